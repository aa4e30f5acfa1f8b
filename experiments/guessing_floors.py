"""What the tiny tasks' policies would score without reading the prompt: the best constant response's share of the
problems each comparison measures on (:func:`verl_group_ppo.tasks.tiny.problems.guessing_floor`).

    python -m experiments.guessing_floors      # a few seconds, no model

One row per (task, problem set) that a comparison in docs/results.md reports on, built exactly as its pipeline builds
it (:func:`verl_group_ppo.tasks.tiny.problems.split_problems` with the pipeline's own sizes and seed):

* the demo (``python -m experiments.demo``: the demo comparison, longer chains, edge vs response length): its
  held-out prompts, at 4-5, 8-10 and 12-14 terms, graded with ``check_work`` (steps and answer);
* the CPU launcher's tiny task (``python -m verl_group_ppo.tasks.tiny.prepare``: the main command, value sources): its
  test split and its training pool (the comparisons read the training reward), graded with ``check_work``;
* the tool task (``prepare --tools``: the multi-turn comparison): the same problems graded on the final answer alone.

Then the arithmetic maths task's modules (:mod:`verl_group_ppo.tasks.maths.arith`): the best constant answer's share of
:data:`MATHS_QUESTIONS` questions drawn at seed 0 (:func:`verl_group_ppo.tasks.maths.numeric.guessing_floor`).
"""

from __future__ import annotations

import argparse
from typing import Callable, NamedTuple

from experiments.demo.cli import DemoOptions
from verl_group_ppo.tasks.tiny.prepare import PrepareSettings, settings_from_flags, task_and_split
from verl_group_ppo.tasks.tiny.variants import TOOLS
from verl_group_ppo.tasks.tiny.problems import Problem, Task, guessing_floor, make_task, parse_terms, split_problems


#: questions drawn per arithmetic module for its floor
MATHS_QUESTIONS = 2000


class Setup(NamedTuple):
    """One problem set a comparison measures on."""

    label: str  # where docs/results.md reports on it
    answer_only: bool  # graded on the final answer alone (the tool task)
    split: Callable[[], tuple[Task, list[Problem], list[Problem]]]  # the task, its training pool, its held-out set


def demo_split(terms: str) -> Callable[[], tuple[Task, list[Problem], list[Problem]]]:
    """The demo's problems at ``terms`` (its ``prepare``: split_problems at its default seed)."""
    opts = DemoOptions()

    def split() -> tuple[Task, list[Problem], list[Problem]]:
        task = make_task(opts.task, parse_terms(terms))
        return task, *split_problems(task, opts.train_size, opts.final_eval_size)

    return split


def setups() -> list[Setup]:
    """The problem sets of the comparisons, from the pipelines' own defaults."""
    tiny, tools = PrepareSettings(), settings_from_flags({"variant": TOOLS.name})
    return [*(Setup(f"demo, {terms} terms", False, demo_split(terms)) for terms in ("4-5", "8-10", "12-14")),
            Setup("launcher's tiny task", False, lambda: task_and_split(tiny)),
            Setup("tool task (multi-turn)", True, lambda: task_and_split(tools))]


def floors(setup: Setup) -> dict[str, tuple[str, float, int]]:
    """``{"held-out" | "training": (best constant response, its share, problems)}`` of ``setup``."""
    task, train, held = setup.split()
    return {name: (*guessing_floor(task, problems, setup.answer_only), len(problems))
            for name, problems in (("held-out", held), ("training", train))}


def table(rows: list[tuple[Setup, dict[str, tuple[str, float, int]]]]) -> str:
    out = ["| problems | graded on | held-out: floor (problems) | its best constant response | training pool: floor "
           "(problems) |", "|---|---|---|---|---|"]
    for setup, f in rows:
        (response, held, n_held), (_, train, n_train) = f["held-out"], f["training"]
        graded = "final answer" if setup.answer_only else "steps and answer (`check_work`)"
        out.append(f"| {setup.label} | {graded} | {held:.4f} ({n_held}) | `{response}` | {train:.4f} ({n_train}) |")
    return "\n".join(out)


def maths_table(count: int = MATHS_QUESTIONS) -> str:
    """The arithmetic modules' floors: per module the best constant answer and its share of ``count`` questions."""
    from verl_group_ppo.tasks.maths import arith
    from verl_group_ppo.tasks.maths.numeric import guessing_floor as numeric_floor

    out = [f"| arithmetic module | floor ({count} questions) | its best constant answer |", "|---|---|---|"]
    for module in arith.MODULES:
        answer, share = numeric_floor([q.answer for q in arith.draw([module], count, 0)])
        out.append(f"| `{module}` | {share:.4f} | `{answer}` |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    rows = []
    for setup in setups():
        print(f"[guessing floors] {setup.label} ...", flush=True)
        rows.append((setup, floors(setup)))
    print(table(rows))
    print()
    print(maths_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
