"""Step time of a maths-task launcher against each of its levers, measured in one run on one machine.

    python benchmarks/bench_mathtask_speed.py [--task twoway|arith] [--work-dir DIR] [--configs base,...] [--steps 3]
    python benchmarks/bench_mathtask_speed.py --task arith --report

Every configuration runs ``examples/cpu/common.sh group_ppo`` with the task's ``TASK`` (verl's ``main_ppo`` on the CPU
backend) for ``--steps`` steps on a prepared ``--work-dir``, with no validation before training and verl's validation
of the work dir's test split after the last step. A configuration is the baseline (the launcher's settings: the
task's spec in ``verl_group_ppo.tasks.maths.spec``) with one lever changed (:func:`configs`); a record measured with other
levers is not reported, and runs again:
threads per process, remove-padding, the rollout (the backend's ``hf`` or verl's vLLM, fp32 or bf16), trainer
ranks, prompts per step, response length, validation batch. ``base`` runs first and again last (``base_again``): the
two bound the machine's drift over the sweep. Each finished configuration is kept as one JSON record under
benchmarks/results/<task's folder>/ (resumable); the report gives, per configuration, verl's ``timing_s/*`` means
over the steps after the first, seconds per response, the validation's seconds per test prompt, the start-up, and
the step time as a ratio to ``base``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import MISSING, asdict, dataclass, fields, replace
from statistics import mean

from benchlib import REPO, LauncherError, portable, read_json, run_launcher, write_json
from verl_group_ppo.logs import timing_breakdown
from verl_group_ppo.tasks.contract import TaskSpec
from verl_group_ppo.tasks.maths.spec import ARITH, TWOWAY

TASKS: dict[str, tuple[TaskSpec, str]] = {"twoway": (TWOWAY, "mathtask_speed"), "arith": (ARITH, "arith_speed")}
"""task -> (its spec, the folder of its records under benchmarks/results)."""
PHASES = ("gen", "values", "adv", "update_critic", "update_actor", "step", "testing")


@dataclass(frozen=True)
class Levers:
    """What a configuration sets; every field is passed explicitly. :func:`base` gives a launcher's own."""

    threads: int  # OMP_NUM_THREADS of every process (driver, trainer workers, rollout server)
    prompts: int  # prompts per step (x 4 responses)
    mini_batches: int  # actor and critic updates per step
    response_length: int  # data.max_response_length
    prompt_length: int  # data.max_prompt_length: verl pads every prompt to it
    remove_padding: bool = False  # actor and critic forward passes without padding tokens
    rollout: str = "hf"  # hf (the backend's) or vllm (verl's, on vLLM's CPU build)
    rollout_dtype: str = "float32"  # the rollout's dtype (vllm: float32 or bfloat16; hf computes in fp32)
    ranks: int = 1  # trainer ranks (N_RANKS)
    val_batch: int = 64  # data.val_batch_size: test prompts the rollout generates together

    def matches(self, recorded: dict) -> bool:
        """Whether a record's levers are these (a record from before a lever existed had its default)."""
        defaults = {f.name: f.default for f in fields(self) if f.default is not MISSING}
        return {**defaults, **recorded} == asdict(self)

    def env(self) -> dict[str, str]:
        return {"OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads), "N_RANKS": str(self.ranks)}

    def overrides(self) -> list[str]:
        mini_batch = self.prompts // self.mini_batches
        responses_per_rank = 4 * mini_batch // self.ranks
        return [f"data.train_batch_size={self.prompts}", f"data.max_response_length={self.response_length}",
                f"data.max_prompt_length={self.prompt_length}",
                f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_batch}",
                f"critic.ppo_mini_batch_size={mini_batch}",
                f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={responses_per_rank}",
                f"critic.ppo_micro_batch_size_per_gpu={responses_per_rank}",
                f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={responses_per_rank}",
                f"actor_rollout_ref.model.use_remove_padding={self.remove_padding}",
                f"critic.model.use_remove_padding={self.remove_padding}",
                f"actor_rollout_ref.rollout.name={self.rollout}",
                f"actor_rollout_ref.rollout.dtype={self.rollout_dtype}", f"data.val_batch_size={self.val_batch}"]


