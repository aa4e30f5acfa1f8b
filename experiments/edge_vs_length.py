"""Where GROUP-PPO's edge lies: the demo's arms against PPO at one response length, and the report over lengths.

The pre-registered sweep of docs/results.md ("Edge vs response length"), one length at a time, then the report::

    .venv/bin/python -m experiments.edge_vs_length --terms 4-5     # also 8-10 and 12-14
    .venv/bin/python -m experiments.edge_vs_length --report

A length runs the demo (its defaults for every arm) twice on one cached warm start: group_ppo, gae, sae and grpo
on seeds 0-2, then group_ppo and gae on seeds 3-5. The report reads every length under ``--output-dir``: the paired
differences to PPO (final sampled accuracy and curve area, mean +- 2 paired SE, the rule's verdict) by mean
response length, each arm's mean final accuracy with SAE - GROUP-PPO and GRPO - PPO, the trend verdicts, and the
figure ``docs/edge_vs_length.png`` (``--figure``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks.benchlib import DEMO_METRICS, REPO, cell, differences, figure, read_json

#: the runs of one length: (name, arms, seeds)
PARTS = (("a", "group_ppo,gae,sae,grpo", "0,1,2"), ("b", "group_ppo,gae", "3,4,5"))
#: the differences the question is about (the first two), and the ones the defaults rule and the context need:
#: (arm, baseline)
PAIRS = (("group_ppo", "gae"), ("sae", "gae"), ("sae", "group_ppo"), ("grpo", "gae"))
ARMS = ("group_ppo", "gae", "sae", "grpo")


class Length(NamedTuple):
    """One length of the report."""

    terms: str
    mean_response_length: float
    differences: dict  # differences(): pair -> metric -> paired difference and verdict
    arms: dict  # experiments.demo.report.summarise(...)["estimators"]: arm -> final_mean, seeds, ...


def run_length(terms: str, out_root: str, steps: int) -> None:
    """Both parts of one length, in ``OUT_ROOT/terms-<terms>/``; the second reuses the first's warm-start cache."""
    from experiments.demo.cli import main as demo_main

    out_dir = os.path.join(out_root, f"terms-{terms}")
    for name, arms, seeds in PARTS:
        os.makedirs(os.path.join(out_dir, name), exist_ok=True)
        cache = os.path.join(out_dir, name, "cache")
        if name != PARTS[0][0] and not os.path.exists(cache):
            os.symlink(os.path.abspath(os.path.join(out_dir, PARTS[0][0], "cache")), cache)
        argv = ["--terms", terms, "--steps", str(steps), "--estimators", arms, "--seeds", seeds,
                "--output-dir", os.path.join(out_dir, name), "--no-progress"]
        print(f"[edge] terms {terms}, part {name}: python -m experiments.demo {' '.join(argv)}", flush=True)
        if demo_main(argv) != 0:
            raise SystemExit(f"the demo failed for terms {terms}, part {name}")


def load_length(out_dir: str) -> tuple[list[dict], float]:
    """Every run of one length (both parts), and its mean response length over all runs and steps."""
    runs, lengths = [], []
    for name, _, _ in PARTS:
        path = os.path.join(out_dir, name, "results.json")
        if (data := read_json(path)) is None:
            raise FileNotFoundError(f"{path} is missing: run this length first (--terms)")
        runs += data["runs"]
        with open(os.path.join(out_dir, name, "metrics.jsonl")) as f:
            lengths += [rec["response_length/mean"] for rec in map(json.loads, f) if "response_length/mean" in rec]
    return runs, sum(lengths) / len(lengths)


def trend(rows: list, pair: str) -> dict[str, Any]:
    """The pre-registered trend test of ``pair`` (e.g. ``"group_ppo-gae"``) between the shortest and the longest
    length in ``rows`` (:class:`Length` records, or anything with ``differences``, sorted by length).

    "grows" when the final-accuracy difference at the longest length exceeds the one at the shortest by more
    than ``2 * sqrt(SE_short^2 + SE_long^2)`` and the curve-area difference does not move the other way by more
    than its own such margin; "shrinks" by the mirror rule; else "no trend shown" (also with a missing SE).
    """
    short, long_ = rows[0].differences[pair], rows[-1].differences[pair]
    if any(d[metric]["se"] is None for d in (short, long_) for metric in ("final", "area")):
        return {"verdict": "no trend shown", "final": None, "area": None}
    moves = {metric: (long_[metric]["mean"] - short[metric]["mean"],
                      2.0 * math.hypot(short[metric]["se"], long_[metric]["se"])) for metric in ("final", "area")}
    (d_final, m_final), (d_area, m_area) = moves["final"], moves["area"]
    if d_final > m_final and d_area >= -m_area:
        verdict = "grows"
    elif d_final < -m_final and d_area <= m_area:
        verdict = "shrinks"
    else:
        verdict = "no trend shown"
    return {"verdict": verdict, **moves}


def _trend_line(rows: list, pair: str, label: str) -> str:
    t = trend(rows, pair)
    if t["final"] is None:
        return f"{label}: {t['verdict']} (a standard error is missing)"
    (df, mf), (da, ma) = t["final"], t["area"]
    return (f"{label}, {rows[0].terms} -> {rows[-1].terms} terms: final {df:+.3f} (margin {mf:.3f}), "
            f"area {da:+.3f} (margin {ma:.3f}): **{t['verdict']}**")


