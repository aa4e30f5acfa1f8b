"""verl plugin: ``import verl`` loads this module through the ``verl.plugins`` entry point ``group_ppo``.

It changes nothing at import time except to arrange three installs that run the moment verl imports
the module they touch (post-import hooks), so that a process which never trains (a Ray worker, a
script that only needs ``verl.protocol``) pays nothing for them:

=====================================  ========================================================================
verl module imported                   what is installed
=====================================  ========================================================================
``verl.trainer.ppo.core_algos``        ``group_ppo`` registered with ``register_adv_est`` (:func:`group_ppo_estimator`)
``verl.trainer.ppo.utils``             ``need_critic`` replaced by :func:`make_need_critic`'s wrapper: critic on
                                       for ``group_ppo`` and the GROUP-PPO start-up checks (before Ray starts)
``verl.trainer.ppo.v1``                ``TRAINER_REGISTRY`` entries ``sync``, ``colocate_async``, ``separate_async``
                                       replaced by the GROUP-PPO subclasses in :mod:`verl_group_ppo.trainer`
=====================================  ========================================================================

verl swallows plugin exceptions at DEBUG level. Here every install step is guarded: a failure is logged
at ERROR with its traceback and remembered, and a ``group_ppo`` run then stops with that original cause
(from ``need_critic`` before Ray starts, or from the estimator). Runs with any other estimator are left
alone. This module imports only the standard library at import time.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import importlib.abc
import logging
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Iterator, Optional

ESTIMATOR_NAME = "group_ppo"
"""The value of ``algorithm.adv_estimator`` that selects GROUP-PPO."""

CORE_ALGOS_MODULE = "verl.trainer.ppo.core_algos"
PPO_UTILS_MODULE = "verl.trainer.ppo.utils"
V1_TRAINER_MODULE = "verl.trainer.ppo.v1"

logger = logging.getLogger("verl_group_ppo")

_install_errors: list[tuple[str, BaseException]] = []
"""(what failed to install, the exception) for every failed install step in this process."""


# ==================================================================================================
# failure reporting


class PluginInstallError(RuntimeError):
    """A ``group_ppo`` run was requested but part of the verl-group-ppo plugin failed to install."""


def install_errors() -> list[tuple[str, BaseException]]:
    """The install steps that failed in this process, each with its exception (empty when all worked)."""
    return list(_install_errors)


def _record_failure(step: str, exc: BaseException) -> None:
    """Remember a failed install step and log it at ERROR with its traceback."""
    _install_errors.append((step, exc))
    logger.error(
        "verl-group-ppo: %s failed (%s: %s); algorithm.adv_estimator=%s runs will stop with this error, "
        "other estimators are unaffected.", step, type(exc).__name__, exc, ESTIMATOR_NAME, exc_info=exc,
    )


def raise_if_install_failed() -> None:
    """Raise :class:`PluginInstallError` chained to the first failed install step, if any failed."""
    if _install_errors:
        step, exc = _install_errors[0]
        others = f" (and {len(_install_errors) - 1} more install failure(s), see the ERROR log)" \
            if len(_install_errors) > 1 else ""
        raise PluginInstallError(
            f"algorithm.adv_estimator={ESTIMATOR_NAME} needs the verl-group-ppo plugin, but {step} failed: "
            f"{type(exc).__name__}: {exc}{others}") from exc


def _guarded(step: str, hook: Callable[[ModuleType], None]) -> Callable[[ModuleType], None]:
    """Wrap an install hook so that an exception is recorded and logged instead of breaking verl's import."""

    @functools.wraps(hook)
    def run(module: ModuleType) -> None:
        try:
            hook(module)
        except Exception as exc:  # noqa: BLE001 - every failure must be reported, none may break verl
            _record_failure(step, exc)

    return run


# ==================================================================================================
# post-import hooks (run an install step right after verl executes a module)


