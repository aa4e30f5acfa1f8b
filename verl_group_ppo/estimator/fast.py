"""The fast pass: steps 1-7 of docs/algorithm.md vectorised over batch *and* time, with no Python loop over time.

:func:`run_steps` runs the steps in their order on (B, T) tensors; :mod:`verl_group_ppo.core_algos` validates the
inputs (:func:`prepare`) and reads the critic's outputs off the groups. The three places where the algorithm is
sequential in time are computed with whole-tensor operations:

- the next valid value of step 1 and the broadcast of step 4: index arithmetic (a reversed running minimum of
  positions, running counts of group starts) and gathers;
- step 2's budget scan (a running sum that resets when it reaches a limit): a group surely starts after every
  token that alone reaches the budget and after every forced end; from these sure starts every chain of groups is
  followed at once, group by group, each group's end found from float64 prefix sums (a window of 4 sums, then a
  binary search: ``log2(group_max_size)`` gathers). The rounds are as many as the most groups between two sure
  starts (a few at the default settings; at most T / 2). ``fixed`` and ``low_prob`` have no budget: their groups
  are every ``group_max_size`` tokens after a restart, in closed form;
- step 4's backward recursion ``X_i = delta_i + f_i X_{i+1}``: in closed form, ``X_i = sum_{j >= i} w_j delta_j /
  w_i`` with ``w_i = gamma**c_i * lam**e_i`` from integer counts of valid positions and ends (a reversed
  cumulative sum in float64, no compounded rounding); where a row's weights would leave float64's range (more
  than about 13,000 ends at lam = 0.95) or a factor is 0, an associative scan over (factor, residual) pairs,
  composed pairwise level by level (``log2(T)`` levels). At ``gamma = lam = 1`` it is a reversed cumulative sum.

Steps 2 and 4 run by blocks of rows (:func:`row_blocks`), which bounds their float64 buffers; on CPU, fresh
(B, T) buffers come from numpy (:func:`_new`). Conventions as in :mod:`verl_group_ppo.core_algos`.
Computation is in float64 when an input is float64, else in float32; step 2's prefix sums and step 4's scan are
float64 in both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple, Optional, Union

import numpy as np
import torch

from verl_group_ppo.config import AlgorithmSettings, GroupParams
from verl_group_ppo.estimator.checks import check_finite_at_valid, check_float, check_mask, prompt_ids
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


@dataclass(frozen=True)
class Groups:
    """The groups of one batch (step 3), made once by :func:`run_steps` from step 2's ends and read by every
    later step: step 4's cuts and broadcast, step 5's critic slots, step 6's per-prompt statistics, step 7's
    weights and the metrics. A group's first valid token (its critic slot) is :attr:`first`, from
    :func:`group_starts`; everything below is made from the ends when first read, and kept."""

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
        return _flat_nonzero(self.first.view(-1), torch.int64)

    @cached_property
    def sizes(self) -> torch.Tensor:
        """(G,) long: the valid tokens of each group, in the order of :attr:`slots` (groups never span a hole)."""
        return _flat_nonzero(self.endpoint_mask.view(-1), torch.int64).sub_(self.slots).add_(1)


class _PolicyX(NamedTuple):
    """Step 4's X for the advantages, and what steps 6 and 7 need to finish it."""

    x: torch.Tensor  # (B, T): X, in the buffer steps 6 and 7 finish in place
    stats_at: torch.Tensor  # (B, T) bool: where step 6's per-prompt statistics read X (one place per group)
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
    _normalize_advantages_(policy.x, batch, settings, policy.stats_at)  # step 6
    if policy.endpoints is not None:  # step 7, the actor's side: the endpoint loss
        _keep_endpoints_(policy.x, policy.endpoints, batch)
    return Steps(groups, policy.x, returns)


def prepare(rewards, response_mask, values, index, old_log_probs, params: GroupParams) -> Batch:
    """Validate the inputs' types and shapes and bring them to the compute dtype."""
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
    return Batch(valid, invalid, rewards.to(dtype).contiguous(), values.to(dtype).contiguous(), old, ids,
                 int(torch.count_nonzero(valid)))


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
    delta.add_(batch.rewards).sub_(values).masked_fill_(batch.invalid, 0.0)
    if not math.isfinite(sum_of_squares(delta)):
        check_finite_at_valid(batch.rewards.masked_fill(batch.invalid, 0.0), "token_level_rewards")
        check_finite_at_valid(values.masked_fill(batch.invalid, 0.0), "values")
    return delta


