"""GROUP-PPO against PPO (verl's GAE), GRPO and GROUP-PPO's prefix-tree values on the arithmetic maths task.

    python benchmarks/bench_arith_comparison.py                 # run what is missing (resumable), then report
    python benchmarks/bench_arith_comparison.py --from-end      # a second worker: the pending runs from the last back
    python benchmarks/bench_arith_comparison.py --report        # the tables from the kept records
    python benchmarks/bench_arith_comparison.py --log runs/arith_full.log   # one launcher run's summary

The pre-registered comparison: every arm of :data:`ARMS` runs ``examples/cpu/common.sh`` with ``TASK=arith`` at the
launcher's settings (its steps), validated greedily on the 1024 test questions after the last step only, seeds 0, 1
and 2 (``data.seed`` and the rollout's sampling seed), every arm of a seed before the next seed. The validation
before training is greedy from the same pretrained weights for every arm and seed, so it is measured once, by the
sweep's first run :data:`START` (verl's ``trainer.val_only``), and shared. ``group_ppo_prefix_tree`` is group_ppo
with ``VALUE_SOURCE=prefix_tree`` (no critic; groups of the spec's ``value_group_size`` tokens). Each finished run
is kept as one JSON record (its command, seconds and the per-step metrics of :data:`KEEP`) under
benchmarks/results/arith/comparison/, its log under runs/arith/comparison/; an interrupted sweep resumes at the
first missing run.

Per run (:func:`summarise`, shared by the records and ``--log``): validation accuracy per module (verl's
``val-core/<source>/reward/mean@1``) and pooled over the test questions (each module weighted by its question
count), the answered rate (``val-aux/<source>/answered/mean@1``), the rise of pooled accuracy from step 0 (the start
record's) to the end in binomial standard errors of the difference; the training reward ``critic/score/mean`` over
the first and last :data:`WINDOW` steps and over all steps (area); verl's ``critic/vf_explained_var``, median over
the second half of the steps whose batch rewards differ (runs with a critic); mean ``timing_s/step`` (validation
not included). Pairs compare val after, reward over the last window and area seed by seed: win when every seed's
difference is positive and the mean exceeds 2 paired SE, lose by the mirror rule, else level; no verdict before all
planned seeds are in.
"""

from __future__ import annotations

import argparse
import math
import os
from statistics import mean, median

from benchlib import REPO, Run, Sweep, cell, differences, plan, run_launcher, run_pending
from verl_group_ppo.logs import parse_step_metrics
from verl_group_ppo.tasks.maths.prepare import PrepareSettings
from verl_group_ppo.tasks.maths.spec import ARITH
from verl_group_ppo.tasks.contract import KEY_FILE, read_key

RESULTS = os.path.join(REPO, "benchmarks", "results", "arith", "comparison")
RUNS = os.path.join(REPO, "runs", "arith", "comparison")  # logs and checkpoints (not committed)
STEPS = ARITH.steps  # the launcher's own; the records are checked against it
SEEDS = (0, 1, 2)
START = Run("start", 0)
"""The sweep's first run: verl's validation of the pretrained model alone (no training step), every arm's step 0."""
ARMS = {"group_ppo": ("group_ppo", ""), "gae": ("gae", ""), "grpo": ("grpo", ""),
        "group_ppo_prefix_tree": ("group_ppo", "prefix_tree")}
"""arm -> (launcher estimator, its VALUE_SOURCE; "" is the estimator's default)."""
PAIRS = (("group_ppo", "gae"), ("group_ppo", "grpo"), ("gae", "grpo"), ("group_ppo_prefix_tree", "group_ppo"),
         ("group_ppo_prefix_tree", "gae"), ("group_ppo_prefix_tree", "grpo"))
WINDOW = 4  # steps in the reward's first and last windows
METRICS = {"val after": "val_after", f"reward, last {WINDOW}": "last", "area": "area"}
N_TEST = PrepareSettings().n_test
SOURCES = ARITH.data_sources  # in module order: the test split gives module i questions i, i + 3, ...
def counts(n_test: int = N_TEST) -> dict[str, int]:
    """Test questions per source: the split gives module i questions i, i + 3, ..."""
    return {src: len(range(i, n_test, len(SOURCES))) for i, src in enumerate(SOURCES)}


COUNTS = counts()
VAL, ANSWERED, EV = "val-core/{}/reward/mean@1", "val-aux/{}/answered/mean@1", "critic/vf_explained_var"
KEEP = ("critic/score/", EV, "response_length/mean", "group/", "timing_s/", "actor/ppo_kl", "actor/entropy", "val-")


def sweep() -> Sweep:
    return Sweep(RESULTS, (START, *plan([Run(arm, seed) for arm in ARMS for seed in SEEDS], list(ARMS))))


