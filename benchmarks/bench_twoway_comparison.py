"""GROUP-PPO against PPO (verl's GAE) and GRPO on the two-way maths task, and the critic's explained variance.

    python benchmarks/bench_twoway_comparison.py            # run what is missing (resumable), then report
    python benchmarks/bench_twoway_comparison.py --report   # the tables from the kept records
    python benchmarks/bench_twoway_comparison.py --sweep critic_warmup

``--sweep comparison`` (the default) is the pre-registered comparison of docs/results.md ("Format learning on
two-way questions"): every arm runs ``examples/cpu/run_twoway_<arm>.sh`` at the launcher's settings, seed by seed
(``data.seed`` and the rollout's sampling seed). ``--sweep critic_warmup`` runs group_ppo with verl's
``trainer.critic_warmup`` at each setting of :data:`WARMUPS` (critic-only steps first, then the launcher's training
steps). Each finished run is kept as one JSON record (its command, verl's validation before and after, the per-step
metrics the report reads) under benchmarks/results/twoway/<sweep>/; an interrupted sweep resumes at the first
missing run.
"""

from __future__ import annotations

import argparse
import os
from statistics import mean, median

from benchlib import REPO, Run, Sweep, cell, differences, plan, run_launcher, run_pending
from verl_group_ppo.tasks.maths.spec import TWOWAY

RESULTS = os.path.join("benchmarks", "results", "twoway")
STEPS = TWOWAY.steps  # the launcher's default, which the records are checked against
SEEDS = {"group_ppo": (0, 1, 2), "gae": (0, 1, 2), "grpo": (0, 1)}
PAIRS = (("group_ppo", "gae"), ("group_ppo", "grpo"), ("gae", "grpo"))
WARMUPS = (0, 5, 10)
WINDOW = 5  # steps in the reward's first and last windows
VAL = "val-core/verl_group_ppo/smollm2_math/reward/mean@1"
AUX = "val-aux/verl_group_ppo/smollm2_math/{}/mean@1"
KEEP = ("critic/score/", "critic/vf_explained_var", "critic/returns/", "critic/values/", "response_length/mean",
        "group/", "timing_s/", "actor/ppo_kl", "actor/entropy", "val-")


def sweep(name: str) -> tuple[Sweep, list[str]]:
    """The sweep's plan and each run's arm order."""
    if name == "comparison":
        runs = [Run(arm, seed) for arm, seeds in SEEDS.items() for seed in seeds]
        return Sweep(os.path.join(REPO, RESULTS, name), tuple(plan(runs, list(SEEDS)))), list(SEEDS)
    arms = [f"warmup{w}" for w in WARMUPS]
    return Sweep(os.path.join(REPO, RESULTS, name), tuple(Run(arm, 0) for arm in arms)), arms


def run_one(run: Run, sweep_name: str, work_dir: str) -> dict:
    """Run the launcher for ``run``; the record keeps the metrics the report reads."""
    estimator, warmup = (run.arm, 0) if sweep_name == "comparison" else ("group_ppo", int(run.arm[len("warmup"):]))
    overrides = [f"data.seed={run.seed}", f"actor_rollout_ref.rollout.seed={run.seed}",
                 f"trainer.critic_warmup={warmup}", f"trainer.test_freq={STEPS + warmup}",
                 f"trainer.experiment_name=twoway_{sweep_name}_{run.arm}_seed{run.seed}"]
    label = f"{run.arm}-seed{run.seed}"
    result = run_launcher(estimator, STEPS + warmup, overrides, env={"TASK": "twoway", "WORK_DIR": work_dir},
                          log_path=os.path.join(REPO, "runs", "twoway", sweep_name, f"{label}.log"),
                          checkpoint_dir=os.path.join(REPO, "runs", "twoway", sweep_name, "checkpoints", label))
    steps = {str(s): {k: v for k, v in m.items() if k.startswith(KEEP)} for s, m in result.steps.items()}
    return {"arm": run.arm, "estimator": estimator, "seed": run.seed, "critic_warmup": warmup, "steps_planned": STEPS,
            "command": result.command, "seconds": round(result.seconds, 1), "steps": steps}


def accept(record: dict) -> bool:
    return record.get("steps_planned") == STEPS


