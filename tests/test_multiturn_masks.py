"""GROUP-PPO on the masks verl's tool agent loop really produces.

``tests/data/multiturn_step2.groups.jsonl`` is the groups dump (``trainer.rollout_data_dir``) of step 2 of a
real run: ``examples/cpu/run_tiny_multiturn_group_ppo.sh`` (verl's ``main_ppo``, ``ToolAgentLoop``, the tiny
tool task) with 8 prompts x 4 responses a step; its ``row`` fields hold the advantage step's inputs and
outputs over each response, tool replies included. The checks below run on that file, and the slow test
runs them again on the dump of a fresh 2-step run, so what they say holds for the installed verl.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from verl.trainer.ppo.core_algos import compute_gae_advantage_return

from verl_group_ppo.config import GroupParams, read_algorithm_settings
from verl_group_ppo.core_algos import boundary_loss_weights, compute_group_ppo_outputs
from verl_group_ppo.tasks.tiny import prepare as prep

REPO = Path(__file__).resolve().parents[1]
RECORDED = REPO / "tests" / "data" / "multiturn_step2.groups.jsonl"
ROW_FIELDS = ("response_ids", "response_mask", "token_level_rewards", "values", "advantages", "returns", "critic_mask")


def load_records(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def as_batch(records: list[dict]) -> dict:
    """The rows as (B, T) float64 tensors, right-padded with mask 0 (and the uids and threshold)."""
    width = max(len(r["row"]["response_mask"]) for r in records)
    out = {}
    for name in ROW_FIELDS:
        t = torch.zeros((len(records), width), dtype=torch.float64)
        for i, r in enumerate(records):
            t[i, : len(r["row"][name])] = torch.tensor(r["row"][name], dtype=torch.float64)
        out[name] = t
    out["uids"] = [r["uid"] for r in records]
    thresholds = {r["row"]["threshold"] for r in records}
    assert len(thresholds) == 1, thresholds
    out["threshold"] = thresholds.pop()
    return out


def turns(mask_row: list[int]) -> list[list[int]]:
    """The maximal runs of valid positions (assistant turns) of one response."""
    runs: list[list[int]] = []
    for t, m in enumerate(mask_row):
        if m and runs and runs[-1][-1] == t - 1:
            runs[-1].append(t)
        elif m:
            runs.append([t])
    return runs


# ------------------------------------------------------------------------------------------------- checks


def check_holes_are_tool_replies(records: list[dict]) -> None:
    """The mask has holes, each right after an assistant turn's ``<|im_end|>``, each the same template around
    the reply: the agent loop's tool messages."""
    n_turns = [len(turns(r["row"]["response_mask"])) for r in records]
    assert max(n_turns) >= 2, "no response called the tool"
    heads, tails = set(), set()
    for r in records:
        mask, ids = r["row"]["response_mask"], r["row"]["response_ids"]
        valid_rank = {t: k for k, t in enumerate(t for t, m in enumerate(mask) if m)}
        runs = turns(mask)
        for before, after in zip(runs, runs[1:]):
            assert r["tokens"][valid_rank[before[-1]]] == "<|im_end|>"  # the turn ended with EOS
            hole = ids[before[-1] + 1: after[0]]
            heads.add(hole[0])
            tails.add(tuple(hole[-3:]))
    assert len(heads) <= 1 and len(tails) <= 1, (heads, tails)


def check_tool_tokens_get_no_advantage_and_no_critic_loss(records: list[dict]) -> None:
    batch = as_batch(records)
    holes = batch["response_mask"] == 0
    assert torch.all(batch["advantages"][holes] == 0) and torch.all(batch["returns"][holes] == 0)
    assert torch.all(batch["critic_mask"][holes] == 0)
    weights = boundary_loss_weights(batch["critic_mask"], batch["response_mask"])
    assert torch.all(weights[holes] == 0) and bool(weights.sum() > 0)