class _HookedLoader(importlib.abc.Loader):
    """Delegates to the real loader and runs the hooks once the module has executed."""

    def __init__(self, loader: importlib.abc.Loader, hooks: list[Callable[[ModuleType], None]]):
        self._loader = loader
        self._hooks = hooks

    def create_module(self, spec):  # noqa: D102 - importlib protocol
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        """Execute the module with its real loader (restored on the module), then run the hooks."""
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        for hook in self._hooks:
            hook(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class _PostImportHooks(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that only wraps the loaders of the modules it has hooks for."""

    def __init__(self) -> None:
        self._pending: dict[str, list[Callable[[ModuleType], None]]] = {}

    def add(self, module_name: str, hook: Callable[[ModuleType], None]) -> None:
        """Run ``hook(module)`` now if the module is already imported, else right after it is."""
        module = sys.modules.get(module_name)
        if module is not None:
            if getattr(module.__spec__, "_initializing", False):
                raise RuntimeError(f"{module_name} is half-imported while the plugin loads; it cannot be hooked")
            hook(module)
            return
        self._pending.setdefault(module_name, []).append(hook)
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def find_spec(self, fullname: str, path=None, target=None):  # noqa: D102 - importlib protocol
        if fullname not in self._pending:
            return None
        spec = self._find_with_other_finders(fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _HookedLoader(spec.loader, self._pending.pop(fullname))
        if not self._pending and self in sys.meta_path:
            sys.meta_path.remove(self)  # the import system stops iterating once a spec is returned
        return spec

    def _find_with_other_finders(self, fullname: str, path, target):
        for finder in list(sys.meta_path):
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None


_hooks = _PostImportHooks()


# ==================================================================================================
# the estimator and the context that feeds it


@dataclass
class EstimatorInputs:
    """What verl does not pass to a registered estimator, set by the GROUP-PPO trainer around verl's
    advantage step; ``outputs`` receives the full :class:`~verl_group_ppo.core_algos.GroupPPOOutputs`."""

    values: Any
    old_log_probs: Any = None
    threshold: Optional[float] = None
    outputs: Any = None


_active_inputs: contextvars.ContextVar[Optional[EstimatorInputs]] = contextvars.ContextVar(
    "verl_group_ppo_estimator_inputs", default=None)


@contextlib.contextmanager
def estimator_inputs(values: Any, old_log_probs: Any = None,
                     threshold: Optional[float] = None) -> Iterator[EstimatorInputs]:
    """Hand ``values`` (and old log-probs, and the current threshold) to :func:`group_ppo_estimator`
    for calls made inside the ``with`` block; yields the record whose ``outputs`` the estimator fills."""
    inputs = EstimatorInputs(values=values, old_log_probs=old_log_probs, threshold=threshold)
    token = _active_inputs.set(inputs)
    try:
        yield inputs
    finally:
        _active_inputs.reset(token)


def group_ppo_estimator(token_level_rewards, response_mask, config=None, index=None, values=None,
                        old_log_probs=None, threshold=None, **kwargs: Any):
    """The function registered as ``group_ppo``: verl's estimator convention, ``(advantages, returns)``.

    verl passes only rewards, mask, ``config`` and ``index`` to a registered estimator; ``values``,
    ``old_log_probs`` and ``threshold`` come from :func:`estimator_inputs` (the GROUP-PPO trainer sets
    it) unless given explicitly. Other keyword arguments verl may add (``reward_baselines``) are ignored.
    """
    raise_if_install_failed()
    inputs = _active_inputs.get()
    if values is None:
        if inputs is None:
            raise RuntimeError(
                f"algorithm.adv_estimator={ESTIMATOR_NAME} got no critic values: verl passes values only to "
                "'gae', so GROUP-PPO runs through the verl-group-ppo trainer classes (verl's v1 trainer, "
                "trainer.use_v1=true, with the plugin loaded), or pass values= when calling it directly.")
        values = inputs.values
        old_log_probs = inputs.old_log_probs if old_log_probs is None else old_log_probs
        threshold = inputs.threshold if threshold is None else threshold
    from verl_group_ppo.core_algos import compute_group_ppo_outputs

    outputs = compute_group_ppo_outputs(token_level_rewards, response_mask, values, index=index, config=config,
                                        old_log_probs=old_log_probs, threshold=threshold)
    if inputs is not None:
        inputs.outputs = outputs
    return outputs.advantages, outputs.returns


# ==================================================================================================
# need_critic and the start-up checks


def is_group_ppo(config: Any) -> bool:
    """True when ``config.algorithm.adv_estimator`` selects GROUP-PPO."""
    estimator = _select(config, "algorithm.adv_estimator")
    return str(getattr(estimator, "value", estimator)) == ESTIMATOR_NAME


def check_group_ppo_config(config: Any) -> None:
    """Start-up checks for a ``group_ppo`` run; a ValueError names the offending key.

    Checks: the plugin installed completely; the v1 trainer is used; the critic is not disabled;
    ``algorithm.gamma``/``lam``/``group_params`` are valid; ``critic.loss_agg_mode`` is ``token-mean``
    when the critic loss runs at boundaries.
    """
    raise_if_install_failed()
    if _select(config, "trainer.use_v1", True) is False:
        raise ValueError(
            f"trainer.use_v1=false: algorithm.adv_estimator={ESTIMATOR_NAME} runs only on verl's v1 trainer "
            "(the legacy trainer never hands the critic's values to an estimator); set trainer.use_v1=true.")
    enable = _select(config, "critic.enable")
    if enable is not None and not bool(enable):
        raise ValueError(
            f"critic.enable=false: algorithm.adv_estimator={ESTIMATOR_NAME} needs a critic (its values set the "
            "group baselines); remove the override or set critic.enable=true.")
    from verl_group_ppo.config import read_algorithm_settings

    settings = read_algorithm_settings(_select(config, "algorithm"))
    if settings.group.critic_loss_on == "boundaries":
        check_critic_loss_agg_mode(_select(config, "critic.loss_agg_mode", "token-mean"))


def check_critic_loss_agg_mode(loss_agg_mode: Any) -> None:
    """The boundary critic loss (spec Step 7) is defined for verl's ``token-mean`` aggregation only."""
    if loss_agg_mode != "token-mean":
        raise ValueError(
            f"critic.loss_agg_mode={loss_agg_mode!r} is not supported with algorithm.adv_estimator="
            f"{ESTIMATOR_NAME} and group_params.critic_loss_on=boundaries: the boundary weights N_valid/N_boundary "
            "assume verl's token-mean; set critic.loss_agg_mode=token-mean (or critic_loss_on=all_tokens).")


def make_need_critic(original: Callable[[Any], bool]) -> Callable[[Any], bool]:
    """verl's ``need_critic`` with GROUP-PPO's rule in front: for ``group_ppo`` run the start-up checks
    and return True; for every other estimator return exactly what ``original`` returns."""

    @functools.wraps(original)
    def need_critic(config: Any) -> bool:
        if not is_group_ppo(config):
            return original(config)
        check_group_ppo_config(config)
        return True

    need_critic.verl_group_ppo_original = original  # type: ignore[attr-defined]
    return need_critic


def _select(config: Any, dotted_key: str, default: Any = None) -> Any:
    """``config.a.b`` for a DictConfig or nested mappings, ``default`` when a level is missing."""
    node = config
    for part in dotted_key.split("."):
        if node is None:
            return default
        getter = getattr(node, "get", None)
        node = getter(part, None) if getter is not None else getattr(node, part, None)
    return default if node is None else node


# ==================================================================================================
# the three installs


def _register_estimator(core_algos: ModuleType) -> None:
    """Register ``group_ppo``, then import our math module so that a broken install shows now (logged,
    and raised by ``need_critic`` and the estimator for group_ppo runs) rather than at the first step."""
    core_algos.register_adv_est(ESTIMATOR_NAME)(group_ppo_estimator)
    import verl_group_ppo.core_algos  # noqa: F401


def _install_need_critic(ppo_utils: ModuleType) -> None:
    """Replace ``verl.trainer.ppo.utils.need_critic`` before any verl module imports it by name."""
    current = ppo_utils.need_critic
    if getattr(current, "verl_group_ppo_original", None) is None:
        ppo_utils.need_critic = make_need_critic(current)


TRAINER_MODULE = "verl_group_ppo.trainer"
_TRAINERS_STEP = "installing the GROUP-PPO v1 trainer classes"
_deferred_v1: list[ModuleType] = []


def _install_trainers(v1: ModuleType) -> None:
    """Replace verl's v1 trainer registry entries with the GROUP-PPO subclasses.

    When our trainer module is itself what imported verl's v1 package (a user imported it first), it
    is only half-initialised here; the install is then left to the end of that module, see
    :func:`run_deferred_trainer_install`.
    """
    trainer = sys.modules.get(TRAINER_MODULE)
    if trainer is not None and getattr(trainer.__spec__, "_initializing", False):
        _deferred_v1.append(v1)
        return
    importlib.import_module(TRAINER_MODULE).install_trainers(v1.trainer_base.TRAINER_REGISTRY)


def run_deferred_trainer_install(install: Callable[[dict], None]) -> None:
    """Called as :mod:`verl_group_ppo.trainer` finishes importing: run a trainer install the v1 hook deferred."""
    while _deferred_v1:
        v1 = _deferred_v1.pop()
        _guarded(_TRAINERS_STEP, lambda module: install(module.trainer_base.TRAINER_REGISTRY))(v1)


def install() -> None:
    """Arrange the three installs (idempotent); called when verl loads this module."""
    for module_name, step, hook in (
        (CORE_ALGOS_MODULE, "registering the group_ppo advantage estimator", _register_estimator),
        (PPO_UTILS_MODULE, "installing need_critic for group_ppo", _install_need_critic),
        (V1_TRAINER_MODULE, _TRAINERS_STEP, _install_trainers),
    ):
        try:
            _hooks.add(module_name, _guarded(step, hook))
        except Exception as exc:  # noqa: BLE001
            _record_failure(step, exc)
    try:  # the CPU backend: does nothing unless VERL_PLATFORM=cpu (verl would hide an exception raised here)
        importlib.import_module("verl_group_ppo.cpu").install_if_requested()
    except Exception as exc:  # noqa: BLE001
        _record_failure("installing the CPU backend (VERL_PLATFORM=cpu)", exc)


install()
