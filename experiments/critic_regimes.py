"""Where bootstrapping pays: the estimator family against PPO in two critic regimes, one run at a time.

The pre-registered comparison of docs/results.md ("Critic regimes") on the default task from the demo's warm
start: group_ppo, group_ppo_per_token, endpoint_loss, gae (lam 1) and vapo in two critic regimes (``recipe``: the
demo's critic recipe; ``pretrained``: the same from a pretrained critic, :mod:`experiments.demo.pretrain`), and
grpo once (it has no critic). Rerun the first command after an interruption::

    .venv/bin/python -m experiments.critic_regimes --output-dir runs/critic-regimes
    .venv/bin/python -m experiments.critic_regimes --output-dir runs/critic-regimes --report

A finished run is kept as ``RUNS/<regime>/<arm>-seed<seed>.json`` and skipped by a rerun, which reuses the cached
warm start and pretrained critic. The report, of the runs found (missing ones listed): per regime each arm's mean
final accuracy, its critic's final explained variance and the paired differences to PPO with the rule's verdicts,
and the figure ``docs/critic_regimes.png`` (``--figure``).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from typing import Any

from benchmarks.benchlib import DEMO_METRICS, REPO, Run, Sweep, cell, differences, figure, plan, run_pending

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


def sweep(out_dir: str) -> Sweep:
    """Every run (``Run.condition`` is the regime), seed by seed, each kept in ``OUT/runs/<regime>/``."""
    runs = [Run(arm, s, REGIMES[0]) for arm, seeds in NO_CRITIC_ARMS for s in seeds]
    runs += [Run(arm, s, regime) for regime in REGIMES for arm, seeds in CRITIC_ARMS for s in seeds]
    return Sweep(os.path.join(out_dir, "runs"), tuple(plan(runs, ARM_ORDER, REGIMES)))


def finished(steps: int):
    """Accepts the records of runs of ``steps`` steps (other step counts are other runs)."""
    return lambda record: record.get("steps") == steps


def run_record(run: Run, result: dict, pretrain_info: dict) -> dict:
    """What one run's file keeps: the fields the report and ``demo.report`` read, the critic's final explained
    variance (the mean finite ``critic/vf_explained_var`` of the last :data:`EV_LAST_STEPS` steps; None without
    a critic) and the pretrained critic's held-out explained variance (pretrained regime)."""
    keep = ("estimator", "seed", "final_eval_accuracy", "final_eval_samples", "curve_area", "steps", "curve",
            "greedy_curve", "final_greedy_accuracy", "wall_time_s", "final_threshold")
    evs = [h.get("critic/vf_explained_var") for h in result["history"][-EV_LAST_STEPS:]]
    evs = [v for v in evs if v is not None and math.isfinite(v)]
    return {**{k: result[k] for k in keep if k in result}, "regime": run.condition,
            "final_critic_explained_variance": sum(evs) / len(evs) if evs else None,
            "pretrained_heldout_explained_variance": pretrain_info.get("heldout_explained_variance")}


def run_sweep(out_dir: str, steps: int, log=print) -> int:
    """Every pending run, one after the other, each written when it finishes; returns how many ran."""
    import torch

    import experiments.demo.report  # noqa: F401  (loaded now: the report after hours of runs needs no file)
    from experiments.demo.cli import DemoOptions, setup_demo
    from experiments.demo.pretrain import PretrainConfig
    from experiments.demo.rl import RunConfig, run_one

    torch.set_num_threads(1)
    setups: dict[str, Any] = {}

    def one(run: Run) -> dict:
        if run.condition not in setups:  # the warm start (and the pretrained critic) from setup/cache when cached
            pretrain = PretrainConfig(**PRETRAINED) if run.condition == "pretrained" else PretrainConfig()
            setups[run.condition] = setup_demo(DemoOptions(output_dir=os.path.join(out_dir, "setup"), no_progress=True),
                                               RunConfig(steps=steps), "cpu", log, pretrain)
        s, t0 = setups[run.condition], time.time()

        def progress(rec: dict) -> None:
            if "eval/accuracy" in rec:
                log(f"[regimes]   {run.label()}: step {rec['step']}/{steps}, eval accuracy {rec['eval/accuracy']:.3f}, "
                    f"{time.time() - t0:.0f}s")

        result = run_one(run.arm, run.seed, s.cfg, s.task, s.tok, s.train, s.evals, s.init_state, "cpu",
                         on_step=progress)
        log(f"[regimes] {run.label()}: final accuracy {result['final_eval_accuracy']:.3f}")
        return run_record(run, result, s.critic_pretrain)

    return run_pending(sweep(out_dir), one, finished(steps), log, "regimes")


