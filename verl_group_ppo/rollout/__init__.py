"""The ``hf`` rollout: verl's rollout interfaces served by a Hugging Face model, on the trainer's device.

``actor_rollout_ref.rollout.name=hf`` selects it on CPU (under the CPU backend, :mod:`verl_group_ppo.cpu`) and on
CUDA alike. The plugin registers it by name on every platform (:func:`register_hf_adapter`,
:func:`register_hf_replica`, called by :mod:`verl_group_ppo.integration.entry_point` when verl imports its
rollout registries); nothing of the rollout itself is imported unless a run selects it. This module imports
only the standard library.

verl's rollout has three parts, one module each:

* :mod:`~verl_group_ppo.rollout.replica`: :class:`~verl_group_ppo.rollout.replica.HFRolloutReplica` (a
  ``RolloutReplica``) starts one server Ray actor per replica on the device kind the trainer uses.
* :mod:`~verl_group_ppo.rollout.server`: :class:`~verl_group_ppo.rollout.server.HFRolloutServer` (a Ray actor)
  gathers the agent loop's concurrent token-in/token-out ``generate`` calls into batches, pauses and resumes
  for verl's partial rollout, and takes the actor's weights.
* :mod:`~verl_group_ppo.rollout.adapter`: :class:`~verl_group_ppo.rollout.adapter.HFRolloutAdapter` (a
  ``BaseRollout``) lives in the actor worker and forwards the actor's weights to its replica's server.

What they use: :mod:`~verl_group_ppo.rollout.requests` turns a ``generate`` call's sampling parameters into a
request, :mod:`~verl_group_ppo.rollout.model` loads the served model and picks its device, and
:mod:`~verl_group_ppo.rollout.generation` samples a batch of requests with the model's KV cache, and
:mod:`~verl_group_ppo.rollout.prefix_cache` keeps finished replies' keys and values for requests that continue them.
:mod:`~verl_group_ppo.rollout.sampler` is verl's replay buffer with a short poll interval, for trainer steps of a
few seconds (any rollout).
"""

from __future__ import annotations

import importlib
from types import ModuleType

HF_ROLLOUT_NAME = "hf"
"""The value of ``actor_rollout_ref.rollout.name`` that selects this rollout."""

ADAPTER_PATH = "verl_group_ppo.rollout.adapter.HFRolloutAdapter"
"""Where verl's ``get_rollout_class`` imports the rollout adapter from."""

REPLICA_MODULE = "verl_group_ppo.rollout.replica"
"""The module of :class:`~verl_group_ppo.rollout.replica.HFRolloutReplica`, imported when verl asks for it."""


def register_hf_adapter(rollout_base: ModuleType) -> None:
    """Name the ``hf`` adapter in ``verl.workers.rollout.base._ROLLOUT_REGISTRY`` (a dotted path: verl imports
    the module only when a run uses it). Idempotent; ``rollout_base`` is that verl module."""
    rollout_base._ROLLOUT_REGISTRY[(HF_ROLLOUT_NAME, "async")] = ADAPTER_PATH


def register_hf_replica(rollout_replica: ModuleType) -> None:
    """Register the ``hf`` replica loader in ``verl.workers.rollout.replica.RolloutReplicaRegistry`` without
    importing the rollout (a Ray actor that unpickles the rollout server imports it first, and verl's plugin
    load inside that import must not need it). Idempotent; ``rollout_replica`` is that verl module."""
    rollout_replica.RolloutReplicaRegistry.register(HF_ROLLOUT_NAME, load_hf_replica)


def load_hf_replica() -> type:
    """The ``hf`` replica class (verl calls this when ``rollout.name=hf``)."""
    return importlib.import_module(REPLICA_MODULE).HFRolloutReplica