def check_every_turn_ends_a_group(records: list[dict]) -> None:
    for r in records:
        mask = r["row"]["response_mask"]
        valid = [t for t, m in enumerate(mask) if m]
        ends = {valid[k] for k, e in enumerate(r["endpoints"]) if e}
        for turn in turns(mask):
            assert turn[-1] in ends
        assert r["row"]["critic_mask"][turns(mask)[0][0]] == 1.0 if valid else True


def check_the_run_computed_what_the_core_computes(records: list[dict], params: GroupParams) -> None:
    """The run's advantages, returns and critic mask equal the core's on the recorded inputs (float32 run)."""
    batch = as_batch(records)
    settings = read_algorithm_settings({"gamma": 1.0, "lam": 1.0, "group_params": params.to_dict()})
    out = compute_group_ppo_outputs(batch["token_level_rewards"], batch["response_mask"], values=batch["values"],
                                    index=batch["uids"], settings=settings, threshold=batch["threshold"])
    torch.testing.assert_close(out.critic_mask, batch["critic_mask"])
    torch.testing.assert_close(out.returns, batch["returns"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.advantages, batch["advantages"], rtol=1e-4, atol=1e-4)
    # group/* count assistant tokens only: every group's tokens are valid, and together they are all of them
    n_valid = int(batch["response_mask"].sum())
    assert out.metrics["group/num_groups"] == int(batch["critic_mask"].sum())
    assert out.metrics["group/mean_group_size"] * out.metrics["group/num_groups"] == pytest.approx(n_valid)


def check_turn_end_bootstraps_from_the_next_turns_first_token(records: list[dict]) -> None:
    """With every token its own group and lambda 0 the advantage is the TD residual; at a turn's last token
    it reads V at the first assistant token after the reply, exactly as verl's GAE does."""
    batch = as_batch(records)
    mask, rewards, values = batch["response_mask"], batch["token_level_rewards"], batch["values"]
    settings = read_algorithm_settings({"gamma": 1.0, "lam": 0.0, "group_params": {
        "group_variance_threshold": 0.0, "adaptive_threshold": False, "policy_lam": None, "adv_norm": "none"}})
    out = compute_group_ppo_outputs(rewards, mask, values=values, settings=settings)
    _, verl_returns = compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=0.0)
    valid = mask.bool()
    torch.testing.assert_close(out.returns[valid], verl_returns[valid], rtol=1e-12, atol=1e-12)
    checked = 0
    for b in range(len(records)):
        runs = turns(mask[b].int().tolist())
        for before, after in zip(runs, runs[1:]):
            end, first = before[-1], after[0]
            expected = rewards[b, end] + values[b, first] - values[b, end]
            assert float(out.advantages[b, end]) == pytest.approx(float(expected), abs=1e-12)
            checked += 1
    assert checked > 0


CHECKS = (check_holes_are_tool_replies, check_tool_tokens_get_no_advantage_and_no_critic_loss,
          check_every_turn_ends_a_group, check_turn_end_bootstraps_from_the_next_turns_first_token)


# ------------------------------------------------------------------------------------------ on the record


@pytest.fixture(scope="module")
def recorded() -> list[dict]:
    return load_records(RECORDED)


def test_multiturn_recorded_holes_are_verls_tool_replies(recorded):
    check_holes_are_tool_replies(recorded)


def test_multiturn_tool_tokens_get_advantage_0_and_no_critic_loss(recorded):
    check_tool_tokens_get_no_advantage_and_no_critic_loss(recorded)


def test_multiturn_each_assistant_turn_ends_a_group(recorded):
    check_every_turn_ends_a_group(recorded)


def test_multiturn_turn_end_bootstraps_from_the_first_token_after_the_reply(recorded):
    check_turn_end_bootstraps_from_the_next_turns_first_token(recorded)


def test_multiturn_run_equals_the_core_and_group_metrics_count_assistant_tokens(recorded):
    check_the_run_computed_what_the_core_computes(recorded, GroupParams())


