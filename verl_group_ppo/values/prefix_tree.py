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
"""

from __future__ import annotations

import torch

from verl_group_ppo.core_algos import IndexLike
from verl_group_ppo.values.batch import BatchFields, BoundaryValues, describe, prompt_rows

__all__ = ["prefix_tree_source", "prefix_tree_values", "shared_prefix_lengths"]


def prefix_tree_source(fields: BatchFields) -> BoundaryValues:
    """The prefix tree's values for a batch (reads ``responses``, ``reply_lengths``, ``scores`` and ``uid``); the
    estimator finds the groups."""
    exists = fields.reply_positions("prefix_tree")
    return BoundaryValues(values=prefix_tree_values(fields.require("responses", "prefix_tree"), exists,
                                                    fields.require("scores", "prefix_tree"),
                                                    fields.require("uid", "prefix_tree")))


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
                       index: IndexLike) -> torch.Tensor:
    """The prefix tree's value before every response position (module docstring).

    ``V[b, t]`` = mean of ``scores[j]`` over the replies j with ``index[j] == index[b]`` whose first t positions
    equal reply b's (:func:`shared_prefix_lengths` >= t); reply b itself always counts.

    Args:
        response_ids: (B, T) token ids.
        attention_mask: (B, T) 0/1, the response part of verl's attention mask.
        scores: (B,) float, each reply's reward (the sum of its token-level rewards).
        index: (B,) prompt ids (verl's ``uid``: str or int).

    Returns:
        (B, T) values in ``scores``' dtype (float32 when it is not floating); callers read them at valid
        positions only.
    """
    _check_shapes(response_ids, attention_mask, scores)
    groups = prompt_rows(index, response_ids.shape[0])
    B, T = response_ids.shape
    dtype = scores.dtype if scores.is_floating_point() else torch.float32
    values = torch.empty((B, T), dtype=dtype, device=scores.device)
    positions = torch.arange(T, device=response_ids.device)
    for rows in groups:
        shared = shared_prefix_lengths(response_ids[rows], attention_mask[rows])  # (n, n)
        member = (shared[:, :, None] >= positions).to(dtype)  # (n, n, T): j shares b's first t positions
        total = torch.einsum("bjt,j->bt", member, scores[rows].to(dtype))
        values[rows] = total / member.sum(dim=1)
    return values


def _check_shapes(response_ids: torch.Tensor, attention_mask: torch.Tensor, scores: torch.Tensor) -> None:
    if not isinstance(response_ids, torch.Tensor) or response_ids.dim() != 2:
        raise ValueError(f"response_ids must be a (B, T) tensor, got {describe(response_ids)}")
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != response_ids.shape:
        raise ValueError(f"attention_mask must have the shape of response_ids {tuple(response_ids.shape)}, "
                         f"got {describe(attention_mask)}")
    if not isinstance(scores, torch.Tensor) or scores.shape != response_ids.shape[:1]:
        raise ValueError(f"scores must have shape ({response_ids.shape[0]},), got {describe(scores)}")
