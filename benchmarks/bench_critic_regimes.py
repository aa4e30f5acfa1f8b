#!/usr/bin/env python3
"""Where bootstrapping pays: the estimator family against PPO in two critic regimes, one run at a time.

The pre-registered comparison of docs/results.md ("Critic regimes"): the default task, the demo's warm start,
two critic regimes (``recipe``: the demo's critic recipe as it is; ``pretrained``: the same, starting from a
critic pretrained on the warm-start policy's samples, :mod:`verl_group_ppo.demo.pretrain`), and the arms
group_ppo, group_ppo_per_token, endpoint_loss, gae (lam 1), vapo in each regime and grpo once (it has no
critic). Run it, and rerun the same command after an interruption::

    .venv/bin/python benchmarks/bench_critic_regimes.py --output-dir runs/critic-regimes

Each finished run is written to its own JSON file (``RUNS/<regime>/<arm>-seed<seed>.json``); a rerun skips
the finished ones and starts the unfinished ones again, and reuses the cached warm start and pretrained critic
(``setup/cache``). The report, with whatever runs exist (the missing ones are listed)::

    .venv/bin/python benchmarks/bench_critic_regimes.py --output-dir runs/critic-regimes --report

prints per regime the paired differences to PPO with the rule's verdicts, every arm's mean final accuracy
and its critic's final explained variance, and draws ``docs/critic_regimes.png`` (``--figure``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, NamedTuple, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_edge_vs_length as edge  # noqa: E402  (the paired differences and the table cells)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REGIMES = ("recipe", "pretrained")
#: value pretraining of the ``pretrained`` regime (fixed before the comparison: docs/results.md)
PRETRAINED: dict[str, Any] = {"critic_pretrain_steps": 400, "critic_pretrain_lr": 3e-4, "critic_pretrain_epochs": 1,
                              "critic_pretrain_clip": 0.5, "critic_pretrain_lam": 1.0}
#: (arm, seeds) in every regime with a critic; GRPO (no critic) runs once, in the first regime
CRITIC_ARMS = (("group_ppo", (0, 1, 2, 3)), ("gae", (0, 1, 2, 3)), ("group_ppo_per_token", (0, 1, 2)),
               ("endpoint_loss", (0, 1, 2)), ("vapo", (0, 1, 2)))
NO_CRITIC_ARMS = (("grpo", (0, 1, 2)),)
#: the differences reported per regime: every arm against PPO, the one-key ablation and the endpoint loss
#: against GROUP-PPO (the defaults rule's pairs)
PAIRS = (("group_ppo", "gae"), ("group_ppo_per_token", "gae"), ("endpoint_loss", "gae"), ("vapo", "gae"),
         ("grpo", "gae"), ("group_ppo_per_token", "group_ppo"), ("endpoint_loss", "group_ppo"))
ARM_ORDER = ("group_ppo", "group_ppo_per_token", "endpoint_loss", "gae", "vapo", "grpo")
#: a run's critic explained variance at the end: the mean of its last steps' ``critic/vf_explained_var``
EV_LAST_STEPS = 10


class Job(NamedTuple):
    """One run of the sweep."""

    regime: str
    arm: str
    seed: int


def plan() -> list[Job]:
    """Every run, seed by seed (so that an interrupted sweep has whole seeds of every arm): seed 0 of every arm
    in both regimes, then seed 1, ..."""
    jobs = [Job(REGIMES[0], arm, s) for arm, seeds in NO_CRITIC_ARMS for s in seeds]
    jobs += [Job(regime, arm, s) for regime in REGIMES for arm, seeds in CRITIC_ARMS for s in seeds]
    return sorted(jobs, key=lambda j: (j.seed, REGIMES.index(j.regime), ARM_ORDER.index(j.arm)))


def run_path(out_dir: str, job: Job) -> str:
    return os.path.join(out_dir, "runs", job.regime, f"{job.arm}-seed{job.seed}.json")


def load_run(path: str, steps: Optional[int] = None) -> Optional[dict]:
    """A finished run's record, or None when the file is missing, unreadable or from another step count."""
    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if steps is not None and record.get("steps") != steps:
        return None
    return record


def pending(out_dir: str, steps: int) -> list[Job]:
    """The planned runs without a finished record for ``steps`` steps."""
    return [job for job in plan() if load_run(run_path(out_dir, job), steps) is None]


def final_critic_ev(history: list[dict], last: int = EV_LAST_STEPS) -> Optional[float]:
    """Mean ``critic/vf_explained_var`` over a run's last ``last`` steps (None without a critic)."""
    values = [h["critic/vf_explained_var"] for h in history[-last:] if "critic/vf_explained_var" in h]
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else None


