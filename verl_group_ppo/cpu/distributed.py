"""The gloo backend-string fix for ``torch.distributed.init_process_group``.

verl starts its process groups with the backend string ``f"cpu:gloo,{device}:{backend}"``
(``verl/utils/distributed.py``: ``initialize_global_process_group`` and
``initialize_global_process_group_ray``). On the cpu platform that is ``"cpu:gloo,cpu:gloo"``, which torch
rejects ("Duplicate device type cpu in backend string"). :func:`patch_init_process_group` wraps torch's
function so that a backend string naming one device twice keeps only the first entry for that device;
every other call is passed through unchanged.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch.distributed

from .patching import replace_once


def dedupe_backend_string(backend: Optional[Any]) -> Optional[Any]:
    """``"cpu:gloo,cpu:gloo"`` -> ``"cpu:gloo"``: drop later entries for a device already named.

    Anything that is not a comma-separated ``device:backend`` string (``None``, ``"gloo"``, a Backend
    object) is returned as it is. Two different backends for one device raise ``ValueError``.
    """
    if not isinstance(backend, str) or "," not in backend:
        return backend
    kept: dict[str, str] = {}
    for entry in (part.strip() for part in backend.split(",")):
        if ":" not in entry:
            return backend  # not a per-device list; let torch judge it
        device, name = entry.split(":", 1)
        if device in kept and kept[device] != name:
            raise ValueError(f"backend={backend!r} names two backends for device {device!r}")
        kept.setdefault(device, name)
    return ",".join(f"{device}:{name}" for device, name in kept.items())


def patch_init_process_group() -> None:
    """Wrap ``torch.distributed.init_process_group`` with :func:`dedupe_backend_string` (idempotent).

    verl looks the function up on the module at call time, so replacing the module attribute reaches it.
    """
    replace_once(torch.distributed, "init_process_group", _deduping)


def _deduping(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` with its ``backend`` argument (positional or keyword) passed through the de-duplication."""

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if args:
            args = (dedupe_backend_string(args[0]),) + args[1:]
        elif "backend" in kwargs:
            kwargs["backend"] = dedupe_backend_string(kwargs["backend"])
        return original(*args, **kwargs)

    return init_process_group
