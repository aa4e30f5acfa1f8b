"""The boundary values (verl_group_ppo.values): the prefix tree and Monte Carlo means against plain loops and their
reductions, the one function the trainer calls for every source, the fields it asks for, and the start-up limits."""

from __future__ import annotations

import ast
import pathlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import verl_group_ppo.values as values_pkg
from verl_group_ppo.config import read_algorithm_settings
from verl_group_ppo.core_algos import find_group_endpoints
from verl_group_ppo.values import (BatchFields, Continuations, batch_fields, boundary_values,
                                   check_value_source_config, fields_needed, mc_boundary_values, prefix_tree_values,
                                   shared_prefix_lengths)
from verl_group_ppo_testutils_reference import loop_mc_boundary_values, loop_prefix_tree_values


# ------------------------------------------------------------------------------------------ loop references


def _batch(rows, index, scores):
    """(ids, attention) tensors from rows of tokens, None as padding (id 0, attention 0)."""
    T = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), T), dtype=torch.long)
    attention = torch.zeros((len(rows), T), dtype=torch.long)
    for b, row in enumerate(rows):
        for t, token in enumerate(row):
            if token is not None:
                ids[b, t], attention[b, t] = token, 1
    return ids, attention, torch.tensor(scores, dtype=torch.float64), index


def _check_against_loop(ids, attention, scores, index):
    got = prefix_tree_values(ids, attention, scores, index)
    want = loop_prefix_tree_values(ids.tolist(), attention.tolist(), scores.tolist(), list(index))
    assert torch.allclose(got, torch.tensor(want, dtype=got.dtype), rtol=0, atol=1e-12), (got, want)
    return got


# ------------------------------------------------------------------------------------------ prefix tree


def test_prefix_tree_shared_and_unshared_prefixes_match_the_loop():
    # prompt "a": replies 0 and 1 share 3 tokens, reply 2 parts after 1; prompt "b": no shared first token
    ids, attention, scores, index = _batch(
        [[5, 6, 7, 8], [5, 6, 7, 9], [5, 1, 1, 1], [3, 3], [4, 4, 4]],
        ["a", "a", "a", "b", "b"], [1.0, 0.0, 1.0, 1.0, 0.0])
    values = _check_against_loop(ids, attention, scores, index)
    assert values[0].tolist() == pytest.approx([2 / 3, 2 / 3, 0.5, 0.5])  # {0,1,2} share "5", {0,1} "5 6 7"
    assert values[3, 0] == pytest.approx(0.5) and values[3, 1] == 1.0  # unshared: its own reward after token 0


def test_prefix_tree_with_no_shared_first_token_is_the_prompt_mean_then_the_own_reward():
    torch.manual_seed(0)
    n, T = 6, 7
    ids = torch.randint(10, 50, (n, T))
    ids[:, 0] = torch.arange(n)  # every first token differs
    scores = torch.rand(n, dtype=torch.float64)
    values = prefix_tree_values(ids, torch.ones_like(ids), scores, [0] * n)
    assert torch.allclose(values[:, 0], scores.mean().expand(n))
    assert torch.equal(values[:, 1:], scores[:, None].expand(n, T - 1))


def test_prefix_tree_holes_and_a_reply_shorter_than_the_others():
    # tool observations are part of the state: equal ids with different existence differ; padding differs from a token
    ids, attention, scores, index = _batch(
        [[1, 2, None, 3], [1, 2, None, 3], [1, 2], [1, 2, 7, 3]], [0, 0, 0, 0], [1.0, 0.5, 0.0, 0.25])
    attention[0, 2] = attention[1, 2] = 1  # a tool observation token (id 0) in replies 0 and 1
    _check_against_loop(ids, attention, scores, index)


