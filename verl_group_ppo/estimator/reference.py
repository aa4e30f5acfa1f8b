"""GROUP-PPO read top to bottom: the steps of docs/algorithm.md as plain Python loops, the oracle of the tests.

One Python loop per response and per token, plain float64 arithmetic, written from the steps without reusing
anything else of the package, so that :mod:`verl_group_ppo.estimator.fast` (vectorised, what verl runs) can be
checked against it on random batches. :func:`reference_group_ppo` runs the steps in order, one function each:
TD residuals (:func:`td_residuals`, step 1), endpoints (:func:`endpoints`, step 2), groups
(:func:`groups_of`, step 3), segment GAE and broadcast (:func:`segment_gae`, :func:`token_advantages`,
step 4), critic slots, returns and weights (:func:`response_outputs`, :func:`boundary_explained_variance`,
step 5), normalisation (:func:`normalise_batch`, :func:`normalise_by_prompt`, step 6). Step 4's kernel alone,
over a batch: :func:`segment_gae_batch`, the loop twin of :func:`verl_group_ppo.core_algos.segment_gae`.

Within one response, positions are indices ``i`` into its list of valid positions ``p`` (``p[i]`` the
response column), as in the spec.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass
class ReferenceResult:
    advantages: torch.Tensor  # (B, T) float64
    returns: torch.Tensor  # (B, T) float64
    endpoints: torch.Tensor  # (B, T) bool
    group_ids: torch.Tensor  # (B, T) long
    critic_mask: torch.Tensor  # (B, T) float64
    critic_loss_weights: torch.Tensor  # (B, T) float64
    explained_variance: float
    max_group_size: int
    num_groups: int


@dataclass(frozen=True)
class Cuts:
    """The settings of step 2."""

    rule: str
    threshold: float
    group_max_size: int
    eps: float
    low_prob_threshold: float


def reference_group_ppo(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    values: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    threshold: float,
    group_max_size: int,
    boundary_rule: str = "variance",
    adv_norm: str = "batch",
    norm_by_std: bool = True,
    eps: float = 1e-6,
    low_prob_threshold: float = 0.9,
    old_log_probs: Optional[torch.Tensor] = None,
    index: Optional[Sequence] = None,
    critic_lam: Optional[float] = None,
    within_group: str = "broadcast",
    policy_lams: Optional[Sequence[float]] = None,
) -> ReferenceResult:
    """GROUP-PPO on one batch; all tensors (B, T).

    ``lam`` is the advantages' lambda, ``critic_lam`` the returns' (None = ``lam``, with or without
    ``policy_lams``). ``policy_lams`` (one per response, the length-adaptive lambda) replaces ``lam`` for the
    advantages of each response. ``within_group='per_token'``: each valid token keeps its own X (the spec's
    V3.1) instead of its group's A_k.
    """
    B, T = mask.shape
    lams = per_response_lambdas(lam, policy_lams, B)
    critic_lam = lam if critic_lam is None else critic_lam
    m, r, v = mask.tolist(), rewards.double().tolist(), values.double().tolist()
    olp = old_log_probs.double().tolist() if old_log_probs is not None else [None] * B
    positions = [[t for t in range(T) if m[b][t] != 0] for b in range(B)]
    deltas = [td_residuals(r[b], v[b], positions[b], gamma) for b in range(B)]  # step 1
    n_valid = sum(len(p) for p in positions)
    sigma2 = sum(x * x for d in deltas for x in d) / n_valid if n_valid else 0.0
    cuts = Cuts(boundary_rule, threshold, group_max_size, eps, low_prob_threshold)
    ends = [endpoints(positions[b], deltas[b], olp[b], sigma2, cuts) for b in range(B)]  # step 2
    rows = [response_outputs(deltas[b], ends[b], [v[b][t] for t in positions[b]], gamma, lams[b], critic_lam,
                             within_group) for b in range(B)]  # steps 3-5
    ev = boundary_explained_variance(rows, eps)
    if adv_norm == "batch":  # step 6
        normalise_batch([row.advantages for row in rows])
    elif adv_norm == "prompt":
        normalise_by_prompt(rows, index, norm_by_std, eps)
    return batch_result(rows, positions, T, ev)


@dataclass
class ResponseOutputs:
    """One response's outputs, per index into its valid positions (before normalisation)."""

    ends: list[bool]
    advantages: list[float]
    returns: list[float]  # X + V with the critic's lambda
    values: list[float]
    group_ids: list[int]
    groups: list[tuple[int, int]]  # (first, last) index of every group; the first is its critic slot
    group_advantages: list[float]  # A_k = X at the group's first index, with the advantages' lambda


