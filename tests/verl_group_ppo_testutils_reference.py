"""A slow, literal reference implementation of GROUP-PPO (shared/docs/GROUP_PPO_SPEC.md), for tests only.

One Python loop per response and per token, plain float64 arithmetic, written from the spec's steps
without reusing anything from the package, so the fast vectorised implementation can be checked
against it on random batches.
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
    """GROUP-PPO on one batch. ``lam`` is the advantages' lambda; ``critic_lam`` (None = ``lam``) the returns'.
    ``within_group='per_token'``: each valid token t gets A_t = delta_t + gamma * lam_t * A_{t'} (t' the next
    valid token), lam_t = ``lam`` at its group's last token and 1 inside (the spec's V3.1), not A_k.
    ``policy_lams`` (one per response) replaces ``lam`` for the advantages of each response (the
    length-adaptive lambda); the returns keep ``critic_lam``."""
    critic_lam = lam if critic_lam is None and policy_lams is None else critic_lam
    B, T = mask.shape
    m = mask.tolist()
    r = rewards.double().tolist()
    v = values.double().tolist()
    olp = old_log_probs.double().tolist() if old_log_probs is not None else None
    positions = [[t for t in range(T) if m[b][t] != 0] for b in range(B)]

    # Step 1: TD residuals over valid positions; V after the last valid position is 0.
    deltas = []
    for b in range(B):
        p = positions[b]
        d = []
        for i, t in enumerate(p):
            v_next = v[b][p[i + 1]] if i + 1 < len(p) else 0.0
            d.append(r[b][t] + gamma * v_next - v[b][t])
        deltas.append(d)
    n_valid = sum(len(p) for p in positions)
    sigma2 = sum(x * x for d in deltas for x in d) / n_valid if n_valid else 0.0

    # Step 2: endpoints.
    ends = []
    for b in range(B):
        if boundary_rule == "turn":
            ends.append(_turn_ends(positions[b], group_max_size))
            continue
        p, d = positions[b], deltas[b]
        L = len(p)
        e = [False] * L
        start, budget = 0, 0.0
        for i in range(L):
            if boundary_rule == "variance":
                budget += d[i] * d[i] / (sigma2 + eps)
            hole_next = i + 1 < L and p[i + 1] != p[i] + 1
            low_next = (boundary_rule == "low_prob" and i + 1 < L and not hole_next
                        and math.exp(olp[b][p[i + 1]]) < low_prob_threshold)
            if ((boundary_rule == "variance" and budget >= threshold) or i - start + 1 == group_max_size
                    or i == L - 1 or hole_next or low_next):
                e[i] = True
                start, budget = i + 1, 0.0
        ends.append(e)

    # Steps 3-5: segment GAE backward, groups, broadcast, returns, critic slots.
    adv = [[0.0] * T for _ in range(B)]
    ret = [[0.0] * T for _ in range(B)]
    gid = [[0] * T for _ in range(B)]
    cmask = [[0.0] * T for _ in range(B)]
    group_values = []  # (b, A_k) per group
    sizes = []
    for b in range(B):
        p, d, e = positions[b], deltas[b], ends[b]
        L = len(p)
        lam_b = lam if policy_lams is None else policy_lams[b]
        X = [0.0] * (L + 1)
        Xc = [0.0] * (L + 1)  # the same recursion with the critic's lambda, for the returns
        for i in range(L - 1, -1, -1):
            X[i] = d[i] + gamma * (lam_b if e[i] else 1.0) * X[i + 1]
            Xc[i] = d[i] + gamma * (critic_lam if e[i] else 1.0) * Xc[i + 1]
        k, i = 0, 0
        while i < L:
            k += 1
            s = i
            while not e[i]:
                i += 1
            group_values.append((b, X[s]))
            sizes.append(i - s + 1)
            cmask[b][p[s]] = 1.0
            for j in range(s, i + 1):
                adv[b][p[j]] = X[s]
                gid[b][p[j]] = k
            i += 1
        for i in range(L):
            ret[b][p[i]] = Xc[i] + v[b][p[i]]
        if within_group == "per_token":  # V3.1, written out from its own recursion
            a_next = 0.0
            for i in range(L - 1, -1, -1):
                lam_t = lam_b if e[i] else 1.0
                a_next = d[i] + gamma * lam_t * a_next
                adv[b][p[i]] = a_next

    # Boundary explained variance (population variances over critic slots).
    slots = [(b, t) for b in range(B) for t in range(T) if cmask[b][t]]
    if slots:
        rs = [ret[b][t] for b, t in slots]
        es = [ret[b][t] - v[b][t] for b, t in slots]
        ev = 1.0 - _pvar(es) / (_pvar(rs) + eps)
        ev = min(1.0, max(-1.0, ev))
    else:
        ev = float("nan")

    # Step 6: normalisation.
    if adv_norm == "batch" and n_valid >= 2:
        xs = [adv[b][t] for b in range(B) for t in positions[b]]
        mean = sum(xs) / (n_valid + 1e-8)
        var = sum((x - mean) ** 2 for x in xs) / (n_valid + 1e-8) * (n_valid / (n_valid - 1))
        scale = 1.0 / math.sqrt(var + 1e-8)
        for b in range(B):
            for t in positions[b]:
                adv[b][t] = (adv[b][t] - mean) * scale
    elif adv_norm == "prompt":
        by_prompt: dict = {}
        for b, a in group_values:
            by_prompt.setdefault(index[b], []).append(a)
        stats = {}
        for key, vals in by_prompt.items():
            if len(vals) == 1:
                stats[key] = (0.0, 1.0)
            else:
                mu = sum(vals) / len(vals)
                stats[key] = (mu, math.sqrt(sum((a - mu) ** 2 for a in vals) / (len(vals) - 1)))
        for b in range(B):
            if not positions[b]:
                continue
            mu, sd = stats[index[b]]
            for t in positions[b]:
                adv[b][t] = (adv[b][t] - mu) / (sd + eps) if norm_by_std else adv[b][t] - mu

    n_groups = len(sizes)
    weight = n_valid / n_groups if n_groups else 0.0
    f64 = torch.float64
    return ReferenceResult(
        advantages=torch.tensor(adv, dtype=f64).reshape(B, T),
        returns=torch.tensor(ret, dtype=f64).reshape(B, T),
        endpoints=torch.tensor([[False] * T if not positions[b] else
                                [t in {p for p, x in zip(positions[b], ends[b]) if x} for t in range(T)]
                                for b in range(B)], dtype=torch.bool).reshape(B, T),
        group_ids=torch.tensor(gid, dtype=torch.long).reshape(B, T),
        critic_mask=torch.tensor(cmask, dtype=f64).reshape(B, T),
        critic_loss_weights=torch.tensor(cmask, dtype=f64).reshape(B, T) * weight,
        explained_variance=ev,
        max_group_size=max(sizes) if sizes else 0,
        num_groups=n_groups,
    )


def _pvar(xs: list[float]) -> float:
    mu = sum(xs) / len(xs)
    return sum((x - mu) ** 2 for x in xs) / len(xs)


def _turn_ends(p: list[int], group_max_size: int) -> list[bool]:
    """The ``turn`` rule from its own definition: a turn is a maximal run of consecutive valid positions;
    each turn is cut into pieces of ``group_max_size`` tokens counted from the turn's start, the last piece
    ending at the turn's last token."""
    ends = []
    turn_start = 0
    for i in range(len(p)):
        if i > 0 and p[i] != p[i - 1] + 1:
            turn_start = i
        turn_last = i == len(p) - 1 or p[i + 1] != p[i] + 1
        ends.append(turn_last or (i - turn_start + 1) % group_max_size == 0)
    return ends
