"""Does GROUP-PPO help over turns? The pre-registered comparison on the tiny tool task (docs/results.md,
"Multi-turn: the tool task"), through verl's real ``main_ppo`` and its tool agent loop.

    .venv/bin/python benchmarks/bench_multiturn.py                 # every run not yet done, then the report
    .venv/bin/python benchmarks/bench_multiturn.py --report        # the report of what is done

A run is ``examples/cpu/common.sh`` with ``MULTI_TURN=1`` (as ``run_tiny_multiturn_<estimator>.sh``) for ``--steps``
steps with ``data.seed=SEED`` on one shared warm start (``OUTPUT_DIR/task``, built by the first run; logs in
``OUTPUT_DIR/logs``), for each arm of :data:`ARMS` (group_ppo; group_ppo_turn: ``boundary_rule: turn``; gae, lam 1;
grpo) and its seeds. A finished run is kept as ``RESULTS_DIR/<arm>-seed<S>.json`` (its command and per-step
metrics; the committed ones are what docs/results.md reports) and skipped next time. The report: per arm the mean
training reward over the last 10 steps ("final") and all steps ("area") with verl's turns per response, and the
paired differences of :data:`PAIRS` with the rule's verdict.
"""

from __future__ import annotations

import argparse
import os
import sys
from statistics import mean
from typing import Any

from benchlib import REPO, Run, Sweep, differences, plan, plus_minus, read_json, run_launcher, run_pending
from verl_group_ppo.tasks import contract

#: arm -> (launcher estimator, extra overrides, seeds)
ARMS: dict[str, tuple[str, tuple[str, ...], tuple[int, ...]]] = {
    "group_ppo": ("group_ppo", (), (0, 1, 2, 3, 4, 5)),
    "group_ppo_turn": ("group_ppo", ("++algorithm.group_params.boundary_rule=turn",), (0, 1, 2)),
    "gae": ("gae", (), (0, 1, 2, 3, 4, 5)),
    "grpo": ("grpo", (), (0, 1, 2)),
}
#: overrides a record may hold beyond its arm's, because they change nothing: ``turn`` ignores the cap, and 96 is
#: the launcher's response length (the committed group_ppo_turn records carry it)
ALSO_ACCEPTED = {"group_ppo_turn": ("++algorithm.group_params.group_max_size=96",)}
#: the paired differences reported (arm, baseline): each arm against PPO, and turn groups against the defaults
PAIRS = (("group_ppo", "gae"), ("group_ppo_turn", "gae"), ("grpo", "gae"), ("group_ppo_turn", "group_ppo"))
#: the metrics kept per step (the training reward, the turn counts, the step's time)
KEPT = ("critic/score/mean", "num_turns/mean", "num_turns/max", "response_length/mean", "timing_s/step")
WINDOW = 10
RESULTS_DIR = os.path.join(REPO, "benchmarks", "results", "multiturn")


def sweep(results_dir: str) -> Sweep:
    """Every (arm, seed) of the comparison, seeds first, one record each in ``results_dir``."""
    runs = [Run(arm, seed) for arm, (_, _, seeds) in ARMS.items() for seed in seeds]
    return Sweep(results_dir, tuple(plan(runs, list(ARMS))))


def accepts(record: dict) -> bool:
    """Whether a record ran its arm's setting: the arm's estimator and exactly its ``+`` overrides (besides
    :data:`ALSO_ACCEPTED`)."""
    words = record.get("command", "").split()
    launcher = "examples/cpu/common.sh"
    if record.get("arm") not in ARMS or launcher not in words:
        return False
    estimator, extra, _ = ARMS[record["arm"]]
    given = {w for w in words if w.startswith("+")} - set(ALSO_ACCEPTED.get(record["arm"], ()))
    return words[words.index(launcher) + 1] == estimator and given == set(extra)


def run_one(out_dir: str, run: Run, steps: int, python: str) -> dict[str, Any]:
    """One launcher run; its record: the command and per-step metrics. Raises :class:`benchlib.LauncherError`
    with the log's tail when the run fails."""
    estimator, extra, _ = ARMS[run.arm]
    name = f"{run.arm}-seed{run.seed}"
    overrides = [f"data.seed={run.seed}", f"trainer.experiment_name=multiturn_{run.arm}_seed{run.seed}", *extra]
    done = run_launcher(estimator, steps, overrides,
                        env={"MULTI_TURN": "1", "WORK_DIR": os.path.join(out_dir, "task"), "PYTHON": python},
                        log_path=os.path.join(out_dir, "logs", f"{name}.log"),
                        checkpoint_dir=os.path.join(out_dir, "checkpoints", name))
    record = {"arm": run.arm, "seed": run.seed, "command": f"MULTI_TURN=1 {done.command}",
              "seconds": round(done.seconds, 1), "warm_start": warm_start(os.path.join(out_dir, "task")),
              "steps": {str(k): {m: v[m] for m in KEPT if m in v} for k, v in sorted(done.steps.items())}}
    m = run_metrics(record)
    print(f"[multiturn] {name}: final {m['final']:.3f}, area {m['area']:.3f}, turns {m['turns_first']:.2f} -> "
          f"{m['turns_last']:.2f}", flush=True)
    return record


