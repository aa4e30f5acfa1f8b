"""The ``verl.plugins`` entry point ``group_ppo``: ``import verl`` imports this module, which installs.

Each install runs the moment verl imports the module it touches (a post-import hook, see
:mod:`~verl_group_ppo.integration.hooks`), so a process that never trains pays nothing for it:

===================================  ================================================================================
verl module imported                 what is installed
===================================  ================================================================================
``verl.trainer.ppo.core_algos``      ``group_ppo`` registered with ``register_adv_est``
                                     (:func:`~verl_group_ppo.integration.estimator.group_ppo_estimator`)
``verl.trainer.ppo.utils``           ``need_critic``: critic on for ``group_ppo``, after the config checks
``verl.utils.config``                ``validate_config``: the accelerator check for ``group_ppo`` before Ray starts
``verl.trainer.main_ppo``            ``run_ppo``: refuses verl's fully_async / one_step_off_policy entry points
``verl.trainer.ppo.v1``              our trainer module, which puts its classes into ``TRAINER_REGISTRY``
``verl.workers.rollout.base``        the ``hf`` rollout adapter's name
                                     (:func:`verl_group_ppo.rollout.register_hf_adapter`)
``verl.workers.rollout.replica``     the ``hf`` rollout replica's loader
                                     (:func:`verl_group_ppo.rollout.register_hf_replica`)
``verl.experimental.agent_loop.     the ``tree_single_turn`` agent loop (:mod:`verl_group_ppo.tree.agent_loop`)
agent_loop``
``verl.utils.model``                 the critic's value-model loader with the configured attention
                                     (:func:`verl_group_ppo.cpu.valuehead.patch_valuehead_loader`)
===================================  ================================================================================

The last three serve every platform: ``actor_rollout_ref.rollout.name=hf`` and a critic without flash-attn
work on CUDA as on CPU. Plus, at once and only with ``VERL_PLATFORM=cpu``, the CPU backend
(:mod:`verl_group_ppo.cpu`, docs/cpu.md).

Every install is guarded: a failure is logged at ERROR and recorded (:mod:`~verl_group_ppo.integration.failures`),
and ``group_ppo`` runs then stop with it. This module imports only the standard library and this
package's hook and failure modules; the installs import the rest when they run.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from verl_group_ppo.integration.failures import guarded, install_errors, record_failure
from verl_group_ppo.integration.hooks import post_import_hooks


def register_estimator(core_algos: ModuleType) -> None:
    """Register ``group_ppo`` (:func:`verl_group_ppo.integration.estimator.register_estimator`)."""
    importlib.import_module("verl_group_ppo.integration.estimator").register_estimator(core_algos)


def install_need_critic(ppo_utils: ModuleType) -> None:
    """Replace ``verl.trainer.ppo.utils.need_critic`` before any verl module imports it by name."""
    from verl_group_ppo.integration.startup import make_need_critic

    _wrap(ppo_utils, "need_critic", make_need_critic)


def install_validate_config(config_module: ModuleType) -> None:
    """Replace ``verl.utils.config.validate_config`` before verl's entry points import it by name."""
    from verl_group_ppo.integration.startup import make_validate_config

    _wrap(config_module, "validate_config", make_validate_config)


def install_run_ppo(main_ppo: ModuleType) -> None:
    """Replace ``verl.trainer.main_ppo.run_ppo`` (verl's experimental entry points import it at call time)."""
    from verl_group_ppo.integration.startup import make_run_ppo

    _wrap(main_ppo, "run_ppo", make_run_ppo)


def install_trainers(v1: ModuleType) -> None:
    """Import our trainer module, which installs its classes at the end of its own import."""
    importlib.import_module("verl_group_ppo.integration.trainer")


def install_hf_adapter(rollout_base: ModuleType) -> None:
    """Name the ``hf`` rollout adapter in verl's rollout registry (nothing of the rollout is imported)."""
    importlib.import_module("verl_group_ppo.rollout").register_hf_adapter(rollout_base)


def install_hf_replica(rollout_replica: ModuleType) -> None:
    """Register the ``hf`` rollout replica's loader (nothing of the rollout is imported)."""
    importlib.import_module("verl_group_ppo.rollout").register_hf_replica(rollout_replica)


def install_tree_agent_loop(agent_loop: ModuleType) -> None:
    """Register the ``tree_single_turn`` agent loop (its module registers itself with verl's ``register``)."""
    importlib.import_module("verl_group_ppo.tree.agent_loop")


def install_valuehead_loader(verl_model: ModuleType) -> None:
    """Replace ``verl.utils.model.load_valuehead_model`` with the loader that honours the configured attention."""
    importlib.import_module("verl_group_ppo.cpu.valuehead").patch_valuehead_loader()


def _wrap(module: ModuleType, name: str, make_wrapper) -> None:
    current = getattr(module, name)
    if getattr(current, "verl_group_ppo_original", None) is None:
        setattr(module, name, make_wrapper(current))


INSTALLS = (
    ("verl.trainer.ppo.core_algos", "registering the group_ppo advantage estimator", register_estimator),
    ("verl.trainer.ppo.utils", "installing need_critic for group_ppo", install_need_critic),
    ("verl.utils.config", "installing validate_config for group_ppo", install_validate_config),
    ("verl.trainer.main_ppo", "installing run_ppo for group_ppo", install_run_ppo),
    ("verl.trainer.ppo.v1", "importing the GROUP-PPO v1 trainer classes", install_trainers),
    ("verl.workers.rollout.base", "registering the hf rollout adapter", install_hf_adapter),
    ("verl.workers.rollout.replica", "registering the hf rollout replica", install_hf_replica),
    ("verl.experimental.agent_loop.agent_loop", "registering the tree_single_turn agent loop",
     install_tree_agent_loop),
    ("verl.utils.model", "installing the critic's value-model loader (configured attention)",
     install_valuehead_loader),
)
"""(verl module, what the install does (named in errors), install function)."""


def install_cpu_backend() -> None:
    """The CPU backend (:mod:`verl_group_ppo.cpu`), now: it does nothing at all unless ``VERL_PLATFORM=cpu``."""
    importlib.import_module("verl_group_ppo.cpu").install_if_requested()


CPU_BACKEND_STEP = "installing the CPU backend (VERL_PLATFORM=cpu)"


def install() -> None:
    """Arrange every install (idempotent); runs when verl loads this module."""
    for module_name, step, function in INSTALLS:
        try:
            post_import_hooks.add(module_name, guarded(step, function))
        except Exception as exc:  # noqa: BLE001 - recorded and logged, never breaks verl's import
            record_failure(step, exc)
    try:  # verl would hide an exception raised here; the backend logs and records its own failures loudly
        install_cpu_backend()
    except Exception as exc:  # noqa: BLE001
        record_failure(CPU_BACKEND_STEP, exc)


install()

__all__ = ["INSTALLS", "install", "install_errors"]
