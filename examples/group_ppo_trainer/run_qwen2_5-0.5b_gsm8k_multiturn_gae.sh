#!/usr/bin/env bash
# PPO (verl's GAE, baseline) on GSM8K with tool calling: Qwen2.5-0.5B-Instruct (1 node x 2 GPUs), vLLM rollout, verl's tool agent loop
# with the calculate tool (calculator_tool.py) in verl's hermes format. Data: examples/data_preprocess/gsm8k.py
# --multi-turn. Every setting is in common.sh (MULTI_TURN=1).
# Usage: bash examples/group_ppo_trainer/run_qwen2_5-0.5b_gsm8k_multiturn_gae.sh [extra Hydra overrides...]
set -euo pipefail
MULTI_TURN=1 exec bash "$(dirname "${BASH_SOURCE[0]}")/common.sh" 0.5b gae "$@"
