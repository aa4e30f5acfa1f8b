"""Tree rollouts' pure parts: the shape, who branches from whom and where, a child's row, the segments."""

import pytest
import torch

from verl_group_ppo.tree import Reply, TreeShape, branch_position, child_reply, tree_plan
from verl_group_ppo.tree.cost import tree_token_counts
from verl_group_ppo.values.prefix_tree import branch_endpoints


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
    ({"branch_start": "asap"}, "tree_rollout.branch_start"),
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
    ends = branch_endpoints(ids, exists, exists, ["a", "a", "a", "b"])
    assert ends[0].nonzero().flatten().tolist() == [0, 2, 4]
    assert ends[1].nonzero().flatten().tolist() == [0, 2, 3]
    assert ends[2].nonzero().flatten().tolist() == [0, 2]
    assert ends[3].nonzero().flatten().tolist() == [4]
    once = exists.clone()
    once[1, :3] = 0  # row 1 trains only its tail
    ends = branch_endpoints(ids, exists, once, ["a", "a", "a", "b"])
    assert ends[1].nonzero().flatten().tolist() == [3]


def test_tree_round_seconds_are_the_mean_time_in_generate_per_level():
    from verl_group_ppo.tree.cost import tree_round_seconds

    levels = torch.tensor([0, 2, 1, 2, 0, 2, 1, 2])
    seconds = torch.tensor([4.0, 1.0, 2.0, 3.0, 6.0, 1.0, 4.0, 3.0])
    assert tree_round_seconds(levels, seconds) == {"group/tree_round0_generate_s": 5.0,
                                                   "group/tree_round1_generate_s": 3.0,
                                                   "group/tree_round2_generate_s": 2.0}
    with pytest.raises(ValueError, match="seconds must have the shape of levels"):
        tree_round_seconds(levels, seconds[:3])


def test_tree_token_counts():
    assert tree_token_counts(torch.tensor([5, 4, 3]), torch.tensor([5, 1, 2])) == {
        "group/tree_generated_tokens": 8.0, "group/tree_path_tokens": 12.0}


# ------------------------------------------------------------------ the samples of one prompt meeting in memory

import asyncio
import random

from verl_group_ppo.tree.assemble import prefix_length
from verl_group_ppo.tree.coordinator import TreeRegistry, pieces, sample_in_tree


class FakeServer:
    """Counts requests and tokens; replies are random tokens of a random length, each with log-prob -token/100,
    after a random delay (so samples finish out of order)."""

    def __init__(self, seed, max_len=12, eos_early=True):
        self.rng = random.Random(seed)
        self.requests = []
        self.max_len = max_len
        self.eos_early = eos_early

    async def generate(self, token_ids, max_tokens):
        await asyncio.sleep(self.rng.random() / 1000)
        limit = self.max_len if max_tokens is None else min(max_tokens, self.max_len)
        length = self.rng.randint(1, limit) if self.eos_early else limit
        ids = [self.rng.randint(10, 99) for _ in range(length)]
        self.requests.append((list(token_ids), max_tokens, len(ids)))
        return Reply(ids=ids, mask=[1] * length, log_probs=[-t / 100 for t in ids])


async def _run_tree(shape, server, response_length=12, prompt=(1, 2, 3), n=None, stop_ids=()):
    registry = TreeRegistry()
    plans = tree_plan(shape, n)
    tree = registry.tree(("uid", 0))
    order = list(plans)
    random.Random(0).shuffle(order)  # verl starts the tasks in sample order; any order must work
    server.by_sample = {}

    def generate_for(i):
        async def generate(token_ids, max_tokens):
            reply = await server.generate(token_ids, max_tokens)
            server.by_sample.setdefault(i, []).append((list(token_ids), max_tokens, len(reply.ids)))
            return reply
        return generate

    results = await asyncio.gather(*[
        sample_in_tree(tree, p, shape, list(prompt), generate_for(p.index), response_length, stop_ids=stop_ids)
        for p in order])
    for _ in plans:
        registry.finished(("uid", 0), len(plans))
    assert len(registry) == 0
    return {p.index: r for p, r in zip(order, results)}


