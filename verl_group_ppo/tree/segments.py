"""A tree's segments as GROUP-PPO's groups, and what the tree cost (pure torch, no verl imports).

In a tree rollout the replies of a prompt share prefixes exactly, so the branch points of a row are the positions
where another reply of its prompt parts from it: ``t = shared(b, j)`` with ``0 < t < len_b``
(:func:`~verl_group_ppo.values.prefix_tree.shared_prefix_lengths`). :func:`tree_endpoints` ends a group right before
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

import torch

from verl_group_ppo.core_algos import IndexLike
from verl_group_ppo.values.batch import prompt_rows
from verl_group_ppo.values.prefix_tree import shared_prefix_lengths

__all__ = ["tree_endpoints", "tree_token_counts"]


def tree_endpoints(response_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                   index: IndexLike) -> torch.Tensor:
    """Group endpoints at the tree's branch points (module docstring).

    Args:
        response_ids: (B, T) token ids.
        attention_mask: (B, T) 0/1, 1 at the positions each reply has.
        response_mask: (B, T) 0/1, the trained positions (0 on a copied prefix with ``shared_prefix: once``).
        index: (B,) prompt ids (verl's ``uid``).

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
    for rows in prompt_rows(index, B):
        shared = shared_prefix_lengths(response_ids[rows], attention_mask[rows])  # (n, n)
        for k, b in enumerate(rows.tolist()):
            for t in shared[k].tolist():
                if 0 < t < int(lengths[b]):
                    ends[b, t - 1] = True
    valid = response_mask.bool()
    last = torch.where(valid.any(dim=1), T - 1 - valid.flip(dims=[1]).int().argmax(dim=1), torch.full((B,), -1))
    has = last >= 0
    ends[has.nonzero(as_tuple=True)[0], last[has]] = True
    return ends & valid


def tree_token_counts(reply_lengths: torch.Tensor, generated: torch.Tensor) -> dict[str, float]:
    """The tree's cost for one step: ``group/tree_generated_tokens`` (what the rollout generated: each row's own
    tail) and ``group/tree_path_tokens`` (the rows' reply tokens, shared prefixes once per row).

    Args:
        reply_lengths: (B,) each row's reply length.
        generated: (B,) the tokens each row generated itself (its reply length minus its copied prefix).
    """
    if reply_lengths.shape != generated.shape:
        raise ValueError(f"generated must have the shape of reply_lengths {tuple(reply_lengths.shape)}, "
                         f"got {tuple(generated.shape)}")
    return {"group/tree_generated_tokens": float(generated.sum()), "group/tree_path_tokens": float(reply_lengths.sum())}
