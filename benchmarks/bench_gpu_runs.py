"""The launchers' tasks on a CUDA machine, a few steps each, with a record per run (docs/reproducing.md, "Air-gapped
node").

    python3 benchmarks/bench_gpu_runs.py --out DIR [--run TASK:ESTIMATOR:STEPS[:VAR=VALUE,...] ...]
        [--override TASK:KEY=VALUE ...] [--timeout-s S]

Each run is ``DEVICE=cuda NCCL_DEBUG=INFO PREPARE=0 [VAR=VALUE ...] bash examples/cpu/run_<TASK>_<ESTIMATOR>.sh
trainer.total_training_steps=STEPS [OVERRIDES]`` (``VAR=VALUE``: the launcher's own variables, e.g.
``ROLLOUT=tree,VALUE_SOURCE=prefix_tree``; ``--override``: Hydra overrides for one task's runs) on a task directory
that is already prepared (``--work-dir TASK=DIR``, default the launcher's), with the hf rollout and sdpa attention
(no vLLM, no flash-attn). For every run it writes ``DIR/<TASK>-<ESTIMATOR>[-<VALUE>...].json``: the command (paths
relative to the repository), the versions (Python, torch, CUDA, GPU, transformers, verl, ray), the exit status and
wall time, whether the model held random weights (a timing-only run: ``python -m
verl_group_ppo.tasks.maths.checkpoint random-weights``), the NCCL communicator lines, and verl's per-step metrics
(``critic/score/mean``, ``timing_s/*``, ...) with the mean breakdown over the steps after the first; and the console
log, compressed, beside it. Runs are independent: one that fails or outlasts ``--timeout-s`` is
recorded with its exit status and the next one starts. ``--report DIR`` prints the records as tables.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from verl_group_ppo.logs import parse_step_metrics, timing_breakdown  # noqa: E402
from verl_group_ppo.tasks.maths.checkpoint import RANDOM_WEIGHTS, held_model  # noqa: E402

DEFAULT_RUNS = ("tiny:group_ppo:3", "tiny:gae:3", "arith:group_ppo:2")
ESTIMATORS = ("group_ppo", "gae", "grpo")
NCCL_LINE = re.compile(r"NCCL INFO .*(comm 0x|Init COMPLETE|nRanks|NCCL version)")


LAUNCHER_VAR = re.compile(r"^([A-Z][A-Z0-9_]*)=([A-Za-z0-9_.-]+)$")


def parse_run(text: str) -> tuple[str, str, int, tuple[tuple[str, str], ...]]:
    """``TASK:ESTIMATOR:STEPS[:VAR=VALUE,...]`` -> (task, estimator, steps, launcher variables); ValueError naming
    ``--run`` when it is not one."""
    parts = text.split(":")
    if len(parts) not in (3, 4) or parts[1] not in ESTIMATORS or not parts[2].isdigit() or int(parts[2]) < 1:
        raise ValueError(f"--run: {text!r} is not TASK:ESTIMATOR:STEPS[:VAR=VALUE,...] (ESTIMATOR one of "
                         f"{ESTIMATORS}, STEPS >= 1)")
    launcher = REPO / "examples" / "cpu" / f"run_{parts[0]}_{parts[1]}.sh"
    if not launcher.is_file():
        raise ValueError(f"--run: {text!r} has no launcher {launcher.relative_to(REPO)}")
    variables = []
    for item in (parts[3].split(",") if len(parts) == 4 else []):
        match = LAUNCHER_VAR.match(item)
        if match is None:
            raise ValueError(f"--run: {item!r} in {text!r} is not VAR=VALUE (upper-case VAR; VALUE of letters, "
                             "digits, '_', '.', '-')")
        variables.append((match[1], match[2]))
    return parts[0], parts[1], int(parts[2]), tuple(variables)


def versions() -> dict[str, str]:
    """The versions a record names (each 'missing' when it does not import)."""
    found = {"python": platform.python_version()}
    for name in ("torch", "transformers", "verl", "ray", "tensordict"):
        try:
            found[name] = __import__(name).__version__
        except Exception as error:  # noqa: BLE001 - a record names what is missing rather than stopping
            found[name] = f"missing ({type(error).__name__})"
    try:
        import torch

        found["cuda"] = str(torch.version.cuda)
        found["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except Exception as error:  # noqa: BLE001
        found["gpu"] = f"unknown ({type(error).__name__})"
    return found


def random_weights(work_dir: Path) -> bool:
    """Whether ``work_dir/model`` holds random weights (a timing-only run)."""
    return held_model(str(work_dir / "model")) == RANDOM_WEIGHTS


def run_one(task: str, estimator: str, steps: int, work_dir: Path | None, out: Path, timeout_s: float,
            overrides: tuple[str, ...] = (), variables: tuple[tuple[str, str], ...] = ()) -> dict:
    """Run one launcher on CUDA (its ``variables`` in the environment, Hydra ``overrides`` after the steps); write
    its record and compressed log under ``out``; return the record."""
    launcher = f"examples/cpu/run_{task}_{estimator}.sh"
    args = [f"trainer.total_training_steps={steps}", *overrides]
    settings = {"DEVICE": "cuda", "NCCL_DEBUG": "INFO", "PREPARE": "0", **dict(variables)}
    env = {**os.environ, **settings, "PYTHONUNBUFFERED": "1"}
    if work_dir is not None:
        env["WORK_DIR"] = str(work_dir)
    name = "-".join([task, estimator, *(value for _, value in variables)])
    print(f"[gpu runs] {name}: {steps} steps", flush=True)
    start = time.time()
    try:
        done = subprocess.run(["bash", launcher, *args], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=timeout_s)
        status, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        status = "timeout"
        text = "".join(part.decode(errors="replace") if isinstance(part, bytes) else (part or "")
                       for part in (expired.stdout, expired.stderr))
    if shutil.which("ray"):
        subprocess.run(["ray", "stop", "--force"], capture_output=True)  # no Ray left over for the next run
    steps_logged = parse_step_metrics(text)
    record = {
        "command": " ".join([*(f"{key}={value}" for key, value in settings.items()), "bash", launcher, *args]),
        "work_dir": os.path.relpath(work_dir, REPO) if work_dir is not None else "the launcher's default",
        "random_weights": random_weights(work_dir or REPO / "runs" / f"cpu-{task}"),
        "versions": versions(),
        "exit_status": status,
        "wall_s": round(time.time() - start, 1),
        "nccl": [line.strip()[-200:] for line in text.splitlines() if NCCL_LINE.search(line)][:8],
        "steps": {str(step): metrics for step, metrics in sorted(steps_logged.items())},
        "timing_mean_after_first": timing_breakdown(steps_logged) if steps_logged else {},
        "last_lines": [line[-300:] for line in text.splitlines()[-15:]] if status != 0 else [],
    }
    (out / f"{name}.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    with gzip.open(out / f"{name}.log.gz", "wt") as f:
        f.write(text)
    print(f"[gpu runs] {name}: exit {status} in {record['wall_s']} s, {len(steps_logged)} steps logged, "
          f"step {record['timing_mean_after_first'].get('timing_s/step', float('nan')):.2f} s", flush=True)
    return record


def report(folder: Path) -> str:
    """Markdown tables of the records in ``folder``."""
    lines = ["| run | exit | wall s | steps | s/step | gen | actor | critic | values | score last | weights |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for path in sorted(folder.glob("*.json")):
        record = json.loads(path.read_text())
        timing, steps = record["timing_mean_after_first"], record["steps"]
        last = steps[max(steps, key=int)] if steps else {}

        def cell(key: str) -> str:
            return f"{timing[key]:.2f}" if key in timing else "-"

        score = f"{last['critic/score/mean']:.3f}" if "critic/score/mean" in last else "-"
        lines.append(f"| {path.stem} | {record['exit_status']} | {record['wall_s']:.0f} | {len(steps)} | "
                     f"{cell('timing_s/step')} | {cell('timing_s/gen')} | {cell('timing_s/update_actor')} | "
                     f"{cell('timing_s/update_critic')} | {cell('timing_s/values')} | {score} | "
                     f"{'random' if record['random_weights'] else 'trained'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="a folder for the records and logs")
    parser.add_argument("--run", action="append",
                        help=f"TASK:ESTIMATOR:STEPS[:VAR=VALUE,...] (repeatable; default {DEFAULT_RUNS})")
    parser.add_argument("--override", action="append", default=[],
                        help="TASK:KEY=VALUE: a Hydra override for that task's runs (repeatable)")
    parser.add_argument("--work-dir", action="append", default=[], help="TASK=DIR: that task's prepared directory")
    parser.add_argument("--timeout-s", type=float, default=300, help="the most seconds one run may take")
    parser.add_argument("--report", type=Path, help="print the records in this folder as a table, and stop")
    args = parser.parse_args(argv)
    if args.report is not None:
        print(report(args.report))
        return 0
    if args.out is None:
        parser.error("--out is required (or --report)")
    runs = [parse_run(text) for text in (args.run or DEFAULT_RUNS)]
    work_dirs = {}
    for text in args.work_dir:
        task, sep, folder = text.partition("=")
        if not sep or not Path(folder, "data", "train.parquet").is_file():
            raise ValueError(f"--work-dir: {text!r} is not TASK=DIR with DIR a prepared task (DIR/data/train.parquet)")
        work_dirs[task] = Path(folder).resolve()
    overrides: dict[str, list[str]] = {}
    for text in args.override:
        task, sep, override = text.partition(":")
        if not sep or "=" not in override:
            raise ValueError(f"--override: {text!r} is not TASK:KEY=VALUE")
        overrides.setdefault(task, []).append(override)
    args.out.mkdir(parents=True, exist_ok=True)
    print(json.dumps(versions()), flush=True)
    failed = [run for run in runs
              if run_one(*run[:3], work_dirs.get(run[0]), args.out, args.timeout_s,
                         tuple(overrides.get(run[0], ())), run[3])["exit_status"] != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
