"""Step time of verl's real ``main_ppo`` on CPU against responses per step, through our tiny launchers.

    python benchmarks/bench_cpu_step_scaling.py --work-dir runs/cpu-tiny \
        --estimators group_ppo,gae --prompts 16,32,64 --steps 6

For every (estimator, prompts per step) pair it runs ``examples/cpu/common.sh ESTIMATOR`` for ``--steps`` steps
with ``P`` prompts x 4 responses a step in the launcher's shape (:func:`run_one`), keeps the log under
``--log-dir`` and prints a markdown table of verl's ``timing_s/*`` means over the steps after the first, each
row's step time also as a ratio to the estimator's first row (only ratios within one run are compared).
``WORK_DIR`` must hold a prepared tiny task, or the first run prepares it (not timed in the table).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from benchlib import REPO, LauncherRun, int_list, run_launcher
from verl_group_ppo.logs import timing_breakdown

PHASES = ("step", "gen", "old_log_prob", "values", "adv", "update_critic", "update_actor")


def prompt_counts(text: str) -> list[int]:
    """``--prompts``: a comma list of positive multiples of 4."""
    values = int_list(text, "--prompts")
    if any(v <= 0 or v % 4 for v in values):
        raise SystemExit(f"--prompts: every value must be a positive multiple of 4, got {text!r}")
    return values


def run_one(estimator: str, prompts: int, steps: int, work_dir: Path, log_path: Path) -> LauncherRun:
    """Run the launcher once with ``prompts`` prompts a step in its shape (one actor mini-batch of the whole batch,
    two critic mini-batches; each micro-batch divides its mini-batch), its log in ``log_path``. Raises on a failed
    run."""
    overrides = [f"data.train_batch_size={prompts}", f"actor_rollout_ref.actor.ppo_mini_batch_size={prompts}",
                 f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={math.gcd(32, 4 * prompts)}",
                 f"critic.ppo_mini_batch_size={prompts // 2}",
                 f"critic.ppo_micro_batch_size_per_gpu={math.gcd(32, 2 * prompts)}",
                 f"trainer.experiment_name=scaling_{estimator}_{prompts}"]
    return run_launcher(estimator, steps, overrides, env={"WORK_DIR": str(work_dir)}, log_path=log_path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=REPO / "runs/cpu-tiny", help="prepared tiny task")
    parser.add_argument("--log-dir", type=Path, default=REPO / "runs/bench-cpu-scaling", help="where logs go")
    parser.add_argument("--estimators", default="group_ppo", help="comma list of group_ppo, gae, grpo")
    parser.add_argument("--prompts", default="16,32,64", help="prompts per step (x 4 responses), comma list")
    parser.add_argument("--steps", type=int, default=6, help="steps per run (the first is not averaged)")
    args = parser.parse_args(argv)
    if args.steps < 2:
        raise SystemExit(f"--steps: need at least 2 (the first step is excluded), got {args.steps}")
    prompts_list = prompt_counts(args.prompts)
    args.log_dir.mkdir(parents=True, exist_ok=True)

    header = "| estimator | responses/step | " + " | ".join(PHASES) + " | step / first row | run wall s |"
    rows = [header, "|" + "---|" * (len(PHASES) + 4)]
    for estimator in [e for e in args.estimators.split(",") if e]:
        first_step = None
        for prompts in prompts_list:
            log_path = args.log_dir / f"{estimator}_{prompts}.log"
            print(f"[scaling] {estimator}: {prompts} prompts x 4, {args.steps} steps -> {log_path}", flush=True)
            run = run_one(estimator, prompts, args.steps, args.work_dir.resolve(), log_path)
            timing = timing_breakdown(run.steps)
            cells = [timing.get(f"timing_s/{p}", float("nan")) for p in PHASES]
            first_step = first_step or cells[0]
            rows.append(f"| {estimator} | {4 * prompts} | " + " | ".join(f"{c:.2f}" for c in cells)
                        + f" | {cells[0] / first_step:.2f} | {run.seconds:.0f} |")
            print(rows[-1], flush=True)
    table = "\n".join(rows)
    (args.log_dir / "scaling.md").write_text(table + "\n")
    print("\n" + table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
