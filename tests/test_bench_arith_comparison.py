"""The arith comparison without its runs: pooled accuracy, the rise's SE test, the plan and each run's launcher
arguments, a record through benchlib's launcher with a fake process, the pairs' verdicts, and --log."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_arith_comparison as B  # noqa: E402
import benchlib  # noqa: E402

SOURCES = B.SOURCES


def steps(val: tuple[float, float, float] = (0.1, 0.15, 0.2), reward=lambda s: 0.3, ev=None,
          answered: float = 0.9) -> dict[int, dict[str, float]]:
    """A run's ``{step: metrics}``: every source at accuracy ``val[i]`` at step 0, the middle and the end."""
    out: dict[int, dict[str, float]] = {0: {}}
    for s in range(1, B.STEPS + 1):
        out[s] = {"critic/score/mean": reward(s), "critic/score/max": 1.0, "critic/score/min": 0.0,
                  "timing_s/step": 10.0, "timing_s/gen": 6.0}
        if ev is not None:
            out[s][B.EV] = ev(s)
    for s, v in zip((0, B.MIDDLE, B.STEPS), val):
        out[s].update({B.VAL.format(src): v for src in SOURCES} | {B.ANSWERED.format(src): answered for src in SOURCES})
    for s in (B.MIDDLE, B.STEPS):
        out[s]["timing_s/testing"] = 4.0
    return out


def record(arm: str, seed: int, **kwargs) -> dict:
    return {"arm": arm, "estimator": B.ARMS[arm][0], "seed": seed, "steps_planned": B.STEPS,
            "steps": {str(s): m for s, m in steps(**kwargs).items()}}


def test_counts_follow_the_test_split_and_pooling_weights_modules_by_them():
    from verl_group_ppo.mathtask import arith
    from verl_group_ppo.mathtask.prepare import PrepareSettings
    from verl_group_ppo.mathtask.task import arith_data_source

    modules = PrepareSettings().modules.split(",")
    drawn = Counter(arith_data_source(q.module) for q in arith.draw(modules, B.N_TEST, 0))
    assert B.COUNTS == dict(drawn) and list(B.COUNTS.values()) == [342, 341, 341] and B.N_TEST == 1024
    assert list(B.counts(512).values()) == [171, 171, 170]
    a, b, c = SOURCES
    assert B.pooled({a: 1.0, b: 0.0, c: 0.0}) == pytest.approx(342 / 1024)
    assert B.pooled({a: 0.0, b: 0.0, c: 1.0}, 512) == pytest.approx(170 / 512)
    s = B.summarise(steps())
    assert sorted(s["val"]) == [0, B.MIDDLE, B.STEPS] and s["val"][B.STEPS]["pooled"] == pytest.approx(0.2)


def test_the_rise_is_measured_in_binomial_standard_errors_of_the_difference():
    diff, se, flag = B.rise(0.10, 0.15, 512)
    assert diff == pytest.approx(0.05) and se == pytest.approx(math.sqrt((0.09 + 0.1275) / 512))
    assert flag == "yes"  # 0.05 > 2 x 0.0206
    assert B.rise(0.10, 0.13, 512)[2] == "no" and B.rise(0.15, 0.10, 512)[2] == "drop"
    assert B.rise(0.10, 0.125, 1024)[2] == "no" and B.rise(0.10, 0.13, 1024)[2] == "yes"  # more questions, smaller SE


