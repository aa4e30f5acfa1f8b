"""The weight sync of verl's vLLM rollout on vLLM's CPU build: each update loaded inside vLLM's layerwise reload.

vLLM's CPU linear layers prepack their weights once loaded and drop the ``weight`` parameter
(``dispatch_cpu_unquantized_gemm(..., remove_weight=True)``), so verl's worker-side ``model.load_weights(...)``
finds no weight loader for them ("'Parameter' object has no attribute 'weight_loader'").
:class:`CPUvLLMWorkerExtension` is verl's worker extension (``vLLMColocateWorkerExtension``) with its
``update_weights_from_ipc`` run between ``initialize_layerwise_reload(model)`` and
``finalize_layerwise_reload(model, model_config)`` (``vllm.model_executor.model_loader.reload``, the API vLLM
keeps for RL weight updates): the layers get their loadable parameters back, verl's buckets load into them,
and each layer is processed (prepacked) again once all of its weights arrived.

Layerwise reload holds on to the tensors of a layer until the layer is complete, and verl's receiver hands
over views into one reused transfer buffer: a layer whose weights span two buckets would be built from the
next bucket's bytes. So each bucket's tensors are copied before they are loaded (``_update_weights``); the
weight-sync test (tests/test_cpu_vllm.py) sends several buckets and fails without the copy.

This module is imported inside vLLM's worker process (vLLM's ``worker_extension_cls``), and by the driver's
start-up checks (:mod:`.vllm_checks`), which check the verl methods it overrides before Ray starts.
"""

from __future__ import annotations

from typing import Any

from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from verl_group_ppo.cpu.vllm_common import MODELS_METHOD


class CPUvLLMWorkerExtension(vLLMColocateWorkerExtension):
    """verl's vLLM worker extension, loading full-weight updates inside vLLM's layerwise reload."""

    def update_weights_from_ipc(self, peft_config: dict = None, base_sync_done: bool = False,
                                use_shm: bool = False) -> None:
        if peft_config and base_sync_done:  # LoRA adapter weights: vLLM's add_lora, no layer is reloaded
            return super().update_weights_from_ipc(peft_config=peft_config, base_sync_done=base_sync_done,
                                                   use_shm=use_shm)
        models = list(getattr(self, MODELS_METHOD)())
        for model, _ in models:
            initialize_layerwise_reload(model)
        self._verl_group_ppo_reloading = True
        try:
            super().update_weights_from_ipc(peft_config=peft_config, base_sync_done=base_sync_done, use_shm=use_shm)
        finally:
            self._verl_group_ppo_reloading = False
            for model, model_config in models:
                finalize_layerwise_reload(model, model_config)

    def _update_weights(self, weights: list, peft_config: dict, base_sync_done: bool) -> None:
        if getattr(self, "_verl_group_ppo_reloading", False):
            # own copies: layerwise reload keeps them past this bucket, the receiver reuses its buffer
            weights = [(name, tensor.clone()) for name, tensor in weights]
        return super()._update_weights(weights, peft_config, base_sync_done)
