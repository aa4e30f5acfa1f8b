"""The one way the CPU backend replaces a function of verl or torch: in place, once, with the original kept.

Every patch of the backend goes through :func:`replace_once`, so a second install finds its own replacement and
does nothing, and tests can reach the function that was replaced through :data:`PATCH_MARK`.
"""

from __future__ import annotations

from typing import Any, Callable

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
