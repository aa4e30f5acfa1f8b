"""The fast pass: steps 1-7 of docs/algorithm.md vectorised over batch *and* time, with no Python loop over time.

:func:`run_steps` runs the steps in their order on (B, T) tensors; :mod:`verl_group_ppo.core_algos` validates the
inputs (:func:`prepare`) and reads the critic's outputs off the groups. The three places where the algorithm is
sequential in time are computed with whole-tensor operations:

- the next valid value of step 1: a gather; the broadcast of step 4: each group's value repeated its size times
  into the valid positions (groups never span a hole);
- step 2's budget scan (a running sum that resets when it reaches a limit): a group surely starts after every
  token that alone reaches the budget and after every forced end; from these sure starts every chain of groups is
  followed at once, group by group, each group's end found by a binary search in float64 prefix sums
  (``log2(group_max_size)`` gathers). The rounds are as many as the most groups between two sure starts (a few at
  the default settings; at most T / 2). ``fixed`` and ``low_prob`` have no budget: their groups are every
  ``group_max_size`` tokens after a restart, in closed form;
- step 4's backward recursion ``X_i = delta_i + f_i X_{i+1}``: in closed form, ``X_i = q_i sum_{j >= i} delta_j /
  q_j`` with ``q_i`` the product of the factors from i to the row's end (a cumulative product and a cumulative sum
  in float64, run from the row's end); where a row's products would leave float64's range (more than about 13,000
  ends at lam = 0.95) or a factor is 0, an associative scan over (factor, residual) pairs, composed pairwise level
  by level (``log2(T)`` levels). At ``gamma = lam = 1`` it is a reversed cumulative sum.

With ``within_group: broadcast`` (the default) step 6 normalises the groups' advantages, one value per group
weighted by its size, and the broadcast then writes each token its group's normalised value.

Steps 2 and 4 run by blocks of rows (:func:`row_blocks`), which bounds their float64 buffers. On CPU the
whole-tensor work goes through numpy where numpy is the faster (gathers with 64-bit indices, reversed views,
mixed-dtype arithmetic) and fresh (B, T) buffers come from numpy (:func:`new_tensor`). Conventions as in
:mod:`verl_group_ppo.core_algos`. Computation is in float64 when an input is float64, else in float32; step 2's
prefix sums, step 4's scan and step 6's group statistics are float64 in both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple, Optional, Union

import numpy as np
import torch

from verl_group_ppo.config import AlgorithmSettings, GroupParams
from verl_group_ppo.estimator.checks import (check_finite_at_valid, check_float, check_mask, check_parent_nodes,
                                             prompt_ids)
from verl_group_ppo.metrics import sum_of_squares


@dataclass
class Batch:
    """Validated inputs, (B, T), in the compute dtype. ``rewards`` and ``values`` are the caller's tensors when they
    already have that dtype: the pass never writes them, and never reads their masked positions into a result."""

    valid: torch.Tensor  # (B, T) bool
    invalid: torch.Tensor  # (B, T) bool, ~valid
    rewards: torch.Tensor  # (B, T)
    values: torch.Tensor  # (B, T)
    old_log_probs: Optional[torch.Tensor]  # (B, T), 0 at masked positions; low_prob rule only
    index: Optional[np.ndarray]  # (B,) prompt ids as 0..P-1
    n_valid: int
    parent_nodes: Optional[torch.Tensor] = None  # (B, T) long, adv_norm='parent' only: each group's tree node


@dataclass(frozen=True)
class Groups:
    """The groups of one batch (step 3), made once by :func:`run_steps` from step 2's ends and read by every
    later step: step 4's cuts and broadcast, step 5's critic slots, step 6's statistics, step 7's weights and the
    metrics. A group's first valid token (its critic slot) is :attr:`first`, from :func:`group_starts`; everything
    below is made from the ends when first read, and kept."""

    ends: torch.Tensor  # (B, T) bool: each group's last valid token, and every masked position
    valid: torch.Tensor  # (B, T) bool

    @cached_property
    def first(self) -> torch.Tensor:
        """(B, T) bool: each group's first valid token, its critic slot (step 5)."""
        return group_starts(self.ends, self.valid)

    @cached_property
    def endpoint_mask(self) -> torch.Tensor:
        """(B, T) bool: each group's last valid token (step 2's endpoints)."""
        return self.ends & self.valid

    @cached_property
    def ids(self) -> torch.Tensor:
        """(B, T) long: the 1-based group ids of step 3, 0 at masked positions."""
        return ids_from_starts(self.first, self.valid)

    @cached_property
    def slots(self) -> torch.Tensor:
        """(G,) long: the flat (B, T) index of each group's first token, row by row."""
        return _flat_nonzero(self.first.view(-1))

    @cached_property
    def sizes(self) -> torch.Tensor:
        """(G,) long: the valid tokens of each group, in the order of :attr:`slots` (groups never span a hole)."""
        return _flat_nonzero(self.endpoint_mask.view(-1)).sub_(self.slots).add_(1)


class _PolicyX(NamedTuple):
    """Step 4's X for the advantages, and what steps 6 and 7 need to finish it."""

    x: torch.Tensor  # (B, T): X, in the buffer steps 6 and 7 finish in place (broadcast: the advantages)
    stats_at: Optional[torch.Tensor]  # (B, T) bool: where step 6's per-prompt statistics read X (one place per
    # group); None: step 6 is done (broadcast: on the groups, before the broadcast)
    endpoints: Optional[torch.Tensor]  # (B, T) bool: the positions step 7's endpoint loss keeps; None: all


