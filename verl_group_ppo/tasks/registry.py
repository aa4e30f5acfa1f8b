"""The list of the package's tasks: :data:`TASKS`, one :class:`~verl_group_ppo.tasks.contract.Task` record per task
folder (its ``spec.TASK``). The one reward function (:mod:`verl_group_ppo.tasks.reward`) and the launcher
(:mod:`verl_group_ppo.tasks.launcher`) read the tasks from here and nowhere else.

Adding a task: its folder, and its ``TASK`` in :data:`TASKS` below.
"""

from __future__ import annotations

from .contract import Task
from .maths.spec import TASK as MATHS
from .tiny.spec import TASK as TINY

#: every task of the package
TASKS: tuple[Task, ...] = (TINY, MATHS)
