"""A branched sample's row from its parent's reply and its own tail (pure Python, no verl imports).

A child copies the parent's first ``q`` reply tokens (its branch position, :func:`~verl_group_ppo.tree.shape.
branch_position`) with their log-probs, and appends the tokens it generated. Its ``response_mask`` on the copied
prefix follows ``tree_rollout.shared_prefix``: ``per_leaf`` copies the parent's mask (the prefix is trained in
every row that holds it), ``once`` writes 0 there (the prefix is trained only in the row that generated it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["Reply", "child_reply", "prefix_length"]


@dataclass(frozen=True)
class Reply:
    """A reply as the agent loop returns it: ``ids``, ``mask`` and ``log_probs`` (or None) of equal length."""

    ids: list[int]
    mask: list[int]
    log_probs: Optional[list[float]] = None

    def __post_init__(self) -> None:
        if len(self.mask) != len(self.ids) or (self.log_probs is not None and len(self.log_probs) != len(self.ids)):
            raise ValueError(f"Reply fields differ in length: ids {len(self.ids)}, mask {len(self.mask)}, "
                             f"log_probs {None if self.log_probs is None else len(self.log_probs)}")


def child_reply(parent: Reply, position: int, tail: Reply, shared_prefix: str) -> Reply:
    """The child's full reply: ``parent``'s first ``position`` tokens, then ``tail``.

    Args:
        parent: the parent's finished reply (length ``L_p``).
        position: the branch position ``q`` in ``[0, L_p]``.
        tail: what the child generated from there.
        shared_prefix: ``once`` (mask 0 on the copied prefix) or ``per_leaf`` (the parent's mask copied).

    Returns:
        A :class:`Reply` of length ``q + len(tail.ids)``; log-probs present only when both parts have them.
    """
    if isinstance(position, bool) or not isinstance(position, int) or not 0 <= position <= len(parent.ids):
        raise ValueError(f"position must be an integer in [0, {len(parent.ids)}] (the parent's reply length), "
                         f"got {position!r}")
    if shared_prefix not in ("once", "per_leaf"):
        raise ValueError(f"shared_prefix must be 'once' or 'per_leaf', got {shared_prefix!r}")
    prefix_mask = [0] * position if shared_prefix == "once" else list(parent.mask[:position])
    log_probs: Optional[list[float]] = None
    if parent.log_probs is not None and tail.log_probs is not None:
        log_probs = list(parent.log_probs[:position]) + list(tail.log_probs)
    return Reply(ids=list(parent.ids[:position]) + list(tail.ids), mask=prefix_mask + list(tail.mask),
                 log_probs=log_probs)


def prefix_length(ids: Sequence[int], other: Sequence[int]) -> int:
    """How many leading tokens two replies share."""
    n = 0
    for a, b in zip(ids, other):
        if a != b:
            break
        n += 1
    return n
