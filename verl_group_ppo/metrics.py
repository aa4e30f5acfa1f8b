"""The ``group/*`` metrics of one GROUP-PPO advantage pass (pure torch; docs/configuration.md lists them).

:func:`verl_group_ppo.core_algos.compute_group_ppo_outputs` computes them from its own results; nothing here
changes an advantage or a return. Conventions as in :mod:`verl_group_ppo.core_algos`: tensors (B, T), 0 at
masked positions.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from verl_group_ppo.config import AlgorithmSettings

__all__ = ["group_metrics", "probability_metrics", "prompts_scored_alike", "sum_of_squares"]


def group_metrics(settings: AlgorithmSettings, valid: torch.Tensor, n_valid: int, advantages: torch.Tensor,
                  sizes: torch.Tensor, tau: float, ev: float) -> dict[str, float]:
    """The ``group/*`` metrics every pass reports.

    Args:
        settings: the pass's settings (``policy_lam`` and ``critic_lam`` are reported).
        valid: (B, T) bool, the response mask; ``n_valid`` its count.
        advantages: (B, T), 0 at masked positions.
        sizes: (G,) long, valid tokens of each group.
        tau: the threshold the pass used; ``ev``: its boundary explained variance.
    """
    n_groups = len(sizes)
    n_responses = int(torch.count_nonzero(valid.any(dim=1)))
    quantiles = _integer_quantiles(sizes, (0.5, 0.9)) if n_groups else [0.0, 0.0]
    metrics = {
        "group/num_groups": float(n_groups),
        "group/mean_group_size": n_valid / n_groups if n_groups else 0.0,
        "group/max_group_size": float(sizes.max()) if n_groups else 0.0,
        "group/size_p50": quantiles[0],
        "group/size_p90": quantiles[1],
        "group/groups_per_response": n_groups / n_responses if n_responses else 0.0,
        "group/compression_ratio": 1.0 - n_groups / n_valid if n_valid else 0.0,
        "group/threshold": float(tau),
        "group/boundary_explained_variance": ev,
        "group/policy_lam": settings.policy_lam,
        "group/critic_lam": settings.critic_lam,
    }
    metrics.update(_advantage_metrics(advantages, valid, n_valid))
    return metrics


def probability_metrics(old_log_probs: torch.Tensor, valid: torch.Tensor, endpoints: torch.Tensor,
                        starts: torch.Tensor) -> dict[str, float]:
    """Mean old-policy probability at group endpoints, at group starts, and at the other valid tokens
    (for rules that read old log-probs). All arguments (B, T); NaN for an empty selection."""
    probs = old_log_probs.double().exp()

    def mean_at(sel: torch.Tensor) -> float:
        return float(probs[sel].mean()) if bool(sel.any()) else math.nan

    return {"group/prob_at_endpoints": mean_at(endpoints),
            "group/prob_at_group_starts": mean_at(starts),
            "group/prob_elsewhere": mean_at(valid & ~endpoints & ~starts)}


def prompts_scored_alike(scores: torch.Tensor, prompt_ids: np.ndarray) -> float:
    """The fraction of prompts whose replies all got the same score: no estimator has a signal there, and a value
    source that reads the replies' own rewards (``prefix_tree``) reads them perfectly. At 1.0 the step's boundary
    explained variance says nothing about the values, and the trainer leaves it out of the step's metrics.

    Args:
        scores: (B,) each reply's score.
        prompt_ids: (B,) int prompt ids 0..P-1 (:func:`verl_group_ppo.estimator.checks.prompt_ids`).

    Returns:
        In [0, 1]; NaN for an empty batch.
    """
    if scores.dim() != 1 or scores.shape[0] != len(prompt_ids):
        raise ValueError(f"scores must have shape ({len(prompt_ids)},) (one per reply), got {tuple(scores.shape)}")
    if len(prompt_ids) == 0:
        return math.nan
    values = scores.detach().double().cpu().numpy()
    n_prompts = int(prompt_ids.max()) + 1
    low = np.full(n_prompts, np.inf)
    high = np.full(n_prompts, -np.inf)
    np.minimum.at(low, prompt_ids, values)
    np.maximum.at(high, prompt_ids, values)
    present = np.bincount(prompt_ids, minlength=n_prompts) > 0
    return float(np.mean(low[present] == high[present]))


def sum_of_squares(x: torch.Tensor) -> float:
    """Sum of ``x**2`` as a Python float (``vector_norm``: fast at every size, unlike ``torch.dot`` on CPU)."""
    return float(torch.linalg.vector_norm(x)) ** 2


def sum_float64(x: torch.Tensor) -> float:
    """Sum of ``x``, accumulated in float64, as a Python float (numpy on CPU: ten times faster there than torch's
    float64 sum of a float32 tensor)."""
    if x.device.type == "cpu" and x.is_contiguous():
        return float(np.add.reduce(x.numpy().reshape(-1), dtype=np.float64))
    return float(x.sum(dtype=torch.float64))


def _advantage_metrics(advantages: torch.Tensor, valid: torch.Tensor, n_valid: int) -> dict[str, float]:
    """Mean, std, min and max of the advantages over valid positions (0 each for an empty batch)."""
    if not n_valid:
        return {f"group/advantage_{k}": 0.0 for k in ("mean", "std", "min", "max")}
    mean = sum_float64(advantages) / n_valid
    std = max(sum_of_squares(advantages) / n_valid - mean**2, 0.0) ** 0.5
    low, high = _min_max_at(advantages, valid, n_valid)
    return {"group/advantage_mean": mean, "group/advantage_std": std, "group/advantage_min": low,
            "group/advantage_max": high}


def _min_max_at(x: torch.Tensor, valid: torch.Tensor, n_valid: int) -> tuple[float, float]:
    """Min and max of ``x`` over valid positions, where ``x`` is 0 at masked ones.

    The unmasked min/max is exact unless it is the 0 of a masked position; only then mask explicitly.
    """
    low, high = (float(v) for v in torch.aminmax(x))
    if n_valid < x.numel() and (low == 0.0 or high == 0.0):
        selected = x[valid]
        low, high = float(selected.min()), float(selected.max())
    return low, high


def _integer_quantiles(x: torch.Tensor, qs: Sequence[float]) -> list[float]:
    """``torch.quantile(x, qs)`` (linear interpolation) for a non-empty (N,) tensor of small non-negative
    integers, through a histogram instead of a sort."""
    cumulative = torch.cumsum(torch.bincount(x), 0)
    n = int(cumulative[-1])
    out = []
    for q in qs:
        rank = q * (n - 1)
        bounds = torch.tensor([math.floor(rank), math.ceil(rank)], device=cumulative.device)
        low, high = torch.searchsorted(cumulative, bounds, right=True).tolist()
        out.append(low + (high - low) * (rank - math.floor(rank)))
    return out
