"""The value sources' view of verl's batch (verl glue): the stored fields each source reads
(:func:`fields_needed`) and the :class:`~verl_group_ppo.values.batch.BatchFields` built from what verl's
TransferQueue returns for them (:func:`batch_fields`).

Imports no verl module: it reads the ``TensorDict`` TransferQueue returns (jagged per-response tensors, non-tensor
stacks for ``uid`` and the reward's columns).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from verl_group_ppo.config import AlgorithmSettings
from verl_group_ppo.values.batch import BatchFields
from verl_group_ppo.values.mc_rollout import row_info

__all__ = ["NeededFields", "SOURCE_FIELDS", "batch_fields", "fields_needed"]

SOURCE_FIELDS: dict[str, tuple[str, ...]] = {
    "critic": ("values",),
    "prefix_tree": ("responses", "rm_scores", "uid"),
    "mc": ("responses", "rm_scores", "uid", "prompts", "data_source", "reward_model"),
}
"""verl's stored fields each value source reads besides ``response_mask``."""

OPTIONAL_FIELDS: dict[str, tuple[str, ...]] = {"mc": ("extra_info",)}
"""Fields a source reads when the dataset has them (``extra_info``: the reward function gets ``{}`` without)."""


@dataclass(frozen=True)
class NeededFields:
    """What to fetch for a value source: ``required`` fields and ``optional`` ones (fetched when stored)."""

    required: tuple[str, ...]
    optional: tuple[str, ...] = ()


def fields_needed(settings: AlgorithmSettings) -> NeededFields:
    """The stored fields :func:`~verl_group_ppo.values.sources.boundary_values` reads for
    ``settings.group.value_source``, ``old_log_probs`` included for the ``low_prob`` rule."""
    source = settings.group.value_source
    required = ["response_mask", *SOURCE_FIELDS.get(source, ())]
    if settings.group.boundary_rule == "low_prob":
        required.append("old_log_probs")
    return NeededFields(required=tuple(dict.fromkeys(required)), optional=OPTIONAL_FIELDS.get(source, ()))


def batch_fields(data: Any) -> BatchFields:
    """:class:`~verl_group_ppo.values.batch.BatchFields` from the ``TensorDict`` TransferQueue returned: per-token
    fields right-padded to (B, T) as verl's advantage step sees them, ``scores`` the sum of ``rm_scores``,
    ``reply_lengths`` from the jagged ``response_mask``, ``prompts`` without padding and ``reward_inputs`` from
    ``data_source``, ``reward_model`` and ``extra_info``. A field not in ``data`` stays None."""
    names = set(data.keys())
    padded = data.to_padded_tensor()

    def tensor(name: str) -> Any:
        return padded[name] if name in names else None

    nested_mask = data["response_mask"]
    reward_inputs = None
    if "data_source" in names and "reward_model" in names:
        extra = data.get("extra_info").tolist() if "extra_info" in names else None
        reward_inputs = row_info(data.get("data_source").tolist(), data.get("reward_model").tolist(), extra)
    return BatchFields(
        response_mask=padded["response_mask"],
        reply_lengths=torch.tensor([len(row) for row in nested_mask.unbind()], dtype=torch.long),
        responses=tensor("responses"),
        scores=padded["rm_scores"].sum(dim=-1) if "rm_scores" in names else None,
        uid=[str(uid) for uid in padded.get("uid").tolist()] if "uid" in names else None,
        values=tensor("values"),
        old_log_probs=tensor("old_log_probs"),
        prompts=[row.tolist() for row in data["prompts"].unbind()] if "prompts" in names else None,
        reward_inputs=reward_inputs,
    )
