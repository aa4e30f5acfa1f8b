#!/usr/bin/env python3
"""Does GROUP-PPO help over turns? The pre-registered comparison on the tiny tool task (docs/results.md,
"Multi-turn: the tool task"), through verl's real ``main_ppo`` and its tool agent loop.

    .venv/bin/python benchmarks/bench_multiturn.py                 # every run not yet done, then the report
    .venv/bin/python benchmarks/bench_multiturn.py --report        # the report of what is done

Each run is ``examples/cpu/run_tiny_multiturn_<estimator>.sh`` (``MULTI_TURN=1`` in common.sh: 32 prompts x 4
responses a step, every other setting the launcher's) with ``data.seed=SEED`` and ``--steps`` steps, on one
shared warm start (``OUTPUT_DIR/task``, built by the first run; logs in ``OUTPUT_DIR/logs``). Arms (:data:`ARMS`): group_ppo (package
defaults), group_ppo with ``boundary_rule: turn`` (one group per turn), gae (lam 1, the same critic recipe)
and grpo; seeds 0-5 for group_ppo and gae, 0-2 for the others. The runs are resumable: each finished run is
written to ``RESULTS_DIR/<arm>-seed<S>.json`` (its command and per-step training metrics; by default
``benchmarks/results/multiturn/``, kept in the repository as the measurement docs/results.md reports) and
skipped next time; an interrupted run leaves no such file and runs again. The report prints, per arm, the mean training reward
over the last 10 steps ("final") and over all steps ("area") with verl's turns per response, and the paired
differences of :data:`PAIRS` with the rule's verdict (:func:`verl_group_ppo.demo.report.verdict`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from statistics import mean
from typing import Any

from verl_group_ppo.logs import parse_step_metrics

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: arm -> (launcher estimator, extra overrides, seeds)
ARMS: dict[str, tuple[str, tuple[str, ...], tuple[int, ...]]] = {
    "group_ppo": ("group_ppo", (), (0, 1, 2, 3, 4, 5)),
    "group_ppo_turn": ("group_ppo", ("++algorithm.group_params.boundary_rule=turn",
                                     "++algorithm.group_params.group_max_size=96"), (0, 1, 2)),
    "gae": ("gae", (), (0, 1, 2, 3, 4, 5)),
    "grpo": ("grpo", (), (0, 1, 2)),
}
#: the paired differences reported (arm, baseline): each arm against PPO, and turn groups against the defaults
PAIRS = (("group_ppo", "gae"), ("group_ppo_turn", "gae"), ("grpo", "gae"), ("group_ppo_turn", "group_ppo"))
#: the metrics kept per step (the training reward, the turn counts, the step's time)
KEPT = ("critic/score/mean", "num_turns/mean", "num_turns/max", "response_length/mean", "timing_s/step")
WINDOW = 10


def plan(arms: dict = ARMS) -> list[tuple[str, int]]:
    """Every (arm, seed) of the comparison, seeds first so an interrupted sweep has whole seeds of every arm."""
    seeds = sorted({s for _, _, arm_seeds in arms.values() for s in arm_seeds})
    return [(arm, seed) for seed in seeds for arm, (_, _, arm_seeds) in arms.items() if seed in arm_seeds]


RESULTS_DIR = os.path.join(REPO, "benchmarks", "results", "multiturn")


def run_path(results_dir: str, arm: str, seed: int) -> str:
    return os.path.join(results_dir, f"{arm}-seed{seed}.json")


def run_one(out_dir: str, results_dir: str, arm: str, seed: int, steps: int, python: str) -> dict[str, Any]:
    """One launcher run; its per-step metrics written to :func:`run_path` (written last: a run without that
    file is not done). Raises RuntimeError with the log's tail when the run fails."""
    estimator, extra, _ = ARMS[arm]
    log_path = os.path.join(out_dir, "logs", f"{arm}-seed{seed}.log")
    ckpt = os.path.join(out_dir, "checkpoints", f"{arm}-seed{seed}")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    env = {**os.environ, "MULTI_TURN": "1", "WORK_DIR": os.path.join(out_dir, "task"), "PYTHON": python}
    cmd = ["bash", os.path.join(REPO, "examples", "cpu", "common.sh"), estimator, f"data.seed={seed}",
           f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={ckpt}",
           f"trainer.experiment_name=multiturn_{arm}_seed{seed}", *extra]
    t0 = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    shutil.rmtree(ckpt, ignore_errors=True)  # the checkpoints are not part of the comparison
    with open(log_path) as f:
        output = f.read()
    if proc.returncode != 0:
        raise RuntimeError(f"{arm} seed {seed} failed (rc {proc.returncode}); {log_path} ends:\n{output[-3000:]}")
    steps_logged = parse_step_metrics(output)
    command = " ".join(cmd).replace(REPO + os.sep, "")
    record = {"arm": arm, "seed": seed, "command": f"MULTI_TURN=1 {command}", "seconds": round(time.time() - t0, 1),
              "warm_start": warm_start(os.path.join(out_dir, "task")),
              "steps": {str(k): {m: v[m] for m in KEPT if m in v} for k, v in sorted(steps_logged.items())}}
    if len(steps_logged) != steps:
        raise RuntimeError(f"{arm} seed {seed} logged {len(steps_logged)} of {steps} steps; see {log_path}")
    path = run_path(results_dir, arm, seed)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)
    return record


