#!/usr/bin/env bash
# PPO with verl's GAE (the critic baseline) on the arithmetic maths task: two- and three-step integer
# questions with free-form answers, each after a worked example, answered by SmolLM2-135M-Instruct (the default
# model: 4-bit GGUF weights, converted once), verl's real main_ppo on CPU, validated on 1024 questions before
# training, in the middle and after the last step, per module.
# Every setting is in common.sh (TASK=arith; environment: WORK_DIR, PYTHON; see there); docs/mathtask.md.
# Usage: bash examples/cpu/run_arith_gae.sh [extra Hydra overrides...]
set -euo pipefail
TASK=arith exec bash "$(dirname "${BASH_SOURCE[0]}")/common.sh" gae "$@"
