"""The tiny value-source comparison per generated token and per wall-clock second, and the value sources' step
times against gae (docs/results.md, "Value sources"; docs/benchmarks.md).

    python benchmarks/compare.py --run tiny_value_sources      # the comparison's runs (the engine, resumable)
    python benchmarks/compare.py --report tiny_value_sources   # its verdicts per step
    python benchmarks/bench_tiny_value_sources.py              # the same runs per token and per second, step times
    python benchmarks/bench_tiny_value_sources.py --sweep speed   # step times, one run per arm, interleaved

The comparison is the engine's spec ``benchmarks/specs/tiny_value_sources.json`` (its arms, seeds, steps and
pairs). This script reads its records and gives each arm's training reward at a common budget: per generated token
(every run cut at the smallest token total of any run, mc's continuations counted) and per wall-clock second (cut
at the smallest total step time of any run), with the pairs' verdicts by the rule of :mod:`stats`, then the step
times of the same runs (every arm, seed by seed on one machine: a same-run benchmark against gae).

``--sweep speed`` runs gae, group_ppo (critic), prefix_tree and mc (the spec's arms) for :data:`SPEED_STEPS` steps
at seed 0, twice each in alternation, through the engine, and prints the same step-time table: verl's
``timing_s/*`` means over the steps after the first, each arm's step time as a ratio to gae's, and each phase's
share of the step.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from statistics import mean, median

import compare
from benchlib import plus_minus
from stats import detectable_of, paired_difference, verdict
from verl_group_ppo.tasks.tiny.spec import TINY

SPEC = "tiny_value_sources"
SPEED_RESULTS = os.path.join("benchmarks", "results", "tiny_value_sources", "speed")
MATCHED_N = 18  # the grpo_matched arm's replies per prompt (its rollout.n in the spec)
WINDOW = 5  # steps in the reward's last window
SPEED_ARMS = ("gae", "group_ppo", "prefix_tree", "mc")
SPEED_STEPS = 8


def responses_per_step(arm: str) -> int:
    """The replies the rollout generates a step (prompts x n)."""
    return TINY.train_batch * (MATCHED_N if arm == "grpo_matched" else TINY.rollout_n)


def tokens_per_step(record: dict) -> list[float]:
    """Generated tokens per step: the replies (mean length x replies) plus mc's continuations."""
    steps = record["steps"]
    return [steps[str(s)]["response_length/mean"] * responses_per_step(record["arm"])
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


def budget_cell(rows: list[dict], arm: str, base: str, key: str, planned: int) -> str:
    """One pair's cell at one budget (``key`` of :func:`summaries`' rows): ``"+0.006 +- 0.016 (6 seeds; detectable
    0.030, rise +0.040: not measurable)"``; no verdict before the ``planned`` seeds are in."""
    by_seed = {name: {r["seed"]: r for r in rows if r["arm"] == name} for name in (arm, base)}
    diff = paired_difference(*({s: r[key] for s, r in by_seed[name].items()} for name in (arm, base)))
    if diff["mean"] is None:
        return "n/a"
    rise = mean(r[key] - r["first"] for name in (arm, base) for s, r in by_seed[name].items() if s in diff["seeds"])
    detectable = detectable_of(diff["per_seed"])
    said = verdict(diff, rise) if len(diff["seeds"]) == planned else f"no verdict before {planned}"
    return (f"{plus_minus(diff)} ({len(diff['seeds'])} seeds; detectable "
            f"{'n/a' if detectable is None else format(detectable, '.3f')}, rise {rise:+.3f}: {said})")


def report_budgets(spec: compare.Spec, records: list[dict]) -> str:
    """Each arm's reward at the token and the seconds budget, and the pairs' verdicts at each budget."""
    if not records:
        return "no records yet: python benchmarks/compare.py --run tiny_value_sources"
    rows = summaries(records)
    token_budget = min(r["tokens"] for r in rows)
    second_budget = min(r["seconds"] for r in rows)
    out = [f"budgets: {spec.steps} steps; {token_budget:.0f} generated tokens; {second_budget:.0f} s of steps", "",
           "| arm | seeds | reward, last 5 (per step) | at the token budget | at the seconds budget | tokens / step | "
           "s / step | boundary EV (median) |", "|---" * 8 + "|"]
    for arm in spec.arms:
        mine = [r for r in rows if r["arm"] == arm]
        if not mine:
            continue
        avg = {k: mean(r[k] for r in mine) for k in ("final", "at_tokens", "at_seconds", "tokens", "seconds", "ev")}
        out.append(f"| {arm} | {len(mine)} | {avg['final']:.3f} | {avg['at_tokens']:.3f} | {avg['at_seconds']:.3f} | "
                   f"{avg['tokens'] / spec.steps:.0f} | {avg['seconds'] / spec.steps:.2f} | {avg['ev']:+.2f} |")
    out += ["", "Per pair and budget: mean paired difference +- 2 paired SE, the 80%-detectable difference at the observed "
            "paired SD, the pair's mean rise (reward at the budget minus the first 5 steps' reward) and the verdict "
            "(benchmarks/stats.py).", "", "| pair | at the token budget | at the seconds budget |", "|---|---|---|"]
    for arm, base in spec.pairs:
        planned = len(set(spec.arms[arm].seeds) & set(spec.arms[base].seeds))
        cells = [budget_cell(rows, arm, base, key, planned) for key in ("at_tokens", "at_seconds")]
        out.append(f"| {arm}-{base} | " + " | ".join(cells) + " |")
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


def speed_spec(spec: compare.Spec) -> compare.Spec:
    """The speed sweep as an engine spec: the speed arms of ``spec``, runs 0 and 1 of each at seed 0's prompts,
    :data:`SPEED_STEPS` steps, records under :data:`SPEED_RESULTS`."""
    arms = {a: dataclasses.replace(spec.arms[a], seeds=(0, 1)) for a in SPEED_ARMS}
    overrides = ("data.seed=0", "actor_rollout_ref.rollout.seed=0",
                 "trainer.experiment_name=tiny_value_sources_speed_{arm}_{seed}")
    return dataclasses.replace(spec, name=f"{spec.name}_speed", results=SPEED_RESULTS, steps=SPEED_STEPS,
                               arms=arms, pairs=(), overrides=overrides)


def ok_records(spec: compare.Spec) -> list[dict]:
    """The records of ``spec``'s finished runs that trained its steps."""
    return [r for r in compare.records(spec).values()
            if r.get("status", "ok") == "ok" and r.get("steps_planned") == spec.steps]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", choices=("speed",), help="run the speed sweep's missing runs, then report it")
    args = parser.parse_args(argv)
    spec = compare.load_spec(compare.spec_path(SPEC))
    if args.sweep:
        speed = speed_spec(spec)
        compare.run_spec(speed)
        print(report_speed(ok_records(speed)))
        return 0
    records = ok_records(spec)
    print(report_budgets(spec, records) + "\n\nStep times of the same runs (steps 2-20, every seed):\n\n"
          + report_speed(records, tuple(spec.arms)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
