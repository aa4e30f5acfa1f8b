#!/usr/bin/env bash
# Baseline: GRPO, Qwen2.5-3B-Instruct on GSM8K (1 node x 8 GPUs).
# Differs from run_qwen2_5-3b_gsm8k.sh (GROUP-PPO) only in: algorithm.adv_estimator=grpo,
# no algorithm.group_params, no critic (critic.enable=False), and KL to the reference policy
# as a loss (actor_rollout_ref.actor.use_kl_loss=True, kl_loss_coef=0.001,
# kl_loss_type=low_var_kl). Same n responses per prompt, batch sizes and everything else.
# Usage: bash examples/group_ppo_trainer/run_qwen2_5-3b_gsm8k_grpo.sh [extra Hydra overrides...]
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/common.sh" 3b grpo "$@"
