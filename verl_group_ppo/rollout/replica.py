"""The ``hf`` rollout's replica: verl's ``RolloutReplica`` that starts one server per replica."""

from __future__ import annotations

import ray

from verl.workers.rollout.replica import RolloutReplica
from verl_group_ppo.rollout.model import trainer_device_type
from verl_group_ppo.rollout.server import HFRolloutServer, server_actor_name


class HFRolloutReplica(RolloutReplica):
    """One :class:`HFRolloutServer` per replica; it reserves no accelerator from Ray and generates on the
    trainer's device kind (:func:`trainer_device_type`)."""

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self) -> None:
        """Start the replica's server actor and wait until its model is loaded."""
        name = server_actor_name(self.replica_rank, self.name_suffix)
        server = ray.remote(HFRolloutServer).options(
            name=name, num_cpus=0, max_concurrency=self.max_concurrency,
        ).remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank,
                 device_type=trainer_device_type())
        await server.stats.remote()  # surfaces a failed model load here, not at the first request
        self.servers = [server]
        self._server_handle = server
        self._server_address = name

