"""verl's ``fsdp`` strategy (torch FSDP1) on CPU ranks over gloo: three GPU-only assumptions answered the CPU way.

verl's FSDP engine wraps with ``FSDP(module, device_id=get_device_id(), sync_module_states=True, ...)``
(``verl/workers/engine/fsdp/transformer_impl.py``, ``_build_fsdp_module``). On the cpu platform ``device_id``
is ``"cpu"``, so FSDP1 keeps the parameters on the host and computes there, and ``sync_module_states``
broadcasts rank 0's weights over the process group, which here is gloo (it broadcasts CPU tensors). Three
things stand in the way, each answered by one patch installed only when ``VERL_PLATFORM=cpu``:

* torch's FSDP1 refuses ``sync_module_states=True`` whenever a parameter or buffer is on CPU
  (``torch/distributed/fsdp/_init_utils.py``, ``_check_module_states_for_sync_module_states``: "The module
  has CPU parameters or buffers when `sync_module_states=True`"), a guard for GPU process groups (NCCL
  cannot broadcast host tensors). :func:`patch_sync_module_states_check` lets CPU states through when the default
  process group broadcasts them with gloo; any other case goes to torch's check unchanged. Without the
  broadcast, ranks other than 0 would train from uninitialised memory (verl builds their model on the meta
  device and materialises it empty).
* verl's ``load_fsdp_model_to_gpu`` (``verl/utils/fsdp_utils.py``), called before every rollout weight sync
  and checkpoint save, moves an FSDP1 module's flat parameters to ``torch.device(f"{device_name}:{device_id}")``,
  which on the cpu platform is ``"cpu:cpu"``, a device string torch rejects. :func:`patch_load_fsdp_model`
  makes the load a no-op for FSDP1 modules on the cpu platform (their flat parameters never leave the host,
  which is where the load would put them); FSDP2 modules go to verl's function unchanged.
* torch's ``FlatParamHandle.to_cpu`` (``torch/distributed/fsdp/_flat_param.py``), entered when a sharded FSDP1
  module is unsharded with ``offload_to_cpu=True`` (a full state dict with ``FullStateDictConfig(offload_to_cpu=
  True)``, as verl's ``get_fsdp_full_state_dict`` and its checkpoint manager's ``hf_model`` save ask;
  ``summon_full_params(offload_to_cpu=True)``), moves the unsharded flat parameter to CPU and then frees the
  unsharded storage on the compute device. When the compute device is the CPU the move is no copy, so the
  free empties the parameter itself ("setStorage: ... out of bounds for storage of size 0").
  :func:`patch_flat_param_to_cpu` leaves a handle whose compute device is the CPU as it is; any other handle
  goes to torch's method.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator, Sequence

import torch

from .patching import PATCH_MARK, replace_once

ENGINE_MODULE = "verl.workers.engine.fsdp.transformer_impl"
"""verl's FSDP engine, which binds ``load_fsdp_model_to_gpu`` by name when it is imported."""


def gloo_broadcasts_cpu_tensors() -> bool:
    """True when the default process group is initialised and its backend for CPU tensors is gloo."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return False
    backend = str(dist.get_backend())  # "gloo", or a per-device list such as "cpu:gloo,cuda:nccl"
    if ":" not in backend:
        return backend == "gloo"
    return any(entry.strip() == "cpu:gloo" for entry in backend.split(","))


def cpu_states_can_sync(module_states: Sequence[torch.Tensor]) -> bool:
    """True when every tensor FSDP1 is about to broadcast from rank 0 is on CPU and gloo carries the broadcast."""
    return all(tensor.device.type == "cpu" for tensor in module_states) and gloo_broadcasts_cpu_tensors()


def patch_sync_module_states_check() -> None:
    """Let FSDP1's ``sync_module_states=True`` broadcast CPU parameters and buffers over gloo (idempotent).

    Replaces ``torch.distributed.fsdp._init_utils._check_module_states_for_sync_module_states``, which FSDP1
    looks up in its module at call time: states accepted by :func:`cpu_states_can_sync` pass, anything else
    goes to torch's own check.
    """
    from torch.distributed.fsdp import _init_utils

    def make(original: Callable[[list[torch.Tensor]], None]) -> Callable[[list[torch.Tensor]], None]:
        def check_module_states_for_sync_module_states(module_states: list[torch.Tensor]) -> None:
            if not cpu_states_can_sync(module_states):
                original(module_states)

        return check_module_states_for_sync_module_states

    replace_once(_init_utils, "_check_module_states_for_sync_module_states", make)


def _load_fsdp_model_on_cpu(original: Callable[[Any], None]) -> Callable[[Any], None]:
    """verl's ``load_fsdp_model_to_gpu`` with FSDP1 modules left where they are (on the host)."""

    def load_fsdp_model_to_gpu(model: Any) -> None:
        from verl.utils.fsdp_utils import fsdp_version

        if fsdp_version(model) == 1:
            return None
        return original(model)

    load_fsdp_model_to_gpu.__doc__ = (
        "On the cpu platform: nothing for an FSDP1 module (its flat parameters stay on the host, where the "
        "load would put them); verl's load_fsdp_model_to_gpu for any other module.")
    return load_fsdp_model_to_gpu


def patch_load_fsdp_model() -> None:
    """Replace ``verl.utils.fsdp_utils.load_fsdp_model_to_gpu`` with its CPU answer (idempotent).

    verl's FSDP engine imports the function by name, so the engine module's binding is replaced too when that
    module is already imported; an engine imported later binds the replacement.
    """
    import verl.utils.fsdp_utils as fsdp_utils

    replacement = replace_once(fsdp_utils, "load_fsdp_model_to_gpu", _load_fsdp_model_on_cpu)
    engine = sys.modules.get(ENGINE_MODULE)
    if engine is not None and getattr(engine, "load_fsdp_model_to_gpu", None) is getattr(replacement, PATCH_MARK):
        engine.load_fsdp_model_to_gpu = replacement


def _to_cpu_on_host(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """torch's ``FlatParamHandle.to_cpu`` with a handle that computes on the CPU left as it is."""

    @contextlib.contextmanager
    def to_cpu(self: Any) -> Iterator[None]:
        if self.device.type == "cpu":  # the unsharded flat parameter is already on the host: nothing to move
            yield
            return
        with original(self):
            yield

    to_cpu.__doc__ = ("On the cpu platform: nothing for a handle whose compute device is the CPU (its unsharded "
                      "flat parameter is on the host already); torch's FlatParamHandle.to_cpu for any other.")
    return to_cpu


def patch_flat_param_to_cpu() -> None:
    """Make ``FlatParamHandle.to_cpu`` a no-op for a handle that computes on the CPU (idempotent)."""
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    replace_once(FlatParamHandle, "to_cpu", _to_cpu_on_host)


def patch_fsdp1() -> None:
    """Install the three FSDP1 patches (idempotent)."""
    patch_sync_module_states_check()
    patch_load_fsdp_model()
    patch_flat_param_to_cpu()
