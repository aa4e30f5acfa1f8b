"""What a value source reads and what it returns: :class:`BatchFields` in, :class:`BoundaryValues` out.

Pure torch, no verl imports. Tensors are (B, T) = (batch, response length) in verl's convention:
``values[b, t]`` is the value of the state before response token t.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np
import torch

from verl_group_ppo.core_algos import IndexLike, prompt_ids


@dataclass(frozen=True)
class BatchFields:
    """One step's batch as the value sources read it; a source names the fields it needs
    (:func:`~verl_group_ppo.values.fields_needed`) and the others may be None.

    Attributes:
        response_mask: (B, T) 0/1, the tokens the policy is trained on (holes at tool observations).
        reply_lengths: (B,) long, the positions each reply has (assistant tokens and tool observations): the
            lengths of the stored, jagged reply.
        responses: (B, T) long token ids, right-padded.
        scores: (B,) float, each reply's reward (the sum of its token-level scores).
        uid: B prompt ids (verl's ``uid``).
        values: (B, T) float, the critic's values.
        old_log_probs: (B, T) float, the rollout policy's log-probs.
        prompts: B lists of prompt token ids, without padding.
        reward_inputs: B objects, what the run's reward function reads about a row besides the reply
            (opaque here; the continuation sampler reads them).
    """

    response_mask: torch.Tensor
    reply_lengths: Optional[torch.Tensor] = None
    responses: Optional[torch.Tensor] = None
    scores: Optional[torch.Tensor] = None
    uid: Optional[Sequence[Any]] = None
    values: Optional[torch.Tensor] = None
    old_log_probs: Optional[torch.Tensor] = None
    prompts: Optional[Sequence[Sequence[int]]] = None
    reward_inputs: Optional[Sequence[Any]] = None

    def require(self, name: str, source: str) -> Any:
        """The field ``name``; ValueError naming it and the value source when it is missing."""
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"fields.{name} is required by value_source={source!r} (fetch the fields that "
                             "fields_needed(settings) lists)")
        return value

    def reply_positions(self, source: str) -> torch.Tensor:
        """(B, T) long 0/1: 1 at the positions each reply has, from :attr:`reply_lengths`."""
        lengths = self.require("reply_lengths", source)
        width = self.response_mask.shape[1]
        positions = torch.arange(width, device=lengths.device)
        return (positions[None, :] < lengths[:, None]).long()


@dataclass(frozen=True)
class BoundaryValues:
    """A value source's answer for one step.

    Attributes:
        values: (B, T) float, the values the estimator reads at its group boundaries.
        endpoints: (B, T) bool, the group endpoints (step 2) when the source had to fix the groups before its values
            existed (``mc``); the estimator then uses them as they are. None: the estimator finds the groups.
        parent_nodes: (B, T) long, the tree node at each position (``prefix_tree`` under ``adv_norm: parent``), which
            the estimator reads at group starts to normalise sibling segments together; None otherwise.
        metrics: the source's own ``group/*`` scalars (``mc``: ``group/mc_responses``, ``group/mc_tokens``).
    """

    values: torch.Tensor
    endpoints: Optional[torch.Tensor] = None
    parent_nodes: Optional[torch.Tensor] = None
    metrics: dict[str, float] = field(default_factory=dict)


def prompt_rows(index: IndexLike, batch_size: int) -> list[torch.Tensor]:
    """The rows of each prompt id (:func:`~verl_group_ppo.core_algos.prompt_ids`): a list of (n_p,) long tensors,
    one per prompt in sorted order of the ids."""
    ids = prompt_ids(index, batch_size)
    return [torch.from_numpy(np.flatnonzero(ids == group)) for group in range(int(ids.max()) + 1 if len(ids) else 0)]
