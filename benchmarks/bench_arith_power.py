"""The pre-registered comparison rule's power by validation size, seeds and run-to-run SD (a simulation, no model).

    python benchmarks/bench_arith_power.py                                             # the defaults' table
    python benchmarks/bench_arith_power.py --json benchmarks/results/arith_power/power.json
    python benchmarks/bench_arith_power.py --n-questions 512 --seeds 3,6 --run-sd 0.02 --base-accuracy 0.3

The rule (``benchmarks/stats.py``, :func:`stats.rule_codes`) compares two arms A - B by verl's validation
accuracy on the same n questions after S seeds per arm: per seed the paired difference d_s; **win** when every d_s
> 0 and the mean exceeds 2 paired standard errors (sd(d_s, ddof=1) / sqrt(S)), **lose** by the mirror rule, else
**level**. :func:`simulate` draws many such comparisons at a true difference and counts the verdicts; the table
gives, per (n questions, seeds, run SD): the spurious win and lose shares at a true difference of 0, the win share
(power) at a true difference of 0.05, and the smallest true difference on a 0.005 grid up to 0.3 that the rule calls
a win at least 80% of the time (:func:`smallest_detectable`). Every simulation starts from a fresh generator of
``--seed`` (common random numbers), so the columns agree with each other.

The rule is not a test of fixed size: its spurious win share falls with the seeds (about 0.09 at 3, 0.05 at 4, 0.013
at 6: the "every seed positive" clause), and past 3-4 seeds that clause also costs more power than the smaller
standard error gains, so more seeds do not lower the smallest detectable difference.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Optional

import numpy as np

from benchlib import int_list, portable, write_json
from stats import rule_codes, rule_verdict

VERDICTS = ("win", "lose", "level")  # the order of stats.rule_codes
GRID_STEP, GRID_MAX = 0.005, 0.3
#: the difference the table's power column is taken at
POWER_AT = 0.05


def verdict(differences: Sequence[float]) -> str:
    """``'win'`` | ``'lose'`` | ``'level'`` for the per-seed paired differences A - B (at least 2), by the rule of
    :mod:`stats`."""
    d = np.asarray(differences, dtype=float)
    if d.ndim != 1 or d.size < 2:
        raise ValueError(f"differences: need at least 2 per-seed differences, got {list(differences)}")
    return rule_verdict(d)


def _check(n_questions: int, seeds: int, base_accuracy: float, run_sd: float, trials: int) -> None:
    """ValueError naming the first argument out of range."""
    values = {"n_questions": n_questions, "seeds": seeds, "base_accuracy": base_accuracy, "run_sd": run_sd,
              "trials": trials}
    for name, ok, need in (("n_questions", n_questions >= 1, ">= 1"), ("seeds", seeds >= 2, ">= 2"),
                           ("base_accuracy", 0 <= base_accuracy <= 1, "in [0, 1]"), ("run_sd", run_sd >= 0, ">= 0"),
                           ("trials", trials >= 1, ">= 1")):
        if not ok:
            raise ValueError(f"{name}: need {need}, got {values[name]}")


def simulate(n_questions: int, seeds: int, base_accuracy: float, true_difference: float, run_sd: float,
             trials: int, rng: np.random.Generator) -> dict[str, float]:
    """The share of ``trials`` comparisons A - B the rule calls win / lose / level, ``{"win", "lose", "level"}``.

    Per trial and seed, arm B's true accuracy is ``base_accuracy`` and arm A's ``base_accuracy + true_difference``,
    each plus its own normal run-to-run deviation of SD ``run_sd`` (training noise between seeds), clipped to
    [0, 1]; each arm's measured accuracy is Binomial(``n_questions``, that accuracy) / ``n_questions``, drawn
    independently between arms. Both arms really answer the same questions, whose shared difficulty correlates
    their scores positively and makes the paired differences less noisy: independent draws ignore that, so the
    power here is conservative (a lower bound, as far as the model goes).
    """
    _check(n_questions, seeds, base_accuracy, run_sd, trials)
    shape = (trials, seeds)
    true = np.array([base_accuracy + true_difference, base_accuracy])[:, None, None] + run_sd * rng.standard_normal(
        (2, *shape))
    measured = rng.binomial(n_questions, np.clip(true, 0.0, 1.0)) / n_questions
    counts = np.bincount(rule_codes(measured[0] - measured[1]), minlength=3)
    return {name: float(c) / trials for name, c in zip(VERDICTS, counts)}


def smallest_detectable(n_questions: int, seeds: int, base_accuracy: float, run_sd: float, power: float = 0.8,
                        trials: int = 4000, seed: int = 0) -> Optional[float]:
    """The smallest true difference on the grid 0.005, 0.010, ..., 0.3 whose win share (:func:`simulate`, each
    point from a fresh generator of ``seed``) is at least ``power``; None when none is."""
    for i in range(1, round(GRID_MAX / GRID_STEP) + 1):
        difference = round(i * GRID_STEP, 10)
        share = simulate(n_questions, seeds, base_accuracy, difference, run_sd, trials, np.random.default_rng(seed))
        if share["win"] >= power:
            return difference
    return None


def row(n_questions: int, seeds: int, base_accuracy: float, run_sd: float, trials: int, seed: int) -> dict:
    """One line of the table: the spurious shares at 0, the power at :data:`POWER_AT`, the smallest 80% difference."""
    null = simulate(n_questions, seeds, base_accuracy, 0.0, run_sd, trials, np.random.default_rng(seed))
    at = simulate(n_questions, seeds, base_accuracy, POWER_AT, run_sd, trials, np.random.default_rng(seed))
    return {"n_questions": n_questions, "seeds": seeds, "run_sd": run_sd, "spurious_win": null["win"],
            "spurious_lose": null["lose"], f"power_at_{POWER_AT:g}": at["win"],
            "smallest_detectable_80": smallest_detectable(n_questions, seeds, base_accuracy, run_sd, 0.8, trials, seed)}


def table(rows: Sequence[dict], base_accuracy: float, trials: int) -> str:
    """The markdown table of ``rows`` and a line naming the settings."""
    lines = [f"| n questions | seeds | run SD | spurious win at 0 | spurious lose at 0 | power at {POWER_AT:g} | "
             "smallest difference detected 80% of the time |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        small = r["smallest_detectable_80"]
        lines.append(f"| {r['n_questions']} | {r['seeds']} | {r['run_sd']:g} | {r['spurious_win']:.3f} | "
                     f"{r['spurious_lose']:.3f} | {r[f'power_at_{POWER_AT:g}']:.3f} | "
                     f"{'> %g' % GRID_MAX if small is None else format(small, '.3f')} |")
    lines += ["", f"base accuracy {base_accuracy:g}, {trials} simulated comparisons a cell; arms scored "
              "independently (conservative: shared questions correlate them)"]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-questions", default="512,1024", help="comma list of validation set sizes")
    p.add_argument("--seeds", default="3,4,5,6", help="comma list of seeds per arm")
    p.add_argument("--base-accuracy", type=float, default=0.15, help="arm B's true validation accuracy")
    p.add_argument("--run-sd", default="0,0.01,0.02", help="comma list of run-to-run SDs of the true accuracy")
    p.add_argument("--trials", type=int, default=4000, help="simulated comparisons per cell")
    p.add_argument("--seed", type=int, default=0, help="the generator's seed for every simulation")
    p.add_argument("--json", help="also write the rows as JSON to this path")
    args = p.parse_args(argv)
    sizes, seed_counts = int_list(args.n_questions, "--n-questions"), int_list(args.seeds, "--seeds")
    try:
        run_sds = [float(v) for v in args.run_sd.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--run-sd: a comma list of numbers, got {args.run_sd!r}") from None
    try:
        rows = [row(n, s, args.base_accuracy, sd, args.trials, args.seed)
                for n in sizes for s in seed_counts for sd in run_sds]
    except ValueError as error:
        raise SystemExit(f"bad argument: {error}") from None
    print(table(rows, args.base_accuracy, args.trials))
    if args.json:
        command = " ".join(["python", "benchmarks/bench_arith_power.py",
                            *(portable(a) for a in (sys.argv[1:] if argv is None else argv))])
        write_json(args.json, {"command": command, "base_accuracy": args.base_accuracy, "trials": args.trials,
                               "seed": args.seed, "rule": "win: every d_s > 0 and mean > 2 se; lose: mirror; "
                               "else level", "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
