"""The tasks verl trains on: one folder each, and :data:`verl_group_ppo.tasks.registry.TASKS`, the list of them.

Every task folder has the same files (:mod:`verl_group_ppo.tasks.contract` says what each holds): ``spec.py`` (its
launcher runs and its :class:`~verl_group_ppo.tasks.contract.Task` record ``TASK``), ``variants.py``, ``prepare.py``
(``python -m verl_group_ppo.tasks.<name>.prepare --output-dir DIR``) and ``reward.py`` (its data sources and its
scorer). Beside the folders:

* :mod:`.registry`: ``TASKS``, the task list. Adding a task: its folder, and its ``TASK`` there;
* :mod:`.contract`: the task, spec and variant records, the prepared directory's layout, the prepare command line;
* :mod:`.reward`: the one reward function verl calls for every row
  (``reward.custom_reward_function.path=pkg://verl_group_ppo.tasks.reward``) and its start-up check of the scorers;
* :mod:`.launcher`: ``python -m verl_group_ppo.tasks.launcher shell TASK MULTI_TURN``, the variables
  examples/cpu/common.sh reads.

This package's ``__init__`` imports nothing, so that ``python -m verl_group_ppo.tasks.<name>.prepare`` loads only
its own task.
"""
