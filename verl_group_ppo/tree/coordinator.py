"""Where a prompt's samples meet: one :class:`Tree` per prompt in the agent-loop worker's memory, and
:func:`sample_in_tree`, one sample's part (pure asyncio, no verl imports).

verl runs a prompt's ``rollout.n`` samples as asyncio tasks of one agent-loop worker (``session_id`` 0 .. n-1), so
they find each other through a :class:`TreeRegistry` keyed by the prompt's identity (``uid`` and step). A root
generates at once; a child awaits its parent's finished reply (an ``asyncio.Future`` per sample), then generates
only its tail from prompt + the parent's first ``q`` reply tokens. Every sample starts when its own parent is done,
not when the parent's level is, so branches run as soon as their prefix exists. A parent that fails fails its
children with the same error.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Hashable, Optional

from verl_group_ppo.tree.assemble import Reply, child_reply, prefix_length
from verl_group_ppo.tree.shape import SamplePlan, TreeShape, branch_position

__all__ = ["Tree", "TreeRegistry", "TreeSample", "sample_in_tree"]

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
    """The finished replies of one prompt's samples, as each finishes."""

    def __init__(self) -> None:
        self._replies: dict[int, asyncio.Future] = {}
        self.finished: set[int] = set()
        self.notes: dict[int, Any] = {}
        """What the caller records per sample for its children to read (the verl glue: the span of weight
        versions that generated the sample's reply, prefix included)."""

    def _future(self, index: int) -> asyncio.Future:
        if index not in self._replies:
            self._replies[index] = asyncio.get_running_loop().create_future()
        return self._replies[index]

    async def reply_of(self, index: int) -> Reply:
        """Sample ``index``'s full reply, once it has one (its error, if it failed)."""
        return await asyncio.shield(self._future(index))

    def publish(self, index: int, reply: Reply) -> None:
        """Sample ``index`` finished with ``reply``."""
        self._future(index).set_result(reply)
        self.finished.add(index)

    def fail(self, index: int, error: BaseException) -> None:
        """Sample ``index`` failed: its children fail with ``error``."""
        future = self._future(index)
        if not future.done():
            future.set_exception(error)
            future.exception()  # retrieved here: a sample without children must not log "never retrieved"
        self.finished.add(index)


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


async def sample_in_tree(tree: Tree, plan: SamplePlan, shape: TreeShape, prompt_ids: list[int], generate: Generate,
                         response_length: int, assemble: Optional[Assemble] = None) -> TreeSample:
    """One sample of the tree (module docstring): a root generates from the prompt; a child waits for its parent,
    copies the parent's first ``q`` reply tokens (:func:`~verl_group_ppo.tree.shape.branch_position`) and generates
    at most ``response_length - q`` tokens after them. Publishes the sample's full reply (its prefix's mask as
    generated) for its own children, and returns its row (:class:`TreeSample`)."""
    assemble = assemble or _identity
    try:
        if plan.parent is None:
            tail = await generate(list(prompt_ids), None)
            reply = await assemble(tail)
            result = TreeSample(reply, parent=-1, position=0, generated=len(tail.ids))
        else:
            parent = await tree.reply_of(plan.parent)
            q = branch_position(plan, shape, len(parent.ids), parent.log_probs)
            tail = await generate(list(prompt_ids) + parent.ids[:q], response_length - q)
            full = child_reply(parent, q, tail, "per_leaf")
            reply = await assemble(Reply(ids=full.ids, mask=[1] * len(full.ids), log_probs=full.log_probs))
            result = TreeSample(reply, parent=plan.parent, position=q, generated=len(tail.ids))
    except BaseException as error:
        tree.fail(plan.index, error)
        raise
    tree.publish(plan.index, result.reply)
    if shape.shared_prefix == "once" and plan.parent is not None:
        # the copied prefix, and any first tokens of the tail that repeat the parent's: those are the parent's
        # tree nodes, trained in the parent's row, and the child's first trained token is where it parts from it
        shared = prefix_length(result.reply.ids, parent.ids)
        masked = Reply(ids=result.reply.ids, mask=[0] * shared + result.reply.mask[shared:],
                       log_probs=result.reply.log_probs)
        result = TreeSample(masked, result.parent, result.position, result.generated)
    return result


async def _identity(reply: Reply) -> Reply:
    return reply
