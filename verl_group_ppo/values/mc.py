"""``value_source: mc``: the value at a group start is the mean score of K continuations sampled from there.

Pure torch, no verl imports. The groups come first (step 2 on the rollout's own signals: ``fixed``, ``low_prob`` or
``turn``, never ``variance``, which needs values), then one batch of K continuations from every group start after
position 0 (:class:`ContinuationSampler`, which the run supplies: :mod:`~verl_group_ppo.values.mc_rollout` samples
through verl's rollout servers and scores with the run's reward function), then the means
(:func:`mc_boundary_values`). The value before token 0 is the prompt's mean reward over its n replies: those are n
samples from exactly that state, already paid for, so K more would only repeat them. The endpoints travel with the
values (:class:`~verl_group_ppo.values.batch.BoundaryValues`), so the estimator uses the groups the continuations
were sampled from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import torch

from verl_group_ppo.config import AlgorithmSettings
from verl_group_ppo.core_algos import IndexLike, find_group_endpoints, group_start_mask
from verl_group_ppo.estimator.checks import describe
from verl_group_ppo.values.batch import BatchFields, BoundaryValues, prompt_rows

__all__ = ["ContinuationSampler", "Continuations", "Prefix", "boundary_prefixes", "mc_boundary_values",
           "mc_endpoints", "mc_source"]


@dataclass(frozen=True)
class Prefix:
    """One boundary to continue from: its row in the batch, the prompt's token ids, the reply's tokens before the
    boundary, and what the run's reward function reads about the row besides the reply (opaque here)."""

    row: int
    prompt_ids: list[int]
    reply_ids: list[int]
    reward_input: Any = None


@dataclass(frozen=True)
class Continuations:
    """What a :class:`ContinuationSampler` returns: ``scores`` (S, K) float, the score of ``reply_ids +
    continuation`` for each of K continuations of each of S prefixes, and ``tokens``, the tokens generated."""

    scores: torch.Tensor
    tokens: int


class ContinuationSampler(Protocol):
    """The run's rollout, lent to ``mc``: K continuations of every prefix, sampled with the weights that generated
    the batch, each scored as the run scores a reply."""

    def __call__(self, prefixes: Sequence[Prefix], k: int) -> Continuations:
        ...


def mc_source(fields: BatchFields, settings: AlgorithmSettings, sampler: ContinuationSampler) -> BoundaryValues:
    """``mc``'s values, endpoints and metrics for a batch (module docstring).

    Reads ``response_mask``, ``responses``, ``scores``, ``uid`` and ``prompts`` (``old_log_probs`` for the
    ``low_prob`` rule, ``reward_inputs`` for the sampler). Metrics: ``group/mc_responses`` (continuations sampled)
    and ``group/mc_tokens`` (tokens they took).
    """
    endpoints = mc_endpoints(fields.response_mask, settings, fields.old_log_probs)
    starts = group_start_mask(endpoints, fields.response_mask)
    prompts = fields.require("prompts", "mc")
    reward_inputs = fields.reward_inputs if fields.reward_inputs is not None else [None] * len(prompts)
    prefixes = boundary_prefixes(prompts, fields.require("responses", "mc"), starts, reward_inputs)
    k = settings.group.mc_samples
    sampled = sampler(prefixes, k) if prefixes else Continuations(scores=torch.empty((0, k)), tokens=0)
    values = mc_boundary_values(starts, sampled.scores, fields.require("scores", "mc"), fields.require("uid", "mc"))
    return BoundaryValues(values=values, endpoints=endpoints,
                          metrics={"group/mc_responses": int(sampled.scores.numel()),
                                   "group/mc_tokens": int(sampled.tokens)})


