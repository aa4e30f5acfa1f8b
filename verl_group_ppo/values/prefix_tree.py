"""``value_source: prefix_tree``: the value of a prefix is the mean reward of the prompt's replies that share it.

Pure torch, no verl imports. :func:`prefix_tree_values` gives ``values`` (B, T) in verl's convention
(``values[b, t]`` is the value of the state before response token t), which the estimator reads exactly as it reads
a critic's. The replies to the same prompt (verl's ``uid``) that share the prefix token for token count; no
generation beyond the replies themselves. Every prefix has a value, so it is defined at every position, not only at
group starts.

What it reduces to when no two replies of a prompt share a first token: the value before token 0 is the prompt's
mean reward (the empty prefix is shared by all), and every later value is the reply's own reward. With
``gamma = lam = 1`` and one reward at the last token the first group's advantage is ``R - mean(R of the prompt)``
(GRPO's advantage before its std scaling) and every later group's is 0: the tree only assigns credit inside a reply
where replies agree on a prefix and then part.

Equality of prefixes is decided on ``response_ids`` and ``attention_mask`` together (a position that exists in one
reply and not in the other differs), over every position before the boundary, tool observations included (in the
multi-turn loop they are part of the state).

Over a tree rollout (:mod:`verl_group_ppo.tree`) the replies of a prompt share prefixes exactly, so the branch
points of a row are the positions where another reply of its prompt parts from it: ``t = shared(b, j)`` with ``0 < t < len_b``
(:func:`shared_prefix_lengths`). :func:`branch_endpoints` (``boundary_rule: tree``) ends a group right before
each of them and at the reply's last trained token, so the groups are the tree's segments along the row's path.
Between two branch points no reply leaves the row's path, so ``prefix_tree``'s value is constant on a segment and
changes at its ends: with ``gamma = lam = 1`` a segment's advantage is ``V(child) - V(parent)`` (the mean leaf reward
under the node the segment ends in minus that under the node it starts from), the last segment's
``R - V(parent)``.

The branch points are read from the tokens, not from the rollout's records: a child whose first sampled tokens
happen to repeat its parent's parts from it later than its recorded branch position, and the value does not change
before that, so the segment boundary follows the tokens.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

from verl_group_ppo.core_algos import IndexLike
from verl_group_ppo.estimator.checks import describe
from verl_group_ppo.values.batch import BatchFields, BoundaryValues, prompt_rows

__all__ = ["PromptPrefixes", "branch_endpoints", "parent_nodes", "prefix_tree_source", "prefix_tree_values",
           "prompt_prefixes", "shared_prefix_lengths"]


def prefix_tree_source(fields: BatchFields, boundary_rule: str = "fixed", adv_norm: str = "batch") -> BoundaryValues:
    """The prefix tree's values for a batch (reads ``responses``, ``reply_lengths``, ``scores`` and ``uid``); the
    estimator finds the groups, except under ``boundary_rule: tree``, where they end at the rows' branch points
    (:func:`branch_endpoints`, handed on as ``endpoints``); under ``adv_norm: parent`` also each position's tree
    node (:func:`parent_nodes`)."""
    exists = fields.reply_positions("prefix_tree")
    responses = fields.require("responses", "prefix_tree")
    uid = fields.require("uid", "prefix_tree")
    prefixes = prompt_prefixes(responses, exists, uid)  # computed once, read by the three below
    values = prefix_tree_values(responses, exists, fields.require("scores", "prefix_tree"), uid, prefixes=prefixes)
    if boundary_rule != "tree":
        return BoundaryValues(values=values)
    nodes = parent_nodes(responses, exists, uid, prefixes=prefixes) if adv_norm == "parent" else None
    endpoints = branch_endpoints(responses, exists, fields.response_mask, uid, prefixes=prefixes)
    return BoundaryValues(values=values, endpoints=endpoints, parent_nodes=nodes)


class PromptPrefixes(NamedTuple):
    """One prompt's replies and how far each pair of them agrees."""

    rows: torch.Tensor  # (n,) long: the prompt's rows in the batch, ascending
    shared: torch.Tensor  # (n, n) long: shared_prefix_lengths of those rows