def base(spec: TaskSpec) -> Levers:
    """The launcher's levers for ``spec``."""
    return Levers(threads=spec.threads, prompts=spec.train_batch, mini_batches=spec.actor_mini_batches,
                  response_length=spec.response_length, prompt_length=spec.prompt_length)


def configs(spec: TaskSpec) -> dict[str, Levers]:
    """The sweep for ``spec``: its base, one lever changed a configuration, and the base again."""
    b = base(spec)
    return {
        "base": b,
        "threads1": replace(b, threads=1),
        "remove_padding": replace(b, remove_padding=True),
        "vllm_fp32": replace(b, rollout="vllm"),
        "vllm_bf16": replace(b, rollout="vllm", rollout_dtype="bfloat16"),
        "ranks2": replace(b, ranks=2),
        f"prompts{b.prompts * 2}": replace(b, prompts=b.prompts * 2),
        f"prompts{b.prompts // 2}": replace(b, prompts=b.prompts // 2),
        f"response{b.response_length // 2}": replace(b, response_length=b.response_length // 2),
        f"val_batch{b.val_batch * 4}": replace(b, val_batch=b.val_batch * 4),
        "base_again": b,
    }


def run_config(task: str, name: str, levers: Levers, steps: int, work_dir: str) -> dict:
    """One configuration's record: its levers, the command, wall seconds and each step's ``timing_s/*`` and
    response length. The launcher uses ``work_dir`` as it is (``PREPARE=0``): its own prepare would rebuild a
    copy with fewer test questions at the task's defaults."""
    log = REPO / "runs" / f"bench-{TASKS[task][1]}" / f"{name}.log"
    overrides = [*levers.overrides(), "trainer.val_before_train=False", f"trainer.test_freq={steps}",
                 f"trainer.experiment_name=speed_{name}"]
    record = {"config": name, "levers": asdict(levers)}
    try:
        run = run_launcher("group_ppo", steps, overrides, log_path=log, checkpoint_dir=str(log.parent / "checkpoints"),
                           env={"TASK": task, "WORK_DIR": work_dir, "PREPARE": "0", **levers.env()})
    except LauncherError as error:  # kept as a failed configuration: the sweep goes on
        return {**record, "failed": str(error).splitlines()[0], "log": portable(str(log))}
    keep = ("timing_s/", "response_length/mean", "critic/score/mean")
    return {**record, "command": run.command, "seconds": round(run.seconds, 1),
            "steps": {str(s): {k: v for k, v in m.items() if k.startswith(keep)} for s, m in run.steps.items()}}


def summarize(record: dict) -> dict:
    """Means over the steps after the first: each phase's seconds, seconds per response, validation seconds per
    test prompt (the last step's ``timing_s/testing``), and start-up (the wall time outside the steps)."""
    steps = {int(s): m for s, m in record["steps"].items()}
    timing = timing_breakdown({s: {k: v for k, v in m.items() if k != "timing_s/testing"} for s, m in steps.items()})
    last = steps[max(steps)]
    testing = last.get("timing_s/testing", float("nan"))
    in_steps = sum(m.get("timing_s/step", 0.0) + m.get("timing_s/testing", 0.0) for m in steps.values())
    responses = 4 * record["levers"]["prompts"]
    return {**{p: timing.get(f"timing_s/{p}", float("nan")) for p in PHASES if p != "testing"},
            "per_response": timing["timing_s/step"] / responses,
            "testing_per_prompt": testing / record.get("n_test", 128),  # records before n_test was kept: 128
            "start_up": record["seconds"] - in_steps,
            "length": mean(m["response_length/mean"] for m in steps.values() if "response_length/mean" in m)}


def results_dir(task: str):
    return REPO / "benchmarks" / "results" / TASKS[task][1]


def report(task: str) -> str:
    sweep, results = configs(TASKS[task][0]), results_dir(task)
    records = {name: read_json(results / f"{name}.json") for name in sweep}
    # a record measured with other levers (another base) is not this configuration's
    records = {k: v for k, v in records.items() if v and sweep[k].matches(v.get("levers", {}))}
    if not records:
        raise SystemExit(f"no records under {portable(str(results))}: run the benchmark first")
    failed = {name: r["failed"] for name, r in records.items() if "failed" in r}
    rows = {name: summarize(r) for name, r in records.items() if name not in failed}
    base = rows.get("base", {}).get("step")
    lines = ["| config | gen | values | adv | update_critic | update_actor | step | s/response | x base step | "
             "x base s/response | validation s/prompt | start-up s | response length |", "|---" * 13 + "|"]
    for name, row in rows.items():
        ratio = row["step"] / base if base else float("nan")
        per = row["per_response"] / rows["base"]["per_response"] if base else float("nan")
        lines.append(f"| {name} | " + " | ".join(f"{row[p]:.1f}" for p in PHASES if p != "testing")
                     + f" | {row['per_response']:.2f} | {ratio:.2f} | {per:.2f} | {row['testing_per_prompt']:.2f} | "
                     f"{row['start_up']:.0f} | {row['length']:.1f} |")
    lines += [f"| {name} | failed: {why} |" + " |" * 11 for name, why in failed.items()]
    return "\n".join(lines)


def prepare(task: str, work_dir: str) -> None:
    """The task in ``work_dir`` with 128 test questions: the validation after the last step then takes about a
    minute, and its seconds per prompt are what a full validation costs per prompt."""
    cmd = [sys.executable, "-m", "verl_group_ppo.tasks.maths.prepare", "--variant", task, "--output-dir", work_dir,
           "--n-test", "128"]
    print(f"[speed] preparing: {' '.join(portable(c) for c in cmd)}", flush=True)
    subprocess.run(cmd, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="twoway", choices=sorted(TASKS), help="the maths task's variant (TASK)")
    parser.add_argument("--work-dir", help="the prepared task (default: runs/bench-<task folder>/work, prepared "
                                           "with --n-test 128 when missing)")
    parser.add_argument("--configs", help="comma list of the sweep's configurations (default: all of them)")
    parser.add_argument("--steps", type=int, default=3, help="steps per configuration (the first is not averaged)")
    parser.add_argument("--report", action="store_true", help="only print the table from the kept records")
    args = parser.parse_args(argv)
    sweep, results = configs(TASKS[args.task][0]), results_dir(args.task)
    names = [c for c in (args.configs or ",".join(sweep)).split(",") if c]
    unknown = [c for c in names if c not in sweep]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; --task {args.task} has {', '.join(sweep)}")
    if args.steps < 2:
        raise SystemExit(f"--steps: must be >= 2 (got {args.steps})")
    if not args.report:
        work_dir = os.path.abspath(args.work_dir or REPO / "runs" / f"bench-{TASKS[args.task][1]}" / "work")
        if args.work_dir is None and not os.path.exists(os.path.join(work_dir, "data", "prepare.json")):
            prepare(args.task, work_dir)
        info = read_json(os.path.join(work_dir, "data", "prepare.json"))
        if info is None:
            raise SystemExit(f"--work-dir: {work_dir} holds no prepared task "
                             f"(python -m verl_group_ppo.tasks.maths.prepare --variant {args.task} --output-dir DIR)")
        for name in names:
            recorded = (read_json(results / f"{name}.json") or {}).get("levers")
            if recorded is None or not sweep[name].matches(recorded):
                print(f"[speed] {name}: {sweep[name]}", flush=True)
                record = run_config(args.task, name, sweep[name], args.steps, work_dir)
                write_json(results / f"{name}.json", {**record, "n_test": info["n_test"]})
    print(report(args.task))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
