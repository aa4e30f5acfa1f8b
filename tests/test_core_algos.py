"""GROUP-PPO core: fast implementation vs the loop reference, the properties of docs/algorithm.md, verl equalities, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf
from verl.trainer.ppo.core_algos import compute_gae_advantage_return, compute_grpo_outcome_advantage

from verl_group_ppo.config import V1_GROUP_PARAMS, GroupParams, read_algorithm_settings
from verl_group_ppo.core_algos import (
    AdaptiveThreshold,
    compute_group_advantage,
    compute_group_ppo_outputs,
    create_critic_endpoint_mask,
    endpoints_to_group_ids,
    explained_variance,
    find_group_endpoints,
    segment_gae,
    update_threshold,
)
from verl_group_ppo.estimator.reference import reference_group_ppo, segment_gae_batch

F64 = torch.float64


def make_batch(seed: int, B: int, T: int, mask_kind: str = "prefix", dense: bool = True, junk: bool = True,
               empty_rows: bool = False, n_prompts: int = 2, dtype=F64):
    """Rewards, mask, values, old log-probs and uids; masked positions hold junk (NaN, inf) when asked."""
    g = torch.Generator().manual_seed(seed)
    if mask_kind == "prefix":
        lengths = torch.randint(1, T + 1, (B,), generator=g)
        mask = (torch.arange(T)[None] < lengths[:, None]).to(dtype)
    elif mask_kind == "holes":  # multi-turn: runs of valid tokens separated by masked observations
        mask = (torch.rand(B, T, generator=g) < 0.75).to(dtype)
        mask[:, 0] = 1
    else:  # anything, leading masked positions included
        mask = (torch.rand(B, T, generator=g) < 0.5).to(dtype)
    if empty_rows:
        mask[torch.rand(B, generator=g) < 0.3] = 0
    valid = mask.bool()
    if dense:
        rewards = torch.randn(B, T, generator=g, dtype=dtype)
    else:  # outcome reward at the last valid token
        rewards = torch.zeros(B, T, dtype=dtype)
        for b in range(B):
            idx = valid[b].nonzero()
            if len(idx):
                rewards[b, idx[-1]] = float(torch.randint(0, 2, (1,), generator=g))
    values = torch.randn(B, T, generator=g, dtype=dtype)
    old_log_probs = torch.rand(B, T, generator=g, dtype=dtype).clamp(min=1e-3).log()
    if junk:
        junk_values = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30], dtype=dtype)
        pick = torch.randint(0, 4, (B, T), generator=g)
        for x in (rewards, values, old_log_probs):
            x[~valid] = junk_values[pick[~valid]]
    index = np.array([f"uid-{b % n_prompts}" for b in range(B)], dtype=object)
    return rewards, mask, values, old_log_probs, index


def config(gamma=1.0, lam=1.0, norm_by_std=True, **group):
    """verl's ``algorithm`` config. ``lam`` drives both lambdas unless ``policy_lam``/``critic_lam`` are given
    (policy_lam's package default is 0.95, so the helper sets it to null = algorithm.lam)."""
    group.setdefault("adaptive_threshold", False)
    group.setdefault("policy_lam", None)
    return {"gamma": gamma, "lam": lam, "norm_adv_by_std_in_grpo": norm_by_std, "group_params": group}


def algo_settings(*args, **kwargs):
    """Typed settings for compute_group_ppo_outputs, from the same arguments as :func:`config`."""
    return read_algorithm_settings(config(*args, **kwargs))


def assert_close(a, b, tol=1e-9):
    torch.testing.assert_close(a.to(F64), b.to(F64), rtol=tol, atol=tol, equal_nan=False)


# --------------------------------------------------------------------------------------------------
# fast == reference


@st.composite
def cases(draw):
    T = draw(st.integers(1, 20))
    return dict(
        seed=draw(st.integers(0, 2**31 - 1)),
        B=draw(st.integers(1, 6)),
        T=T,
        mask_kind=draw(st.sampled_from(["prefix", "holes", "random"])),
        dense=draw(st.booleans()),
        empty_rows=draw(st.booleans()),
        n_prompts=draw(st.integers(1, 3)),
        gamma=draw(st.one_of(st.sampled_from([0.0, 0.5, 0.99, 1.0]), st.floats(0.0, 1.0))),
        lam=draw(st.one_of(st.sampled_from([0.0, 0.95, 1.0]), st.floats(0.0, 1.0))),
        critic_lam=draw(st.one_of(st.none(), st.sampled_from([0.0, 0.9, 1.0]), st.floats(0.0, 1.0))),
        threshold=draw(st.one_of(st.sampled_from([0.0, 0.3, 1.0, 4.0, math.inf]), st.floats(0.0, 50.0))),
        group_max_size=draw(st.integers(1, T + 2)),
        boundary_rule=draw(st.sampled_from(["variance", "fixed", "low_prob", "turn"])),
        adv_norm=draw(st.sampled_from(["batch", "prompt", "none"])),
        norm_by_std=draw(st.booleans()),
        low_prob_threshold=draw(st.sampled_from([0.1, 0.5, 0.9])),
        within_group=draw(st.sampled_from(["broadcast", "per_token"])),
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_fast_equals_loop_reference(case):
    rewards, mask, values, olp, index = make_batch(case["seed"], case["B"], case["T"], case["mask_kind"],
                                                   case["dense"], True, case["empty_rows"], case["n_prompts"])
    cfg = config(case["gamma"], case["lam"], case["norm_by_std"], group_max_size=case["group_max_size"],
                 boundary_rule=case["boundary_rule"], adv_norm=case["adv_norm"],
                 low_prob_threshold=case["low_prob_threshold"], critic_lam=case["critic_lam"],
                 within_group=case["within_group"])
    out = compute_group_ppo_outputs(rewards, mask, values=values, index=index, settings=read_algorithm_settings(cfg),
                                    old_log_probs=olp,
                                    threshold=case["threshold"])
    ref = reference_group_ppo(rewards, mask, values, gamma=case["gamma"], lam=case["lam"],
                              threshold=case["threshold"], group_max_size=case["group_max_size"],
                              boundary_rule=case["boundary_rule"], adv_norm=case["adv_norm"],
                              norm_by_std=case["norm_by_std"], low_prob_threshold=case["low_prob_threshold"],
                              old_log_probs=olp, index=index, critic_lam=case["critic_lam"],
                              within_group=case["within_group"])
    assert torch.equal(out.endpoint_mask, ref.endpoints)
    assert torch.equal(out.group_ids, ref.group_ids)
    assert torch.equal(out.critic_mask, ref.critic_mask)
    assert_close(out.critic_loss_weights, ref.critic_loss_weights)
    assert_close(out.returns, ref.returns)
    assert_close(out.advantages, ref.advantages)
    assert out.metrics["group/num_groups"] == ref.num_groups
    assert out.metrics["group/max_group_size"] == ref.max_group_size
    if math.isnan(ref.explained_variance):
        assert math.isnan(out.boundary_explained_variance)
    else:
        assert out.boundary_explained_variance == pytest.approx(ref.explained_variance, abs=1e-9)
    # the plain estimator gives the same advantages and returns
    adv, ret = compute_group_advantage(rewards, mask, values=values, index=index, config=cfg, old_log_probs=olp,
                                       threshold=case["threshold"])
    assert torch.equal(adv, out.advantages) and torch.equal(ret, out.returns)


# --------------------------------------------------------------------------------------------------
# step 4's kernel alone == its loop twin


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), B=st.integers(1, 6), T=st.integers(1, 20),
       mask_kind=st.sampled_from(["prefix", "holes", "random"]), empty_rows=st.booleans(),
       gamma=st.one_of(st.sampled_from([0.0, 0.99, 1.0]), st.floats(0.0, 1.0)),
       lam=st.one_of(st.sampled_from([0.0, 0.95, 1.0, "per_response"]), st.floats(0.0, 1.0)),
       end_prob=st.sampled_from([0.0, 0.3, 1.0]), dtype=st.sampled_from([torch.float32, F64]))
