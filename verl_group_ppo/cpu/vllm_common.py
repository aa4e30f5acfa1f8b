"""What the three sides of the CPU backend's vLLM rollout share: the driver (:mod:`.vllm_rollout`, :mod:`.vllm_checks`),
the rollout server in its Ray actor (:mod:`.vllm_server`) and the worker extension in vLLM's engine process
(:mod:`.vllm_worker`).

The rollout's name and settings, the verl methods the server and the worker extension build on, and the head sizes
rule of vLLM's CPU attention. This module imports nothing of the package, verl or vLLM, so each side imports it
without reaching back to another.
"""

from __future__ import annotations

from typing import Any, Sequence

VLLM_ROLLOUT_NAME = "vllm"
"""The value of ``actor_rollout_ref.rollout.name`` that selects verl's vLLM rollout."""

ROLLOUT_SETTINGS: dict[str, Any] = {
    "enable_sleep_mode": False,  # vLLM's CPU platform has no sleep mode (it refuses enable_sleep_mode=True)
    "free_cache_engine": False,  # with no sleep mode nothing can be freed between generations
    "enforce_eager": True,  # no torch.compile warm-up (minutes on 2 cores); CUDA graphs do not exist on CPU
}
"""``actor_rollout_ref.rollout.*`` on the CPU backend when ``rollout.name=vllm`` (set whatever the config says)."""

SERVER_HOOKS: dict[str, tuple[str, ...]] = {
    "_init_config": ("config",),  # refuses a config without ROLLOUT_SETTINGS
    "_validate_configs": (),  # refuses a model vLLM's CPU attention cannot serve
    "_get_worker_extension_cls": (),  # names the CPU worker extension
}
"""verl's ``vLLMHttpServer`` methods ``vllm_server.CPUvLLMHttpServer`` overrides, with their arguments after self."""

WORKER_METHODS: dict[str, tuple[str, ...]] = {
    # receives a whole weight update (every bucket): run inside layerwise reload
    "update_weights_from_ipc": ("peft_config", "base_sync_done", "use_shm"),
    # loads one bucket: its tensors are copied first
    "_update_weights": ("weights", "peft_config", "base_sync_done"),
}
"""verl's worker-extension methods ``vllm_worker.CPUvLLMWorkerExtension`` overrides, with their arguments."""

MODELS_METHOD = "_iter_all_models_with_config"
"""verl's worker-extension method yielding ``(model, model_config)`` for every served model."""


def attention_head_size(hf_config: Any) -> int:
    """The attention head size of a Hugging Face model config: ``head_dim`` when set, else hidden / heads."""
    head_dim = getattr(hf_config, "head_dim", None)
    if head_dim:
        return int(head_dim)
    return int(hf_config.hidden_size) // int(hf_config.num_attention_heads)


def check_cpu_attention_head_size(head_size: int, supported: Sequence[int], model_path: str = "") -> None:
    """Raise ValueError, naming the rollout key and the head size, when vLLM's CPU attention (whose head sizes
    are ``supported``) cannot serve the model. vLLM itself accepts such a model at start-up and fails on its
    first generation, inside its engine process; verl then stops later with a replay-buffer error that names
    neither vLLM nor the model."""
    if head_size not in supported:
        raise ValueError(
            f"actor_rollout_ref.rollout.name={VLLM_ROLLOUT_NAME}: the model {model_path or ''} has attention heads of "
            f"{head_size} dimensions, and vLLM's CPU attention serves only {sorted(supported)}; use "
            "actor_rollout_ref.rollout.name=hf for this model, or a model whose hidden size / attention heads is one "
            "of those")
