"""GROUP-PPO advantage estimation (the algorithm math; pure torch + numpy, no verl trainer imports).

Each response is cut into contiguous token groups at dynamically chosen endpoints; the critic is read
at group boundaries, each group gets one advantage (segment GAE over groups), broadcast to every token
of the group. See docs/algorithm.md for the algorithm in words and a worked example.

Conventions (verl's): tensors are (B, T) = (batch, response length); ``response_mask`` is 0/1 and may
have holes (multi-turn tool observations); ``values[b, t]`` is the critic's value of the state before
response token t. Masked positions are transparent: their rewards and values are never read (they may
hold NaN), they belong to no group and every output is 0 there.

Implementation notes. All work is vectorised over the batch. The two places where the spec needs a
sequential pass over time (the variance budget scan and the backward segment-GAE recursion) are loops
over T whose every step is a handful of whole-batch operations on contiguous rows of time-major (T, B)
buffers; on CPU those steps run on numpy views of the same memory (about half the per-call overhead of
torch), on other devices with torch. No cumulative-product tricks: results are exact for any gamma,
lam and T. Computation is in float64 when an input is float64, else in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from verl_group_ppo.config import AlgorithmSettings, GroupParams, read_algorithm_settings

__all__ = [
    "GroupPPOOutputs",
    "ThresholdState",
    "boundary_explained_variance",
    "compute_group_advantage",
    "compute_group_ppo_outputs",
    "create_critic_endpoint_mask",
    "endpoints_to_group_ids",
    "find_group_endpoints",
    "update_threshold",
]

IndexLike = Union[np.ndarray, Sequence[Any], torch.Tensor]


# ==================================================================================================
# public API


@dataclass
class GroupPPOOutputs:
    """Everything the trainer needs from one GROUP-PPO advantage pass. Tensors are (B, T), 0 at masked positions.

    Attributes:
        advantages: per-token advantages (group advantage broadcast, normalised per ``adv_norm``).
        returns: segment lambda-returns ``X + V``: the critic's targets (never normalised).
        group_ids: long, 1-based group index within each response.
        endpoint_mask: bool, True at each group's last valid token.
        critic_mask: float 0/1, one 1 per group at its value slot (the group's first valid token).
        critic_loss_weights: float, ``N_valid / N_boundary`` at critic-mask positions (spec Step 7).
        threshold: the variance threshold tau used for this batch.
        boundary_explained_variance: 1 - Var(returns - values) / Var(returns) at critic-mask positions
            (NaN for a batch with no valid token).
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
    metrics: dict[str, float] = field(default_factory=dict)


@torch.no_grad()
def compute_group_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
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
        config: verl's algorithm config (DictConfig, dict or AlgoConfig) with ``gamma``, ``lam``,
            ``norm_adv_by_std_in_grpo`` and ``group_params``; missing keys take defaults.
        old_log_probs: (B, T) old-policy log-probs; required for ``boundary_rule='low_prob'``.
        threshold: current variance threshold tau; None uses ``group_params.group_variance_threshold``.
        **kwargs: ignored (verl passes extra fields such as ``reward_baselines``).

    Returns:
        (advantages, returns), both (B, T) in float32 (float64 when an input is float64), 0 at masked positions.
    """
    return _run(token_level_rewards, response_mask, values, index, config, old_log_probs, threshold, rich=False)


@torch.no_grad()
def compute_group_ppo_outputs(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: Optional[torch.Tensor],
    index: Optional[IndexLike] = None,
    config: Any = None,
    old_log_probs: Optional[torch.Tensor] = None,
    threshold: Optional[float] = None,
) -> GroupPPOOutputs:
    """One pass giving advantages, returns, groups, critic mask and weights, and ``group/*`` metrics.

    Same arguments as :func:`compute_group_advantage`. The threshold is not updated here: feed
    ``boundary_explained_variance`` to :meth:`ThresholdState.update` (spec Step 6).
    """
    return _run(token_level_rewards, response_mask, values, index, config, old_log_probs, threshold, rich=True)


@torch.no_grad()
def find_group_endpoints(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: Optional[torch.Tensor] = None,
    gamma: float = 1.0,
    threshold: float = 1.0,
    group_max_size: int = 16,
    group_epsilon: float = 1e-6,
    boundary_rule: str = "variance",
    old_log_probs: Optional[torch.Tensor] = None,
    low_prob_threshold: float = 0.9,
) -> torch.Tensor:
    """Group endpoints (spec Step 2): bool (B, T), True at the last valid token of every group.

    Rules: ``variance`` (Algorithm 2: a running budget of normalised squared TD residuals
    ``z = delta^2 / (mean(delta^2) + eps)`` ends a group once it reaches ``threshold``), ``fixed`` (every
    ``group_max_size`` valid tokens) and ``low_prob`` (a group starts at each token whose old-policy
    probability is below ``low_prob_threshold``). Under every rule a group ends at ``group_max_size``
    tokens, at the last valid token and before a masked position (groups never span a hole).

    Args:
        token_level_rewards, values, response_mask: (B, T), see :func:`compute_group_advantage`.
            ``values`` is required by the ``variance`` rule.
        old_log_probs: (B, T), required by the ``low_prob`` rule.
    """
    params = GroupParams(group_variance_threshold=threshold, group_max_size=group_max_size,
                         group_epsilon=group_epsilon, boundary_rule=boundary_rule,
                         low_prob_threshold=low_prob_threshold, adaptive_threshold=False)
    settings = AlgorithmSettings(gamma=gamma, lam=1.0, group=params)
    if values is None:
        if boundary_rule == "variance":
            raise ValueError("values is required by boundary_rule='variance'")
        values = torch.zeros_like(token_level_rewards)
    batch = _prepare(token_level_rewards, response_mask, values, None, old_log_probs, settings)
    ends = _group_ends(_td_residuals(batch, gamma), batch, settings.group, threshold)
    return _to_batch_major(ends & batch.valid_tm)


def endpoints_to_group_ids(endpoints: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Group ids (spec Step 3): long (B, T), 1-based group index at valid positions, 0 at masked ones.

    A group starts at a valid position whose previous position is masked, is an endpoint, or does not
    exist. ``endpoints`` (B, T) bool must be False at masked positions.
    """
    valid = _check_mask(response_mask, "response_mask")
    if endpoints.shape != valid.shape:
        raise ValueError(f"endpoints must have the shape of response_mask {tuple(valid.shape)}, "
                         f"got {tuple(endpoints.shape)}")
    endpoints = endpoints.bool()
    if bool((endpoints & ~valid).any()):
        raise ValueError("endpoints must be False at masked positions of response_mask")
    starts = _group_starts((endpoints | ~valid).t(), valid.t()).t()
    return torch.cumsum(starts, dim=1).mul_(valid)


def create_critic_endpoint_mask(response_mask: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Critic boundary mask (spec Step 5): (B, T) 0/1 with exactly one 1 per group.

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
    previous = torch.nn.functional.pad(group_ids[:, :-1], (1, 0), value=0)
    first = valid & (group_ids != previous) & (group_ids > 0)
    dtype = response_mask.dtype if response_mask.is_floating_point() else torch.float32
    return first.to(dtype)


def boundary_explained_variance(
    returns: torch.Tensor, values: torch.Tensor, critic_mask: torch.Tensor, eps: float = 1e-6
) -> float:
    """Explained variance of the critic at its boundary slots (spec Step 6).

    ``ev = 1 - Var(returns - values) / (Var(returns) + eps)`` with population variances over the
    positions where ``critic_mask`` is 1, clipped to [-1, 1]. NaN when the mask selects nothing.
    All tensors (B, T).
    """
    sel = critic_mask.bool()
    return _explained_variance(returns[sel] - values[sel], returns[sel], eps)


def update_threshold(threshold: float, explained_variance: float, params: GroupParams) -> float:
    """One adaptive-threshold step (spec Step 6), pure.

    ``tau <- clip(tau * exp(threshold_lr * (target_explained_variance - ev)), min_threshold, max_threshold)``
    with ``ev`` clipped to [-1, 1]. A NaN ``ev`` (a batch without valid tokens) leaves tau unchanged.
    A low ev (poor critic) grows tau, hence groups (toward GRPO); a high ev shrinks them (toward PPO).
    """
    if math.isnan(explained_variance):
        return float(threshold)
    ev = min(1.0, max(-1.0, float(explained_variance)))
    tau = float(threshold) * math.exp(params.threshold_lr * (params.target_explained_variance - ev))
    return min(params.max_threshold, max(params.min_threshold, tau))


@dataclass
class ThresholdState:
    """The adaptive variance threshold tau: training state, logged each step and checkpointed."""

    value: float

    def __post_init__(self) -> None:
        self.value = _check_threshold(self.value, "ThresholdState.value")

    @classmethod
    def from_params(cls, params: GroupParams) -> "ThresholdState":
        """Start from ``group_params.group_variance_threshold``."""
        return cls(float(params.group_variance_threshold))

    def update(self, explained_variance: float, params: GroupParams) -> float:
        """Apply :func:`update_threshold` when adaptation applies (``variance`` rule, adaptation on)."""
        if params.adaptive_threshold and params.boundary_rule == "variance":
            self.value = update_threshold(self.value, explained_variance, params)
        return self.value

    def state_dict(self) -> dict[str, float]:
        return {"threshold": float(self.value)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or "threshold" not in state:
            raise ValueError(f"state must be a dict with key 'threshold', got {state!r}")
        self.value = _check_threshold(state["threshold"], "state['threshold']")


# ==================================================================================================
# the pipeline


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


@dataclass
class _Pass:
    """Results of one advantage pass, time-major internals kept for the rich outputs."""

    advantages: torch.Tensor  # (B, T)
    returns: torch.Tensor  # (B, T)
    starts_tm: torch.Tensor  # (T, B) bool group starts (= critic slots)
    ends_tm: torch.Tensor  # (T, B) bool: group endpoints, and every masked position
    valid_bt: torch.Tensor  # (B, T) bool
    valid_tm: torch.Tensor  # (T, B) bool
    groups: Optional["_Groups"]  # where each group starts (rich pass or adv_norm='prompt')
    n_valid: int
    threshold: float
    explained_variance: float


@dataclass
class _Groups:
    """Every group's first position in the time-major buffers (flat index t * B + b), its response, and
    X there (= A_k, before normalisation). Ordered by time, then response."""

    flat_tm: torch.Tensor  # (G,) long
    rows: torch.Tensor  # (G,) long
    advantage: torch.Tensor  # (G,)


def _run(rewards, response_mask, values, index, config, old_log_probs, threshold, rich: bool):
    """compute_group_advantage (rich=False: (advantages, returns)) or compute_group_ppo_outputs (rich=True)."""
    p = _advantage_pass(rewards, response_mask, values, index, config, old_log_probs, threshold,
                        with_explained_variance=rich)
    if not rich:
        return p.advantages, p.returns
    starts_bt = p.starts_tm.t().contiguous()
    critic_mask = starts_bt.to(p.advantages.dtype)
    n_groups = len(p.groups.flat_tm)
    weights = critic_mask * (p.n_valid / n_groups) if n_groups else torch.zeros_like(critic_mask)
    valid_bt = p.valid_bt.contiguous()
    group_ids = torch.cumsum(starts_bt, dim=1, dtype=torch.int32).to(torch.long).masked_fill_(~valid_bt, 0)
    return GroupPPOOutputs(
        advantages=p.advantages,
        returns=p.returns,
        group_ids=group_ids,
        endpoint_mask=_to_batch_major(p.ends_tm & p.valid_tm),
        critic_mask=critic_mask,
        critic_loss_weights=weights,
        threshold=p.threshold,
        boundary_explained_variance=p.explained_variance,
        metrics=_group_metrics(p.starts_tm, p.valid_tm, p.advantages, p.n_valid, p.threshold, p.explained_variance),
    )


def _advantage_pass(rewards, response_mask, values, index, config, old_log_probs, threshold,
                    with_explained_variance: bool) -> _Pass:
    """Steps 1-6 of the spec (without the threshold update), in time-major buffers."""
    settings = read_algorithm_settings(config)
    params = settings.group
    tau = _check_threshold(params.group_variance_threshold if threshold is None else threshold, "threshold")
    if values is None:
        raise ValueError("values is required by group_ppo: the critic's values (B, T) for every response token")
    batch = _prepare(rewards, response_mask, values, index, old_log_probs, settings)

    x = _td_residuals(batch, settings.gamma)  # Step 1, a fresh buffer
    ends = _group_ends(x, batch, params, tau)  # Step 2
    starts = _group_starts(ends, batch.valid_tm)  # Step 3 (ids) / Step 5 (critic slots)
    _segment_gae_(x, ends, batch.invalid_tm, settings.gamma, settings.lam)  # Step 4: x becomes X
    returns = torch.add(x, batch.values_tm, out=batch.rewards_tm)  # rewards are no longer needed
    returns = _to_batch_major(returns.masked_fill_(batch.invalid_tm, 0.0))
    ev, groups = float("nan"), None
    if with_explained_variance or params.adv_norm == "prompt":
        groups = _locate_groups(starts, x)
    if with_explained_variance:
        values_at_starts = batch.values_tm.view(-1)[groups.flat_tm]
        ev = _explained_variance(groups.advantage, groups.advantage + values_at_starts, params.group_epsilon)
    _broadcast_from_starts_(x, starts)  # A_k to every token of group k
    x.masked_fill_(batch.invalid_tm, 0.0)
    _normalize_advantages_(x, batch.invalid_tm, batch.n_valid, groups, batch.index, params.adv_norm,
                           settings.norm_adv_by_std_in_grpo, params.group_epsilon)  # Step 6
    return _Pass(_to_batch_major(x), returns, starts, ends, batch.valid_bt, batch.valid_tm, groups, batch.n_valid, tau, ev)


def _prepare(rewards, response_mask, values, index, old_log_probs, settings: AlgorithmSettings) -> _Batch:
    """Validate the inputs' types and shapes and copy them into time-major buffers."""
    valid = _check_mask(response_mask, "response_mask")
    shape = tuple(valid.shape)
    _check_float(rewards, "token_level_rewards", shape, response_mask.device)
    _check_float(values, "values", shape, response_mask.device)
    if old_log_probs is not None:
        _check_float(old_log_probs, "old_log_probs", shape, response_mask.device)
    dtype = torch.float64 if torch.float64 in (rewards.dtype, values.dtype) else torch.float32
    valid_tm = valid.t().contiguous()
    old_tm = None
    if settings.group.boundary_rule == "low_prob":
        if old_log_probs is None:
            raise ValueError("old_log_probs is required by boundary_rule='low_prob'")
        old_tm = _time_major(old_log_probs, dtype).masked_fill_(~valid_tm, 0.0)
        _check_finite_at_valid(old_tm, "old_log_probs")
    ids = None
    if index is not None:
        ids = _index_ids(index, shape[0])
    elif settings.group.adv_norm == "prompt":
        raise ValueError("index (the prompt uid of each response) is required by adv_norm='prompt'")
    return _Batch(valid, valid_tm, ~valid_tm, _time_major(rewards, dtype), _time_major(values, dtype), old_tm, ids,
                  int(torch.count_nonzero(valid_tm)))


def _td_residuals(batch: _Batch, gamma: float) -> torch.Tensor:
    """TD residuals (spec Step 1), (T, B), in a new buffer, 0 at masked positions.

    ``delta_i = r[p_i] + gamma * V[p_{i+1}] - V[p_i]`` over valid positions p_i, V after the last valid
    position = 0. ``V[p_{i+1}]``, the value at the next valid position (across holes too), comes from a
    backward pass that carries the latest valid value. Raises ValueError naming the input when a reward
    or value at a valid position is not finite.
    """
    values, valid = batch.values_tm, batch.valid_tm
    delta = torch.empty_like(values)
    delta[-1:].zero_()
    xp, (d_, v_, ok_) = _array_backend(delta, values, valid)
    for t in range(values.shape[0] - 2, -1, -1):  # d[t] = V[t+1] if t+1 is valid else d[t+1]
        _select(xp, ok_[t + 1], v_[t + 1], d_[t + 1], out=d_[t])
    if gamma != 1.0:
        delta.mul_(gamma)
    # (r + gamma * V_next) - V, in the order of verl's GAE and the reference; junk at masked positions -> 0.
    delta.add_(batch.rewards_tm).sub_(values).masked_fill_(batch.invalid_tm, 0.0)
    if not math.isfinite(_sum_of_squares(delta)):
        _check_finite_at_valid(batch.rewards_tm.masked_fill(batch.invalid_tm, 0.0), "token_level_rewards")
        _check_finite_at_valid(values.masked_fill(batch.invalid_tm, 0.0), "values")
    return delta


def _group_ends(delta_tm: torch.Tensor, batch: _Batch, params: GroupParams, tau: float) -> torch.Tensor:
    """Group ends in time-major layout: bool (T, B), True at every endpoint (spec Step 2) *and* at every
    masked position (so a group starts right after any True).

    The variance budget ``sum z_i >= tau`` with ``z_i = delta_i^2 / (sigma2 + eps)`` is evaluated as
    ``sum delta_i^2 >= tau * (sigma2 + eps)``: the same test, one pass fewer.
    """
    valid, invalid = batch.valid_tm, batch.invalid_tm
    T, B = valid.shape
    cap = min(params.group_max_size, max(T, 1))
    rule = params.boundary_rule
    if cap == 1 or (rule == "variance" and tau == 0.0) or batch.n_valid == 0:
        return torch.ones_like(valid)  # every valid token is its own group
    # Increments of the scan's two budgets, [delta^2; token count]. A masked position, or one that must
    # end a group (the next position is masked, or starts a low_prob group), counts `cap` tokens.
    inc = torch.empty((T, 2, B), dtype=delta_tm.dtype, device=delta_tm.device)
    if rule == "variance":
        torch.mul(delta_tm, delta_tm, out=inc[:, 0])
        sigma2 = _sum_of_squares(delta_tm) / batch.n_valid
        limit = tau * (sigma2 + params.group_epsilon)
    else:
        inc[:, 0].zero_()
        limit = math.inf
    forced = torch.empty_like(valid)
    torch.logical_or(invalid[:-1], invalid[1:], out=forced[:-1])
    forced[-1:] = True
    if rule == "low_prob":
        low = batch.old_log_probs_tm.exp() < params.low_prob_threshold
        forced[:-1] |= low[1:] & valid[1:]
    torch.where(forced, _scalar(cap, inc), _scalar(1.0, inc), out=inc[:, 1])
    limits = torch.tensor([[limit], [float(cap)]], dtype=inc.dtype, device=inc.device)
    return _scan_budget(inc, limits)


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


def _group_starts(ends_tm: torch.Tensor, valid_tm: torch.Tensor) -> torch.Tensor:
    """(T, B) bool group starts: valid positions that follow an end (or a masked position, or nothing)."""
    starts = torch.empty_like(valid_tm)
    starts[:1] = valid_tm[:1]
    torch.logical_and(valid_tm[1:], ends_tm[:-1], out=starts[1:])
    return starts


def _segment_gae_(x: torch.Tensor, ends_tm: torch.Tensor, invalid_tm: torch.Tensor, gamma: float,
                  lam: float) -> None:
    """Segment GAE (spec Step 4), in place: TD residuals ``x`` (T, B) become ``X``.

    ``X_i = delta_i + gamma * (lam if i is an endpoint else 1) * X_{i+1}`` backward over valid positions,
    X after the last = 0; masked positions pass X through unchanged (their delta is 0, factor 1).
    """
    T, B = x.shape
    factor = torch.where(ends_tm, _scalar(gamma * lam, x), _scalar(gamma, x)).masked_fill_(invalid_tm, 1.0)
    tmp = torch.empty((B,), dtype=x.dtype, device=x.device)
    xp, (x_, f_, tmp_) = _array_backend(x, factor, tmp)
    for t in range(T - 2, -1, -1):
        xp.multiply(f_[t], x_[t + 1], out=tmp_)
        xp.add(x_[t], tmp_, out=x_[t])


def _broadcast_from_starts_(x: torch.Tensor, starts_tm: torch.Tensor) -> None:
    """In place, forward in time: every non-start position takes the value of the position before it,
    so each group carries the value at its first token (A_k = X at s_k)."""
    not_start = ~starts_tm
    xp, (x_, not_start_) = _array_backend(x, not_start)
    for t in range(1, x.shape[0]):
        _select(xp, not_start_[t], x_[t - 1], x_[t], out=x_[t])


def _normalize_advantages_(x, invalid_tm, n_valid: int, groups: Optional[_Groups], index: Optional[np.ndarray], mode: str,
                           norm_by_std: bool, eps: float) -> None:
    """Spec Step 6 normalisation, in place on the broadcast advantages ``x`` (T, B), 0 at masked positions.

    ``batch``: verl's ``masked_whiten`` over valid tokens (mean = sum / (n + 1e-8), Bessel-corrected
    variance, ``(x - mean) * rsqrt(var + 1e-8)``), skipped with fewer than 2 valid tokens.
    ``prompt``: per prompt id, mean and Bessel std over its group advantages (each group once; a prompt
    with one group gets mean 0, std 1); ``(A - mean) / (std + eps)``, or ``A - mean`` without std scaling.
    """
    if mode == "none":
        return
    if mode == "batch":
        n = n_valid
        if n < 2:
            return
        mean = x.sum() / (n + 1e-8)
        x.sub_(mean).masked_fill_(invalid_tm, 0.0)
        var = _sum_of_squares(x) / (n + 1e-8) * (n / (n - 1))
        x.mul_(1.0 / math.sqrt(var + 1e-8)).masked_fill_(invalid_tm, 0.0)
        return
    # prompt: statistics over group advantages, one per group
    group_adv = groups.advantage
    row_pid = torch.as_tensor(index, device=x.device)
    pid = row_pid[groups.rows]
    n_prompts = int(index.max()) + 1 if len(index) else 0
    count = torch.bincount(pid, minlength=n_prompts).to(x.dtype)
    total = torch.zeros(n_prompts, dtype=x.dtype, device=x.device).index_add_(0, pid, group_adv)
    mean = torch.where(count > 1, total / count.clamp(min=1), 0.0)
    sq = torch.zeros_like(mean).index_add_(0, pid, (group_adv - mean[pid]) ** 2)
    std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), 1.0)
    x.sub_(mean[row_pid])
    if norm_by_std:
        x.div_(std[row_pid] + eps)
    x.masked_fill_(invalid_tm, 0.0)


def _locate_groups(starts_tm: torch.Tensor, x_tm: torch.Tensor) -> _Groups:
    """All groups' first positions (one ``nonzero``), with X read there."""
    flat = torch.nonzero(starts_tm.view(-1)).squeeze(1)
    return _Groups(flat, flat % starts_tm.shape[1], x_tm.view(-1)[flat])


def _explained_variance(error: torch.Tensor, returns: torch.Tensor, eps: float) -> float:
    """``1 - Var(error) / (Var(returns) + eps)`` (population variances, float64), clipped to [-1, 1]; NaN if empty."""
    if error.numel() == 0:
        return float("nan")
    ev = 1.0 - error.double().var(correction=0) / (returns.double().var(correction=0) + eps)
    return float(ev.clamp(-1.0, 1.0))


def _group_metrics(starts_tm: torch.Tensor, valid_tm: torch.Tensor, advantages: torch.Tensor, n_valid: int,
                   tau: float, ev: float) -> dict[str, float]:
    """The spec's ``group/*`` metrics. ``advantages`` (B, T) is 0 at masked positions."""
    n_groups = int(torch.count_nonzero(starts_tm))
    n_responses = int(torch.count_nonzero(valid_tm.any(dim=0)))
    metrics = {
        "group/num_groups": float(n_groups),
        "group/mean_group_size": n_valid / n_groups if n_groups else 0.0,
        "group/max_group_size": float(_max_group_size(starts_tm, valid_tm)),
        "group/groups_per_response": n_groups / n_responses if n_responses else 0.0,
        "group/compression_ratio": 1.0 - n_groups / n_valid if n_valid else 0.0,
        "group/threshold": float(tau),
        "group/boundary_explained_variance": ev,
        "group/advantage_mean": 0.0,
        "group/advantage_std": 0.0,
        "group/advantage_min": 0.0,
        "group/advantage_max": 0.0,
    }
    if n_valid:
        total = float(advantages.sum(dtype=torch.float64))
        squares = _sum_of_squares(advantages)
        mean = total / n_valid
        low, high = _min_max_at(advantages, valid_tm.t(), n_valid)
        metrics.update({"group/advantage_mean": mean, "group/advantage_std": max(squares / n_valid - mean**2, 0.0) ** 0.5,
                        "group/advantage_min": low, "group/advantage_max": high})
    return metrics


def _max_group_size(starts_tm: torch.Tensor, valid_tm: torch.Tensor) -> int:
    """Most valid tokens in one group: a forward pass counting tokens since the last group start."""
    T, B = starts_tm.shape
    count = torch.zeros((B,), dtype=torch.int32, device=starts_tm.device)
    most = torch.zeros_like(count)
    not_start = ~starts_tm
    xp, (count_, most_, not_start_, valid_) = _array_backend(count, most, not_start, valid_tm)
    for t in range(T):
        xp.multiply(count_, not_start_[t], out=count_)
        xp.add(count_, valid_[t], out=count_)
        xp.maximum(most_, count_, out=most_)
    return int(most.max()) if B else 0


def _min_max_at(x: torch.Tensor, valid: torch.Tensor, n_valid: int) -> tuple[float, float]:
    """Min and max of ``x`` over valid positions, where ``x`` is 0 at masked ones.

    The unmasked min/max is exact unless it is the 0 of a masked position; only then mask explicitly.
    """
    low, high = (float(v) for v in torch.aminmax(x))
    if n_valid < x.numel() and (low == 0.0 or high == 0.0):
        selected = x[valid]
        low, high = float(selected.min()), float(selected.max())
    return low, high


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


def _index_ids(index: IndexLike, batch_size: int) -> np.ndarray:
    """Prompt ids as integers 0..P-1 (from verl's uid strings, ints, or a tensor)."""
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


def _check_threshold(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise ValueError(f"{name} (the variance threshold tau) must be a number >= 0, got {value!r}")
    return float(value)


def _sum_of_squares(x: torch.Tensor) -> float:
    """Sum of ``x**2`` as a Python float (``vector_norm``: fast at every size, unlike ``torch.dot`` on CPU)."""
    return float(torch.linalg.vector_norm(x)) ** 2


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