def test_segment_gae_equals_its_loop_twin(seed, B, T, mask_kind, empty_rows, gamma, lam, end_prob, dtype):
    """Holes, empty rows, junk at masked positions, ends anywhere (masked ones included), one lambda or one
    per response: the vectorised kernel equals the per-response loop, and leaves its inputs as they were."""
    _, mask, deltas, _, _ = make_batch(seed, B, T, mask_kind, junk=True, empty_rows=empty_rows, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    ends = torch.rand(B, T, generator=g) < end_prob
    if lam == "per_response":
        lam = torch.rand(B, generator=g, dtype=F64)
    before = [x.clone() for x in (deltas, ends, mask)] + [lam.clone() if isinstance(lam, torch.Tensor) else lam]
    x = segment_gae(deltas, ends, mask, gamma, lam)
    assert x.dtype == dtype and x.shape == (B, T)
    assert_close(x, segment_gae_batch(deltas, ends, mask, gamma, lam), 1e-12 if dtype == F64 else 1e-4)
    assert bool((x[~mask.bool()] == 0).all())
    after = [deltas, ends, mask, lam]
    for a, b in zip(before[:3], after[:3]):
        assert torch.equal(a.nan_to_num(7.0, 7.0, 7.0), b.nan_to_num(7.0, 7.0, 7.0))
    assert torch.equal(before[3], lam) if isinstance(lam, torch.Tensor) else before[3] == lam


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.99, 0.95), (1.0, 0.0), (0.0, 1.0), (1.0, 1.0), (0.999, 0.5),
                                        (1.0, "per_response")])
def test_segment_gae_at_32768_tokens_in_float32_stays_within_1e_5_of_the_float64_loop(gamma, lam):
    """Stable at long rows: the closed form's weights come from integer counts; beyond float64's range of them, and
    at a factor 0, the associative scan composes factors pairwise (no division)."""
    B, T = 2, 32768
    _, mask, deltas, _, _ = make_batch(3, B, T, "holes", junk=True, dtype=torch.float32)
    ends = torch.rand(B, T, generator=torch.Generator().manual_seed(4)) < 0.3
    if lam == "per_response":
        lam = torch.tensor([0.9, 0.999])
    want = segment_gae_batch(deltas, ends, mask, gamma, lam)
    got = segment_gae(deltas, ends, mask, gamma, lam)
    assert got.dtype == torch.float32
    assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())


@pytest.mark.parametrize("rule, cap, threshold", [("variance", 16, 1.0), ("variance", 400, 6.0), ("variance", 3, 0.3),
                                                   ("fixed", 7, 1.0), ("low_prob", 16, 1.0)])
@pytest.mark.parametrize("mask_kind", ["prefix", "holes"])
def test_long_rows_cut_exactly_the_references_groups(rule, cap, threshold, mask_kind):
    """Step 2 at thousands of tokens a row (many rounds along the chains and binary-search steps): the same groups
    as the reference's loop, and the same advantages and returns."""
    rewards, mask, values, olp, index = make_batch(11, 3, 2500, mask_kind, junk=True)
    cfg = config(0.99, 0.9, group_max_size=cap, boundary_rule=rule, low_prob_threshold=0.2)
    out = compute_group_ppo_outputs(rewards, mask, values=values, index=index, settings=read_algorithm_settings(cfg),
                                    old_log_probs=olp, threshold=threshold)
    ref = reference_group_ppo(rewards, mask, values, gamma=0.99, lam=0.9, threshold=threshold, group_max_size=cap,
                              boundary_rule=rule, low_prob_threshold=0.2, old_log_probs=olp, index=index)
    assert torch.equal(out.endpoint_mask, ref.endpoints)
    assert 1.2 < out.mean_group_size < cap  # groups of several tokens, not all at their cap
    assert_close(out.returns, ref.returns)
    assert_close(out.advantages, ref.advantages)


# --------------------------------------------------------------------------------------------------
# groups decided elsewhere: the endpoints argument


@pytest.mark.parametrize("rule", ["variance", "low_prob", "turn"])
def test_given_endpoints_reproduce_the_pass_that_found_them(rule):
    rewards, mask, values, olp, index = make_batch(21, 6, 40, "holes", junk=True)
    settings = algo_settings(0.99, 0.9, boundary_rule=rule, group_max_size=6, adv_norm="prompt", low_prob_threshold=0.3)
    own = compute_group_ppo_outputs(rewards, mask, values=values, index=index, settings=settings, old_log_probs=olp,
                                    threshold=1.5)
    endpoints = find_group_endpoints(rewards, mask, values=values, old_log_probs=olp, gamma=0.99, threshold=1.5,
                                     group_max_size=6, boundary_rule=rule, low_prob_threshold=0.3)
    assert torch.equal(endpoints, own.endpoint_mask)
    given = compute_group_ppo_outputs(rewards, mask, values=values, index=index, settings=settings, old_log_probs=olp,
                                      threshold=1.5, endpoints=endpoints)
    for name in ("advantages", "returns", "group_ids", "endpoint_mask", "critic_mask", "critic_loss_weights"):
        assert torch.equal(getattr(given, name), getattr(own, name)), name
    adv, ret = compute_group_advantage(rewards, mask, values=values, index=index, config=config(0.99, 0.9),
                                       endpoints=endpoints)
    assert torch.equal(adv, compute_group_ppo_outputs(rewards, mask, values=values, index=index,
                                                      settings=algo_settings(0.99, 0.9), endpoints=endpoints).advantages)


def test_given_endpoints_replace_step_2_and_a_hole_still_ends_a_group():
    mask = torch.tensor([[1.0, 1, 1, 0, 1, 1, 1, 1]])
    rewards, values = torch.zeros(1, 8), torch.zeros(1, 8)
    endpoints = torch.tensor([[False, False, False, False, False, True, False, False]])  # the hole and the end add theirs
    out = compute_group_ppo_outputs(rewards, mask, values=values, settings=algo_settings(), endpoints=endpoints)
    assert out.group_ids.tolist() == [[1, 1, 1, 0, 2, 2, 3, 3]]
    assert out.endpoint_mask.tolist() == [[False, False, True, False, False, True, False, True]]
    assert out.critic_mask.tolist() == [[1.0, 0, 0, 0, 1, 0, 1, 0]]