@pytest.mark.parametrize("branch_start", ["parent_done", "prefix_ready"])
@pytest.mark.parametrize("shared_prefix", ["once", "per_leaf"])
@pytest.mark.parametrize("rule", ["fixed", "low_prob"])
@pytest.mark.parametrize("seed", range(5))
def test_every_row_copies_its_parent_up_to_the_branch_point_and_generates_only_its_tail(seed, rule, shared_prefix,
                                                                                         branch_start):
    shape = TreeShape(roots=2, branching=(2, 2), segment_tokens=3, branch_rule=rule, window=3,
                      shared_prefix=shared_prefix, branch_start=branch_start)
    server = FakeServer(seed)
    rows = asyncio.run(_run_tree(shape, server))
    assert sorted(rows) == list(range(8))
    plans = {p.index: p for p in tree_plan(shape)}
    for i, row in rows.items():
        if plans[i].parent is None:
            assert row.parent == -1 and row.position == 0 and row.generated == len(row.reply.ids)
            continue
        parent = rows[row.parent].reply
        q = row.position
        assert row.parent == plans[i].parent
        assert row.reply.ids[:q] == parent.ids[:q]
        assert row.reply.log_probs[:q] == parent.log_probs[:q]
        assert row.generated == len(row.reply.ids) - q >= 1
        # once: 0 on the copied prefix and on any first sampled tokens that repeat the parent's
        masked = prefix_length(row.reply.ids, parent.ids) if shared_prefix == "once" else 0
        assert masked >= (q if shared_prefix == "once" else 0)
        assert row.reply.mask == [0] * masked + [1] * (len(row.reply.ids) - masked)
        if rule == "fixed":
            assert q == min(plans[i].nominal_position, len(parent.ids) - 1)
        assert len(row.reply.ids) <= 12
    # a sample's requests continue its text: prompt + its reply so far (the parent's prefix, then its own pieces),
    # each for the tokens up to its next piece's end; the server generated exactly the rows' own tails
    for i, asked in server.by_sample.items():
        ends, reply = pieces(plans[i], shape, 12), rows[i].reply.ids
        starts = [rows[i].position] + [e for e in ends[:-1] if e < len(reply)]
        assert [len(ids) - 3 for ids, _, _ in asked] == starts[:len(asked)]
        for ids, max_tokens, _ in asked:
            start = len(ids) - 3
            assert ids == [1, 2, 3] + reply[:start]
            assert max_tokens == (None if plans[i].parent is None and len(ends) == 1
                                  else min(e for e in ends if e > start) - start)
        assert sum(got for _, _, got in asked) == rows[i].generated
    assert sum(n for _, _, n in server.requests) == sum(r.generated for r in rows.values())


@pytest.mark.parametrize("shared_prefix", ["once", "per_leaf"])
def test_a_child_whose_first_tokens_repeat_its_parents_trains_from_where_it_parts(shared_prefix):
    """A child branched at q = 2 samples the parent's token at 2 again and parts at 3: with ``once`` the repeated
    token is the parent's tree node (trained in the parent's row), so the child's mask is 0 through position 2 and
    its first trained token is its first token off the parent's path (where the tree's value changes)."""
    root = [10, 11, 12, 13, 14, 15]

    async def generate(token_ids, max_tokens):
        if len(token_ids) == 3:  # the root, from the prompt (1, 2, 3)
            ids = root
        else:  # the child, from prompt + root[:2]: repeats root[2], then parts
            ids = [12, 40, 41]
        return Reply(ids=ids, mask=[1] * len(ids), log_probs=[-0.5] * len(ids))

    shape = TreeShape(roots=1, branching=(2,), segment_tokens=2, shared_prefix=shared_prefix)
    rows = asyncio.run(_run_tree(shape, _Scripted(generate), n=2))
    child = next(r for r in rows.values() if r.parent >= 0)
    assert child.position == 2 and child.generated == 3 and child.reply.ids == [10, 11, 12, 40, 41]
    assert child.reply.mask == ([0, 0, 0, 1, 1] if shared_prefix == "once" else [1] * 5)


