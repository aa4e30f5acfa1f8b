"""The demo's arms: one record per advantage estimator, the only place the list of arms is spelled.

Every arm runs the same RL loop (:mod:`.rl`); an :class:`Arm` says what differs: how advantages and
critic targets are computed, whether there is a critic and how its loss is taken, and how the arm is
labelled and coloured in the outputs.

* ``group_ppo``            - ours: ``compute_group_ppo_outputs`` with the adaptive threshold; the critic is
                             trained at group boundaries only (docs/algorithm.md, step 7).
* ``group_ppo_all_tokens`` - the same with ``critic_loss_on: all_tokens``.
* ``gae``                  - PPO: verl's ``compute_gae_advantage_return`` with ``lam``.
* ``gae_decoupled``        - PPO with decoupled-lambda GAE: verl's GAE with ``policy_lam`` for the
                             advantages and again with ``critic_lam`` for the critic's returns.
* ``sae``                  - SAE's estimator as GROUP-PPO settings: groups start at low-probability tokens
                             (``boundary_rule: low_prob``), each token keeps its own advantage with lambda
                             applied only at group ends (``within_group: per_token``); the critic is trained
                             on every token, as PPO's (docs/faq.md says how this differs from the paper).
* ``group_ppo_per_token``  - ``group_ppo`` with ``within_group: per_token`` and nothing else changed (the
                             one-key ablation of SAE's estimator).
* ``endpoint_loss``        - the "sparse-loss" GROUP-PPO of the original design notes: token-level GAE
                             advantages with the actor's loss only at group endpoints
                             (``policy_loss_on: endpoints``); critic at group boundaries, as ``group_ppo``.
* ``vapo``                 - VAPO's estimator as GROUP-PPO settings: token level (``group_max_size: 1``),
                             each response's policy lambda 1 - 1/(0.05 L) (``length_adaptive_alpha: 0.05``),
                             critic targets with ``critic_lam: 1``; critic on every token.
* ``grpo``                 - verl's ``compute_grpo_outcome_advantage``; no critic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch

# critic-loss modes
NO_CRITIC = None
ALL_TOKENS = "all_tokens"  # verl's value loss, unchanged, on every response token
BOUNDARIES = "boundaries"  # verl's value loss with GROUP-PPO's boundary weights (docs/algorithm.md, step 7)


@dataclass
class AdvantageInputs:
    """One training batch as an estimator sees it. Tensors are (B, T) unless noted.

    Attributes:
        rewards: token-level rewards (the verifier's 0/1 at the last valid token).
        mask: response mask, float 0/1.
        values: critic values V (None for arms without a critic).
        index: (B,) prompt ids (verl's ``uid``).
        old_log_probs: the sampling policy's log-probs.
        settings: the arm's :class:`~verl_group_ppo.config.AlgorithmSettings`.
        threshold: GROUP-PPO's :class:`~verl_group_ppo.core_algos.AdaptiveThreshold` (None for other arms).
    """

    rewards: torch.Tensor
    mask: torch.Tensor
    values: Optional[torch.Tensor]
    index: np.ndarray
    old_log_probs: torch.Tensor
    settings: Any
    threshold: Any = None


@dataclass
class Advantages:
    """An estimator's output: (B, T) advantages and returns (critic targets), critic-loss weights for the
    ``boundaries`` mode, ``metrics`` to log, and GROUP-PPO's full outputs (``groups``) when it has them."""

    advantages: torch.Tensor
    returns: torch.Tensor
    critic_weights: Optional[torch.Tensor] = None
    metrics: dict[str, float] = field(default_factory=dict)
    groups: Any = None


@dataclass(frozen=True)
class Arm:
    """One estimator of the comparison.

    Attributes:
        name: the CLI and results name.
        label: the name in tables and plots.
        color: matplotlib colour of its curves.
        critic_loss_on: :data:`NO_CRITIC` (None), :data:`ALL_TOKENS` or :data:`BOUNDARIES`.
        advantage: ``AdvantageInputs -> Advantages``.
        uses_groups: GROUP-PPO: it has groups and an adaptive threshold (and group samples to draw).
        group_params: ``group_params`` the arm's definition fixes (beside its critic-loss mode).
    """

    name: str
    label: str
    color: str
    critic_loss_on: Optional[str]
    advantage: Callable[[AdvantageInputs], Advantages]
    uses_groups: bool = False
    group_params: dict[str, Any] = field(default_factory=dict)

    @property
    def needs_critic(self) -> bool:
        return self.critic_loss_on is not NO_CRITIC

    def group_overrides(self) -> dict[str, Any]:
        """The ``group_params`` the arm itself fixes: its critic-loss mode and definition, for GROUP-PPO arms."""
        return {"critic_loss_on": self.critic_loss_on, **self.group_params} if self.uses_groups else {}


def _gae(inp: AdvantageInputs) -> Advantages:
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    adv, ret = compute_gae_advantage_return(inp.rewards, inp.values, inp.mask, gamma=inp.settings.gamma,
                                            lam=inp.settings.lam)
    return Advantages(adv, ret)


def decoupled_gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                  policy_lam: float, critic_lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled-lambda GAE from verl's GAE: advantages with ``policy_lam``, returns with ``critic_lam``.

    All tensors (B, T). verl's GAE is run once when the two lambdas are equal, else twice.
    """
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=gamma, lam=policy_lam)
    if critic_lam != policy_lam:
        _, ret = compute_gae_advantage_return(rewards, values, mask, gamma=gamma, lam=critic_lam)
    return adv, ret


def _gae_decoupled(inp: AdvantageInputs) -> Advantages:
    s = inp.settings
    adv, ret = decoupled_gae(inp.rewards, inp.values, inp.mask, s.gamma, s.policy_lam, s.critic_lam)
    return Advantages(adv, ret, metrics={"gae/policy_lam": float(s.policy_lam),
                                         "gae/critic_lam": float(s.critic_lam)})


def _grpo(inp: AdvantageInputs) -> Advantages:
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    adv, ret = compute_grpo_outcome_advantage(inp.rewards, inp.mask, inp.index,
                                              norm_adv_by_std_in_grpo=inp.settings.norm_adv_by_std_in_grpo)
    return Advantages(adv, ret)


def _group_ppo(inp: AdvantageInputs) -> Advantages:
    """GROUP-PPO's advantage step, then one adaptive-threshold update (the new tau applies next batch)."""
    from verl_group_ppo.core_algos import compute_group_ppo_outputs

    out = compute_group_ppo_outputs(inp.rewards, inp.mask, values=inp.values, settings=inp.settings,
                                    index=inp.index, old_log_probs=inp.old_log_probs,
                                    threshold=inp.threshold.value)
    inp.threshold.update(out)
    metrics = {**out.metrics, "group/next_threshold": float(inp.threshold.value)}
    return Advantages(out.advantages, out.returns, out.critic_loss_weights, metrics, out)


#: the ``sae`` arm's definition: cuts before tokens the sampling policy gave probability < 0.2 (SAE's
#: threshold p = 0.2) and nowhere else (no length cap: a cap far above any response), per-token advantages
#: inside the segments; lambdas stay the package's (policy_lam 0.95, critic_lam = algorithm.lam).
#: docs/faq.md says how this arm and the paper differ.
SAE_GROUP_PARAMS: dict[str, Any] = {"within_group": "per_token", "boundary_rule": "low_prob",
                                    "low_prob_threshold": 0.2, "group_max_size": 1_000_000}

#: the ``endpoint_loss`` arm's definition (everything else at the package defaults, as ``group_ppo``)
ENDPOINT_LOSS_GROUP_PARAMS: dict[str, Any] = {"policy_loss_on": "endpoints"}
#: the ``vapo`` arm's definition: every token its own group (token-level GAE), VAPO's alpha, Monte Carlo targets
VAPO_GROUP_PARAMS: dict[str, Any] = {"group_max_size": 1, "adaptive_threshold": False,
                                     "length_adaptive_alpha": 0.05, "critic_lam": 1.0}

ARMS: dict[str, Arm] = {a.name: a for a in (
    Arm("group_ppo", "GROUP-PPO", "#d62728", BOUNDARIES, _group_ppo, uses_groups=True),
    Arm("group_ppo_all_tokens", "GROUP-PPO (critic on all tokens)", "#ff7f0e", ALL_TOKENS, _group_ppo,
        uses_groups=True),
    Arm("gae", "PPO (GAE)", "#1f77b4", ALL_TOKENS, _gae),
    Arm("gae_decoupled", "PPO (decoupled-lambda GAE)", "#9467bd", ALL_TOKENS, _gae_decoupled),
    Arm("sae", "SAE (per-token, low-prob cuts)", "#8c564b", ALL_TOKENS, _group_ppo, uses_groups=True,
        group_params=SAE_GROUP_PARAMS),
    Arm("group_ppo_per_token", "GROUP-PPO (per-token within groups)", "#e377c2", BOUNDARIES, _group_ppo,
        uses_groups=True, group_params={"within_group": "per_token"}),
    Arm("endpoint_loss", "GROUP-PPO (policy loss at endpoints)", "#bcbd22", BOUNDARIES, _group_ppo,
        uses_groups=True, group_params=ENDPOINT_LOSS_GROUP_PARAMS),
    Arm("vapo", "VAPO (length-adaptive lambda)", "#17becf", ALL_TOKENS, _group_ppo, uses_groups=True,
        group_params=VAPO_GROUP_PARAMS),
    Arm("grpo", "GRPO", "#2ca02c", NO_CRITIC, _grpo),
)}
#: the arms a plain ``python -m experiments.demo`` compares
DEFAULT_ARMS = ("group_ppo", "gae", "grpo")


def get_arm(name: str) -> Arm:
    """The arm called ``name``; ValueError listing the known arms otherwise."""
    if name not in ARMS:
        raise ValueError(f"unknown estimator {name!r}; choose from {', '.join(ARMS)}")
    return ARMS[name]
