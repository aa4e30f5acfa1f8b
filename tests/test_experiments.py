"""The experiments beside the demo (experiments/, run from the repository root) without their long runs: argument
checks (bad input fails before anything runs) and the reports' numbers on fake records."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_benchmarks import _load, _numbers, _table

# ------------------------------------------------------------------------------------------------ edge_vs_length


def _fake_length(root: Path, terms: str, shift: dict[str, float], length: float) -> None:
    """What the demo writes for one length of the edge sweep: results.json and metrics.jsonl of both parts."""
    bench = _load("experiments.edge_vs_length")
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
    bench = _load("experiments.edge_vs_length")
    _fake_length(tmp_path, "8-10", {"group_ppo": 0.0, "gae": 0.0, "sae": 0.0, "grpo": 0.0}, 27.0)
    _fake_length(tmp_path, "4-5", {"group_ppo": 0.02, "gae": 0.0, "sae": -0.03, "grpo": 0.0}, 12.0)
    (tmp_path / "terms-8-10.log").write_text("a sweep's log beside its folders is not a length")
    rows = bench.load_rows(str(tmp_path))
    assert [(r.terms, r.mean_response_length) for r in rows] == [("4-5", 12.0), ("8-10", 27.0)]  # by length
    g, s = rows[0].differences["group_ppo-gae"]["final"], rows[0].differences["sae-gae"]["final"]
    assert g["seeds"] == [0, 1, 2, 3, 4, 5] and g["mean"] == pytest.approx(0.02) and g["verdict"] == "win"
    assert s["seeds"] == [0, 1, 2] and s["mean"] == pytest.approx(-0.03) and s["verdict"] == "lose"
    text = bench.report(str(tmp_path), str(tmp_path / "edge.png"))
    first = _table(text, "terms")
    assert [row[0] for row in first] == ["4-5", "8-10"]
    assert _numbers(first[0][2]) == pytest.approx([0.02, 0.0, 6]) and "win" in first[0][2]
    assert _numbers(first[1][2]) == pytest.approx([0.0, 0.0, 6]) and "level" in first[1][2]
    finals = _numbers(_table(text.split("\n\n", 1)[1], "terms")[0][1])
    # arm means with their seed counts: 6 seeds for group_ppo and gae (0.5 + 0.02 + 0.025), 3 for sae and grpo
    assert finals == pytest.approx([0.545, 6, 0.525, 6, 0.48, 3, 0.51, 3])
    # every seed's difference is the same (no spread, margin 0): GROUP-PPO's +0.02 -> 0 shrinks, SAE's -0.03 -> 0 grows
    assert bench.trend(rows, "group_ppo-gae")["verdict"] == "shrinks"
    assert bench.trend(rows, "sae-gae")["verdict"] == "grows"
    assert "**shrinks**" in text and "**grows**" in text


def test_edge_figure_shows_each_lengths_difference_and_error_bar(tmp_path):
    bench = _load("experiments.edge_vs_length")
    _fake_length(tmp_path, "4-5", {"group_ppo": 0.02, "gae": 0.0, "sae": -0.03, "grpo": 0.0}, 12.0)
    _fake_length(tmp_path, "8-10", {"group_ppo": 0.0, "gae": 0.0, "sae": 0.0, "grpo": 0.0}, 27.0)
    data = bench.figure_data(bench.load_rows(str(tmp_path)))
    assert set(data) == {"final", "area"} and set(data["final"]) == {"group_ppo-gae", "sae-gae"}
    assert data["final"]["group_ppo-gae"] == [pytest.approx((12.0, 0.02, 0.0)), pytest.approx((27.0, 0.0, 0.0))]
    assert data["area"]["sae-gae"][0] == pytest.approx((12.0, -0.015, 0.0))


@pytest.mark.parametrize("final,area,verdict", [
    ([(0.0, 0.01), (0.05, 0.01)], [(0.0, 0.001), (0.0, 0.001)], "grows"),  # +0.05 > 2 * sqrt(2) * 0.01
    ([(0.0, 0.01), (0.02, 0.01)], [(0.0, 0.001), (0.0, 0.001)], "no trend shown"),  # inside the margin
    ([(0.0, 0.01), (0.05, 0.01)], [(0.0, 0.001), (-0.01, 0.001)], "no trend shown"),  # area moves the other way
    ([(0.05, 0.01), (0.0, 0.01)], [(0.0, 0.001), (0.0, 0.001)], "shrinks"),
    ([(0.0, None), (0.05, 0.01)], [(0.0, 0.001), (0.0, 0.001)], "no trend shown"),  # one seed: no SE
])
def test_edge_trend_rule(final, area, verdict):
    length = _load("experiments.edge_vs_length").Length
    rows = [length(str(i), float(i), {"p": {"final": {"mean": f[0], "se": f[1]}, "area": {"mean": a[0], "se": a[1]}}},
                   {}) for i, (f, a) in enumerate(zip(final, area))]
    assert _load("experiments.edge_vs_length").trend(rows, "p")["verdict"] == verdict


def test_edge_sweep_needs_a_length_or_the_report(tmp_path):
    bench = _load("experiments.edge_vs_length")
    with pytest.raises(SystemExit):
        bench.main(["--output-dir", str(tmp_path)])
    (tmp_path / "terms-4-5" / "a").mkdir(parents=True)  # a length still running is left out, and said so
    with pytest.raises(SystemExit, match="no length found"):
        bench.report(str(tmp_path), str(tmp_path / "x.png"))