def test_with_prefix_ready_a_branch_starts_as_soon_as_its_prefix_exists_not_when_its_parent_ends():
    """The root's last piece is answered only once its child has asked for its tail: a child that waited for the
    root's whole reply would never ask (the wait times out)."""
    child_asked = asyncio.Event()

    async def generate(token_ids, max_tokens):
        if token_ids == [1, 2, 3]:  # the root's first piece: up to its child's branch point and one token more
            assert max_tokens == 3
            return Reply(ids=[10, 11, 12], mask=[1] * 3, log_probs=[-0.1] * 3)
        if token_ids == [1, 2, 3, 10, 11, 12]:  # the root's last piece
            await asyncio.wait_for(child_asked.wait(), timeout=5)
            return Reply(ids=[13, 14], mask=[1] * 2, log_probs=[-0.1] * 2)
        assert token_ids == [1, 2, 3, 10, 11] and max_tokens == 10  # the child, branched at 2
        child_asked.set()
        return Reply(ids=[40], mask=[1], log_probs=[-0.2])

    shape = TreeShape(roots=1, branching=(2,), segment_tokens=2, branch_start="prefix_ready")
    rows = asyncio.run(_run_tree(shape, _Scripted(generate), n=2))
    assert rows[0].reply.ids == [10, 11, 12, 13, 14] and rows[0].generated == 5
    assert (rows[1].position, rows[1].reply.ids, rows[1].generated) == (2, [10, 11, 40], 1)


@pytest.mark.parametrize("stop_ids", [(), (12,)])
def test_a_piece_that_ends_at_a_stop_token_ends_the_reply(stop_ids):
    """The root's first piece comes back full (3 of 3 tokens) with a stop token last: the reply has ended, the
    child branches at the root's last token. Without that token among ``stop_ids`` (``rollout.ignore_eos``) the
    root goes on."""

    async def generate(token_ids, max_tokens):
        if token_ids == [1, 2, 3]:
            return Reply(ids=[10, 11, 12], mask=[1] * 3, log_probs=[-0.1] * 3)
        if token_ids == [1, 2, 3, 10, 11, 12]:
            return Reply(ids=[13], mask=[1], log_probs=[-0.1])
        return Reply(ids=[40], mask=[1], log_probs=[-0.2])

    shape = TreeShape(roots=1, branching=(2,), segment_tokens=2, branch_start="prefix_ready")
    server = _Scripted(generate)
    rows = asyncio.run(_run_tree(shape, server, n=2, stop_ids=stop_ids))
    if stop_ids:
        assert rows[0].reply.ids == [10, 11, 12] and len(server.by_sample[0]) == 1
    else:
        assert rows[0].reply.ids == [10, 11, 12, 13] and len(server.by_sample[0]) == 2
    assert rows[1].position == 2 and rows[1].reply.ids == [10, 11, 40]


def test_pieces_stop_where_the_deeper_levels_branch():
    fixed = TreeShape(roots=2, branching=(2, 2), segment_tokens=4, branch_start="prefix_ready")
    plans = tree_plan(fixed)
    assert pieces(plans[0], fixed, 16) == [5, 9, 16]  # a root: its children at levels 1 and 2
    assert pieces(plans[2], fixed, 16) == [9, 16]  # a level-1 branch: its child at level 2
    assert pieces(plans[1], fixed, 16) == [16]  # a leaf: one piece
    assert pieces(plans[0], fixed, 8) == [5, 8]  # past the reply's limit: no piece
    low_prob = TreeShape(roots=2, branching=(2, 2), segment_tokens=4, branch_rule="low_prob", window=3,
                         branch_start="prefix_ready")
    assert pieces(plans[0], low_prob, 16) == [7, 11, 16]  # the whole window first
    independent = TreeShape(roots=4, branching=(), branch_start="prefix_ready")
    assert pieces(tree_plan(independent)[0], independent, 16) == [16]
    # parent_done (the default): every sample in one piece, a child starts when its parent is done
    assert all(pieces(plan, TreeShape(roots=2, branching=(2, 2), segment_tokens=4), 16) == [16] for plan in plans)


class _Scripted:
    def __init__(self, generate):
        self.generate = generate


def test_a_full_tree_generates_fewer_tokens_than_its_rows_hold():
    shape = TreeShape(roots=2, branching=(2, 2), segment_tokens=3)
    rows = asyncio.run(_run_tree(shape, FakeServer(1, eos_early=False)))
    generated = sum(r.generated for r in rows.values())
    path = sum(len(r.reply.ids) for r in rows.values())
    # 2 roots x 12, 2 level-1 branches x 9, 4 level-2 branches x 6
    assert (generated, path) == (2 * 12 + 2 * 9 + 4 * 6, 8 * 12)


