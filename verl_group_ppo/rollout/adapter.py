"""The ``hf`` rollout's adapter in the actor worker: verl's ``BaseRollout``, which forwards the actor's weights.

verl's "naive" weight sync hands the adapter the actor's full tensors; the leader rank of each replica sends them,
in buckets, to its replica's server (:meth:`~verl_group_ppo.rollout.server.HFRolloutServer.load_weights`), which
copies them into its model and checks that every parameter was received.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, AsyncIterator, Iterable, Union

import ray
import torch

from verl.workers.rollout.base import BaseRollout
from verl_group_ppo.rollout.server import server_actor_name

WEIGHT_BUCKET_BYTES = 256 << 20
"""Weight sync sends the actor's tensors to the server in buckets of about this many bytes."""


async def _iterate(weights: Union[Iterable, AsyncIterator]) -> AsyncIterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from a sync or async iterable."""
    if inspect.isasyncgen(weights) or hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


def _buckets_sizes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class HFRolloutAdapter(BaseRollout):
    """verl's ``BaseRollout`` for the ``hf`` rollout: forwards the actor's weights to the replica's server.

    Every rank iterates the weights (the FSDP engine gathers full tensors collectively); the leader rank
    of each replica sends them, in buckets of ``bucket_bytes`` (:data:`WEIGHT_BUCKET_BYTES`), to its server.
    """

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, *args: Any, replica_rank: int = -1,
                 **kwargs: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        world = (self.config.tensor_model_parallel_size * self.config.data_parallel_size
                 * self.config.pipeline_model_parallel_size)
        self.replica_rank = rank // world if replica_rank == -1 else replica_rank
        self.is_leader_rank = rank % world == 0
        self.bucket_bytes = WEIGHT_BUCKET_BYTES
        self._server: Any = None

    async def resume(self, tags: list[str]) -> None:
        return None

    async def release(self) -> None:
        return None

    def server(self) -> Any:
        """The replica's server actor handle (looked up by name once)."""
        if self._server is None:
            self._server = ray.get_actor(server_actor_name(self.replica_rank))
        return self._server

    async def update_weights(self, weights: Any, wire_format: str = "named_tensors", **kwargs: Any) -> None:
        """Send the actor's full tensors to the server (leader rank); other ranks only consume them."""
        if wire_format != "named_tensors":
            raise NotImplementedError(f"the hf rollout takes wire_format='named_tensors' weights, got {wire_format!r}")
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError("the hf rollout does not take LoRA adapter weights; set "
                                      "actor_rollout_ref.model.lora.merge=True")
        bucket: dict[str, torch.Tensor] = {}
        size, steps = 0, kwargs.get("global_steps")
        async for name, tensor in _iterate(weights):
            if not self.is_leader_rank:
                continue
            bucket[name] = tensor.detach().to("cpu", copy=True)
            size += _buckets_sizes(tensor)
            if size >= self.bucket_bytes:
                await self.server().load_weights.remote(bucket, steps, last=False)
                bucket, size = {}, 0
        if self.is_leader_rank:
            await self.server().load_weights.remote(bucket, steps, last=True)
