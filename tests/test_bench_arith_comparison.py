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
from verl_group_ppo.tasks.maths.spec import ARITH  # noqa: E402

SOURCES = B.SOURCES
MIDDLE = ARITH.test_freq  # the launcher validates in the middle; the comparison's runs do not


def steps(val: tuple[float, float, float] = (0.1, 0.15, 0.2), reward=lambda s: 0.3, ev=None,
          answered: float = 0.9) -> dict[int, dict[str, float]]:
    """A launcher run's ``{step: metrics}``: every source at accuracy ``val[i]`` at step 0, the middle and the end."""
    out: dict[int, dict[str, float]] = {0: {}}
    for s in range(1, B.STEPS + 1):
        out[s] = {"critic/score/mean": reward(s), "critic/score/max": 1.0, "critic/score/min": 0.0,
                  "timing_s/step": 10.0, "timing_s/gen": 6.0}
        if ev is not None:
            out[s][B.EV] = ev(s)
    for s, v in zip((0, MIDDLE, B.STEPS), val):
        out[s].update({B.VAL.format(src): v for src in SOURCES} | {B.ANSWERED.format(src): answered for src in SOURCES})
    for s in (MIDDLE, B.STEPS):
        out[s]["timing_s/testing"] = 4.0
    return out


def validation(val: float, answered: float = 0.9) -> dict[str, float]:
    return {B.VAL.format(src): val for src in SOURCES} | {B.ANSWERED.format(src): answered for src in SOURCES}


def record(arm: str, seed: int, val_after: float = 0.2, **kwargs) -> dict:
    """An arm's record as the sweep keeps it: steps 1..STEPS, validated after the last only."""
    data = steps(val=(0.0, 0.0, val_after), **kwargs)
    del data[0]
    data[MIDDLE] = {k: v for k, v in data[MIDDLE].items() if not k.startswith("val-") and k != "timing_s/testing"}
    return {"arm": arm, "estimator": B.ARMS[arm][0], "seed": seed, "steps_planned": B.STEPS,
            "steps": {str(s): m for s, m in data.items()}}


def start_record(val: float = 0.1) -> dict:
    return {"arm": "start", "estimator": "grpo", "seed": 0, "steps_planned": 0, "steps": {"0": validation(val)}}


def test_counts_follow_the_test_split_and_pooling_weights_modules_by_them():
    from verl_group_ppo.tasks.maths import arith
    from verl_group_ppo.tasks.maths.prepare import PrepareSettings
    from verl_group_ppo.tasks.maths.task import arith_data_source

    modules = PrepareSettings().modules.split(",")
    drawn = Counter(arith_data_source(q.module) for q in arith.draw(modules, B.N_TEST, 0))
    assert B.COUNTS == dict(drawn) and list(B.COUNTS.values()) == [342, 341, 341] and B.N_TEST == 1024
    assert list(B.counts(512).values()) == [171, 171, 170]
    a, b, c = SOURCES
    assert B.pooled({a: 1.0, b: 0.0, c: 0.0}) == pytest.approx(342 / 1024)
    assert B.pooled({a: 0.0, b: 0.0, c: 1.0}, 512) == pytest.approx(170 / 512)
    s = B.summarise(steps())
    assert sorted(s["val"]) == [0, MIDDLE, B.STEPS] and s["val"][B.STEPS]["pooled"] == pytest.approx(0.2)


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
    assert s["timing"]["timing_s/testing"] == (4.0, [MIDDLE, B.STEPS])
    assert B.summarise(steps())["ev"] is None  # no critic


def test_the_plan_validates_the_start_once_then_runs_every_arm_of_a_seed_before_the_next_seed():
    start, *runs = B.sweep().runs
    assert start == B.START
    assert [(r.arm, r.seed) for r in runs[:4]] == [(arm, 0) for arm in B.ARMS]
    assert [r.seed for r in runs] == sorted(r.seed for r in runs) and len(runs) == 4 * 3
    assert list(B.ARMS) == ["group_ppo", "gae", "grpo", "group_ppo_prefix_tree"]


def test_launch_arguments_of_the_prefix_tree_arm_and_the_others():
    args = B.launch(benchlib.Run("group_ppo_prefix_tree", 2), "runs/cpu-arith")
    assert args["estimator"] == "group_ppo" and args["steps"] == B.STEPS
    assert args["env"] == {"TASK": "arith", "WORK_DIR": "runs/cpu-arith", "VALUE_SOURCE": "prefix_tree"}
    assert args["overrides"] == ["data.seed=2", "actor_rollout_ref.rollout.seed=2", "trainer.val_before_train=False",
                                 f"trainer.test_freq={B.STEPS}",
                                 "trainer.experiment_name=arith_comparison_group_ppo_prefix_tree_seed2"]
    assert not any("total_training_steps" in o for o in args["overrides"])
    assert args["log_path"].endswith("runs/arith/comparison/group_ppo_prefix_tree-seed2.log")
    for arm in ("group_ppo", "gae", "grpo"):
        args = B.launch(benchlib.Run(arm, 0), "w")
        assert args["estimator"] == arm and args["env"]["VALUE_SOURCE"] == ""
    args = B.launch(B.START, "w")
    assert args["estimator"] == "grpo" and args["steps"] == 0 and args["env"]["VALUE_SOURCE"] == ""
    assert "trainer.val_only=True" in args["overrides"] and "trainer.val_before_train=True" in args["overrides"]


