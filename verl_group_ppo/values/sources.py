"""Where the boundary values come from: :func:`boundary_values`, the one function the trainer calls each step.

Pure torch, no verl imports. ``algorithm.group_params.value_source`` picks the source (docs/algorithm.md, "Value
sources"):

=================  ==================================================================  =======================
``value_source``   the values                                                          the groups
=================  ==================================================================  =======================
``critic``         the critic's, as verl computed them                                 the estimator's step 2
``prefix_tree``    :func:`~verl_group_ppo.values.prefix_tree.prefix_tree_values`       the estimator's step 2;
                                                                                       ``boundary_rule: tree``:
                                                                                       the branch points, here
``mc``             :func:`~verl_group_ppo.values.mc.mc_source` (continuations from     fixed here, before the
                   the run's rollout through a :class:`~verl_group_ppo.values.mc.       values, and handed on
                   ContinuationSampler`)
=================  ==================================================================  =======================

A new source adds its branch here, its fields in :data:`~verl_group_ppo.values.verl_batch.SOURCE_FIELDS` and its
name in :data:`verl_group_ppo.config.VALUE_SOURCES`.
"""

from __future__ import annotations

from typing import Optional

from verl_group_ppo.config import GROUP_PARAMS_PATH, VALUE_SOURCES, AlgorithmSettings
from verl_group_ppo.values.batch import BatchFields, BoundaryValues
from verl_group_ppo.values.mc import ContinuationSampler, mc_source
from verl_group_ppo.values.prefix_tree import prefix_tree_source

__all__ = ["boundary_values"]


def boundary_values(settings: AlgorithmSettings, fields: BatchFields, *,
                    sampler: Optional[ContinuationSampler] = None) -> BoundaryValues:
    """The (B, T) values the estimator reads at group boundaries for this step's batch, by
    ``settings.group.value_source``; for ``mc`` also the group endpoints (B, T) bool and its metrics.

    Args:
        settings: from :func:`~verl_group_ppo.config.read_algorithm_settings`.
        fields: the batch (:class:`~verl_group_ppo.values.batch.BatchFields`), holding at least what
            :func:`~verl_group_ppo.values.verl_batch.fields_needed` lists for the source.
        sampler: the run's rollout for ``mc``'s continuations (read by no other source).

    Raises:
        ValueError: an unknown value source (naming ``algorithm.group_params.value_source``), a field the source
            needs missing, or ``mc`` without a ``sampler``.
    """
    source = settings.group.value_source
    if source == "critic":
        return BoundaryValues(values=fields.require("values", source))
    if source == "prefix_tree":
        return prefix_tree_source(fields, settings.group.boundary_rule, settings.group.adv_norm)
    if source == "mc":
        if sampler is None:
            raise ValueError("sampler is required by value_source='mc' (the run's rollout samples its continuations)")
        return mc_source(fields, settings, sampler)
    raise ValueError(f"{GROUP_PARAMS_PATH}.value_source={source!r} has no boundary values; one of "
                     f"{list(VALUE_SOURCES)}")
