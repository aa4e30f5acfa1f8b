#!/usr/bin/env bash
# baseline: PPO with token-level GAE on the tiny chain_sum task, verl's real main_ppo on CPU.
# Every setting is in common.sh (environment: WORK_DIR, PYTHON; see there).
# Usage: bash examples/cpu/run_tiny_gae.sh [extra Hydra overrides...]
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/common.sh" gae "$@"