def test_prefix_tree_all_equal_rewards_give_that_reward_everywhere():
    torch.manual_seed(1)
    ids = torch.randint(0, 3, (8, 5))
    values = prefix_tree_values(ids, torch.ones_like(ids), torch.full((8,), 0.75), torch.arange(8) % 2)
    assert torch.equal(values, torch.full((8, 5), 0.75))


@pytest.mark.parametrize("seed", range(5))
def test_prefix_tree_random_small_vocabularies_match_the_loop(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 9, 6
    ids = torch.randint(0, 2, (B, T), generator=g)  # two tokens: many shared prefixes
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    attention = (torch.arange(T) < lengths[:, None]).long()
    ids = ids * attention
    scores = torch.randint(0, 2, (B,), generator=g).double()
    index = torch.randint(0, 3, (B,), generator=g).tolist()
    _check_against_loop(ids, attention, scores, index)


def test_prefix_tree_does_not_depend_on_batch_order():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 2, (10, 5), generator=g)
    scores, index = torch.rand(10, generator=g), [i % 3 for i in range(10)]
    values = prefix_tree_values(ids, torch.ones_like(ids), scores, index)
    perm = torch.randperm(10, generator=g)
    permuted = prefix_tree_values(ids[perm], torch.ones_like(ids), scores[perm], [index[i] for i in perm])
    assert torch.allclose(permuted, values[perm])


def test_shared_prefix_lengths():
    ids = torch.tensor([[1, 2, 3], [1, 2, 4], [2, 2, 3]])
    assert shared_prefix_lengths(ids, torch.ones_like(ids)).tolist() == [[3, 2, 0], [2, 3, 0], [0, 0, 3]]


def test_prefix_tree_bad_inputs_name_the_argument():
    ids = torch.zeros((2, 3), dtype=torch.long)
    with pytest.raises(ValueError, match="attention_mask must have the shape"):
        prefix_tree_values(ids, torch.ones((2, 4)), torch.zeros(2), [0, 0])
    with pytest.raises(ValueError, match=r"scores must have shape \(2,\)"):
        prefix_tree_values(ids, torch.ones_like(ids), torch.zeros(3), [0, 0])
    with pytest.raises(ValueError, match="index must be a 1-D sequence of 2"):
        prefix_tree_values(ids, torch.ones_like(ids), torch.zeros(2), [0])


# ------------------------------------------------------------------------------------------ Monte Carlo


def test_mc_values_sit_at_the_starts_with_the_prompt_mean_first():
    starts = torch.tensor([[True, False, True, False, True], [True, True, False, False, False]])
    continuations = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])  # (2,2), (2,4), (3,1) in row-major order
    values = mc_boundary_values(starts, continuations, torch.tensor([1.0, 0.0]), ["p", "p"])
    assert values.tolist() == [[0.5, 0.0, 0.5, 0.0, 1.0], [0.5, 0.0, 0.0, 0.0, 0.0]]


def test_mc_with_a_deterministic_reward_gives_the_exact_value():
    # every continuation from a start scores the same: the mean of K equals that value whatever K is
    starts = torch.tensor([[True, True, True]])
    exact = torch.tensor([0.25, 0.75])
    for k in (1, 4, 9):
        values = mc_boundary_values(starts, exact[:, None].expand(2, k), torch.tensor([1.0]), [0])
        assert values[0, 1:].tolist() == exact.tolist()


def test_mc_bad_inputs_name_the_argument():
    starts = torch.tensor([[True, True]])
    with pytest.raises(ValueError, match=r"continuation_scores must have shape \(1, K\) with K >= 1"):
        mc_boundary_values(starts, torch.zeros((1, 0)), torch.zeros(1), [0])
    with pytest.raises(ValueError, match=r"continuation_scores must have shape \(1, K\)"):
        mc_boundary_values(starts, torch.zeros((2, 3)), torch.zeros(1), [0])
    with pytest.raises(ValueError, match="starts must be a"):
        mc_boundary_values(starts.int(), torch.zeros((1, 3)), torch.zeros(1), [0])


