"""One arithmetic launcher run's summary from its output: validation per module and pooled, the rise, rewards,
explained variance and step times.

    python benchmarks/bench_arith_log.py --log runs/arith_full.log
    python benchmarks/bench_arith_log.py --log grpo.log --n-test 512

Per run (:func:`summarise`): validation accuracy per module (verl's ``val-core/<source>/reward/mean@1``) and pooled
over the test questions (each module weighted by its question count), the answered rate
(``val-aux/<source>/answered/mean@1``), the rise of pooled accuracy from the first validated step to the last in
binomial standard errors of the difference; the training reward ``critic/score/mean`` over the first and last
:data:`WINDOW` steps and over all steps (area); verl's ``critic/vf_explained_var``, median over the second half of
the steps whose batch rewards differ (runs with a critic); mean ``timing_s/*`` (validation not included). The
arithmetic comparison itself is a spec of the comparison engine: ``python benchmarks/compare.py --report arith``.
"""

from __future__ import annotations

import argparse
import math
from statistics import mean, median

from verl_group_ppo.logs import parse_step_metrics
from verl_group_ppo.tasks.maths.prepare import PrepareSettings
from verl_group_ppo.tasks.maths.spec import ARITH

WINDOW = 4  # steps in the reward's first and last windows
N_TEST = PrepareSettings().n_test
SOURCES = ARITH.data_sources  # in module order: the test split gives module i questions i, i + 3, ...


def counts(n_test: int = N_TEST) -> dict[str, int]:
    """Test questions per source: the split gives module i questions i, i + 3, ..."""
    return {src: len(range(i, n_test, len(SOURCES))) for i, src in enumerate(SOURCES)}


COUNTS = counts()
VAL, ANSWERED, EV = "val-core/{}/reward/mean@1", "val-aux/{}/answered/mean@1", "critic/vf_explained_var"


def avg(values) -> float:
    values = list(values)
    return mean(values) if values else math.nan


def pooled(per_source: dict[str, float], n_test: int = N_TEST) -> float:
    """The accuracy over ``n_test`` test questions: each source's figure weighted by its question count."""
    n = counts(n_test)
    return sum(n[s] * v for s, v in per_source.items()) / sum(n[s] for s in per_source)


def rise(p0: float, p1: float, n: int = N_TEST) -> tuple[float, float, str]:
    """(p1 - p0, the binomial SE of that difference, sqrt(p0 (1 - p0) / n + p1 (1 - p1) / n), and whether it
    exceeds 2 SE: "yes", "drop" (below -2 SE) or "no")."""
    diff, se = p1 - p0, math.sqrt(p0 * (1 - p0) / n + p1 * (1 - p1) / n)
    return diff, se, "yes" if diff > 2 * se else "drop" if diff < -2 * se else "no"


def summarise(steps: dict[int, dict[str, float]], n_test: int = N_TEST) -> dict:
    """One run's figures from its ``{step: metrics}``: ``val`` per validated step (``pooled``, ``answered``
    pooled, ``modules``: source -> (accuracy, answered)), the reward windows, ``ev_steps`` and ``ev`` (None
    without a critic), and the mean of every ``timing_s/*`` over the training steps that log it."""
    val = {}
    for s in sorted(steps):
        if all(VAL.format(src) in steps[s] for src in SOURCES):
            modules = {src: (steps[s][VAL.format(src)], steps[s].get(ANSWERED.format(src), math.nan))
                       for src in SOURCES}
            val[s] = {"pooled": pooled({k: v[0] for k, v in modules.items()}, n_test),
                      "answered": pooled({k: v[1] for k, v in modules.items()}, n_test), "modules": modules}
    trained = [s for s in sorted(steps) if s > 0 and "critic/score/mean" in steps[s]]
    reward = [steps[s]["critic/score/mean"] for s in trained]
    ev_steps = [(s, steps[s][EV]) for s in trained if EV in steps[s]]
    # the second half, batches whose rewards differ (with equal returns EV means nothing; kept where not logged)
    late = [ev for s, ev in ev_steps if s > trained[-1] / 2
            and steps[s].get("critic/score/max", 1.0) > steps[s].get("critic/score/min", 0.0)]
    keys = sorted({k for s in trained for k in steps[s] if k.startswith("timing_s/")})
    return {"n_test": n_test, "val": val, "first": avg(reward[:WINDOW]), "last": avg(reward[-WINDOW:]),
            "area": avg(reward),
            "ev_steps": ev_steps, "ev": (median(late) if late else math.nan) if ev_steps else None,
            "timing": {k: (avg(steps[s][k] for s in trained if k in steps[s]),
                           [s for s in trained if k in steps[s]]) for k in keys}}