def per_response_lambdas(lam: float, policy_lams: Optional[Sequence[float]], batch_size: int) -> list[float]:
    """The advantages' lambda of every response: ``policy_lams`` when given (one per response), else ``lam``."""
    if policy_lams is None:
        return [lam] * batch_size
    if len(policy_lams) != batch_size:
        raise ValueError(f"policy_lams must hold one lambda per response ({batch_size}), got {len(policy_lams)}")
    return [float(x) for x in policy_lams]


def td_residuals(r: list[float], v: list[float], p: list[int], gamma: float) -> list[float]:
    """Step 1: ``delta_i = r[p_i] + gamma * V[p_{i+1}] - V[p_i]``, V after the last valid position = 0."""
    out = []
    for i, t in enumerate(p):
        v_next = v[p[i + 1]] if i + 1 < len(p) else 0.0
        out.append(r[t] + gamma * v_next - v[t])
    return out


def endpoints(p: list[int], d: list[float], olp: Optional[list[float]], sigma2: float, cuts: Cuts) -> list[bool]:
    """Step 2 for one response: True at the index of every group's last token."""
    if cuts.rule == "turn":
        return turn_ends(p)
    L = len(p)
    e = [False] * L
    start, budget = 0, 0.0
    for i in range(L):
        if cuts.rule == "variance":
            budget += d[i] * d[i] / (sigma2 + cuts.eps)
        hole_next = i + 1 < L and p[i + 1] != p[i] + 1
        low_next = (cuts.rule == "low_prob" and i + 1 < L and not hole_next
                    and math.exp(olp[p[i + 1]]) < cuts.low_prob_threshold)
        if ((cuts.rule == "variance" and budget >= cuts.threshold) or i - start + 1 == cuts.group_max_size
                or i == L - 1 or hole_next or low_next):
            e[i] = True
            start, budget = i + 1, 0.0
    return e


def turn_ends(p: list[int]) -> list[bool]:
    """The ``turn`` rule from its own definition: a turn is a maximal run of consecutive valid positions,
    and each turn is one group, however long (``group_max_size`` plays no part)."""
    return [i == len(p) - 1 or p[i + 1] != p[i] + 1 for i in range(len(p))]


def groups_of(e: list[bool]) -> list[tuple[int, int]]:
    """Step 3: every group's (first, last) index, in order."""
    groups, start = [], 0
    for i, is_end in enumerate(e):
        if is_end:
            groups.append((start, i))
            start = i + 1
    return groups


def segment_gae(d: list[float], e: list[bool], gamma: float, lam: float) -> list[float]:
    """Step 4: ``X_i = delta_i + gamma * (lam if i is an endpoint else 1) * X_{i+1}``, ``X_L = 0``."""
    x = [0.0] * (len(d) + 1)
    for i in range(len(d) - 1, -1, -1):
        x[i] = d[i] + gamma * (lam if e[i] else 1.0) * x[i + 1]
    return x[:-1]


def segment_gae_batch(deltas: torch.Tensor, ends: torch.Tensor, mask: torch.Tensor, gamma: float,
                      lam) -> torch.Tensor:
    """The loop twin of :func:`verl_group_ppo.core_algos.segment_gae`: :func:`segment_gae` over each response's valid positions, with
    that response's lambda (``lam``: one float, or one per response); (B, T) float64, 0 at masked positions."""
    B, T = mask.shape
    lams = [float(x) for x in lam] if isinstance(lam, (torch.Tensor, list, tuple)) else [float(lam)] * B
    d, e, m = deltas.double().tolist(), ends.bool().tolist(), mask.tolist()
    out = [[0.0] * T for _ in range(B)]
    for b in range(B):
        p = [t for t in range(T) if m[b][t] != 0]
        x = segment_gae([d[b][t] for t in p], [e[b][t] for t in p], gamma, lams[b])
        for i, t in enumerate(p):
            out[b][t] = x[i]
    return torch.tensor(out, dtype=torch.float64).reshape(B, T)


def token_advantages(x: list[float], groups: list[tuple[int, int]], within_group: str) -> list[float]:
    """Step 4's output: ``A_k = X_{s_k}`` for every token of group k (broadcast), or each token's own X
    (``per_token``: the spec's V3.1 recursion is step 4's, lambda at group ends only)."""
    if within_group == "per_token":
        return list(x)
    return [x[s] for s, last in groups for _ in range(s, last + 1)]


