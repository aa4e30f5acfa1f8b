"""Value sources on the tiny task through verl's ``main_ppo``: GROUP-PPO with the critic, ``mc`` and ``prefix_tree``
against PPO (GAE), GRPO, and GRPO with as many generated tokens per step as ``mc`` (docs/results.md, "Value
sources"), and the step-time benchmark of the value sources against gae (docs/benchmarks.md).

    python benchmarks/bench_tiny_value_sources.py                  # the comparison: run what is missing, report
    python benchmarks/bench_tiny_value_sources.py --report         # the tables from the kept records
    python benchmarks/bench_tiny_value_sources.py --sweep speed    # step times, one run per arm, interleaved

``--sweep comparison`` is the pre-registered comparison: every arm runs ``examples/cpu/run_tiny_<estimator>.sh``
at the launcher's settings plus the arm's own keys (:data:`ARMS`) for :data:`STEPS` steps, seed by seed
(``data.seed`` and the rollout's sampling seed). Each finished run is kept as one JSON record (its command and the
per-step metrics the report reads) under benchmarks/results/tiny_value_sources/<sweep>/; an interrupted sweep
resumes at the first missing run. The report gives each metric three ways: per step (equal training steps), per
generated token (every run cut at the smallest token total of any run) and per wall-clock second (cut at the
smallest total step time of any run).

The comparison's report ends with the step times of its own runs (every arm, seed by seed on one machine: a
same-run benchmark against gae). ``--sweep speed`` runs gae, group_ppo (critic), prefix_tree and mc at K = 4 for
:data:`SPEED_STEPS` steps, twice each in alternation, and prints the same table: verl's ``timing_s/*`` means over
the steps after the first, each arm's step time as a ratio to gae's, and each phase's share of the step.
"""

from __future__ import annotations

import argparse
import os
from statistics import mean, median

from benchlib import REPO, Run, Sweep, cell, differences, plan, run_launcher, run_pending
from verl_group_ppo.tasks.tiny.spec import TINY

RESULTS = os.path.join("benchmarks", "results", "tiny_value_sources")
STEPS = 20
SEEDS = (0, 1, 2, 3, 4, 5)
MC_K = 4
RULE = ("++algorithm.group_params.boundary_rule=fixed", "++algorithm.group_params.group_max_size=4")
MATCHED_N = 18
ARMS: dict[str, tuple[str, tuple[str, ...]]] = {
    "group_ppo": ("group_ppo", ()),
    "mc": ("group_ppo", ("++algorithm.group_params.value_source=mc", f"++algorithm.group_params.mc_samples={MC_K}",
                         *RULE)),
    "prefix_tree": ("group_ppo", ("++algorithm.group_params.value_source=prefix_tree", *RULE)),
    "gae": ("gae", ()),
    "grpo": ("grpo", ()),
    "grpo_matched": ("grpo", (f"actor_rollout_ref.rollout.n={MATCHED_N}",)),
}
"""arm -> (launcher estimator, the arm's own overrides)."""
PAIRS = (("mc", "group_ppo"), ("prefix_tree", "group_ppo"), ("mc", "gae"), ("prefix_tree", "gae"),
         ("mc", "grpo"), ("prefix_tree", "grpo"), ("mc", "grpo_matched"), ("group_ppo", "gae"))
WINDOW = 5  # steps in the reward's last window
SPEED_ARMS = ("gae", "group_ppo", "prefix_tree", "mc")
SPEED_STEPS = 8
KEEP = ("critic/score/", "critic/vf_explained_var", "response_length/mean", "group/", "timing_s/", "actor/entropy")


def responses_per_step(arm: str) -> int:
    """The replies the rollout generates a step (prompts x n)."""
    return TINY.train_batch * (MATCHED_N if arm == "grpo_matched" else TINY.rollout_n)


def sweep(name: str) -> Sweep:
    if name == "comparison":
        runs = [Run(arm, seed) for arm in ARMS for seed in SEEDS]
        return Sweep(os.path.join(REPO, RESULTS, name), tuple(plan(runs, list(ARMS))))
    return Sweep(os.path.join(REPO, RESULTS, name), tuple(Run(a, r) for r in (0, 1) for a in SPEED_ARMS))


