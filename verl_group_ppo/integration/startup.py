"""What the plugin runs in front of three verl start-up functions: the config checks of ``group_ppo`` runs and the
launch checks of every run.

==========================================  ====================================================================
verl function (wrapped by the entry point)  what runs first for ``algorithm.adv_estimator=group_ppo``
==========================================  ====================================================================
``verl.trainer.ppo.utils.need_critic``      :func:`check_group_ppo_config` (config keys), then "critic on"
``verl.utils.config.validate_config``       ``check_accelerator`` (only where Ray is not started yet) and
                                            ``check_cpu_sequence_parallel`` (CPU backend only), both of
                                            :mod:`verl_group_ppo.cpu.checks`; for any run with a critic,
                                            ``check_critic_attention`` (flash-attn missing); for any run scored
                                            by ``verl_group_ppo.tasks.reward``, its ``check_reward_scorers``
                                            (a scorer's module missing)
``verl.trainer.main_ppo.run_ppo``           :func:`check_entry_point` (refuses verl's fully_async and
                                            one_step_off_policy entry points)
==========================================  ====================================================================

verl's ``main_ppo`` calls ``need_critic`` and ``validate_config`` before ``ray.init`` (its ``main``, before
``run_ppo``), in that order, so a bad key is reported before the accelerator; the experimental entry points call
``run_ppo`` (their ``main``) before Ray starts. Every other estimator gets verl's behaviour, plus the critic's
attention check when it trains a critic.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any, Callable

from verl_group_ppo.config import GROUP_PARAMS_PATH, check_critic_loss_agg_mode, read_algorithm_settings, select
from verl_group_ppo.cpu.checks import check_accelerator, check_cpu_sequence_parallel
from verl_group_ppo.integration import ESTIMATOR_NAME
from verl_group_ppo.integration.failures import raise_if_install_failed

UNSUPPORTED_ENTRY_POINTS = {
    "verl.experimental.fully_async_policy": "fully_async_policy",
    "verl.experimental.one_step_off_policy": "one_step_off_policy",
}
"""verl packages whose trainers are not verl's v1 trainer classes (so the critic's values never reach
the ``group_ppo`` estimator), with the name used in the error."""


# ==================================================================================================
# config checks (need_critic)


def is_group_ppo(config: Any) -> bool:
    """True when ``config.algorithm.adv_estimator`` selects GROUP-PPO."""
    estimator = select(config, "algorithm.adv_estimator")
    return str(getattr(estimator, "value", estimator)) == ESTIMATOR_NAME


def check_group_ppo_config(config: Any) -> None:
    """Start-up checks for a ``group_ppo`` run; a ValueError names the offending key by its full path.

    Checks: the plugin installed completely; the v1 trainer is used; ``algorithm.gamma``/``lam``/``group_params``
    are valid; ``critic.enable``, if set, agrees with ``group_params.value_source``; ``value_source: mc`` has a
    rollout that can continue replies, and at least 2 replies per prompt for the
    critic-free sources (:func:`verl_group_ppo.values.limits.check_value_source_config`); ``critic.loss_agg_mode`` is ``token-mean`` when
    the critic loss runs at boundaries.
    """
    raise_if_install_failed()
    if select(config, "trainer.use_v1", True) is False:
        raise ValueError(
            f"trainer.use_v1=false: algorithm.adv_estimator={ESTIMATOR_NAME} runs only on verl's v1 trainer "
            "(the legacy trainer never hands the critic's values to an estimator); set trainer.use_v1=true.")
    settings = read_algorithm_settings(select(config, "algorithm"))
    source = settings.group.value_source
    enable = select(config, "critic.enable")
    if settings.group.uses_critic and enable is not None and not bool(enable):
        raise ValueError(
            f"critic.enable=false: algorithm.adv_estimator={ESTIMATOR_NAME} with {GROUP_PARAMS_PATH}.value_source="
            "critic needs a critic (its values set the group baselines); remove the override, set "
            f"critic.enable=true, or take the boundary values from {GROUP_PARAMS_PATH}.value_source=mc or "
            "prefix_tree.")
    if not settings.group.uses_critic and enable is not None and bool(enable):
        raise ValueError(
            f"critic.enable=true: {GROUP_PARAMS_PATH}.value_source={source} takes the boundary values without a "
            "critic, so a critic would train and never be read; remove critic.enable (GROUP-PPO decides) or set "
            "it to false.")
    from verl_group_ppo.values.limits import check_value_source_config  # values/ imports the core: not at import

    check_value_source_config(config)
    if settings.group.uses_critic and settings.group.critic_loss_on == "boundaries":
        check_critic_loss_agg_mode(select(config, "critic.loss_agg_mode", "token-mean"))


def make_need_critic(original: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """verl's ``need_critic`` with GROUP-PPO's rule in front: for ``group_ppo`` run the config checks and return
    True when the boundary values come from the critic (``value_source: critic``), False for ``mc`` and
    ``prefix_tree`` (no critic worker, as for grpo); for every other estimator return exactly what ``original``
    returns."""

    @functools.wraps(original)
    def need_critic(config: Any) -> bool:
        if not is_group_ppo(config):
            return original(config)
        check_group_ppo_config(config)
        return read_algorithm_settings(select(config, "algorithm")).group.uses_critic

    need_critic.verl_group_ppo_original = original  # type: ignore[attr-defined]
    return need_critic


# ==================================================================================================
# launch checks (validate_config, run_ppo)


def check_entry_point(task_runner_class: Any) -> None:
    """Refuse verl's ``fully_async_policy`` and ``one_step_off_policy`` entry points (ValueError).

    Their trainers derive from verl's legacy ``RayPPOTrainer`` (through
    ``verl.experimental.separation.ray_trainer.SeparateRayPPOTrainer``), not from the v1 trainer classes:
    verl's ``need_critic`` turns the critic on, but the critic's values never reach the estimator.
    """
    module = _defining_module(task_runner_class)
    for package, name in UNSUPPORTED_ENTRY_POINTS.items():
        if module == package or module.startswith(package + "."):
            raise ValueError(
                f"algorithm.adv_estimator={ESTIMATOR_NAME} is not supported by verl's {name} entry point "
                f"({module}): its trainer derives from verl's legacy RayPPOTrainer, which never hands the critic's "
                "values to the estimator, so the run would stop at its first advantage step after the models load. "
                "Use python -m verl.trainer.main_ppo (verl's v1 trainer); for asynchronous rollout set "
                "trainer.v1.trainer_mode=colocate_async or separate_async.")


def make_validate_config(original: Callable[..., Any]) -> Callable[..., Any]:
    """verl's ``validate_config`` with ``check_accelerator`` and ``check_cpu_sequence_parallel``
    (:mod:`verl_group_ppo.cpu.checks`) in front for ``group_ppo`` runs in a process that has not started Ray (inside
    Ray, a worker's visible devices say nothing); the critic's attention check for a run with a critic, and the
    scorers' check (:func:`verl_group_ppo.tasks.reward.check_reward_scorers`) and the tree rollout's
    (:func:`verl_group_ppo.tree.limits.check_tree_config`) for every run."""

    @functools.wraps(original)
    def validate_config(config: Any, *args: Any, **kwargs: Any) -> Any:
        if is_group_ppo(config) and not _ray_started():
            check_accelerator(config)
            check_cpu_sequence_parallel(config)
        if kwargs.get("use_critic", args[1] if len(args) > 1 else False) and not _ray_started():
            from verl_group_ppo.cpu.valuehead import check_critic_attention

            check_critic_attention(config)
        if not _ray_started():
            from verl_group_ppo.tasks.reward import check_reward_scorers
            from verl_group_ppo.tree.limits import check_tree_config

            check_reward_scorers(config)
            check_tree_config(config)
        return original(config, *args, **kwargs)

    validate_config.verl_group_ppo_original = original  # type: ignore[attr-defined]
    return validate_config


def make_run_ppo(original: Callable[..., Any]) -> Callable[..., Any]:
    """verl's ``run_ppo`` with :func:`check_entry_point` in front for ``group_ppo`` runs."""

    @functools.wraps(original)
    def run_ppo(config: Any, task_runner_class: Any, *args: Any, **kwargs: Any) -> Any:
        if is_group_ppo(config):
            check_entry_point(task_runner_class)
        return original(config, task_runner_class, *args, **kwargs)

    run_ppo.verl_group_ppo_original = original  # type: ignore[attr-defined]
    return run_ppo


def _defining_module(cls: Any) -> str:
    """The dotted module name that defines ``cls`` (a class or a Ray actor class); for a module run as
    ``python -m pkg.mod`` that is ``pkg.mod``, and for one run as ``python path/to/pkg/mod.py`` it is
    ``pkg.mod`` for the installed package ``pkg`` (found from the path), not ``__main__``."""
    module = getattr(cls, "__module__", None) or ""
    if module != "__main__":
        return module
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None:
        return spec.name
    path = os.path.splitext(os.path.abspath(getattr(main, "__file__", "") or ""))[0]
    parts = path.split(os.sep)
    if "verl" not in parts:
        return ""
    return ".".join(parts[len(parts) - 1 - parts[::-1].index("verl"):])


def _ray_started() -> bool:
    import ray

    return ray.is_initialized()