def test_a_failed_parent_fails_its_children_and_a_partial_tree_runs():
    shape = TreeShape(roots=1, branching=(2,), segment_tokens=2)

    async def broken(token_ids, max_tokens):
        raise RuntimeError("server down")

    with pytest.raises(RuntimeError, match="server down"):
        asyncio.run(_run_tree(shape, type("S", (), {"generate": staticmethod(broken)})()))
    # validation asking fewer samples than the tree holds: the first k samples are a tree of their own
    rows = asyncio.run(_run_tree(TreeShape(roots=2, branching=(2, 2)), FakeServer(3), n=3))
    assert [rows[i].parent for i in range(3)] == [-1, 0, 0]


# ------------------------------------------------------------------ the estimator on a tree

from verl_group_ppo.config import AlgorithmSettings, GroupParams
from verl_group_ppo.core_algos import compute_group_ppo_outputs
from verl_group_ppo.values import BatchFields, boundary_values


def _tree_batch(seed, shared_prefix, prompts=2):
    """Rows of ``prompts`` trees (roots=2, branching=[2, 2], segments of 3), a deterministic reward per reply."""
    shape = TreeShape(roots=2, branching=(2, 2), segment_tokens=3, shared_prefix=shared_prefix)
    replies, masks, uids = [], [], []
    for p in range(prompts):
        rows = asyncio.run(_run_tree(shape, FakeServer(seed * 10 + p, max_len=10), response_length=10))
        for i in range(shape.size):
            replies.append(rows[i].reply.ids)
            masks.append(rows[i].reply.mask)
            uids.append(f"p{p}")
    width = max(len(r) for r in replies)
    ids, exists = _rows(replies, width)
    mask = torch.zeros_like(exists)
    for b, m in enumerate(masks):
        mask[b, :len(m)] = torch.tensor(m)
    scores = torch.tensor([float(sum(r) % 3 == 0) + 0.25 * (r[-1] % 2) for r in replies])
    rewards = torch.zeros((len(replies), width))
    for b, r in enumerate(replies):
        rewards[b, len(r) - 1] = scores[b]
    return replies, uids, ids, exists, mask, scores, rewards


def _loop_value(replies, uids, scores, b, t):
    """Mean reward of the prompt's replies whose first t tokens are reply b's (a plain loop)."""
    same = [j for j in range(len(replies)) if uids[j] == uids[b] and len(replies[j]) >= t
            and replies[j][:t] == replies[b][:t]]
    return sum(float(scores[j]) for j in same) / len(same)


@pytest.mark.parametrize("policy_lam", [0.0, 1.0])
@pytest.mark.parametrize("shared_prefix", ["once", "per_leaf"])
@pytest.mark.parametrize("seed", range(4))
def test_tree_segments_get_the_advantages_a_plain_loop_over_the_tree_gives(seed, shared_prefix, policy_lam):
    """gamma = 1: with policy_lam = 0 a segment's advantage is V(child) - V(parent) (SPO-tree), with policy_lam = 1
    it is the row's own reward minus V(parent)."""
    replies, uids, ids, exists, mask, scores, rewards = _tree_batch(seed, shared_prefix)
    settings = AlgorithmSettings(gamma=1.0, lam=1.0, group=GroupParams(
        value_source="prefix_tree", boundary_rule="tree", policy_lam=policy_lam, adv_norm="none"))
    fields = BatchFields(response_mask=mask, reply_lengths=exists.sum(dim=1), responses=ids, scores=scores, uid=uids)
    bv = boundary_values(settings, fields)
    assert bv.endpoints is not None
    out = compute_group_ppo_outputs(rewards, mask.float(), values=bv.values, settings=settings, index=uids,
                                    endpoints=bv.endpoints)
    for b, reply in enumerate(replies):
        L = len(reply)
        for t in range(L):
            assert float(bv.values[b, t]) == pytest.approx(_loop_value(replies, uids, scores, b, t))
        # the row's branch points: where another reply of its prompt parts from it
        cuts = sorted({next((t for t in range(min(L, len(o))) if o[t] != reply[t]), min(L, len(o)))
                       for j, o in enumerate(replies) if j != b and uids[j] == uids[b]} - {0})
        cuts = [t for t in cuts if t < L]
        starts = [0] + cuts
        for s, e in zip(starts, starts[1:] + [L]):
            end_value = float(scores[b]) if e == L or policy_lam == 1.0 else _loop_value(replies, uids, scores, b, e)
            expected = end_value - _loop_value(replies, uids, scores, b, s)
            for t in range(s, e):
                if mask[b, t]:
                    assert float(out.advantages[b, t]) == pytest.approx(expected, abs=1e-6), (b, s, e, t)