def load_runs(runs: Sweep) -> dict[str, list[dict]]:
    """Finished runs per regime; the no-critic arms (run once) are counted in every regime."""
    shared = {arm for arm, _ in NO_CRITIC_ARMS}
    return {regime: [rec for run, rec in runs.records() if run.condition == regime or run.arm in shared]
            for regime in REGIMES}


def arm_summary(runs: list[dict]) -> dict[str, dict]:
    """Per arm: seeds, mean final accuracy, its standard error, and the critic's final explained variance."""
    out: dict[str, dict] = {}
    for arm in ARM_ORDER:
        rs = sorted((r for r in runs if r["estimator"] == arm), key=lambda r: r["seed"])
        if rs:
            finals = [r["final_eval_accuracy"] for r in rs]
            evs = [r["final_critic_explained_variance"] for r in rs
                   if r.get("final_critic_explained_variance") is not None]
            out[arm] = {"seeds": [r["seed"] for r in rs], "final_mean": statistics.fmean(finals),
                        "final_se": statistics.stdev(finals) / math.sqrt(len(rs)) if len(rs) > 1 else None,
                        "critic_ev": sum(evs) / len(evs) if evs else None}
    return out


def _label(arm: str) -> str:
    from experiments.demo.arms import ARMS

    return ARMS[arm].label


def regime_lines(regime: str, runs: list[dict], summary: dict[str, dict]) -> list[str]:
    """One regime's tables: each arm's final accuracy, critic explained variance and difference to PPO, then the
    differences of :data:`PAIRS` against GROUP-PPO."""
    lines = [f"### Regime `{regime}`", ""]
    pretrained = sorted({r["pretrained_heldout_explained_variance"] for r in runs
                         if r.get("pretrained_heldout_explained_variance") is not None})
    if pretrained:
        lines += [f"Pretrained critic, held-out explained variance before RL: {pretrained[0]:.3f}", ""]
    lines += ["| arm | final accuracy, mean (seeds) | critic explained variance at the end | - PPO, final "
              "| - PPO, area |", "|---|---|---|---|---|"]
    diffs = differences(runs, PAIRS, DEMO_METRICS)
    for arm, row in summary.items():
        ev = "n/a" if row["critic_ev"] is None else f"{row['critic_ev']:.3f}"
        pair = diffs.get(f"{arm}-gae")
        cells = f"{cell(pair['final'])} | {cell(pair['area'])}" if pair else "(PPO) | (PPO)"
        lines.append(f"| {_label(arm)} | {row['final_mean']:.3f} ({len(row['seeds'])}) | {ev} | {cells} |")
    lines += ["", "| difference | final | area |", "|---|---|---|"]
    lines += [f"| {_label(arm)} - {_label(base)} | {cell(diffs[f'{arm}-{base}']['final'])} | "
              f"{cell(diffs[f'{arm}-{base}']['area'])} |" for arm, base in PAIRS if base != "gae"]
    return lines + [""]


