"""The tiny task's reward: verl's score of one of its rows.

verl's reward loop calls the package's one reward function, :func:`verl_group_ppo.tasks.reward.compute_score`
(``reward.custom_reward_function.path=pkg://verl_group_ppo.tasks.reward``), for every response; it hands the rows
whose ``data_source`` is one of :data:`DATA_SOURCES` to :func:`compute_score` here.

The score is the task's exact verifier (:meth:`verl_group_ppo.tasks.tiny.problems.Task.verify`): 1.0 when the
response is the correct running totals followed by ``#<answer>``, else 0.0; for the tool-use task (data source ending
``+tools``) the final answer of the episode (:func:`verl_group_ppo.tasks.tiny.tooluse.score_transcript`). The
problem set is named by the row's ``data_source`` (``verl_group_ppo/chain_sum``); the problem is rebuilt from the row
written by :func:`verl_group_ppo.tasks.tiny.variants.verl_row` (``reward_model.ground_truth`` and ``extra_info``).

verl hands over the decoded text only (special tokens skipped), so a response cut off at
``data.max_response_length`` without EOS is scored on its text; a cut-off response almost never has the exact form.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from .problems import PROBLEM_SETS, Problem, Task, make_task

DATA_SOURCE_PREFIX = "verl_group_ppo/"
#: the modules the scorer imports beyond verl-group-ppo's requirements (chain_sum's scorer is reasoning-gym's), and
#: the extra of verl-group-ppo that installs them
SCORER_MODULES = ("reasoning_gym.utils",)
SCORER_EXTRA = "demo"


#: the ``data_source`` suffix of the tool-use task's rows (:mod:`verl_group_ppo.tasks.tiny.tooluse`)
TOOLS_SUFFIX = "+tools"


def data_source_for(task_name: str, suffix: str = "") -> str:
    """The ``data_source`` written into a row of ``task_name`` (e.g. ``verl_group_ppo/chain_sum``, or with
    ``suffix`` :data:`TOOLS_SUFFIX` ``verl_group_ppo/chain_sum+tools`` for the tool-use task)."""
    if task_name not in PROBLEM_SETS:
        raise ValueError(f"task_name: unknown task {task_name!r}; choose one of {sorted(PROBLEM_SETS)}")
    if suffix not in ("", TOOLS_SUFFIX):
        raise ValueError(f"suffix: must be '' or {TOOLS_SUFFIX!r}, got {suffix!r}")
    if suffix and task_name != "chain_sum":
        raise ValueError(f"task_name: the tool-use task is built on chain_sum, got {task_name!r}")
    return DATA_SOURCE_PREFIX + task_name + suffix


#: every ``data_source`` a row of the tiny task carries: each task's, and the tool-use task's
DATA_SOURCES = frozenset([*(data_source_for(name) for name in PROBLEM_SETS),
                          data_source_for("chain_sum", TOOLS_SUFFIX)])


@lru_cache(maxsize=None)
def task_for(data_source: str) -> Task:
    """The task a ``data_source`` names; ValueError for any other data source."""
    name = data_source[len(DATA_SOURCE_PREFIX):] if data_source.startswith(DATA_SOURCE_PREFIX) else None
    if name not in PROBLEM_SETS:
        raise ValueError(f"data_source: {data_source!r} is not a task of verl_group_ppo; expected one of "
                         f"{sorted(DATA_SOURCE_PREFIX + t for t in PROBLEM_SETS)}")
    return make_task(name)


def problem_from_row(ground_truth: str, extra_info: dict[str, Any]) -> Problem:
    """Rebuild the ``Problem`` from a row's ``reward_model.ground_truth`` and ``extra_info``."""
    missing = [k for k in ("prompt", "solution", "entry_json") if k not in extra_info]
    if missing:
        raise ValueError(f"extra_info: missing {missing} (rows are written by verl_group_ppo.tasks.tiny.prepare)")
    return Problem(prompt=extra_info["prompt"], answer=str(ground_truth), solution=extra_info["solution"],
                   entry=json.loads(extra_info["entry_json"]))


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
                  **kwargs: Any) -> float:
    """The tiny task's score of one response: the task's exact verifier, 1.0 or 0.0."""
    if extra_info is None:
        raise ValueError("extra_info: verl passed none; the tiny task's rows carry the problem there")
    problem = problem_from_row(ground_truth, extra_info)
    if data_source.endswith(TOOLS_SUFFIX):
        from .tooluse import score_transcript

        return score_transcript(solution_str, problem, task_for(data_source[: -len(TOOLS_SUFFIX)]))
    return float(task_for(data_source).verify(solution_str, problem))