def load_rows(out_root: str) -> list[Length]:
    """Every finished length under ``out_root``, shortest mean response first (unfinished ones left out, and
    said so on stderr)."""
    from experiments.demo.report import summarise

    rows: list[Length] = []
    for folder in sorted(path for path in Path(out_root).glob("terms-*") if path.is_dir()):
        try:
            runs, length = load_length(str(folder))
        except FileNotFoundError as err:  # a length still running, or never finished: left out, and said so
            print(f"[edge] {folder.name} left out of the report: {err}", file=sys.stderr)
            continue
        rows.append(Length(folder.name[len("terms-"):], length, differences(runs, PAIRS, DEMO_METRICS),
                           summarise(runs)["estimators"]))
    return sorted(rows, key=lambda r: r.mean_response_length)


def report(out_root: str, figure_path: str) -> str:
    """The table over every length found under ``out_root`` (markdown) and the figure."""
    rows = load_rows(out_root)
    if not rows:
        raise SystemExit(f"no length found under {out_root}: run one first (--terms 4-5)")
    lines = ["| terms | mean response length (tokens) | GROUP-PPO - PPO, final | GROUP-PPO - PPO, area "
             "| SAE - PPO, final | SAE - PPO, area |", "|---|---|---|---|---|---|"]
    for terms, length, diff, _ in rows:
        g, s = diff["group_ppo-gae"], diff["sae-gae"]
        lines.append(f"| {terms} | {length:.1f} | {cell(g['final'])} | {cell(g['area'])} | {cell(s['final'])} "
                     f"| {cell(s['area'])} |")
    lines += ["", "| terms | final accuracy, mean (seeds): GROUP-PPO / PPO / SAE / GRPO | SAE - GROUP-PPO, final "
              "| SAE - GROUP-PPO, area | GRPO - PPO, final | GRPO - PPO, area |", "|---|---|---|---|---|---|"]
    for terms, _, diff, arms in rows:
        s, r = diff["sae-group_ppo"], diff["grpo-gae"]
        finals = " / ".join(f"{arms[a]['final_mean']:.3f} ({len(arms[a]['seeds'])})" if a in arms else "n/a"
                            for a in ARMS)
        lines.append(f"| {terms} | {finals} | {cell(s['final'])} | {cell(s['area'])} | {cell(r['final'])} "
                     f"| {cell(r['area'])} |")
    plot(rows, figure_path)
    if len(rows) > 1:
        lines += ["", "Trend (the pre-registered rule, shortest against longest length):", "",
                  "* " + _trend_line(rows, "group_ppo-gae", "GROUP-PPO - PPO"),
                  "* " + _trend_line(rows, "sae-gae", "SAE - PPO")]
    return "\n".join(lines)


#: the figure's series: (pair, label, colour, x shift in tokens so the error bars do not overlap)
SERIES = (("group_ppo-gae", "GROUP-PPO - PPO", "#d62728", -0.3), ("sae-gae", "SAE - PPO", "#8c564b", 0.3))


def figure_data(rows: list[Length]) -> dict[str, dict[str, list[tuple[float, float, float]]]]:
    """What the figure draws: ``{metric: {pair: [(mean response length, mean difference, 2 paired SE)]}}``, one
    point per length (NaN error bar without a standard error)."""
    def point(row: Length, pair: str, metric: str) -> tuple[float, float, float]:
        d = row.differences[pair][metric]
        return row.mean_response_length, d["mean"], math.nan if d["se"] is None else 2 * d["se"]

    return {metric: {pair: [point(row, pair, metric) for row in rows] for pair, *_ in SERIES}
            for metric in DEMO_METRICS}


def plot(rows: list[Length], path: str) -> None:
    """Differences to PPO (mean +- 2 paired SE) against mean response length, final accuracy and curve area."""
    with figure(path, 2, (10, 3.8), sharex=True) as axes:
        for ax, (metric, series) in zip(axes, figure_data(rows).items()):
            for pair, label, color, shift in SERIES:
                xs, ys, errs = zip(*series[pair])
                ax.errorbar([x + shift for x in xs], ys, yerr=errs, fmt="o-", color=color, capsize=4, label=label)
            ax.axhline(0.0, color="grey", lw=0.8)
            ax.set_xlabel("mean response length (tokens)")
            ax.set_ylabel("final sampled accuracy difference" if metric == "final" else "curve area difference")
            ax.set_title(f"{'final accuracy' if metric == 'final' else 'learning-curve area'} vs PPO (+- 2 SE)")
            ax.legend()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--terms", help="run one length, e.g. 4-5, 8-10 or 12-14")
    p.add_argument("--report", action="store_true", help="print the table over all lengths and draw the figure")
    p.add_argument("--steps", type=int, default=150, help="RL steps per run (default: 150)")
    p.add_argument("--output-dir", default=os.path.join(REPO, "runs", "edge-vs-length"),
                   help="where each length's runs go (default: runs/edge-vs-length)")
    p.add_argument("--figure", default=os.path.join(REPO, "docs", "edge_vs_length.png"),
                   help="the report's figure (default: docs/edge_vs_length.png)")
    args = p.parse_args(argv)
    if not args.terms and not args.report:
        p.error("give --terms MIN-MAX (run one length) or --report")
    if args.terms:
        run_length(args.terms, args.output_dir, args.steps)
    if args.report:
        print(report(args.output_dir, args.figure))
    return 0


if __name__ == "__main__":
    sys.exit(main())
