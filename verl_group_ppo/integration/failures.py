"""The install-failure record: which install step failed in this process, and the error it raised.

verl swallows plugin exceptions at DEBUG level, so every install step is guarded here: a failure is
logged at ERROR with its traceback and remembered, and a ``group_ppo`` run then stops with that
original cause (from the start-up checks before Ray starts, or from the estimator). Runs with any
other estimator are left alone. Standard library only.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, TypeVar

from verl_group_ppo.integration import ESTIMATOR_NAME

logger = logging.getLogger("verl_group_ppo")

T = TypeVar("T")

_install_errors: list[tuple[str, BaseException]] = []
"""(what failed to install, the exception) for every failed install step in this process."""


class PluginInstallError(RuntimeError):
    """A ``group_ppo`` run was requested but part of the verl-group-ppo plugin failed to install."""


def install_errors() -> list[tuple[str, BaseException]]:
    """The install steps that failed in this process, each with its exception (empty when all worked)."""
    return list(_install_errors)


def record_failure(step: str, exc: BaseException) -> None:
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


def guarded(step: str, install: Callable[[T], None]) -> Callable[[T], None]:
    """Wrap an install so that an exception is recorded and logged instead of breaking verl's import."""

    @functools.wraps(install)
    def run(target: T) -> None:
        try:
            install(target)
        except Exception as exc:  # noqa: BLE001 - every failure must be reported, none may break verl
            record_failure(step, exc)

    return run
