"""Where the boundary values come from: the critic, the prefix tree of a prompt's replies, or Monte Carlo
continuations (``algorithm.group_params.value_source``), behind one function the trainer calls each step.

================================  =====================================================================
module                            holds
================================  =====================================================================
:mod:`.sources`                   :func:`boundary_values`: the dispatch by value source
:mod:`.batch`                     :class:`BatchFields` (what a source reads), :class:`BoundaryValues`
:mod:`.prefix_tree`               ``prefix_tree``'s values (pure torch)
:mod:`.mc`                        ``mc``'s groups, prefixes and means; :class:`ContinuationSampler`
:mod:`.limits`                    start-up refusals (:func:`check_value_source_config`)
:mod:`.verl_batch` (verl glue)    :func:`fields_needed` and :func:`batch_fields` over verl's stored batch
:mod:`.mc_rollout` (verl glue)    ``mc``'s sampler over verl's rollout servers and reward function
================================  =====================================================================

Importing this package imports no verl module.
"""

from verl_group_ppo.values.batch import BatchFields, BoundaryValues
from verl_group_ppo.values.limits import check_value_source_config
from verl_group_ppo.values.mc import ContinuationSampler, Continuations, Prefix, mc_boundary_values
from verl_group_ppo.values.prefix_tree import prefix_tree_values, shared_prefix_lengths
from verl_group_ppo.values.sources import boundary_values
from verl_group_ppo.values.verl_batch import NeededFields, batch_fields, fields_needed

__all__ = [
    "BatchFields",
    "BoundaryValues",
    "ContinuationSampler",
    "Continuations",
    "NeededFields",
    "Prefix",
    "batch_fields",
    "boundary_values",
    "check_value_source_config",
    "fields_needed",
    "mc_boundary_values",
    "prefix_tree_values",
    "shared_prefix_lengths",
]
