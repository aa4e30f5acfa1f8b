"""The fast pass: steps 1-7 of docs/algorithm.md vectorised over the batch, in time-major (T, B) buffers.

:func:`run_steps` runs the steps in their order; :mod:`verl_group_ppo.core_algos` validates the inputs (:func:`prepare`)
and reads the critic's outputs off the groups. Conventions as in :mod:`verl_group_ppo.core_algos`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple, Optional, Union

import numpy as np
import torch

from verl_group_ppo.config import AlgorithmSettings, GroupParams
from verl_group_ppo.estimator.checks import (check_finite_at_valid, check_float, check_mask, prompt_ids, time_major,
                                             to_batch_major)
from verl_group_ppo.metrics import sum_of_squares

@dataclass
class Batch:
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
class Groups:
    """The groups of one batch (step 3), made once by :func:`run_steps` from step 2's ends and read by every
    later step: step 4's cuts and broadcast, step 5's critic slots, step 6's per-prompt statistics, step 7's
    weights and the metrics. A group's first valid token (its critic slot) is :attr:`first`, from
    :func:`group_starts`; everything below is made from the ends when first read, and kept."""

    ends_tm: torch.Tensor  # (T, B) bool: each group's last valid token, and every masked position
    valid_tm: torch.Tensor  # (T, B) bool
    valid_bt: torch.Tensor  # (B, T) bool

    @cached_property
    def first(self) -> torch.Tensor:
        """(B, T) bool: each group's first valid token, its critic slot (step 5). Computed over time, written
        in batch-major memory, so that :attr:`starts_tm` is the same memory and nothing is stored twice."""
        return group_starts(self.ends_tm, self.valid_bt.t()).t()

    @property
    def starts_tm(self) -> torch.Tensor:
        """(T, B) bool: :attr:`first` seen time-major (a transposed view, not contiguous)."""
        return self.first.t()

    @cached_property
    def endpoint_mask(self) -> torch.Tensor:
        """(B, T) bool: each group's last valid token (step 2's endpoints)."""
        return to_batch_major(self.ends_tm & self.valid_tm)

    @cached_property
    def ids(self) -> torch.Tensor:
        """(B, T) long: the 1-based group ids of step 3, 0 at masked positions."""
        return ids_from_starts(self.first, self.valid_bt)

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


class Steps(NamedTuple):
    """The results of :func:`run_steps`: the groups, and (B, T) tensors, 0 at masked positions."""

    groups: Groups
    advantages: torch.Tensor  # (B, T)
    returns: torch.Tensor  # (B, T)


def run_steps(batch: Batch, settings: AlgorithmSettings, tau: float, lam: Union[float, torch.Tensor],
              endpoints_tm: Optional[torch.Tensor] = None) -> Steps:
    """Steps 1-7 of docs/algorithm.md on one batch, in their order, as far as the advantages and the returns
    need them. Step 5's critic slots are the groups' first tokens (:attr:`Groups.first`); the critic's other
    outputs (group ids, critic mask, explained variance, loss weights) are read off the groups afterwards.

    Args:
        batch: the validated inputs (:func:`prepare`); the values enter here, as an argument of steps 1 and 4.
        settings: the pass's settings; ``tau`` its variance threshold.
        lam: the advantages' lambda, a float or (B,) per-response lambdas in the compute dtype.
        endpoints_tm: (T, B) bool, step 2's groups decided elsewhere (True at every group's last token and at
            every masked position); None runs step 2 here.
    """
    values = batch.values_tm  # V (T, B): the critic's values, the one source of values (steps 1 and 4)
    delta = td_residuals(values, batch, settings.gamma)  # step 1, a fresh buffer
    if endpoints_tm is None:
        endpoints_tm = group_ends(delta, batch, settings.group, tau)  # step 2
    groups = Groups(endpoints_tm, batch.valid_tm, batch.valid_bt)  # step 3
    returns, policy = segment_gae_step(delta, values, groups, batch, settings, lam)  # step 4, in delta's buffer
    _normalize_advantages_(policy.x, batch, settings, policy.stats_at_tm)  # step 6
    if policy.endpoints_tm is not None:  # step 7, the actor's side: the endpoint loss
        _keep_endpoints_(policy.x, policy.endpoints_tm, batch)
    return Steps(groups, to_batch_major(policy.x), returns)


def prepare(rewards, response_mask, values, index, old_log_probs, params: GroupParams) -> Batch:
    """Validate the inputs' types and shapes and copy them into time-major buffers."""
    if values is None:
        raise ValueError("values is required by group_ppo: the critic's values (B, T) for every response token")
    valid = check_mask(response_mask, "response_mask")
    shape = tuple(valid.shape)
    check_float(rewards, "token_level_rewards", shape, response_mask.device)
    check_float(values, "values", shape, response_mask.device)
    if old_log_probs is not None:
        check_float(old_log_probs, "old_log_probs", shape, response_mask.device)
    dtype = torch.float64 if torch.float64 in (rewards.dtype, values.dtype) else torch.float32
    valid_tm = valid.t().contiguous()
    old_tm = None
    if params.boundary_rule == "low_prob":
        if old_log_probs is None:
            raise ValueError("old_log_probs is required by boundary_rule='low_prob'")
        old_tm = time_major(old_log_probs, dtype).masked_fill_(~valid_tm, 0.0)
        check_finite_at_valid(old_tm, "old_log_probs")
    ids = None
    if index is not None:
        ids = prompt_ids(index, shape[0])
    elif params.adv_norm == "prompt":
        raise ValueError("index (the prompt uid of each response) is required by adv_norm='prompt'")
    return Batch(valid, valid_tm, ~valid_tm, time_major(rewards, dtype), time_major(values, dtype), old_tm, ids,
                  int(torch.count_nonzero(valid_tm)))






