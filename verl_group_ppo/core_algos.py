"""GROUP-PPO advantage estimation: the algorithm math (pure torch + numpy, no verl trainer imports).

Each response is cut into contiguous token groups at dynamically chosen endpoints; the critic is read
at group boundaries, each group gets one advantage (segment GAE over groups), broadcast to every token
of the group. docs/algorithm.md explains the steps cited below ("step N") with a worked example.

Where a token's advantage comes from: :func:`compute_group_ppo_outputs` and :func:`compute_group_advantage` call
:func:`_run_steps`, which runs the steps in their order as far as the advantages and returns need them:
:func:`_td_residuals` (1), :func:`_group_ends` (2), :func:`_make_groups` (3: the groups, computed once;
:func:`_group_starts` is the one definition of a group's first token, which is also its critic slot),
:func:`_segment_gae_step` (4: the critic's segment GAE, giving the returns, and the policy's, each a
:func:`_segment_gae_` loop), :func:`_normalize_advantages_` (6), :func:`_keep_endpoints_` (7, the endpoint loss).
:func:`compute_group_ppo_outputs` then reads the critic's outputs off the groups, in step order too: the group
ids (3), the critic mask (5), the boundary explained variance (6) and :func:`_boundary_weights` (7);
:class:`AdaptiveThreshold` then moves tau for the next batch. :func:`_segment_gae_step` is the one place the
policy side is read, in a plain ``if``/``elif``: the policy's X is broadcast from each group's first token
(:func:`_broadcast_from_starts_`, the default), kept per token (``within_group: per_token``), or token-level GAE
kept only at group endpoints (``policy_loss_on: endpoints``). ``length_adaptive_alpha`` gives each response its
own policy lambda (:func:`length_adaptive_lambda`, VAPO's rule). The values enter :func:`_run_steps` in one
place, as an argument of steps 1 and 4: the critic's. :func:`segment_gae` is step 4's kernel as a pure
batch-major function. The ``group/*`` metrics are computed in :mod:`verl_group_ppo.metrics`; the settings and
their defaults live in :mod:`verl_group_ppo.config`.

Conventions (verl's): tensors are (B, T) = (batch, response length); ``response_mask`` is 0/1 and may
have holes (multi-turn tool observations); ``values[b, t]`` is the critic's value of the state before
response token t. Masked positions are transparent: their rewards and values are never read (they may
hold NaN), they belong to no group and every output is 0 there.

Implementation notes. All work is vectorised over the batch. The places where the algorithm needs a
sequential pass over time (the variance budget scan, the backward segment-GAE recursion, the forward
broadcast) are loops over T whose every step is a handful of whole-batch operations on contiguous rows of
time-major (T, B) buffers; on CPU those steps run on numpy views of the same memory (about half the
per-call overhead of torch), on other devices with torch. No cumulative-product tricks: results are exact
for any gamma, lam and T. Computation is in float64 when an input is float64, else in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

from verl_group_ppo.config import (AlgorithmSettings, GroupParams, check_threshold, check_unit_interval,
                                   read_algorithm_settings)
from verl_group_ppo.metrics import group_metrics, probability_metrics, sum_of_squares

__all__ = [
    "AdaptiveThreshold",
    "GroupPPOOutputs",
    "boundary_loss_weights",
    "compute_group_advantage",
    "compute_group_ppo_outputs",
    "create_critic_endpoint_mask",
    "endpoints_to_group_ids",
    "explained_variance",
    "find_group_endpoints",
    "group_start_mask",
    "length_adaptive_lambda",
    "segment_gae",
    "update_threshold",
]

IndexLike = Union[np.ndarray, Sequence[Any], torch.Tensor]
_DEFAULTS = GroupParams()  # the package defaults, written once in verl_group_ppo.config


# ==================================================================================================
# public API


@dataclass
class GroupPPOOutputs:
    """Everything the trainer needs from one GROUP-PPO advantage pass. Tensors are (B, T), 0 at masked positions.

    Attributes:
        advantages: per-token advantages (group advantage broadcast, or each token's own with
            ``within_group: per_token``; normalised per ``adv_norm``). With ``policy_loss_on: endpoints``:
            normalised token-level GAE times ``N_valid / N_endpoints`` at group endpoints, 0 elsewhere.
        returns: segment lambda-returns ``X + V`` with ``critic_lam``: the critic's targets (never normalised).
        group_ids: long, 1-based group index within each response.
        endpoint_mask: bool, True at each group's last valid token.
        critic_mask: float 0/1, one 1 per group at its value slot (the group's first valid token).
        critic_loss_weights: float, ``N_valid / N_boundary`` at critic-mask positions (step 7,
            :func:`boundary_loss_weights` counting ``response_mask``).
        threshold: the variance threshold tau used for this batch.
        boundary_explained_variance: :func:`explained_variance` at the critic-mask positions (NaN without any).
        mean_group_size: valid tokens per group over the batch (NaN without any group).
        metrics: ``group/*`` scalars for the logger.
    """

    advantages: torch.Tensor
    returns: torch.Tensor
    group_ids: torch.Tensor
    endpoint_mask: torch.Tensor
    critic_mask: torch.Tensor
    critic_loss_weights: torch.Tensor
    threshold: float
    boundary_explained_variance: float
    mean_group_size: float
    metrics: dict[str, float] = field(default_factory=dict)


@torch.no_grad()
def compute_group_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    values: Optional[torch.Tensor] = None,
    index: Optional[IndexLike] = None,
    config: Any = None,
    old_log_probs: Optional[torch.Tensor] = None,
    threshold: Optional[float] = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GROUP-PPO advantages and returns, with verl's advantage-estimator calling convention.

    Args:
        token_level_rewards: (B, T) float rewards.
        response_mask: (B, T) 0/1 mask (bool, int or float); holes allowed.
        values: (B, T) float critic values; required (a ValueError names it when missing).
        index: (B,) prompt ids (verl's ``uid``); required for ``adv_norm='prompt'``.
        config: verl's algorithm config (DictConfig, dict, AlgoConfig or :class:`AlgorithmSettings`) with
            ``gamma``, ``lam``, ``norm_adv_by_std_in_grpo`` and ``group_params``; missing keys take defaults.
        old_log_probs: (B, T) old-policy log-probs; required for ``boundary_rule='low_prob'``.
        threshold: current variance threshold tau; None uses ``group_params.group_variance_threshold``.
        **kwargs: ignored (verl passes extra fields such as ``reward_baselines``).

    Returns:
        (advantages, returns), both (B, T) in float32 (float64 when an input is float64), 0 at masked positions.
    """
    settings = read_algorithm_settings(config)
    batch = _prepare(token_level_rewards, response_mask, values, index, old_log_probs, settings.group)
    steps = _run_steps(batch, settings, _resolve_threshold(threshold, settings.group))
    return steps.advantages, steps.returns


@torch.no_grad()
def compute_group_ppo_outputs(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    values: torch.Tensor,
    settings: AlgorithmSettings,
    index: Optional[IndexLike] = None,
    old_log_probs: Optional[torch.Tensor] = None,
    threshold: Optional[float] = None,
) -> GroupPPOOutputs:
    """One pass giving advantages, returns, groups, critic mask and weights, and ``group/*`` metrics.

    Tensors as in :func:`compute_group_advantage`; ``settings`` from
    :func:`~verl_group_ppo.config.read_algorithm_settings`. The threshold is not updated here: hand the
    outputs to :meth:`AdaptiveThreshold.update` (step 6).
    """
    if not isinstance(settings, AlgorithmSettings):
        raise ValueError(f"settings must be an AlgorithmSettings (read_algorithm_settings(config)), "
                         f"got {type(settings).__name__}")
    batch = _prepare(token_level_rewards, response_mask, values, index, old_log_probs, settings.group)
    tau = _resolve_threshold(threshold, settings.group)
    steps = _run_steps(batch, settings, tau)  # steps 1-7 for the advantages and returns
    groups, n_valid = steps.groups, batch.n_valid
    group_ids = groups.ids  # step 3's ids (made once the pass's time-major buffers are freed: peak memory)
    critic_mask = groups.first.to(steps.advantages.dtype)  # step 5
    n_groups = len(groups.sizes)
    ev = _explained_variance_at(steps.returns, values, groups.slots, settings.group.group_epsilon)  # step 6's tau
    metrics = group_metrics(settings, batch.valid_bt, n_valid, steps.advantages, groups.sizes, tau, ev)
    metrics["group/policy_lam"] = steps.policy_lam
    if old_log_probs is not None and settings.group.boundary_rule == "low_prob":
        metrics.update(probability_metrics(old_log_probs, batch.valid_bt, groups.endpoint_mask, groups.first))
    return GroupPPOOutputs(
        advantages=steps.advantages,
        returns=steps.returns,
        group_ids=group_ids,
        endpoint_mask=groups.endpoint_mask,
        critic_mask=critic_mask,
        critic_loss_weights=_boundary_weights(critic_mask, n_valid, n_groups),  # step 7
        threshold=tau,
        boundary_explained_variance=ev,
        mean_group_size=n_valid / n_groups if n_groups else math.nan,
        metrics=metrics,
    )


@torch.no_grad()
def find_group_endpoints(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    values: Optional[torch.Tensor] = None,
    old_log_probs: Optional[torch.Tensor] = None,
    gamma: float = 1.0,
    threshold: float = _DEFAULTS.group_variance_threshold,
    group_max_size: int = _DEFAULTS.group_max_size,
    group_epsilon: float = _DEFAULTS.group_epsilon,
    boundary_rule: str = _DEFAULTS.boundary_rule,
    low_prob_threshold: float = _DEFAULTS.low_prob_threshold,
) -> torch.Tensor:
    """Group endpoints (step 2): bool (B, T), True at the last valid token of every group.

    Rules: ``variance`` (a running budget of normalised squared TD residuals
    ``z = delta^2 / (mean(delta^2) + eps)`` ends a group once it reaches ``threshold``), ``fixed`` (every
    ``group_max_size`` valid tokens), ``low_prob`` (a group starts at each token whose old-policy
    probability is below ``low_prob_threshold``) and ``turn`` (one group per assistant turn, a turn being a
    maximal run of valid positions between masked tool observations). Under every rule a group ends at
    the last valid token and before a masked position (groups never span a hole); under every rule but
    ``turn`` it also ends at ``group_max_size`` tokens, which ``turn`` ignores. Turns capped at N tokens
    are ``fixed`` with ``group_max_size=N``.

    Args:
        token_level_rewards, values, response_mask: (B, T), see :func:`compute_group_advantage`.
            ``values`` is required by the ``variance`` rule.
        old_log_probs: (B, T), required by the ``low_prob`` rule.
        threshold, group_max_size, group_epsilon, boundary_rule, low_prob_threshold: as the
            ``group_params`` keys (``threshold`` is ``group_variance_threshold``), defaults from :class:`GroupParams`.
    """
    params = GroupParams(group_variance_threshold=threshold, group_max_size=group_max_size,
                         group_epsilon=group_epsilon, boundary_rule=boundary_rule,
                         low_prob_threshold=low_prob_threshold, adaptive_threshold=False)
    if values is None:
        if boundary_rule == "variance":
            raise ValueError("values is required by boundary_rule='variance'")
        values = torch.zeros_like(token_level_rewards)
    batch = _prepare(token_level_rewards, response_mask, values, None, old_log_probs, params)
    ends = _group_ends(_td_residuals(batch.values_tm, batch, gamma), batch, params, threshold)
    return _to_batch_major(ends & batch.valid_tm)


def endpoints_to_group_ids(endpoints: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Group ids (step 3): long (B, T), 1-based group index at valid positions, 0 at masked ones.

    A group starts at a valid position whose previous position is masked, is an endpoint, or does not
    exist. ``endpoints`` (B, T) bool must be False at masked positions.
    """
    valid = _check_mask(response_mask, "response_mask")
    return _group_ids(group_start_mask(endpoints, response_mask), valid)


def group_start_mask(endpoints: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Each group's first valid position (the slot of its boundary value): bool (B, T).

    A group starts at a valid position whose previous position is masked, is an endpoint, or does not
    exist. ``endpoints`` (B, T) bool (step 2's) must be False at masked positions.
    """
    valid = _check_mask(response_mask, "response_mask")
    if endpoints.shape != valid.shape:
        raise ValueError(f"endpoints must have the shape of response_mask {tuple(valid.shape)}, "
                         f"got {tuple(endpoints.shape)}")
    endpoints = endpoints.bool()
    if bool((endpoints & ~valid).any()):
        raise ValueError("endpoints must be False at masked positions of response_mask")
    return _group_starts((endpoints | ~valid).t(), valid.t()).t()  # a masked position ends a group too


@torch.no_grad()
def segment_gae(deltas: torch.Tensor, ends: torch.Tensor, response_mask: torch.Tensor, gamma: float,
                lam: Union[float, torch.Tensor]) -> torch.Tensor:
    """Segment GAE (step 4) as a pure function: the TD residuals' X, backward over each response's valid tokens.

    ``X_i = delta_i + gamma * (lam if i ends a group else 1) * X_{i+1}``, X after the last valid token = 0.
    Masked positions are skipped (their residual and end flag are never read) and get 0. Every token an end
    gives token-level GAE (``X + V`` is verl's GAE return); one end per response gives ``R - V`` at lam = 1.

    Args:
        deltas: (B, T) float TD residuals (step 1), any value at masked positions.
        ends: (B, T) bool (or 0/1), True at the last valid token of every group (step 2's endpoints).
        response_mask: (B, T) 0/1, holes allowed.
        gamma: discount in [0, 1].
        lam: lambda in [0, 1], or a (B,) tensor of per-response lambdas (as :func:`length_adaptive_lambda`).

    Returns:
        X, (B, T), a new tensor in float32 (float64 when ``deltas`` is float64), 0 at masked positions; the
        inputs are left as they were.
    """
    valid = _check_mask(response_mask, "response_mask")
    _check_float(deltas, "deltas", tuple(valid.shape), response_mask.device)
    if not isinstance(ends, torch.Tensor) or ends.shape != valid.shape:
        raise ValueError(f"ends must be a tensor of the shape of response_mask {tuple(valid.shape)}, "
                         f"got {_describe(ends)}")
    gamma = check_unit_interval(gamma, "gamma")
    dtype = torch.float64 if deltas.dtype == torch.float64 else torch.float32
    if isinstance(lam, torch.Tensor):
        if lam.shape != (valid.shape[0],) or not bool(((lam >= 0) & (lam <= 1)).all()):
            raise ValueError(f"lam must be in [0, 1], or a ({valid.shape[0]},) tensor of such, got {_describe(lam)}")
        lam = lam.to(device=deltas.device, dtype=dtype)
    else:
        lam = check_unit_interval(lam, "lam")
    invalid_tm = ~valid.t().contiguous()
    x = _time_major(deltas, dtype).masked_fill_(invalid_tm, 0.0)
    _segment_gae_(x, ends.t().bool().contiguous(), invalid_tm, gamma, lam)
    return _to_batch_major(x.masked_fill_(invalid_tm, 0.0))


def create_critic_endpoint_mask(response_mask: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Critic boundary mask (step 5): (B, T) 0/1 with exactly one 1 per group.

    The 1 sits at the group's *first* valid position. Why not at its last token, as the original design
    notes put it: verl's ``values[b, t]`` is the critic's value of the state before response token t, and
    the value a group's advantage uses as its baseline is V(state before the group's first token) =
    ``values[b, first]``; the bootstrap value at the group's end is the *next* group's first slot. So the
    slot the critic is consulted at (and trained at) for group k is its first valid position.

    Args:
        response_mask: (B, T) 0/1.
        group_ids: (B, T) integer group ids from :func:`endpoints_to_group_ids`.

    Returns:
        (B, T) mask in ``response_mask``'s dtype when floating, else float32.
    """
    valid = _check_mask(response_mask, "response_mask")
    if group_ids.shape != valid.shape:
        raise ValueError(f"group_ids must have the shape of response_mask {tuple(valid.shape)}, "
                         f"got {tuple(group_ids.shape)}")
    changes = torch.ones_like(valid)  # the group changes after position t: the ends _group_starts reads
    torch.ne(group_ids[:, 1:], group_ids[:, :-1], out=changes[:, :-1])
    first = _group_starts(changes.t(), valid.t()).t()
    dtype = response_mask.dtype if response_mask.is_floating_point() else torch.float32
    return first.to(dtype)


def boundary_loss_weights(critic_mask: torch.Tensor, count_mask: torch.Tensor, *,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Step 7's per-position critic-loss weights: ``N / N_boundary`` where ``critic_mask`` is 1, 0 elsewhere.

    N counts the 1s of ``count_mask`` over the whole batch and N_boundary those of ``critic_mask``, so a
    token-mean over N tokens of ``loss * weights`` is the mean loss over boundary positions. The core
    counts ``response_mask`` (:attr:`GroupPPOOutputs.critic_loss_weights`); the verl trainer counts verl's
    ``loss_mask``, the count verl's engines divide by (see :mod:`verl_group_ppo.integration.critic_loss`).

    Args:
        critic_mask: (B, T) 0/1, one 1 per group (:func:`create_critic_endpoint_mask`).
        count_mask: (B, T) 0/1, the mask whose 1s are N.
        dtype: the weights' dtype (float32 by default: bf16 would round them).

    Returns:
        (B, T) weights in ``dtype``; all 0 when ``critic_mask`` has no 1.
    """
    boundary, counted = _check_mask(critic_mask, "critic_mask"), _check_mask(count_mask, "count_mask")
    if counted.shape != boundary.shape:
        raise ValueError(f"count_mask must have the shape of critic_mask {tuple(boundary.shape)}, "
                         f"got {tuple(counted.shape)}")
    return _boundary_weights(boundary.to(dtype), int(torch.count_nonzero(counted)),
                             int(torch.count_nonzero(boundary)))


def explained_variance(returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, eps: float = 1e-6) -> float:
    """How much of the returns' variance the critic explains, over the positions where ``mask`` is 1.

    ``ev = 1 - Var(returns - values) / (Var(returns) + eps)`` with population variances (in float64),
    clipped to [-1, 1]; NaN when the mask selects nothing. All tensors (B, T). With the critic mask this
    is the boundary explained variance of step 6; with the response mask, verl's ``vf_explained_var``.
    """
    return _explained_variance_at(returns, values, torch.nonzero(mask.reshape(-1)).squeeze(1), eps)


def length_adaptive_lambda(response_mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """VAPO's length-adaptive policy lambda: ``1 - 1 / (alpha * L)`` per response, clipped to [0, 1].

    Args:
        response_mask: (B, T) 0/1 (holes allowed); L is each row's count of valid tokens.
        alpha: ``group_params.length_adaptive_alpha`` (> 0).

    Returns:
        (B,) float64 lambdas; a row with no valid token gets 0 (it has nothing to weight).
    """
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < math.inf:
        raise ValueError(f"length_adaptive_alpha must be a finite number > 0, got {alpha!r}")
    lengths = _check_mask(response_mask, "response_mask").sum(dim=1, dtype=torch.float64)
    return (1.0 - 1.0 / (float(alpha) * lengths)).clamp_(0.0, 1.0)


def update_threshold(threshold: float, *, params: GroupParams, explained_variance: float = math.nan,
                     mean_group_size: float = math.nan) -> float:
    """One adaptive-threshold step (step 6 and its version-2 target), pure; the rule lives here only.

    ``adaptive_target='explained_variance'``:
    ``tau <- clip(tau * exp(threshold_lr * (target_explained_variance - ev)), min, max)``, ev clipped to
    [-1, 1]; a low ev (poor critic) grows tau, hence groups (toward GRPO), a high ev shrinks them.
    ``adaptive_target='group_size'``: ``tau <- clip(tau * (target_group_size / m) ** threshold_lr, min, max)``
    with ``m`` the batch's mean group size: larger groups than the target shrink tau, smaller grow it.
    A NaN input (a batch without valid tokens or groups) leaves tau unchanged.
    """
    if params.adaptive_target == "group_size":
        if math.isnan(mean_group_size) or mean_group_size <= 0:
            return float(threshold)
        tau = float(threshold) * (params.target_group_size / mean_group_size) ** params.threshold_lr
    else:
        if math.isnan(explained_variance):
            return float(threshold)
        ev = min(1.0, max(-1.0, float(explained_variance)))
        tau = float(threshold) * math.exp(params.threshold_lr * (params.target_explained_variance - ev))
    return min(params.max_threshold, max(params.min_threshold, tau))


class AdaptiveThreshold:
    """The variance threshold tau as training state: it owns its settings and its update rule (the shape of
    verl's ``AdaptiveKLController``). Logged every step, saved and restored with checkpoints.

    Example::

        threshold = AdaptiveThreshold(settings.group)
        out = compute_group_ppo_outputs(..., settings=settings, threshold=threshold.value)
        threshold.update(out)        # tau for the next batch
    """

    def __init__(self, params: GroupParams) -> None:
        if not isinstance(params, GroupParams):
            raise ValueError(f"params must be a GroupParams, got {type(params).__name__}")
        self.params = params
        self.value = check_threshold(params.group_variance_threshold, "group_variance_threshold")

    @property
    def adapts(self) -> bool:
        """Whether tau moves: adaptation on and the ``variance`` rule (the other rules do not read tau)."""
        return self.params.adaptive_threshold and self.params.boundary_rule == "variance"

    def update(self, outputs: GroupPPOOutputs) -> float:
        """Apply :func:`update_threshold` with this batch's outputs when :attr:`adapts`; returns the new tau."""
        if self.adapts:
            self.value = update_threshold(self.value, params=self.params,
                                          explained_variance=outputs.boundary_explained_variance,
                                          mean_group_size=outputs.mean_group_size)
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"threshold": float(self.value)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or "threshold" not in state:
            raise ValueError(f"state must be a dict with key 'threshold', got {state!r}")
        self.value = check_threshold(state["threshold"], "state['threshold']")


# ==================================================================================================
# the pass: steps 1-7 in order, in time-major (T, B) buffers


@dataclass
class _Batch:
    """Validated inputs in time-major (T, B) layout and the compute dtype.

    ``rewards_tm`` and ``values_tm`` are plain copies: their masked positions still hold whatever the
    caller had there (possibly NaN) and are never read into a result.
    """

    valid_bt: torch.Tensor  # (B, T) bool
    valid_tm: torch.Tensor  # (T, B) bool
    invalid_tm: torch.Tensor  # (T, B) bool, ~valid_tm
    rewards_tm: torch.Tensor  # (T, B)
    values_tm: torch.Tensor  # (T, B)
    old_log_probs_tm: Optional[torch.Tensor]  # (T, B), low_prob rule only
    index: Optional[np.ndarray]  # (B,) prompt ids as 0..P-1
    n_valid: int


@dataclass(frozen=True)
class _Groups:
    """The groups of one batch (step 3), made once by :func:`_make_groups` from step 2's ends and read by every
    later step: step 4's cuts and broadcast, step 5's critic slots, step 6's per-prompt statistics, step 7's
    weights and the metrics. A group's first valid token (its critic slot) is :attr:`first`, from
    :func:`_group_starts`; everything below is made from the ends when first read, and kept."""

    ends_tm: torch.Tensor  # (T, B) bool: each group's last valid token, and every masked position
    valid_tm: torch.Tensor  # (T, B) bool
    valid_bt: torch.Tensor  # (B, T) bool

    @cached_property
    def first(self) -> torch.Tensor:
        """(B, T) bool: each group's first valid token, its critic slot (step 5). Computed over time, written
        in batch-major memory, so that :attr:`starts_tm` is the same memory and nothing is stored twice."""
        return _group_starts(self.ends_tm, self.valid_bt.t()).t()

    @property
    def starts_tm(self) -> torch.Tensor:
        """(T, B) bool: :attr:`first` seen time-major (a transposed view, not contiguous)."""
        return self.first.t()

    @cached_property
    def endpoint_mask(self) -> torch.Tensor:
        """(B, T) bool: each group's last valid token (step 2's endpoints)."""
        return _to_batch_major(self.ends_tm & self.valid_tm)

    @cached_property
    def ids(self) -> torch.Tensor:
        """(B, T) long: the 1-based group ids of step 3, 0 at masked positions."""
        return _group_ids(self.first, self.valid_bt)

    @cached_property
    def slots(self) -> torch.Tensor:
        """(G,) long: the flat (B, T) index of each group's first token, row by row."""
        return torch.nonzero(self.first.view(-1)).squeeze(1)

    @cached_property
    def sizes(self) -> torch.Tensor:
        """(G,) long: the valid tokens of each group, in the order of :attr:`slots` (groups never span a hole)."""
        return torch.nonzero(self.endpoint_mask.view(-1)).squeeze(1).sub_(self.slots).add_(1)


class _PolicyX(NamedTuple):
    """Step 4's X for the advantages, and what steps 6 and 7 need to finish it."""

    x: torch.Tensor  # (T, B): X, in the buffer steps 6 and 7 finish in place
    stats_at_tm: torch.Tensor  # (T, B) bool: where step 6's per-prompt statistics read X (one place per group)
    endpoints_tm: Optional[torch.Tensor]  # (T, B) bool: the positions step 7's endpoint loss keeps; None: all


class _Steps(NamedTuple):
    """The results of :func:`_run_steps`: the groups, and (B, T) tensors, 0 at masked positions."""

    groups: _Groups
    advantages: torch.Tensor  # (B, T)
    returns: torch.Tensor  # (B, T)
    policy_lam: float  # the advantages' lambda (with length_adaptive_alpha: the mean over non-empty responses)


def _run_steps(batch: _Batch, settings: AlgorithmSettings, tau: float) -> _Steps:
    """Steps 1-7 of docs/algorithm.md on one batch, in their order, as far as the advantages and the returns
    need them. Step 5's critic slots are the groups' first tokens (:attr:`_Groups.first`); the critic's other
    outputs (group ids, critic mask, explained variance, loss weights) are read off the groups afterwards.

    The values enter here, as an argument of steps 1 and 4: the critic's (``batch.values_tm``).
    """
    values = batch.values_tm  # V (T, B): the critic's values, the one source of values (steps 1 and 4)
    lam = _policy_lambda(batch, settings)
    delta = _td_residuals(values, batch, settings.gamma)  # step 1, a fresh buffer
    groups = _make_groups(_group_ends(delta, batch, settings.group, tau), batch)  # steps 2 and 3
    returns, policy = _segment_gae_step(delta, values, groups, batch, settings, lam)  # step 4, in delta's buffer
    _normalize_advantages_(policy.x, batch, settings, policy.stats_at_tm)  # step 6
    if policy.endpoints_tm is not None:  # step 7, the actor's side: the endpoint loss
        _keep_endpoints_(policy.x, policy.endpoints_tm, batch)
    return _Steps(groups, _to_batch_major(policy.x), returns, _mean_lambda(lam, batch.valid_bt))


def _resolve_threshold(threshold: Optional[float], params: GroupParams) -> float:
    """The tau of this call: ``threshold`` when given, else the configured starting value."""
    return check_threshold(params.group_variance_threshold if threshold is None else threshold, "threshold")


def _prepare(rewards, response_mask, values, index, old_log_probs, params: GroupParams) -> _Batch:
    """Validate the inputs' types and shapes and copy them into time-major buffers."""
    if values is None:
        raise ValueError("values is required by group_ppo: the critic's values (B, T) for every response token")
    valid = _check_mask(response_mask, "response_mask")
    shape = tuple(valid.shape)
    _check_float(rewards, "token_level_rewards", shape, response_mask.device)
    _check_float(values, "values", shape, response_mask.device)
    if old_log_probs is not None:
        _check_float(old_log_probs, "old_log_probs", shape, response_mask.device)
    dtype = torch.float64 if torch.float64 in (rewards.dtype, values.dtype) else torch.float32
    valid_tm = valid.t().contiguous()
    old_tm = None
    if params.boundary_rule == "low_prob":
        if old_log_probs is None:
            raise ValueError("old_log_probs is required by boundary_rule='low_prob'")
        old_tm = _time_major(old_log_probs, dtype).masked_fill_(~valid_tm, 0.0)
        _check_finite_at_valid(old_tm, "old_log_probs")
    ids = None
    if index is not None:
        ids = prompt_ids(index, shape[0])
    elif params.adv_norm == "prompt":
        raise ValueError("index (the prompt uid of each response) is required by adv_norm='prompt'")
    return _Batch(valid, valid_tm, ~valid_tm, _time_major(rewards, dtype), _time_major(values, dtype), old_tm, ids,
                  int(torch.count_nonzero(valid_tm)))


def _policy_lambda(batch: _Batch, settings: AlgorithmSettings) -> Union[float, torch.Tensor]:
    """The advantages' lambda: ``settings.policy_lam``, or with ``length_adaptive_alpha`` a (B,) tensor of
    per-response lambdas (:func:`length_adaptive_lambda`) in the compute dtype."""
    alpha = settings.group.length_adaptive_alpha
    if alpha is None:
        return float(settings.policy_lam)
    return length_adaptive_lambda(batch.valid_bt, alpha).to(batch.values_tm.dtype)


def _mean_lambda(lam: Union[float, torch.Tensor], valid_bt: torch.Tensor) -> float:
    """A scalar lambda as it is; per-response lambdas (B,) averaged over the responses with a valid token."""
    if isinstance(lam, float):
        return lam
    rows = valid_bt.any(dim=1)
    return float(lam[rows].mean()) if bool(rows.any()) else math.nan


# --------------------------------------------------------------------------------------------------
# steps 1-3: TD residuals, group ends, groups


def _td_residuals(values: torch.Tensor, batch: _Batch, gamma: float) -> torch.Tensor:
    """TD residuals (step 1) of the rewards and ``values`` (T, B): (T, B), a new buffer, 0 at masked positions.

    ``delta_i = r[p_i] + gamma * V[p_{i+1}] - V[p_i]`` over valid positions p_i, V after the last valid
    position = 0. ``V[p_{i+1}]``, the value at the next valid position (across holes too), comes from a
    backward pass that carries the latest valid value. Raises ValueError naming the input when a reward
    or value at a valid position is not finite.
    """
    valid = batch.valid_tm
    delta = torch.empty_like(values)
    delta[-1:].zero_()
    xp, (d_, v_, ok_) = _array_backend(delta, values, valid)
    for t in range(values.shape[0] - 2, -1, -1):  # d[t] = V[t+1] if t+1 is valid else d[t+1]
        _select(xp, ok_[t + 1], v_[t + 1], d_[t + 1], out=d_[t])
    if gamma != 1.0:
        delta.mul_(gamma)
    # (r + gamma * V_next) - V, in the order of verl's GAE and the reference; junk at masked positions -> 0.
    delta.add_(batch.rewards_tm).sub_(values).masked_fill_(batch.invalid_tm, 0.0)
    if not math.isfinite(sum_of_squares(delta)):
        _check_finite_at_valid(batch.rewards_tm.masked_fill(batch.invalid_tm, 0.0), "token_level_rewards")
        _check_finite_at_valid(values.masked_fill(batch.invalid_tm, 0.0), "values")
    return delta


def _group_ends(delta_tm: torch.Tensor, batch: _Batch, params: GroupParams, tau: float) -> torch.Tensor:
    """Group ends in time-major layout: bool (T, B), True at every endpoint (step 2) *and* at every
    masked position (so a group starts right after any True).

    ``turn`` ends groups only where every rule does (:func:`_turn_ends`). The other rules add a cap of
    ``group_max_size`` tokens and their own cuts. The variance budget ``sum z_i >= tau`` with
    ``z_i = delta_i^2 / (sigma2 + eps)`` is evaluated as ``sum delta_i^2 >= tau * (sigma2 + eps)``: the
    same test, one pass fewer.
    """
    rule = params.boundary_rule
    if rule == "turn":
        return _turn_ends(batch.invalid_tm)  # no cut of its own, no cap: one group per turn
    valid = batch.valid_tm
    T, B = valid.shape
    cap = min(params.group_max_size, max(T, 1))
    if cap == 1 or (rule == "variance" and tau == 0.0) or batch.n_valid == 0:
        return torch.ones_like(valid)  # every valid token is its own group
    # Increments of the scan's two budgets, [delta^2; token count]. A masked position, or one that must
    # end a group (the next position is masked, or starts a low_prob group), counts `cap` tokens.
    inc = torch.empty((T, 2, B), dtype=delta_tm.dtype, device=delta_tm.device)
    if rule == "variance":
        torch.mul(delta_tm, delta_tm, out=inc[:, 0])
        sigma2 = sum_of_squares(delta_tm) / batch.n_valid
        limit = tau * (sigma2 + params.group_epsilon)
    else:  # fixed and low_prob: only the token budget and the forced ends below cut
        inc[:, 0].zero_()
        limit = math.inf
    forced = _turn_ends(batch.invalid_tm)
    if rule == "low_prob":
        low = batch.old_log_probs_tm.exp() < params.low_prob_threshold
        forced[:-1] |= low[1:] & valid[1:]
    torch.where(forced, _scalar(cap, inc), _scalar(1.0, inc), out=inc[:, 1])
    limits = torch.tensor([[limit], [float(cap)]], dtype=inc.dtype, device=inc.device)
    return _scan_budget(inc, limits)


def _turn_ends(invalid_tm: torch.Tensor) -> torch.Tensor:
    """(T, B) bool: every masked position, and every valid position that is the last of its turn (the
    next position is masked or does not exist). The ends every rule has; a new tensor."""
    ends = torch.empty_like(invalid_tm)
    torch.logical_or(invalid_tm[:-1], invalid_tm[1:], out=ends[:-1])
    ends[-1:] = True
    return ends


def _scan_budget(inc: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
    """The sequential budget scan: (T, 2, B) increments, (2, 1) limits -> (T, B) bool ends.

    Two running sums per response start at 0; at step t both add ``inc[t]``; if either reaches its limit
    the step is an end and both reset to 0. Each step is five whole-batch operations.
    """
    T, _, B = inc.shape
    ends = torch.empty((T, B), dtype=torch.bool, device=inc.device)
    state = torch.zeros((2, B), dtype=inc.dtype, device=inc.device)
    hit = torch.empty((2, B), dtype=torch.bool, device=inc.device)
    keep = torch.empty((B,), dtype=torch.bool, device=inc.device)
    xp, (inc_, limits_, ends_, state_, hit_, keep_) = _array_backend(inc, limits, ends, state, hit, keep)
    for t in range(T):
        xp.add(state_, inc_[t], out=state_)
        xp.greater_equal(state_, limits_, out=hit_)
        xp.logical_or(hit_[0], hit_[1], out=ends_[t])
        xp.logical_not(ends_[t], out=keep_)
        xp.multiply(state_, keep_, out=state_)
    return ends


def _make_groups(ends_tm: torch.Tensor, batch: _Batch) -> _Groups:
    """Step 3: the groups cut at ``ends_tm`` (T, B) bool, True at every endpoint and masked position."""
    return _Groups(ends_tm, batch.valid_tm, batch.valid_bt)


def _group_starts(ends_tm: torch.Tensor, valid_tm: torch.Tensor) -> torch.Tensor:
    """Each group's first valid token: the one definition of it in this module (the pass, the group ids and the
    critic mask all come from here). (T, B) bool, True at a valid position that is the first of its response
    or follows a True of ``ends_tm`` (T, B) bool, which must be True at each group's last token and at every
    masked position. The result has ``valid_tm``'s memory layout (time-major, or a transposed (B, T) tensor)."""
    starts = torch.empty_like(valid_tm)
    starts[:1] = valid_tm[:1]
    torch.logical_and(valid_tm[1:], ends_tm[:-1], out=starts[1:])
    return starts


def _group_ids(starts: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Step 3's ids from the groups' first tokens ``starts`` (B, T) bool: long (B, T), 1-based, 0 where
    ``valid`` (B, T) bool is False."""
    return torch.cumsum(starts, dim=1, dtype=torch.int32).masked_fill_(~valid, 0).long()


# --------------------------------------------------------------------------------------------------
# step 4: segment GAE, for the critic's returns and, by the policy side, for the advantages


def _segment_gae_step(delta: torch.Tensor, values: torch.Tensor, groups: _Groups, batch: _Batch,
                      settings: AlgorithmSettings, lam: Union[float, torch.Tensor]) -> tuple[torch.Tensor, _PolicyX]:
    """Step 4 from the TD residuals ``delta`` (T, B), which it consumes, and ``values`` (T, B): the critic's
    returns (B, T) (:func:`_segment_gaes` with the groups' cuts and ``critic_lam``) and the advantages' X,
    made as the policy side asks. The one place ``policy_loss_on`` and ``within_group`` are read:

    - ``policy_loss_on: endpoints``: token-level GAE with ``lam`` (every token cut), which step 6 normalises
      over every valid token and step 7 keeps at the group endpoints only;
    - ``within_group: per_token``: the groups' segment GAE with ``lam``, each token keeping its own X;
    - else (``broadcast``): the groups' segment GAE with ``lam``, X at each group's first token written to
      every token of the group (:func:`_broadcast_from_starts_`).
    """
    params, ends, gamma = settings.group, groups.ends_tm, settings.gamma
    endpoint_loss = params.policy_loss_on == "endpoints"
    cuts = torch.ones_like(ends) if endpoint_loss else ends  # token-level GAE for the endpoint loss
    returns, x = _segment_gaes(delta, values, batch, gamma, (ends, settings.critic_lam), (cuts, lam))
    if endpoint_loss:
        return returns, _PolicyX(x, batch.valid_tm, ends & batch.valid_tm)
    elif params.within_group == "per_token":
        return returns, _PolicyX(x, groups.starts_tm, None)
    else:
        _broadcast_from_starts_(x, groups.starts_tm)
        return returns, _PolicyX(x, groups.starts_tm, None)


_Recursion = tuple[torch.Tensor, Union[float, torch.Tensor]]  # (cuts (T, B) bool, lambda: float or (B,))


def _segment_gaes(delta: torch.Tensor, values: torch.Tensor, batch: _Batch, gamma: float, critic: _Recursion,
                  policy: _Recursion) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 4 for the critic and for the policy, from the TD residuals ``delta`` (T, B), which it consumes.

    Returns ``(returns, x)``: the critic's segment lambda-returns ``X + V`` (B, T) with ``values`` (T, B), a
    new tensor, 0 at masked positions; and the policy's X (T, B) in ``delta``'s buffer, for the caller to
    finish in place. Each of ``critic`` and ``policy`` is (cuts, lambda) of :func:`_segment_gae_`. The one
    place a buffer serves twice: when the two recursions are the same (equal cuts, one scalar lambda) it runs
    once and the returns are read from it before it is handed on; otherwise the critic's recursion runs in a
    copy of ``delta``.
    """
    (ends, critic_lam), (cuts, policy_lam) = critic, policy
    if isinstance(policy_lam, float) and policy_lam == critic_lam and torch.equal(cuts, ends):
        _segment_gae_(delta, ends, batch.invalid_tm, gamma, critic_lam)
        return _returns(delta, values, batch), delta
    x_critic = delta.clone()
    _segment_gae_(x_critic, ends, batch.invalid_tm, gamma, critic_lam)
    _segment_gae_(delta, cuts, batch.invalid_tm, gamma, policy_lam)
    return _returns(x_critic, values, batch), delta


def _segment_gae_(x: torch.Tensor, ends_tm: torch.Tensor, invalid_tm: torch.Tensor, gamma: float,
                  lam: Union[float, torch.Tensor]) -> None:
    """The segment-GAE loop of :func:`segment_gae`, in place: TD residuals ``x`` (T, B), 0 at masked positions,
    become ``X``.

    ``X_i = delta_i + gamma * (lam if i is an endpoint else 1) * X_{i+1}`` backward over valid positions,
    X after the last = 0; masked positions pass X through unchanged (their delta is 0, factor 1). ``ends_tm``
    (T, B) bool marks the ends; ``lam`` is a float or a (B,) tensor of per-response lambdas in ``x``'s dtype.
    """
    T, B = x.shape
    lam_ = lam if isinstance(lam, torch.Tensor) else _scalar(float(lam), x)
    factor = torch.where(ends_tm, gamma * lam_, _scalar(gamma, x)).masked_fill_(invalid_tm, 1.0)
    tmp = torch.empty((B,), dtype=x.dtype, device=x.device)
    xp, (x_, f_, tmp_) = _array_backend(x, factor, tmp)
    for t in range(T - 2, -1, -1):
        xp.multiply(f_[t], x_[t + 1], out=tmp_)
        xp.add(x_[t], tmp_, out=x_[t])


def _returns(x_tm: torch.Tensor, values: torch.Tensor, batch: _Batch) -> torch.Tensor:
    """``X + V`` from the critic's X and ``values`` (T, B): (B, T), a new tensor, 0 at masked positions."""
    return _to_batch_major(torch.add(x_tm, values).masked_fill_(batch.invalid_tm, 0.0))


def _broadcast_from_starts_(x: torch.Tensor, starts_tm: torch.Tensor) -> None:
    """In place on ``x`` (T, B), forward in time: every non-start position takes the value of the position
    before it, so each group carries the value at its first token (A_k = X at s_k). ``starts_tm`` (T, B) bool
    may be a transposed view; the loop reads a contiguous time-major copy of its negation."""
    not_start = torch.logical_not(starts_tm, out=torch.empty_like(x, dtype=torch.bool))
    xp, (x_, not_start_) = _array_backend(x, not_start)
    for t in range(1, x.shape[0]):
        _select(xp, not_start_[t], x_[t - 1], x_[t], out=x_[t])


# --------------------------------------------------------------------------------------------------
# steps 6 and 7: normalisation, the endpoint loss, the critic-loss weights


def _normalize_advantages_(x: torch.Tensor, batch: _Batch, settings: AlgorithmSettings,
                           stats_at_tm: torch.Tensor) -> None:
    """Step 6, in place on the advantages ``x`` (T, B): 0 at masked positions, then per ``adv_norm``.

    ``batch``: verl's ``masked_whiten`` over valid tokens (mean = sum / (n + 1e-8), Bessel-corrected
    variance, ``(x - mean) * rsqrt(var + 1e-8)``), skipped with fewer than 2 valid tokens.
    ``prompt``: per prompt id, mean and Bessel std over the advantages at ``stats_at_tm`` (T, B) bool (one
    position per group: each group once; a prompt with one group gets mean 0, std 1);
    ``(A - mean) / (std + eps)``, or ``A - mean`` without std scaling.
    """
    invalid_tm, mode = batch.invalid_tm, settings.group.adv_norm
    x.masked_fill_(invalid_tm, 0.0)
    if mode == "batch" and batch.n_valid >= 2:
        n = batch.n_valid
        mean = x.sum() / (n + 1e-8)
        x.sub_(mean).masked_fill_(invalid_tm, 0.0)
        var = sum_of_squares(x) / (n + 1e-8) * (n / (n - 1))
        x.mul_(1.0 / math.sqrt(var + 1e-8)).masked_fill_(invalid_tm, 0.0)
    elif mode == "prompt":
        _normalize_by_prompt_(x, batch, stats_at_tm, settings.norm_adv_by_std_in_grpo, settings.group.group_epsilon)


def _normalize_by_prompt_(x: torch.Tensor, batch: _Batch, stats_at_tm: torch.Tensor, norm_by_std: bool,
                          eps: float) -> None:
    """``adv_norm: prompt`` in place on ``x`` (T, B), 0 at masked positions (see :func:`_normalize_advantages_`).
    The statistics sum the advantages in time-major order (by time, then response)."""
    flat = torch.nonzero(stats_at_tm.reshape(-1)).squeeze(1)  # time-major order
    group_adv, index = x.view(-1)[flat], batch.index
    row_pid = torch.as_tensor(index, device=x.device)
    pid = row_pid[flat % x.shape[1]]
    n_prompts = int(index.max()) + 1 if len(index) else 0
    count = torch.bincount(pid, minlength=n_prompts).to(x.dtype)
    total = torch.zeros(n_prompts, dtype=x.dtype, device=x.device).index_add_(0, pid, group_adv)
    mean = torch.where(count > 1, total / count.clamp(min=1), 0.0)
    sq = torch.zeros_like(mean).index_add_(0, pid, (group_adv - mean[pid]) ** 2)
    std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), 1.0)
    x.sub_(mean[row_pid])
    if norm_by_std:
        x.div_(std[row_pid] + eps)
    x.masked_fill_(batch.invalid_tm, 0.0)


def _keep_endpoints_(x: torch.Tensor, endpoints_tm: torch.Tensor, batch: _Batch) -> None:
    """Step 7's endpoint loss (``policy_loss_on: endpoints``), in place on the normalised advantages ``x``
    (T, B): 0 off ``endpoints_tm`` (T, B) bool, ``N_valid / N_endpoints`` times itself on them (both counted
    over the batch), so that verl's token-mean over the valid tokens is the mean over the endpoints."""
    n_endpoints = int(torch.count_nonzero(endpoints_tm))
    x.masked_fill_(~endpoints_tm, 0.0)
    if n_endpoints:
        x.mul_(batch.n_valid / n_endpoints)


def _boundary_weights(critic_mask: torch.Tensor, n_counted: int, n_boundary: int) -> torch.Tensor:
    """:func:`boundary_loss_weights` from checked inputs: ``critic_mask`` (B, T) float 0/1 with
    ``n_boundary`` ones, times ``n_counted / n_boundary`` (a new tensor; all 0 without a boundary)."""
    return critic_mask * (n_counted / n_boundary) if n_boundary else critic_mask.clone()


def _explained_variance_at(returns: torch.Tensor, values: torch.Tensor, flat_index: torch.Tensor,
                           eps: float) -> float:
    """:func:`explained_variance` over the (B, T) positions whose flattened indices are ``flat_index`` (G,)."""
    if flat_index.numel() == 0:
        return float("nan")
    target = returns.reshape(-1)[flat_index].double()
    error = target - values.reshape(-1)[flat_index].double()
    ev = 1.0 - error.var(correction=0) / (target.var(correction=0) + eps)
    return float(ev.clamp(-1.0, 1.0))


# ==================================================================================================
# validation and layout helpers


def _check_mask(mask: Any, name: str) -> torch.Tensor:
    """The mask as bool, after checking it holds only 0 and 1."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        raise ValueError(f"{name} must be a 2-D tensor (B, T), got {_describe(mask)}")
    if mask.dtype == torch.bool:
        return mask
    valid = mask != 0
    if mask.is_complex() or not torch.equal(valid.to(mask.dtype), mask):  # NaN fails too
        raise ValueError(f"{name} must contain only 0 and 1")
    return valid


def _check_float(x: Any, name: str, shape: tuple, device: torch.device) -> None:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of shape {shape}, got {_describe(x)}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name} must have shape {shape} (that of response_mask), got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but response_mask is on {device}")


def _time_major(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new contiguous (T, B) copy of the (B, T) tensor ``x`` in ``dtype`` (never a view of ``x``)."""
    return torch.empty((x.shape[1], x.shape[0]), dtype=dtype, device=x.device).copy_(x.t())


def _check_finite_at_valid(x_tm: torch.Tensor, name: str) -> None:
    """``x_tm`` is 0 at masked positions, so any NaN or inf in it sits at a valid position."""
    if not bool(torch.isfinite(x_tm).all()):
        raise ValueError(f"{name} must be finite at valid positions of response_mask (found NaN or inf)")


def _to_batch_major(x_tm: torch.Tensor) -> torch.Tensor:
    return x_tm.t().contiguous()


def prompt_ids(index: IndexLike, batch_size: int) -> np.ndarray:
    """verl's ``index`` (``uid``: strings, ints, or a tensor) as (B,) int64 prompt ids 0..P-1, in sorted order of the
    ids; ValueError naming ``index`` when it is not ``batch_size`` comparable ids."""
    if isinstance(index, torch.Tensor):
        index = index.detach().cpu().numpy()
    arr = np.asarray(index)
    if arr.ndim != 1 or len(arr) != batch_size:
        raise ValueError(f"index must be a 1-D sequence of {batch_size} prompt ids (one per response), "
                         f"got shape {arr.shape}")
    try:
        _, inverse = np.unique(arr, return_inverse=True)
    except TypeError as err:
        raise ValueError(f"index must hold comparable prompt ids (all str or all int): {err}") from None
    return inverse.reshape(-1).astype(np.int64)


def _scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    """A 0-dim tensor of ``like``'s dtype and device (for torch.where with an ``out`` buffer)."""
    return torch.tensor(value, dtype=like.dtype, device=like.device)


def _select(xp, cond, a, b, out) -> None:
    """``out = a where cond else b`` for one time step (numpy or torch rows; ``out`` may alias ``b``)."""
    if xp is np:
        if out is not b:
            np.copyto(out, b)
        np.copyto(out, a, where=cond)
    else:
        torch.where(cond, a, b, out=out)


def _array_backend(*tensors: torch.Tensor):
    """numpy views of CPU tensors (cheaper per step in the sequential loops), torch tensors elsewhere."""
    if tensors[0].device.type == "cpu":
        return np, tuple(t.numpy() for t in tensors)
    return torch, tensors


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"tensor of shape {tuple(x.shape)} and dtype {x.dtype}"
    return type(x).__name__