def launch(run: Run, work_dir: str) -> dict:
    """:func:`benchlib.run_launcher`'s arguments for ``run`` (nothing runs): :data:`START` validates GRPO's actor
    (no critic to build) before any step and stops; an arm trains its steps and validates after the last."""
    label = f"{run.arm}-seed{run.seed}"
    if run == START:
        estimator, value_source, steps = "grpo", "", 0
        validation = ["trainer.val_before_train=True", "trainer.val_only=True"]
    else:
        (estimator, value_source), steps = ARMS[run.arm], STEPS
        validation = ["trainer.val_before_train=False", f"trainer.test_freq={STEPS}"]
    return {"estimator": estimator, "steps": steps,
            "overrides": [f"data.seed={run.seed}", f"actor_rollout_ref.rollout.seed={run.seed}", *validation,
                          f"trainer.experiment_name=arith_comparison_{run.arm}_seed{run.seed}"],
            # VALUE_SOURCE is always set, so that no arm inherits one from the shell
            "env": {"TASK": "arith", "WORK_DIR": work_dir, "VALUE_SOURCE": value_source},
            "log_path": os.path.join(RUNS, f"{label}.log"), "checkpoint_dir": os.path.join(RUNS, "checkpoints", label)}


def prepared_n_test(work_dir: str) -> int:
    """The test questions of the task prepared in ``work_dir``: its key file's ``n_test``."""
    key = read_key(work_dir) or {}
    if not isinstance(key.get("n_test"), int):
        raise SystemExit(f"--work-dir {work_dir}: {KEY_FILE} is missing or has no n_test; prepare the task there "
                         "with python -m verl_group_ppo.tasks.maths.prepare --output-dir WORK_DIR")
    return key["n_test"]


def run_one(run: Run, work_dir: str) -> dict:
    """Run the launcher for ``run`` (it prepares ``work_dir`` when needed); the record keeps the metrics of
    :data:`KEEP` and the prepared task's ``n_test``."""
    args = launch(run, work_dir)
    result = run_launcher(**args)
    steps = {str(s): {k: v for k, v in m.items() if k.startswith(KEEP)} for s, m in result.steps.items()}
    return {"arm": run.arm, "estimator": args["estimator"], "seed": run.seed, "steps_planned": args["steps"],
            "n_test": prepared_n_test(work_dir), "command": result.command, "seconds": round(result.seconds, 1),
            "steps": steps}


def accept(record: dict) -> bool:
    """The start record validated step 0; an arm's record trained :data:`STEPS` steps and validated the last."""
    validated = {int(s) for s, m in record.get("steps", {}).items() if all(VAL.format(src) in m for src in SOURCES)}
    if record.get("arm") == START.arm:
        return record.get("steps_planned") == 0 and validated == {0}
    return record.get("steps_planned") == STEPS and STEPS in validated


def avg(values) -> float:
    values = list(values)
    return mean(values) if values else math.nan


def pooled(per_source: dict[str, float], n_test: int = N_TEST) -> float:
    """The accuracy over ``n_test`` test questions: each source's figure weighted by its question count."""
    n = counts(n_test)
    return sum(n[s] * v for s, v in per_source.items()) / sum(n[s] for s in per_source)


def rise(p0: float, p1: float, n: int = N_TEST) -> tuple[float, float, str]:
    """(p1 - p0, the binomial SE of that difference, sqrt(p0 (1 - p0) / n + p1 (1 - p1) / n), and whether it
    exceeds 2 SE: "yes", "drop" (below -2 SE) or "no")."""
    diff, se = p1 - p0, math.sqrt(p0 * (1 - p0) / n + p1 * (1 - p1) / n)
    return diff, se, "yes" if diff > 2 * se else "drop" if diff < -2 * se else "no"