def response_outputs(d: list[float], e: list[bool], v: list[float], gamma: float, lam: float, critic_lam: float,
                     within_group: str) -> ResponseOutputs:
    """Steps 3-5 for one response from its TD residuals ``d``, endpoints ``e`` and values ``v`` (per index):
    the advantages with ``lam``, the returns ``X_i + V_i`` with ``critic_lam``, the groups."""
    groups = groups_of(e)
    x = segment_gae(d, e, gamma, lam)
    x_critic = segment_gae(d, e, gamma, critic_lam)
    return ResponseOutputs(
        ends=e,
        advantages=token_advantages(x, groups, within_group),
        returns=[xc + v_i for xc, v_i in zip(x_critic, v)],
        values=v,
        group_ids=[k for k, (s, last) in enumerate(groups, start=1) for _ in range(s, last + 1)],
        groups=groups,
        group_advantages=[x[s] for s, _ in groups],
    )


def boundary_explained_variance(rows: list[ResponseOutputs], eps: float) -> float:
    """``1 - Var(returns - values) / (Var(returns) + eps)`` over the critic slots (population variances),
    clipped to [-1, 1]; NaN without a slot."""
    slots = [(row.returns[s], row.values[s]) for row in rows for s, _ in row.groups]
    if not slots:
        return float("nan")
    ev = 1.0 - _pvar([ret - v for ret, v in slots]) / (_pvar([ret for ret, _ in slots]) + eps)
    return min(1.0, max(-1.0, ev))


def normalise_batch(advantages: list[list[float]]) -> None:
    """Step 6, ``batch``, in place: verl's masked_whiten over every valid token (skipped under 2 tokens)."""
    xs = [a for row in advantages for a in row]
    n = len(xs)
    if n < 2:
        return
    mean = sum(xs) / (n + 1e-8)
    var = sum((x - mean) ** 2 for x in xs) / (n + 1e-8) * (n / (n - 1))
    scale = 1.0 / math.sqrt(var + 1e-8)
    for row in advantages:
        row[:] = [(a - mean) * scale for a in row]


def normalise_by_prompt(rows: list[ResponseOutputs], index: Sequence, norm_by_std: bool, eps: float) -> None:
    """Step 6, ``prompt``, in place: per prompt id, the mean and Bessel std of its group advantages (each
    group once; one group: mean 0, std 1); ``(A - mean) / (std + eps)``, or ``A - mean``."""
    by_prompt: dict = {}
    for b, row in enumerate(rows):
        by_prompt.setdefault(index[b], []).extend(row.group_advantages)
    stats = {}
    for key, vals in by_prompt.items():
        if len(vals) < 2:
            stats[key] = (0.0, 1.0)
        else:
            mu = sum(vals) / len(vals)
            stats[key] = (mu, math.sqrt(sum((a - mu) ** 2 for a in vals) / (len(vals) - 1)))
    for b, row in enumerate(rows):
        mu, sd = stats[index[b]]
        row.advantages[:] = [(a - mu) / (sd + eps) if norm_by_std else a - mu for a in row.advantages]


def batch_result(rows: list[ResponseOutputs], positions: list[list[int]], T: int, ev: float) -> ReferenceResult:
    """The per-index outputs placed at their positions in (B, T) tensors, 0 at masked positions; the critic
    loss weights ``N_valid / N_groups`` at the slots (step 7)."""
    B = len(rows)
    adv, ret, cmask = ([[0.0] * T for _ in range(B)] for _ in range(3))
    gid, ends = [[0] * T for _ in range(B)], [[False] * T for _ in range(B)]
    for b, (row, p) in enumerate(zip(rows, positions)):
        for i, t in enumerate(p):
            adv[b][t], ret[b][t] = row.advantages[i], row.returns[i]
            gid[b][t], ends[b][t] = row.group_ids[i], row.ends[i]
        for s, _ in row.groups:
            cmask[b][p[s]] = 1.0
    sizes = [last - s + 1 for row in rows for s, last in row.groups]
    n_valid = sum(len(p) for p in positions)
    weight = n_valid / len(sizes) if sizes else 0.0
    f64 = torch.float64
    return ReferenceResult(
        advantages=torch.tensor(adv, dtype=f64).reshape(B, T),
        returns=torch.tensor(ret, dtype=f64).reshape(B, T),
        endpoints=torch.tensor(ends, dtype=torch.bool).reshape(B, T),
        group_ids=torch.tensor(gid, dtype=torch.long).reshape(B, T),
        critic_mask=torch.tensor(cmask, dtype=f64).reshape(B, T),
        critic_loss_weights=torch.tensor(cmask, dtype=f64).reshape(B, T) * weight,
        explained_variance=ev,
        max_group_size=max(sizes) if sizes else 0,
        num_groups=len(sizes),
    )


def _pvar(xs: list[float]) -> float:
    mu = sum(xs) / len(xs)
    return sum((x - mu) ** 2 for x in xs) / len(xs)
