#!/usr/bin/env bash
# GROUP-PPO over a tree rollout (a prompt's 8 replies sampled as one tree, prefix_tree values, groups = the tree's
# segments, no critic) on GSM8K with Qwen2.5-0.5B-Instruct (1 node x 2 GPUs), vLLM rollout. Differs from
# run_qwen2_5-0.5b_gsm8k.sh only in the group_ppo_tree keys of common.sh.
# Usage: bash examples/group_ppo_trainer/run_qwen2_5-0.5b_gsm8k_tree.sh [extra Hydra overrides...]
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/common.sh" 0.5b group_ppo_tree "$@"
