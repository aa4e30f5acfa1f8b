"""GROUP-PPO advantage estimation, the design card's functions (pure torch + numpy, no verl imports).

Each response is cut into contiguous token groups at dynamically chosen endpoints; the critic is read at group
boundaries, each group gets one advantage (segment GAE over groups), broadcast to every token of the group.
docs/algorithm.md explains the steps cited below ("step N") with a worked example.

:func:`compute_group_ppo_outputs` is the estimator verl runs (through
:func:`~verl_group_ppo.integration.estimator.group_ppo_estimator`); :func:`compute_group_advantage` is the same pass
with verl's estimator convention. Both run :func:`verl_group_ppo.estimator.fast.run_steps`, the steps vectorised
over batch and time; :mod:`verl_group_ppo.estimator.reference` is the same steps as plain loops, the tests' oracle.

Conventions (verl's): tensors are (B, T) = (batch, response length); ``response_mask`` is 0/1 and may have holes
(multi-turn tool observations); ``values[b, t]`` is the critic's value of the state before response token t. Masked
positions are transparent: their rewards and values are never read (they may hold NaN), they belong to no group and
every output is 0 there. Computation is in float64 when an input is float64, else in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from verl_group_ppo.config import (AlgorithmSettings, GroupParams, check_threshold, check_unit_interval,
                                   read_algorithm_settings)
from verl_group_ppo.estimator.checks import IndexLike, check_float, check_mask, describe, prompt_ids
from verl_group_ppo.estimator.fast import (Batch, gather_flat, group_ends, group_starts, ids_from_starts, new_tensor,
                                           prepare, run_steps, segment_scan, td_residuals, turn_ends)
from verl_group_ppo.metrics import group_metrics, probability_metrics

__all__ = [
    "AdaptiveThreshold",
    "GroupPPOOutputs",
    "IndexLike",
    "boundary_loss_weights",
    "compute_group_advantage",
    "compute_group_ppo_outputs",
    "create_critic_endpoint_mask",
    "endpoints_to_group_ids",
    "explained_variance",
    "find_group_endpoints",
    "group_start_mask",
    "length_adaptive_lambda",
    "prompt_ids",
    "segment_gae",
    "update_threshold",
]

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
    endpoints: Optional[torch.Tensor] = None,
    parent_nodes: Optional[torch.Tensor] = None,
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
        endpoints: (B, T) bool group endpoints decided elsewhere (as :func:`find_group_endpoints` returns them,
            False at masked positions); step 2 is then skipped. None: step 2 decides them.
        parent_nodes: (B, T) integer, read only by ``adv_norm='parent'`` (and required by it): at each group's
            first token, the node of the tree the group hangs from (groups with equal ids are siblings and are
            normalised together), as :func:`~verl_group_ppo.values.prefix_tree.parent_nodes` returns them.
        **kwargs: ignored (verl passes extra fields such as ``reward_baselines``).

    Returns:
        (advantages, returns), both (B, T) in float32 (float64 when an input is float64), 0 at masked positions.
    """
    settings = read_algorithm_settings(config)
    batch, tau, lam = _validated(token_level_rewards, response_mask, values, settings, index, old_log_probs,
                                 threshold, endpoints, parent_nodes)
    steps = run_steps(batch, settings, tau, lam, _given_ends(endpoints, batch))  # as compute_group_ppo_outputs
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
    endpoints: Optional[torch.Tensor] = None,
    parent_nodes: Optional[torch.Tensor] = None,
) -> GroupPPOOutputs:
    """One pass giving advantages, returns, groups, critic mask and weights, and ``group/*`` metrics.

    Tensors (and ``endpoints``, ``parent_nodes``) as in :func:`compute_group_advantage`; ``settings`` from
    :func:`~verl_group_ppo.config.read_algorithm_settings`. The threshold is not updated here: hand the
    outputs to :meth:`AdaptiveThreshold.update` (step 6).
    """
    batch, tau, lam = _validated(token_level_rewards, response_mask, values, settings, index, old_log_probs,
                                 threshold, endpoints, parent_nodes)
    steps = run_steps(batch, settings, tau, lam, _given_ends(endpoints, batch))  # steps 1-7: advantages, returns
    groups, n_valid = steps.groups, batch.n_valid
    group_ids = groups.ids  # step 3's ids (made after the pass, once its buffers are freed: peak memory)
    critic_mask = create_critic_endpoint_mask(batch.valid, group_ids).to(steps.advantages.dtype)  # step 5
    n_groups = len(groups.sizes)
    ev = _explained_variance_at(steps.returns, batch.values, groups.slots, settings.group.group_epsilon)  # step 6
    metrics = group_metrics(settings, batch.valid, n_valid, steps.advantages, groups.sizes, tau, ev)
    metrics["group/policy_lam"] = _mean_lambda(lam, batch.valid)
    if old_log_probs is not None and settings.group.boundary_rule == "low_prob":
        metrics.update(probability_metrics(old_log_probs, batch.valid, groups.endpoint_mask, groups.first))
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
    batch = prepare(token_level_rewards, response_mask, values, None, old_log_probs, params)
    ends = group_ends(td_residuals(batch.values, batch, gamma), batch, params, threshold)
    return ends & batch.valid


