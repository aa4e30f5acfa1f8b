#!/usr/bin/env bash
# GROUP-PPO with Monte Carlo boundary values (value_source=mc, no critic) on GSM8K with Qwen2.5-7B-Instruct
# (1 node x 8 GPUs), vLLM rollout. Differs from run_qwen2_5-7b_gsm8k.sh only in the group_ppo_mc keys of common.sh.
# Usage: bash examples/group_ppo_trainer/run_qwen2_5-7b_gsm8k_mc.sh [extra Hydra overrides...]
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/common.sh" 7b group_ppo_mc "$@"