def run_one(run: Run, sweep_name: str, work_dir: str) -> dict:
    """Run the launcher for ``run``; the record keeps the metrics the report reads."""
    estimator, own = ARMS[run.arm]
    steps = STEPS if sweep_name == "comparison" else SPEED_STEPS
    seed = run.seed if sweep_name == "comparison" else 0
    overrides = [*own, f"data.seed={seed}", f"actor_rollout_ref.rollout.seed={seed}",
                 f"trainer.experiment_name=tiny_value_sources_{sweep_name}_{run.arm}_{run.seed}"]
    label = f"{run.arm}-seed{run.seed}"
    result = run_launcher(estimator, steps, overrides, env={"WORK_DIR": work_dir},
                          log_path=os.path.join(REPO, "runs", "tiny_value_sources", sweep_name, f"{label}.log"))
    kept = {str(s): {k: v for k, v in m.items() if k.startswith(KEEP)} for s, m in result.steps.items()}
    return {"arm": run.arm, "estimator": estimator, "seed": run.seed, "steps_planned": steps,
            "responses_per_step": responses_per_step(run.arm), "command": result.command,
            "seconds": round(result.seconds, 1), "steps": kept}


def tokens_per_step(record: dict) -> list[float]:
    """Generated tokens per step: the replies (mean length x replies) plus mc's continuations."""
    steps = record["steps"]
    return [steps[str(s)]["response_length/mean"] * record["responses_per_step"]
            + steps[str(s)].get("group/mc_tokens", 0.0)
            for s in range(1, record["steps_planned"] + 1)]


def seconds_per_step(record: dict) -> list[float]:
    return [record["steps"][str(s)]["timing_s/step"] for s in range(1, record["steps_planned"] + 1)]


def rewards(record: dict) -> list[float]:
    return [record["steps"][str(s)]["critic/score/mean"] for s in range(1, record["steps_planned"] + 1)]


def reward_within(record: dict, costs: list[float], budget: float) -> float:
    """The mean training reward over the last :data:`WINDOW` steps that end within ``budget`` (cumulative cost);
    the first step's reward when even it exceeds the budget."""
    total, inside = 0.0, 0
    for cost in costs:
        total += cost
        if total > budget + 1e-9:
            break
        inside += 1
    inside = max(inside, 1)
    return mean(rewards(record)[max(0, inside - WINDOW):inside])


def summaries(records: list[dict]) -> list[dict]:
    """Per run: "final" (last :data:`WINDOW` steps' reward), "area" (all steps), the reward at the token budget and
    at the seconds budget (each the smallest total of any run), the run's totals, and the boundary EV."""
    token_budget = min(sum(tokens_per_step(r)) for r in records)
    second_budget = min(sum(seconds_per_step(r)) for r in records)
    out = []
    for r in records:
        rw = rewards(r)
        ev = [m["group/boundary_explained_variance"] for s, m in r["steps"].items()
              if int(s) > 0 and "group/boundary_explained_variance" in m]
        out.append({"arm": r["arm"], "seed": r["seed"], "final": mean(rw[-WINDOW:]), "first": mean(rw[:WINDOW]),
                    "area": mean(rw), "at_tokens": reward_within(r, tokens_per_step(r), token_budget),
                    "at_seconds": reward_within(r, seconds_per_step(r), second_budget),
                    "tokens": sum(tokens_per_step(r)), "seconds": sum(seconds_per_step(r)),
                    "ev": median(ev) if ev else float("nan")})
    return out


