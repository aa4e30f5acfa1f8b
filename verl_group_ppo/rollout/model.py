"""The served model: the device a replica's server generates on, the causal LM it loads, its EOS and pad ids.

On CUDA the server reserves no GPU from Ray (the trainer's placement groups hold them all) and generates on
GPU ``replica_rank % device_count`` (:func:`server_device`); it sees the GPUs because Ray leaves
``CUDA_VISIBLE_DEVICES`` alone for an actor with ``num_gpus=0`` unless ``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1``.
"""

from __future__ import annotations

from typing import Any

import torch

from verl_group_ppo.rollout.requests import config_value


def server_device(device_type: str, replica_rank: int, device_count: int) -> torch.device:
    """The device a replica's server generates on: ``cpu``, or accelerator ``replica_rank % device_count``
    of kind ``device_type`` (``cuda``, ``npu``, ...). Raises ``RuntimeError`` when an accelerator kind is
    asked for and the server's process sees none."""
    if device_type == "cpu":
        return torch.device("cpu")
    if device_count < 1:
        raise RuntimeError(f"hf rollout: the trainer runs on {device_type!r} but the rollout server's process sees "
                           f"no {device_type} device (is RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1 or "
                           f"CUDA_VISIBLE_DEVICES empty in the Ray workers' environment?)")
    return torch.device(device_type, replica_rank % device_count)


def visible_device_count(device_type: str) -> int:
    """How many devices of kind ``device_type`` this process sees (0 for ``cpu`` or an unknown kind)."""
    module = getattr(torch, device_type, None) if device_type != "cpu" else None
    if module is None or not module.is_available():
        return 0
    return int(module.device_count())


def trainer_device_type() -> str:
    """The device kind the trainer runs on, as verl resolves it in this process (``cpu``, ``cuda``, ...)."""
    from verl.utils.device import get_device_name

    return str(get_device_name())


def model_attention(model_config: Any) -> str:
    """The attention implementation configured for the actor model (``override_config.attn_implementation``),
    ``sdpa`` when none is configured; raises ``ValueError`` for flash-attn without the package."""
    from verl_group_ppo.cpu.valuehead import check_attention_available

    attention = config_value(config_value(model_config, "override_config", {}), "attn_implementation", "sdpa")
    check_attention_available(str(attention))
    return str(attention)


def load_causal_lm(model_config: Any) -> Any:
    """The actor's HF causal LM in float32 on the CPU (the server moves it to its device), in eval mode, from
    ``model_config.path``."""
    from transformers import AutoModelForCausalLM

    from verl.utils.fs import copy_to_local

    path = copy_to_local(str(config_value(model_config, "local_path") or config_value(model_config, "path")))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=model_attention(
        model_config), trust_remote_code=bool(config_value(model_config, "trust_remote_code", False)))
    return model.eval()


def eos_and_pad(model: Any) -> tuple[list[int], int]:
    """(EOS token ids, pad token id) from the model's generation config, then its config (a response stops
    at any of the EOS ids, as vLLM stops at the generation config's ``eos_token_id``)."""
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = model.config.eos_token_id
    eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.config.pad_token_id
    return eos_ids, int(pad if pad is not None else (eos_ids[0] if eos_ids else 0))