def _sibling_loop(replies, uids, b, s):
    """The node a segment starting at position s of reply b hangs from, as a plain loop: the rows of b's prompt that
    share its first s tokens."""
    return frozenset(j for j in range(len(replies)) if uids[j] == uids[b] and len(replies[j]) >= s
                     and replies[j][:s] == replies[b][:s])


@pytest.mark.parametrize("shared_prefix", ["once", "per_leaf"])
@pytest.mark.parametrize("seed", range(3))
def test_parent_normalisation_scales_each_segment_with_its_siblings(seed, shared_prefix):
    """adv_norm='parent': every group's advantage minus the mean over the groups that start at the same tree node,
    over their Bessel std plus epsilon (a node with one group: unchanged), node membership found by a plain loop."""
    replies, uids, ids, exists, mask, scores, rewards = _tree_batch(seed, shared_prefix)
    fields = BatchFields(response_mask=mask, reply_lengths=exists.sum(dim=1), responses=ids, scores=scores, uid=uids)

    def run(adv_norm):
        settings = AlgorithmSettings(gamma=1.0, lam=1.0, group=GroupParams(
            value_source="prefix_tree", boundary_rule="tree", policy_lam=0.0, adv_norm=adv_norm))
        bv = boundary_values(settings, fields)
        assert (bv.parent_nodes is not None) == (adv_norm == "parent")
        return compute_group_ppo_outputs(rewards, mask.float(), values=bv.values, settings=settings, index=uids,
                                         endpoints=bv.endpoints, parent_nodes=bv.parent_nodes)

    raw, normed = run("none"), run("parent")
    assert torch.equal(raw.group_ids, normed.group_ids)
    heads = {}  # node -> [(b, first, last, raw advantage)]
    for b in range(len(replies)):
        positions = mask[b].nonzero().flatten().tolist()
        for g in sorted(set(raw.group_ids[b, positions].tolist())):
            members = [t for t in positions if int(raw.group_ids[b, t]) == g]
            node = _sibling_loop(replies, uids, b, members[0])
            heads.setdefault(node, []).append((b, members, float(raw.advantages[b, members[0]])))
    eps = GroupParams().group_epsilon
    several = 0
    for node, groups in heads.items():
        values = [a for _, _, a in groups]
        if len(values) < 2:
            mean, scale = 0.0, 1.0 + eps
        else:
            several += 1
            mean = sum(values) / len(values)
            scale = (sum((a - mean) ** 2 for a in values) / (len(values) - 1)) ** 0.5 + eps
        for b, members, a in groups:
            for t in members:
                assert float(normed.advantages[b, t]) == pytest.approx((a - mean) / scale, abs=1e-5), (b, t)
    assert several >= 2  # roots and at least one branch node hold siblings
    assert torch.all(normed.advantages[mask == 0] == 0)


def test_the_prefix_tree_source_compares_each_prompts_replies_once(monkeypatch):
    """Under boundary_rule 'tree' and adv_norm 'parent' the values, the endpoints and the nodes all read one
    comparison of each prompt's replies, and equal what each function gives on its own."""
    from verl_group_ppo.values import prefix_tree

    replies, uids, ids, exists, mask, scores, rewards = _tree_batch(0, "once")
    fields = BatchFields(response_mask=mask, reply_lengths=exists.sum(dim=1), responses=ids, scores=scores, uid=uids)
    alone = (prefix_tree.prefix_tree_values(ids, exists, scores, uids),
             prefix_tree.branch_endpoints(ids, exists, mask, uids), prefix_tree.parent_nodes(ids, exists, uids))
    calls = []
    counted = prefix_tree.shared_prefix_lengths
    monkeypatch.setattr(prefix_tree, "shared_prefix_lengths", lambda *a: calls.append(1) or counted(*a))
    bv = prefix_tree.prefix_tree_source(fields, boundary_rule="tree", adv_norm="parent")
    assert len(calls) == len(set(uids))
    assert torch.equal(bv.values, alone[0]) and torch.equal(bv.endpoints, alone[1])
    assert torch.equal(bv.parent_nodes, alone[2])


