"""The comparison engine (benchmarks/compare.py): specs, resumable runs, a stalled run killed and recorded as
failed, and the report on the committed records. A fake launcher stands in for main_ppo."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import compare  # noqa: E402

FAKE_LAUNCHER = textwrap.dedent('''
    """A stand-in for main_ppo: logs verl-style step lines; STALL=1 logs one step, then waits forever; STALL=heartbeat
    logs one step, then only the agent loop's status line, forever."""
    import os, sys, time
    args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
    steps, seed, gain = int(args["trainer.total_training_steps"]), int(args["data.seed"]), float(args.get("+gain", 0))
    for s in range(1, steps + 1):
        print(f"step:{s} - critic/score/mean:{0.1 * s + gain + 0.001 * seed} - timing_s/step:1.0", flush=True)
        if os.environ.get("STALL") == "1":
            time.sleep(3600)
        while os.environ.get("STALL") == "heartbeat":  # what verl's agent loop prints while it waits forever
            print("(TaskRunnerV1 pid=1) INFO:pending: 0, running: 16, finished: 16, failure: 0", flush=True)
            time.sleep(0.2)
        if os.environ.get("FAIL") == "oom":  # Ray's memory monitor kills a worker: the driver exits 1
            print("ray.exceptions.OutOfMemoryError: 5 worker(s) were killed due to the node running low on memory.")
            sys.exit(1)