@pytest.mark.parametrize("endpoints, message", [
    (torch.zeros(2, 8, dtype=torch.bool), "endpoints must be a \\(B, T\\) tensor"),
    ([[False] * 8], "endpoints must be a \\(B, T\\) tensor"),
    (torch.full((1, 8), 0.5), "endpoints must contain only 0 and 1"),
    (torch.tensor([[False, False, False, True, False, False, False, False]]), "endpoints must be False at masked"),
])
def test_bad_endpoints_are_named(endpoints, message):
    mask = torch.tensor([[1.0, 1, 1, 0, 1, 1, 1, 1]])
    with pytest.raises(ValueError, match=message):
        compute_group_ppo_outputs(torch.zeros(1, 8), mask, values=torch.zeros(1, 8), settings=algo_settings(),
                                  endpoints=endpoints)


def test_segment_gae_with_every_token_an_end_gives_verls_gae_returns():
    rewards, mask, values, _, _ = make_batch(5, 6, 17, "holes", junk=False)
    valid = mask.bool()
    # TD residuals over valid positions, V after the last = 0 (what compute_group_ppo_outputs' step 1 gives)
    deltas = torch.zeros_like(values)
    for b in range(mask.shape[0]):
        p = valid[b].nonzero().squeeze(1).tolist()
        for i, t in enumerate(p):
            deltas[b, t] = rewards[b, t] + 0.99 * (values[b, p[i + 1]] if i + 1 < len(p) else 0.0) - values[b, t]
    x = segment_gae(deltas, torch.ones_like(valid), mask, 0.99, 0.9)
    _, verl_returns = compute_gae_advantage_return(rewards, values, mask, gamma=0.99, lam=0.9)
    assert_close((x + values)[valid], verl_returns[valid])


@pytest.mark.parametrize("change, name", [
    ({"deltas": torch.zeros(2, 3, dtype=torch.long)}, "deltas"),
    ({"deltas": torch.zeros(3, 3)}, "deltas"),
    ({"ends": torch.zeros(2, 4, dtype=torch.bool)}, "ends"),
    ({"response_mask": torch.full((2, 3), 0.5)}, "response_mask"),
    ({"gamma": 1.5}, "gamma"),
    ({"lam": -0.1}, "lam"),
    ({"lam": torch.tensor([0.5, 0.5, 0.5])}, "lam"),
    ({"lam": torch.tensor([0.5, 2.0])}, "lam"),
])
def test_segment_gae_bad_input_is_named(change, name):
    args = {"deltas": torch.zeros(2, 3), "ends": torch.ones(2, 3, dtype=torch.bool), "response_mask": torch.ones(2, 3),
            "gamma": 1.0, "lam": 0.9, **change}
    with pytest.raises(ValueError, match=name):
        segment_gae(**args)


# --------------------------------------------------------------------------------------------------
# the numbered properties (docs/algorithm.md and the reference definition it cites)


@pytest.mark.parametrize("mask_kind", ["prefix", "holes", "random"])
@pytest.mark.parametrize("rule", ["variance", "fixed", "low_prob", "turn"])
def test_groups_partition_valid_tokens_into_contiguous_capped_runs(mask_kind, rule):  # properties 1, 2, 3, 6
    rewards, mask, values, olp, index = make_batch(3, 8, 40, mask_kind, empty_rows=True)
    gmax = 5
    out = compute_group_ppo_outputs(rewards, mask, values=values, index=index,
                                    settings=algo_settings(group_max_size=gmax, boundary_rule=rule),
                                    old_log_probs=olp, threshold=2.0)
    valid = mask.bool()
    assert torch.all(out.group_ids[~valid] == 0) and torch.all(out.group_ids[valid] > 0)
    for b in range(mask.shape[0]):
        pos = valid[b].nonzero().squeeze(1).tolist()
        ids = out.group_ids[b, pos].tolist()
        if not pos:
            continue
        assert ids[0] == 1 and all(0 <= j - i <= 1 for i, j in zip(ids, ids[1:]))  # contiguous, in order
        for k in set(ids):
            members = [p for p, i in zip(pos, ids) if i == k]
            assert len(members) <= gmax or rule == "turn"  # turn: one group per turn, however long
            assert members == list(range(members[0], members[-1] + 1))  # no group spans a hole
            assert out.critic_mask[b, members].tolist() == [1.0] + [0.0] * (len(members) - 1)  # one slot, first
            assert out.endpoint_mask[b, members[-1]] and not out.endpoint_mask[b, members[:-1]].any()
            assert len(set(out.advantages[b, members].tolist())) == 1  # constant within the group
        assert out.endpoint_mask[b, pos[-1]]  # the last valid token ends a group
    assert int(out.critic_mask.sum()) == out.metrics["group/num_groups"]


