"""A checkpoint engine that moves the actor's weights to rollout workers through Ray's object store.

verl's ``separate_async`` trainer refuses the in-process ``naive`` engine, and every other engine verl ships
(nccl, nixl, hccl, mooncake, kimi, delta_sharded) needs a GPU transport. This one works anywhere Ray does:
the actor's rank 0 puts the weights, in buckets of ``bucket_size`` bytes, into the object store and hands
the references to a named mailbox actor; each rollout worker takes the references for the same
``global_steps`` from the mailbox and yields the tensors to its rollout adapter.

Select it with ``actor_rollout_ref.rollout.checkpoint_engine.backend=ray_object_store`` and
``actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module=verl_group_ppo.cpu.checkpoint`` (verl
imports that module in every process that builds a checkpoint engine, which registers the engine).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Optional

import ray
import torch

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl.workers.rollout.utils import ensure_async_iterator

BACKEND = "ray_object_store"
"""The value of ``actor_rollout_ref.rollout.checkpoint_engine.backend`` that selects this engine."""

MAILBOX_NAME = "verl_group_ppo_cpu_weight_mailbox"


class WeightMailbox:
    """A Ray actor holding the object references of the latest weights, keyed by ``global_steps``."""

    def __init__(self) -> None:
        self._version: Any = None
        self._refs: Optional[list] = None
        self._changed: Optional[asyncio.Condition] = None

    def _condition(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def put(self, version: Any, refs: list) -> None:
        """Publish the bucket references of weights ``version`` (replacing older ones)."""
        async with self._condition():
            self._version, self._refs = version, refs
            self._condition().notify_all()

    async def get(self, version: Any) -> list:
        """The bucket references of weights ``version``, once they are published."""
        async with self._condition():
            await self._condition().wait_for(lambda: self._refs is not None and self._version == version)
            return self._refs


def _mailbox() -> Any:
    """The mailbox actor (created by whichever side asks first)."""
    return ray.remote(WeightMailbox).options(name=MAILBOX_NAME, get_if_exists=True, num_cpus=0).remote()


@CheckpointEngineRegistry.register(BACKEND)
class RayObjectStoreCheckpointEngine(CheckpointEngine):
    """Weights from the actor's rank 0 to every rollout worker through Ray's object store."""

    def __init__(self, bucket_size: int, is_master: bool = False, **kwargs: Any) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master

    def prepare(self) -> dict[str, Any]:
        return {}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """No process group: every worker only talks to the mailbox."""
        return {}, {}

    def init_process_group(self, **kwargs: Any) -> None:
        return None

    def finalize(self) -> None:
        return None

    async def send_weights(self, weights: Any, global_steps: Optional[int] = None) -> None:
        """Every actor rank consumes ``weights`` (FSDP gathers collectively); rank 0 publishes them."""
        refs, bucket, size = [], {}, 0
        async for name, tensor in ensure_async_iterator(weights):
            if not self.is_master:
                continue
            bucket[name] = tensor.detach().to("cpu", copy=True)
            size += tensor.numel() * tensor.element_size()
            if size >= self.bucket_size:
                refs.append(ray.put(bucket))
                bucket, size = {}, 0
        if self.is_master:
            if bucket:
                refs.append(ray.put(bucket))
            await _mailbox().put.remote(global_steps, refs)

    async def receive_weights(self, global_steps: Optional[int] = None) -> AsyncIterator[tuple[str, torch.Tensor]]:
        """Yield ``(name, tensor)`` of weights ``global_steps`` once the actor has published them."""
        for ref in await _mailbox().get.remote(global_steps):
            bucket = await ref
            for item in bucket.items():
                yield item