def report(out_dir: str, figure_path: str) -> str:
    """The markdown report of whatever runs exist (missing ones listed), and the figure."""
    runs = sweep(out_dir)
    by_regime = load_runs(runs)
    summaries = {regime: arm_summary(by_regime[regime]) for regime in REGIMES}
    lines = [line for regime in REGIMES for line in regime_lines(regime, by_regime[regime], summaries[regime])]
    lines += regime_differences(by_regime)
    missing = runs.pending()
    lines.append(f"Missing runs ({len(missing)} of {len(runs.runs)}): " +
                 ", ".join(f"{r.condition}/{r.arm}/seed {r.seed}" for r in missing) if missing
                 else f"All {len(runs.runs)} runs finished.")
    if any(summaries.values()):
        plot(summaries, figure_path)
    return "\n".join(lines)


def regime_differences(by_regime: dict[str, list[dict]]) -> list[str]:
    """Table lines: each critic arm's ``pretrained - recipe`` paired difference (what pretraining does to it)."""
    tagged = [{**r, "estimator": f"{r['estimator']}@{regime}"} for regime, runs in by_regime.items() for r in runs]
    arms = [arm for arm, _ in CRITIC_ARMS]
    diffs = differences(tagged, [(f"{a}@{REGIMES[1]}", f"{a}@{REGIMES[0]}") for a in arms], DEMO_METRICS)
    lines = [f"### `{REGIMES[1]}` - `{REGIMES[0]}`, per arm", "", "| arm | final | area |", "|---|---|---|"]
    for arm in arms:
        d = diffs[f"{arm}@{REGIMES[1]}-{arm}@{REGIMES[0]}"]
        if d["final"]["seeds"]:
            lines.append(f"| {_label(arm)} | {cell(d['final'])} | {cell(d['area'])} |")
    return lines + [""]


def figure_data(summaries: dict[str, dict]) -> dict[str, list[tuple[str, float, float]]]:
    """What the figure draws: per regime, ``(arm, mean final accuracy, 2 standard errors)`` of each arm it has."""
    return {regime: [(arm, row["final_mean"], 2 * row["final_se"] if row["final_se"] is not None else 0.0)
                     for arm, row in summaries[regime].items()] for regime in REGIMES}


def plot(summaries: dict[str, dict], path: str) -> None:
    """Final accuracy per arm (mean +- 2 SE over seeds), one bar per regime."""
    data = figure_data(summaries)
    arms = [a for a in ARM_ORDER if any(a == bar[0] for bars in data.values() for bar in bars)]
    width = 0.38
    with figure(path) as ax:
        for k, (regime, color) in enumerate(zip(REGIMES, ("#7f7f7f", "#1f77b4"))):
            xs = [arms.index(arm) + (k - 0.5) * width for arm, _, _ in data[regime]]
            ax.bar(xs, [y for _, y, _ in data[regime]], width, yerr=[e for _, _, e in data[regime]], capsize=4,
                   color=color, label=f"critic: {regime}")
        ax.set_xticks(range(len(arms)))
        ax.set_xticklabels([_label(a).replace(" (", "\n(") for a in arms], fontsize=8)
        ax.set_ylabel("final sampled accuracy")
        ax.set_ylim(max(0.0, min(y for bars in data.values() for _, y, _ in bars) - 0.1), None)
        ax.set_title("final accuracy per arm and critic regime (mean +- 2 SE over seeds; GRPO: one set of runs)")
        ax.legend()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output-dir", default=os.path.join(REPO, "runs", "critic-regimes"),
                   help="where the runs, the setup cache and the log go (default: runs/critic-regimes)")
    p.add_argument("--steps", type=int, default=200, help="RL steps per run, the same for every arm (default: 200)")
    p.add_argument("--report", action="store_true", help="only print the report of the runs found and draw the figure")
    p.add_argument("--figure", default=os.path.join(REPO, "docs", "critic_regimes.png"),
                   help="the report's figure (default: docs/critic_regimes.png)")
    args = p.parse_args(argv)
    if args.steps < 200 and not args.report:
        p.error("--steps: the pre-registered comparison needs at least 200 steps per run")
    if not args.report:
        for key, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
            os.environ.setdefault(key, value)
        run_sweep(args.output_dir, args.steps, log=lambda m: print(m, flush=True))
    print(report(args.output_dir, args.figure))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
