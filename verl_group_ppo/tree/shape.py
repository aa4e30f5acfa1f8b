"""A prompt's replies sampled as a tree: the shape setting, who branches from whom, and where.

Pure Python, no verl and no torch imports.

The shape (:class:`TreeShape`, Hydra block ``tree_rollout``): ``roots`` replies sampled freely, then at level
``l = 1 .. L`` every reply present so far is joined by ``branching[l-1] - 1`` new replies that share its first
``l * segment_tokens`` tokens and sample their own tail from there. A prompt gets
``roots * prod(branching)`` replies, which must equal ``actor_rollout_ref.rollout.n``. Every reply is a complete
root-to-leaf path (the prompt plus a full reply); the tree's nodes are the segments between branch points.

Sample numbering (:func:`tree_plan`): sample ``i`` written in the mixed radix ``(r, d_1, ..., d_L)``
(``r < roots``, ``d_l < branching[l-1]``, ``d_L`` the fastest digit). All ``d_l = 0``: root ``r``. Otherwise its
parent is the same number with its last nonzero digit ``d_l`` set to 0, and it branches at level ``l``, i.e. at
token ``l * segment_tokens`` of the parent's reply. A parent's number is always smaller than its child's, so any
first ``k`` samples form a tree on their own (validation with fewer samples per prompt is a partial tree).

Example ``roots=2, branching=[2, 2]`` (n = 8): samples 0 and 4 are roots; 2 branches from 0 and 6 from 4 at level
1; 1 from 0, 3 from 2, 5 from 4 and 7 from 6 at level 2.

Where a branch really starts (:func:`branch_position`), given the parent's reply of length ``L_p`` (its reply so far
once that holds the nominal position and the window after it; its whole reply if it ended first):

- ``branch_rule: fixed``: at the nominal position ``p = l * segment_tokens``; a parent that ends before it
  (``L_p <= p``) is branched at its last token instead, ``q = L_p - 1``: the child copies all of the parent's reply
  but the last token and samples from there, so every child samples at least one token of its own.
- ``branch_rule: low_prob`` (SPO's cutpoints): at the parent's lowest-probability token among positions
  ``[p, p + window)`` of its reply (the child copies the tokens before it and resamples it); the first such token
  on ties; a parent that ends before ``p`` as above.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from verl_group_ppo.config import to_plain_dict

__all__ = ["BRANCH_RULES", "BRANCH_STARTS", "SHARED_PREFIX", "TREE_PATH", "SamplePlan", "TreeShape", "branch_position",
           "tree_plan"]

TREE_PATH = "tree_rollout"
"""Where the tree's keys live in the run's config (errors name keys by this path)."""

BRANCH_RULES = ("fixed", "low_prob")
BRANCH_STARTS = ("parent_done", "prefix_ready")
"""When a branch starts sampling: once its parent's reply is done (each sample one request), or as soon as the
parent's reply reaches the branch (``prefix_ready``: a sample with children asks for its reply in pieces, one more
request per level below it; :func:`~verl_group_ppo.tree.coordinator.pieces`)."""
SHARED_PREFIX = ("once", "per_leaf")
"""How often a shared prefix is trained: ``once`` (SPO-tree: a child's copied prefix, with any first sampled tokens
that repeat the parent's, is masked out of its ``response_mask``, so each segment is trained by the one sample that
generated it) or ``per_leaf`` (TreeRL: every row trains its whole reply, a shared token once per leaf below it)."""


@dataclass(frozen=True)
class TreeShape:
    """The ``tree_rollout`` keys (module docstring). Build with :meth:`from_config`; bad values raise ValueError
    naming the key.

    Attributes:
        roots: replies sampled freely per prompt (>= 1).
        branching: replies per node at each level (each >= 2; empty: ``roots`` independent replies).
        segment_tokens: tokens between two levels' branch points (>= 1).
        branch_rule: ``fixed`` or ``low_prob``.
        window: ``low_prob`` only: how many of the parent's tokens from the nominal position are candidates (>= 1).
        shared_prefix: ``once`` or ``per_leaf`` (:data:`SHARED_PREFIX`).
        branch_start: ``parent_done`` or ``prefix_ready`` (:data:`BRANCH_STARTS`).
    """

    roots: int = 2
    branching: tuple[int, ...] = (2, 2)
    segment_tokens: int = 4
    branch_rule: str = "fixed"
    window: int = 4
    shared_prefix: str = "once"
    branch_start: str = "parent_done"

    def __post_init__(self) -> None:
        object.__setattr__(self, "branching", tuple(self.branching))
        for key in ("roots", "segment_tokens", "window"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{TREE_PATH}.{key} must be an integer >= 1, got {value!r}")
        for b in self.branching:
            if isinstance(b, bool) or not isinstance(b, int) or b < 2:
                raise ValueError(f"{TREE_PATH}.branching must list integers >= 2 (replies per node at each level), "
                                 f"got {list(self.branching)!r}")
        if self.branch_rule not in BRANCH_RULES:
            raise ValueError(f"{TREE_PATH}.branch_rule must be one of {list(BRANCH_RULES)}, got {self.branch_rule!r}")
        if self.branch_start not in BRANCH_STARTS:
            raise ValueError(f"{TREE_PATH}.branch_start must be one of {list(BRANCH_STARTS)}, got {self.branch_start!r}")
        if self.shared_prefix not in SHARED_PREFIX:
            raise ValueError(f"{TREE_PATH}.shared_prefix must be one of {list(SHARED_PREFIX)}, "
                             f"got {self.shared_prefix!r}")

    @property
    def size(self) -> int:
        """Replies per prompt: ``roots * prod(branching)``."""
        return self.roots * math.prod(self.branching)

    @property
    def levels(self) -> int:
        """Branch levels L (the depth of the tree below its roots)."""
        return len(self.branching)

    def check_samples(self, n: Any, key: str = "actor_rollout_ref.rollout.n") -> None:
        """ValueError naming ``key`` and the shape's keys when ``n`` is not :attr:`size`."""
        if n != self.size:
            raise ValueError(
                f"{key}={n} but the tree gives {TREE_PATH}.roots * prod({TREE_PATH}.branching) = {self.roots} * "
                f"prod({list(self.branching)}) = {self.size} replies per prompt; set {key}={self.size} or change "
                f"{TREE_PATH}.roots / {TREE_PATH}.branching")

    @classmethod
    def from_config(cls, obj: Any = None) -> "TreeShape":
        """From None (defaults), a TreeShape, a mapping or an OmegaConf node; unknown keys raise ValueError."""
        if obj is None:
            return cls()
        if isinstance(obj, TreeShape):
            return obj
        raw = to_plain_dict(obj, TREE_PATH)
        known = ("roots", "branching", "segment_tokens", "branch_rule", "window", "shared_prefix", "branch_start")
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"{TREE_PATH}: unknown key(s) {unknown}; known keys are {list(known)}")
        if "branching" in raw:
            branching = raw["branching"]
            if isinstance(branching, (str, bytes)) or not isinstance(branching, Sequence):
                raise ValueError(f"{TREE_PATH}.branching must be a list of integers >= 2, got {branching!r}")
            raw["branching"] = tuple(branching)
        return cls(**raw)

    def to_dict(self) -> dict[str, Any]:
        """The keys as a plain dict (for logs and ``extra_fields``)."""
        return {"roots": self.roots, "branching": list(self.branching), "segment_tokens": self.segment_tokens,
                "branch_rule": self.branch_rule, "window": self.window, "shared_prefix": self.shared_prefix,
                "branch_start": self.branch_start}


