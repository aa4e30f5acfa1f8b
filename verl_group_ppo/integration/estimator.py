"""The ``group_ppo`` advantage estimator: its registration with verl, the function verl calls, and the context
that hands it what verl does not pass (:func:`values_verl_does_not_pass`).

The math module is imported when the estimator first runs, so that registering the estimator (at
``import verl.trainer.ppo.core_algos``) works even when the math module is broken: a ``group_ppo`` run
then stops with that cause (see :mod:`verl_group_ppo.integration.failures`).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Iterator, Optional

from verl_group_ppo.integration import ESTIMATOR_NAME
from verl_group_ppo.integration.failures import raise_if_install_failed


@dataclass
class EstimatorInputs:
    """What verl does not pass to a registered estimator; ``outputs`` receives the estimator's
    :class:`~verl_group_ppo.core_algos.GroupPPOOutputs` (None until it ran)."""

    values: Any
    old_log_probs: Any = None
    threshold: Optional[float] = None
    endpoints: Any = None
    parent_nodes: Any = None
    outputs: Any = None


_active_inputs: contextvars.ContextVar[Optional[EstimatorInputs]] = contextvars.ContextVar(
    "verl_group_ppo_estimator_inputs", default=None)


@contextlib.contextmanager
def estimator_inputs(values: Any, old_log_probs: Any = None, threshold: Optional[float] = None,
                     endpoints: Any = None, parent_nodes: Any = None) -> Iterator[EstimatorInputs]:
    """Hand ``values`` (B, T) (and old log-probs (B, T), the current threshold, the groups' endpoints (B, T)
    bool when they were decided before the advantage step, and the tree's nodes (B, T) for ``adv_norm: parent``) to
    :func:`group_ppo_estimator` for calls made inside the ``with`` block; yields the record whose ``outputs`` the
    estimator fills."""
    inputs = EstimatorInputs(values=values, old_log_probs=old_log_probs, threshold=threshold, endpoints=endpoints,
                             parent_nodes=parent_nodes)
    token = _active_inputs.set(inputs)
    try:
        yield inputs
    finally:
        _active_inputs.reset(token)


def values_verl_does_not_pass() -> EstimatorInputs:
    """What verl does not hand a registered estimator (it passes only rewards, mask, config and index): the critic's
    values, old log-probs, tau, endpoints and tree nodes that the GROUP-PPO trainer put into :func:`estimator_inputs`
    around verl's advantage step. RuntimeError when no trainer set them."""
    inputs = _active_inputs.get()
    if inputs is None:
        raise RuntimeError(
            f"algorithm.adv_estimator={ESTIMATOR_NAME} got no critic values: verl passes values only to "
            "'gae', so GROUP-PPO runs through the verl-group-ppo trainer classes (verl's v1 trainer, "
            "trainer.use_v1=true, with the plugin loaded), or pass values= when calling it directly.")
    return inputs


def group_ppo_estimator(token_level_rewards, response_mask, config=None, index=None, values=None,
                        old_log_probs=None, threshold=None, endpoints=None, parent_nodes=None, **kwargs: Any):
    """The function registered as ``group_ppo`` (:func:`register_estimator`): verl's estimator convention.

    Args:
        token_level_rewards, response_mask: (B, T), as verl passes them.
        config: verl's ``algorithm`` config (read with ``read_algorithm_settings``).
        index: (B,) prompt ids (verl's ``uid``), or None.
        values, old_log_probs, threshold, endpoints, parent_nodes: from :func:`values_verl_does_not_pass` when
            ``values`` is not given.
        kwargs: other arguments verl may add (``reward_baselines``), ignored.

    Returns:
        ``(advantages, returns)``, each (B, T).
    """
    raise_if_install_failed()
    inputs = None
    if values is None:
        inputs = values_verl_does_not_pass()
        values = inputs.values
        old_log_probs = inputs.old_log_probs if old_log_probs is None else old_log_probs
        threshold = inputs.threshold if threshold is None else threshold
        endpoints = inputs.endpoints if endpoints is None else endpoints
        parent_nodes = inputs.parent_nodes if parent_nodes is None else parent_nodes
    from verl_group_ppo.config import read_algorithm_settings
    from verl_group_ppo.core_algos import compute_group_ppo_outputs

    outputs = compute_group_ppo_outputs(token_level_rewards, response_mask, values=values,
                                        settings=read_algorithm_settings(config), index=index,
                                        old_log_probs=old_log_probs, threshold=threshold, endpoints=endpoints,
                                        parent_nodes=parent_nodes)
    if inputs is not None:
        inputs.outputs = outputs
    return outputs.advantages, outputs.returns


def register_estimator(core_algos: ModuleType) -> None:
    """Register :func:`group_ppo_estimator` as ``group_ppo`` in verl's ``core_algos`` module, then import our math
    module so that a broken install shows now (logged, and raised by the start-up checks and the estimator for
    group_ppo runs), not at the first step."""
    core_algos.register_adv_est("group_ppo")(group_ppo_estimator)
    importlib.import_module("verl_group_ppo.core_algos")