def test_reward_windows_ev_over_the_second_half_of_varying_batches_and_step_time():
    ev = {s: (-1.0 if s <= B.STEPS // 2 else 0.5) for s in range(1, B.STEPS + 1)}
    ev[B.STEPS] = 9.0
    data = steps(reward=lambda s: s / 100, ev=ev.get)
    data[B.STEPS]["critic/score/max"] = 0.0  # every reward equal: its EV is left out
    s = B.summarise(data)
    assert s["first"] == pytest.approx(0.025) and s["last"] == pytest.approx((B.STEPS - 1.5) / 100)
    assert s["area"] == pytest.approx((B.STEPS + 1) / 200) and s["ev"] == 0.5
    assert s["timing"]["timing_s/step"] == (10.0, list(range(1, B.STEPS + 1)))
    assert s["timing"]["timing_s/testing"] == (4.0, [B.MIDDLE, B.STEPS])
    assert B.summarise(steps())["ev"] is None  # no critic


def test_the_plan_runs_every_arm_of_a_seed_before_the_next_seed():
    runs = B.sweep().runs
    assert [(r.arm, r.seed) for r in runs[:4]] == [(arm, 0) for arm in B.ARMS]
    assert [r.seed for r in runs] == sorted(r.seed for r in runs) and len(runs) == 4 * 3
    assert list(B.ARMS) == ["group_ppo", "gae", "grpo", "group_ppo_prefix_tree"]


def test_launch_arguments_of_the_prefix_tree_arm_and_the_others():
    args = B.launch(benchlib.Run("group_ppo_prefix_tree", 2), "runs/cpu-arith")
    assert args["estimator"] == "group_ppo" and args["steps"] == B.STEPS
    assert args["env"] == {"TASK": "arith", "WORK_DIR": "runs/cpu-arith", "VALUE_SOURCE": "prefix_tree"}
    assert args["overrides"] == ["data.seed=2", "actor_rollout_ref.rollout.seed=2",
                                 "trainer.experiment_name=arith_comparison_group_ppo_prefix_tree_seed2"]
    assert not any("total_training_steps" in o or "test_freq" in o for o in args["overrides"])
    assert args["log_path"].endswith("runs/arith/comparison/group_ppo_prefix_tree-seed2.log")
    for arm in ("group_ppo", "gae", "grpo"):
        args = B.launch(benchlib.Run(arm, 0), "w")
        assert args["estimator"] == arm and args["env"]["VALUE_SOURCE"] == ""


def log_text(data: dict[int, dict[str, float]]) -> str:
    lines = ["(TaskRunner pid=1) some other line"]
    for s, m in data.items():
        lines.append(f"(TaskRunner pid=1) step:{s} - " + " - ".join(f"{k}:np.float64({v})" for k, v in m.items()))
    return "\n".join(lines) + "\n"


def test_a_record_holds_no_machine_path_and_keeps_the_reports_metrics(tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, env, stdout, **kwargs):
        calls.append((cmd, env))
        data = steps(ev=lambda s: 0.1)
        data[1]["actor/pg_loss"] = 1.0  # not kept
        stdout.write(log_text(data))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(benchlib.subprocess, "run", fake_run)
    monkeypatch.setattr(B, "RUNS", str(tmp_path / "runs"))
    rec = B.run_one(benchlib.Run("group_ppo_prefix_tree", 1), str(tmp_path / "work"))
    cmd, env = calls[0]
    assert cmd[2] == "group_ppo" and env["VALUE_SOURCE"] == "prefix_tree" and env["TASK"] == "arith"
    assert benchlib.machine_paths(rec) == [] and json.loads(json.dumps(rec)) == rec
    assert rec["command"].startswith("TASK=arith WORK_DIR=") and "VALUE_SOURCE=prefix_tree" in rec["command"]
    assert "actor/pg_loss" not in rec["steps"]["1"] and B.EV in rec["steps"]["1"]
    assert B.VAL.format(SOURCES[0]) in rec["steps"]["0"] and B.accept(rec)


def pair_row(text: str, pair: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"| {pair} |"))


def test_pair_verdicts_win_level_and_missing_seeds_listed():
    gae = [record("gae", s, val=(0.1, 0.1, 0.2), reward=lambda t: 0.3) for s in B.SEEDS]
    ours = [record("group_ppo", s, val=(0.1, 0.2, 0.3 + 0.01 * s), reward=lambda t, s=s: 0.3 + 0.01 * (s - 1))
            for s in B.SEEDS]
    text = B.report(gae + ours)
    row = pair_row(text, "group_ppo-gae").split(" | ")
    assert row[1].startswith("+0.110") and row[1].endswith("(3 seeds, win)")  # val after
    assert row[2].endswith("(3 seeds, level)")  # reward, last 4: -0.01, 0, +0.01
    assert pair_row(text, "group_ppo-grpo").endswith("| n/a | n/a | n/a | grpo seed 0, grpo seed 1, grpo seed 2 |")
    text = B.report(gae + ours[:2])
    row = pair_row(text, "group_ppo-gae")
    assert "win" not in row and "no verdict" in row and row.endswith("| group_ppo seed 2 |")
    assert "group_ppo seed 2" in text.split("missing runs:")[1]
    arm = pair_row(text, "gae").split(" | ")
    assert arm[1:6] == ["0, 1, 2", "0.100", "0.100", "0.200", "0.200"]


def test_log_summary_of_one_launcher_run(tmp_path, capsys):
    data = steps(val=(0.10, 0.12, 0.20), ev=lambda s: 0.2, answered=0.8)
    a, b, c = SOURCES
    data[B.STEPS][B.VAL.format(a)] = 0.4
    path = tmp_path / "arith_full.log"
    path.write_text(log_text(data))
    assert B.main(["--log", str(path), "--n-test", "512"]) == 0
    text = capsys.readouterr().out
    assert f"| {B.STEPS} | mul_add (171) | 0.400 | 0.800 | 0.500 |" in text
    pooled = (171 * 0.4 + 171 * 0.2 + 170 * 0.2) / 512
    assert f"| {B.STEPS} | pooled (512) | {pooled:.3f} | 0.800 | {pooled / 0.8:.3f} |" in text
    assert f"pooled accuracy, step 0 -> {B.STEPS}: 0.100 -> {pooled:.3f}" in text and "> 2 SE: yes" in text
    assert "first 4 steps 0.300" in text and "median over the second half (batches whose rewards differ): +0.20" in text
    assert "| timing_s/step | 16 | 10.00 | 100.0% |" in text and "| timing_s/gen | 16 | 6.00 | 60.0% |" in text
    assert f"4.0 s at steps {B.MIDDLE}, {B.STEPS}" in text and "| timing_s/testing |" not in text
