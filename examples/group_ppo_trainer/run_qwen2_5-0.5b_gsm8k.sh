#!/usr/bin/env bash
# GROUP-PPO on GSM8K with Qwen2.5-0.5B-Instruct (1 node x 2 GPUs), vLLM rollout, critic on.
# Every setting is in common.sh; of algorithm.group_params it sets only what differs from the package defaults.
# Usage: bash examples/group_ppo_trainer/run_qwen2_5-0.5b_gsm8k.sh [extra Hydra overrides...]
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/common.sh" 0.5b group_ppo "$@"