def summary(record: dict) -> dict:
    """Per run: validation before and after (accuracy, answered, bare), the training reward over the first and
    last :data:`WINDOW` training steps and over all of them (area), and the critic's explained variance."""
    steps = {int(s): m for s, m in record["steps"].items()}
    first, last = steps[0], steps[max(steps)]
    trained = [s for s in sorted(steps) if s > record["critic_warmup"]]
    reward = [steps[s]["critic/score/mean"] for s in trained]
    return {"val_before": first[VAL], "val_after": last[VAL],
            "answered_before": first[AUX.format("answered")], "answered_after": last[AUX.format("answered")],
            "bare_after": last[AUX.format("bare")],
            "first": mean(reward[:WINDOW]), "last": mean(reward[-WINDOW:]), "area": mean(reward),
            "ev": explained_variance_windows(steps)}


def explained_variance_windows(steps: dict[int, dict]) -> list[tuple[int, int, float]]:
    """verl's ``critic/vf_explained_var`` as (first step, last step, median) over windows of 10 steps, counting only
    the steps whose batch has rewards that differ (with equal returns the variance is 0 and the figure means
    nothing); none for a run without a critic."""
    usable = [(s, m["critic/vf_explained_var"]) for s, m in sorted(steps.items())
              if s > 0 and "critic/vf_explained_var" in m and m["critic/score/max"] > m["critic/score/min"]]
    out = []
    for start in range(1, max(steps) + 1, 10):
        window = [ev for s, ev in usable if start <= s < start + 10]
        if window:
            out.append((start, min(start + 9, max(steps)), median(window)))
    return out


def report(sweep_name: str, records: list[dict] | None = None) -> str:
    """The tables of ``records`` (default: the kept ones) and the planned runs they lack."""
    the_sweep, arms = sweep(sweep_name)
    if records is None:
        records = [r for _, r in the_sweep.records(accept)]
    done = {(r["arm"], r["seed"]) for r in records}
    missing = [run.label() for run in the_sweep.runs if (run.arm, run.seed) not in done]
    rows = ["| arm | seeds | val before | val after | answered before -> after | reward, first 5 | reward, last 5 | "
            "area | explained variance (median per 10 steps, batches whose rewards differ) |", "|---" * 9 + "|"]
    for arm in arms:
        mine = [(r["seed"], summary(r)) for r in records if r["arm"] == arm]
        if not mine:
            continue
        avg = {k: mean(s[k] for _, s in mine) for k in mine[0][1] if k != "ev"}
        ev = " / ".join(", ".join(f"{e:+.2f}" for _, _, e in s["ev"]) or "-" for _, s in mine)
        rows.append(f"| {arm} | {', '.join(str(seed) for seed, _ in mine)} | {avg['val_before']:.3f} | "
                    f"{avg['val_after']:.3f} | {avg['answered_before']:.2f} -> {avg['answered_after']:.2f} | "
                    f"{avg['first']:.3f} | {avg['last']:.3f} | {avg['area']:.3f} | {ev} |")
    if sweep_name == "comparison" and records:
        values = [{"estimator": r["arm"], "seed": r["seed"], **summary(r)} for r in records]
        diffs = differences(values, PAIRS, {"val after": "val_after", "last 5": "last", "area": "area"})
        rows += ["", "| pair | val after | reward, last 5 | area |", "|---|---|---|---|"]
        for (arm, base), (pair, metric) in zip(PAIRS, diffs.items()):
            planned = len(set(SEEDS[arm]) & set(SEEDS[base]))
            cells = [cell(d) if len(d["seeds"]) == planned else cell({**d, "verdict": f"no verdict before {planned}"})
                     for d in metric.values()]
            rows.append(f"| {pair} | " + " | ".join(cells) + " |")
    if missing:
        rows += ["", f"missing runs: {', '.join(missing)}"]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", choices=("comparison", "critic_warmup"), default="comparison")
    parser.add_argument("--work-dir", default=os.path.join(REPO, "runs", "cpu-twoway"),
                        help="the task's directory (the launcher prepares it when needed)")
    parser.add_argument("--report", action="store_true", help="only print the tables from the kept records")
    args = parser.parse_args(argv)
    if not args.report:
        the_sweep, _ = sweep(args.sweep)
        run_pending(the_sweep, lambda run: run_one(run, args.sweep, os.path.abspath(args.work_dir)), accept,
                    tag=f"twoway {args.sweep}")
    print(report(args.sweep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