''')


def write_spec(tmp_path: Path, results: str, **extra) -> Path:
    fake = tmp_path / "fake_launcher.py"
    fake.write_text(FAKE_LAUNCHER)
    spec = {"description": "a fake comparison", "results": results, "steps": 3, "seeds": [0, 1, 2],
            "overrides": ["data.seed={seed}"],
            "arms": {"better": {"launcher": f"{sys.executable} {fake}", "overrides": ["+gain=0.05"]},
                     "base": {"launcher": f"{sys.executable} {fake}"}},
            "pairs": [["better", "base"]],
            "metrics": {"first": {"key": "critic/score/mean", "window": "first", "steps": 1, "compare": False},
                        "last": {"key": "critic/score/mean", "window": "last", "steps": 1, "rise_from": "first"}},
            **extra}
    path = tmp_path / "fake.json"
    path.write_text(json.dumps(spec))
    return path


@pytest.fixture
def results(tmp_path, monkeypatch):
    """Records under tmp_path: the engine's repository root points there."""
    monkeypatch.setattr(compare, "REPO", tmp_path)
    return "results/fake"


def fake_record(spec, arm, seed, runs_dir, gain=0.0, status="ok"):
    return {"spec": spec.name, "arm": arm, "seed": seed, "steps_planned": spec.steps, "status": status,
            "reason": None if status == "ok" else "exit code 1", "command": "fake", "seconds": 0.0,
            "steps": {str(s): {"critic/score/mean": 0.1 * s + gain + 0.001 * seed} for s in range(1, spec.steps + 1)}}


def test_committed_specs_load_and_are_listed():
    names = [name for name, _ in compare.list_specs()]
    assert {"arith", "tiny_value_sources", "twoway", "bench_validation", "first_comparison", "tree_comparison",
            "tree_settings", "tree_per_row"} <= set(names)
    arith = compare.load_spec(compare.spec_path("arith"))
    assert arith.runs()[0] == ("start", 0)  # the shared validation before training runs first
    assert arith.runs()[1:5] == [("group_ppo", 0), ("gae", 0), ("grpo", 0), ("group_ppo_prefix_tree", 0)]


@pytest.mark.parametrize("change, field", [
    ({"steps": -1}, "steps"),
    ({"arms": {}}, "arms"),
    ({"pairs": [["better", "nobody"]]}, "pairs"),
    ({"metrics": {"m": {"key": "x", "window": "middle"}}}, "metrics.m.window"),
    ({"metrics": {"m": {"key": "x", "window": "all", "rise_from": "nothing"}}}, "metrics.m.rise_from"),
    ({"results": "/abs/path"}, "results"),
    ({"arms": {"a": {"launcher": "x", "seed_offset": "one"}}}, "arms.a.seed_offset"),
    ({"arms": {"a": {"from": "b"}, "b": {"launcher": "x"}}}, "arms.a.from"),
    ({"base": "no_such_spec"}, "base"),
])
def test_a_bad_spec_names_its_field(tmp_path, change, field):
    path = write_spec(tmp_path, "results/fake")
    data = {**json.loads(path.read_text()), **change}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=f"^{field}"):
        compare.load_spec(path)


def test_a_spec_on_a_base_takes_its_regime_and_an_arm_from_another_adds_to_it(tmp_path):
    base = json.loads(write_spec(tmp_path, "results/base", env={"WORK_DIR": "w"}).read_text())
    base["overrides"] = ["data.seed={seed}", "trainer.experiment_name={spec}_{arm}"]
    base["arms"]["better"]["env"] = {"A": "1"}
    (tmp_path / "regime.json").write_text(json.dumps(base))
    derived = {"description": "on the regime", "base": "regime", "results": "results/derived", "seeds": [5],
               "steps": 7, "arms": {"b": {"from": "better", "overrides": ["+x=1"], "env": {"B": "2"}},
                                    "c": {"from": "b", "overrides": ["+y=2"]}},
               "pairs": [["c", "b"]]}
    (tmp_path / "derived.json").write_text(json.dumps(derived))
    spec = compare.load_spec(tmp_path / "derived.json")
    assert spec.steps == 7 and spec.env == {"WORK_DIR": "w"} and set(spec.metrics) == {"first", "last"}
    assert spec.runs() == [("b", 5), ("c", 5)]  # this spec's seeds, not the base arm's or the base's
    assert spec.arms["b"].overrides == ("+gain=0.05", "+x=1") and spec.arms["b"].env == {"A": "1", "B": "2"}
    assert spec.arms["c"].overrides == ("+gain=0.05", "+x=1", "+y=2") and spec.arms["c"].env == {"A": "1", "B": "2"}
    args, _ = compare.command(spec, "c", 5, "ckpt")
    assert "trainer.experiment_name=derived_c" in args and "trainer.total_training_steps=7" in args
    base["base"] = "derived"  # a base of a base is refused
    (tmp_path / "regime.json").write_text(json.dumps(base))
    with pytest.raises(ValueError, match="^base"):
        compare.load_spec(tmp_path / "derived.json")


def test_an_arm_can_read_the_records_of_another_spec_that_runs_the_same_command(tmp_path, results):
    source = json.loads(write_spec(tmp_path, "results/source").read_text())
    source["overrides"] = ["data.seed={seed}", "trainer.experiment_name={spec}_{arm}"]
    source["start"] = {"launcher": source["arms"]["base"]["launcher"], "overrides": ["data.seed=0"]}
    (tmp_path / "source.json").write_text(json.dumps(source))
    reader = {"description": "reads base", "base": "source", "results": "results/reader", "seeds": [0, 1],
              "arms": {"new": {"from": "better", "overrides": ["+x=1"]}, "base": {"records_of": "source"},
                       "more": {"from": "base", "overrides": ["+y=2"]}},
              "pairs": [["new", "base"]]}
    (tmp_path / "reader.json").write_text(json.dumps(reader))
    spec = compare.load_spec(tmp_path / "reader.json")
    assert spec.arms["base"].records_of == "source" and spec.arms["base"].seeds == (0, 1)
    assert spec.path("base", 1) == tmp_path / "results/source/base-seed1.json"
    assert spec.path("start", 0) == tmp_path / "results/source/start-seed0.json"  # the base's start run, read
    assert spec.arms["more"].overrides == ("+y=2",) and not spec.arms["more"].records_of  # from a read arm: runs
    assert compare.pending(spec) == [("new", 0), ("more", 0), ("new", 1), ("more", 1)]  # the source spec runs "base"
    source_spec = compare.load_spec(tmp_path / "source.json")
    for seed in (0, 1):
        compare.write_json(source_spec.path("base", seed), fake_record(source_spec, "base", seed, tmp_path))
        compare.write_json(spec.path("new", seed), fake_record(spec, "new", seed, tmp_path, gain=0.05))
    assert "| new - base | last | +0.050 |" in compare.report(spec)
    for change, field in (({"steps": 4}, "arms.base.records_of"),  # another command: not the same runs
                          ({"arms": {**reader["arms"], "base": {"records_of": "reader"}}}, "arms.base.records_of"),
                          ({"arms": {**reader["arms"], "gone": {"records_of": "source"}}}, "arms.gone.records_of"),
                          ({"seeds": [0, 7]}, "arms.base.seeds")):
        (tmp_path / "reader.json").write_text(json.dumps({**reader, **change}))
        with pytest.raises(ValueError, match=f"^{field}"):
            compare.load_spec(tmp_path / "reader.json")


def test_resume_skips_finished_runs_and_workers_split_the_plan(tmp_path, results):
    spec = compare.load_spec(write_spec(tmp_path, results))
    ran: list[tuple[str, int]] = []

    def runner(spec, arm, seed, runs_dir):
        ran.append((arm, seed))
        return fake_record(spec, arm, seed, runs_dir)

    first = compare.pending(spec, worker=(1, 2))
    second = compare.pending(spec, worker=(2, 2))
    assert sorted(first + second) == sorted(spec.runs()) and not set(first) & set(second)
    assert compare.run_spec(spec, (1, 2), runner=runner, log=lambda m: None) == len(first)
    assert compare.run_spec(spec, (1, 2), runner=runner, log=lambda m: None) == 0  # resumed: nothing left
    assert compare.run_spec(spec, (1, 1), runner=runner, log=lambda m: None) == len(second)
    assert sorted(ran) == sorted(spec.runs())
    compare.write_json(spec.path("base", 2), fake_record(spec, "base", 2, None, status="failed"))
    assert compare.pending(spec) == [] and compare.pending(spec, retry_failed=True) == [("base", 2)]


def test_report_gives_verdicts_detectable_differences_rises_and_failed_runs(tmp_path, results):
    spec = compare.load_spec(write_spec(tmp_path, results))
    jitter = {0: 0.0, 1: 0.01, 2: -0.005}
    for seed in (0, 1, 2):
        compare.write_json(spec.path("better", seed), fake_record(spec, "better", seed, None, 0.05 + jitter[seed]))
        compare.write_json(spec.path("base", seed), fake_record(spec, "base", seed, None))
    vals = compare.values(spec, compare.records(spec))
    pair = compare.compare_pair(spec, vals, "better", "base", "last")
    assert pair["per_seed"] == pytest.approx([0.05, 0.06, 0.045])
    assert pair["verdict"] == "win" and pair["rise"] == pytest.approx(0.2)
    assert pair["detectable"] == pytest.approx(compare.detectable_of(pair["per_seed"]))
    compare.write_json(spec.path("base", 2), fake_record(spec, "base", 2, None, status="failed"))
    text = compare.report(spec)
    assert "| better - base | last | +0.055 |" in text and "no verdict (2 of 3 seeds)" in text
    assert "failed runs: base seed 2 (exit code 1)" in text
    assert "| better - base | first |" not in text  # a start value stays out of the pairs


def _task_folder(root: Path, weights: bytes) -> Path:
    (root / "model").mkdir(parents=True)
    (root / "data").mkdir()
    (root / "model" / "model.safetensors").write_bytes(weights)
    (root / "data" / "train.parquet").write_bytes(b"rows")
    (root / "data" / "prepare.json").write_text(json.dumps({"test_accuracy": {"sampled": 0.4, "greedy": 0.9}}))
    return root


def test_a_record_names_its_task_build_and_a_pair_on_two_builds_gets_no_verdict(tmp_path, results):
    one, same, other = (_task_folder(tmp_path / name, w) for name, w in (("a", b"w1"), ("b", b"w1"), ("c", b"w2")))
    build = compare.task_build(f"noise\n[launcher] task: {one}\nstep:1 - x:1\n")
    assert build == {"fingerprint": compare.task_build(f"[launcher] task: {same}")["fingerprint"],
                     "warm_start": {"sampled": 0.4, "greedy": 0.9}}
    assert len(build["fingerprint"]) == 12 and compare.task_build(f"[launcher] task: {other}") != build
    assert compare.task_build("no launcher line") is None and compare.task_build(f"[launcher] task: {tmp_path}") is None
    spec = compare.load_spec(write_spec(tmp_path, results))
    for seed, gain in ((0, 0.05), (1, 0.06), (2, 0.045)):
        folders = {"better": one, "base": other if seed == 2 else same}
        for arm, g in (("better", gain), ("base", 0.0)):
            compare.write_json(spec.path(arm, seed), {**fake_record(spec, arm, seed, None, g),
                                                      "task": compare.task_build(f"[launcher] task: {folders[arm]}")})
    kept = compare.records(spec)
    assert compare.different_builds(kept, "better", "base") == [2]
    pair = compare.compare_pair(spec, compare.values(spec, kept), "better", "base", "last", kept)
    assert pair["verdict"] == "no verdict (task builds differ at seed 2)"
    kept[("base", 2)]["task"] = None  # a record that names no build pairs with any
    assert compare.compare_pair(spec, compare.values(spec, kept), "better", "base", "last", kept)["verdict"] == "win"


def test_a_sweep_refuses_to_add_runs_on_another_build_than_its_records(tmp_path, results):
    here, before = _task_folder(tmp_path / "here", b"w1"), _task_folder(tmp_path / "before", b"w2")
    spec = compare.load_spec(write_spec(tmp_path, results, env={"WORK_DIR": str(here)}))
    ran = []
    runner = lambda spec, arm, seed, runs_dir: ran.append((arm, seed)) or fake_record(spec, arm, seed, runs_dir)
    compare.write_json(spec.path("base", 0), {**fake_record(spec, "base", 0, None),
                                              "task": compare.folder_build(before)})
    with pytest.raises(SystemExit, match=f"holds build {compare.folder_build(here)['fingerprint']} .* made on "
                                         f"{compare.folder_build(before)['fingerprint']}"):
        compare.run_spec(spec, runner=runner, log=lambda m: None)
    assert ran == []
    compare.write_json(spec.path("base", 0), {**fake_record(spec, "base", 0, None), "task": compare.folder_build(here)})
    assert compare.run_spec(spec, runner=runner, log=lambda m: None) == 5 and len(ran) == 5


def test_report_reproduces_the_committed_arithmetic_verdicts():
    spec = compare.load_spec(compare.spec_path("arith"))
    vals = compare.values(spec, compare.records(spec))
    pair = compare.compare_pair(spec, vals, "group_ppo", "grpo", "val after")
    assert pair["mean"] == pytest.approx(-0.022, abs=5e-4) and pair["verdict"] == "lose"
    gae = compare.compare_pair(spec, vals, "group_ppo", "gae", "val after")
    assert gae["mean"] == pytest.approx(0.018, abs=5e-4) and gae["verdict"] == "not measurable"
    assert gae["detectable"] > gae["rise"] / 2


def test_the_command_fills_the_placeholders_and_the_start_run_takes_only_its_own_overrides():
    spec = compare.load_spec(compare.spec_path("arith"))
    args, env = compare.command(spec, "group_ppo_prefix_tree", 2, "ckpt")
    assert args[:4] == ["bash", "examples/cpu/common.sh", "group_ppo", "trainer.total_training_steps=16"]
    assert "data.seed=2" in args and "trainer.test_freq=16" in args and args[-1] == "trainer.default_local_dir=ckpt"
    assert env == {"TASK": "arith", "VALUE_SOURCE": "prefix_tree"}
    args, env = compare.command(spec, "start", 0, "ckpt")
    assert "trainer.val_only=True" in args and "trainer.test_freq=0" not in args
    assert "trainer.total_training_steps=0" in args


@pytest.mark.slow
def test_a_fake_run_is_recorded_with_its_command_code_version_and_metrics(tmp_path, results):
    spec = compare.load_spec(write_spec(tmp_path, results))
    record = compare.run_one(spec, "better", 1, tmp_path / "runs")
    assert record["status"] == "ok" and record["reason"] is None
    assert record["steps"]["3"]["critic/score/mean"] == pytest.approx(0.351)
    assert "+gain=0.05" in record["command"] and "data.seed=1" in record["command"]
    assert not any(word.startswith("/") for word in record["command"].split())
    assert len(record["code_version"]["commit"]) == 40 and isinstance(record["code_version"]["dirty"], bool)
    assert record["task"] is None  # the fake launcher names no task folder


@pytest.mark.slow
@pytest.mark.parametrize("stall", ["1", "heartbeat"])
def test_a_stalled_run_is_killed_and_recorded_as_failed_and_the_sweep_goes_on(tmp_path, results, stall):
    spec = compare.load_spec(write_spec(tmp_path, results, stall_seconds=2,
                                        env={"STALL": stall}, seeds=[0]))
    assert compare.run_spec(spec, runs_dir=tmp_path / "runs", log=lambda m: None) == 2  # both arms ran
    for arm in ("better", "base"):
        record = compare.read_json(spec.path(arm, 0))
        assert record["status"] == "failed" and record["reason"].startswith("stalled: no progress in the output for 2 s")
        assert record["seconds"] < 30 and record["steps"]["1"]["critic/score/mean"] > 0


@pytest.mark.slow
def test_a_failed_run_names_the_cause_its_output_gives(tmp_path, results):
    spec = compare.load_spec(write_spec(tmp_path, results, env={"FAIL": "oom"}, seeds=[0]))
    compare.run_spec(spec, runs_dir=tmp_path / "runs", log=lambda m: None)
    record = compare.read_json(spec.path("base", 0))
    assert record["status"] == "failed"
    assert record["reason"] == "exit code 1 (Ray's memory monitor killed workers: the machine ran low on memory)"
    assert compare.failure_cause("Traceback ...\nValueError: bad key\n") is None


def test_only_lines_other_than_the_agent_loops_status_count_as_progress():
    heartbeat = b"\x1b[36m(TaskRunnerV1 pid=3420)\x1b[0m INFO:2026-11-27 20:21:11,685:pending: 0, running: 16, finished: 16, failure: 0\n"
    assert not compare._progress(heartbeat * 3 + b"\n")
    assert compare._progress(heartbeat + b"step:12 - critic/score/mean:0.5\n")
    assert not compare._progress(b"")
    assert compare._progress(b"Loading weights:  50%|#####     | 13/26\r")  # a progress bar moving


def test_report_reproduces_the_committed_two_way_arm_table():
    """docs/results.md's two-way arm table (val before, val after, reward windows, area) from the engine."""
    spec = compare.load_spec(compare.spec_path("twoway"))
    docs = (REPO / "docs" / "results.md").read_text()
    lines = compare.report(spec).splitlines()
    header = [c.strip() for c in next(line for line in lines if line.startswith("| arm |")).strip("|").split("|")]
    rows = [line for line in lines if line.startswith(("| group_ppo |", "| gae |"))]
    assert len(rows) == 2
    for row in rows:
        cell = dict(zip(header, (c.strip() for c in row.strip("|").split("|"))))
        assert f"| {cell['arm']} | {cell['seeds']} | {cell['val before']} | {cell['val after']} |" in docs
        assert f"| {cell['reward, first 5']} | {cell['reward, last 5']} | {cell['area']} |" in docs


def test_report_reproduces_the_committed_multi_turn_tables():
    """docs/results.md's multi-turn arm table and paired differences from the engine on the committed records."""
    spec = compare.load_spec(compare.spec_path("multiturn"))
    docs = (REPO / "docs" / "results.md").read_text()
    vals = compare.values(spec, compare.records(spec))
    for arm in spec.arms:
        seeds = len(vals["final"][arm])
        cells = [f"{sum(vals[m][arm].values()) / seeds:.3f}" for m in ("final", "area", "first 10 steps")]
        turns = [f"{sum(vals[m][arm].values()) / seeds:.2f}" for m in ("turns, first 10", "turns, last 10")]
        assert f"| {arm} | {seeds} | {' | '.join(cells)} | {turns[0]} -> {turns[1]} |" in docs
    turn = compare.compare_pair(spec, vals, "group_ppo_turn", "group_ppo", "final")
    assert turn["verdict"] == "win" and f"{turn['mean']:+.3f} +- {2 * turn['se']:.3f} (3), **win**" in docs


def test_an_arms_seed_offset_shifts_the_seed_its_runs_get_but_not_its_pairing():
    spec = compare.load_spec(compare.spec_path("bench_validation"))
    assert ("grpo_again", "grpo") in spec.pairs and spec.arms["grpo_again"].seeds == spec.arms["grpo"].seeds
    again, _ = compare.command(spec, "grpo_again", 2, "ckpt")
    base, _ = compare.command(spec, "grpo", 2, "ckpt")
    assert "data.seed=1002" in again and "actor_rollout_ref.rollout.seed=1002" in again and "data.seed=2" in base
    assert [a for a in again if "seed" not in a] == [a for a in base if "seed" not in a]  # otherwise the same arm
    assert spec.path("grpo_again", 2).name == "grpo_again-seed2.json"


def test_the_pre_registered_specs_run_the_validated_regime():
    regime = compare.load_spec(compare.spec_path("bench_validation"))
    for name in ("first_comparison", "tree_comparison", "tree_settings", "tree_per_row"):
        spec = compare.load_spec(compare.spec_path(name))
        assert json.loads(compare.spec_path(name).read_text())["base"] == "bench_validation"
        assert (spec.steps, spec.env, spec.overrides, spec.metrics["held-out, end"]) == (
            regime.steps, regime.env, regime.overrides, regime.metrics["held-out, end"])
        assert spec.path("start", 0) == regime.path("start", 0) and spec.start.records_of == "bench_validation"
        args, _ = compare.command(spec, next(iter(spec.arms)), 0, "ckpt")
        assert f"trainer.experiment_name={name}_{next(iter(spec.arms))}_seed0" in args
    tree = compare.load_spec(compare.spec_path("tree_comparison"))
    assert tree.arms["tree_group_ppo"].env == {"ROLLOUT": "tree", "VALUE_SOURCE": "prefix_tree"}
    first = compare.load_spec(compare.spec_path("first_comparison"))  # the baselines run once, read by the others
    assert first.arms["grpo"].records_of == tree.arms["grpo"].records_of == "bench_validation"
    assert tree.arms["gae"].records_of == "first_comparison" and not first.arms["gae"].records_of
    assert "actor_rollout_ref.rollout.n=8" in tree.arms["tree_grpo"].overrides
    settings = compare.load_spec(compare.spec_path("tree_settings"))  # each setting apart from the defaults' arm
    base = settings.arms["tree_group_ppo"]
    assert base.records_of == "tree_comparison"
    assert (base.env, base.overrides) == (tree.arms["tree_group_ppo"].env, tree.arms["tree_group_ppo"].overrides)
    for arm, extra in (("tree_parent", "++algorithm.group_params.adv_norm=parent"),
                       ("tree_per_leaf", "++tree_rollout.shared_prefix=per_leaf")):
        assert settings.arms[arm].env == base.env and list(settings.arms[arm].overrides) == [*base.overrides, extra]
    per_row = compare.load_spec(compare.spec_path("tree_per_row"))  # runs nothing of its own: reads the runs above
    assert {name: arm.records_of for name, arm in per_row.arms.items()} == {
        "tree_group_ppo": "tree_comparison", "tree_grpo": "tree_comparison", "grpo_n8": "bench_validation"}
    assert "actor_rollout_ref.rollout.n=8" in regime.arms["grpo_n8"].overrides