def test_parent_nodes_name_the_rows_that_share_a_prefix():
    from verl_group_ppo.values.prefix_tree import parent_nodes
    ids, exists = _rows([[1, 2, 3], [1, 2, 4], [1, 5, 6], [7, 8, 9]], 3)
    nodes = parent_nodes(ids, exists, ["a", "a", "a", "b"])
    T = 3
    assert nodes[:3, 0].tolist() == [0, 0, 0] and nodes[3, 0] == 3 * T  # the empty prefix: one node per prompt
    assert nodes[0, 2] == nodes[1, 2] == 0 * T + 2 and nodes[2, 2] == 2 * T + 2  # [1, 2] vs [1, 5]
    assert nodes[0, 1] == nodes[1, 1] == nodes[2, 1] == 1  # all share [1]


def test_parent_normalisation_is_refused_off_the_tree_and_without_nodes():
    with pytest.raises(ValueError, match=r"adv_norm='parent' needs algorithm.group_params.boundary_rule='tree'"):
        GroupParams(value_source="prefix_tree", adv_norm="parent")
    with pytest.raises(ValueError, match=r"adv_norm='parent' needs algorithm.group_params.within_group='broadcast'"):
        GroupParams(value_source="prefix_tree", boundary_rule="tree", adv_norm="parent", within_group="per_token")
    tree = AlgorithmSettings(group=GroupParams(value_source="prefix_tree", boundary_rule="tree", adv_norm="parent"))
    args = dict(values=torch.zeros(2, 3), index=["a", "a"], endpoints=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="parent_nodes is required by adv_norm='parent'"):
        compute_group_ppo_outputs(torch.zeros(2, 3), torch.ones(2, 3), settings=tree, **args)
    with pytest.raises(ValueError, match="parent_nodes must be an integer"):
        compute_group_ppo_outputs(torch.zeros(2, 3), torch.ones(2, 3), settings=tree, parent_nodes=torch.zeros(2, 3),
                                  **args)
    plain = AlgorithmSettings(group=GroupParams(value_source="prefix_tree", boundary_rule="tree"))
    with pytest.raises(ValueError, match="parent_nodes is read only by adv_norm='parent'"):
        compute_group_ppo_outputs(torch.zeros(2, 3), torch.ones(2, 3), settings=plain,
                                  parent_nodes=torch.zeros(2, 3, dtype=torch.long), **args)


def test_tree_rule_is_refused_without_prefix_tree_values_or_endpoints():
    with pytest.raises(ValueError, match="boundary_rule='tree' does not combine with .*value_source='critic'"):
        GroupParams(boundary_rule="tree")
    with pytest.raises(ValueError, match="value_source='mc'"):
        GroupParams(boundary_rule="tree", value_source="mc")
    settings = AlgorithmSettings(group=GroupParams(value_source="prefix_tree", boundary_rule="tree"))
    with pytest.raises(ValueError, match="endpoints is required by boundary_rule='tree'"):
        compute_group_ppo_outputs(torch.zeros(2, 3), torch.ones(2, 3), values=torch.zeros(2, 3), settings=settings,
                                  index=["a", "a"])


# ------------------------------------------------------------------ start-up refusals

from verl_group_ppo.tree.limits import check_tree_config
from verl_group_ppo.values.limits import check_value_source_config


def _config(n=8, agent="tree_single_turn", tree=None, **rollout):
    cfg = {"actor_rollout_ref": {"rollout": {"n": n, "agent": {"default_agent_loop": agent},
                                             "calculate_log_probs": True, **rollout}},
           "algorithm": {"adv_estimator": "grpo"}}
    if tree is not None:
        cfg["tree_rollout"] = tree
    return cfg


def test_tree_settings_are_checked_before_ray_starts():
    check_tree_config(_config(tree={"roots": 2, "branching": [2, 2]}))
    check_tree_config(_config(agent="single_turn_agent"))
    with pytest.raises(ValueError, match=r"actor_rollout_ref.rollout.n=4 .*tree_rollout.roots"):
        check_tree_config(_config(n=4))
    with pytest.raises(ValueError, match="tree_rollout.branching"):
        check_tree_config(_config(tree={"branching": [1]}))
    with pytest.raises(ValueError, match="multi_turn.enable"):
        check_tree_config(_config(multi_turn={"enable": True}))
    with pytest.raises(ValueError, match="calculate_log_probs"):
        check_tree_config(_config(tree={"branch_rule": "low_prob"}, calculate_log_probs=False))
    with pytest.raises(ValueError, match="tree_rollout is set but .*default_agent_loop"):
        check_tree_config(_config(agent="single_turn_agent", tree={"roots": 2}))


