"""verl's console metrics: read and summarise the output of a ``main_ppo`` run (``examples/cpu/run_tiny_*.sh``).

    python -m verl_group_ppo.logs run.log [more.log ...]

For each log: the steps logged, the training reward ``critic/score/mean`` averaged over the first and the
last 10 steps (and their difference), and verl's per-step time breakdown ``timing_s/*`` averaged over the
steps after the first (the first step includes one-off warm-up), with each phase's share of the step.
"""

from __future__ import annotations

import argparse
import re
from statistics import mean

STEP_LINE = re.compile(r"step:(\d+) - (.*)$")
NUMBER = re.compile(r"^(?:np\.\w+\()?([-+]?(?:\d+\.?\d*(?:[eE][-+]?\d+)?|nan|inf))\)?$")


def parse_step_metrics(output: str) -> dict[int, dict[str, float]]:
    """``{step: {metric: value}}`` from verl's console-logger lines ``step:N - key:value - key:value ...``.

    Values that are not numbers are skipped; a step logged twice keeps its last line.
    """
    steps: dict[int, dict[str, float]] = {}
    for line in output.splitlines():
        match = STEP_LINE.search(line)
        if not match:
            continue
        metrics = {}
        for item in match.group(2).split(" - "):
            key, _, value = item.rpartition(":")
            number = NUMBER.match(value.strip())
            if key and number:
                metrics[key.strip()] = float(number.group(1))
        steps[int(match.group(1))] = metrics
    return steps


def reward_rise(steps: dict[int, dict[str, float]], window: int = 10) -> tuple[float, float, float]:
    """(mean ``critic/score/mean`` over the first ``window`` steps, over the last ``window``, last - first)."""
    scores = [steps[s]["critic/score/mean"] for s in sorted(steps) if "critic/score/mean" in steps[s]]
    if len(scores) < window:
        raise ValueError(f"window: need at least {window} steps with critic/score/mean, got {len(scores)}")
    first, last = mean(scores[:window]), mean(scores[-window:])
    return first, last, last - first


def timing_breakdown(steps: dict[int, dict[str, float]]) -> dict[str, float]:
    """Mean of every ``timing_s/*`` metric over the steps after the first one (all steps if only one)."""
    chosen = sorted(steps)[1:] or sorted(steps)
    keys = sorted({k for s in chosen for k in steps[s] if k.startswith("timing_s/")})
    return {k: mean(steps[s][k] for s in chosen if k in steps[s]) for k in keys}


def summary(text: str) -> str:
    """A short markdown summary of one run's log."""
    steps = parse_step_metrics(text)
    if not steps:
        return "no `step:N - ...` metric lines found"
    lines = [f"steps logged: {min(steps)}..{max(steps)} ({len(steps)})"]
    if len(steps) >= 10:
        first, last, rise = reward_rise(steps)
        lines.append(f"critic/score/mean: first 10 steps {first:.3f}, last 10 steps {last:.3f}, rise {rise:+.3f}")
    timing = timing_breakdown(steps)
    total = timing.get("timing_s/step")
    lines += ["", "| phase | mean s/step | share of step |", "|---|---|---|"]
    for key, value in sorted(timing.items(), key=lambda kv: -kv[1]):
        share = f"{100 * value / total:.1f}%" if total else "-"
        lines.append(f"| {key} | {value:.3f} | {share} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_group_ppo.logs", description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", help="console logs of main_ppo runs")
    for path in parser.parse_args(argv).logs:
        with open(path, errors="replace") as f:
            print(f"## {path}\n{summary(f.read())}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