def test_multiturn_turn_rule_is_one_group_per_turn_at_default_settings_and_fixed_is_not(recorded):
    """At the package defaults (``group_max_size`` 16) ``turn`` makes every assistant turn one group, the ones
    longer than 16 tokens too; ``fixed`` cuts each turn into ceil(length / 16) groups."""
    batch = as_batch(recorded)
    outs = {rule: compute_group_ppo_outputs(
        batch["token_level_rewards"], batch["response_mask"], values=batch["values"], index=batch["uids"],
        settings=read_algorithm_settings({"gamma": 1.0, "lam": 1.0, "group_params": {"boundary_rule": rule}}))
        for rule in ("turn", "fixed")}
    runs = [turns(r["row"]["response_mask"]) for r in recorded]
    lengths = [len(turn) for response in runs for turn in response]
    cap = GroupParams().group_max_size
    assert max(lengths) > cap  # the recorded step has a turn longer than the default cap
    turn = outs["turn"]
    assert turn.metrics["group/num_groups"] == len(lengths)
    assert turn.metrics["group/max_group_size"] == max(lengths)
    for b, response in enumerate(runs):
        for k, run in enumerate(response, start=1):
            assert turn.group_ids[b, run].tolist() == [k] * len(run)  # the turn is group k, whole
    fixed = outs["fixed"]
    assert fixed.metrics["group/num_groups"] == sum(math.ceil(n / cap) for n in lengths) > len(lengths)
    assert fixed.metrics["group/max_group_size"] == cap
    assert not torch.equal(fixed.group_ids, turn.group_ids)
    assert not torch.equal(fixed.advantages, turn.advantages)


# ------------------------------------------------------------------------------------------- a fresh run

# the tool task on the tiny model, briefly warm-started: enough to open its turns with a call, not to be right
TOOL_TINY = prep.PrepareSettings(variant="tools", response_length=96, model_size="tiny", warmstart_steps=150,
                                 warmstart_batch_size=32, n_train=2000, n_test=32, min_sampled_accuracy=0.0,
                                 min_call_rate=0.0)