def test_tree_boundary_rule_needs_the_tree_rollout():
    cfg = _config(agent="single_turn_agent")
    cfg["algorithm"] = {"adv_estimator": "group_ppo",
                        "group_params": {"value_source": "prefix_tree", "boundary_rule": "tree"}}
    with pytest.raises(ValueError, match="boundary_rule=tree .*default_agent_loop='single_turn_agent'"):
        check_value_source_config(cfg)
    cfg["actor_rollout_ref"]["rollout"]["agent"]["default_agent_loop"] = "tree_single_turn"
    check_value_source_config(cfg)


@pytest.mark.parametrize("shared_prefix", ["once", "per_leaf"])
def test_the_worked_example_of_algorithm_md(shared_prefix):
    a, b, c, d, e, f, g, x, h, i, j, k = range(10, 22)
    replies = [[a, b, c, d, e], [a, b, c, f, g], [x, h], [x, i, j, k]]
    copied = [0, 3, 0, 1]
    ids, exists = _rows(replies, 5)
    mask = exists.clone()
    if shared_prefix == "once":
        for row, q in enumerate(copied):
            mask[row, :q] = 0
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0])
    rewards = torch.zeros(4, 5)
    for row, r in enumerate(replies):
        rewards[row, len(r) - 1] = scores[row]
    settings = AlgorithmSettings(gamma=1.0, lam=1.0, group=GroupParams(
        value_source="prefix_tree", boundary_rule="tree", policy_lam=0.0, adv_norm="none"))
    uid = ["p"] * 4
    bv = boundary_values(settings, BatchFields(response_mask=mask, reply_lengths=exists.sum(dim=1), responses=ids,
                                               scores=scores, uid=uid))
    out = compute_group_ppo_outputs(rewards, mask.float(), values=bv.values, settings=settings, index=uid,
                                    endpoints=bv.endpoints)
    table = [[0.25] * 3 + [0.5] * 2, [0.25] * 3 + [-0.5] * 2, [-0.25, 0.0], [-0.25, 0.0, 0.0, 0.0]]
    for row, expected in enumerate(table):
        got = [round(float(out.advantages[row, t]), 6) if mask[row, t] else None for t in range(len(expected))]
        assert got == [None if not mask[row, t] else v for t, v in enumerate(expected)], row
    generated = torch.tensor([len(r) - q for r, q in zip(replies, copied)])
    assert tree_token_counts(exists.sum(dim=1), generated) == {"group/tree_generated_tokens": 12.0,
                                                                "group/tree_path_tokens": 16.0}
    if shared_prefix == "once":  # adv_norm parent: the example's last table, siblings 0.25 / -0.25, 0.5 / -0.5, 0 / 0
        parent = AlgorithmSettings(gamma=1.0, lam=1.0, group=GroupParams(
            value_source="prefix_tree", boundary_rule="tree", policy_lam=0.0, adv_norm="parent"))
        fields = BatchFields(response_mask=mask, reply_lengths=exists.sum(dim=1), responses=ids, scores=scores, uid=uid)
        bv = boundary_values(parent, fields)
        normed = compute_group_ppo_outputs(rewards, mask.float(), values=bv.values, settings=parent, index=uid,
                                           endpoints=bv.endpoints, parent_nodes=bv.parent_nodes)
        eps = GroupParams().group_epsilon
        r1, r2 = 0.25 / (0.125 ** 0.5 + eps), 0.5 / (0.5 ** 0.5 + eps)  # A / (Bessel std + eps): about 0.71 each
        table = [[r1] * 3 + [r2] * 2, [None] * 3 + [-r2] * 2, [-r1, 0.0], [None, 0.0, 0.0, 0.0]]
        for row, expected in enumerate(table):
            got = [float(normed.advantages[row, t]) if mask[row, t] else None for t in range(len(expected))]
            assert got == pytest.approx(expected, abs=1e-6), row
