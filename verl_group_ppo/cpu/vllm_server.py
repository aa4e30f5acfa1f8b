"""verl's vLLM replica and server for the CPU backend (``rollout.name=vllm``; :mod:`.vllm_rollout` says why).

:class:`CPUvLLMHttpServer` is verl's ``vLLMHttpServer`` with three of its subclass hooks overridden:
``_init_config`` refuses a config without :data:`.vllm_common.ROLLOUT_SETTINGS` (no sleep mode, no freed cache,
eager; set in the driver, the server's config is frozen), ``_validate_configs`` refuses a model whose attention
head size vLLM's CPU attention does not serve (before the engine starts), and ``_get_worker_extension_cls`` names
:data:`WORKER_EXTENSION` (the weight sync through vLLM's layerwise reload). :class:`CPUvLLMReplica` is verl's
``vLLMReplica`` starting that server. The driver checks the verl hooks all of this builds on before Ray starts
(:mod:`.vllm_checks`).
"""

from __future__ import annotations

from typing import Any

import ray

from verl.workers.rollout.vllm_rollout import vllm_async_server as server_module
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

from verl_group_ppo.cpu.vllm_common import ROLLOUT_SETTINGS, attention_head_size, check_cpu_attention_head_size

WORKER_EXTENSION = "verl_group_ppo.cpu.vllm_worker.CPUvLLMWorkerExtension"
"""vLLM's ``worker_extension_cls`` on the CPU backend (:mod:`.vllm_worker`; vLLM's engine process imports it)."""


class CPUvLLMHttpServer(server_module.vLLMHttpServer):
    """verl's vLLM server with the CPU worker extension; refuses a config without the CPU rollout settings."""

    def _init_config(self, config: Any) -> Any:
        config = super()._init_config(config)
        wrong = {key: getattr(config, key, None) for key, value in ROLLOUT_SETTINGS.items()
                 if getattr(config, key, None) != value}
        if wrong:  # verl's RolloutConfig is frozen here: the settings are made in the driver (auto_set_device)
            raise RuntimeError(
                f"rollout.name=vllm on the CPU backend needs actor_rollout_ref.rollout settings {ROLLOUT_SETTINGS}, "
                f"got {wrong}: the backend sets them in verl.utils.device.auto_set_device, which main_ppo calls; "
                "an entry point that skips it must set them itself")
        return config

    def _validate_configs(self) -> None:
        super()._validate_configs()
        check_cpu_attention_head_size(attention_head_size(self.model_config.hf_config),
                                      CPUAttentionBackend.get_supported_head_sizes(), self.model_config.local_path)

    def _get_worker_extension_cls(self) -> str:
        return WORKER_EXTENSION


class CPUvLLMReplica(server_module.vLLMReplica):
    """verl's vLLM replica, starting :class:`CPUvLLMHttpServer` actors."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(CPUvLLMHttpServer)
