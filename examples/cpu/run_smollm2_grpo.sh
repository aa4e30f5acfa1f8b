#!/usr/bin/env bash
# GRPO (verl's group-normalised outcome advantage, no critic) on the real-model task: SmolLM2-135M-Instruct (4-bit GGUF weights, converted once) on DeepMind's
# mathematics questions, verl's real main_ppo on CPU, validated before training and after the last step.
# Every setting is in common.sh (TASK=smollm2; environment: WORK_DIR, PYTHON; see there); docs/smollm2.md.
# Usage: bash examples/cpu/run_smollm2_grpo.sh [extra Hydra overrides...]
set -euo pipefail
TASK=smollm2 exec bash "$(dirname "${BASH_SOURCE[0]}")/common.sh" grpo "$@"
