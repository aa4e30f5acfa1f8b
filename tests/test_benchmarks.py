"""The benchmark scripts without their long runs: the shared plumbing (benchmarks/benchlib.py), argument checks
(bad input fails before anything runs), the reports' numbers on fake records, and the committed records."""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "benchmarks") not in sys.path:
    sys.path.insert(0, str(REPO / "benchmarks"))  # what `python benchmarks/<name>.py` does (benchlib's convention)


def _load(name: str):
    """A benchmark script (or benchlib) as a module, imported by name."""
    return importlib.import_module(name)


def _table(text: str, first_header: str) -> list[list[str]]:
    """The body rows of the markdown table in ``text`` whose header starts with ``| first_header |``, as cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {first_header} |"))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def _numbers(cell: str) -> list[float]:
    return [float(x) for x in re.findall(r"[-+]?\d+\.\d+|[-+]?\d+", cell)]


# --------------------------------------------------------------------------------------------------- benchlib


def test_records_are_written_whole_and_without_machine_paths(tmp_path):
    lib = _load("benchlib")
    path = tmp_path / "a" / "run.json"
    lib.write_json(path, {"command": "bash examples/cpu/common.sh gae trainer.default_local_dir=runs/x", "v": [1]})
    assert lib.read_json(path)["v"] == [1] and not (tmp_path / "a" / "run.json.tmp").exists()
    for bad in ({"command": "x trainer.default_local_dir=/work/x"}, ["/tmp/y"], {"/home/z": 1}, {"p": "~/data"}):
        with pytest.raises(ValueError, match="no machine path"):
            lib.write_json(tmp_path / "bad.json", bad)
    assert not (tmp_path / "bad.json").exists()
    (tmp_path / "half.json").write_text('{"a": ')
    assert lib.read_json(tmp_path / "half.json") is None and lib.read_json(tmp_path / "none.json") is None
    assert lib.machine_paths({"ratio": "1/2", "url": "https://example.org/a", "n": 3.0}) == []


def test_portable_makes_paths_relative_to_the_repository():
    lib = _load("benchlib")
    assert lib.portable(f"trainer.default_local_dir={lib.REPO}/runs/a") == "trainer.default_local_dir=runs/a"
    assert lib.portable(str(lib.LAUNCHER)) == "examples/cpu/common.sh"
    assert not os.path.isabs(lib.portable("/elsewhere/x")) and lib.portable("data.seed=3") == "data.seed=3"


def test_differences_pair_by_seed_and_apply_the_rule():
    lib = _load("benchlib")
    records = [{"estimator": "a", "seed": s, "v": 0.5 + 0.1 + 0.01 * s} for s in (0, 1, 2, 3)]
    records += [{"estimator": "b", "seed": s, "v": 0.5 + 0.02 * s} for s in (0, 1, 2)]
    records = [{**r, "twice": 2 * r["v"]} for r in records]
    d = lib.differences(records, [("a", "b"), ("b", "a")], {"v": "v", "twice": "twice"})
    ab = d["a-b"]["v"]
    assert ab["seeds"] == [0, 1, 2] and ab["per_seed"] == pytest.approx([0.1, 0.09, 0.08])  # seed 3 unpaired
    assert ab["mean"] == pytest.approx(0.09) and ab["se"] == pytest.approx(0.01 / math.sqrt(3))
    assert ab["verdict"] == "win" and d["b-a"]["v"]["verdict"] == "lose"
    assert d["a-b"]["twice"]["mean"] == pytest.approx(0.18)
    assert lib.cell(ab) == "+0.090 +- 0.012 (3 seeds, win)"
    tagged = [{**r, "arm": r["estimator"], "estimator": "other"} for r in records]  # the arm under another key
    assert lib.differences(tagged, [("a", "b")], {"v": "v"}, arm_key="arm")["a-b"]["v"]["seeds"] == [0, 1, 2]
    assert lib.cell(lib.differences(records, [("a", "c")], {"v": "v"})["a-c"]["v"]) == "n/a"


def test_round_robin_timing_calls_each_once_to_warm_up_then_per_repeat():
    lib = _load("benchlib")
    calls = {"a": 0, "b": 0}

    def call(name: str):
        calls[name] += 1
        return calls[name]

    repeats: list[int] = []
    results, times = lib.time_round_robin({n: (lambda n=n: call(n)) for n in calls}, 3, on_repeat=repeats.append)
    assert calls == {"a": 4, "b": 4} and results == {"a": 1, "b": 1} and repeats == [0, 1, 2]
    assert all(wall >= 0 and cpu >= 0 for wall, cpu in times.values())
    _, untimed = lib.time_round_robin({"a": lambda: call("a")}, 0)
    assert all(math.isnan(x) for x in untimed["a"])
    assert lib.timed(lambda: call("b"))[0] == 5 and calls["b"] == 5  # one call, its result passed through


def test_run_launcher_checks_exit_code_and_steps_and_records_relative_paths(tmp_path, monkeypatch):
    lib = _load("benchlib")
    seen = {}

    def fake_run(cmd, env, text, stdout, stderr):
        seen.update(cmd=cmd, env=env)
        ckpt = Path(cmd[-1].split("=", 1)[1])
        ckpt.mkdir(parents=True, exist_ok=True)
        out = "".join(f"step:{k} - critic/score/mean:0.{k} - timing_s/step:2.0\n" for k in range(seen.get("first", 1), seen["steps"] + 1))
        if stdout is not subprocess.PIPE:
            stdout.write(out)
        return subprocess.CompletedProcess(cmd, seen["rc"], out if stdout is subprocess.PIPE else None)

    monkeypatch.setattr(lib.subprocess, "run", fake_run)
    seen.update(steps=2, rc=0)
    ckpt = str(lib.REPO / "runs" / "test-benchlib-ckpt")
    work_dir = str(lib.REPO / "runs" / "w")
    run = lib.run_launcher("gae", 2, ["data.seed=1"], {"WORK_DIR": work_dir}, tmp_path / "logs" / "x.log", ckpt)
    assert run.steps == {1: {"critic/score/mean": 0.1, "timing_s/step": 2.0}, 2: {"critic/score/mean": 0.2,
                                                                                  "timing_s/step": 2.0}}
    assert run.command == ("WORK_DIR=runs/w bash examples/cpu/common.sh gae trainer.total_training_steps=2 "
                           "data.seed=1 trainer.default_local_dir=runs/test-benchlib-ckpt")
    assert seen["env"]["WORK_DIR"] == work_dir and "PYTHON" in seen["env"] and not os.path.exists(ckpt)
    assert (tmp_path / "logs" / "x.log").read_text().startswith("step:1 - ")
    with pytest.raises(lib.LauncherError, match="2 of 3 steps logged"):
        lib.run_launcher("gae", 3)
    seen.update(first=0)  # verl's validation before training logs step 0
    assert sorted(lib.run_launcher("gae", 2).steps) == [0, 1, 2]
    seen.update(first=1)
    seen.update(rc=1)
    with pytest.raises(lib.LauncherError, match="exit code 1"):
        lib.run_launcher("gae", 2)


# ----------------------------------------------------------------------------------------- committed records


def test_no_committed_record_holds_a_machine_path():
    lib = _load("benchlib")
    files = [p for p in (REPO / "benchmarks" / "results").rglob("*") if p.is_file()]
    assert len(files) >= 37 + 18  # the critic regimes' and the multi-turn comparison's records
    machine = re.compile(r"(?<![\w.])/(work|tmp|home|root|Users|mnt|var|opt|srv|data|scratch)/")
    for path in files:
        text = path.read_text()
        assert not machine.search(text), path
        if path.suffix == ".json":
            assert lib.machine_paths(json.loads(text)) == [], path  # no string, nor word of one, is an absolute path


# ------------------------------------------------------------------------------------------- step scaling etc.


def test_step_scaling_rejects_prompt_counts_that_are_not_multiples_of_four():
    bench = _load("bench_cpu_step_scaling")
    assert bench.prompt_counts("16,32,64") == [16, 32, 64]
    with pytest.raises(SystemExit, match="--prompts: every value must be a positive multiple of 4"):
        bench.prompt_counts("16,30")
    with pytest.raises(SystemExit, match="--prompts: expected a comma list of integers"):
        bench.prompt_counts("16,a")


def test_step_scaling_needs_two_steps_before_running_anything(tmp_path):
    bench = _load("bench_cpu_step_scaling")
    with pytest.raises(SystemExit, match="--steps: need at least 2"):
        bench.main(["--steps", "1", "--log-dir", str(tmp_path / "logs")])
    assert not (tmp_path / "logs").exists()


def test_tree_bench_reads_shapes_and_refuses_mixed_sizes_before_running_anything(tmp_path):
    bench = _load("bench_tree_rollout")
    assert bench.parse_shape("2x2x2:4") == {"roots": 2, "branching": [2, 2], "segment_tokens": 4}
    assert bench.shape_size(bench.parse_shape("4x2:3")) == 8
    for bad in ("2x2", "2x1:4", "ax2:4", "2x2:0"):
        with pytest.raises(SystemExit, match="--shapes"):
            bench.parse_shape(bad)
    with pytest.raises(SystemExit, match="--shapes: every shape must give the same replies per prompt"):
        bench.main(["--shapes", "2x2x2:4,2x2:4", "--log-dir", str(tmp_path / "logs")])
    assert not (tmp_path / "logs").exists()


def test_tree_bench_summarizes_tokens_times_and_rounds_after_the_first_step():
    bench = _load("bench_tree_rollout")
    from benchlib import LauncherRun

    steps = {s: {"timing_s/gen": 10.0 * s, "timing_s/step": 20.0 * s, "group/tree_generated_tokens": 50.0 + s,
                 "group/tree_path_tokens": 100.0, "group/tree_round0_generate_s": 1.0 * s,
                 "group/tree_round1_generate_s": 0.5} for s in (1, 2, 3)}
    row = bench.summarize(LauncherRun("cmd", 9.0, steps))
    assert row["generated_over_path"] == pytest.approx((52 + 53) / 200)
    assert (row["gen_s"], row["step_s"]) == (25.0, 50.0)
    assert row["round_generate_s"] == {"tree_round0_generate_s": 2.5, "tree_round1_generate_s": 0.5}
    independent = bench.summarize(LauncherRun("cmd", 9.0, {s: {"timing_s/gen": 5.0, "timing_s/step": 10.0}
                                                           for s in (1, 2)}))
    assert independent["generated_over_path"] == 1.0
    lines = bench.table([{**independent, "rollout": "independent", "n": 8},
                         {**row, "rollout": "2x2x2:4", "n": 8}]).splitlines()
    assert lines[3].split("|")[3:8] == [" 0.525 ", " 25.00 ", " 5.00 ", " 50.00 ", " 5.00 "]


def test_hf_server_tree_bench_takes_each_ratio_against_the_independent_arm_of_its_repeat_and_cache(tmp_path):
    bench = _load("bench_hf_server_tree")
    counts = {"prefills": 1, "prefill_tokens": 100, "decoding_steps": 10, "cache_hits": 0}
    records = [{"cache": cache, "arm": arm, "repeat": repeat, "seconds": seconds, **counts}
               for cache, arm, repeat, seconds in [
                   ("off", "independent", 0, 1.0), ("off", "tree", 0, 1.5), ("off", "independent", 1, 2.0),
                   ("off", "tree", 1, 2.2), ("off", "independent", 2, 1.0), ("off", "tree", 2, 1.2),
                   ("on", "independent", 0, 0.5), ("on", "tree", 0, 0.4)]]
    rows = {(r["cache"], r["arm"]): r for r in bench.summarize(records)}
    assert rows[("off", "tree")]["ratio"] == pytest.approx(1.2) and rows[("off", "tree")]["seconds"] == 1.5
    assert rows[("on", "tree")]["ratio"] == pytest.approx(0.8) and rows[("off", "independent")]["ratio"] == 1.0
    assert ("on", "tree_prefix_ready") not in rows
    line = bench.table(bench.summarize(records)).splitlines()[3]
    assert line.split("|")[1:9] == [" off ", " tree ", " 1.500 ", " 1.20 ", " 1 ", " 100 ", " 10 ", " 0 "]
    with pytest.raises(SystemExit, match="--n 2"):
        bench.main(["--n", "1", "--work-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="--work-dir: .* has no prepared tiny task"):
        bench.main(["--work-dir", str(tmp_path)])


def test_tree_bench_takes_each_repeats_ratio_against_its_own_independent_run(tmp_path):
    bench = _load("bench_tree_rollout")
    rows = [{"rollout": "independent", "repeat": 0, "gen_s": 4.0, "step_s": 8.0},
            {"rollout": "2x2x2:4", "repeat": 0, "gen_s": 5.0, "step_s": 8.8},
            {"rollout": "independent", "repeat": 1, "gen_s": 2.0, "step_s": 5.0},
            {"rollout": "2x2x2:4", "repeat": 1, "gen_s": 3.0, "step_s": 6.0},
            {"rollout": "independent", "repeat": 2, "gen_s": 5.0, "step_s": 10.0},
            {"rollout": "2x2x2:4", "repeat": 2, "gen_s": 5.0, "step_s": 9.0}]
    ratios = bench.median_ratios(rows)["2x2x2:4"]
    assert ratios["gen"] == [1.25, 1.5, 1.0] and ratios["median_gen"] == 1.25
    assert ratios["step"] == pytest.approx([1.1, 1.2, 0.9]) and ratios["median_step"] == pytest.approx(1.1)
    with pytest.raises(SystemExit, match="--repeats: need at least 1"):
        bench.main(["--repeats", "0", "--log-dir", str(tmp_path / "logs")])
    assert not (tmp_path / "logs").exists()


# ----------------------------------------------------------------------------------------------------------------------
# bench_gpu_runs: the CUDA runs' driver (its runs need a GPU; its inputs and records are checked here)


@pytest.mark.parametrize("bad", ["tiny:group_ppo", "tiny:ppo:3", "tiny:gae:0", "nosuchtask:gae:2", "tiny:gae:x",
                                 "tiny:gae:2:rollout=tree", "tiny:gae:2:ROLLOUT=a/b", "tiny:gae:2:ROLLOUT"])
def test_the_gpu_runs_refuse_a_run_that_is_not_task_estimator_steps(bad):
    gpu = _load("bench_gpu_runs")
    with pytest.raises(ValueError, match="^--run: "):
        gpu.parse_run(bad)
    assert gpu.parse_run("arith:grpo:2") == ("arith", "grpo", 2, ())
    assert gpu.parse_run("tiny:group_ppo:3:ROLLOUT=tree,VALUE_SOURCE=prefix_tree") == (
        "tiny", "group_ppo", 3, (("ROLLOUT", "tree"), ("VALUE_SOURCE", "prefix_tree")))
    assert all(gpu.parse_run(run) for run in gpu.DEFAULT_RUNS)


def test_the_gpu_runs_record_a_failed_run_and_its_steps(tmp_path, monkeypatch):
    gpu = _load("bench_gpu_runs")
    log = ("NCCL INFO comm 0x5 rank 0 nRanks 1 nNodes 1 localRanks 1 localRank 0 MNNVL 0 - Init COMPLETE\n"
           "step:1 - critic/score/mean:0.25 - timing_s/step:3.0 - timing_s/gen:1.0\n"
           "step:2 - critic/score/mean:0.5 - timing_s/step:2.0 - timing_s/gen:0.5\nTraceback: boom\n")

    def fake_run(command, **kwargs):
        if command[0] == "bash":
            return subprocess.CompletedProcess(command, 1, stdout=log, stderr="")
        return subprocess.CompletedProcess(command, 0, stdout="", stderr="")

    monkeypatch.setattr(gpu.subprocess, "run", fake_run)
    work = tmp_path / "work"
    (work / "model").mkdir(parents=True)
    (work / "model" / "config.json").write_text("{}")
    (work / "model" / "verl_group_ppo_model.json").write_text('{"model": "random-weights"}')
    record = gpu.run_one("tiny", "gae", 2, work, tmp_path, timeout_s=10)
    assert record["exit_status"] == 1 and record["random_weights"] is True
    assert record["steps"]["2"]["critic/score/mean"] == 0.5 and record["timing_mean_after_first"]["timing_s/gen"] == 0.5
    assert len(record["nccl"]) == 1 and record["last_lines"][-1] == "Traceback: boom"
    assert "examples/cpu/run_tiny_gae.sh trainer.total_training_steps=2" in record["command"]
    assert not os.path.isabs(record["work_dir"])
    table = gpu.report(tmp_path)
    assert "| tiny-gae | 1 |" in table and "| 2.00 | 0.50 |" in table and "| 0.500 | random |" in table
    seen = {}
    monkeypatch.setattr(gpu.subprocess, "run", lambda command, **kwargs: (
        seen.setdefault("env", kwargs.get("env")), fake_run(command, **kwargs))[1])
    tree = gpu.run_one("tiny", "group_ppo", 2, work, tmp_path, timeout_s=10, variables=(("ROLLOUT", "tree"),))
    assert seen["env"]["ROLLOUT"] == "tree" and (tmp_path / "tiny-group_ppo-tree.json").is_file()
    assert "ROLLOUT=tree bash examples/cpu/run_tiny_group_ppo.sh" in tree["command"]


def test_estimator_bench_times_every_estimator_and_the_scan_alone_against_verls_gae(tmp_path):
    bench = _load("bench_estimators")
    out = tmp_path / "est.json"
    assert bench.main(["--device", "cpu", "--shapes", "8x64", "--repeats", "1", "--no-memory", "--json",
                       str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["estimator"] for r in rows] == list(bench.ESTIMATORS)
    assert all(r["wall_s"] > 0 and r["ratio_to_gae"] > 0 for r in rows)
    assert [r["ratio_to_gae"] for r in rows if r["estimator"] == "gae"] == [1.0]
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--estimators", "gae,scan"])  # an unknown name fails before timing
