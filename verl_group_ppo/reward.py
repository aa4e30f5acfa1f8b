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

verl's reward loop catches a scorer's exception for each response, logs it and goes on with a score of 0, so a
scorer that cannot import its module would train on zero rewards without stopping. :func:`check_scorers` imports
what each task's scorer needs before the first response (the plugin calls it at start-up from ``validate_config``
with the data sources of the run's parquet files) and names the extra that installs a missing module.
"""

from __future__ import annotations

import importlib
from typing import Any, Iterable

from .mathtask import reward as mathtask_reward
from .tinytask import reward as tinytask_reward


#: per task (its data sources): the module its scorer imports beyond verl-group-ppo's requirements, and the
#: extra of verl-group-ppo that installs it
SCORER_IMPORTS = ((tinytask_reward.DATA_SOURCES, "reasoning_gym.utils", "demo"),)


def check_scorers(data_sources: Iterable[str]) -> None:
    """Import what scoring ``data_sources`` needs. ImportError naming the module, a data source that needs it and the
    extra that installs it; ValueError (as :func:`compute_score`) for a data source of no task."""
    sources = set(data_sources)
    known = tinytask_reward.DATA_SOURCES | mathtask_reward.DATA_SOURCES
    unknown = sorted(sources - known)
    if unknown:
        raise ValueError(f"data_source: {unknown[0]!r} is not a task of verl_group_ppo; expected one of {sorted(known)}")
    for task_sources, module, extra in SCORER_IMPORTS:
        needing = sorted(sources & task_sources)
        if not needing:
            continue
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise ImportError(f"data_source {needing[0]!r}: its scorer needs {module} ({error}); install it with "
                              f"pip install 'verl-group-ppo[{extra}]' (an offline bundle: --extra {extra})") from error


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
                  **kwargs: Any) -> float | dict[str, float]:
    """The score of one response, by the task its ``data_source`` names; ValueError for a data source of no task."""
    if data_source in tinytask_reward.DATA_SOURCES:
        return tinytask_reward.compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)
    if data_source in mathtask_reward.DATA_SOURCES:
        return mathtask_reward.compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)
    known = sorted(tinytask_reward.DATA_SOURCES | mathtask_reward.DATA_SOURCES)
    raise ValueError(f"data_source: {data_source!r} is not a task of verl_group_ppo; expected one of {known}")
