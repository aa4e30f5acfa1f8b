"""The value-source comparison's budgets report on synthetic records: the token and seconds budgets, the per-budget
rewards, the verdicts only with every planned seed, the speed sweep as an engine spec, and the speed table's ratios."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_tiny_value_sources as B  # noqa: E402
import compare  # noqa: E402

SPEC = compare.load_spec(compare.spec_path(B.SPEC))
STEPS = SPEC.steps
SEEDS = SPEC.arms["mc"].seeds


def record(arm: str, seed: int, reward, length=10.0, mc_tokens=0.0, seconds=2.0) -> dict:
    steps = {}
    for s in range(1, STEPS + 1):
        m = {"critic/score/mean": reward(s), "response_length/mean": length, "timing_s/step": seconds}
        if mc_tokens:
            m["group/mc_tokens"] = mc_tokens
        steps[str(s)] = m
    return {"arm": arm, "seed": seed, "steps_planned": STEPS, "steps": steps}


def test_reward_within_a_budget_takes_the_last_window_of_steps_that_fit():
    r = record("mc", 0, lambda s: float(s))
    costs = [10.0] * STEPS
    assert B.reward_within(r, costs, budget=70.0) == pytest.approx((3 + 4 + 5 + 6 + 7) / 5)
    assert B.reward_within(r, costs, budget=25.0) == pytest.approx((1 + 2) / 2)
    assert B.reward_within(r, costs, budget=5.0) == 1.0  # even step 1 is over: its reward
    assert B.reward_within(r, costs, budget=1e9) == pytest.approx(mean_last(r))


def mean_last(r):
    rewards = B.rewards(r)
    return sum(rewards[-B.WINDOW:]) / B.WINDOW


def test_mc_tokens_count_toward_the_token_budget_and_set_the_cut():
    cheap = record("grpo", 0, lambda s: 0.1 * s / STEPS)
    costly = record("mc", 0, lambda s: 0.5, mc_tokens=3 * 10.0 * 128)  # 4x grpo's tokens a step
    assert B.tokens_per_step(cheap)[0] == 10.0 * 128
    assert B.tokens_per_step(costly)[0] == 4 * 10.0 * 128
    rows = {r["arm"]: r for r in B.summaries([cheap, costly])}
    assert rows["grpo"]["at_tokens"] == pytest.approx(rows["grpo"]["final"])  # the cheapest run sets the budget
    # the mc run is cut after a quarter of its steps
    assert rows["mc"]["tokens"] == 4 * rows["grpo"]["tokens"]


def test_budget_verdicts_only_with_every_planned_seed():
    records = [record(arm, seed, (lambda s, a=arm: 0.6 if a == "mc" else 0.4)) for arm in ("mc", "group_ppo")
               for seed in SEEDS[:2]]
    text = B.report_budgets(SPEC, records)
    assert f"no verdict before {len(SEEDS)}" in text.split("| mc-group_ppo |")[1].splitlines()[0]
    records = [record(arm, seed, (lambda s, a=arm, k=seed: (0.6 if a == "mc" else 0.4) + 0.01 * k))
               for arm in ("mc", "group_ppo") for seed in SEEDS]
    row = B.report_budgets(SPEC, records).split("| mc-group_ppo |")[1].splitlines()[0]
    assert row.count("win") == 2  # both budgets: +0.2 on every seed


def test_a_level_budget_verdict_reads_not_measurable_when_the_detectable_difference_exceeds_half_the_rise():
    # flat runs (no rise) whose per-seed differences change sign: level by the rule, nothing to measure against
    records = [record(arm, seed, (lambda s, a=arm, k=seed: 0.4 + (0.02 if (a == "mc") == (k % 2 == 0) else 0.0)))
               for arm in ("mc", "group_ppo") for seed in SEEDS]
    row = B.report_budgets(SPEC, records).split("| mc-group_ppo |")[1].splitlines()[0]
    assert row.count("not measurable") == 2 and "rise +0.000" in row and "detectable 0.0" in row


def test_the_speed_sweep_is_the_specs_speed_arms_at_seed_0_twice_each_in_alternation():
    speed = B.speed_spec(SPEC)
    assert speed.runs() == [(arm, r) for r in (0, 1) for arm in B.SPEED_ARMS]
    args, _ = compare.command(speed, "mc", 1, "ckpt")
    assert "data.seed=0" in args and f"trainer.total_training_steps={B.SPEED_STEPS}" in args
    assert "++algorithm.group_params.value_source=mc" in args  # the arm's own overrides, from the spec


def test_speed_table_gives_ratios_to_gae():
    records = [record("gae", 0, lambda s: 0.5, seconds=2.0), record("mc", 0, lambda s: 0.5, seconds=5.0)]
    for r in records:
        r["steps_planned"] = B.SPEED_STEPS
    text = B.report_speed(records)
    assert "| gae | 2.00 | 1.00 |" in text and "| mc | 5.00 | 2.50 |" in text
