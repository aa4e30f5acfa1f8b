"""Where a prompt's samples meet: one :class:`Tree` per prompt in the agent-loop worker's memory, and
:func:`sample_in_tree`, one sample's part (pure asyncio, no verl imports).

verl runs a prompt's ``rollout.n`` samples as asyncio tasks of one agent-loop worker (``session_id`` 0 .. n-1), so
they find each other through a :class:`TreeRegistry` keyed by the prompt's identity (``uid`` and step). A child
waits until its parent's reply reaches its branch window (or ends), then generates only its tail from prompt + the
parent's first ``q`` reply tokens. With ``branch_start: parent_done`` every sample asks for its reply in one
request, so a child starts when its parent is done; with ``prefix_ready`` a sample with children asks for its
reply in pieces, each ending just past a child's branch window (:func:`pieces`), and shows the tree what it has so
far after each, so a child starts while its parent goes on. The tokens are sampled as in one request (each piece
continues the text so far); a piece that comes back short, or ends at a stop token, ends the reply. A parent that
fails fails its children with the same error.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Collection, Hashable, Optional

from verl_group_ppo.tree.assemble import Reply, child_reply, prefix_length
from verl_group_ppo.tree.shape import SamplePlan, TreeShape, branch_position

__all__ = ["Tree", "TreeRegistry", "TreeSample", "branch_window_end", "pieces", "sample_in_tree"]

Generate = Callable[[list[int], Optional[int]], Awaitable[Reply]]
"""``generate(token_ids, max_tokens)``: what the server sampled after ``token_ids`` (at most ``max_tokens``
tokens; None: the rollout's own limit), as a :class:`Reply` (mask all 1)."""

Assemble = Callable[[Reply], Awaitable[Reply]]
"""Turns a sample's full assistant tokens into its row's reply (verl's token merge); the identity by default."""


@dataclass(frozen=True)
class TreeSample:
    """One sample's result: its row's ``reply``, and where it sits in the tree.

    Attributes:
        reply: the row's reply (prefix copied, then the tail; ``once``: mask 0 on the copied prefix).
        parent: the parent sample's number, -1 for a root.
        position: the branch position ``q`` (tokens copied from the parent), 0 for a root.
        generated: how many tokens this sample generated itself.
    """

    reply: Reply
    parent: int
    position: int
    generated: int

    def extra_fields(self) -> dict[str, int]:
        """What a row records of its tree position (verl stores a row's ``extra_fields`` with it)."""
        return {"tree_parent": self.parent, "tree_branch_position": self.position,
                "tree_generated_tokens": self.generated}


class Tree:
    """The replies of one prompt's samples as they grow: each sample's tokens so far, and whether it ended."""

    def __init__(self) -> None:
        self._known: dict[int, tuple[Reply, bool]] = {}
        self._errors: dict[int, BaseException] = {}
        self._waiting: dict[int, asyncio.Event] = {}
        self.finished: set[int] = set()
        self.notes: dict[int, Any] = {}
        """What the caller records per sample for its children to read (the verl glue: the span of weight
        versions that generated the sample's reply so far, prefix included)."""

    async def prefix_of(self, index: int, length: Optional[int]) -> tuple[Reply, bool]:
        """Sample ``index``'s reply once it holds ``length`` tokens (None: once it has ended) or has ended: (its
        reply so far, ended); its error, if it failed."""
        while True:
            if index in self._errors:
                raise self._errors[index]
            known = self._known.get(index)
            if known is not None and (known[1] or (length is not None and len(known[0].ids) >= length)):
                return known
            if index not in self._waiting:
                self._waiting[index] = asyncio.Event()
            await self._waiting[index].wait()

    async def reply_of(self, index: int) -> Reply:
        """Sample ``index``'s full reply, once it has one (its error, if it failed)."""
        reply, _ = await self.prefix_of(index, None)
        return reply

    def grow(self, index: int, reply: Reply) -> None:
        """Sample ``index`` has generated ``reply`` so far and goes on."""
        self._set(index, (reply, False))

    def publish(self, index: int, reply: Reply) -> None:
        """Sample ``index`` finished with ``reply``."""
        self._set(index, (reply, True))
        self.finished.add(index)

    def fail(self, index: int, error: BaseException) -> None:
        """Sample ``index`` failed: its children fail with ``error``."""
        self._errors[index] = error
        self._wake(index)
        self.finished.add(index)

    def _set(self, index: int, known: tuple[Reply, bool]) -> None:
        self._known[index] = known
        self._wake(index)

    def _wake(self, index: int) -> None:
        event = self._waiting.pop(index, None)
        if event is not None:
            event.set()


class TreeRegistry:
    """The trees of the prompts in flight in one worker, keyed by the prompt's identity; a tree is dropped once
    ``size`` of its samples finished, and the oldest trees beyond ``max_trees`` (samples of a prompt that never
    all ran, e.g. validation with fewer samples per prompt than the tree holds)."""

    def __init__(self, max_trees: int = 4096) -> None:
        self.max_trees = max_trees
        self._trees: OrderedDict[Hashable, Tree] = OrderedDict()

    def __len__(self) -> int:
        return len(self._trees)

    def tree(self, key: Hashable) -> Tree:
        """The tree of prompt ``key`` (made on first use)."""
        if key not in self._trees:
            self._trees[key] = Tree()
            while len(self._trees) > self.max_trees:
                self._trees.popitem(last=False)
        return self._trees[key]

    def finished(self, key: Hashable, size: int) -> None:
        """Drop prompt ``key``'s tree when ``size`` of its samples have finished."""
        tree = self._trees.get(key)
        if tree is not None and len(tree.finished) >= size:
            del self._trees[key]


def branch_window_end(plan: SamplePlan, shape: TreeShape) -> int:
    """How many of its parent's reply tokens a child needs to see (unless the parent ends first) before its branch
    position is known: the nominal position and one token more (``fixed``: the parent goes on past it), or the
    whole window (``low_prob``)."""
    return plan.nominal_position + _lookahead(shape)


def pieces(plan: SamplePlan, shape: TreeShape, response_length: int) -> list[int]:
    """Where sample ``plan`` stops to show its reply so far: with ``branch_start: prefix_ready`` the reply lengths
    its children wait for (:func:`branch_window_end`; a sample at level ``l``, 0 for a root, has children at every
    level ``l + 1 .. L``), in order, then ``response_length``. A leaf, and every sample with ``parent_done``, asks
    for its reply in one piece."""
    if shape.branch_start == "parent_done":
        return [response_length]
    ends = {level * shape.segment_tokens + _lookahead(shape) for level in range(plan.level + 1, shape.levels + 1)}
    return sorted(end for end in ends if end < response_length) + [response_length]


def _lookahead(shape: TreeShape) -> int:
    return shape.window if shape.branch_rule == "low_prob" else 1


async def sample_in_tree(tree: Tree, plan: SamplePlan, shape: TreeShape, prompt_ids: list[int], generate: Generate,
                         response_length: int, assemble: Optional[Assemble] = None,
                         stop_ids: Collection[int] = ()) -> TreeSample:
    """One sample of the tree (module docstring): a root generates from the prompt; a child waits until its parent
    reaches its branch window, copies the parent's first ``q`` reply tokens
    (:func:`~verl_group_ppo.tree.shape.branch_position`) and generates after them. Either asks for its reply in
    :func:`pieces`, showing the tree each piece; a piece that returns fewer tokens than asked, or ends with one of
    ``stop_ids`` (the tokens the server stops at), ends the reply. Publishes the sample's full reply (its
    prefix's mask as generated) and returns its row (:class:`TreeSample`)."""
    assemble = assemble or _identity
    try:
        parent, q = None, 0
        if plan.parent is not None:
            parent, _ = await tree.prefix_of(plan.parent, branch_window_end(plan, shape))
            q = branch_position(plan, shape, len(parent.ids), parent.log_probs)
        own = Reply(ids=[], mask=[], log_probs=[])  # what this sample generated, piece by piece
        for end in pieces(plan, shape, response_length):
            want = end - q - len(own.ids)
            if want <= 0:
                continue
            so_far = _text(parent, q, own)
            whole = parent is None and not own.ids and end == response_length  # one piece: the rollout's limit
            tail = await generate(list(prompt_ids) + so_far.ids, None if whole else want)
            own = Reply(ids=own.ids + tail.ids, mask=own.mask + tail.mask,
                        log_probs=None if own.log_probs is None or tail.log_probs is None
                        else own.log_probs + list(tail.log_probs))
            if len(tail.ids) < want or (tail.ids and tail.ids[-1] in stop_ids) or end >= response_length:
                break
            tree.grow(plan.index, _text(parent, q, own))
        reply = await assemble(_text(parent, q, own))
        result = TreeSample(reply, parent=-1 if plan.parent is None else plan.parent, position=q,
                            generated=len(own.ids))
    except BaseException as error:
        tree.fail(plan.index, error)
        raise
    tree.publish(plan.index, result.reply)
    if shape.shared_prefix == "once" and parent is not None:
        # the copied prefix, and any first tokens of the tail that repeat the parent's: those are the parent's
        # tree nodes, trained in the parent's row, and the child's first trained token is where it parts from it
        parent_reply = await tree.reply_of(plan.parent)
        shared = prefix_length(result.reply.ids, parent_reply.ids)
        masked = Reply(ids=result.reply.ids, mask=[0] * shared + result.reply.mask[shared:],
                       log_probs=result.reply.log_probs)
        result = TreeSample(masked, result.parent, result.position, result.generated)
    return result


def _text(parent: Optional[Reply], q: int, own: Reply) -> Reply:
    """A sample's reply so far: its parent's first ``q`` tokens (none for a root), then its own."""
    return own if parent is None else child_reply(parent, q, own, "per_leaf")


async def _identity(reply: Reply) -> Reply:
    return reply
