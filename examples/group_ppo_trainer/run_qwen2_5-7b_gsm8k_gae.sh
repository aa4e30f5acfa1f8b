#!/usr/bin/env bash
# Baseline: PPO with token-level GAE, Qwen2.5-7B-Instruct on GSM8K (1 node x 8 GPUs).
# Differs from run_qwen2_5-7b_gsm8k.sh (GROUP-PPO) only in: algorithm.adv_estimator=gae and no
# algorithm.group_params. Critic, KL (none), batch sizes and everything else are the same.
# Usage: bash examples/group_ppo_trainer/run_qwen2_5-7b_gsm8k_gae.sh [extra Hydra overrides...]
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/common.sh" 7b gae "$@"
