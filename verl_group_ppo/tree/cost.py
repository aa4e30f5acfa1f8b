"""What a tree rollout cost, per step (pure torch, no verl imports)."""

from __future__ import annotations

import torch

__all__ = ["tree_round_seconds", "tree_token_counts"]


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


def tree_round_seconds(levels: torch.Tensor, seconds: torch.Tensor) -> dict[str, float]:
    """How long a sample of each round waited on the server: the roots are round 0, the samples branching at
    level l round l. ``group/tree_round{l}_generate_s`` is the mean over round l's samples of their time in
    the server's ``generate``, all its pieces together (a branch starts once its parent's reply reaches the branch
    point, so the rounds overlap, within a tree and across a batch's trees).

    Args:
        levels: (B,) long, each row's branch level (0 for a root).
        seconds: (B,) float, each row's time in ``generate``.
    """
    if levels.shape != seconds.shape:
        raise ValueError(f"seconds must have the shape of levels {tuple(levels.shape)}, got {tuple(seconds.shape)}")
    return {f"group/tree_round{level}_generate_s": float(seconds[levels == level].double().mean())
            for level in sorted(set(levels.tolist()))}
