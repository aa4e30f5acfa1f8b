"""What a tree rollout saves and costs against independent sampling, through verl's real ``main_ppo`` on CPU.

    python benchmarks/bench_tree_rollout.py --work-dir runs/cpu-tiny --steps 4 \
        --json benchmarks/results/tree/cpu.json

Runs the tiny launcher (``examples/cpu/common.sh grpo``: no critic, so the rollout is most of what differs) once
with ``rollout.n`` independent replies per prompt and once per tree shape of ``--shapes`` with the same n
(``ROLLOUT=tree``), one after the other on the same machine, on the ``hf`` rollout or verl's vLLM one (``--rollout``),
the tree runs with ``tree_rollout.branch_start`` of ``--branch-start``. Per run, over the steps after the first: the tokens
the rollout generated against the rows' reply tokens (``group/tree_generated_tokens / group/tree_path_tokens``;
independent sampling generates every row's reply, ratio 1), verl's ``timing_s/gen`` and ``timing_s/step``, each as
a ratio to the independent run's, and each round's mean time in the server (``group/tree_round{l}_generate_s``).
A shape is ``ROOTSxB1xB2...:SEGMENT_TOKENS``, e.g. ``2x2x2:4`` (2 roots, two levels of 2, a branch every 4 tokens).
``--repeats R`` runs the whole sequence R times, each shape's ratios taken against the independent run of its own
repeat, and reports their medians: the ratio moves by several hundredths between identical runs on a 2-core machine.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from statistics import mean, median
from typing import Any, Optional

from benchlib import REPO, LauncherRun, run_launcher, write_json
from compare import code_version
from verl_group_ppo.logs import timing_breakdown


def parse_shape(text: str) -> dict[str, Any]:
    """``ROOTSxB1x...:SEGMENT_TOKENS`` -> the ``tree_rollout`` keys; SystemExit naming ``--shapes`` when malformed."""
    try:
        sizes, tokens = text.split(":")
        roots, *branching = (int(v) for v in sizes.split("x"))
        shape = {"roots": roots, "branching": branching, "segment_tokens": int(tokens)}
    except ValueError:
        raise SystemExit(f"--shapes: {text!r} is not ROOTSxB1xB2...:SEGMENT_TOKENS (e.g. 2x2x2:4)") from None
    if roots < 1 or int(tokens) < 1 or any(b < 2 for b in branching):
        raise SystemExit(f"--shapes: {text!r} needs roots >= 1, branching >= 2 and segment tokens >= 1")
    return shape


def shape_size(shape: dict[str, Any]) -> int:
    """Replies per prompt of a shape: roots * prod(branching)."""
    return shape["roots"] * math.prod(shape["branching"])


def run_one(n: int, shape: Optional[dict[str, Any]], steps: int, work_dir: Path, log_path: Path,
            rollout: str = "hf", branch_start: str = "parent_done") -> LauncherRun:
    """One tiny GRPO run with ``n`` replies per prompt, as a tree of ``shape`` (None: independent replies), on the
    ``rollout`` server (``hf`` or ``vllm``)."""
    overrides = [f"actor_rollout_ref.rollout.n={n}", "trainer.experiment_name=bench_tree_" + log_path.stem,
                 f"actor_rollout_ref.rollout.name={rollout}"]
    env = {"WORK_DIR": str(work_dir), "ROLLOUT": "tree" if shape else "independent"}
    if shape:
        overrides += [f"++tree_rollout.roots={shape['roots']}",
                      "++tree_rollout.branching=[" + ",".join(str(b) for b in shape["branching"]) + "]",
                      f"++tree_rollout.segment_tokens={shape['segment_tokens']}",
                      f"++tree_rollout.branch_start={branch_start}"]
    return run_launcher("grpo", steps, overrides, env=env, log_path=log_path)


def summarize(run: LauncherRun) -> dict[str, Any]:
    """The run's means over the steps after the first: token ratio, gen and step seconds, round times."""
    chosen = sorted(run.steps)[1:] or sorted(run.steps)
    timing = timing_breakdown(run.steps)
    row: dict[str, Any] = {"gen_s": timing.get("timing_s/gen", math.nan), "step_s": timing.get("timing_s/step", math.nan),
                           "command": run.command, "wall_s": round(run.seconds, 1)}
    if all("group/tree_path_tokens" in run.steps[s] for s in chosen):
        generated = sum(run.steps[s]["group/tree_generated_tokens"] for s in chosen)
        row["generated_over_path"] = generated / sum(run.steps[s]["group/tree_path_tokens"] for s in chosen)
        rounds = sorted({k for s in chosen for k in run.steps[s] if k.startswith("group/tree_round")})
        row["round_generate_s"] = {k.split("/")[1]: mean(run.steps[s][k] for s in chosen if k in run.steps[s])
                                   for k in rounds}
    else:
        row["generated_over_path"] = 1.0
    return row


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of the runs, ratios against the first (independent) row."""
    base = rows[0]
    lines = ["| rollout | n | generated / path tokens | gen s | / independent | step s | / independent | "
             "time in server per round, s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rounds = ", ".join(f"{v:.2f}" for v in r.get("round_generate_s", {}).values()) or "-"
        lines.append(f"| {r['rollout']} | {r['n']} | {r['generated_over_path']:.3f} | {r['gen_s']:.2f} | "
                     f"{r['gen_s'] / base['gen_s']:.2f} | {r['step_s']:.2f} | {r['step_s'] / base['step_s']:.2f} | "
                     f"{rounds} |")
    return "\n".join(lines)


def median_ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per tree shape (``rollout`` label): its gen and step seconds over those of the independent run of the same
    ``repeat``, each repeat's ratio and their median. ``rows`` carry ``rollout``, ``repeat``, ``gen_s``, ``step_s``."""
    base = {r["repeat"]: r for r in rows if r["rollout"] == "independent"}
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["rollout"] == "independent":
            continue
        entry = out.setdefault(r["rollout"], {"gen": [], "step": []})
        entry["gen"].append(r["gen_s"] / base[r["repeat"]]["gen_s"])
        entry["step"].append(r["step_s"] / base[r["repeat"]]["step_s"])
    for entry in out.values():
        entry["median_gen"], entry["median_step"] = median(entry["gen"]), median(entry["step"])
    return out


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=REPO / "runs/cpu-tiny", help="prepared tiny task")
    parser.add_argument("--log-dir", type=Path, default=REPO / "runs/bench-tree", help="where the run logs go")
    parser.add_argument("--shapes", default="2x2x2:2,2x2x2:3,2x2x2:4,4x2:4",
                        help="tree shapes ROOTSxB1x...:SEGMENT_TOKENS, comma list, all of one size n")
    parser.add_argument("--steps", type=int, default=4, help="steps per run (the first is not averaged)")
    parser.add_argument("--rollout", choices=("hf", "vllm"), default="hf", help="the rollout server")
    parser.add_argument("--branch-start", choices=("parent_done", "prefix_ready"), default="parent_done",
                        help="tree_rollout.branch_start of the tree runs")
    parser.add_argument("--repeats", type=int, default=1, help="run the independent run and the shapes this many times")
    parser.add_argument("--json", type=Path, help="write the record here")
    args = parser.parse_args(argv)
    if args.steps < 2:
        raise SystemExit(f"--steps: need at least 2 (the first step is excluded), got {args.steps}")
    if args.repeats < 1:
        raise SystemExit(f"--repeats: need at least 1, got {args.repeats}")
    shapes = [parse_shape(s) for s in args.shapes.split(",") if s]
    sizes = {shape_size(s) for s in shapes}
    if len(sizes) != 1:
        raise SystemExit(f"--shapes: every shape must give the same replies per prompt, got {sorted(sizes)}")
    n = sizes.pop()
    version = code_version()  # the code the runs run, read before they start
    args.log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    runs = [("independent", None)] + [(s, p) for s, p in zip(args.shapes.split(","), shapes)]
    for repeat in range(args.repeats):
        for label, shape in runs:
            stem = label.replace(":", "_") + (f"_r{repeat + 1}" if args.repeats > 1 else "")
            log_path = args.log_dir / f"{stem}.log"
            print(f"[tree bench] {label}, n = {n}, {args.steps} steps, repeat {repeat + 1}/{args.repeats} -> "
                  f"{log_path}", flush=True)
            row = {"rollout": label if shape else "independent", "n": n, "shape": shape, "server": args.rollout,
                   "branch_start": args.branch_start if shape else None, "repeat": repeat,
                   **summarize(run_one(n, shape, args.steps, args.work_dir.resolve(), log_path, args.rollout,
                                       args.branch_start))}
            rows.append(row)
            print(f"[tree bench] {label}: generated/path {row['generated_over_path']:.3f}, gen {row['gen_s']:.2f} s, "
                  f"step {row['step_s']:.2f} s", flush=True)
    for repeat in range(args.repeats):
        print("\n" + table([r for r in rows if r["repeat"] == repeat]))
    ratios = median_ratios(rows)
    for label, entry in ratios.items():
        print(f"[tree bench] {label} / independent over {args.repeats} repeats: gen "
              f"{', '.join(f'{v:.2f}' for v in entry['gen'])} (median {entry['median_gen']:.2f}), step "
              f"{', '.join(f'{v:.2f}' for v in entry['step'])} (median {entry['median_step']:.2f})")
    if args.json:
        write_json(args.json, {"steps": args.steps, "repeats": args.repeats, "code_version": version, "runs": rows,
                               "ratios": ratios})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
