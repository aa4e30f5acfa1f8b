#!/usr/bin/env bash
# GRPO (verl's group-normalised outcome advantage, no critic) on the two-way maths task: DeepMind's True/False and
# which-is-bigger questions answered by SmolLM2-135M-Instruct (the default model: 4-bit GGUF weights, converted once),
# verl's real main_ppo on CPU, validated before training and after the last step. It measures the answer format.
# Every setting is in common.sh (TASK=twoway; environment: WORK_DIR, PYTHON; see there); docs/mathtask.md.
# Usage: bash examples/cpu/run_twoway_grpo.sh [extra Hydra overrides...]
set -euo pipefail
TASK=twoway exec bash "$(dirname "${BASH_SOURCE[0]}")/common.sh" grpo "$@"
