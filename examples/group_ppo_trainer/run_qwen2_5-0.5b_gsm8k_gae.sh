#!/usr/bin/env bash
# Baseline: PPO with token-level GAE, Qwen2.5-0.5B-Instruct on GSM8K (1 node x 2 GPUs).
# Differs from run_qwen2_5-0.5b_gsm8k.sh (GROUP-PPO) only in: algorithm.adv_estimator=gae and no
# algorithm.group_params. Critic, KL (none), batch sizes and everything else are the same.
# Usage: bash examples/group_ppo_trainer/run_qwen2_5-0.5b_gsm8k_gae.sh [extra Hydra overrides...]
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/common.sh" 0.5b gae "$@"