def mc_endpoints(response_mask: torch.Tensor, settings: AlgorithmSettings,
                 old_log_probs: torch.Tensor | None = None) -> torch.Tensor:
    """Step 2 before any value exists: (B, T) bool group endpoints by ``group_params.boundary_rule``, which for
    ``mc`` never reads values (rewards and values are not read either: zeros stand in)."""
    group = settings.group
    return find_group_endpoints(torch.zeros_like(response_mask, dtype=torch.float32), response_mask,
                                old_log_probs=old_log_probs, gamma=settings.gamma,
                                group_max_size=group.group_max_size, group_epsilon=group.group_epsilon,
                                boundary_rule=group.boundary_rule, low_prob_threshold=group.low_prob_threshold)


def boundary_prefixes(prompts: Sequence[Sequence[int]], responses: torch.Tensor, starts: torch.Tensor,
                      reward_inputs: Sequence[Any]) -> list[Prefix]:
    """The prefixes to continue, in ``nonzero(starts[:, 1:])`` order (row by row, left to right).

    Args:
        prompts: B lists of prompt token ids (no padding).
        responses: (B, T) response token ids.
        starts: (B, T) bool, each group's first valid position (position 0 is never continued: its value is the
            prompt's mean reward, see :func:`mc_boundary_values`).
        reward_inputs: B objects handed on with each row's prefixes.
    """
    if starts.dim() != 2 or starts.shape != responses.shape:
        raise ValueError(f"starts must have the shape of responses {tuple(responses.shape)}, got {describe(starts)}")
    if len(prompts) != starts.shape[0] or len(reward_inputs) != starts.shape[0]:
        raise ValueError(f"prompts and reward_inputs must hold {starts.shape[0]} rows, got {len(prompts)} and "
                         f"{len(reward_inputs)}")
    later = starts.clone()
    later[:, 0] = False
    return [Prefix(row=row, prompt_ids=[int(t) for t in prompts[row]], reply_ids=responses[row, :start].tolist(),
                   reward_input=reward_inputs[row])
            for row, start in later.nonzero().tolist()]


def mc_boundary_values(starts: torch.Tensor, continuation_scores: torch.Tensor, scores: torch.Tensor,
                       index: IndexLike) -> torch.Tensor:
    """Monte Carlo values at group starts (module docstring).

    Args:
        starts: (B, T) bool, True at each group's first valid position.
        continuation_scores: (S, K) float, the scores of K continuations for each start that is not at position 0,
            in row-major order of ``starts`` (row by row, left to right), i.e. ``nonzero(starts[:, 1:])`` order.
        scores: (B,) float, each reply's own reward.
        index: (B,) prompt ids.

    Returns:
        (B, T) values: the mean over K at every start after position 0, the prompt's mean reward at a start at
        position 0, 0 elsewhere (no other position is read with boundaries from ``starts``).
    """
    if starts.dim() != 2 or starts.dtype != torch.bool:
        raise ValueError(f"starts must be a (B, T) bool tensor, got {describe(starts)}")
    B, T = starts.shape
    if scores.shape != (B,):
        raise ValueError(f"scores must have shape ({B},), got {tuple(scores.shape)}")
    later = starts.clone()
    later[:, 0] = False
    n_later = int(later.sum())
    if continuation_scores.dim() != 2 or continuation_scores.shape[0] != n_later or continuation_scores.shape[1] < 1:
        raise ValueError(f"continuation_scores must have shape ({n_later}, K) with K >= 1 (one row per group start "
                         f"after position 0), got {tuple(continuation_scores.shape)}")
    dtype = scores.dtype if scores.is_floating_point() else torch.float32
    values = torch.zeros((B, T), dtype=dtype, device=scores.device)
    values[later] = continuation_scores.to(dtype).mean(dim=1)
    prompt_mean = torch.empty(B, dtype=dtype, device=scores.device)
    for rows in prompt_rows(index, B):
        prompt_mean[rows] = scores[rows].to(dtype).mean()
    values[:, 0] = torch.where(starts[:, 0], prompt_mean, values[:, 0])
    return values
