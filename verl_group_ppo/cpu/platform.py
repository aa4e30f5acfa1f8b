"""The ``cpu`` platform for verl's platform registry (``verl.plugin.platform``).

verl resolves one platform per process (``VERL_PLATFORM`` names it) and routes every device call through
it: ``verl.utils.device.get_torch_device()`` returns the platform's ``device_module``, the process group's
backend comes from ``communication_backend_name()``, and Ray resource pools ask ``ray_resource_name()``.
verl 0.9.1 ships ``nvidia``, ``npu`` and ``rocm`` only. This module adds ``cpu``:

* device ``"cpu"``, collective backend ``gloo``;
* Ray resource ``"GPU"``: verl's resource pools count only accelerators, so a CPU run declares logical
  GPUs (``ray_init.num_gpus=N``, ``trainer.n_gpus_per_node=N``), one per training rank;
* a device module (:data:`CPU_DEVICE_MODULE`) with the ``torch.cuda``-style calls verl makes, each
  answered the CPU way (caches and streams are no-ops, memory figures come from the host).
"""

from __future__ import annotations

import contextlib
import os
import types
from typing import Any, Callable, Iterator, Optional

import torch

from verl.plugin.platform import PlatformBase, PlatformRegistry

PLATFORM_NAME = "cpu"
"""The value of ``VERL_PLATFORM`` that selects this platform."""

ENGINE_DEVICE_ENV = "VERL_ENGINE_DEVICE"
"""verl's override for the device key of its training-engine lookup (``EngineRegistry.get_engine_cls``)."""

FSDP_ENGINE_DEVICE = "cuda"
"""The device key verl registers its FSDP engines under (also valid on CPU: FSDP2 runs over gloo)."""


def _host_memory() -> tuple[int, int]:
    """(available, total) host memory in bytes, the CPU answer to ``torch.cuda.mem_get_info``."""
    try:
        import psutil
    except ImportError:  # psutil comes with ray; fall back to sysconf on the odd install without it
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    memory = psutil.virtual_memory()
    return int(memory.available), int(memory.total)


def _returns(value: Any) -> Callable[..., Any]:
    """A function that ignores its arguments and returns ``value``."""

    def constant(*args: Any, **kwargs: Any) -> Any:
        return value

    return constant


def _seed(seed: int, *args: Any, **kwargs: Any) -> None:
    """Seed torch's (CPU) generator."""
    torch.manual_seed(seed)


def _build_device_module() -> types.ModuleType:
    """The ``torch.cuda`` stand-in verl gets from ``get_torch_device()`` on the cpu platform.

    It holds exactly the calls verl 0.9.1 makes on its device module; an attribute not listed here
    raises ``AttributeError`` naming it (a call verl started making that needs a CPU answer).
    """
    module = types.ModuleType("verl_group_ppo.cpu.device", "torch.cuda-style device calls answered on CPU")
    for name in ("Event", "Stream", "current_stream", "stream", "synchronize", "is_available", "device_count"):
        setattr(module, name, getattr(torch.cpu, name))
    noop = _returns(None)
    for name in ("empty_cache", "ipc_collect", "set_device", "set_per_process_memory_fraction",
                 "reset_peak_memory_stats", "reset_accumulated_memory_stats"):
        setattr(module, name, noop)
    zero = _returns(0)
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(module, name, zero)
    module.current_device = _returns("cpu")  # verl passes it to tensor.to(device=...): an int means an accelerator
    module.get_device_name = _returns("CPU")  # verl/utils/flops_counter.py matches names against a table
    module.memory_stats = lambda *args, **kwargs: {}
    module.mem_get_info = lambda *args, **kwargs: _host_memory()
    module.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    module.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    module.manual_seed = _seed
    module.manual_seed_all = _seed
    return module


CPU_DEVICE_MODULE = _build_device_module()


class CPUPlatform(PlatformBase):
    """verl platform for a machine without accelerators: torch on CPU, gloo collectives."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return CPU_DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        """Never auto-detected: the cpu platform is used only when ``VERL_PLATFORM=cpu`` asks for it."""
        return False

    def current_device(self) -> str:  # type: ignore[override]
        """``"cpu"``: verl uses the answer as a torch device (``module.to(device=get_device_id())``),
        where an integer would name an accelerator."""
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        """``"GPU"``: verl's resource pools count GPUs/NPUs only, so CPU ranks run on declared logical GPUs."""
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def rollout_env_vars(self) -> dict[str, str]:
        """The environment of verl's rollout servers (``vLLMReplica`` passes it to each server's Ray actor): vLLM's
        CPU platform, KV-cache size and thread binding (:data:`verl_group_ppo.cpu.vllm_rollout.ENGINE_ENV_DEFAULTS`)."""
        from verl_group_ppo.cpu.vllm_rollout import engine_env_vars

        return {**super().rollout_env_vars(), **engine_env_vars()}

    def cudart(self) -> Any:
        return None


def register_cpu_platform() -> None:
    """Register :class:`CPUPlatform` as verl platform ``cpu`` (idempotent)."""
    if PlatformRegistry.get(PLATFORM_NAME) is not CPUPlatform:
        PlatformRegistry.register(PLATFORM_NAME)(CPUPlatform)


def check_active_platform() -> None:
    """Raise ``RuntimeError`` unless verl's platform singleton in this process is the cpu platform.

    ``get_platform()`` resolves (and caches) the singleton from ``VERL_PLATFORM``; a process that resolved
    another platform before the cpu backend was installed would run every device call on the wrong one.
    """
    from verl.plugin.platform import get_platform

    platform = get_platform()
    if not isinstance(platform, CPUPlatform):
        raise RuntimeError(
            f"VERL_PLATFORM=cpu was requested but verl's platform in this process is "
            f"{type(platform).__name__} (device {platform.device_name!r}): it was resolved before the "
            "verl-group-ppo cpu backend was installed.")


def select_fsdp_engine() -> None:
    """Make verl's engine lookup pick the FSDP engines, which verl registers for cuda/npu only.

    Sets ``VERL_ENGINE_DEVICE=cuda`` in this process's environment (read by
    ``EngineRegistry.get_engine_cls`` at lookup time; Ray workers started after this inherit it, and every
    worker runs the backend's install anyway). A value the user set is kept, with no change.
    """
    os.environ.setdefault(ENGINE_DEVICE_ENV, FSDP_ENGINE_DEVICE)
