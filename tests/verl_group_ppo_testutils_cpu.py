"""Test helpers for the CPU backend: a tiny random Qwen2 causal LM (built locally, nothing downloaded) and a
fresh-interpreter runner.

Imported by its unique module name (see conftest.py), never as ``tests.<name>``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

EOS_ID = 1
PAD_ID = 0
VOCAB = 64


def tiny_qwen2(seed: int = 0, tie_word_embeddings: bool = False) -> Any:
    """A random float32 Qwen2ForCausalLM (2 layers, hidden 32, vocab 64; EOS 1, pad 0) in eval mode."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=tie_word_embeddings, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
                         attn_implementation="sdpa")
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def save_tiny_qwen2(directory: str, seed: int = 0) -> Any:
    """Save :func:`tiny_qwen2` to ``directory`` (with its generation config) and return the model."""
    model = tiny_qwen2(seed)
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = PAD_ID
    model.save_pretrained(directory)
    return model


def run_python(code: str, platform: str | None, timeout: float = 300) -> dict:
    """Run ``code`` in a fresh interpreter with this checkout first on ``PYTHONPATH`` and ``VERL_PLATFORM``
    set to ``platform`` (removed when None); return the JSON object the code printed on its last line."""
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_PLATFORM", "VERL_ENGINE_DEVICE")}
    env["PYTHONPATH"] = os.pathsep.join([REPO_ROOT] + [p for p in [env.get("PYTHONPATH")] if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    if platform is not None:
        env["VERL_PLATFORM"] = platform
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=REPO_ROOT)
    assert done.returncode == 0, f"subprocess failed (rc={done.returncode}):\n{done.stderr[-4000:]}"
    return json.loads(done.stdout.strip().splitlines()[-1])
