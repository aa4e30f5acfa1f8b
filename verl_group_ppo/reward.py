"""The package's one reward function for verl: every task's rows are scored through it.

verl's reward loop calls ``compute_score(data_source, solution_str, ground_truth, extra_info)`` for every response
when the run sets::

    reward.custom_reward_function.path=pkg://verl_group_ppo.reward
    reward.custom_reward_function.name=compute_score

A row names its task by its ``data_source`` (written by the task's ``prepare``), and :func:`compute_score` hands it
to that task's scorer: the tiny task's exact verifier (:func:`verl_group_ppo.tinytask.reward.compute_score`, a float)
or the maths-question task's final-answer match (:func:`verl_group_ppo.mathtask.reward.compute_score`, a dict whose
``score`` verl takes as the reward and whose other fields go into its ``reward_extra_info``). Another task is one
more branch.
"""

from __future__ import annotations

from typing import Any

from .mathtask import reward as mathtask_reward
from .tinytask import reward as tinytask_reward


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
                  **kwargs: Any) -> float | dict[str, float]:
    """The score of one response, by the task its ``data_source`` names; ValueError for a data source of no task."""
    if data_source in tinytask_reward.DATA_SOURCES:
        return tinytask_reward.compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)
    if data_source in mathtask_reward.DATA_SOURCES:
        return mathtask_reward.compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)
    known = sorted(tinytask_reward.DATA_SOURCES | mathtask_reward.DATA_SOURCES)
    raise ValueError(f"data_source: {data_source!r} is not a task of verl_group_ppo; expected one of {known}")