def warm_start(task_dir: str) -> dict[str, float]:
    """What ``prepare`` measured of the shared warm start (``model/prepare.json``): it tells the runs of one warm
    start from another's (``prepare`` is deterministic on one machine, not across CPUs)."""
    with open(os.path.join(task_dir, "model", "prepare.json")) as f:
        return json.load(f)["test_accuracy"]


def warm_start_label(record: dict) -> str:
    ws = record.get("warm_start")
    if not ws:
        return "not recorded"
    return f"sampled {ws['sampled']:.3f}, greedy {ws['greedy']:.3f}, calls/response {ws['calls_per_response']:.2f}"


def run_metrics(record: dict) -> dict[str, float]:
    """A run's final reward (mean of the last :data:`WINDOW` steps), area (mean of all steps), its turns per
    response at the first and the last :data:`WINDOW` steps, and its seconds per step."""
    steps = [record["steps"][k] for k in sorted(record["steps"], key=int)]
    score = [s["critic/score/mean"] for s in steps]
    turns = [s.get("num_turns/mean", float("nan")) for s in steps]
    return {"final": mean(score[-WINDOW:]), "area": mean(score), "first": mean(score[:WINDOW]),
            "turns_first": mean(turns[:WINDOW]), "turns_last": mean(turns[-WINDOW:]),
            "seconds_per_step": mean(s.get("timing_s/step", float("nan")) for s in steps[1:] or steps)}


def load_runs(folder: str) -> list[dict]:
    if not os.path.isdir(folder):
        return []
    runs = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                runs.append(json.load(f))
    return runs


def report(runs: list[dict], arms: dict = ARMS) -> str:
    """The per-arm table and the paired differences to :data:`BASELINE`, with the runs still missing."""
    from verl_group_ppo.demo.report import paired_difference, verdict

    by_arm: dict[str, dict[int, dict[str, float]]] = {}
    for r in runs:
        by_arm.setdefault(r["arm"], {})[int(r["seed"])] = run_metrics(r)
    lines = ["| arm | seeds | final (last 10 steps) | area (all steps) | first 10 steps | turns/response first -> last 10 | s/step |",
             "|---|---|---|---|---|---|---|"]
    for arm in arms:
        got = by_arm.get(arm, {})
        if not got:
            lines.append(f"| {arm} | 0 | - | - | - | - | - |")
            continue
        avg = {k: mean(m[k] for m in got.values()) for k in next(iter(got.values()))}
        lines.append(f"| {arm} | {len(got)} | {avg['final']:.3f} | {avg['area']:.3f} | {avg['first']:.3f} | "
                     f"{avg['turns_first']:.2f} -> {avg['turns_last']:.2f} | {avg['seconds_per_step']:.2f} |")
    lines += ["", "Paired differences (mean +- 2 paired SE over common seeds; the rule's verdict):", "",
              "| pair | metric | seeds | difference | verdict |", "|---|---|---|---|---|"]
    for arm, base in PAIRS:
        a, b = by_arm.get(arm, {}), by_arm.get(base, {})
        for metric in ("final", "area"):
            diff = paired_difference({s: m[metric] for s, m in a.items()}, {s: m[metric] for s, m in b.items()})
            if diff["mean"] is None:
                lines.append(f"| {arm} - {base} | {metric} | 0 | - | - |")
                continue
            se = "n/a" if diff["se"] is None else f"{2 * diff['se']:.3f}"
            lines.append(f"| {arm} - {base} | {metric} | {len(diff['seeds'])} | {diff['mean']:+.3f} +- {se} | "
                         f"{verdict(diff)} |")
    starts: dict[str, set[int]] = {}
    for r in runs:
        starts.setdefault(warm_start_label(r), set()).add(int(r["seed"]))
    lines += ["", "Warm starts (the seeds that ran on each; a pair compares runs of one seed, so of one warm start "
              "when every arm of a seed ran on it):", ""]
    lines += [f"- {label}: seeds {', '.join(map(str, sorted(seeds)))}" for label, seeds in sorted(starts.items())]
    missing = [f"{a}-seed{s}" for a, s in plan(arms) if s not in by_arm.get(a, {})]
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
    out_dir, results_dir = os.path.abspath(args.output_dir), os.path.abspath(args.results_dir)
    if not args.report:
        todo = [(a, s) for a, s in plan() if not os.path.exists(run_path(results_dir, a, s))]
        print(f"[multiturn] {len(plan()) - len(todo)} runs done, {len(todo)} to go, {args.steps} steps each; "
              f"results in {results_dir}, logs in {out_dir}", flush=True)
        for k, (arm, seed) in enumerate(todo, start=1):
            t0 = time.time()
            record = run_one(out_dir, results_dir, arm, seed, args.steps, args.python)
            m = run_metrics(record)
            print(f"[multiturn] {k}/{len(todo)} {arm} seed {seed}: final {m['final']:.3f}, area {m['area']:.3f}, "
                  f"turns {m['turns_first']:.2f} -> {m['turns_last']:.2f} ({time.time() - t0:.0f} s)", flush=True)
    print(report(load_runs(results_dir)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
