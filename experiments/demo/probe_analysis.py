"""The estimator-quality probe's measurements: Monte Carlo values, estimator configurations, and the two
scores (pure functions over tensors; the orchestration is in :mod:`.probe`).

For sampled responses we know, by K Monte Carlo completions from every prefix, the true value
``V_mc[b, t]`` of the state before response token t under the sampling policy. The Monte Carlo advantage
of token t is then ``V_mc[t+1] - V_mc[t]`` (``r - V_mc[L-1]`` at the last token, whose reward is known).
Every estimator configuration gives per-token advantages from the same responses, with the trained critic's
values or, as an upper bound, with ``V_mc`` in the critic's place. Two scores per configuration:

* ``correlation``: Pearson correlation of its per-token advantages with the Monte Carlo advantages over
  every valid token of the batch (how much of the true credit signal it carries);
* ``blame``: in failed responses, the share of the response's negative advantage that sits on the first
  wrong token (the verifier knows where the solution first went wrong); GRPO's flat advantage gives 1/L.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch


@dataclass(frozen=True)
class EstimatorConfig:
    """One row of the probe's table.

    Attributes:
        name: row label, e.g. ``gae lam=0.95`` or ``group_ppo variance size=8 lam=0.9``.
        estimator: ``gae``, ``grpo`` or ``group_ppo``.
        lam: GAE's lambda, or GROUP-PPO's ``policy_lam``.
        group_params: GROUP-PPO's ``algorithm.group_params`` (adaptation is resolved by :func:`settle_threshold`).
    """

    name: str
    estimator: str
    lam: float = 1.0
    group_params: dict[str, Any] = field(default_factory=dict)


def default_configs() -> list[EstimatorConfig]:
    """GAE at several lambdas, GRPO, and GROUP-PPO with each boundary rule and adaptive target at two lambdas."""
    configs = [EstimatorConfig(f"gae lam={lam}", "gae", lam) for lam in (1.0, 0.95, 0.9, 0.8, 0.5)]
    configs.append(EstimatorConfig("grpo", "grpo"))
    group_variants = {
        "variance tau=1": {"adaptive_threshold": False},
        "variance target=ev": {"adaptive_target": "explained_variance"},
        "variance target=size4": {"adaptive_target": "group_size", "target_group_size": 4.0},
        "variance target=size8": {"adaptive_target": "group_size", "target_group_size": 8.0},
        "fixed size=4": {"boundary_rule": "fixed", "group_max_size": 4},
        "low_prob p<0.3": {"boundary_rule": "low_prob", "low_prob_threshold": 0.3},
        "low_prob p<0.9": {"boundary_rule": "low_prob", "low_prob_threshold": 0.9},
    }
    for lam in (1.0, 0.9):
        for label, params in group_variants.items():
            configs.append(EstimatorConfig(f"group_ppo {label} lam={lam}", "group_ppo", lam, dict(params)))
    return configs


def monte_carlo_advantages(values_mc: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) Monte Carlo advantages: ``V_mc[t+1] - V_mc[t]``, and ``r_t - V_mc[t]`` at each row's last valid
    token (rewards sit there); 0 at masked positions. Responses are right-padded (no holes)."""
    nxt = torch.zeros_like(values_mc)
    nxt[:, :-1] = values_mc[:, 1:]
    last = mask.bool() & ~torch.nn.functional.pad(mask[:, 1:].bool(), (0, 1), value=False)
    nxt = torch.where(last, torch.zeros_like(nxt), nxt)
    return ((rewards + nxt - values_mc) * mask).float()


def correlation(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    """Pearson correlation of ``a`` and ``b`` (B, T) over valid positions; NaN when either is constant."""
    sel = mask.bool()
    x, y = a[sel].detach().double(), b[sel].detach().double()
    x, y = x - x.mean(), y - y.mean()
    denom = math.sqrt(float((x * x).sum()) * float((y * y).sum()))
    return float((x * y).sum()) / denom if denom > 0 else math.nan


def blame_share(advantages: torch.Tensor, mask: torch.Tensor, first_wrong: list[Optional[int]]) -> float:
    """Mean over failed responses (``first_wrong[b]`` not None) of the share of the response's negative
    advantage mass on its first wrong token; a response with no negative advantage counts 0. NaN if none failed."""
    shares = []
    for b, w in enumerate(first_wrong):
        if w is None:
            continue
        negative = (-advantages[b].double()).clamp(min=0) * mask[b].double()
        total = float(negative.sum())
        shares.append(float(negative[w]) / total if total > 0 else 0.0)
    return float(np.mean(shares)) if shares else math.nan


def first_wrong_tokens(responses: list[list[int]], correct: list[list[int]]) -> list[Optional[int]]:
    """For each response (its valid token ids) the index of its first token that differs from the correct
    response (EOS included), None when there is none: the correct response, or one cut off by the length
    limit while still on track (it failed without a wrong token; the blame score leaves it out). A response
    that stops early is wrong at its EOS."""
    return [next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), None)
            for got, want in zip(responses, correct)]


def settle_threshold(compute: Callable[[float], Any], params: Any, iterations: int = 60) -> float:
    """The tau an adaptive target settles at on this batch: run the controller on the same batch until it stops.

    ``compute(tau)`` returns GROUP-PPO outputs at tau. The probe has one batch, not a run, so "each adaptive
    target" is represented by its fixed point on that batch (a larger ``threshold_lr`` only gets there sooner).
    """
    from verl_group_ppo.config import GroupParams
    from verl_group_ppo.core_algos import AdaptiveThreshold

    fast = GroupParams.from_config({**params.to_dict(), "threshold_lr": 0.5})
    threshold = AdaptiveThreshold(fast)
    for _ in range(iterations):
        before = threshold.value
        threshold.update(compute(before))
        if abs(threshold.value - before) <= 1e-4 * max(1.0, before):
            break
    return threshold.value


def estimator_advantages(config: EstimatorConfig, rewards: torch.Tensor, mask: torch.Tensor, values: torch.Tensor,
                         index: np.ndarray, old_log_probs: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """(B, T) unnormalised advantages of one configuration (GRPO: reward minus its prompt's mean), and a few
    facts about its groups (``groups_per_response``, ``threshold``) for the table."""
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    from verl_group_ppo.config import read_algorithm_settings
    from verl_group_ppo.core_algos import compute_group_ppo_outputs

    if config.estimator == "gae":
        _, returns = compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=config.lam)
        return (returns - values) * mask, {}
    if config.estimator == "grpo":
        return _grpo_unnormalised(rewards, mask, index), {}
    # config.lam is GROUP-PPO's policy_lam (not the package default) unless the row sets policy_lam itself
    settings = read_algorithm_settings({"gamma": 1.0, "lam": config.lam, "group_params": {
        "policy_lam": config.lam, **config.group_params, "adv_norm": "none"}})

    def run(tau: float):
        return compute_group_ppo_outputs(rewards, mask, values=values, settings=settings, index=index,
                                         old_log_probs=old_log_probs, threshold=tau)

    tau = settings.group.group_variance_threshold
    if settings.group.adaptive_threshold and settings.group.boundary_rule == "variance":
        tau = settle_threshold(run, settings.group)
    out = run(tau)
    return out.advantages, {"groups_per_response": out.metrics["group/groups_per_response"], "threshold": tau}


def _grpo_unnormalised(rewards: torch.Tensor, mask: torch.Tensor, index: np.ndarray) -> torch.Tensor:
    """Each response's reward minus the mean reward of its prompt's responses, broadcast to its tokens
    (verl's GRPO without the std scaling)."""
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    advantages, _ = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=False)
    return advantages * mask