@dataclass(frozen=True)
class SamplePlan:
    """One sample's place in the tree, before anything is generated.

    Attributes:
        index: the sample's number (verl's ``session_id``).
        parent: the number of the sample it branches from; None for a root.
        level: the branch level (1 .. L); 0 for a root.
        nominal_position: ``level * segment_tokens``, the token of the parent's reply where the branch starts
            under the fixed rule (0 for a root).
    """

    index: int
    parent: Optional[int]
    level: int
    nominal_position: int


def tree_plan(shape: TreeShape, n: Optional[int] = None) -> list[SamplePlan]:
    """The plan of samples ``0 .. n-1`` (default: the whole tree, ``shape.size``; module docstring's numbering).

    Samples numbered ``shape.size`` or above (a run asking for more samples than the tree holds) are roots.
    """
    count = shape.size if n is None else n
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"n must be an integer >= 0, got {n!r}")
    plans = []
    for i in range(count):
        if i >= shape.size:
            plans.append(SamplePlan(i, None, 0, 0))
            continue
        digits = _digits(i, shape.branching)  # d_1 .. d_L
        nonzero = [level for level, d in enumerate(digits, start=1) if d]
        if not nonzero:
            plans.append(SamplePlan(i, None, 0, 0))
            continue
        level = nonzero[-1]
        stride = math.prod(shape.branching[level:])  # the weight of digit d_level
        parent = i - digits[level - 1] * stride
        plans.append(SamplePlan(i, parent, level, level * shape.segment_tokens))
    return plans


def branch_position(plan: SamplePlan, shape: TreeShape, parent_length: int,
                    parent_log_probs: Optional[Sequence[float]] = None) -> int:
    """The token of the parent's reply where the child's own tail starts (the child copies positions ``[0, q)``).

    Args:
        plan: the child's :class:`SamplePlan` (not a root).
        shape: the tree's shape (``branch_rule``, ``window``).
        parent_length: the parent's reply length ``L_p`` (tokens; so far, or finished: module docstring).
        parent_log_probs: the parent's ``L_p`` per-token log-probs; required by ``branch_rule: low_prob``.

    Returns:
        ``q`` in ``[0, max(L_p - 1, 0)]`` (module docstring): the nominal position, the rule's token, or the parent's
        last token when the parent ends before the nominal position.
    """
    if plan.parent is None:
        raise ValueError(f"plan of sample {plan.index} is a root: it has no branch position")
    if isinstance(parent_length, bool) or not isinstance(parent_length, int) or parent_length < 0:
        raise ValueError(f"parent_length must be an integer >= 0, got {parent_length!r}")
    last = max(parent_length - 1, 0)
    p = plan.nominal_position
    if p > last:
        return last
    if shape.branch_rule == "fixed":
        return p
    if parent_log_probs is None or len(parent_log_probs) != parent_length:
        got = None if parent_log_probs is None else len(parent_log_probs)
        raise ValueError(f"{TREE_PATH}.branch_rule=low_prob needs the parent's {parent_length} log-probs "
                         f"(actor_rollout_ref.rollout.calculate_log_probs=True), got {got}")
    window = range(p, min(p + shape.window, parent_length))
    return min(window, key=lambda t: (parent_log_probs[t], t))


def _digits(i: int, branching: Sequence[int]) -> list[int]:
    """The digits ``d_1 .. d_L`` of ``i`` in the mixed radix ``branching`` (``d_L`` fastest)."""
    digits = []
    for base in reversed(branching):
        digits.append(i % base)
        i //= base
    return digits[::-1]