def prompt_prefixes(response_ids: torch.Tensor, attention_mask: torch.Tensor, index: IndexLike) -> list[PromptPrefixes]:
    """:func:`shared_prefix_lengths` of every prompt's replies (``response_ids`` and ``attention_mask`` (B, T),
    ``index`` (B,) prompt ids), one entry per prompt in the order of :func:`prompt_rows`."""
    _check_replies(response_ids, attention_mask)
    rows_of = prompt_rows(index, response_ids.shape[0])
    return [PromptPrefixes(rows, shared_prefix_lengths(response_ids[rows], attention_mask[rows])) for rows in rows_of]


def shared_prefix_lengths(response_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """For n replies of one prompt, how many leading positions each pair shares.

    Args:
        response_ids: (n, T) token ids.
        attention_mask: (n, T) 0/1, 1 where the reply has a token (assistant or tool observation), 0 on padding.

    Returns:
        (n, n) long: ``L[i, j]`` = the number of leading positions where replies i and j hold the same token and
        both exist or both do not (T when they agree everywhere); symmetric, ``L[i, i] = T``.
    """
    n, T = response_ids.shape
    exists = attention_mask.bool()
    same = (response_ids[:, None, :] == response_ids[None, :, :]) & (exists[:, None, :] == exists[None, :, :])
    differs = ~same  # (n, n, T)
    first = torch.where(differs.any(dim=2), differs.int().argmax(dim=2), torch.full((n, n), T))
    return first.long()


def prefix_tree_values(response_ids: torch.Tensor, attention_mask: torch.Tensor, scores: torch.Tensor,
                       index: IndexLike, prefixes: Optional[Sequence[PromptPrefixes]] = None) -> torch.Tensor:
    """The prefix tree's value before every response position (module docstring).

    ``V[b, t]`` = mean of ``scores[j]`` over the replies j with ``index[j] == index[b]`` whose first t positions
    equal reply b's (:func:`shared_prefix_lengths` >= t); reply b itself always counts.

    Args:
        response_ids: (B, T) token ids.
        attention_mask: (B, T) 0/1, the response part of verl's attention mask.
        scores: (B,) float, each reply's reward (the sum of its token-level rewards).
        index: (B,) prompt ids (verl's ``uid``: str or int).
        prefixes: :func:`prompt_prefixes` of these inputs, when the caller has them; None computes them.

    Returns:
        (B, T) values in ``scores``' dtype (float32 when it is not floating); callers read them at valid
        positions only.
    """
    _check_shapes(response_ids, attention_mask, scores)
    B, T = response_ids.shape
    dtype = scores.dtype if scores.is_floating_point() else torch.float32
    values = torch.empty((B, T), dtype=dtype, device=scores.device)
    positions = torch.arange(T, device=response_ids.device)
    for rows, shared in prefixes or prompt_prefixes(response_ids, attention_mask, index):
        member = (shared[:, :, None] >= positions).to(dtype)  # (n, n, T): j shares b's first t positions
        total = torch.einsum("bjt,j->bt", member, scores[rows].to(dtype))
        values[rows] = total / member.sum(dim=1)
    return values


def parent_nodes(response_ids: torch.Tensor, attention_mask: torch.Tensor, index: IndexLike,
                 prefixes: Optional[Sequence[PromptPrefixes]] = None) -> torch.Tensor:
    """The node of the prefix tree at every position (``adv_norm: parent``): ``N[b, t]`` names the set of replies of
    b's prompt that share b's first t positions (:func:`shared_prefix_lengths` >= t), as ``j * T + t`` with j the
    first row of that set. A group that starts at t hangs from that node, so groups that start at the same node
    (a parent's continuation and the branches from it, over a tree rollout) get the same id and are normalised
    together; at t = 0 every reply of a prompt shares the empty prefix, so the first groups are normalised per
    prompt.

    Args:
        response_ids: (B, T) token ids.
        attention_mask: (B, T) 0/1, 1 at the positions each reply has.
        index: (B,) prompt ids (verl's ``uid``).
        prefixes: :func:`prompt_prefixes` of these inputs, when the caller has them; None computes them.

    Returns:
        (B, T) long, in [0, B * T).
    """
    B, T = response_ids.shape
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != (B, T):
        raise ValueError(f"attention_mask must have the shape of response_ids {(B, T)}, got {describe(attention_mask)}")
    nodes = torch.empty((B, T), dtype=torch.long, device=response_ids.device)
    positions = torch.arange(T, device=response_ids.device)
    for rows, shared in prefixes or prompt_prefixes(response_ids, attention_mask, index):
        rows = rows.to(response_ids.device)
        member = shared[:, :, None] >= positions  # (n, n, T); b is a member of its own set
        first = member.int().argmax(dim=1)  # (n, T): the first member of each set
        nodes[rows] = rows[first] * T + positions
    return nodes


def branch_endpoints(response_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                     index: IndexLike, prefixes: Optional[Sequence[PromptPrefixes]] = None) -> torch.Tensor:
    """Group endpoints at the branch points of each row (``boundary_rule: tree``): a group ends right before every
    position ``t`` where another reply of the row's prompt parts from it (``0 < t < len``, from
    :func:`shared_prefix_lengths`) and at the row's last trained position. Over a tree rollout these are the
    tree's branch points, so the groups are its segments and ``prefix_tree``'s value is constant inside each
    (docs/algorithm.md, "Tree rollouts").

    Args:
        response_ids: (B, T) token ids.
        attention_mask: (B, T) 0/1, 1 at the positions each reply has.
        response_mask: (B, T) 0/1, the trained positions (0 on a copied prefix with ``shared_prefix: once``).
        index: (B,) prompt ids (verl's ``uid``).
        prefixes: :func:`prompt_prefixes` of these inputs, when the caller has them; None computes them.

    Returns:
        (B, T) bool: True at ``t - 1`` for every branch point ``t`` of the row and at its last trained position,
        False wherever ``response_mask`` is 0 (a masked position ends a group by itself).
    """
    B, T = response_ids.shape
    if attention_mask.shape != (B, T) or response_mask.shape != (B, T):
        raise ValueError(f"attention_mask and response_mask must have the shape of response_ids {(B, T)}, got "
                         f"{tuple(attention_mask.shape)} and {tuple(response_mask.shape)}")
    ends = torch.zeros((B, T), dtype=torch.bool, device=response_ids.device)
    lengths = attention_mask.long().sum(dim=1)
    for rows, shared in prefixes or prompt_prefixes(response_ids, attention_mask, index):
        for k, b in enumerate(rows.tolist()):
            for t in shared[k].tolist():
                if 0 < t < int(lengths[b]):
                    ends[b, t - 1] = True
    valid = response_mask.bool()
    last = torch.where(valid.any(dim=1), T - 1 - valid.flip(dims=[1]).int().argmax(dim=1), torch.full((B,), -1))
    has = last >= 0
    ends[has.nonzero(as_tuple=True)[0], last[has]] = True
    return ends & valid


def _check_shapes(response_ids: torch.Tensor, attention_mask: torch.Tensor, scores: torch.Tensor) -> None:
    _check_replies(response_ids, attention_mask)
    if not isinstance(scores, torch.Tensor) or scores.shape != response_ids.shape[:1]:
        raise ValueError(f"scores must have shape ({response_ids.shape[0]},), got {describe(scores)}")


def _check_replies(response_ids: torch.Tensor, attention_mask: torch.Tensor) -> None:
    if not isinstance(response_ids, torch.Tensor) or response_ids.dim() != 2:
        raise ValueError(f"response_ids must be a (B, T) tensor, got {describe(response_ids)}")
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != response_ids.shape:
        raise ValueError(f"attention_mask must have the shape of response_ids {tuple(response_ids.shape)}, "
                         f"got {describe(attention_mask)}")