@pytest.mark.parametrize("mask_kind", ["prefix", "holes", "random"])
@pytest.mark.parametrize("how", ["tau0", "size1"])
def test_token_limit_equals_verl_gae(mask_kind, how):  # property 4
    rewards, mask, values, olp, index = make_batch(7, 6, 50, mask_kind, junk=False)
    limit = {"tau0": dict(threshold=0.0, gmax=16), "size1": dict(threshold=3.0, gmax=1)}[how]
    verl_adv, verl_ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.97, lam=0.9)
    valid = mask.bool()
    for adv_norm in ("batch", "none"):
        adv, ret = compute_group_advantage(rewards, mask, values=values, index=index, threshold=limit["threshold"],
                                           config=config(0.97, 0.9, group_max_size=limit["gmax"], adv_norm=adv_norm))
        assert (ret[valid] - verl_ret[valid]).abs().max() <= 1e-9
        expected = verl_adv if adv_norm == "batch" else verl_ret - values
        assert (adv[valid] - expected[valid]).abs().max() <= 1e-9
        assert torch.all(adv[~valid] == 0) and torch.all(ret[~valid] == 0)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_one_group_limit_is_sequence_advantage_and_verl_grpo(norm_by_std):  # property 5
    B, T, n = 12, 30, 4
    rewards, mask, values, _, index = make_batch(11, B, T, "prefix", dense=False, junk=False, n_prompts=B // n)
    rewards[mask.bool()] += 0.1 * torch.randn(int(mask.sum()), dtype=F64)  # per-token rewards too
    valid = mask.bool()
    for b in range(B):  # V[p_0] equal for responses to the same prompt
        values[b, 0] = values[b % (B // n), 0]
    one_group = dict(threshold=math.inf)
    gmax = T
    adv, _ = compute_group_advantage(rewards, mask, values=values, index=index, config=config(0.9, 0.7, group_max_size=gmax,
                                                                                  adv_norm="none"), **one_group)
    discount = 0.9 ** torch.arange(T, dtype=F64)
    expected = (rewards * mask * discount).sum(1) - values[:, 0]
    assert ((adv - expected[:, None])[valid]).abs().max() <= 1e-9
    # adv_norm=prompt, gamma=1: verl's GRPO
    adv, _ = compute_group_advantage(rewards, mask, values=values, index=index,
                                     config=config(1.0, 0.7, norm_by_std, group_max_size=gmax, adv_norm="prompt"),
                                     **one_group)
    grpo, _ = compute_grpo_outcome_advantage(rewards, mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=norm_by_std)
    assert (adv[valid] - grpo[valid]).abs().max() <= 1e-9


def test_one_group_returns_are_monte_carlo_returns_to_go():  # Step 4 check
    rewards, mask, values, _, index = make_batch(5, 4, 12, "prefix", junk=False)
    _, ret = compute_group_advantage(rewards, mask, values=values, index=index, threshold=math.inf,
                                     config=config(0.8, 0.3, group_max_size=12, adv_norm="none"))
    for b in range(4):
        L = int(mask[b].sum())
        for t in range(L):
            mc = sum(0.8**k * float(rewards[b, t + k]) for k in range(L - t))
            assert float(ret[b, t]) == pytest.approx(mc, abs=1e-12)


def test_padding_junk_and_batch_order_change_nothing():  # property 7
    rewards, mask, values, olp, index = make_batch(13, 7, 25, "holes", junk=False, empty_rows=True)
    cfg = algo_settings(0.95, 0.9, group_max_size=6, adv_norm="prompt")
    base = compute_group_ppo_outputs(rewards, mask, values=values, index=index, settings=cfg, threshold=1.5)
    # extra right padding (with junk in it)
    pad = lambda x, v: torch.cat([x, torch.full((x.shape[0], 9), v, dtype=x.dtype)], 1)  # noqa: E731
    padded = compute_group_ppo_outputs(pad(rewards, float("nan")), pad(mask, 0.0), values=pad(values, float("inf")),
                                       index=index, settings=cfg, threshold=1.5)
    assert_close(padded.advantages[:, :25], base.advantages)
    assert torch.all(padded.advantages[:, 25:] == 0)
    # junk at masked positions
    r2, v2 = rewards.clone(), values.clone()
    r2[~mask.bool()], v2[~mask.bool()] = float("nan"), -float("inf")
    junked = compute_group_ppo_outputs(r2, mask, values=v2, index=index, settings=cfg, threshold=1.5)
    assert torch.equal(junked.advantages, base.advantages) and torch.equal(junked.returns, base.returns)
    # batch order
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(0))
    shuffled = compute_group_ppo_outputs(rewards[perm], mask[perm], values=values[perm], index=index[perm.numpy()],
                                         settings=cfg, threshold=1.5)
    assert_close(shuffled.advantages, base.advantages[perm])
    assert torch.equal(shuffled.group_ids, base.group_ids[perm])
    # rows with no valid token give zeros
    empty = ~mask.bool().any(1)
    assert empty.any() and torch.all(base.advantages[empty] == 0) and torch.all(base.returns[empty] == 0)


def test_all_masked_batch_gives_zeros_and_no_error():
    rewards, values = torch.randn(3, 5), torch.randn(3, 5)
    out = compute_group_ppo_outputs(rewards, torch.zeros(3, 5), values=values, index=np.arange(3),
                                    settings=algo_settings(adv_norm="prompt"))
    assert torch.all(out.advantages == 0) and torch.all(out.returns == 0) and torch.all(out.critic_mask == 0)
    assert math.isnan(out.boundary_explained_variance) and out.metrics["group/num_groups"] == 0


def test_adaptive_threshold_changes_group_sizes_monotonically():
    rewards, mask, values, _, index = make_batch(17, 16, 64, "prefix", junk=False)
    sizes = [compute_group_ppo_outputs(rewards, mask, values=values, index=index, settings=algo_settings(group_max_size=64),
                                       threshold=tau).metrics["group/mean_group_size"] for tau in (0.0, 0.5, 2.0, 8.0, math.inf)]
    assert sizes[0] == 1.0 and sizes == sorted(sizes) and sizes[-1] == pytest.approx(float(mask.sum()) / 16)


# --------------------------------------------------------------------------------------------------
# the smaller public functions agree with the rich pass


def test_small_functions_agree_with_rich_outputs():
    rewards, mask, values, olp, index = make_batch(21, 5, 30, "holes", junk=True)
    for rule in ("variance", "fixed", "low_prob", "turn"):
        out = compute_group_ppo_outputs(rewards, mask, values=values, index=index,
                                        settings=algo_settings(0.9, group_max_size=4, boundary_rule=rule),
                                        old_log_probs=olp, threshold=1.0)
        ends = find_group_endpoints(rewards, mask, values=values, gamma=0.9, threshold=1.0, group_max_size=4,
                                    boundary_rule=rule, old_log_probs=olp)
        assert torch.equal(ends, out.endpoint_mask)
        ids = endpoints_to_group_ids(ends, mask)
        assert torch.equal(ids, out.group_ids)
        assert torch.equal(create_critic_endpoint_mask(mask, ids), out.critic_mask)
        ev = explained_variance(out.returns, values.nan_to_num(0.0, 0.0, 0.0), out.critic_mask)
        assert ev == pytest.approx(out.boundary_explained_variance, abs=1e-12)


def test_critic_loss_weights_average_to_boundary_mean():
    rewards, mask, values, _, index = make_batch(23, 6, 20, "prefix", junk=False)
    out = compute_group_ppo_outputs(rewards, mask, values=values, index=index, settings=algo_settings(group_max_size=4),
                                    threshold=1.0)
    per_token = torch.rand(6, 20, dtype=F64)
    token_mean = (per_token * out.critic_loss_weights).sum() / mask.sum()  # verl's token-mean, weighted
    boundary_mean = per_token[out.critic_mask.bool()].mean()
    assert float(token_mean) == pytest.approx(float(boundary_mean), rel=1e-12)


# --------------------------------------------------------------------------------------------------
# dtypes, devices, purity


def test_low_precision_inputs_compute_in_fp32_and_match_fp64():
    rewards, mask, values, _, index = make_batch(29, 6, 40, "prefix", junk=False)
    cfg = config(0.99, 0.95, group_max_size=8, boundary_rule="fixed")
    ref_adv, ref_ret = compute_group_advantage(rewards, mask, values=values, index=index, config=cfg)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 5e-2)):
        adv, ret = compute_group_advantage(rewards.to(dtype), mask.to(dtype), values=values.to(dtype), index=index,
                                           config=cfg)
        assert adv.dtype == torch.float32 and ret.dtype == torch.float32
        ret_ref_low = compute_group_advantage(rewards.to(dtype).double(), mask, values=values.to(dtype).double(),
                                              index=index, config=cfg)[1]
        assert (ret.double() - ret_ref_low).abs().max() <= tol * max(1.0, float(ret_ref_low.abs().max()))
    assert ref_adv.dtype == F64 and ref_ret.dtype == F64