# --------------------------------------------------------------------------------------------------
# steps 1-3: TD residuals, group ends, groups


def td_residuals(values: torch.Tensor, batch: Batch, gamma: float) -> torch.Tensor:
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
        check_finite_at_valid(batch.rewards_tm.masked_fill(batch.invalid_tm, 0.0), "token_level_rewards")
        check_finite_at_valid(values.masked_fill(batch.invalid_tm, 0.0), "values")
    return delta


def group_ends(delta_tm: torch.Tensor, batch: Batch, params: GroupParams, tau: float) -> torch.Tensor:
    """Group ends in time-major layout: bool (T, B), True at every endpoint (step 2) *and* at every
    masked position (so a group starts right after any True).

    ``turn`` ends groups only where every rule does (:func:`turn_ends`). The other rules add a cap of
    ``group_max_size`` tokens and their own cuts. The variance budget ``sum z_i >= tau`` with
    ``z_i = delta_i^2 / (sigma2 + eps)`` is evaluated as ``sum delta_i^2 >= tau * (sigma2 + eps)``: the
    same test, one pass fewer.
    """
    rule = params.boundary_rule
    if rule == "turn":
        return turn_ends(batch.invalid_tm)  # no cut of its own, no cap: one group per turn
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
    forced = turn_ends(batch.invalid_tm)
    if rule == "low_prob":
        low = batch.old_log_probs_tm.exp() < params.low_prob_threshold
        forced[:-1] |= low[1:] & valid[1:]
    torch.where(forced, _scalar(cap, inc), _scalar(1.0, inc), out=inc[:, 1])
    limits = torch.tensor([[limit], [float(cap)]], dtype=inc.dtype, device=inc.device)
    return _scan_budget(inc, limits)


def turn_ends(invalid_tm: torch.Tensor) -> torch.Tensor:
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


