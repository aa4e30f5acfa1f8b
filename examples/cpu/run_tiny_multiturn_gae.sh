#!/usr/bin/env bash
# PPO (verl's GAE) on the tiny tool task (chain_sum with a calculator tool) through verl's own tool agent loop:
# verl's real main_ppo on CPU with multi_turn.enable, tool replies masked in the response. Every setting is in
# common.sh (MULTI_TURN=1; environment: WORK_DIR, PYTHON; see there).
# Usage: bash examples/cpu/run_tiny_multiturn_gae.sh [extra Hydra overrides...]
set -euo pipefail
MULTI_TURN=1 exec bash "$(dirname "${BASH_SOURCE[0]}")/common.sh" gae "$@"