def test_inputs_are_not_mutated_and_no_graph_is_built():
    rewards, mask, values, olp, index = make_batch(31, 4, 16, "holes", junk=True)
    values.requires_grad_(True)
    copies = [x.detach().clone() for x in (rewards, mask, values, olp)]
    out = compute_group_ppo_outputs(rewards, mask, values=values, index=index, settings=algo_settings(boundary_rule="low_prob"),
                                    old_log_probs=olp)
    assert not out.advantages.requires_grad and not out.returns.requires_grad
    for before, after in zip(copies, (rewards, mask, values.detach(), olp)):
        assert torch.equal(before.nan_to_num(7.0, 7.0, 7.0), after.nan_to_num(7.0, 7.0, 7.0))
    one_row = torch.randn(1, 8)  # a (1, T) batch, whose transpose is contiguous
    one_row_copy = one_row.clone()
    compute_group_advantage(one_row, torch.ones(1, 8), values=one_row, config=config())
    assert torch.equal(one_row, one_row_copy)


@pytest.mark.parametrize("group", [{}, {"critic_lam": 0.5}, {"policy_loss_on": "endpoints"},
                                   {"within_group": "per_token", "length_adaptive_alpha": 0.1}])
def test_the_pass_leaves_its_validated_inputs_as_they_were(group):
    """The validated inputs (``Batch``, which holds the caller's tensors when their dtype is the compute dtype) are
    only read: the pass writes its results elsewhere, whether the critic's and the policy's X are one buffer (the
    first case) or two."""
    from verl_group_ppo.core_algos import _policy_lambda
    from verl_group_ppo.estimator.fast import prepare, run_steps

    rewards, mask, values, olp, index = make_batch(43, 5, 21, "holes", junk=True)
    settings = algo_settings(0.97, 0.9, adv_norm="prompt", **group)
    batch = prepare(rewards, mask, values, index, olp, settings.group)
    assert batch.rewards is rewards  # float64 inputs are not copied
    before = [x.clone() for x in (batch.rewards, batch.values, batch.valid, batch.invalid)]
    steps = run_steps(batch, settings, 1.0, _policy_lambda(batch, settings))
    after = (batch.rewards, batch.values, batch.valid, batch.invalid)
    assert all(torch.equal(a.nan_to_num(7.0, 7.0, 7.0), b.nan_to_num(7.0, 7.0, 7.0)) for a, b in zip(before, after))
    out = compute_group_ppo_outputs(rewards, mask, values=values, index=index, old_log_probs=olp, settings=settings,
                                    threshold=1.0)
    assert torch.equal(steps.advantages, out.advantages) and torch.equal(steps.returns, out.returns)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_broadcast_writes_each_group_value_on_its_valid_tokens_by_numpy_and_by_torch(dtype, monkeypatch):
    """Step 4's broadcast (numpy on CPU, torch's repeat_interleave and masked_scatter elsewhere): each group's value
    on each of its valid tokens, bit for bit, 0 at masked positions, holes included."""
    import verl_group_ppo.estimator.fast as fast

    valid = torch.tensor([[True, True, False, True, True, True, False, False],
                          [False, False, False, False, False, False, False, False],
                          [True, True, True, True, True, True, True, True]])
    ends = ~valid  # True at every masked position and at each group's last token: row 0 [0, 1] | [3] [4, 5],
    ends[0, 1] = ends[0, 3] = ends[0, 5] = ends[2, 2] = ends[2, 7] = True  # row 2 [0, 1, 2] [3..7]
    groups = fast.Groups(ends, valid)
    assert groups.sizes.tolist() == [2, 1, 2, 3, 5]
    heads = torch.tensor([1 / 3, -2.5, math.pi, 1e-30, -7.0], dtype=dtype)
    expected = torch.zeros(3, 8, dtype=dtype)
    for (row, start, size), value in zip([(0, 0, 2), (0, 3, 1), (0, 4, 2), (2, 0, 3), (2, 3, 5)], heads):
        expected[row, start:start + size] = value
    by_numpy = fast._broadcast_from_starts(heads, groups)
    monkeypatch.setattr(fast, "_array", lambda x: x)  # the torch path, as off CPU
    by_torch = fast._broadcast_from_starts(heads, groups)
    assert by_numpy.dtype == dtype and torch.equal(by_numpy, expected) and torch.equal(by_torch, expected)


@pytest.mark.parametrize("rule", ["variance", "fixed", "low_prob", "turn"])
def test_torch_gathers_equal_numpy_gathers(monkeypatch, rule):
    """Step 2's rounds, step 4's broadcast and the gathers run on numpy arrays on CPU and with torch tensors elsewhere
    (CUDA): same results."""
    import verl_group_ppo.estimator.fast as fast

    rewards, mask, values, olp, index = make_batch(47, 9, 33, "holes", junk=True, empty_rows=True)
    cfg = algo_settings(0.97, 0.9, group_max_size=5, boundary_rule=rule, adv_norm="prompt")
    with_numpy = compute_group_ppo_outputs(rewards, mask, values=values, index=index, settings=cfg, old_log_probs=olp,
                                           threshold=0.7)
    monkeypatch.setattr(fast, "gather_flat", lambda table, index: table[index])
    monkeypatch.setattr(fast, "_array", lambda x: x)
    with_torch = compute_group_ppo_outputs(rewards, mask, values=values, index=index, settings=cfg, old_log_probs=olp,
                                           threshold=0.7)
    for name in ("advantages", "returns", "group_ids", "endpoint_mask", "critic_mask", "critic_loss_weights"):
        assert torch.equal(getattr(with_torch, name), getattr(with_numpy, name)), name
    assert with_torch.metrics == with_numpy.metrics


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    rewards, mask, values, olp, index = make_batch(37, 8, 64, "holes", junk=True)
    cfg = algo_settings(0.99, 0.95, group_max_size=8, adv_norm="prompt")
    cpu = compute_group_ppo_outputs(rewards, mask, values=values, index=index, settings=cfg, threshold=1.0)
    gpu = compute_group_ppo_outputs(rewards.cuda(), mask.cuda(), values=values.cuda(), index=index, settings=cfg,
                                    threshold=1.0)
    assert_close(gpu.advantages.cpu(), cpu.advantages)
    assert torch.equal(gpu.group_ids.cpu(), cpu.group_ids)


# --------------------------------------------------------------------------------------------------
# bad inputs: a ValueError naming the argument


def _good():
    rewards, mask, values, olp, index = make_batch(41, 3, 6, "prefix", junk=False)
    return dict(token_level_rewards=rewards, response_mask=mask, values=values, index=index, config=config(),
                old_log_probs=olp)