def summarise(steps: dict[int, dict[str, float]], n_test: int = N_TEST) -> dict:
    """One run's figures from its ``{step: metrics}``: ``val`` per validated step (``pooled``, ``answered``
    pooled, ``modules``: source -> (accuracy, answered)), the reward windows, ``ev_steps`` and ``ev`` (None
    without a critic), and the mean of every ``timing_s/*`` over the training steps that log it."""
    val = {}
    for s in sorted(steps):
        if all(VAL.format(src) in steps[s] for src in SOURCES):
            modules = {src: (steps[s][VAL.format(src)], steps[s].get(ANSWERED.format(src), math.nan))
                       for src in SOURCES}
            val[s] = {"pooled": pooled({k: v[0] for k, v in modules.items()}, n_test),
                      "answered": pooled({k: v[1] for k, v in modules.items()}, n_test), "modules": modules}
    trained = [s for s in sorted(steps) if s > 0 and "critic/score/mean" in steps[s]]
    reward = [steps[s]["critic/score/mean"] for s in trained]
    ev_steps = [(s, steps[s][EV]) for s in trained if EV in steps[s]]
    # the second half, batches whose rewards differ (with equal returns EV means nothing; kept where not logged)
    late = [ev for s, ev in ev_steps if s > trained[-1] / 2
            and steps[s].get("critic/score/max", 1.0) > steps[s].get("critic/score/min", 0.0)]
    keys = sorted({k for s in trained for k in steps[s] if k.startswith("timing_s/")})
    return {"n_test": n_test, "val": val, "first": avg(reward[:WINDOW]), "last": avg(reward[-WINDOW:]),
            "area": avg(reward),
            "ev_steps": ev_steps, "ev": (median(late) if late else math.nan) if ev_steps else None,
            "timing": {k: (avg(steps[s][k] for s in trained if k in steps[s]),
                           [s for s in trained if k in steps[s]]) for k in keys}}


def record_summary(record: dict) -> dict:
    """:func:`summarise` of a kept record."""
    return summarise({int(k): m for k, m in record["steps"].items()}, record.get("n_test", N_TEST))


def figures(record: dict, s0: dict | None) -> dict:
    """A record's :func:`summarise` with the report's keys, its step 0 taken from ``s0``, the start record's summary
    (NaN without one, or for a step not validated)."""
    s = record_summary(record)

    def val(summary: dict | None, step: int, key: str) -> float:
        return summary["val"][step][key] if summary and step in summary["val"] else math.nan

    return {**s, "arm": record["arm"], "seed": record["seed"], "val_before": val(s0, 0, "pooled"),
            "val_after": val(s, STEPS, "pooled"), "answered_before": val(s0, 0, "answered"),
            "answered_after": val(s, STEPS, "answered"),
            **{src: s["val"][STEPS]["modules"][src][0] if STEPS in s["val"] else math.nan for src in SOURCES},
            "step_s": s["timing"].get("timing_s/step", (math.nan,))[0]}


def short(src: str) -> str:
    return src.rsplit("/", 1)[1]


def rise_cells(p0: float, p1: float, n: int = N_TEST) -> list[str]:
    """p0, p1, the rise, its SE over ``n`` questions, the rise in SEs and the 2-SE flag, formatted."""
    diff, se, flag = rise(p0, p1, n)
    return [f"{p0:.3f}", f"{p1:.3f}", f"{diff:+.3f}", f"{se:.3f}", f"{diff / se if se else math.nan:+.1f}", flag]


def report(records: list[dict] | None = None) -> str:
    """The arm, rise and pair tables of ``records`` (default: the kept ones) and the planned runs they lack."""
    if records is None:
        records = [r for _, r in sweep().records(accept)]
    start = next((r for r in records if r["arm"] == START.arm), None)
    s0 = record_summary(start) if start else None
    rows = [figures(r, s0) for r in records if r is not start]
    done = {(r["arm"], r["seed"]) for r in [*rows, *([start] if start else [])]}
    missing = [run for run in sweep().runs if (run.arm, run.seed) not in done]
    out = []
    if s0:
        v0 = s0["val"][0]
        out += [f"start (every run's step 0): pooled {v0['pooled']:.3f}, answered {v0['answered']:.2f}; "
                + ", ".join(f"{short(k)} {v[0]:.3f}" for k, v in v0["modules"].items()), ""]
    out += ["| arm | seeds | val before | val after | "
           + " | ".join(f"after: {short(s)}" for s in SOURCES) + f" | answered before -> after | reward, first "
           f"{WINDOW} | reward, last {WINDOW} | area | EV (median, 2nd half) | s / step |",
           "|---" * (len(SOURCES) + 10) + "|"]
    for arm in ARMS:
        mine = [r for r in rows if r["arm"] == arm]
        if not mine:
            continue
        m = {k: avg(r[k] for r in mine) for k in ("val_before", "val_after", "answered_before",
                                                   "answered_after", "first", "last", "area", "step_s", *SOURCES)}
        evs = [r["ev"] for r in mine if r["ev"] is not None]
        out.append(f"| {arm} | {', '.join(str(r['seed']) for r in mine)} | {m['val_before']:.3f} | "
                   f"{m['val_after']:.3f} | " + " | ".join(f"{m[s]:.3f}" for s in SOURCES)
                   + f" | {m['answered_before']:.2f} -> {m['answered_after']:.2f} | {m['first']:.3f} | "
                   f"{m['last']:.3f} | {m['area']:.3f} | {f'{avg(evs):+.2f}' if evs else '-'} | {m['step_s']:.1f} |")
    out += ["", "| run | val step 0 | val after | rise | binomial SE | rise / SE | > 2 SE |",
            "|---" * 7 + "|"]
    out += [f"| {r['arm']} seed {r['seed']} | " + " | ".join(rise_cells(r["val_before"], r["val_after"], r["n_test"]))
            + " |"
            for r in rows]
    if rows:
        diffs = differences(rows, PAIRS, METRICS, arm_key="arm")
        out += ["", "| pair | " + " | ".join(METRICS) + " | missing runs |", "|---" * (len(METRICS) + 2) + "|"]
        for (arm, base), (pair, metric) in zip(PAIRS, diffs.items()):
            lacking = [run.label() for run in missing if run.arm in (arm, base)]
            cells = [cell({**d, "verdict": "no verdict"} if lacking else d) for d in metric.values()]
            out.append(f"| {pair} | " + " | ".join(cells) + f" | {', '.join(lacking) or '-'} |")
    if missing:
        out += ["", f"missing runs: {', '.join(run.label() for run in missing)}"]
    return "\n".join(out)