def run_record(job: Job, result: dict, pretrain_info: dict) -> dict:
    """What one run's file keeps: the fields the report and ``demo.report`` read, the critic's final explained
    variance and the pretrained critic's held-out explained variance (pretrained regime)."""
    keep = ("estimator", "seed", "final_eval_accuracy", "final_eval_samples", "curve_area", "steps", "curve",
            "greedy_curve", "final_greedy_accuracy", "wall_time_s", "final_threshold")
    record = {k: result[k] for k in keep if k in result}
    record.update(regime=job.regime, final_critic_explained_variance=final_critic_ev(result["history"]),
                  pretrained_heldout_explained_variance=pretrain_info.get("heldout_explained_variance"))
    return record


def write_json(path: str, data: dict) -> None:
    """Write atomically: a run interrupted while writing leaves no half file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def pretrain_config(regime: str):
    from verl_group_ppo.demo.pretrain import PretrainConfig

    return PretrainConfig(**PRETRAINED) if regime == "pretrained" else PretrainConfig()


def run_sweep(out_dir: str, steps: int, log=print) -> int:
    """Every pending run, one after the other, each written when it finishes; returns how many ran."""
    import torch

    import verl_group_ppo.demo.report  # noqa: F401  (loaded now: the report after hours of runs needs no file)
    from verl_group_ppo.demo.cli import DemoOptions, setup_demo
    from verl_group_ppo.demo.rl import RunConfig, run_one

    torch.set_num_threads(1)
    todo = pending(out_dir, steps)
    total = len(plan())
    log(f"[regimes] {total - len(todo)} of {total} runs finished; {len(todo)} to run ({steps} steps each)")
    setups: dict[str, Any] = {}
    for i, job in enumerate(todo, 1):
        if job.regime not in setups:  # the warm start (and the pretrained critic) from setup/cache when cached
            setups[job.regime] = setup_demo(DemoOptions(output_dir=os.path.join(out_dir, "setup"), no_progress=True),
                                            RunConfig(steps=steps), "cpu", log, pretrain_config(job.regime))
        s = setups[job.regime]
        t0 = time.time()
        log(f"[regimes] run {i}/{len(todo)}: {job.regime} {job.arm} seed {job.seed}")

        def progress(rec: dict, job=job, t0=t0) -> None:
            if "eval/accuracy" in rec:
                log(f"[regimes]   {job.regime} {job.arm} seed {job.seed}: step {rec['step']}/{steps}, eval accuracy "
                    f"{rec['eval/accuracy']:.3f}, {time.time() - t0:.0f}s")

        result = run_one(job.arm, job.seed, s.cfg, s.task, s.tok, s.train, s.evals, s.init_state, "cpu",
                         on_step=progress)
        write_json(run_path(out_dir, job), run_record(job, result, s.critic_pretrain))
        log(f"[regimes] finished {job.regime} {job.arm} seed {job.seed}: final accuracy "
            f"{result['final_eval_accuracy']:.3f} in {time.time() - t0:.0f}s")
    return len(todo)


# ---------------------------------------------------------------------------------------------------------
# the report


def load_runs(out_dir: str) -> dict[str, list[dict]]:
    """Finished runs per regime; the no-critic arms (run once) are counted in every regime."""
    by_regime: dict[str, list[dict]] = {r: [] for r in REGIMES}
    shared = {arm for arm, _ in NO_CRITIC_ARMS}
    for job in plan():
        record = load_run(run_path(out_dir, job))
        if record is None:
            continue
        for regime in (REGIMES if job.arm in shared else (job.regime,)):
            by_regime[regime].append(record)
    return by_regime


def missing_runs(out_dir: str) -> list[Job]:
    return [job for job in plan() if load_run(run_path(out_dir, job)) is None]


def arm_summary(runs: list[dict]) -> dict[str, dict]:
    """Per arm: seeds, mean final accuracy, its standard error, and the critic's final explained variance."""
    out: dict[str, dict] = {}
    for arm in ARM_ORDER:
        rs = sorted((r for r in runs if r["estimator"] == arm), key=lambda r: r["seed"])
        if not rs:
            continue
        finals = [r["final_eval_accuracy"] for r in rs]
        mean = sum(finals) / len(finals)
        se = (math.sqrt(sum((x - mean) ** 2 for x in finals) / (len(finals) - 1) / len(finals))
              if len(finals) > 1 else None)
        evs = [r["final_critic_explained_variance"] for r in rs if r.get("final_critic_explained_variance") is not None]
        out[arm] = {"seeds": [r["seed"] for r in rs], "final_mean": mean, "final_se": se,
                    "critic_ev": sum(evs) / len(evs) if evs else None}
    return out


def _label(arm: str) -> str:
    from verl_group_ppo.demo.arms import ARMS

    return ARMS[arm].label