def group_starts(ends_tm: torch.Tensor, valid_tm: torch.Tensor) -> torch.Tensor:
    """Each group's first valid token: the one definition of it in this module (the pass, the group ids and the
    critic mask all come from here). (T, B) bool, True at a valid position that is the first of its response
    or follows a True of ``ends_tm`` (T, B) bool, which must be True at each group's last token and at every
    masked position. The result has ``valid_tm``'s memory layout (time-major, or a transposed (B, T) tensor)."""
    starts = torch.empty_like(valid_tm)
    starts[:1] = valid_tm[:1]
    torch.logical_and(valid_tm[1:], ends_tm[:-1], out=starts[1:])
    return starts


def ids_from_starts(starts: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Step 3's ids from the groups' first tokens ``starts`` (B, T) bool: long (B, T), 1-based, 0 where
    ``valid`` (B, T) bool is False."""
    return torch.cumsum(starts, dim=1, dtype=torch.int32).masked_fill_(~valid, 0).long()


# --------------------------------------------------------------------------------------------------
# step 4: segment GAE, for the critic's returns and, by the policy side, for the advantages


def segment_gae_step(delta: torch.Tensor, values: torch.Tensor, groups: Groups, batch: Batch,
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


def _segment_gaes(delta: torch.Tensor, values: torch.Tensor, batch: Batch, gamma: float, critic: _Recursion,
                  policy: _Recursion) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 4 for the critic and for the policy, from the TD residuals ``delta`` (T, B), which it consumes.

    Returns ``(returns, x)``: the critic's segment lambda-returns ``X + V`` (B, T) with ``values`` (T, B), a
    new tensor, 0 at masked positions; and the policy's X (T, B) in ``delta``'s buffer, for the caller to
    finish in place. Each of ``critic`` and ``policy`` is (cuts, lambda) of :func:`segment_gae_`. The one
    place a buffer serves twice: when the two recursions are the same (equal cuts, one scalar lambda) it runs
    once and the returns are read from it before it is handed on; otherwise the critic's recursion runs in a
    copy of ``delta``.
    """
    (ends, critic_lam), (cuts, policy_lam) = critic, policy
    if isinstance(policy_lam, float) and policy_lam == critic_lam and torch.equal(cuts, ends):
        segment_gae_(delta, ends, batch.invalid_tm, gamma, critic_lam)
        return _returns(delta, values, batch), delta
    x_critic = delta.clone()
    segment_gae_(x_critic, ends, batch.invalid_tm, gamma, critic_lam)
    segment_gae_(delta, cuts, batch.invalid_tm, gamma, policy_lam)
    return _returns(x_critic, values, batch), delta


def segment_gae_(x: torch.Tensor, ends_tm: torch.Tensor, invalid_tm: torch.Tensor, gamma: float,
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


def _returns(x_tm: torch.Tensor, values: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``X + V`` from the critic's X and ``values`` (T, B): (B, T), a new tensor, 0 at masked positions."""
    return to_batch_major(torch.add(x_tm, values).masked_fill_(batch.invalid_tm, 0.0))


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


def _normalize_advantages_(x: torch.Tensor, batch: Batch, settings: AlgorithmSettings,
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


def _normalize_by_prompt_(x: torch.Tensor, batch: Batch, stats_at_tm: torch.Tensor, norm_by_std: bool,
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


def _keep_endpoints_(x: torch.Tensor, endpoints_tm: torch.Tensor, batch: Batch) -> None:
    """Step 7's endpoint loss (``policy_loss_on: endpoints``), in place on the normalised advantages ``x``
    (T, B): 0 off ``endpoints_tm`` (T, B) bool, ``N_valid / N_endpoints`` times itself on them (both counted
    over the batch), so that verl's token-mean over the valid tokens is the mean over the endpoints."""
    n_endpoints = int(torch.count_nonzero(endpoints_tm))
    x.masked_fill_(~endpoints_tm, 0.0)
    if n_endpoints:
        x.mul_(batch.n_valid / n_endpoints)


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