@pytest.mark.parametrize(
    "change, name",
    [
        (lambda k: k.update(values=None), "values"),
        (lambda k: k.update(values=k["values"][:, :4]), "values"),
        (lambda k: k.update(token_level_rewards=k["token_level_rewards"].long()), "token_level_rewards"),
        (lambda k: k.update(response_mask=k["response_mask"][0]), "response_mask"),
        (lambda k: k["response_mask"].__setitem__((0, 0), 2.0), "response_mask"),
        (lambda k: k["response_mask"].__setitem__((0, 0), 0.5), "response_mask"),
        (lambda k: k["response_mask"].__setitem__((0, 0), float("nan")), "response_mask"),
        (lambda k: k["token_level_rewards"].__setitem__((0, 0), float("nan")), "token_level_rewards"),
        (lambda k: k["values"].__setitem__((0, 0), float("inf")), "values"),
        (lambda k: k.update(config=config(gamma=1.5)), "gamma"),
        (lambda k: k.update(config=config(lam=-0.1)), "lam"),
        (lambda k: k.update(config=config(group_max_size=0)), "group_max_size"),
        (lambda k: k.update(config=config(group_variance_threshold=-1.0)), "group_variance_threshold"),
        (lambda k: k.update(config=config(min_threshold=-0.5)), "min_threshold"),
        (lambda k: k.update(config=config(min_threshold=5.0, max_threshold=1.0)), "min_threshold"),
        (lambda k: k.update(config=config(boundary_rule="low_prob"), old_log_probs=None), "old_log_probs"),
        (lambda k: k.update(config=config(adv_norm="prompt"), index=None), "index"),
        (lambda k: k.update(index=k["index"][:2]), "index"),
        (lambda k: k.update(config=config(group_max_sise=4)), "group_max_sise"),
        (lambda k: k.update(threshold=-1.0), "threshold"),
    ],
)
def test_bad_input_raises_value_error_naming_it(change, name):
    kwargs = _good()
    change(kwargs)
    with pytest.raises(ValueError, match=name):
        compute_group_advantage(**kwargs)


def test_valid_masked_nan_in_old_log_probs_is_named():
    kwargs = _good()
    kwargs["old_log_probs"][0, 0] = float("nan")
    kwargs["config"] = config(boundary_rule="low_prob")
    with pytest.raises(ValueError, match="old_log_probs"):
        compute_group_advantage(**kwargs)


def test_mask_dtypes_bool_int_float_agree():
    kwargs = _good()
    outs = []
    for dtype in (torch.bool, torch.int64, torch.float32):
        kwargs["response_mask"] = kwargs["response_mask"].to(dtype)
        outs.append(compute_group_advantage(**kwargs)[0])
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[1], outs[2])


# --------------------------------------------------------------------------------------------------
# adaptive threshold


def test_update_threshold_moves_toward_target_and_clips():
    p = GroupParams(adaptive_target="explained_variance", threshold_lr=0.5, target_explained_variance=0.5, min_threshold=0.5, max_threshold=4.0)

    def step(tau, ev):
        return update_threshold(tau, params=p, explained_variance=ev)

    assert step(1.0, -1.0) == pytest.approx(math.exp(0.75))  # poor critic: longer groups
    assert step(1.0, 1.0) == pytest.approx(math.exp(-0.25))  # good critic: shorter groups
    assert step(1.0, 0.5) == pytest.approx(1.0)
    assert step(1.0, -50.0) == pytest.approx(math.exp(0.75))  # ev clipped to [-1, 1]
    assert step(3.9, -1.0) == 4.0 and step(0.51, 1.0) == 0.5
    assert step(2.0, float("nan")) == 2.0


def test_largest_v1_tau_growth_per_batch_is_exp_0_015():
    """docs/results.md: with the version-1 values (explained-variance target 0.5, lr 0.01) tau grows at most by
    e^0.015 per batch (ev = -1)."""
    p = GroupParams(**V1_GROUP_PARAMS)
    assert update_threshold(1.0, params=p, explained_variance=-1.0) == pytest.approx(math.exp(0.015))


def test_group_size_target_rule():
    p = GroupParams(adaptive_target="group_size", target_group_size=8.0, threshold_lr=0.5, min_threshold=0.1,
                    max_threshold=10.0)

    def step(tau, m):
        return update_threshold(tau, params=p, mean_group_size=m, explained_variance=-1.0)  # ev is not read

    assert step(1.0, 2.0) == pytest.approx(2.0)  # groups 4x too small: tau * 4 ** 0.5
    assert step(1.0, 32.0) == pytest.approx(0.5)  # groups 4x too large
    assert step(1.0, 8.0) == pytest.approx(1.0)
    assert step(9.0, 1.0) == 10.0 and step(0.11, 1000.0) == 0.1  # clipped
    assert step(2.0, float("nan")) == 2.0  # a batch without groups leaves tau unchanged


def test_adaptive_threshold_owns_state_rule_and_round_trip():
    params = GroupParams(threshold_lr=0.1, adaptive_target="explained_variance")
    threshold = AdaptiveThreshold(params)
    assert threshold.value == 1.0 and threshold.adapts
    rewards, mask, values, _, index = make_batch(19, 4, 12, "prefix", junk=False)
    out = compute_group_ppo_outputs(rewards, mask, values=values, index=index,
                                    settings=read_algorithm_settings({"group_params": params.to_dict()}),
                                    threshold=threshold.value)
    expected = update_threshold(1.0, params=params, explained_variance=out.boundary_explained_variance)
    assert threshold.update(out) == pytest.approx(expected) and threshold.value == pytest.approx(expected)
    fresh = AdaptiveThreshold(GroupParams(group_variance_threshold=3.0))
    fresh.load_state_dict(threshold.state_dict())
    assert fresh.value == threshold.value and fresh.state_dict() == {"threshold": threshold.value}
    for frozen in (GroupParams(adaptive_threshold=False), GroupParams(boundary_rule="fixed")):
        still = AdaptiveThreshold(frozen)
        assert not still.adapts and still.update(out) == 1.0
    with pytest.raises(ValueError, match="threshold"):
        fresh.load_state_dict({"threshold": -2.0})
    with pytest.raises(ValueError, match="threshold"):
        fresh.load_state_dict({"tau": 1.0})
    with pytest.raises(ValueError, match="params"):
        AdaptiveThreshold({"group_max_size": 4})


def test_group_size_controller_converges_monotonically_to_the_target():  # V2.2
    """On a fixed synthetic batch the mean group size moves toward the target every step, never past it."""
    rewards, mask, values, _, index = make_batch(53, 32, 96, "prefix", dense=False, junk=False)
    for target, tau0 in ((12.0, 0.2), (3.0, 9.0)):
        params = GroupParams(adaptive_target="group_size", target_group_size=target, threshold_lr=0.5,
                             group_max_size=96, group_variance_threshold=tau0, min_threshold=0.01,
                             max_threshold=100.0)
        algo = read_algorithm_settings({"group_params": params.to_dict()})
        threshold = AdaptiveThreshold(params)
        gaps = []
        for _ in range(25):
            out = compute_group_ppo_outputs(rewards, mask, values=values, index=index, settings=algo,
                                            threshold=threshold.value)
            gaps.append(math.log(out.mean_group_size / target))
            threshold.update(out)
        assert abs(gaps[-1]) < 0.25 * abs(gaps[0])  # most of the way there
        sign = math.copysign(1.0, gaps[0])
        assert all(sign * g >= -0.15 for g in gaps)  # approached from one side (no runaway, no wide overshoot)
        # the gap never widens, except by the jitter of a step function at its fixed point (sizes are discrete)
        assert all(sign * b <= sign * a + 1e-9 or abs(b) < 0.01 for a, b in zip(gaps, gaps[1:]))


