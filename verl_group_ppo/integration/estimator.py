"""The ``group_ppo`` advantage estimator as verl registers it, and the context that feeds it.

verl passes a registered estimator only rewards, mask, its ``algorithm`` config and ``index``. The
critic's values (and old log-probs, and the current threshold) come from :func:`estimator_inputs`,
which the GROUP-PPO trainer sets around verl's own advantage step; the estimator puts the full
:class:`~verl_group_ppo.core_algos.GroupPPOOutputs` back into that context.

The math module is imported when the estimator first runs, so that registering the estimator (at
``import verl.trainer.ppo.core_algos``) works even when the math module is broken: a ``group_ppo`` run
then stops with that cause (see :mod:`verl_group_ppo.integration.failures`).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
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
    outputs: Any = None


_active_inputs: contextvars.ContextVar[Optional[EstimatorInputs]] = contextvars.ContextVar(
    "verl_group_ppo_estimator_inputs", default=None)


@contextlib.contextmanager
def estimator_inputs(values: Any, old_log_probs: Any = None,
                     threshold: Optional[float] = None) -> Iterator[EstimatorInputs]:
    """Hand ``values`` (B, T) (and old log-probs (B, T), and the current threshold) to
    :func:`group_ppo_estimator` for calls made inside the ``with`` block; yields the record whose
    ``outputs`` the estimator fills."""
    inputs = EstimatorInputs(values=values, old_log_probs=old_log_probs, threshold=threshold)
    token = _active_inputs.set(inputs)
    try:
        yield inputs
    finally:
        _active_inputs.reset(token)


def group_ppo_estimator(token_level_rewards, response_mask, config=None, index=None, values=None,
                        old_log_probs=None, threshold=None, **kwargs: Any):
    """The function registered as ``group_ppo``: verl's estimator convention.

    Args:
        token_level_rewards, response_mask: (B, T), as verl passes them.
        config: verl's ``algorithm`` config (read with ``read_algorithm_settings``).
        index: (B,) prompt ids (verl's ``uid``), or None.
        values, old_log_probs, threshold: taken from :func:`estimator_inputs` when not given.
        kwargs: other arguments verl may add (``reward_baselines``), ignored.

    Returns:
        ``(advantages, returns)``, each (B, T).
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
    from verl_group_ppo.config import read_algorithm_settings
    from verl_group_ppo.core_algos import compute_group_ppo_outputs

    # the values, from here or from the trainer's context, enter the pass at core_algos._run_steps
    outputs = compute_group_ppo_outputs(token_level_rewards, response_mask, values=values,
                                        settings=read_algorithm_settings(config), index=index,
                                        old_log_probs=old_log_probs, threshold=threshold)
    if inputs is not None:
        inputs.outputs = outputs
    return outputs.advantages, outputs.returns
