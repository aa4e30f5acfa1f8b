"""What a tree rollout cost, per step (pure torch, no verl imports)."""

from __future__ import annotations

import torch

__all__ = ["tree_token_counts"]


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