# ------------------------------------------------------------------------------------------ boundary_values


def settings_for(source: str, **group):
    return read_algorithm_settings({"group_params": {"value_source": source, **group}})


def small_batch(seed: int = 0) -> BatchFields:
    """2 prompts x 3 replies over a 2-token vocabulary, replies of lengths 3..6 in a (6, 6) batch, one hole."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 4, 3, 5, 6, 4])
    exists = (torch.arange(6)[None, :] < lengths[:, None]).long()
    mask = exists.clone()
    mask[4, 2] = 0  # a tool observation: a position of the reply that is not trained
    return BatchFields(response_mask=mask, reply_lengths=lengths,
                       responses=torch.randint(1, 3, (6, 6), generator=g) * exists,
                       scores=torch.randint(0, 2, (6,), generator=g).float(), uid=["a", "b", "a", "b", "a", "b"],
                       prompts=[[9, row] for row in range(6)], reward_inputs=[f"row{row}" for row in range(6)])


def test_the_critic_source_hands_the_critics_values_and_leaves_the_groups_to_the_estimator():
    critic = torch.randn(6, 6)
    out = boundary_values(settings_for("critic"), BatchFields(response_mask=torch.ones(6, 6), values=critic))
    assert out.values is critic and out.endpoints is None and out.metrics == {}


def test_the_prefix_tree_source_reads_each_replys_positions_from_its_length():
    fields = small_batch()
    responses = fields.responses.clone()
    responses[4] = responses[0]  # replies 0 and 4 agree token for token; 4 has a hole (an untrained observation)
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 1.0])
    fields = BatchFields(**{**fields.__dict__, "responses": responses, "scores": scores})
    out = boundary_values(settings_for("prefix_tree"), fields)
    exists = (torch.arange(6)[None, :] < fields.reply_lengths[:, None]).long()  # the hole exists: it is state
    want = loop_prefix_tree_values(fields.responses.tolist(), exists.tolist(), fields.scores.tolist(), fields.uid)
    assert torch.allclose(out.values, torch.tensor(want)), (out.values, want)
    assert out.endpoints is None and out.metrics == {}
    # reading the mask in place of the lengths would cut reply 4 at its hole: a different tree
    assert not torch.allclose(prefix_tree_values(fields.responses, fields.response_mask, fields.scores, fields.uid),
                              out.values)


class RecordingSampler:
    """A ContinuationSampler that scores a continuation 1 when its prefix ends in token 1, and records its calls."""

    def __init__(self):
        self.calls = []

    def __call__(self, prefixes, k):
        self.calls.append((list(prefixes), k))
        scores = torch.tensor([[float(p.reply_ids[-1] == 1)] * k for p in prefixes])
        return Continuations(scores=scores, tokens=7 * k * len(prefixes))


def test_mc_fixes_the_groups_samples_once_and_hands_the_endpoints_on():
    fields, sampler = small_batch(seed=1), RecordingSampler()
    out = boundary_values(settings_for("mc", group_max_size=2, mc_samples=3), fields, sampler=sampler)
    want_ends = find_group_endpoints(torch.zeros(6, 6), fields.response_mask, boundary_rule="fixed", group_max_size=2)
    assert torch.equal(out.endpoints, want_ends)
    assert len(sampler.calls) == 1 and sampler.calls[0][1] == 3  # one batch of K = 3 for the whole step
    prefixes = sampler.calls[0][0]
    starts = [(p.row, len(p.reply_ids)) for p in prefixes]
    assert starts == sorted(starts) and all(start > 0 for _, start in starts)  # row-major, position 0 left out
    for p in prefixes:
        assert p.prompt_ids == [9, p.row] and p.reward_input == f"row{p.row}"
        assert p.reply_ids == fields.responses[p.row, :len(p.reply_ids)].tolist()
    assert out.metrics == {"group/mc_responses": 3 * len(prefixes), "group/mc_tokens": 21 * len(prefixes)}
    start_mask = [[False] * 6 for _ in range(6)]
    for b in range(6):
        start_mask[b][0] = True
    for row, start in starts:
        start_mask[row][start] = True
    continuation = [[float(p.reply_ids[-1] == 1)] * 3 for p in prefixes]
    want = loop_mc_boundary_values(start_mask, continuation, fields.scores.tolist(), fields.uid)
    assert torch.equal(out.values, torch.tensor(want))


def test_mc_groups_follow_the_low_prob_rule_on_the_old_log_probs():
    fields = small_batch(seed=2)
    log_probs = torch.zeros(6, 6)
    log_probs[0, 3] = log_probs[3, 1] = -5.0  # two unlikely tokens: a group starts at each
    fields = BatchFields(**{**fields.__dict__, "old_log_probs": log_probs})
    sampler = RecordingSampler()
    out = boundary_values(settings_for("mc", boundary_rule="low_prob", group_max_size=64), fields, sampler=sampler)
    # a group starts at each unlikely token, and after reply 4's hole
    assert [(p.row, len(p.reply_ids)) for p in sampler.calls[0][0]] == [(0, 3), (3, 1), (4, 3)]
    assert out.endpoints[0, 2] and out.endpoints[3, 0] and out.endpoints[4, 1] and int(out.endpoints.sum()) == 6 + 3


def test_mc_without_a_group_after_position_zero_samples_nothing():
    fields, sampler = small_batch(), RecordingSampler()
    out = boundary_values(settings_for("mc", group_max_size=64), BatchFields(
        **{**fields.__dict__, "response_mask": (torch.arange(6) < 2).long().expand(6, 6).clone()}), sampler=sampler)
    assert sampler.calls == [] and out.metrics == {"group/mc_responses": 0, "group/mc_tokens": 0}
    assert out.values[:, 0].tolist() == [fields.scores[[0, 2, 4]].mean().item(), fields.scores[[1, 3, 5]].mean().item()] * 3


def test_boundary_values_refusals_name_what_is_wrong():
    fields = small_batch()
    with pytest.raises(ValueError, match=r"algorithm\.group_params\.value_source='tree' has no boundary values"):
        boundary_values(SimpleNamespace(group=SimpleNamespace(value_source="tree")), fields)
    with pytest.raises(ValueError, match="sampler is required by value_source='mc'"):
        boundary_values(settings_for("mc"), fields)
    with pytest.raises(ValueError, match=r"fields\.values is required by value_source='critic'"):
        boundary_values(settings_for("critic"), fields)
    with pytest.raises(ValueError, match=r"fields\.prompts is required by value_source='mc'"):
        boundary_values(settings_for("mc"), BatchFields(**{**fields.__dict__, "prompts": None}),
                        sampler=RecordingSampler())


@pytest.mark.parametrize("source, rule, required, optional", [
    ("critic", None, ("response_mask", "values"), ()),
    ("critic", "low_prob", ("response_mask", "values", "old_log_probs"), ()),
    ("prefix_tree", None, ("response_mask", "responses", "rm_scores", "uid"), ()),
    ("mc", None, ("response_mask", "responses", "rm_scores", "uid", "prompts", "data_source", "reward_model"),
     ("extra_info",)),
])
def test_fields_needed_by_source(source, rule, required, optional):
    needed = fields_needed(settings_for(source, **({"boundary_rule": rule} if rule else {})))
    assert (needed.required, needed.optional) == (required, optional)


def test_batch_fields_from_verls_stored_batch():
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    rows = [{"response_mask": torch.tensor([1, 0, 1]), "responses": torch.tensor([4, 5, 6]),
             "rm_scores": torch.tensor([0.0, 0.0, 1.0]), "prompts": torch.tensor([1, 2]), "uid": "u0",
             "data_source": "toy", "reward_model": {"ground_truth": "7"}, "extra_info": {"i": 0}},
            {"response_mask": torch.tensor([1]), "responses": torch.tensor([8]), "rm_scores": torch.tensor([0.5]),
             "prompts": torch.tensor([3]), "uid": "u1", "data_source": "toy", "reward_model": {"ground_truth": "8"},
             "extra_info": {"i": 1}}]
    fields = batch_fields(list_of_dict_to_tensordict(rows))
    assert fields.response_mask.tolist() == [[1, 0, 1], [1, 0, 0]]
    assert fields.reply_lengths.tolist() == [3, 1] and fields.responses.tolist() == [[4, 5, 6], [8, 0, 0]]
    assert fields.scores.tolist() == [1.0, 0.5] and fields.uid == ["u0", "u1"]
    assert fields.prompts == [[1, 2], [3]] and fields.values is None and fields.old_log_probs is None
    assert [(r.data_source, r.ground_truth, r.extra_info) for r in fields.reward_inputs] == [
        ("toy", "7", {"i": 0}), ("toy", "8", {"i": 1})]


# ------------------------------------------------------------------------------------------ start-up limits


def run_config(source: str, n=None) -> dict:
    rollout = {} if n is None else {"n": n}
    return {"algorithm": {"group_params": {"value_source": source}}, "actor_rollout_ref": {"rollout": rollout}}


@pytest.mark.parametrize("source", ["prefix_tree", "mc"])
@pytest.mark.parametrize("n", [1, 0, None])
def test_one_reply_per_prompt_is_refused_for_the_sources_that_read_the_others(source, n):
    with pytest.raises(ValueError) as err:
        check_value_source_config(run_config(source, n))
    message = str(err.value)
    assert message.startswith(f"actor_rollout_ref.rollout.n={1 if n is None else n}:")
    assert f"algorithm.group_params.value_source={source}" in message


@pytest.mark.parametrize("source, n", [("prefix_tree", 2), ("mc", 5), ("critic", 1), ("critic", None)])
def test_enough_replies_or_a_critic_pass(source, n):
    check_value_source_config(run_config(source, n))


def test_the_refusal_reads_a_composed_verl_config():
    from verl_group_ppo_testutils_integration import compose_config

    base = ["algorithm.adv_estimator=group_ppo", "++algorithm.group_params.value_source=prefix_tree"]
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.rollout\.n=1"):
        check_value_source_config(compose_config(base))
    check_value_source_config(compose_config(base + ["actor_rollout_ref.rollout.n=4"]))


# ------------------------------------------------------------------------------------------ the package's imports


def test_the_pure_value_modules_import_no_verl_and_no_glue():
    folder = pathlib.Path(values_pkg.__file__).parent
    glue = {"verl_batch", "mc_rollout"}
    for path in sorted(folder.glob("*.py")):
        if path.stem in glue | {"__init__"}:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert name != "verl" and not name.startswith("verl."), (path.name, name)
                assert not any(name.endswith(f".{g}") for g in glue), (path.name, name)
                assert not name.startswith("verl_group_ppo.integration"), (path.name, name)


# ------------------------------------------------------------------ prompts scored alike (group/prompts_scored_alike)

from verl_group_ppo.metrics import prompts_scored_alike


def test_prompts_scored_alike_counts_the_prompts_whose_replies_all_score_the_same():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.25])
    ids = np.array([0, 0, 1, 1, 2, 2, 3])  # prompt 3 has one reply: alike by itself
    assert prompts_scored_alike(scores, ids) == pytest.approx(3 / 4)
    assert prompts_scored_alike(torch.zeros(4), np.array([0, 0, 1, 1])) == 1.0
    assert np.isnan(prompts_scored_alike(torch.zeros(0), np.zeros(0, dtype=np.int64)))
    with pytest.raises(ValueError, match="scores must have shape \\(3,\\)"):
        prompts_scored_alike(torch.zeros(2), np.array([0, 1, 1]))