class Steps(NamedTuple):
    """The results of :func:`run_steps`: the groups, and (B, T) tensors, 0 at masked positions."""

    groups: Groups
    advantages: torch.Tensor  # (B, T)
    returns: torch.Tensor  # (B, T)


def run_steps(batch: Batch, settings: AlgorithmSettings, tau: float, lam: Union[float, torch.Tensor],
              ends: Optional[torch.Tensor] = None) -> Steps:
    """Steps 1-7 of docs/algorithm.md on one batch, in their order, as far as the advantages and the returns
    need them. Step 5's critic slots are the groups' first tokens (:attr:`Groups.first`); the critic's other
    outputs (group ids, critic mask, explained variance, loss weights) are read off the groups afterwards.

    Args:
        batch: the validated inputs (:func:`prepare`); the values enter here, as an argument of steps 1 and 4.
        settings: the pass's settings; ``tau`` its variance threshold.
        lam: the advantages' lambda, a float or (B,) per-response lambdas in the compute dtype.
        ends: (B, T) bool, step 2's groups decided elsewhere (True at every group's last token and at every
            masked position); None runs step 2 here.
    """
    values = batch.values  # V (B, T): the critic's values, the one source of values (steps 1 and 4)
    delta = td_residuals(values, batch, settings.gamma)  # step 1
    if ends is None:
        ends = group_ends(delta, batch, settings.group, tau)  # step 2
    groups = Groups(ends, batch.valid)  # step 3
    returns, policy = segment_gae_step(delta, values, groups, batch, settings, lam)  # step 4
    if policy.stats_at is not None:  # step 6 (broadcast: done on the groups, by step 4's broadcast)
        _normalize_advantages_(policy.x, batch, settings, policy.stats_at)
    if policy.endpoints is not None:  # step 7, the actor's side: the endpoint loss
        _keep_endpoints_(policy.x, policy.endpoints, batch)
    return Steps(groups, policy.x, returns)


def prepare(rewards, response_mask, values, index, old_log_probs, params: GroupParams, parent_nodes=None) -> Batch:
    """Validate the inputs' types and shapes and bring them to the compute dtype (``parent_nodes``: read under
    ``adv_norm='parent'`` only, :func:`~verl_group_ppo.estimator.checks.check_parent_nodes`)."""
    if values is None:
        raise ValueError("values is required by group_ppo: the critic's values (B, T) for every response token")
    valid = check_mask(response_mask, "response_mask").contiguous()
    shape = tuple(valid.shape)
    check_float(rewards, "token_level_rewards", shape, response_mask.device)
    check_float(values, "values", shape, response_mask.device)
    if old_log_probs is not None:
        check_float(old_log_probs, "old_log_probs", shape, response_mask.device)
    dtype = torch.float64 if torch.float64 in (rewards.dtype, values.dtype) else torch.float32
    invalid = ~valid
    old = None
    if params.boundary_rule == "low_prob":
        if old_log_probs is None:
            raise ValueError("old_log_probs is required by boundary_rule='low_prob'")
        old = old_log_probs.to(dtype).masked_fill(invalid, 0.0)
        check_finite_at_valid(old, "old_log_probs")
    ids = None
    if index is not None:
        ids = prompt_ids(index, shape[0])
    elif params.adv_norm == "prompt":
        raise ValueError("index (the prompt uid of each response) is required by adv_norm='prompt'")
    nodes = check_parent_nodes(parent_nodes, valid, params.adv_norm)
    return Batch(valid, invalid, rewards.to(dtype).contiguous(), values.to(dtype).contiguous(), old, ids,
                 int(torch.count_nonzero(valid)), nodes)


# --------------------------------------------------------------------------------------------------
# steps 1-3: TD residuals, group ends, groups


def td_residuals(values: torch.Tensor, batch: Batch, gamma: float) -> torch.Tensor:
    """TD residuals (step 1) of the rewards and ``values`` (B, T): (B, T), a new tensor, 0 at masked positions.

    ``delta_i = r[p_i] + gamma * V[p_{i+1}] - V[p_i]`` over valid positions p_i, V after the last valid
    position = 0 (:func:`next_valid_values`). Raises ValueError naming the input when a reward or value at a
    valid position is not finite.
    """
    delta = next_valid_values(values, batch.valid)
    if gamma != 1.0:
        delta.mul_(gamma)
    # (r + gamma * V_next) - V, in the order of verl's GAE and the reference; junk at masked positions -> 0.
    _fill_where_(delta.add_(batch.rewards).sub_(values), batch.invalid, 0.0)
    if not math.isfinite(sum_of_squares(delta)):
        check_finite_at_valid(batch.rewards.masked_fill(batch.invalid, 0.0), "token_level_rewards")
        check_finite_at_valid(values.masked_fill(batch.invalid, 0.0), "values")
    return delta