def short(src: str) -> str:
    return src.rsplit("/", 1)[1]


def rise_cells(p0: float, p1: float, n: int = N_TEST) -> list[str]:
    """p0, p1, the rise, its SE over ``n`` questions, the rise in SEs and the 2-SE flag, formatted."""
    diff, se, flag = rise(p0, p1, n)
    return [f"{p0:.3f}", f"{p1:.3f}", f"{diff:+.3f}", f"{se:.3f}", f"{diff / se if se else math.nan:+.1f}", flag]


def log_report(text: str, n_test: int = N_TEST) -> str:
    """One launcher run's output (validated on ``n_test`` questions): validation per module and pooled, the rise,
    rewards, EV and step times."""
    steps = parse_step_metrics(text)
    if not steps:
        return "no `step:N - ...` metric lines found"
    s = summarise(steps, n_test)
    n = counts(n_test)
    out = [f"steps logged: {min(steps)}..{max(steps)} ({len(steps)})", "",
           "| step | module (questions) | accuracy | answered | accuracy among answered |", "|---|---|---|---|---|"]
    for step, v in s["val"].items():
        for name, (acc, ans), size in [*((short(k), m, n[k]) for k, m in v["modules"].items()),
                                       ("pooled", (v["pooled"], v["answered"]), n_test)]:
            out.append(f"| {step} | {name} ({size}) | {acc:.3f} | {ans:.3f} | {acc / ans if ans else math.nan:.3f} |")
    if len(s["val"]) >= 2:
        (a, first), (b, last) = list(s["val"].items())[0], list(s["val"].items())[-1]
        cells = rise_cells(first["pooled"], last["pooled"], n_test)
        out += ["", f"pooled accuracy, step {a} -> {b}: {cells[0]} -> {cells[1]}, rise {cells[2]}, binomial SE "
                    f"{cells[3]} (n = {n_test}), {cells[4]} SE; > 2 SE: {cells[5]}"]
    out += ["", f"critic/score/mean: first {WINDOW} steps {s['first']:.3f}, last {WINDOW} {s['last']:.3f}, "
                f"all steps (area) {s['area']:.3f}"]
    if s["ev_steps"]:
        out += [f"{EV} per step: " + ", ".join(f"{k}: {e:+.2f}" for k, e in s["ev_steps"]),
                f"{EV} median over the second half (batches whose rewards differ): {s['ev']:+.2f}"]
    step_s = s["timing"].get("timing_s/step", (math.nan,))[0]
    out += ["", "| phase | steps | mean s | share of step |", "|---|---|---|---|"]
    for key, (value, logged) in sorted(s["timing"].items(), key=lambda kv: -kv[1][0]):
        if key != "timing_s/testing":
            out.append(f"| {key} | {len(logged)} | {value:.2f} | {value / step_s:.1%} |")
    if "timing_s/testing" in s["timing"]:
        value, logged = s["timing"]["timing_s/testing"]
        out.append(f"\nvalidation (timing_s/testing, outside timing_s/step): {value:.1f} s at steps "
                   f"{', '.join(map(str, logged))}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--log", metavar="PATH", required=True, help="one launcher output file")
    parser.add_argument("--n-test", type=int, default=N_TEST,
                        help="the run's validation questions (prepare's --n-test)")
    args = parser.parse_args(argv)
    with open(args.log, errors="replace") as f:
        print(log_report(f.read(), args.n_test))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
