"""The tiny tasks' guessing floor (verl_group_ppo.tasks.tiny.problems.guessing_floor): the best constant response by its
grader, against a loop over every candidate response; and the benchmark that tabulates it for the comparisons."""

from __future__ import annotations

import pytest

from experiments import guessing_floors as G  # noqa: E402
from experiments.demo.cli import DemoOptions  # noqa: E402
from verl_group_ppo.tasks.tiny.prepare import PrepareSettings, task_and_split  # noqa: E402
from verl_group_ppo.tasks.tiny.problems import (ANSWER_MARK, ModChainTask, Problem, answer_is_right,  # noqa: E402
                                           guessing_floor, make_task)

PROBLEMS = [Problem("2+3-1=", "4", "5 4 #4"), Problem("1+4-1=", "4", "5 4 #4"), Problem("1+2+1=", "4", "3 4 #4"),
            Problem("1+6+0=", "7", "7 7 #7")]


def loop_floor(task, problems, answer_only: bool) -> float:
    """Every problem's solution and every ``#answer`` tried as the constant response, graded one by one."""
    candidates = {p.solution for p in problems} | {f"{ANSWER_MARK}{p.answer}" for p in problems}
    grade = (lambda r, p: answer_is_right(r, p, task)) if answer_only else task.verify
    return max(sum(grade(r, p) for p in problems) / len(problems) for r in candidates)


def test_with_check_work_the_floor_is_the_most_frequent_solution_and_on_the_answer_alone_the_most_frequent_answer():
    task = ModChainTask()
    assert guessing_floor(task, PROBLEMS) == ("5 4 #4", 0.5)
    assert guessing_floor(task, PROBLEMS, answer_only=True) == ("#4", 0.75)
    task.check_work = False  # verify grades the answer alone: the same floor as answer_only
    assert guessing_floor(task, PROBLEMS) == ("#4", 0.75)


@pytest.mark.parametrize("name", ["mod_chain", "chain_sum"])
@pytest.mark.parametrize("answer_only", [False, True])
def test_no_candidate_response_beats_the_floor(name, answer_only):
    task = make_task(name, (2, 3))  # short chains, so that solutions repeat
    problems = task.problems(300, 5)
    response, floor = guessing_floor(task, problems, answer_only)
    assert floor == pytest.approx(loop_floor(task, problems, answer_only)) and floor > 1 / 300
    assert response in {p.solution for p in problems} | {f"{ANSWER_MARK}{p.answer}" for p in problems}


def test_no_problems_is_refused_by_name():
    with pytest.raises(ValueError, match="problems: give at least one problem"):
        guessing_floor(ModChainTask(), [])


def test_the_benchmark_measures_each_comparisons_own_problem_sets():
    rows = {s.label: s for s in G.setups()}
    assert [label for label in rows if rows[label].answer_only] == ["tool task (multi-turn)"]
    task, train, held = rows["demo, 8-10 terms"].split()
    assert (task.min_terms, task.max_terms, len(train), len(held)) == (8, 10, DemoOptions().train_size,
                                                                         DemoOptions().final_eval_size)
    tiny = task_and_split(PrepareSettings())
    _, train, held = rows["launcher's tiny task"].split()
    assert [p.prompt for p in held] == [p.prompt for p in tiny[2]] and len(train) == len(tiny[1])
    small = G.Setup("mod chains", True, lambda: (ModChainTask(), PROBLEMS[:2], PROBLEMS))
    f = G.floors(small)
    assert f == {"held-out": ("#4", 0.75, 4), "training": ("#4", 1.0, 2)}
    assert G.table([(small, f)]).splitlines()[-1] == "| mod chains | final answer | 0.7500 (4) | `#4` | 1.0000 (2) |"


def test_the_maths_table_gives_each_arithmetic_module_its_most_frequent_answer():
    table = G.maths_table(count=40)
    rows = [line for line in table.splitlines() if line.startswith("| `arith.")]
    assert len(rows) == 4
    share = float(rows[0].split("|")[2])
    assert 1 / 40 <= share <= 1