def next_valid_values(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, T), a new tensor: at each position, ``values`` at the next valid position after it in its row (across
    holes), 0 where none follows. Without holes (each row's valid positions one run) it is the next position's."""
    B, T = valid.shape
    out = new_tensor((B, T), values.dtype, values.device)
    out[:, -1] = 0.0
    if T < 2:
        return out
    torch.where(valid[:, 1:], values[:, 1:], values.new_zeros(()), out=out[:, :-1])
    if not _has_holes(valid):
        return out
    positions = torch.arange(T, device=valid.device).expand(B, T)
    ahead = torch.where(valid, positions, T).flip(1).cummin(1).values.flip(1)  # first valid position >= t
    nxt = torch.cat([ahead[:, 1:], torch.full((B, 1), T, device=valid.device)], 1)  # first valid position > t
    padded = torch.cat([values.masked_fill(~valid, 0.0), torch.zeros((B, 1), dtype=values.dtype,
                                                                       device=values.device)], 1)
    return torch.gather(padded, 1, nxt)


def _has_holes(valid: torch.Tensor) -> bool:
    """Whether some row's valid positions are more than one run (a masked position between two valid ones)."""
    run_starts = int(torch.count_nonzero(torch.gt(valid[:, 1:], valid[:, :-1]))) + int(torch.count_nonzero(valid[:, 0]))
    return run_starts > int(torch.count_nonzero(valid.any(dim=1)))


def group_ends(delta: torch.Tensor, batch: Batch, params: GroupParams, tau: float) -> torch.Tensor:
    """Group ends (B, T) bool: True at every endpoint (step 2) *and* at every masked position (so a group starts
    right after any True).

    ``turn`` ends groups only where every rule does (:func:`turn_ends`). The other rules add a cap of
    ``group_max_size`` tokens and their own cuts: ``fixed`` and ``low_prob`` in closed form
    (:func:`_periodic_starts`), ``variance`` by following the chains of groups (:func:`_budget_starts`). The
    variance budget ``sum z_i >= tau`` with ``z_i = delta_i^2 / (sigma2 + eps)`` is evaluated as
    ``sum delta_i^2 >= tau * (sigma2 + eps)``: the same test, one pass fewer. A budget above the batch's whole sum
    of ``delta_i^2`` is never reached: the groups are then those of ``fixed``.
    """
    rule = params.boundary_rule
    if rule == "turn":
        return turn_ends(batch.invalid)  # no cut of its own, no cap: one group per turn
    valid = batch.valid
    T = valid.shape[1]
    cap = min(params.group_max_size, max(T, 1))
    if cap == 1 or (rule == "variance" and tau == 0.0) or batch.n_valid == 0:
        return torch.ones_like(valid)  # every valid token is its own group
    forced = turn_ends(batch.invalid)  # a masked position, or one that must end a group
    if rule == "low_prob":
        low = batch.old_log_probs.exp() < params.low_prob_threshold
        forced[:, :-1] |= low[:, 1:] & valid[:, 1:]
    starts = torch.empty_like(valid)
    total = sum_of_squares(delta) if rule == "variance" else 0.0
    limit = math.inf
    if rule == "variance":  # the compute dtype's limit
        limit = float(torch.tensor(tau * (total / batch.n_valid + params.group_epsilon), dtype=delta.dtype))
    for rows in row_blocks(valid.shape, 1 << 20):  # blocks whose prefix sums stay in the CPU's caches
        if limit <= 2.0 * total:
            starts[rows] = _budget_starts(forced[rows], valid[rows], cap, delta[rows], limit)
        else:
            starts[rows] = _periodic_starts(forced[rows], valid[rows], cap)
    return _ends_from_starts(starts, batch.invalid)


def row_blocks(shape: tuple[int, ...], elements: int = 1 << 22) -> list[slice]:
    """Slices of consecutive rows of a (B, T) tensor, about ``elements`` elements each (one row at least),
    covering the B rows in order. Steps 2 and 4 run block by block: their float64 buffers are a block's, not
    the batch's."""
    B, T = shape
    rows = max(1, elements // max(T, 1))
    return [slice(r, min(r + rows, B)) for r in range(0, B, rows)]


def turn_ends(invalid: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: every masked position, and every valid position that is the last of its turn (the
    next position is masked or does not exist). The ends every rule has; a new tensor."""
    ends = torch.empty_like(invalid)
    torch.logical_or(invalid[:, :-1], invalid[:, 1:], out=ends[:, :-1])
    ends[:, -1:] = True
    return ends


def _restarts(forced: torch.Tensor) -> torch.Tensor:
    """(B*T + 1,) bool, a new tensor: True at each row's first position, after every ``forced`` (B, T) position
    (where every chain of groups starts again) and at B*T."""
    B, T = forced.shape
    restart = torch.empty(B * T + 1, dtype=torch.bool, device=forced.device)
    restart[1:] = forced.view(-1)
    restart[:B * T:T] = True
    return restart


def _periodic_starts(forced: torch.Tensor, valid: torch.Tensor, cap: int) -> torch.Tensor:
    """Group starts (B, T) bool of the rules without a budget: a group starts at every restart (a row's first
    position, after a ``forced`` (B, T) position) and every ``cap`` valid positions after it (turns hold no
    masked position), at valid positions only."""
    B, T = forced.shape
    restart = _restarts(forced)[:B * T]
    position = torch.arange(B * T, dtype=torch.int64, device=forced.device)
    last = torch.where(restart, position, 0)  # the last restart at or before each position
    if last.device.type == "cpu":
        np.maximum.accumulate(last.numpy(), out=last.numpy())
    else:
        last = torch.cummax(last, 0).values
    torch.remainder(position.sub_(last), cap, out=position)
    return (position == 0).view(B, T).logical_and_(valid)


#: bits of the state of a position in :func:`_budget_starts`: a group starts here; this token is a group alone
_START, _ALONE = 1, 2


def _budget_starts(forced: torch.Tensor, valid: torch.Tensor, cap: int, delta: torch.Tensor,
                   limit: float) -> torch.Tensor:
    """Group starts (B, T) bool of the ``variance`` rule: the chain of groups of each row, where a group starting
    at s ends at the first of its turn's last position (``forced`` (B, T)), s + ``cap`` - 1 and the first t with
    ``sum(delta[s..t]**2) >= limit`` (``delta`` (B, T); a finite ``limit`` > 0; ``cap`` >= 2).

    A group surely starts after every token that alone reaches the budget and after every forced position: a group
    that holds such a token ends there. These tokens are each a group alone, and the chains start again after them.
    From each sure start the chain is followed group by group to the next sure start, all chains at once: as many
    rounds as the most groups between two sure starts. A group's end is found in the prefix sums
    (:func:`_budget_prefix`, where a forced position reaches the budget by itself) by :func:`_next_starts`. On CPU
    the rounds run on numpy arrays (the same operations, less overhead per call).
    """
    B, T = forced.shape
    n = B * T
    increments = torch.mul(delta, delta, out=new_tensor((B, T), delta.dtype, delta.device))
    alone = torch.ge(increments, limit).logical_or_(forced)
    reached = _array(_budget_prefix(increments, forced, limit, _SEARCH_PAD + _search_span(cap)))
    state = _array(_start_state(alone))
    del increments, alone
    frontier = _flat_nonzero(state[:n] == _START)  # the sure starts whose group goes on
    while len(frontier):
        nxt = _next_starts(reached, frontier, limit, cap)
        code = state[nxt]
        state[nxt] = code | _START
        frontier = nxt[code == 0]  # chains that reach a known start, or a token alone, stop there
    starts = torch.as_tensor(state[:n]).view(B, T) & _START
    return starts.view(torch.bool).logical_and_(valid)


#: the positions after a group's start that :func:`_next_starts` probes one by one before its binary search
_SEARCH_PAD = 2


def _search_span(cap: int) -> int:
    """The range of :func:`_next_starts`'s binary search: a power of two >= ``cap`` - 3 (1 for ``cap`` <= 4)."""
    return 1 << max(cap - 4, 0).bit_length()


def _next_starts(reached: Union[torch.Tensor, np.ndarray], start: Union[torch.Tensor, np.ndarray], limit: float,
                 cap: int) -> Union[torch.Tensor, np.ndarray]:
    """(S,) the first token after the group beginning at each of ``start`` (S,) (flat positions, none a token
    alone): after the first t > s whose prefix sum ``reached[t + 1]`` reaches ``reached[s] + limit``, or after
    s + ``cap`` - 1. ``reached`` (:func:`_budget_prefix`) is non-decreasing.

    Most groups are short: t = s + 1 and s + 2 are probed first (beside ``reached[s]`` in memory), the others
    found by a binary search from s + 2."""
    after = reached[1:]
    target = reached[start] + limit
    nxt = start + 2
    if cap <= 2:
        return nxt
    going = after[start + 1] < target  # the group goes on past s + 1
    nxt += going
    if cap == 3:
        return nxt
    rest = _flat_nonzero(going & (after[start + 2] < target))  # ... and past s + 2
    if len(rest):
        first, goal = start[rest], target[rest]
        below = first + 2  # the last position known not to reach the goal
        span = _search_span(cap)
        while span > 1:
            span >>= 1
            candidate = below + span
            below = _where(after[candidate] < goal, candidate, below)
        nxt[rest] = _minimum(below + 2, first + cap)
    return nxt


def _where(condition, a, b):
    """``numpy.where`` or ``torch.where``, by the arrays' kind."""
    return np.where(condition, a, b) if isinstance(condition, np.ndarray) else torch.where(condition, a, b)


def _minimum(a, b):
    """``numpy.minimum`` or ``torch.minimum``, by the arrays' kind."""
    return np.minimum(a, b) if isinstance(a, np.ndarray) else torch.minimum(a, b)


def _budget_prefix(increments: torch.Tensor, forced: torch.Tensor, limit: float, pad: int) -> torch.Tensor:
    """(B*T + 1 + pad,) float64, a new tensor: 0, then the running sum of ``increments`` (B, T) in flat order with
    ``limit`` in place of the increment at every ``forced`` (B, T) position, then +inf (``pad`` entries).

    A group that reaches a forced position t (or a token whose increment alone reaches ``limit``) reaches the
    budget there, in these float64 sums too: ``fl(P_t + x_t) >= fl(P_s + limit)`` whenever ``P_t >= P_s`` and
    ``x_t >= limit``, rounding being monotone."""
    n = increments.numel()
    out = new_tensor((n + 1 + pad,), torch.float64, increments.device)
    out[0] = 0.0
    out[n + 1:] = math.inf
    sums = out[1:n + 1]
    sums.copy_(increments.reshape(-1))
    _fill_where_(sums, forced.reshape(-1), limit)
    torch.cumsum(sums, 0, out=sums)
    return out


def _start_state(alone: torch.Tensor) -> torch.Tensor:
    """(B*T + 1,) uint8, a new tensor: ``_ALONE`` where ``alone`` (B, T) bool (whose last column must be True) is
    True, ``_START`` at every row's first position and after each such token, and ``_START`` at B*T."""
    n = alone.numel()
    state = torch.empty(n + 1, dtype=torch.uint8, device=alone.device)
    flat = alone.reshape(-1).view(torch.uint8)
    state[0] = _START
    state[1:] = flat  # _START after a token alone; a row's first position follows its previous row's last
    state[:n].add_(flat, alpha=_ALONE)
    return state


def _ends_from_starts(starts: torch.Tensor, invalid: torch.Tensor) -> torch.Tensor:
    """Group ends (B, T) bool from the group starts ``starts`` (B, T): True before each start and where
    :func:`turn_ends` of ``invalid`` (B, T) is."""
    ends = turn_ends(invalid)
    ends[:, :-1] |= starts[:, 1:]
    return ends


def group_starts(ends: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Each group's first valid token: the one definition of it in the package (the pass, the group ids and the
    critic mask all come from here). (B, T) bool, True at a valid position that is the first of its response
    or follows a True of ``ends`` (B, T) bool, which must be True at each group's last token and at every
    masked position."""
    starts = torch.empty_like(valid)
    starts[:, :1] = valid[:, :1]
    torch.logical_and(valid[:, 1:], ends[:, :-1], out=starts[:, 1:])
    return starts


def ids_from_starts(starts: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Step 3's ids from the groups' first tokens ``starts`` (B, T) bool: long (B, T), 1-based, 0 where
    ``valid`` (B, T) bool is False."""
    return _masked_long(torch.cumsum(starts, dim=1, dtype=torch.int32), valid)


# --------------------------------------------------------------------------------------------------
# step 4: segment GAE, for the critic's returns and, by the policy side, for the advantages


def segment_gae_step(delta: torch.Tensor, values: torch.Tensor, groups: Groups, batch: Batch,
                     settings: AlgorithmSettings, lam: Union[float, torch.Tensor]) -> tuple[torch.Tensor, _PolicyX]:
    """Step 4 from the TD residuals ``delta`` (B, T) and ``values`` (B, T): the critic's returns (B, T) (segment GAE
    with the groups' cuts and ``critic_lam``) and the advantages' X, made as the policy side asks. The one place
    ``policy_loss_on`` and ``within_group`` are read:

    - ``policy_loss_on: endpoints``: token-level GAE with ``lam`` (every token cut), which step 6 normalises
      over every valid token and step 7 keeps at the group endpoints only;
    - ``within_group: per_token``: the groups' segment GAE with ``lam``, each token keeping its own X;
    - else (``broadcast``): the groups' segment GAE with ``lam``, X at each group's first token (A_k = X at s_k),
      normalised by step 6 over the groups (:func:`_normalized_heads`: one value per group, the same statistics
      as over the tokens) and written to every token of the group (:func:`_broadcast_from_starts`).
    """
    params, ends, gamma, invalid = settings.group, groups.ends, settings.gamma, batch.invalid
    critic_x = segment_scan(delta, ends, invalid, gamma, settings.critic_lam)
    returns = _fill_where_(torch.add(critic_x, values, out=new_tensor(values.shape, values.dtype, values.device)),
                           invalid, 0.0)
    if params.policy_loss_on == "endpoints":  # token-level GAE
        x = segment_scan(delta, torch.ones_like(ends), invalid, gamma, lam)
        return returns, _PolicyX(x, batch.valid, groups.endpoint_mask)
    same = isinstance(lam, float) and lam == settings.critic_lam
    x = critic_x if same else segment_scan(delta, ends, invalid, gamma, lam)
    if params.within_group == "per_token":
        return returns, _PolicyX(x, groups.first, None)
    heads = _normalized_heads(gather_flat(x.view(-1), groups.slots), groups, batch, settings)  # step 6
    del x, critic_x  # freed before the broadcast's buffers: peak memory
    return returns, _PolicyX(_broadcast_from_starts(heads, groups), None, None)


def segment_scan(delta: torch.Tensor, ends: torch.Tensor, invalid: torch.Tensor, gamma: float,
                 lam: Union[float, torch.Tensor]) -> torch.Tensor:
    """Segment GAE's X (B, T), a new tensor, from the TD residuals ``delta`` (B, T), 0 at masked positions.

    ``X_i = delta_i + f_i X_{i+1}`` backward over valid positions, ``f_i = gamma * (lam if i is an end else 1)``,
    X after the last = 0; masked positions pass X through (their residual is 0, their factor 1). ``ends`` (B, T)
    bool marks the ends; ``lam`` is a float or a (B,) tensor of per-response lambdas.

    In closed form (:func:`_closed_form_scan`): with ``q_i`` the product of the factors from i to the row's end,
    ``X_i = q_i * sum_{j >= i} delta_j / q_j``, a cumulative product and a cumulative sum run from the row's end,
    in float64. Where a row's smallest q would leave float64's range (more than about 13,000 ends at lam = 0.95),
    or gamma or lam is 0, the recursion runs as an associative scan (:func:`_affine_scan`).
    At ``gamma = lam = 1`` it is a reversed cumulative sum.
    """
    if isinstance(lam, float) and gamma == 1.0 and lam == 1.0:  # every factor 1: a reversed cumulative sum
        return delta.flip(1).cumsum(1).flip(1)
    out = new_tensor(delta.shape, delta.dtype, delta.device)
    blocks = row_blocks(delta.shape, _SCAN_BLOCK)
    buffer = new_tensor((2, blocks[0].stop, delta.shape[1]), torch.float64, delta.device) if blocks else None
    for rows in blocks:
        lam_rows = lam[rows] if isinstance(lam, torch.Tensor) else lam
        if not _closed_form_scan(delta[rows], ends[rows], invalid[rows], gamma, lam_rows, out[rows], buffer):
            out[rows] = _scan_rows(delta[rows], ends[rows], invalid[rows], gamma, lam_rows)
    return out


#: the elements of one block of rows of :func:`segment_scan` (its two float64 buffers are a block's)
_SCAN_BLOCK = 1 << 20


def _scan_rows(delta: torch.Tensor, ends: torch.Tensor, invalid: torch.Tensor, gamma: float,
               lam: Union[float, torch.Tensor]) -> torch.Tensor:
    """:func:`segment_scan` by the associative scan (:func:`_affine_scan`) in float64, any factors."""
    lam_ = lam.unsqueeze(1).double() if isinstance(lam, torch.Tensor) else lam
    factor = torch.where(ends, gamma * lam_, torch.full((), gamma, dtype=torch.float64, device=delta.device))
    return _affine_scan(factor.masked_fill_(invalid, 1.0), delta.double()).to(delta.dtype)


#: the smallest product q_i the closed form uses (exp(-600)): q and 1 / q stay far inside float64's range
_SMALLEST_PRODUCT = math.exp(-600.0)


def _closed_form_scan(delta: torch.Tensor, ends: torch.Tensor, invalid: torch.Tensor, gamma: float,
                      lam: Union[float, torch.Tensor], out: torch.Tensor, buffer: torch.Tensor) -> bool:
    """:func:`segment_scan` of (R, T) rows by its closed form, written into ``out`` (R, T), with ``buffer``
    (2, >= R, T) float64 as its scratch; False (``out`` left as it was) where the closed form does not apply."""
    R, T = delta.shape
    lams = (lam.double() if isinstance(lam, torch.Tensor)
            else torch.tensor([float(lam)], dtype=torch.float64, device=delta.device))
    if gamma == 0.0 or bool((lams == 0).any()) or T == 0:
        return False
    valid = ~invalid
    q, total = buffer[0, :R], buffer[1, :R]  # q_i and sum_{j >= i} delta_j / q_j, from the row's end
    _factors_from_the_end(valid, ends & valid, gamma, lams, out=q)
    torch.cumprod(q, 1, out=q)
    if R and float(q[:, -1].min()) < _SMALLEST_PRODUCT:  # each row's smallest q: its first position's
        return False
    if delta.device.type == "cpu":  # numpy's reversed views: no flipped copies
        np.divide(delta.numpy()[:, ::-1], q.numpy(), out=total.numpy())
        torch.cumsum(total, 1, out=total)
        np.multiply(q.numpy()[:, ::-1], total.numpy()[:, ::-1], out=out.numpy(), casting="unsafe")
    else:
        torch.div(delta.flip(1), q, out=total)
        torch.cumsum(total, 1, out=total)
        out.copy_(total.mul_(q).flip(1))
    return True


def _factors_from_the_end(valid: torch.Tensor, at_end: torch.Tensor, gamma: float, lams: torch.Tensor,
                          out: torch.Tensor) -> None:
    """Step 4's factors ``f_i`` of (R, T) rows into ``out`` (R, T) float64, in reversed order (column c holds
    position T - 1 - c): ``gamma * lam`` where ``at_end`` (R, T) bool, ``gamma`` at the other ``valid`` (R, T)
    positions, 1 at masked ones; ``lams``: one lambda (1,) or one per row (R,), float64. Each factor is the
    product ``gamma * lam`` rounded once, as the recursion has it."""
    lams = lams.view(-1, 1)
    at_end, valid = at_end.flip(1), valid.flip(1)  # contiguous copies, reversed
    if valid.device.type != "cpu":
        torch.where(at_end, lams, torch.ones((), dtype=torch.float64, device=valid.device), out=out)
        if gamma != 1.0:
            torch.where(valid, out * gamma, out, out=out)
        return
    f = out.numpy()
    if float(lams.min()) >= 0.5:  # 1 + (lam - 1) is lam exactly there (Sterbenz): arithmetic, no branch
        np.multiply(at_end.numpy().view(np.uint8), (lams - 1.0).numpy(), out=f)
        np.add(f, 1.0, out=f)
    else:
        f.fill(1.0)
        np.copyto(f, lams.numpy(), where=at_end.numpy())
    if gamma != 1.0:
        np.multiply(f, gamma, out=f, where=valid.numpy())


def _affine_scan(factor: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``X_i = x_i + factor_i * X_{i+1}`` along the last dimension, ``X`` past the end = 0: (R, T) -> (R, T), new.

    The maps ``X -> x_i + factor_i X`` compose associatively. Each level composes neighbouring pairs (i even: the
    pair's map ``X -> x_i + factor_i x_{i+1} + factor_i factor_{i+1} X``), solves the half-length problem the same
    way, and reads X at the odd positions off the solved even ones: ``log2(T)`` levels, about 2 T compositions in
    all, products of factors only (no division).
    """
    R, T = x.shape
    if T <= 1:
        return x.clone()
    if T % 2:  # one more position, the identity map (factor 1, residual 0)
        factor = torch.cat([factor, factor.new_ones((R, 1))], 1)
        x = torch.cat([x, x.new_zeros((R, 1))], 1)
    a_even, a_odd, x_even, x_odd = factor[:, 0::2], factor[:, 1::2], x[:, 0::2], x[:, 1::2]
    pair_x = torch.addcmul(x_even, a_even, x_odd)
    pair_x = _affine_scan(a_even * a_odd, pair_x)  # X at the even positions
    out = torch.empty_like(x)
    out[:, 0::2] = pair_x
    out[:, 1:-1:2] = torch.addcmul(x_odd[:, :-1], a_odd[:, :-1], pair_x[:, 1:])
    out[:, -1] = x_odd[:, -1]
    return out if out.shape[1] == T else out[:, :T].contiguous()


def _broadcast_from_starts(heads: torch.Tensor, groups: Groups) -> torch.Tensor:
    """(B, T), a new tensor: every valid token carries its group's value of ``heads`` (G,), one per group in the
    order of :attr:`Groups.slots` (A_k = X at s_k, as step 6 left it); masked positions carry 0. Groups never span
    a hole, so the groups in that order, each repeated its :attr:`Groups.sizes` times, are the valid tokens in flat
    order. Copies only: every token's value is its group's, bit for bit."""
    valid = _array(groups.valid)
    if isinstance(valid, np.ndarray):  # CPU: numpy's repeat and boolean assignment, faster there than torch's
        out = new_tensor(valid.shape, heads.dtype, heads.device)
        advantages = out.numpy()
        advantages.fill(0)
        advantages[valid] = np.repeat(heads.numpy(), groups.sizes.numpy())  # A_k on group k's tokens
        return out
    out = torch.zeros(valid.shape, dtype=heads.dtype, device=heads.device)
    return out.masked_scatter_(valid, torch.repeat_interleave(heads, groups.sizes))


# --------------------------------------------------------------------------------------------------
# steps 6 and 7: normalisation, the endpoint loss


def _normalized_heads(heads: torch.Tensor, groups: Groups, batch: Batch, settings: AlgorithmSettings) -> torch.Tensor:
    """Step 6 for the broadcast advantages, on the groups: (G,), a new tensor, from ``heads`` (G,) (X at each
    group's first token, in the order of :attr:`Groups.slots`), each the advantage of its group's ``sizes`` tokens.

    ``batch``: :func:`_normalize_advantages_`'s statistics over the valid tokens, each group counted once per token
    (sums in float64); ``prompt``: per prompt id over the groups, each once (:func:`_set_moments`); ``parent``: the
    same per tree node, over the sibling groups that hang from it (``batch.parent_nodes`` at each group's first
    token); ``none``: ``heads`` as they are.
    """
    mode = settings.group.adv_norm
    if mode == "batch" and batch.n_valid >= 2:
        n = batch.n_valid
        x, tokens = heads.double(), groups.sizes.double()
        mean = _dot(tokens, x) / (n + 1e-8)
        x.sub_(mean)
        var = _dot(tokens, x * x) / (n + 1e-8) * (n / (n - 1))
        return x.mul_(1.0 / math.sqrt(var + 1e-8)).to(heads.dtype)
    if mode in ("prompt", "parent"):
        pid, n_sets = _group_sets(groups, batch, mode, heads.device)
        mean, scale = _set_moments(heads, pid, n_sets, settings.norm_adv_by_std_in_grpo, settings.group.group_epsilon)
        out = heads - mean[pid]
        return out.div_(scale[pid]) if scale is not None else out
    return heads.clone()


def _group_sets(groups: Groups, batch: Batch, mode: str, device: torch.device) -> tuple[torch.Tensor, int]:
    """The set each group is normalised in, (G,) long in 0..S-1, and S: ``prompt``, its row's prompt id; ``parent``,
    its tree node (``batch.parent_nodes`` at its first token), so the groups hanging from one node are siblings."""
    if mode == "prompt":
        pid = torch.as_tensor(batch.index, device=device)[groups.slots // batch.valid.shape[1]]
        return pid, _n_prompts(batch.index)
    _, pid = torch.unique(gather_flat(batch.parent_nodes.view(-1), groups.slots), return_inverse=True)
    return pid, int(pid.max()) + 1 if len(pid) else 0


def _normalize_advantages_(x: torch.Tensor, batch: Batch, settings: AlgorithmSettings,
                           stats_at: torch.Tensor) -> None:
    """Step 6, in place on the advantages ``x`` (B, T): 0 at masked positions, then per ``adv_norm``.

    ``batch``: verl's ``masked_whiten`` over valid tokens (mean = sum / (n + 1e-8), Bessel-corrected
    variance, ``(x - mean) * rsqrt(var + 1e-8)``), skipped with fewer than 2 valid tokens.
    ``prompt``: per prompt id, mean and Bessel std over the advantages at ``stats_at`` (B, T) bool (one
    position per group: each group once; a prompt with one group gets mean 0, std 1);
    ``(A - mean) / (std + eps)``, or ``A - mean`` without std scaling.
    """
    invalid, mode = batch.invalid, settings.group.adv_norm
    _fill_where_(x, invalid, 0.0)
    if mode == "batch" and batch.n_valid >= 2:
        n = batch.n_valid
        mean = x.sum() / (n + 1e-8)
        _fill_where_(x.sub_(mean), invalid, 0.0)
        var = sum_of_squares(x) / (n + 1e-8) * (n / (n - 1))
        x.mul_(1.0 / math.sqrt(var + 1e-8))  # 0 stays 0
    elif mode == "prompt":
        flat = _flat_nonzero(stats_at.reshape(-1))
        row_pid = torch.as_tensor(batch.index, device=x.device)
        mean, scale = _set_moments(x.view(-1)[flat], row_pid[flat // x.shape[1]], _n_prompts(batch.index),
                                   settings.norm_adv_by_std_in_grpo, settings.group.group_epsilon)
        x.sub_(mean[row_pid].unsqueeze(1))
        if scale is not None:
            x.div_(scale[row_pid].unsqueeze(1))
        _fill_where_(x, invalid, 0.0)


def _n_prompts(index: np.ndarray) -> int:
    """The number of prompts P of a batch's prompt ids ``index`` (B,), 0..P-1."""
    return int(index.max()) + 1 if len(index) else 0


def _set_moments(adv: torch.Tensor, pid: torch.Tensor, n_sets: int, norm_by_std: bool,
                 eps: float) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Per set (a prompt, or a tree node's siblings), from the advantages ``adv`` (N,) of set ids ``pid`` (N,), each
    in 0..n_sets-1: the mean (n_sets,) and, with ``norm_by_std``, the divisor ``std + eps`` (n_sets,)
    (Bessel std; a set with fewer than 2 advantages gets mean 0 and std 1), else None."""
    count = torch.bincount(pid, minlength=n_sets).to(adv.dtype)
    total = torch.zeros(n_sets, dtype=adv.dtype, device=adv.device).index_add_(0, pid, adv)
    mean = torch.where(count > 1, total / count.clamp(min=1), 0.0)
    if not norm_by_std:
        return mean, None
    sq = torch.zeros_like(mean).index_add_(0, pid, (adv - mean[pid]) ** 2)
    return mean, torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), 1.0) + eps


def _keep_endpoints_(x: torch.Tensor, endpoints: torch.Tensor, batch: Batch) -> None:
    """Step 7's endpoint loss (``policy_loss_on: endpoints``), in place on the normalised advantages ``x``
    (B, T): 0 off ``endpoints`` (B, T) bool, ``N_valid / N_endpoints`` times itself on them (both counted
    over the batch), so that verl's token-mean over the valid tokens is the mean over the endpoints."""
    n_endpoints = int(torch.count_nonzero(endpoints))
    x.masked_fill_(~endpoints, 0.0)
    if n_endpoints:
        x.mul_(batch.n_valid / n_endpoints)


# --------------------------------------------------------------------------------------------------
# whole-tensor helpers (numpy on CPU where it is the faster)


def _dot(a: torch.Tensor, b: torch.Tensor) -> float:
    """The dot product of two (N,) float64 tensors as a Python float (numpy's BLAS on CPU: faster there)."""
    if a.device.type == "cpu":
        return float(np.dot(a.numpy(), b.numpy()))
    return float(torch.dot(a, b))


def _array(x: torch.Tensor) -> Union[torch.Tensor, np.ndarray]:
    """``x`` as the array step 2's rounds of index arithmetic and step 4's broadcast run on: a numpy view on CPU
    (less overhead per call than torch's), else ``x``."""
    return x.numpy() if x.device.type == "cpu" else x


def _masked_long(counts: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, T) long, a new tensor: the integer ``counts`` (B, T) where ``valid`` (B, T) bool, 0 elsewhere."""
    out = new_tensor(tuple(counts.shape), torch.int64, counts.device)
    if out.device.type == "cpu":
        np.multiply(counts.numpy(), valid.numpy(), out=out.numpy())
        return out
    return torch.mul(counts, valid, out=out)


def _fill_where_(x: torch.Tensor, mask: torch.Tensor, value: float) -> torch.Tensor:
    """``x[mask] = value`` in place (``x`` and ``mask`` of one shape; numpy's ``copyto`` on CPU, faster there than
    ``masked_fill_``); returns ``x``."""
    if x.device.type == "cpu":
        np.copyto(x.numpy(), value, where=mask.numpy())
        return x
    return x.masked_fill_(mask, value)


def _flat_nonzero(mask: Union[torch.Tensor, np.ndarray]) -> Union[torch.Tensor, np.ndarray]:
    """(N,) long: the positions where the 1-D bool ``mask`` is True, ascending (numpy on CPU: faster; a numpy
    array for a numpy array)."""
    if isinstance(mask, np.ndarray):
        return np.flatnonzero(mask)
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return torch.nonzero(mask).squeeze(1)


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.int32: np.int32, torch.int64: np.int64,
                 torch.bool: np.bool_, torch.uint8: np.uint8}


def new_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor. On CPU its memory comes from numpy, which asks the kernel for huge pages for large
    buffers: the first touch of a fresh (B, T) buffer then costs a few page faults instead of thousands."""
    if device.type == "cpu" and dtype in _NUMPY_DTYPES:
        return torch.from_numpy(np.empty(shape, dtype=_NUMPY_DTYPES[dtype]))
    return torch.empty(shape, dtype=dtype, device=device)


def gather_flat(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` for a 1-D ``table`` and long ``index`` of any shape, a new tensor of ``index``'s shape
    (numpy's ``take`` on CPU, several times faster there than torch's indexing)."""
    if table.device.type == "cpu":
        return torch.from_numpy(np.take(table.numpy(), index.numpy()))
    return table[index]


def _put(table: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """``table[index] = values`` in place for a 1-D ``table`` and long ``index`` (N,) (numpy on CPU)."""
    if table.device.type == "cpu":
        table.numpy()[index.numpy()] = values.numpy()
    else:
        table[index] = values
