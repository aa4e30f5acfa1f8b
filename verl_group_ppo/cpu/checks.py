"""The plugin's start-up checks of the CPU backend's side of a run, run in front of verl's ``validate_config``
(:func:`verl_group_ppo.integration.startup.make_validate_config`) for ``group_ppo`` runs before Ray starts.

* :func:`check_accelerator`: refuse to start Ray where verl would wait for GPUs forever (no accelerator visible,
  the CPU backend not selected, no cluster to join);
* :func:`check_cpu_sequence_parallel`: refuse Ulysses sequence parallelism on the CPU backend, where verl's head
  exchange does not run and each rank would attend over its own slice only.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping, Optional

from verl_group_ppo.config import select
from verl_group_ppo.cpu import PLATFORM_ENV as CPU_BACKEND_ENV
from verl_group_ppo.integration import ESTIMATOR_NAME

#: The Hydra override that makes verl's ``ray.init`` join a running cluster: verl's ppo_trainer config has no
#: ``ray_kwargs.ray_init.address`` key, so the override adds it with ``+``.
RAY_ADDRESS_OVERRIDE = "+ray_kwargs.ray_init.address"


def check_accelerator(config: Any, environ: Optional[Mapping[str, str]] = None,
                      accelerator_visible: Optional[Callable[[], bool]] = None) -> None:
    """Refuse to start Ray on a machine where verl would wait for GPUs forever.

    Passes when the CPU backend is selected (``VERL_PLATFORM=cpu``), when Ray joins an existing cluster
    (``RAY_ADDRESS`` or ``+ray_kwargs.ray_init.address=HOST:PORT``: its accelerators may be on other machines), or
    when verl's platform sees an accelerator (``accelerator_visible``, default verl's
    ``is_device_available``). Raises RuntimeError otherwise.
    """
    environ = os.environ if environ is None else environ
    if environ.get(CPU_BACKEND_ENV, "").strip().lower() == "cpu":
        return
    if environ.get("RAY_ADDRESS") or select(config, "ray_kwargs.ray_init.address"):
        return
    if (accelerator_visible or _verl_sees_an_accelerator)():
        return
    raise RuntimeError(
        f"algorithm.adv_estimator={ESTIMATOR_NAME}: this machine has no accelerator visible to verl and verl's CPU "
        f"backend is not selected, so Ray would wait for trainer.n_gpus_per_node="
        f"{select(config, 'trainer.n_gpus_per_node', '?')} GPUs forever. Run on a machine with a GPU, join a "
        f"Ray cluster that has them (RAY_ADDRESS=HOST:PORT or {RAY_ADDRESS_OVERRIDE}=HOST:PORT), or select "
        f"the CPU backend with the environment variable {CPU_BACKEND_ENV}=cpu (see docs/cpu.md).")


#: The keys that turn on verl's Ulysses sequence parallelism (the engine reads the actor's, ref's and critic's).
ULYSSES_KEYS = (
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
    "actor_rollout_ref.ref.fsdp_config.ulysses_sequence_parallel_size",
    "critic.ulysses_sequence_parallel_size",
    "critic.fsdp.ulysses_sequence_parallel_size",
)


def uses_cpu_backend(config: Any, environ: Optional[Mapping[str, str]] = None) -> bool:
    """True when the run selects verl's CPU device (``trainer.device=cpu`` or ``VERL_PLATFORM=cpu``)."""
    environ = os.environ if environ is None else environ
    device = str(select(config, "trainer.device", "") or "").strip().lower()
    return device == "cpu" or environ.get(CPU_BACKEND_ENV, "").strip().lower() == "cpu"


def check_cpu_sequence_parallel(config: Any, environ: Optional[Mapping[str, str]] = None) -> None:
    """Refuse Ulysses sequence parallelism (any of :data:`ULYSSES_KEYS` above 1) on the CPU backend (ValueError).

    verl splits each sequence across the sequence-parallel ranks and exchanges attention heads with an
    all-to-all placed around transformers' flash-attention function (``_ulysses_flash_attention_forward`` in
    ``verl.models.transformers.monkey_patch``). flash-attn needs CUDA, so on CPU the model attends with SDPA,
    which verl does not patch: each rank would attend over its own slice of the sequence only, and the run would
    train on wrong log-probs and values without an error.
    """
    if not uses_cpu_backend(config, environ):
        return
    for key in ULYSSES_KEYS:
        size = select(config, key, 1)
        if size is not None and int(size) > 1:
            raise ValueError(
                f"{key}={size}: Ulysses sequence parallelism does not run on verl's CPU backend (trainer.device=cpu / "
                f"{CPU_BACKEND_ENV}=cpu). verl exchanges attention heads inside transformers' flash-attention path, "
                "and flash-attn needs CUDA; with SDPA on CPU each rank would attend over its own slice of the "
                "sequence only. Set it to 1 on CPU (use it on GPUs with flash_attention_2).")


def _verl_sees_an_accelerator() -> bool:
    from verl.utils.device import is_device_available

    return bool(is_device_available())
