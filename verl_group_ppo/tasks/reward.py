"""The package's one reward function for verl: every task's rows are scored through it.

verl's reward loop calls ``compute_score(data_source, solution_str, ground_truth, extra_info)`` for every response
when the run sets::

    reward.custom_reward_function.path=pkg://verl_group_ppo.tasks.reward
    reward.custom_reward_function.name=compute_score

A row names its task by its ``data_source`` (written by the task's ``prepare``), and :func:`compute_score` hands it
to the scorer of the task in :data:`verl_group_ppo.tasks.registry.TASKS` whose ``data_sources`` hold it: the tiny task's
exact verifier (:func:`verl_group_ppo.tasks.tiny.reward.compute_score`, a float) or the maths-question task's
final-answer match (:func:`verl_group_ppo.tasks.maths.reward.compute_score`, a dict whose ``score`` verl takes as the
reward and whose other fields go into its ``reward_extra_info``).

verl's reward loop catches a scorer's exception for each response, logs it and goes on with a score of 0, so a
scorer that cannot import its module would train on zero rewards without stopping. :func:`check_scorers` imports
what each task's scorer needs (its ``scorer_modules``) before the first response, and names the extra that installs
a missing module; :func:`check_reward_scorers` runs it at start-up (the plugin calls it from verl's
``validate_config``) over the data sources of the run's parquet files, for a run scored by this function.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, Iterable

from verl_group_ppo.config import select

from .registry import TASKS
from .contract import Task

#: verl's ``reward.custom_reward_function.path`` of every task
REWARD_PATH = "pkg://verl_group_ppo.tasks.reward"
#: the same function named by its file
REWARD_FILE = "verl_group_ppo/tasks/reward.py"


def task_for(data_source: str) -> Task:
    """The task of :data:`~verl_group_ppo.tasks.registry.TASKS` whose rows carry ``data_source``; ValueError for none."""
    for task in TASKS:
        if data_source in task.data_sources:
            return task
    known = sorted(s for task in TASKS for s in task.data_sources)
    raise ValueError(f"data_source: {data_source!r} is not a task of verl_group_ppo; expected one of {known}")


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
                  **kwargs: Any) -> float | dict[str, float]:
    """The score of one response, by the task its ``data_source`` names; ValueError for a data source of no task."""
    return task_for(data_source).compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)


def check_scorers(data_sources: Iterable[str]) -> None:
    """Import what scoring ``data_sources`` needs. ImportError naming the module, a data source that needs it and the
    extra that installs it; ValueError (as :func:`compute_score`) for a data source of no task."""
    sources = set(data_sources)
    for source in sorted(sources):
        task_for(source)
    for task in TASKS:
        needing = sorted(sources & task.data_sources)
        if not needing:
            continue
        for module in task.scorer_modules:
            try:
                importlib.import_module(module)
            except ImportError as error:
                raise ImportError(f"data_source {needing[0]!r}: its scorer needs {module} ({error}); install it with "
                                  f"pip install 'verl-group-ppo[{task.extra}]' (an offline bundle: --extra "
                                  f"{task.extra})") from error


# ------------------------------------------------------------------------------ the start-up check of a run

def uses_package_reward(config: Any) -> bool:
    """True when ``reward.custom_reward_function.path`` is :data:`REWARD_PATH` or the file :data:`REWARD_FILE`."""
    path = str(select(config, "reward.custom_reward_function.path", "") or "")
    return path == REWARD_PATH or path.replace(os.sep, "/").endswith(REWARD_FILE)


def parquet_data_sources(paths: Any) -> set[str]:
    """The ``data_source`` values of the parquet files ``paths`` (one path or a list; files that are missing or have
    no ``data_source`` column are skipped: verl reports those itself)."""
    import pyarrow.parquet as pq

    found: set[str] = set()
    for path in [paths] if isinstance(paths, str) else list(paths or []):
        path = os.path.expanduser(str(path))
        if not os.path.isfile(path) or "data_source" not in pq.read_schema(path).names:
            continue
        found.update(str(v) for v in pq.read_table(path, columns=["data_source"]).column(0).unique().to_pylist())
    return found


def check_reward_scorers(config: Any) -> None:
    """For a run scored by this package's reward (:func:`uses_package_reward`): import what its rows' scorers need
    (:func:`check_scorers` over the data sources of ``data.train_files`` and ``data.val_files``), so that a missing
    module stops the run here instead of scoring every response 0."""
    if not uses_package_reward(config):
        return
    check_scorers(parquet_data_sources(select(config, "data.train_files"))
                  | parquet_data_sources(select(config, "data.val_files")))
