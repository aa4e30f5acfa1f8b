"""The one way the CPU backend replaces a function of verl or torch: in place, once, with the original kept.

Every patch of the backend goes through :func:`replace_once`, so a second install finds its own replacement and
does nothing, and tests can reach the function that was replaced through :data:`PATCH_MARK`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

PATCH_MARK = "verl_group_ppo_cpu_original"
"""The attribute of a replacement that holds the function it replaced."""


def replace_once(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[..., Any]:
    """Set ``owner.name`` (a module or class attribute) to ``make(original)``, marked with the original.

    A no-op when ``owner.name`` is already a replacement of ours. Returns the function now in place.
    """
    current = getattr(owner, name)
    if getattr(current, PATCH_MARK, None) is not None:
        return current
    replacement = make(current)
    setattr(replacement, PATCH_MARK, current)
    setattr(owner, name, replacement)
    return replacement


class PatchTargetError(RuntimeError):
    """A function this package replaces is missing from verl or no longer has the parameters it expects."""


def check_target(owner: Any, name: str, parameters: Sequence[str]) -> None:
    """Raise :class:`PatchTargetError` naming ``owner.name`` when it is missing or its leading parameter names
    differ from ``parameters`` (a replacement of ours is checked through the original it holds)."""
    where = f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"
    current = getattr(owner, name, None)
    if current is None:
        raise PatchTargetError(f"{where} does not exist in this verl: verl-group-ppo cannot replace it "
                               "(supported: verl 0.9.1)")
    original = getattr(current, PATCH_MARK, current)
    found = list(inspect.signature(original).parameters)[:len(parameters)]
    if found != list(parameters):
        raise PatchTargetError(f"{where} takes {found}, verl-group-ppo's replacement expects {list(parameters)} "
                               "(supported: verl 0.9.1)")