def report(out_dir: str, figure: str) -> str:
    """The markdown report of whatever runs exist (missing ones listed), and the figure."""
    by_regime = load_runs(out_dir)
    lines: list[str] = []
    summaries = {}
    for regime in REGIMES:
        runs = by_regime[regime]
        summaries[regime] = arm_summary(runs)
        lines += [f"### Regime `{regime}`", ""]
        pretrained = sorted({r["pretrained_heldout_explained_variance"] for r in runs
                             if r.get("pretrained_heldout_explained_variance") is not None})
        if pretrained:
            lines += [f"Pretrained critic, held-out explained variance before RL: {pretrained[0]:.3f}", ""]
        lines += ["| arm | final accuracy, mean (seeds) | critic explained variance at the end | - PPO, final "
                  "| - PPO, area |", "|---|---|---|---|---|"]
        diffs = edge.differences(runs, PAIRS)
        for arm, row in summaries[regime].items():
            ev = "n/a" if row["critic_ev"] is None else f"{row['critic_ev']:.3f}"
            pair = diffs.get(f"{arm}-gae")
            cells = (f"{edge._cell(pair['final'])} | {edge._cell(pair['area'])}" if pair else "(PPO) | (PPO)")
            lines.append(f"| {_label(arm)} | {row['final_mean']:.3f} ({len(row['seeds'])}) | {ev} | {cells} |")
        lines += ["", "| difference | final | area |", "|---|---|---|"]
        for arm, base in PAIRS:
            if base != "gae":
                d = diffs[f"{arm}-{base}"]
                lines.append(f"| {_label(arm)} - {_label(base)} | {edge._cell(d['final'])} | {edge._cell(d['area'])} |")
        lines.append("")
    lines += regime_differences(by_regime)
    missing = missing_runs(out_dir)
    if missing:
        lines.append(f"Missing runs ({len(missing)} of {len(plan())}): " +
                     ", ".join(f"{j.regime}/{j.arm}/seed {j.seed}" for j in missing))
    else:
        lines.append(f"All {len(plan())} runs finished.")
    if any(summaries[r] for r in REGIMES):
        plot(summaries, figure)
    return "\n".join(lines)


def regime_differences(by_regime: dict[str, list[dict]]) -> list[str]:
    """Table lines: each critic arm's ``pretrained - recipe`` paired difference (what pretraining does to it)."""
    tagged = [{**r, "estimator": f"{r['estimator']}@{regime}"} for regime, runs in by_regime.items() for r in runs]
    arms = [arm for arm, _ in CRITIC_ARMS]
    diffs = edge.differences(tagged, tuple((f"{a}@{REGIMES[1]}", f"{a}@{REGIMES[0]}") for a in arms))
    lines = [f"### `{REGIMES[1]}` - `{REGIMES[0]}`, per arm", "", "| arm | final | area |", "|---|---|---|"]
    for arm in arms:
        d = diffs[f"{arm}@{REGIMES[1]}-{arm}@{REGIMES[0]}"]
        if d["final"]["seeds"]:
            lines.append(f"| {_label(arm)} | {edge._cell(d['final'])} | {edge._cell(d['area'])} |")
    return lines + [""]


def plot(summaries: dict[str, dict], path: str) -> None:
    """Final accuracy per arm (mean +- 2 SE over seeds), one bar per regime."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in ARM_ORDER if any(a in summaries[r] for r in REGIMES)]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.38
    for k, (regime, color) in enumerate(zip(REGIMES, ("#7f7f7f", "#1f77b4"))):
        xs, ys, errs = [], [], []
        for i, arm in enumerate(arms):
            row = summaries[regime].get(arm)
            if row is None:
                continue
            xs.append(i + (k - 0.5) * width)
            ys.append(row["final_mean"])
            errs.append(2 * row["final_se"] if row["final_se"] is not None else 0.0)
        ax.bar(xs, ys, width, yerr=errs, capsize=4, color=color, label=f"critic: {regime}")
    ax.set_xticks(range(len(arms)))
    ax.set_xticklabels([_label(a).replace(" (", "\n(") for a in arms], fontsize=8)
    ax.set_ylabel("final sampled accuracy")
    low = min(r["final_mean"] for s in summaries.values() for r in s.values())
    ax.set_ylim(max(0.0, low - 0.1), None)
    ax.set_title("final accuracy per arm and critic regime (mean +- 2 SE over seeds; GRPO: one set of runs)")
    ax.legend()
    edge.save_figure(fig, path)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output-dir", default=os.path.join(REPO, "runs", "critic-regimes"),
                   help="where the runs, the setup cache and the log go (default: runs/critic-regimes)")
    p.add_argument("--steps", type=int, default=200, help="RL steps per run, the same for every arm (default: 200)")
    p.add_argument("--report", action="store_true", help="only print the report of the runs found and draw the figure")
    p.add_argument("--figure", default=os.path.join(REPO, "docs", "critic_regimes.png"),
                   help="the report's figure (default: docs/critic_regimes.png)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.steps < 200 and not args.report:
        build_parser().error("--steps: the pre-registered comparison needs at least 200 steps per run")
    if args.report:
        print(report(args.output_dir, args.figure))
        return 0
    for key, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)
    run_sweep(args.output_dir, args.steps, log=lambda m: print(m, flush=True))
    print(report(args.output_dir, args.figure))
    return 0


if __name__ == "__main__":
    sys.exit(main())
