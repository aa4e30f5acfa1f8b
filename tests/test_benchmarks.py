"""Argument checks of the benchmark scripts that start long runs (bad input fails before anything runs)."""

from __future__ import annotations

import importlib.util
import json
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


def _fake_length(root: Path, terms: str, shift: dict[str, float], length: float) -> None:
    """What the demo writes for one length of the edge sweep: results.json and metrics.jsonl of both parts."""
    import json

    bench = _load("bench_edge_vs_length")
    for name, arms, seeds in bench.PARTS:
        part = root / f"terms-{terms}" / name
        part.mkdir(parents=True)
        runs = [{"estimator": arm, "seed": int(s), "final_eval_accuracy": 0.5 + shift[arm] + 0.01 * int(s),
                 "curve_area": 0.4 + shift[arm] / 2 + 0.001 * int(s) ** 2, "curve": [[0, 0.1], [1, 0.2]],
                 "wall_time_s": 1.0}
                for arm in arms.split(",") for s in seeds.split(",")]
        (part / "results.json").write_text(json.dumps({"runs": runs, "meta": {}}))
        (part / "metrics.jsonl").write_text("\n".join(json.dumps({"response_length/mean": length + d})
                                                      for d in (-1.0, 1.0)))


def test_edge_report_pairs_seeds_and_applies_the_rule(tmp_path):
    bench = _load("bench_edge_vs_length")
    _fake_length(tmp_path, "4-5", {"group_ppo": 0.02, "gae": 0.0, "sae": -0.03, "grpo": 0.0}, 12.0)
    _fake_length(tmp_path, "8-10", {"group_ppo": 0.0, "gae": 0.0, "sae": 0.0, "grpo": 0.0}, 27.0)
    data = bench.load_length(str(tmp_path / "terms-4-5"))
    assert data["mean_response_length"] == 12.0 and len(data["runs"]) == 4 * 3 + 2 * 3
    diff = bench.differences(data["runs"])
    g, s = diff["group_ppo-gae"]["final"], diff["sae-gae"]["final"]
    assert g["seeds"] == [0, 1, 2, 3, 4, 5] and g["mean"] == pytest.approx(0.02)
    assert s["seeds"] == [0, 1, 2] and s["mean"] == pytest.approx(-0.03)
    (tmp_path / "terms-8-10.log").write_text("a sweep's log beside its folders is not a length")
    figure = tmp_path / "edge.png"
    table = bench.report(str(tmp_path), str(figure))
    first, second = table.split("\n\n")[:2]
    rows = first.splitlines()[2:]
    assert [r.split("|")[1].strip() for r in rows] == ["4-5", "8-10"]  # ordered by response length
    # arm means with their seed counts: 6 seeds for group_ppo and gae (0.5 + 0.02 + 0.025), 3 for sae and grpo
    assert second.splitlines()[2].startswith("| 4-5 | 0.545 (6) / 0.525 (6) / 0.480 (3) / 0.510 (3) | ")
    assert figure.stat().st_size > 0
    # every seed's difference is the same (no spread, margin 0): GROUP-PPO's +0.02 -> 0 shrinks, SAE's -0.03 -> 0 grows
    assert "GROUP-PPO - PPO, 4-5 -> 8-10 terms: final -0.020 (margin 0.000), area -0.010 (margin 0.000): " \
           "**shrinks**" in table
    assert "SAE - PPO, 4-5 -> 8-10 terms: final +0.030 (margin 0.000), area +0.015 (margin 0.000): **grows**" in table


def _rows(final: list[tuple[float, float]], area: list[tuple[float, float]]) -> list:
    """Report rows of one pair ("p") from (mean, se) per length, shortest first."""
    length = _load("bench_edge_vs_length").Length
    return [length(str(i), float(i), {"p": {"final": {"mean": f[0], "se": f[1]}, "area": {"mean": a[0], "se": a[1]}}},
                   {}) for i, (f, a) in enumerate(zip(final, area))]


