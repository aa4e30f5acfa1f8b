"""Argument checks of the benchmark scripts that start long runs (bad input fails before anything runs)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_scaling_rejects_prompt_counts_that_are_not_multiples_of_four():
    bench = _load("bench_cpu_step_scaling")
    assert bench._int_list("16,32,64", "--prompts") == [16, 32, 64]
    with pytest.raises(SystemExit, match="--prompts: every value must be a positive multiple of 4"):
        bench._int_list("16,30", "--prompts")
    with pytest.raises(SystemExit, match="--prompts: expected a comma list of integers"):
        bench._int_list("16,a", "--prompts")


def test_step_scaling_needs_two_steps_before_running_anything(tmp_path):
    bench = _load("bench_cpu_step_scaling")
    with pytest.raises(SystemExit, match="--steps: need at least 2"):
        bench.main(["--steps", "1", "--log-dir", str(tmp_path / "logs")])
    assert not (tmp_path / "logs").exists()


def test_step_scaling_reads_phases_through_the_launcher_log_parser():
    bench = _load("bench_cpu_step_scaling")
    parser = bench._summarize_module()
    log = "step:1 - timing_s/step:9.0 - timing_s/gen:5.0\nstep:2 - timing_s/step:4.0 - timing_s/gen:2.0\n"
    assert parser.timing_breakdown(parser.parse_step_metrics(log)) == {"timing_s/gen": 2.0, "timing_s/step": 4.0}


@pytest.mark.parametrize("argv, message", [
    (["--steps", "19"], "--steps: need at least 20"),
    (["--prompts", "0"], "--prompts: must be >= 1"),
    (["--seeds", "0,x"], "--seeds: expected a comma list of integers"),
    (["--seeds", ","], "--seeds: expected at least one value"),
])
def test_tiny_learning_rejects_bad_arguments_before_loading_anything(argv, message, tmp_path):
    bench = _load("bench_cpu_tiny_learning")
    with pytest.raises(SystemExit, match=message):
        bench.main(["--work-dir", str(tmp_path), *argv])


def test_tiny_learning_needs_a_prepared_work_dir(tmp_path):
    bench = _load("bench_cpu_tiny_learning")
    with pytest.raises(SystemExit, match="prepare.json is missing; run python -m verl_group_ppo.tinytask.prepare"):
        bench.main(["--work-dir", str(tmp_path)])