def warm_start(task_dir: str) -> dict[str, float]:
    """What ``prepare`` measured of the shared warm start (its key file, ``data/prepare.json``): it tells the runs of one warm
    start from another's (``prepare`` is deterministic on one machine, not across CPUs)."""
    return read_json(contract.key_path(task_dir))["test_accuracy"]


def run_metrics(record: dict) -> dict[str, float]:
    """A run's final reward (mean of the last :data:`WINDOW` steps), area (mean of all steps), its turns per
    response at the first and the last :data:`WINDOW` steps, and its seconds per step."""
    steps = [record["steps"][k] for k in sorted(record["steps"], key=int)]
    score = [s["critic/score/mean"] for s in steps]
    turns = [s.get("num_turns/mean", float("nan")) for s in steps]
    return {"final": mean(score[-WINDOW:]), "area": mean(score), "first": mean(score[:WINDOW]),
            "turns_first": mean(turns[:WINDOW]), "turns_last": mean(turns[-WINDOW:]),
            "seconds_per_step": mean(s.get("timing_s/step", float("nan")) for s in steps[1:] or steps)}


def report(runs: list[dict]) -> str:
    """The per-arm table, the paired differences of :data:`PAIRS` with the rule's verdict, the warm starts, and
    the runs still missing."""
    metrics = [{"arm": r["arm"], "seed": int(r["seed"]), **run_metrics(r)} for r in runs]
    lines = ["| arm | seeds | final (last 10 steps) | area (all steps) | first 10 steps | turns/response first -> last 10 | s/step |",
             "|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        got = [m for m in metrics if m["arm"] == arm]
        if not got:
            lines.append(f"| {arm} | 0 | - | - | - | - | - |")
            continue
        avg = {k: mean(m[k] for m in got) for k in got[0] if k not in ("arm", "seed")}
        lines.append(f"| {arm} | {len(got)} | {avg['final']:.3f} | {avg['area']:.3f} | {avg['first']:.3f} | "
                     f"{avg['turns_first']:.2f} -> {avg['turns_last']:.2f} | {avg['seconds_per_step']:.2f} |")
    lines += ["", "Paired differences (mean +- 2 paired SE over common seeds; the rule's verdict):", "",
              "| pair | metric | seeds | difference | verdict |", "|---|---|---|---|---|"]
    diffs = differences(metrics, PAIRS, {"final": "final", "area": "area"}, arm_key="arm")
    for arm, base in PAIRS:
        for metric, d in diffs[f"{arm}-{base}"].items():
            found = "0 | - | -" if d["mean"] is None else f"{len(d['seeds'])} | {plus_minus(d)} | {d['verdict']}"
            lines.append(f"| {arm} - {base} | {metric} | {found} |")
    starts: dict[str, set[int]] = {}
    for r in runs:
        ws = r.get("warm_start")
        label = (f"sampled {ws['sampled']:.3f}, greedy {ws['greedy']:.3f}, calls/response "
                 f"{ws['calls_per_response']:.2f}" if ws else "not recorded")
        starts.setdefault(label, set()).add(int(r["seed"]))
    lines += ["", "Warm starts (the seeds that ran on each; a pair compares runs of one seed, so of one warm start "
              "when every arm of a seed ran on it):", ""]
    lines += [f"- {label}: seeds {', '.join(map(str, sorted(seeds)))}" for label, seeds in sorted(starts.items())]
    done = {(m["arm"], m["seed"]) for m in metrics}
    missing = [f"{r.arm}-seed{r.seed}" for r in sweep("").runs if (r.arm, r.seed) not in done]
    lines += ["", f"Missing runs ({len(missing)}): {', '.join(missing) if missing else 'none'}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output-dir", default=os.path.join(REPO, "runs", "multiturn-comparison"),
                   help="where the task, the logs and the checkpoints go (default: %(default)s)")
    p.add_argument("--results-dir", default=RESULTS_DIR, help="one JSON per finished run (default: %(default)s)")
    p.add_argument("--steps", type=int, default=40, help="training steps per run, the same for every arm (default: 40)")
    p.add_argument("--report", action="store_true", help="only print the report of the runs already done")
    p.add_argument("--python", default=sys.executable, help="interpreter with verl and verl-group-ppo")
    args = p.parse_args(argv)
    if args.steps < WINDOW:
        raise SystemExit(f"--steps must be at least {WINDOW} (the final reward averages the last {WINDOW} steps)")
    out_dir, results = os.path.abspath(args.output_dir), sweep(os.path.abspath(args.results_dir))
    if not args.report:
        print(f"[multiturn] {args.steps} steps a run; results in {results.results_dir}, logs in {out_dir}", flush=True)
        run_pending(results, lambda run: run_one(out_dir, run, args.steps, args.python), accepts,
                    lambda line: print(line, flush=True), "multiturn")
    print(report([record for _, record in results.records(accepts)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
