"""verl integration of GROUP-PPO: everything that touches verl's trainer lives in this subpackage.

=======================  ===========================================================================
module                   what it holds
=======================  ===========================================================================
``entry_point``          the ``verl.plugins`` entry point: only the installs (which verl module, what)
``hooks``                post-import hooks (run an install right after verl executes a module)
``failures``             the install-failure record (read by the start-up checks and the estimator)
``estimator``            the registered ``group_ppo`` estimator and the context that feeds it values
``startup``              what runs in front of verl's ``need_critic``, ``validate_config`` and ``run_ppo``
``trainer``              the trainer mixin over verl's three v1 trainers; installs them on import
``critic_loss``          the boundary critic loss in verl's loss-function convention
``checkpoint``           the threshold's state file in verl's checkpoint folders
``rollout_groups``       ``{step}.groups.jsonl`` beside verl's rollout dump
=======================  ===========================================================================

Import order (no cycle, run-time imports included): ``entry_point`` imports ``hooks`` and ``failures``
and, when the hooked verl modules are imported, ``estimator``, ``startup`` and ``trainer``; nothing here
imports ``entry_point``. This package's ``__init__`` imports only the standard library.
"""

ESTIMATOR_NAME = "group_ppo"
"""The value of ``algorithm.adv_estimator`` that selects GROUP-PPO."""
