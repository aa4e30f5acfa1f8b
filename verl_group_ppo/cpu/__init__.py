"""A CPU backend for verl's ``python -m verl.trainer.main_ppo``, active only when ``VERL_PLATFORM=cpu``.

One switch: ``VERL_PLATFORM=cpu`` in the environment of the launching process. verl-group-ppo's plugin
(loaded by ``import verl`` in the driver and in every Ray worker) calls :func:`install_if_requested`,
which then installs, in that process:

* the ``cpu`` platform (:mod:`~verl_group_ppo.cpu.platform`), and ``VERL_ENGINE_DEVICE=cuda`` so that
  verl's engine lookup picks its FSDP engines (FSDP1 and FSDP2 run over gloo on CPU);
* the gloo backend-string fix (:mod:`~verl_group_ppo.cpu.distributed`);
* what verl's ``fsdp`` strategy (torch FSDP1) needs on CPU ranks: ``sync_module_states`` over gloo, and
  parameter loads and offloads that leave host tensors in place (:mod:`~verl_group_ppo.cpu.fsdp1`);
* verl's own vLLM rollout on vLLM's CPU build, ``actor_rollout_ref.rollout.name=vllm``
  (:mod:`~verl_group_ppo.cpu.vllm_rollout`; its driver-side start-up checks :mod:`~verl_group_ppo.cpu.vllm_checks`,
  its server and worker extension :mod:`~verl_group_ppo.cpu.vllm_server`, :mod:`~verl_group_ppo.cpu.vllm_worker`,
  what they share :mod:`~verl_group_ppo.cpu.vllm_common`).

For verl's ``separate_async`` trainer, :mod:`~verl_group_ppo.cpu.checkpoint` adds a checkpoint engine that
moves weights through Ray's object store (selected by two overrides; see that module).

One part of this package serves every platform, and the plugin installs it whatever ``VERL_PLATFORM``
says (:mod:`verl_group_ppo.integration.entry_point`) when verl imports ``verl.utils.model``: a critic
value-model loader that uses the configured attention instead of flash-attn (:mod:`~verl_group_ppo.cpu.valuehead`).
The ``hf`` rollout, ``actor_rollout_ref.rollout.name=hf``, which a CPU run generates with, is its own package
(:mod:`verl_group_ppo.rollout`): it runs on CPU and CUDA alike.

Without ``VERL_PLATFORM=cpu`` the backend itself does nothing: no import beyond the standard library, no
change to verl or to the environment. The backend is independent of the advantage estimator (gae, grpo,
group_ppo, ...). The Hydra overrides a CPU run still needs (logical GPUs for Ray, sdpa attention,
float32, ...) are listed in ``docs/cpu.md``.
"""

from __future__ import annotations

import logging
import os
import sys

PLATFORM_ENV = "VERL_PLATFORM"
"""The environment variable verl reads to pick its platform; ``cpu`` turns this backend on."""

logger = logging.getLogger("verl_group_ppo.cpu")

_installed = False


class CPUBackendError(RuntimeError):
    """``VERL_PLATFORM=cpu`` was requested but the CPU backend could not be installed."""


def is_requested() -> bool:
    """True when ``VERL_PLATFORM`` (case and surrounding spaces ignored, as verl does) is ``cpu``."""
    return os.environ.get(PLATFORM_ENV, "").strip().lower() == "cpu"


def install_if_requested() -> bool:
    """Install the CPU backend in this process if ``VERL_PLATFORM=cpu``; return whether it is installed.

    Idempotent. Raises :class:`CPUBackendError` (after logging it at ERROR) when the backend was requested
    and an install step failed.
    """
    global _installed
    if not is_requested():
        return False
    if _installed:
        return True
    try:
        _install()
    except Exception as exc:  # noqa: BLE001 - re-raised with the step that failed
        logger.error("verl-group-ppo cpu backend: install failed (VERL_PLATFORM=cpu): %s: %s",
                     type(exc).__name__, exc, exc_info=exc)
        raise CPUBackendError(f"VERL_PLATFORM=cpu: the verl-group-ppo CPU backend failed to install: "
                              f"{type(exc).__name__}: {exc}") from exc
    _installed = True
    return True


def _install() -> None:
    """Each install step, in the order verl needs them (the platform before anything resolves it)."""
    from verl_group_ppo.cpu import distributed, fsdp1, platform, valuehead, vllm_rollout

    platform.register_cpu_platform()
    platform.check_active_platform()
    platform.select_fsdp_engine()
    distributed.patch_init_process_group()
    fsdp1.patch_fsdp1()
    valuehead.patch_valuehead_loader()
    vllm_rollout.register_vllm_rollout()


if is_requested() and "verl" not in sys.modules:
    # A process whose first verl import would come from inside one of this package's modules: import verl now,
    # so that its plugin load installs the backend before any module of the package starts executing.
    import verl  # noqa: E402, F401
