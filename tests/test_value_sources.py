"""Values without a critic (verl_group_ppo.value_sources) against plain loops, and their reductions."""

from __future__ import annotations

import pytest
import torch

from verl_group_ppo.value_sources import mc_boundary_values, prefix_tree_values, shared_prefix_lengths
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