@pytest.mark.parametrize("mask_kind", ["prefix", "holes"])
@pytest.mark.parametrize("how", ["tau0", "size1"])
def test_decoupled_lambda_limit_equals_verl_gae_with_each_lambda(mask_kind, how):  # V2.1
    """tau = 0 or group_max_size = 1: advantages are verl's GAE with policy_lam, returns verl's GAE with critic_lam."""
    rewards, mask, values, _, index = make_batch(59, 6, 40, mask_kind, junk=False)
    limit = {"tau0": dict(threshold=0.0, gmax=16), "size1": dict(threshold=3.0, gmax=1)}[how]
    cfg = config(0.97, 1.0, group_max_size=limit["gmax"], policy_lam=0.9, critic_lam=0.6, adv_norm="none")
    adv, ret = compute_group_advantage(rewards, mask, values=values, index=index, config=cfg,
                                       threshold=limit["threshold"])
    valid = mask.bool()
    _, policy_ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.97, lam=0.9)
    _, critic_ret = compute_gae_advantage_return(rewards, values, mask, gamma=0.97, lam=0.6)
    assert (adv[valid] - (policy_ret - values)[valid]).abs().max() <= 1e-9
    assert (ret[valid] - critic_ret[valid]).abs().max() <= 1e-9
    cfg["group_params"]["adv_norm"] = "batch"  # and whitened, verl's GAE advantages with policy_lam
    adv, _ = compute_group_advantage(rewards, mask, values=values, index=index, config=cfg, threshold=limit["threshold"])
    policy_adv, _ = compute_gae_advantage_return(rewards, values, mask, gamma=0.97, lam=0.9)
    assert (adv[valid] - policy_adv[valid]).abs().max() <= 1e-9


def test_decoupled_lambda_null_means_algorithm_lam_and_metrics_say_which():
    rewards, mask, values, _, index = make_batch(61, 5, 20, "holes", junk=True)
    plain = compute_group_ppo_outputs(rewards, mask, values=values, index=index, settings=algo_settings(0.9, 0.8),
                                      threshold=1.0)
    explicit = compute_group_ppo_outputs(rewards, mask, values=values, index=index,
                                         settings=algo_settings(0.9, 0.3, policy_lam=0.8, critic_lam=0.8), threshold=1.0)
    assert torch.equal(plain.advantages, explicit.advantages) and torch.equal(plain.returns, explicit.returns)
    assert (plain.metrics["group/policy_lam"], plain.metrics["group/critic_lam"]) == (0.8, 0.8)
    split = compute_group_ppo_outputs(rewards, mask, values=values, index=index,
                                      settings=algo_settings(0.9, 0.8, critic_lam=1.0), threshold=1.0)
    assert torch.equal(split.advantages, plain.advantages)  # the policy side is unchanged
    assert not torch.equal(split.returns, plain.returns)
    assert (split.metrics["group/policy_lam"], split.metrics["group/critic_lam"]) == (0.8, 1.0)
    # the boundary explained variance is measured against the critic's returns
    assert split.boundary_explained_variance == pytest.approx(
        explained_variance(split.returns, values.nan_to_num(0.0, 0.0, 0.0), split.critic_mask), abs=1e-12)


def test_low_prob_rule_logs_probabilities_at_cuts():  # V2.4
    rewards, mask, values, olp, index = make_batch(67, 6, 30, "prefix", junk=False)
    out = compute_group_ppo_outputs(rewards, mask, values=values, index=index, old_log_probs=olp,
                                    settings=algo_settings(boundary_rule="low_prob", low_prob_threshold=0.3))
    probs = olp.exp()
    starts = out.critic_mask.bool()
    low = mask.bool() & (probs < 0.3)
    low[:, 0] = False
    assert bool(starts[low].all())  # the rule: every low-probability token (after the first) starts a group
    assert out.metrics["group/prob_at_group_starts"] == pytest.approx(float(probs[starts].mean()))
    assert out.metrics["group/prob_at_endpoints"] == pytest.approx(float(probs[out.endpoint_mask].mean()))
    other = mask.bool() & ~starts & ~out.endpoint_mask
    assert out.metrics["group/prob_elsewhere"] == pytest.approx(float(probs[other].mean()))
    variance = compute_group_ppo_outputs(rewards, mask, values=values, index=index, old_log_probs=olp,
                                         settings=algo_settings())
    assert "group/prob_at_group_starts" not in variance.metrics


def test_group_size_quantiles():
    rewards, mask, values, _, index = make_batch(71, 8, 40, "holes", junk=False)
    out = compute_group_ppo_outputs(rewards, mask, values=values, index=index, settings=algo_settings(group_max_size=7),
                                    threshold=2.0)
    sizes = torch.tensor([int((out.group_ids[b] == k).sum()) for b in range(8)
                          for k in range(1, int(out.group_ids[b].max()) + 1)], dtype=F64)
    assert out.metrics["group/size_p50"] == pytest.approx(float(sizes.quantile(0.5)))
    assert out.metrics["group/size_p90"] == pytest.approx(float(sizes.quantile(0.9)))
    assert out.metrics["group/max_group_size"] == float(sizes.max())
    assert out.mean_group_size == pytest.approx(float(sizes.mean()))


def test_config_from_omegaconf_and_algoconfig():
    from verl.trainer.config import AlgoConfig

    node = OmegaConf.create({"gamma": 0.9, "lam": 0.8, "group_params": {"group_max_size": 4, "adv_norm": "none"}})
    rewards, mask, values, _, index = make_batch(43, 3, 10, "prefix", junk=False)
    a1 = compute_group_advantage(rewards, mask, values=values, index=index, config=node)[0]
    a2 = compute_group_advantage(rewards, mask, values=values, index=index, config=OmegaConf.to_container(node))[0]
    assert torch.equal(a1, a2)
    a3 = compute_group_advantage(rewards, mask, values=values, index=index, config=AlgoConfig(gamma=0.9, lam=0.8))[0]
    a4 = compute_group_advantage(rewards, mask, values=values, index=index, config={"gamma": 0.9, "lam": 0.8})[0]
    assert torch.equal(a3, a4)


def test_worked_example_from_docs():
    """docs/algorithm.md's table, computed by hand there."""
    r = torch.tensor([[0, 0, 0, 0, 0, 1.0]], dtype=F64)
    v = torch.tensor([[0.5, 0.5, 0.6, 0.2, 0.8, 0.9]], dtype=F64)
    out = compute_group_ppo_outputs(r, torch.ones(1, 6, dtype=F64), values=v,
                                    settings=algo_settings(1.0, 0.95, group_max_size=4, adv_norm="none"), threshold=1.0)
    assert out.endpoint_mask.tolist() == [[False, False, True, True, False, True]]
    assert out.group_ids.tolist() == [[1, 1, 1, 2, 3, 3]]
    assert out.advantages[0].tolist() == pytest.approx([0.4505] * 3 + [0.79] + [0.2] * 2, abs=1e-12)
    assert out.returns[0].tolist() == pytest.approx([0.9505] * 3 + [0.99, 1.0, 1.0], abs=1e-12)
    assert out.critic_mask[0].tolist() == [1, 0, 0, 1, 1, 0]
    assert out.critic_loss_weights[0].tolist() == [2, 0, 0, 2, 2, 0]