def report_comparison(records: list[dict], missing: list[str]) -> str:
    if not records:
        return "no records yet; missing runs: " + ", ".join(missing)
    rows = summaries(records)
    token_budget = min(r["tokens"] for r in rows)
    second_budget = min(r["seconds"] for r in rows)
    out = [f"budgets: {STEPS} steps; {token_budget:.0f} generated tokens; {second_budget:.0f} s of steps", "",
           "| arm | seeds | reward, first 5 | reward, last 5 (per step) | area | at the token budget | "
           "at the seconds budget | tokens / step | s / step | boundary EV (median) |", "|---" * 10 + "|"]
    for arm in ARMS:
        mine = [r for r in rows if r["arm"] == arm]
        if not mine:
            continue
        avg = {k: mean(r[k] for r in mine) for k in ("first", "final", "area", "at_tokens", "at_seconds", "tokens",
                                                    "seconds", "ev")}
        out.append(f"| {arm} | {len(mine)} | {avg['first']:.3f} | {avg['final']:.3f} | {avg['area']:.3f} | "
                   f"{avg['at_tokens']:.3f} | {avg['at_seconds']:.3f} | {avg['tokens'] / STEPS:.0f} | "
                   f"{avg['seconds'] / STEPS:.2f} | {avg['ev']:+.2f} |")
    values = [{"estimator": r["arm"], **r} for r in rows]
    diffs = differences(values, PAIRS, {"per step": "final", "area": "area", "per token": "at_tokens",
                                        "per second": "at_seconds"})
    out += ["", "| pair | last 5, per step | area | at the token budget | at the seconds budget |",
            "|---|---|---|---|---|"]
    for (arm, base), (pair, metric) in zip(PAIRS, diffs.items()):
        cells = [cell(d) if len(d["seeds"]) == len(SEEDS) else cell({**d, "verdict": f"no verdict before {len(SEEDS)}"})
                 for d in metric.values()]
        out.append(f"| {pair} | " + " | ".join(cells) + " |")
    if missing:
        out += ["", f"missing runs: {', '.join(missing)}"]
    return "\n".join(out)


PHASES = ("step", "gen", "values", "adv", "group_mc", "group_mc_generate", "group_mc_score", "update_critic",
          "update_actor")


def report_speed(records: list[dict], arms: tuple[str, ...] = SPEED_ARMS) -> str:
    """Mean ``timing_s/*`` over steps 2.. per arm (every record of it), the step time as a ratio to gae's, and each
    phase's share of the step."""
    if not records:
        return "no speed records yet"
    means: dict[str, dict[str, float]] = {}
    for arm in arms:
        steps = [m for r in records if r["arm"] == arm for s, m in r["steps"].items() if int(s) > 1]
        if steps:
            means[arm] = {p: mean(m.get(f"timing_s/{p}", 0.0) for m in steps) for p in PHASES}
    base = means.get("gae", {}).get("step")
    out = ["| arm | step s | / gae | " + " | ".join(f"{p} (share)" for p in PHASES[1:]) + " |",
           "|---" * (len(PHASES) + 2) + "|"]
    for arm, m in means.items():
        ratio = f"{m['step'] / base:.2f}" if base else "n/a"
        shares = " | ".join(f"{m[p]:.2f} ({m[p] / m['step']:.0%})" if m[p] else "-" for p in PHASES[1:])
        out.append(f"| {arm} | {m['step']:.2f} | {ratio} | {shares} |")
    return "\n".join(out)


def accept_for(sweep_name: str):
    steps = STEPS if sweep_name == "comparison" else SPEED_STEPS
    return lambda record: record.get("steps_planned") == steps


def report(sweep_name: str) -> str:
    the_sweep = sweep(sweep_name)
    pairs = the_sweep.records(accept_for(sweep_name))
    if sweep_name == "speed":
        return report_speed([r for _, r in pairs])
    missing = [run.label() for run in the_sweep.pending(accept_for(sweep_name))]
    records = [r for _, r in pairs]
    return (report_comparison(records, missing) + "\n\nStep times of the same runs (steps 2-20, every seed):\n\n"
            + report_speed(records, tuple(ARMS)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", choices=("comparison", "speed"), default="comparison")
    parser.add_argument("--work-dir", default=os.path.join(REPO, "runs", "cpu-tiny"),
                        help="the tiny task's directory (the launcher prepares it when needed)")
    parser.add_argument("--report", action="store_true", help="only print the tables from the kept records")
    parser.add_argument("--from-end", action="store_true",
                        help="take the pending runs from the last seed backwards: a second worker beside one started "
                             "without it (each skips a run the other finished)")
    args = parser.parse_args(argv)
    if not args.report:
        the_sweep = sweep(args.sweep)
        if args.from_end:
            the_sweep = the_sweep._replace(runs=tuple(reversed(the_sweep.runs)))
        run_pending(the_sweep, lambda run: run_one(run, args.sweep, os.path.abspath(args.work_dir)),
                    accept_for(args.sweep), tag=f"tiny value sources {args.sweep}")
    print(report(args.sweep))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