def log_report(text: str, n_test: int = N_TEST) -> str:
    """One launcher run's output (validated on ``n_test`` questions): validation per module and pooled, the rise,
    rewards, EV and step times."""
    steps = parse_step_metrics(text)
    if not steps:
        return "no `step:N - ...` metric lines found"
    s = summarise(steps, n_test)
    n = counts(n_test)
    out = [f"steps logged: {min(steps)}..{max(steps)} ({len(steps)})", "",
           "| step | module (questions) | accuracy | answered | accuracy among answered |", "|---|---|---|---|---|"]
    for step, v in s["val"].items():
        for name, (acc, ans), size in [*((short(k), m, n[k]) for k, m in v["modules"].items()),
                                       ("pooled", (v["pooled"], v["answered"]), n_test)]:
            out.append(f"| {step} | {name} ({size}) | {acc:.3f} | {ans:.3f} | {acc / ans if ans else math.nan:.3f} |")
    if len(s["val"]) >= 2:
        (a, first), (b, last) = list(s["val"].items())[0], list(s["val"].items())[-1]
        cells = rise_cells(first["pooled"], last["pooled"], n_test)
        out += ["", f"pooled accuracy, step {a} -> {b}: {cells[0]} -> {cells[1]}, rise {cells[2]}, binomial SE "
                    f"{cells[3]} (n = {n_test}), {cells[4]} SE; > 2 SE: {cells[5]}"]
    out += ["", f"critic/score/mean: first {WINDOW} steps {s['first']:.3f}, last {WINDOW} {s['last']:.3f}, "
                f"all steps (area) {s['area']:.3f}"]
    if s["ev_steps"]:
        out += [f"{EV} per step: " + ", ".join(f"{k}: {e:+.2f}" for k, e in s["ev_steps"]),
                f"{EV} median over the second half (batches whose rewards differ): {s['ev']:+.2f}"]
    step_s = s["timing"].get("timing_s/step", (math.nan,))[0]
    out += ["", "| phase | steps | mean s | share of step |", "|---|---|---|---|"]
    for key, (value, logged) in sorted(s["timing"].items(), key=lambda kv: -kv[1][0]):
        if key != "timing_s/testing":
            out.append(f"| {key} | {len(logged)} | {value:.2f} | {value / step_s:.1%} |")
    if "timing_s/testing" in s["timing"]:
        value, logged = s["timing"]["timing_s/testing"]
        out.append(f"\nvalidation (timing_s/testing, outside timing_s/step): {value:.1f} s at steps "
                   f"{', '.join(map(str, logged))}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default=os.path.join(REPO, "runs", "cpu-arith"),
                        help="the task's directory (the launcher prepares it when needed)")
    parser.add_argument("--report", action="store_true", help="only print the tables from the kept records")
    parser.add_argument("--from-end", action="store_true",
                        help="take the pending runs from the last backwards: a second worker beside one started "
                             "without it (each skips a run the other finished)")
    parser.add_argument("--log", metavar="PATH", help="only summarise one launcher output file")
    parser.add_argument("--n-test", type=int, default=N_TEST,
                        help="with --log: the run's validation questions (prepare's --n-test)")
    args = parser.parse_args(argv)
    if args.log:
        with open(args.log, errors="replace") as f:
            print(log_report(f.read(), args.n_test))
        return 0
    if not args.report:
        the_sweep = sweep()
        if args.from_end:
            the_sweep = the_sweep._replace(runs=tuple(reversed(the_sweep.runs)))
        run_pending(the_sweep, lambda run: run_one(run, os.path.abspath(args.work_dir)), accept, tag="arith comparison")
    print(report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