def test_accept_asks_the_start_for_step_0_and_an_arm_for_its_last_step():
    assert B.accept(start_record()) and B.accept(record("gae", 0))
    assert not B.accept({**start_record(), "steps": {"0": {}}})  # the validation is missing
    assert not B.accept({**start_record(), "steps_planned": B.STEPS})
    short = record("gae", 0)
    del short["steps"][str(B.STEPS)]
    assert not B.accept(short) and not B.accept({**record("gae", 0), "steps_planned": B.STEPS - 1})


def log_text(data: dict[int, dict[str, float]]) -> str:
    lines = ["(TaskRunner pid=1) some other line"]
    for s, m in data.items():
        lines.append(f"(TaskRunner pid=1) step:{s} - " + " - ".join(f"{k}:np.float64({v})" for k, v in m.items()))
    return "\n".join(lines) + "\n"


def test_a_record_holds_no_machine_path_and_keeps_the_reports_metrics(tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, env, stdout, **kwargs):
        calls.append((cmd, env))
        data = {int(k): m for k, m in record("gae", 0, ev=lambda s: 0.1)["steps"].items()}
        data[1]["actor/pg_loss"] = 1.0  # not kept
        stdout.write(log_text(data if "trainer.total_training_steps=0" not in cmd else {0: validation(0.1)}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(benchlib.subprocess, "run", fake_run)
    monkeypatch.setattr(B, "RUNS", str(tmp_path / "runs"))
    with pytest.raises(SystemExit, match="--work-dir .*data/prepare.json is missing or has no n_test"):
        B.run_one(benchlib.Run("gae", 0), str(tmp_path / "work"))
    calls.clear()
    (tmp_path / "work" / "data").mkdir(parents=True)
    (tmp_path / "work" / "data" / "prepare.json").write_text(json.dumps({"n_test": 512}))
    rec = B.run_one(benchlib.Run("group_ppo_prefix_tree", 1), str(tmp_path / "work"))
    assert rec["n_test"] == 512  # the prepared task's, not the package default
    cmd, env = calls[0]
    assert cmd[2] == "group_ppo" and env["VALUE_SOURCE"] == "prefix_tree" and env["TASK"] == "arith"
    assert benchlib.machine_paths(rec) == [] and json.loads(json.dumps(rec)) == rec
    assert rec["command"].startswith("TASK=arith WORK_DIR=") and "VALUE_SOURCE=prefix_tree" in rec["command"]
    assert "actor/pg_loss" not in rec["steps"]["1"] and B.EV in rec["steps"]["1"]
    assert B.VAL.format(SOURCES[0]) in rec["steps"][str(B.STEPS)] and "0" not in rec["steps"] and B.accept(rec)
    start = B.run_one(B.START, str(tmp_path / "work"))
    assert start["steps_planned"] == 0 and list(start["steps"]) == ["0"] and B.accept(start)
    assert calls[1][0][2] == "grpo" and "trainer.val_only=True" in calls[1][0]


def pair_row(text: str, pair: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"| {pair} |"))


def test_pair_verdicts_win_level_and_missing_seeds_listed():
    gae = [record("gae", s, val_after=0.2, reward=lambda t: 0.3) for s in B.SEEDS]
    ours = [record("group_ppo", s, val_after=0.3 + 0.01 * s, reward=lambda t, s=s: 0.3 + 0.01 * (s - 1))
            for s in B.SEEDS]
    text = B.report([start_record(0.1), *gae, *ours])
    row = pair_row(text, "group_ppo-gae").split(" | ")
    assert row[1].startswith("+0.110") and row[1].endswith("(3 seeds, win)")  # val after
    assert row[2].endswith("(3 seeds, level)")  # reward, last 4: -0.01, 0, +0.01
    assert pair_row(text, "group_ppo-grpo").endswith("| n/a | n/a | n/a | grpo seed 0, grpo seed 1, grpo seed 2 |")
    assert pair_row(text, "gae seed 1").split(" | ")[1:4] == ["0.100", "0.200", "+0.100"]  # the start's step 0
    assert text.startswith("start (every run's step 0): pooled 0.100, answered 0.90; mul_add 0.100, mul_sub 0.100")
    text = B.report([start_record(0.1), *gae, *ours[:2]])
    row = pair_row(text, "group_ppo-gae")
    assert "win" not in row and "no verdict" in row and row.endswith("| group_ppo seed 2 |")
    assert "group_ppo seed 2" in text.split("missing runs:")[1]
    arm = pair_row(text, "gae").split(" | ")
    assert arm[1:5] == ["0, 1, 2", "0.100", "0.200", "0.200"]
    text = B.report(gae)  # no start record: the rise is not known, and the start is listed as missing
    assert pair_row(text, "gae seed 0").split(" | ")[1] == "nan" and "start seed 0" in text.split("missing runs:")[1]


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
    assert f"4.0 s at steps {MIDDLE}, {B.STEPS}" in text and "| timing_s/testing |" not in text