# --------------------------------------------------------------------------------------------------
# V3.1: per-token advantages inside groups (SAE's estimator)


@pytest.mark.parametrize("mask_kind", ["prefix", "holes", "random"])
@pytest.mark.parametrize("how", ["tau0", "size1"])
def test_per_token_token_limit_equals_verl_gae_with_policy_lam(mask_kind, how):
    rewards, mask, values, olp, index = make_batch(17, 6, 40, mask_kind, junk=True)
    limit = {"tau0": dict(threshold=0.0, gmax=16), "size1": dict(threshold=3.0, gmax=1)}[how]
    clean = lambda x: torch.where(mask.bool(), x, torch.zeros_like(x))  # noqa: E731 (verl multiplies junk)
    verl_adv, _ = compute_gae_advantage_return(clean(rewards), clean(values), mask, gamma=0.97, lam=0.9)
    _, verl_ret = compute_gae_advantage_return(clean(rewards), clean(values), mask, gamma=0.97, lam=1.0)
    valid = mask.bool()
    adv, ret = compute_group_advantage(rewards, mask, values=values, index=index, threshold=limit["threshold"],
                                       config=config(0.97, 1.0, group_max_size=limit["gmax"], policy_lam=0.9,
                                                     within_group="per_token"))
    assert (adv[valid] - verl_adv[valid]).abs().max() <= 1e-9
    assert (ret[valid] - verl_ret[valid]).abs().max() <= 1e-9
    assert torch.all(adv[~valid] == 0)


def test_per_token_one_group_at_lam_1_is_return_minus_own_value():
    rewards, mask, values, olp, index = make_batch(5, 6, 30, "prefix", dense=False, junk=False)
    adv, ret = compute_group_advantage(rewards, mask, values=values, index=index, threshold=math.inf,
                                       config=config(1.0, 1.0, group_max_size=64, adv_norm="none",
                                                     within_group="per_token"))
    valid = mask.bool()
    returns_to_go = torch.flip(torch.cumsum(torch.flip(rewards * mask, [1]), 1), [1])
    assert_close(adv[valid], (returns_to_go - values)[valid])  # R - V(s_t): PPO at lam = 1
    assert_close(ret[valid], returns_to_go[valid])


@pytest.mark.parametrize("mask_kind", ["prefix", "holes"])
def test_per_token_changes_only_the_advantages(mask_kind):
    rewards, mask, values, olp, index = make_batch(9, 8, 40, mask_kind)
    outs = {w: compute_group_ppo_outputs(rewards, mask, values=values, index=index, old_log_probs=olp, threshold=2.0,
                                         settings=algo_settings(0.99, 1.0, policy_lam=0.8, adv_norm="none",
                                                                within_group=w))
            for w in ("broadcast", "per_token")}
    b, p = outs["broadcast"], outs["per_token"]
    for name in ("returns", "group_ids", "endpoint_mask", "critic_mask", "critic_loss_weights"):
        assert torch.equal(getattr(b, name), getattr(p, name)), name
    first = p.critic_mask.bool()  # at each group's first token the two agree (A_k is X there)
    assert torch.equal(b.advantages[first], p.advantages[first])
    assert not torch.equal(b.advantages, p.advantages)  # inside groups they differ
    valid = mask.bool()
    assert torch.all(p.advantages[~valid] == 0)


def test_within_group_is_validated_by_name():
    with pytest.raises(ValueError, match="algorithm.group_params.within_group"):
        GroupParams(within_group="tokens")


# --------------------------------------------------------------------------------------------------
# boundary_rule: turn (multi-turn: one group per assistant turn)


def _turns(mask_row: torch.Tensor) -> list[list[int]]:
    """The maximal runs of valid positions of one response (its assistant turns)."""
    runs: list[list[int]] = []
    for t in mask_row.nonzero().flatten().tolist():
        if runs and runs[-1][-1] == t - 1:
            runs[-1].append(t)
        else:
            runs.append([t])
    return runs


@pytest.mark.parametrize("within_group", ["broadcast", "per_token"])
@pytest.mark.parametrize("adv_norm", ["batch", "prompt", "none"])
def test_turn_rule_gives_one_group_per_turn_read_at_turn_starts(adv_norm, within_group):
    rewards, mask, values, olp, index = make_batch(31, 6, 40, "holes", dense=False, empty_rows=True)
    settings = algo_settings(0.97, 0.9, group_max_size=2, boundary_rule="turn", adv_norm=adv_norm,
                             within_group=within_group)  # a cap far under the turns' lengths: turn ignores it
    out = compute_group_ppo_outputs(rewards, mask, values=values, index=index, settings=settings, threshold=3.0)
    ref = reference_group_ppo(rewards, mask, values, gamma=0.97, lam=0.9, threshold=3.0, group_max_size=2,
                              boundary_rule="turn", adv_norm=adv_norm, index=index, within_group=within_group)
    assert_close(out.advantages, ref.advantages)
    assert_close(out.returns, ref.returns)
    n_turns = 0
    for b in range(mask.shape[0]):
        for k, turn in enumerate(_turns(mask[b]), start=1):
            n_turns += 1
            assert out.group_ids[b, turn].tolist() == [k] * len(turn)  # the turn is group k, whole
            assert out.endpoint_mask[b, turn].tolist() == [False] * (len(turn) - 1) + [True]
            assert out.critic_mask[b, turn].tolist() == [1.0] + [0.0] * (len(turn) - 1)  # read at its first token
            if within_group == "broadcast":
                assert torch.all(out.advantages[b, turn] == out.advantages[b, turn[0]])
    assert out.metrics["group/num_groups"] == n_turns
    assert torch.all(out.advantages[~mask.bool()] == 0) and torch.all(out.critic_mask[~mask.bool()] == 0)


def test_turn_rule_ignores_group_max_size_and_fixed_caps_the_turns():
    """``turn`` cuts only at turn ends; turns capped at N tokens are ``fixed`` with ``group_max_size=N``."""
    mask = torch.tensor([[1, 1, 1, 1, 1, 0, 0, 1, 1, 1]], dtype=F64)
    rewards = torch.zeros_like(mask)
    rewards[0, -1] = 1.0

    def ends(rule: str, size: int) -> list[bool]:
        return find_group_endpoints(rewards, mask, values=torch.zeros_like(mask), group_max_size=size,
                                    boundary_rule=rule)[0].tolist()

    turn_ends = [False] * 4 + [True] + [False] * 4 + [True]
    assert ends("turn", 2) == ends("turn", 1) == ends("turn", 16) == turn_ends
    assert ends("fixed", 2) == [False, True, False, True, True, False, False, False, True, True]
    assert ends("fixed", 5) == turn_ends  # a cap at least the longest turn: one group per turn
    assert ends("fixed", 4) == [False, False, False, True, True, False, False, False, False, True]


def test_turn_rule_does_not_adapt_the_threshold():
    assert not AdaptiveThreshold(GroupParams(boundary_rule="turn")).adapts