@pytest.mark.parametrize("final,area,verdict", [
    ([(0.0, 0.01), (0.05, 0.01)], [(0.0, 0.001), (0.0, 0.001)], "grows"),  # +0.05 > 2 * sqrt(2) * 0.01
    ([(0.0, 0.01), (0.02, 0.01)], [(0.0, 0.001), (0.0, 0.001)], "no trend shown"),  # inside the margin
    ([(0.0, 0.01), (0.05, 0.01)], [(0.0, 0.001), (-0.01, 0.001)], "no trend shown"),  # area moves the other way
    ([(0.05, 0.01), (0.0, 0.01)], [(0.0, 0.001), (0.0, 0.001)], "shrinks"),
    ([(0.0, None), (0.05, 0.01)], [(0.0, 0.001), (0.0, 0.001)], "no trend shown"),  # one seed: no SE
])
def test_edge_trend_rule(final, area, verdict):
    bench = _load("bench_edge_vs_length")
    assert bench.trend(_rows(final, area), "p")["verdict"] == verdict


def test_edge_sweep_needs_a_length_or_the_report(tmp_path):
    bench = _load("bench_edge_vs_length")
    with pytest.raises(SystemExit):
        bench.main(["--output-dir", str(tmp_path)])
    (tmp_path / "terms-4-5" / "a").mkdir(parents=True)  # a length still running is left out, and said so
    with pytest.raises(SystemExit, match="no length found"):
        bench.report(str(tmp_path), str(tmp_path / "x.png"))


# ------------------------------------------------------------------------------------ bench_multiturn


def _multiturn_record(arm: str, seed: int, rewards: list[float], turns: float = 4.0) -> dict:
    return {"arm": arm, "seed": seed, "steps": {str(k + 1): {"critic/score/mean": r, "num_turns/mean": turns,
                                                            "timing_s/step": 2.0} for k, r in enumerate(rewards)}}


def test_multiturn_plan_covers_every_arm_and_seed_once_seeds_first():
    bench = _load("bench_multiturn")
    plan = bench.plan()
    assert len(plan) == len(set(plan)) == sum(len(seeds) for _, _, seeds in bench.ARMS.values()) == 18
    assert plan[:4] == [("group_ppo", 0), ("group_ppo_turn", 0), ("gae", 0), ("grpo", 0)]
    assert [s for _, s in plan] == sorted(s for _, s in plan)


def test_multiturn_report_pairs_seeds_applies_the_rule_and_lists_missing_runs():
    bench = _load("bench_multiturn")
    flat = [0.2] * 20
    runs = [_multiturn_record("gae", s, flat) for s in (0, 1, 2)]
    runs += [_multiturn_record("group_ppo", s, [0.2 + 0.05 + 0.01 * s] * 20) for s in (0, 1, 2)]
    runs += [_multiturn_record("grpo", 0, [0.1] * 20)]
    metrics = bench.run_metrics(runs[3])
    assert metrics["final"] == pytest.approx(0.25) and metrics["area"] == pytest.approx(0.25)
    text = bench.report(runs)
    row = next(line for line in text.splitlines() if line.startswith("| group_ppo - gae | final"))
    assert "| 3 | +0.060 +- " in row and row.endswith("| win |")
    assert next(line for line in text.splitlines() if line.startswith("| grpo - gae | final")).endswith("| 1 | -0.100 +- n/a | level |")
    assert "| group_ppo_turn - gae | final | 0 | - | - |" in text
    assert "Missing runs (11)" in text and "gae-seed3" in text and "group_ppo-seed0" not in text.split("Missing")[1]
    assert "- not recorded: seeds 0, 1, 2" in text  # records without the warm start's figures


def test_multiturn_report_names_the_warm_start_of_each_seed(tmp_path):
    bench = _load("bench_multiturn")
    (tmp_path / "model").mkdir()
    measured = {"sampled": 0.195, "greedy": 0.578, "call_rate": 0.89, "calls_per_response": 1.76}
    (tmp_path / "model" / "prepare.json").write_text(json.dumps({"test_accuracy": measured}))
    assert bench.warm_start(str(tmp_path)) == measured
    runs = [_multiturn_record("gae", s, [0.2] * 20) for s in (0, 1, 2)]
    for r in runs[1:]:
        r["warm_start"] = measured
    text = bench.report(runs)
    assert "- not recorded: seeds 0" in text
    assert "- sampled 0.195, greedy 0.578, calls/response 1.76: seeds 1, 2" in text


def test_multiturn_needs_enough_steps_for_the_final_window(tmp_path):
    bench = _load("bench_multiturn")
    with pytest.raises(SystemExit, match="--steps"):
        bench.main(["--steps", "5", "--output-dir", str(tmp_path)])
    assert bench.main(["--report", "--results-dir", str(tmp_path)]) == 0  # nothing run: every run missing