def next_valid_values(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, T), a new tensor: at each position, ``values`` at the next valid position after it in its row (across
    holes), 0 where none follows. Without holes (each row's valid positions one run) it is the next position's."""
    B, T = valid.shape
    out = _new((B, T), values.dtype, values.device)
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
    run_starts = valid.clone()
    run_starts[:, 1:] &= ~valid[:, :-1]
    return int(torch.count_nonzero(run_starts)) > int(torch.count_nonzero(valid.any(dim=1)))


def group_ends(delta: torch.Tensor, batch: Batch, params: GroupParams, tau: float) -> torch.Tensor:
    """Group ends (B, T) bool: True at every endpoint (step 2) *and* at every masked position (so a group starts
    right after any True).

    ``turn`` ends groups only where every rule does (:func:`turn_ends`). The other rules add a cap of
    ``group_max_size`` tokens and their own cuts: ``fixed`` and ``low_prob`` in closed form
    (:func:`_periodic_starts`), ``variance`` by following the chains of groups (:func:`_budget_starts`). The
    variance budget ``sum z_i >= tau`` with ``z_i = delta_i^2 / (sigma2 + eps)`` is evaluated as
    ``sum delta_i^2 >= tau * (sigma2 + eps)``: the same test, one pass fewer.
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
    if rule == "variance":
        sigma2 = sum_of_squares(delta) / batch.n_valid
        limit = float(torch.tensor(tau * (sigma2 + params.group_epsilon), dtype=delta.dtype))  # the compute dtype's
        for rows in row_blocks(valid.shape):
            starts[rows] = _budget_starts(forced[rows], valid[rows], cap, delta[rows] * delta[rows], limit)
    else:
        for rows in row_blocks(valid.shape):
            starts[rows] = _periodic_starts(forced[rows], valid[rows], cap)
    return _ends_from_starts(starts, batch.invalid)


def row_blocks(shape: tuple[int, ...], elements: int = 1 << 22) -> list[slice]:
    """Slices of consecutive rows of a (B, T) tensor, about ``elements`` elements each (one row at least),
    covering the B rows in order. Steps 2 and 4 run block by block: their float64 buffers are a block's, not
    the batch's. Smaller blocks would stay in the CPU's caches, but every block repeats the step's operations,
    and with several threads on shared cores each operation waits for the slowest thread."""
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
    position = torch.arange(B * T, dtype=_index_dtype(B * T), device=forced.device)
    last = torch.where(restart, position, 0)  # the last restart at or before each position
    if last.device.type == "cpu":
        np.maximum.accumulate(last.numpy(), out=last.numpy())
    else:
        last = torch.cummax(last, 0).values
    torch.remainder(position.sub_(last), cap, out=position)
    return (position == 0).view(B, T).logical_and_(valid)


def _budget_starts(forced: torch.Tensor, valid: torch.Tensor, cap: int, increments: torch.Tensor,
                   limit: float) -> torch.Tensor:
    """Group starts (B, T) bool of the ``variance`` rule: the chain of groups of each row, where a group starting
    at s ends at the first of its turn's last position (``forced`` (B, T)), s + ``cap`` - 1 and the first t with
    ``sum(increments[s..t]) >= limit`` (``increments`` (B, T), >= 0; sums as differences of float64 prefix sums
    over the rows in order).

    A group surely starts after every token that alone reaches the budget (``increments >= limit``: then every
    sum that holds it does) and after every forced position: the chains start again there. From each such start
    the chain is followed group by group to the next sure start, all chains at once: as many rounds as the most
    groups between two sure starts (at most ``cap`` tokens apart on average budgets; at most T in all).
    """
    B, T = forced.shape
    n = B * T
    reached = _new((n + 4 * cap,), torch.float64, forced.device)
    reached[0] = 0.0
    reached[n + 1:] = math.inf
    _cumsum64(increments.reshape(-1), reached[1:n + 1])
    after = reached[1:]  # after[t]: the sum of the increments up to t; reached[s]: before s
    alone = (increments >= limit).logical_or_(forced)  # a group starting here is this token alone
    start, one_token = _restarts(alone), alone.view(-1)
    start[:n] |= ~valid.view(-1)  # masked positions stop a chain as a start does
    index = _index_dtype(n + 4 * cap)
    forced_at = _flat_nonzero(forced.view(-1) & valid.view(-1), index)  # the turns' last positions, in order
    frontier = _flat_nonzero(start[:n] & ~one_token, index)  # the sure starts whose group goes on
    width = min(cap, 4)
    window = torch.arange(width, dtype=index, device=forced.device)
    forced_flat = torch.ones(n + width, dtype=torch.bool, device=forced.device)  # True past the batch
    forced_flat[:n] = forced.view(-1)
    while frontier.numel():
        # a group from s ends at the first of: its turn's last position, s + cap - 1, the first t reaching the
        # budget. The first `width` positions at once (neighbours in memory), the longer groups then in full.
        target = _take(reached, frontier).add_(limit)
        ahead = frontier.unsqueeze(1) + window
        stop = _take(after, ahead) >= target.unsqueeze(1)
        stop |= _take(forced_flat, ahead)
        end = torch.argmax(stop.to(torch.uint8), 1).to(index).add_(frontier)
        long = _flat_nonzero(~stop.any(1), torch.int64)
        if long.numel():
            end[long] = _group_end(frontier[long], target[long], after, forced_at, cap, width)
        nxt = end.add_(1)
        nxt = nxt[~_take(start, nxt)]  # chains that reach a known start stop there
        start[nxt] = True
        frontier = nxt[~_take(one_token, nxt)]
    return start[:n].view(B, T).logical_and_(valid)


def _group_end(start: torch.Tensor, target: torch.Tensor, after: torch.Tensor, forced_at: torch.Tensor, cap: int,
               width: int) -> torch.Tensor:
    """(S,): the last position of the groups starting at ``start`` (S,) that are longer than ``width``: the first of
    the turn's last position (the first of ``forced_at`` (K,) ascending at or after it), ``start + cap - 1`` and the
    first t with ``after[t] >= target`` (S,) (``after`` non-decreasing)."""
    end = start + (cap - 1)
    if cap > width:
        turn_end = _take(forced_at, torch.searchsorted(forced_at, start))
        reaching = _first_reaching(after, target, start + (width - 1), 1 << (cap.bit_length() - 1))
        torch.minimum(end, torch.minimum(turn_end, reaching), out=end)
    return end


def _first_reaching(after: torch.Tensor, target: torch.Tensor, below: torch.Tensor, step: int) -> torch.Tensor:
    """(S,): for each of the positions ``below`` (S,) with ``after[below] < target`` (S,), the first t after it with
    ``after[t] >= target``, or a position at least ``2 * step - 1`` after it (``after`` non-decreasing); by binary
    search from the power of two ``step``."""
    while step:
        candidate = below + step
        below = torch.where(_take(after, candidate) < target, candidate, below)
        step >>= 1
    return below.add_(1)


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
    return torch.cumsum(starts, dim=1, dtype=torch.int32).masked_fill_(~valid, 0).long()


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
    - else (``broadcast``): the groups' segment GAE with ``lam``, X at each group's first token written to
      every token of the group (:func:`_broadcast_from_starts`).
    """
    params, ends, gamma, invalid = settings.group, groups.ends, settings.gamma, batch.invalid
    critic_x = segment_scan(delta, ends, invalid, gamma, settings.critic_lam)
    returns = torch.add(critic_x, values, out=_new(values.shape, values.dtype, values.device))
    returns.masked_fill_(invalid, 0.0)
    if params.policy_loss_on == "endpoints":  # token-level GAE
        x = segment_scan(delta, torch.ones_like(ends), invalid, gamma, lam)
        return returns, _PolicyX(x, batch.valid, groups.endpoint_mask)
    same = isinstance(lam, float) and lam == settings.critic_lam
    x = critic_x if same else segment_scan(delta, ends, invalid, gamma, lam)
    if params.within_group == "per_token":
        return returns, _PolicyX(x, groups.first, None)
    return returns, _PolicyX(_broadcast_from_starts(x, groups.first), groups.first, None)


def segment_scan(delta: torch.Tensor, ends: torch.Tensor, invalid: torch.Tensor, gamma: float,
                 lam: Union[float, torch.Tensor]) -> torch.Tensor:
    """Segment GAE's X (B, T), a new tensor, from the TD residuals ``delta`` (B, T), 0 at masked positions.

    ``X_i = delta_i + gamma * (lam if i is an end else 1) * X_{i+1}`` backward over valid positions, X after the
    last = 0; masked positions pass X through (their residual is 0, their factor 1). ``ends`` (B, T) bool marks
    the ends; ``lam`` is a float or a (B,) tensor of per-response lambdas.

    In closed form (:func:`_closed_form_scan`): the product of the factors before position i is
    ``w_i = gamma**c_i * lam**e_i``, with c_i and e_i the counts of valid positions and of ends before i in its
    row (integers: no rounding compounds), so ``X_i = sum_{j >= i} w_j delta_j / w_i``, a reversed cumulative
    sum, in float64. Where a row's smallest w would leave float64's range (more than about 13,000 ends at
    lam = 0.95), or gamma or lam is 0, the recursion runs as an associative scan (:func:`_affine_scan`).
    At ``gamma = lam = 1`` it is a reversed cumulative sum.
    """
    if isinstance(lam, float) and gamma == 1.0 and lam == 1.0:  # every factor 1: a reversed cumulative sum
        return delta.flip(1).cumsum(1).flip(1)
    out = _new(delta.shape, delta.dtype, delta.device)
    for rows in row_blocks(delta.shape):
        lam_rows = lam[rows] if isinstance(lam, torch.Tensor) else lam
        x = _closed_form_scan(delta[rows], ends[rows], invalid[rows], gamma, lam_rows)
        out[rows] = x if x is not None else _scan_rows(delta[rows], ends[rows], invalid[rows], gamma, lam_rows)
    return out


def _scan_rows(delta: torch.Tensor, ends: torch.Tensor, invalid: torch.Tensor, gamma: float,
               lam: Union[float, torch.Tensor]) -> torch.Tensor:
    """:func:`segment_scan` by the associative scan (:func:`_affine_scan`) in float64, any factors."""
    lam_ = lam.unsqueeze(1).double() if isinstance(lam, torch.Tensor) else lam
    factor = torch.where(ends, gamma * lam_, torch.full((), gamma, dtype=torch.float64, device=delta.device))
    return _affine_scan(factor.masked_fill_(invalid, 1.0), delta.double()).to(delta.dtype)


#: the most negative log of a weight w_i the closed form uses: w and 1 / w stay far inside float64's range
_LOG_WEIGHT_FLOOR = -600.0


def _closed_form_scan(delta: torch.Tensor, ends: torch.Tensor, invalid: torch.Tensor, gamma: float,
                      lam: Union[float, torch.Tensor]) -> Optional[torch.Tensor]:
    """:func:`segment_scan` by its closed form; (B, T) in ``delta``'s dtype, or None where it does not apply."""
    B, T = delta.shape
    lams = (lam.double() if isinstance(lam, torch.Tensor)
            else torch.tensor([float(lam)], dtype=torch.float64, device=delta.device))
    if gamma == 0.0 or bool((lams == 0).any()) or T == 0:
        return None
    valid_ends = ends & ~invalid
    e = torch.cumsum(valid_ends, 1, dtype=torch.int32).sub_(valid_ends.to(torch.int32))  # ends before i
    log_w = e[:, -1:].double().mul_(lams.log().view(-1, 1))  # (B or 1, 1): log of each row's smallest weight
    c = None
    if gamma != 1.0:
        c = torch.cumsum(~invalid, 1, dtype=torch.int32).sub_((~invalid).to(torch.int32))  # valid positions before i
        log_w.add_(c[:, -1:].double() * math.log(gamma))
    if B and float(log_w.min()) < _LOG_WEIGHT_FLOOR:
        return None
    if isinstance(lam, torch.Tensor):
        w = e.double().mul_(lams.log().unsqueeze(1)).exp_()
    else:
        w = _take(torch.pow(lams, torch.arange(T + 1, dtype=torch.float64, device=delta.device)), e)
        w = w.view(B, T)
    if c is not None:
        w.mul_(_take(torch.pow(torch.tensor(gamma, dtype=torch.float64, device=delta.device),
                               torch.arange(T + 1, dtype=torch.float64, device=delta.device)), c).view(B, T))
    total = _reversed_cumsum(torch.mul(w, delta, out=_new(w.shape, w.dtype, w.device)))
    return torch.div(total, w, out=w).to(delta.dtype)


def _reversed_cumsum(x: torch.Tensor) -> torch.Tensor:
    """(R, T), in place on ``x`` (R, T) contiguous: the sums from each position to the end of its row."""
    if x.device.type == "cpu":
        view = x.numpy()[:, ::-1]
        np.cumsum(view, axis=1, out=view)
        return x
    return x.flip(1).cumsum(1).flip(1)


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


def _broadcast_from_starts(x: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """(B, T), a new tensor: every position carries X of ``x`` (B, T) at the first token of its group (A_k = X at
    s_k; ``first`` (B, T) bool marks those), found by the running count of group starts; masked positions carry
    their previous group's."""
    out = _new(x.shape, x.dtype, x.device)
    for rows in row_blocks(x.shape):
        starts = first[rows].reshape(-1)
        heads = _take(x[rows].reshape(-1), _flat_nonzero(starts, _index_dtype(starts.numel())))
        if heads.numel() == 0:
            out[rows] = 0.0
            continue
        group = torch.cumsum(starts, 0, dtype=torch.int32).sub_(1).clamp_(min=0)  # each position's, in flat order
        out[rows] = _take(heads, group).view(-1, x.shape[1])
    return out


# --------------------------------------------------------------------------------------------------
# steps 6 and 7: normalisation, the endpoint loss


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
    x.masked_fill_(invalid, 0.0)
    if mode == "batch" and batch.n_valid >= 2:
        n = batch.n_valid
        mean = x.sum() / (n + 1e-8)
        x.sub_(mean).masked_fill_(invalid, 0.0)
        var = sum_of_squares(x) / (n + 1e-8) * (n / (n - 1))
        x.mul_(1.0 / math.sqrt(var + 1e-8)).masked_fill_(invalid, 0.0)
    elif mode == "prompt":
        _normalize_by_prompt_(x, batch, stats_at, settings.norm_adv_by_std_in_grpo, settings.group.group_epsilon)


def _normalize_by_prompt_(x: torch.Tensor, batch: Batch, stats_at: torch.Tensor, norm_by_std: bool,
                          eps: float) -> None:
    """``adv_norm: prompt`` in place on ``x`` (B, T), 0 at masked positions (see :func:`_normalize_advantages_`)."""
    flat = torch.nonzero(stats_at.reshape(-1)).squeeze(1)
    group_adv, index = x.view(-1)[flat], batch.index
    row_pid = torch.as_tensor(index, device=x.device)
    pid = row_pid[flat // x.shape[1]]
    n_prompts = int(index.max()) + 1 if len(index) else 0
    count = torch.bincount(pid, minlength=n_prompts).to(x.dtype)
    total = torch.zeros(n_prompts, dtype=x.dtype, device=x.device).index_add_(0, pid, group_adv)
    mean = torch.where(count > 1, total / count.clamp(min=1), 0.0)
    sq = torch.zeros_like(mean).index_add_(0, pid, (group_adv - mean[pid]) ** 2)
    std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), 1.0)
    x.sub_(mean[row_pid].unsqueeze(1))
    if norm_by_std:
        x.div_(std[row_pid].unsqueeze(1) + eps)
    x.masked_fill_(batch.invalid, 0.0)


def _keep_endpoints_(x: torch.Tensor, endpoints: torch.Tensor, batch: Batch) -> None:
    """Step 7's endpoint loss (``policy_loss_on: endpoints``), in place on the normalised advantages ``x``
    (B, T): 0 off ``endpoints`` (B, T) bool, ``N_valid / N_endpoints`` times itself on them (both counted
    over the batch), so that verl's token-mean over the valid tokens is the mean over the endpoints."""
    n_endpoints = int(torch.count_nonzero(endpoints))
    x.masked_fill_(~endpoints, 0.0)
    if n_endpoints:
        x.mul_(batch.n_valid / n_endpoints)


def _index_dtype(size: int) -> torch.dtype:
    """int32 for flat indices below ``size`` when it fits (half the memory of int64), else int64."""
    return torch.int32 if size < 2**31 else torch.int64


def _flat_nonzero(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(N,) the positions where the 1-D bool ``mask`` is True, ascending, in ``dtype`` (numpy on CPU: faster)."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()).astype(np.dtype(str(dtype).split(".")[1]), copy=False))
    return torch.nonzero(mask).squeeze(1).to(dtype)


def _cumsum64(x: torch.Tensor, out: torch.Tensor) -> None:
    """The running sum of the 1-D ``x`` into the float64 ``out`` of its length, added in order (numpy on CPU:
    twice as fast as torch there, the same sums)."""
    if x.device.type == "cpu":
        np.cumsum(x.numpy(), dtype=np.float64, out=out.numpy())
    else:
        torch.cumsum(x, 0, dtype=torch.float64, out=out)


_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.int32: np.int32, torch.int64: np.int64,
                 torch.bool: np.bool_}


def _new(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor. On CPU its memory comes from numpy, which asks the kernel for huge pages for large
    buffers: the first touch of a fresh (B, T) buffer then costs a few page faults instead of thousands."""
    if device.type == "cpu" and dtype in _NUMPY_DTYPES:
        return torch.from_numpy(np.empty(shape, dtype=_NUMPY_DTYPES[dtype]))
    return torch.empty(shape, dtype=dtype, device=device)


def _take(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` for a 1-D ``table``, of ``index``'s shape (numpy's ``take`` on CPU, several times faster
    there than torch's)."""
    if table.device.type == "cpu":
        return torch.from_numpy(np.take(table.numpy(), index.numpy()))
    return table[index]
