"""Step time of the two-way maths task's launcher against each of its levers, measured in one run on one machine.

    python benchmarks/bench_mathtask_speed.py [--work-dir runs/cpu-twoway] [--configs base,threads2,...] [--steps 3]
    python benchmarks/bench_mathtask_speed.py --report

Every configuration runs ``examples/cpu/run_twoway_group_ppo.sh`` (verl's ``main_ppo`` on the CPU backend) for
``--steps`` steps on a prepared ``--work-dir``, with no validation before training and verl's validation of the test
split after the last step. A configuration is the baseline (:data:`BASE`, the launcher's settings: the task's spec
``verl_group_ppo.task_specs.TWOWAY``) with one lever changed (:data:`CONFIGS`); a record measured with other levers
is not reported, and runs again:
threads per process, remove-padding, the rollout (the backend's ``hf`` or verl's vLLM, fp32 or bf16), trainer
ranks, prompts per step, response length. ``base`` runs first and again last (``base_again``): the two bound the
machine's drift over the sweep. Each finished configuration is kept as one JSON record under
benchmarks/results/mathtask_speed/ (resumable); the report gives, per configuration, verl's ``timing_s/*`` means over
the steps after the first, seconds per response, the validation's seconds per test prompt, the start-up, and the
step time as a ratio to ``base``.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import asdict, dataclass, replace
from statistics import mean

from benchlib import REPO, LauncherError, portable, read_json, run_launcher, write_json
from verl_group_ppo.task_specs import TWOWAY
from verl_group_ppo.logs import timing_breakdown

RESULTS = REPO / "benchmarks" / "results" / "mathtask_speed"
PHASES = ("gen", "values", "adv", "update_critic", "update_actor", "step", "testing")


@dataclass(frozen=True)
class Levers:
    """What a configuration sets; every field is passed explicitly. The defaults are the launcher's (the task's spec,
    :data:`verl_group_ppo.task_specs.TWOWAY`)."""

    threads: int = TWOWAY.threads  # OMP_NUM_THREADS of every process (driver, trainer workers, rollout server)
    remove_padding: bool = False  # actor and critic forward passes without padding tokens
    rollout: str = "hf"  # hf (the backend's) or vllm (verl's, on vLLM's CPU build)
    rollout_dtype: str = "float32"  # the rollout's dtype (vllm: float32 or bfloat16; hf computes in fp32)
    ranks: int = 1  # trainer ranks (N_RANKS)
    prompts: int = TWOWAY.train_batch  # prompts per step (x 4 responses)
    mini_batches: int = TWOWAY.actor_mini_batches  # actor and critic updates per step
    response_length: int = TWOWAY.response_length  # data.max_response_length
    prompt_length: int = TWOWAY.prompt_length  # data.max_prompt_length: verl pads every prompt to it

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
                f"actor_rollout_ref.rollout.dtype={self.rollout_dtype}"]


BASE = Levers()
CONFIGS: dict[str, Levers] = {
    "base": BASE,
    "threads1": replace(BASE, threads=1),
    "remove_padding": replace(BASE, remove_padding=True),
    "vllm_fp32": replace(BASE, rollout="vllm"),
    "vllm_bf16": replace(BASE, rollout="vllm", rollout_dtype="bfloat16"),
    "ranks2": replace(BASE, ranks=2),
    "prompts8": replace(BASE, prompts=8),
    "response24": replace(BASE, response_length=24),
    "response32": replace(BASE, response_length=32),
    "base_again": BASE,
}


def run_config(name: str, levers: Levers, steps: int, work_dir: str) -> dict:
    """One configuration's record: its levers, the command, wall seconds and each step's ``timing_s/*`` and
    response length."""
    log = REPO / "runs" / "bench-mathtask-speed" / f"{name}.log"
    overrides = [*levers.overrides(), "trainer.val_before_train=False", f"trainer.test_freq={steps}",
                 f"trainer.experiment_name=speed_{name}"]
    record = {"config": name, "levers": asdict(levers)}
    try:
        run = run_launcher("group_ppo", steps, overrides, log_path=log, checkpoint_dir=str(log.parent / "checkpoints"),
                           env={"TASK": "twoway", "WORK_DIR": work_dir, **levers.env()})
    except LauncherError as error:  # kept as a failed configuration: the sweep goes on
        return {**record, "failed": str(error).splitlines()[0], "log": portable(str(log))}
    keep = ("timing_s/", "response_length/mean", "critic/score/mean")
    return {**record, "command": run.command, "seconds": round(run.seconds, 1),
            "steps": {str(s): {k: v for k, v in m.items() if k.startswith(keep)} for s, m in run.steps.items()}}


def summarize(record: dict, n_test: int) -> dict:
    """Means over the steps after the first: each phase's seconds, seconds per response, validation seconds per
    test prompt (the last step's ``timing_s/testing``), and start-up (the wall time outside the steps)."""
    steps = {int(s): m for s, m in record["steps"].items()}
    timing = timing_breakdown({s: {k: v for k, v in m.items() if k != "timing_s/testing"} for s, m in steps.items()})
    last = steps[max(steps)]
    testing = last.get("timing_s/testing", float("nan"))
    in_steps = sum(m.get("timing_s/step", 0.0) + m.get("timing_s/testing", 0.0) for m in steps.values())
    responses = 4 * record["levers"]["prompts"]
    return {**{p: timing.get(f"timing_s/{p}", float("nan")) for p in PHASES if p != "testing"},
            "per_response": timing["timing_s/step"] / responses, "testing_per_prompt": testing / n_test,
            "start_up": record["seconds"] - in_steps,
            "length": mean(m["response_length/mean"] for m in steps.values() if "response_length/mean" in m)}


def report(n_test: int) -> str:
    records = {name: read_json(RESULTS / f"{name}.json") for name in CONFIGS}
    # a record measured with other levers (another base) is not this configuration's
    records = {k: v for k, v in records.items() if v and v.get("levers") == asdict(CONFIGS[k])}
    if not records:
        raise SystemExit(f"no records under {portable(str(RESULTS))}: run the benchmark first")
    failed = {name: r["failed"] for name, r in records.items() if "failed" in r}
    rows = {name: summarize(r, n_test) for name, r in records.items() if name not in failed}
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", default=str(REPO / "runs" / "cpu-twoway"), help="a prepared two-way maths task")
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {', '.join(CONFIGS)}")
    parser.add_argument("--steps", type=int, default=3, help="steps per configuration (the first is not averaged)")
    parser.add_argument("--report", action="store_true", help="only print the table from the kept records")
    args = parser.parse_args(argv)
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown or args.steps < 2:
        raise SystemExit(f"--configs: unknown {unknown}; --steps must be >= 2 (got {args.steps})")
    work_dir = os.path.abspath(args.work_dir)
    info = read_json(os.path.join(work_dir, "data", "prepare.json"))
    if info is None:
        raise SystemExit(f"--work-dir: {args.work_dir} holds no prepared task "
                         "(python -m verl_group_ppo.mathtask.prepare)")
    if not args.report:
        for name in names:
            if (read_json(RESULTS / f"{name}.json") or {}).get("levers") != asdict(CONFIGS[name]):
                print(f"[speed] {name}: {CONFIGS[name]}", flush=True)
                write_json(RESULTS / f"{name}.json", run_config(name, CONFIGS[name], args.steps, work_dir))
    print(report(info["n_test"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