def endpoints_to_group_ids(endpoints: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Group ids (step 3): long (B, T), 1-based group index at valid positions, 0 at masked ones.

    A group starts at a valid position whose previous position is masked, is an endpoint, or does not
    exist. ``endpoints`` (B, T) bool must be False at masked positions.
    """
    valid = check_mask(response_mask, "response_mask")
    return ids_from_starts(group_start_mask(endpoints, response_mask), valid)


def group_start_mask(endpoints: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Each group's first valid position (the slot of its boundary value): bool (B, T).

    A group starts at a valid position whose previous position is masked, is an endpoint, or does not
    exist. ``endpoints`` (B, T) bool (step 2's) must be False at masked positions.
    """
    valid = check_mask(response_mask, "response_mask")
    return group_starts(_checked_endpoints(endpoints, valid) | ~valid, valid)  # a masked position ends a group too


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
    valid = check_mask(response_mask, "response_mask")
    check_float(deltas, "deltas", tuple(valid.shape), response_mask.device)
    if not isinstance(ends, torch.Tensor) or ends.shape != valid.shape:
        raise ValueError(f"ends must be a tensor of the shape of response_mask {tuple(valid.shape)}, "
                         f"got {describe(ends)}")
    gamma = check_unit_interval(gamma, "gamma")
    dtype = torch.float64 if deltas.dtype == torch.float64 else torch.float32
    if isinstance(lam, torch.Tensor):
        if lam.shape != (valid.shape[0],) or not bool(((lam >= 0) & (lam <= 1)).all()):
            raise ValueError(f"lam must be in [0, 1], or a ({valid.shape[0]},) tensor of such, got {describe(lam)}")
        lam = lam.to(device=deltas.device, dtype=dtype)
    else:
        lam = check_unit_interval(lam, "lam")
    invalid = ~valid
    x = segment_scan(deltas.to(dtype).masked_fill(invalid, 0.0), ends.bool(), invalid, gamma, lam)
    return x.masked_fill_(invalid, 0.0)


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
    valid = check_mask(response_mask, "response_mask")
    if group_ids.shape != valid.shape:
        raise ValueError(f"group_ids must have the shape of response_mask {tuple(valid.shape)}, "
                         f"got {tuple(group_ids.shape)}")
    changes = torch.ones_like(valid)  # the group changes after position t: the ends group_starts reads
    torch.ne(group_ids[:, 1:], group_ids[:, :-1], out=changes[:, :-1])
    first = group_starts(changes, valid)
    dtype = response_mask.dtype if response_mask.is_floating_point() else torch.float32
    return new_tensor(tuple(first.shape), dtype, first.device).copy_(first)


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
    boundary, counted = check_mask(critic_mask, "critic_mask"), check_mask(count_mask, "count_mask")
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
    lengths = check_mask(response_mask, "response_mask").sum(dim=1, dtype=torch.float64)
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


# --------------------------------------------------------------------------------------------------
# helpers of the functions above


def _validated(token_level_rewards: Any, response_mask: Any, values: Any, settings: AlgorithmSettings, index: Any,
               old_log_probs: Any, threshold: Optional[float], endpoints: Any,
               parent_nodes: Any = None) -> tuple[Batch, float, Union[float, torch.Tensor]]:
    """The pass's inputs, checked (a ValueError names a bad one): the batch (:func:`prepare`, with
    ``parent_nodes`` under ``adv_norm='parent'``), tau and the advantages' lambda."""
    if not isinstance(settings, AlgorithmSettings):
        raise ValueError(f"settings must be an AlgorithmSettings (read_algorithm_settings(config)), "
                         f"got {type(settings).__name__}")
    if endpoints is None and settings.group.boundary_rule == "tree":
        raise ValueError("endpoints is required by boundary_rule='tree' (the tree's branch points, which the "
                         "prefix_tree value source finds: verl_group_ppo.values.boundary_values)")
    batch = prepare(token_level_rewards, response_mask, values, index, old_log_probs, settings.group, parent_nodes)
    return batch, _resolve_threshold(threshold, settings.group), _policy_lambda(batch, settings)


def _resolve_threshold(threshold: Optional[float], params: GroupParams) -> float:
    """The tau of this call: ``threshold`` when given, else the configured starting value."""
    return check_threshold(params.group_variance_threshold if threshold is None else threshold, "threshold")


def _given_ends(endpoints: Optional[torch.Tensor], batch: Batch) -> Optional[torch.Tensor]:
    """Step 2's groups handed in as ``endpoints`` (B, T) bool, checked, as the pass's ends: (B, T) bool,
    True at every endpoint, at every valid token before a masked one or at the end (a hole always ends a group),
    and at every masked position. None when ``endpoints`` is None."""
    if endpoints is None:
        return None
    return torch.logical_or(turn_ends(batch.invalid), _checked_endpoints(endpoints, batch.valid))


def _checked_endpoints(endpoints: Any, valid: torch.Tensor) -> torch.Tensor:
    """``endpoints`` (B, T) 0/1 as bool on ``valid``'s device, after checking it has ``valid``'s (B, T) shape and is
    False wherever ``valid`` (the response mask as bool) is."""
    shape = tuple(valid.shape)
    if not isinstance(endpoints, torch.Tensor) or tuple(endpoints.shape) != shape:
        raise ValueError(f"endpoints must be a (B, T) tensor of the shape of response_mask {shape}, "
                         f"got {describe(endpoints)}")
    ends = check_mask(endpoints, "endpoints").to(valid.device)
    if bool((ends & ~valid).any()):
        raise ValueError("endpoints must be False at masked positions of response_mask")
    return ends


def _policy_lambda(batch: Batch, settings: AlgorithmSettings) -> Union[float, torch.Tensor]:
    """The advantages' lambda: ``settings.policy_lam``, or with ``length_adaptive_alpha`` a (B,) tensor of
    per-response lambdas (:func:`length_adaptive_lambda`) in the compute dtype."""
    alpha = settings.group.length_adaptive_alpha
    if alpha is None:
        return float(settings.policy_lam)
    return length_adaptive_lambda(batch.valid, alpha).to(batch.values.dtype)


def _mean_lambda(lam: Union[float, torch.Tensor], valid_bt: torch.Tensor) -> float:
    """A scalar lambda as it is; per-response lambdas (B,) averaged over the responses with a valid token."""
    if isinstance(lam, float):
        return lam
    rows = valid_bt.any(dim=1)
    return float(lam[rows].mean()) if bool(rows.any()) else math.nan


def _boundary_weights(critic_mask: torch.Tensor, n_counted: int, n_boundary: int) -> torch.Tensor:
    """:func:`boundary_loss_weights` from checked inputs: ``critic_mask`` (B, T) float 0/1 with
    ``n_boundary`` ones, times ``n_counted / n_boundary`` (a new tensor; all 0 without a boundary)."""
    out = new_tensor(tuple(critic_mask.shape), critic_mask.dtype, critic_mask.device)
    return torch.mul(critic_mask, n_counted / n_boundary if n_boundary else 0.0, out=out)


def _explained_variance_at(returns: torch.Tensor, values: torch.Tensor, flat_index: torch.Tensor,
                           eps: float) -> float:
    """:func:`explained_variance` over the (B, T) positions whose flattened indices are ``flat_index`` (G,)."""
    if flat_index.numel() == 0:
        return float("nan")
    target = gather_flat(returns.detach().reshape(-1), flat_index).double()
    error = target - gather_flat(values.detach().reshape(-1), flat_index).double()
    ev = 1.0 - error.var(correction=0) / (target.var(correction=0) + eps)
    return float(ev.clamp(-1.0, 1.0))