@pytest.fixture(scope="session")
def tool_task(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cpu_tiny_tools")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only wait on each other when the cores are busy
    try:
        prep.prepare(str(path), TOOL_TINY, log=lambda m: None)
    finally:
        torch.set_num_threads(threads)
    return path



@pytest.mark.slow
def test_multiturn_main_ppo_two_steps_through_verls_tool_agent_loop(tool_task, tmp_path):
    """verl's main_ppo with the tool agent loop for 2 steps: num_turns/* and group/* logged, and the checks
    above hold on the fresh dump."""
    from test_cpu_e2e import SMALL, summarize_log

    dump = tmp_path / "dump"
    env = {**os.environ, "WORK_DIR": str(tool_task), "PYTHON": sys.executable, "MULTI_TURN": "1", "PREPARE": "0",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(["bash", str(REPO / "examples" / "cpu" / "common.sh"), "group_ppo", *SMALL,
                           f"trainer.rollout_data_dir={dump}"], env=env, capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    steps = summarize_log.parse_step_metrics(output)
    assert sorted(steps) == [1, 2]
    assert max(m["num_turns/max"] for m in steps.values()) >= 3
    assert all("group/num_groups" in m and "group/threshold" in m for m in steps.values())
    for step in (1, 2):
        records = load_records(dump / f"{step}.groups.jsonl")
        assert len(records) == 32
        for check in CHECKS:
            check(records)
        check_the_run_computed_what_the_core_computes(records, GroupParams())


# ------------------------------------------------------------------------------------------- value sources


def test_multiturn_prefix_tree_on_the_recorded_masks_counts_tool_replies_in_the_prefix(recorded):
    """value_source=prefix_tree on verl's real tool-loop rows: the tree is built over every position a reply has
    (tool replies included: they are part of the state), tool tokens still get no advantage, and a turn stays
    whole under the turn rule."""
    from verl_group_ppo.values import prefix_tree_values
    from verl_group_ppo_testutils_reference import loop_prefix_tree_values

    records = recorded[:8]  # two prompts' replies: the loop reference is O(B^2 T^2)
    batch = as_batch(records)
    lengths = [len(r["row"]["response_mask"]) for r in records]
    width = batch["response_mask"].shape[1]
    exists = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    ids = batch["response_ids"].long() * exists
    scores = batch["token_level_rewards"].sum(dim=1)
    values = prefix_tree_values(ids, exists, scores, batch["uids"])
    want = loop_prefix_tree_values(ids.tolist(), exists.tolist(), scores.tolist(), batch["uids"])
    assert torch.allclose(values, torch.tensor(want, dtype=values.dtype), rtol=0, atol=1e-12)

    settings = read_algorithm_settings({"gamma": 1.0, "lam": 1.0, "group_params": {
        "value_source": "prefix_tree", "boundary_rule": "turn"}})
    out = compute_group_ppo_outputs(batch["token_level_rewards"], batch["response_mask"], values=values,
                                    settings=settings, index=batch["uids"])
    holes = (exists == 1) & (batch["response_mask"] == 0)
    assert holes.any(), "the recorded rows should hold tool replies"
    assert (out.advantages[holes] == 0).all() and (out.advantages[exists == 0] == 0).all()
    for b, mask_row in enumerate(batch["response_mask"].tolist()):
        for run in turns(mask_row[: lengths[b]]):
            assert len(set(out.group_ids[b, run].tolist())) == 1  # one group per turn


@pytest.mark.slow
def test_multiturn_prefix_tree_two_steps_through_verls_tool_agent_loop_without_a_critic_worker(tool_task, tmp_path):
    """value_source=prefix_tree through main_ppo, in verl's tool agent loop, with the launcher's groups for it (the
    fixed rule at the spec's value_group_size, 4 tokens). One run checks both:

    * prefix_tree trains without a critic: verl builds no critic worker (need_critic is false), no critic update
      runs, the start-up line names value_source=prefix_tree and boundary_rule=fixed, groups hold at most 4 tokens
      and a reply has more than one, and no mc metric is logged;
    * on the tool loop's rows: tool replies are the mask's holes, get no advantage and no critic loss, every turn
      ends a group (the fixed rule cuts within a turn, never across one), and the run's advantages are the core's
      on the tree's values (the dump holds the values the estimator read). The turn rule on prefix_tree values
      over the tool loop's masks: test_multiturn_prefix_tree_on_the_recorded_masks_counts_tool_replies_in_the_prefix.
    """
    from test_cpu_e2e import SMALL, _worker_groups, assert_trained, summarize_log

    dump = tmp_path / "dump"
    env = {**os.environ, "WORK_DIR": str(tool_task), "PYTHON": sys.executable, "MULTI_TURN": "1", "PREPARE": "0",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(["bash", str(REPO / "examples" / "cpu" / "common.sh"), "group_ppo", *SMALL,
                           f"trainer.default_local_dir={tmp_path / 'ckpt'}", f"trainer.rollout_data_dir={dump}",
                           "++algorithm.group_params.value_source=prefix_tree"],
                          env=env, capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    steps = summarize_log.parse_step_metrics(output)
    assert_trained(steps, [1, 2], critic=False)
    groups = _worker_groups(output)
    assert groups and not any("critic" in g for g in groups), groups
    assert "value_source=prefix_tree" in output and "boundary_rule=fixed" in output
    for step, m in steps.items():
        assert m["group/max_group_size"] <= 4 and m["group/groups_per_response"] > 1, (step, m)
        assert not any(k.startswith("group/mc_") for k in m), (step, sorted(m))
    params = GroupParams(value_source="prefix_tree", boundary_rule="fixed", group_max_size=4)
    for step in (1, 2):
        records = load_records(dump / f"{step}.groups.jsonl")
        check_holes_are_tool_replies(records)
        check_tool_tokens_get_no_advantage_and_no_critic_loss(records)
        check_every_turn_ends_a_group(records)
        check_the_run_computed_what_the_core_computes(records, params)
