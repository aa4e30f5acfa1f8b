"""Tree rollouts' pure parts: the shape, who branches from whom and where, a child's row, the segments."""

import pytest
import torch

from verl_group_ppo.tree import Reply, TreeShape, branch_position, child_reply, tree_plan
from verl_group_ppo.tree.segments import tree_endpoints, tree_token_counts


def test_shape_gives_roots_times_branching_samples_and_refuses_another_n():
    shape = TreeShape.from_config({"roots": 2, "branching": [2, 2], "segment_tokens": 3})
    assert shape.size == 8
    shape.check_samples(8)
    with pytest.raises(ValueError, match=r"actor_rollout_ref.rollout.n=4 .*tree_rollout.roots.*branching"):
        shape.check_samples(4)


@pytest.mark.parametrize("raw, key", [
    ({"roots": 0}, "tree_rollout.roots"),
    ({"branching": [2, 1]}, "tree_rollout.branching"),
    ({"branching": "22"}, "tree_rollout.branching"),
    ({"segment_tokens": 0}, "tree_rollout.segment_tokens"),
    ({"branch_rule": "entropy"}, "tree_rollout.branch_rule"),
    ({"shared_prefix": "twice"}, "tree_rollout.shared_prefix"),
    ({"window": 0}, "tree_rollout.window"),
    ({"depth": 2}, "unknown key"),
])
def test_bad_shapes_are_refused_naming_the_key(raw, key):
    with pytest.raises(ValueError, match=key):
        TreeShape.from_config(raw)


def test_plan_numbers_parents_before_children_in_mixed_radix():
    plans = tree_plan(TreeShape(roots=2, branching=(2, 2), segment_tokens=5))
    got = {p.index: (p.parent, p.level, p.nominal_position) for p in plans}
    assert got == {0: (None, 0, 0), 1: (0, 2, 10), 2: (0, 1, 5), 3: (2, 2, 10),
                   4: (None, 0, 0), 5: (4, 2, 10), 6: (4, 1, 5), 7: (6, 2, 10)}
    # a 3-level tree with branching 3: every parent precedes its child, every non-root node has branching-1 new
    # siblings per level
    plans = tree_plan(TreeShape(roots=1, branching=(3, 2, 2), segment_tokens=1))
    assert all(p.parent is None or p.parent < p.index for p in plans)
    assert sum(p.parent is None for p in plans) == 1
    assert [sum(p.level == lv for p in plans) for lv in (1, 2, 3)] == [2, 3, 6]
    # samples beyond the tree (more asked than the tree holds) are roots
    assert tree_plan(TreeShape(roots=1, branching=(2,)), n=3)[2].parent is None


def test_branch_position_fixed_and_when_the_parent_ends_before_it():
    shape = TreeShape(roots=1, branching=(2, 2), segment_tokens=4)
    child = tree_plan(shape)[1]  # level 2: nominal position 8
    assert branch_position(child, shape, parent_length=12) == 8
    assert branch_position(child, shape, parent_length=9) == 8
    # parent ends at or before the nominal position: the child copies all but the parent's last token
    assert branch_position(child, shape, parent_length=8) == 7
    assert branch_position(child, shape, parent_length=3) == 2
    assert branch_position(child, shape, parent_length=0) == 0
    with pytest.raises(ValueError, match="root"):
        branch_position(tree_plan(shape)[0], shape, 5)


def test_branch_position_low_prob_picks_the_least_likely_token_in_the_window():
    shape = TreeShape(roots=1, branching=(2,), segment_tokens=2, branch_rule="low_prob", window=3)
    child = tree_plan(shape)[1]  # nominal position 2, candidates 2, 3, 4
    logp = [-9.0, -9.0, -0.1, -2.0, -0.5, -50.0]
    assert branch_position(child, shape, 6, logp) == 3
    assert branch_position(child, shape, 4, logp[:4]) == 3  # window clipped at the reply's end
    assert branch_position(child, shape, 2, logp[:2]) == 1  # ends before: the last token
    with pytest.raises(ValueError, match="calculate_log_probs"):
        branch_position(child, shape, 6, None)


def test_child_reply_copies_the_prefix_and_masks_it_once():
    parent = Reply(ids=[5, 6, 7, 8], mask=[1, 1, 1, 1], log_probs=[-1.0, -2.0, -3.0, -4.0])
    tail = Reply(ids=[9, 10], mask=[1, 1], log_probs=[-0.5, -0.25])
    once = child_reply(parent, 2, tail, "once")
    assert once.ids == [5, 6, 9, 10] and once.mask == [0, 0, 1, 1]
    assert once.log_probs == [-1.0, -2.0, -0.5, -0.25]
    assert child_reply(parent, 2, tail, "per_leaf").mask == [1, 1, 1, 1]
    with pytest.raises(ValueError, match="position"):
        child_reply(parent, 5, tail, "once")


def _rows(replies, width):
    ids = torch.zeros((len(replies), width), dtype=torch.long)
    exists = torch.zeros((len(replies), width), dtype=torch.long)
    for b, r in enumerate(replies):
        ids[b, :len(r)] = torch.tensor(r)
        exists[b, :len(r)] = 1
    return ids, exists


def test_tree_endpoints_cut_at_every_branch_point_of_the_row():
    # root 0; 1 branches from 0 at 3; 2 branches from 0 at 1; a second prompt's row shares nothing with them
    replies = [[1, 2, 3, 4, 5], [1, 2, 3, 9], [1, 7, 7], [1, 2, 3, 4, 5]]
    ids, exists = _rows(replies, 6)
    ends = tree_endpoints(ids, exists, exists, ["a", "a", "a", "b"])
    assert ends[0].nonzero().flatten().tolist() == [0, 2, 4]
    assert ends[1].nonzero().flatten().tolist() == [0, 2, 3]
    assert ends[2].nonzero().flatten().tolist() == [0, 2]
    assert ends[3].nonzero().flatten().tolist() == [4]
    once = exists.clone()
    once[1, :3] = 0  # row 1 trains only its tail
    ends = tree_endpoints(ids, exists, once, ["a", "a", "a", "b"])
    assert ends[1].nonzero().flatten().tolist() == [3]


def test_tree_token_counts():
    assert tree_token_counts(torch.tensor([5, 4, 3]), torch.tensor([5, 1, 2])) == {
        "group/tree_generated_tokens": 8.0, "group/tree_path_tokens": 12.0}
