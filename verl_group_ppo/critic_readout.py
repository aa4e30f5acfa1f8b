"""The critic's readout on scored replies: the batch layout, the critic's values, one warm-up update through verl's
value loss, and the explained variance on held-out replies.

The demo's value pretraining (:mod:`experiments.demo.pretrain`) and the maths-question task's critic benchmark
(:mod:`verl_group_ppo.tasks.maths.critic`) both measure and train a critic with these functions.

Layout (verl's): ``input_ids`` and ``attention_mask`` are (N, P + R), each prompt left-padded to the common width P
and each reply right-padded to the common width R; ``response_mask`` is (N, R), 1 on reply tokens. The critic's
value of reply token t is its output at position ``P - 1 + t``, the position *before* that token, as verl's critic
reads it. Positions count real tokens only (left padding gets position 0), as verl's do.

verl is imported only inside the functions that call it (:func:`lambda_returns`, :func:`warmup_update`), so the
layout serves modules that must not load verl.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence, Union

import torch

from verl_group_ppo.core_algos import explained_variance

#: a value clip range that never clips (verl's ``critic.cliprange_value`` takes a number, not "off")
NO_CLIP = 1e9

Rows = Union[slice, torch.Tensor]
"""Rows of a batch: a slice, or a (K,) long index tensor."""


class LaidOut(Protocol):
    """Anything laid out as verl lays out a batch (:class:`ScoredReplies`, the tiny task's ``Rollout``)."""

    @property
    def input_ids(self) -> torch.Tensor: ...  # (N, P + R) long

    @property
    def attention_mask(self) -> torch.Tensor: ...  # (N, P + R) 0/1

    @property
    def response_mask(self) -> torch.Tensor: ...  # (N, R) 0/1


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists left-padded with ``pad_id`` to the longest: (``input_ids`` (N, W), ``attention_mask`` (N, W)),
    both int64 on the CPU, the mask 1 on tokens. An empty list gives a row of padding."""
    return _pad(seqs, pad_id, left=True)


def right_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists right-padded with ``pad_id`` to the longest: (``input_ids`` (N, W), ``attention_mask`` (N, W)),
    both int64 on the CPU, the mask 1 on tokens. An empty list gives a row of padding."""
    return _pad(seqs, pad_id, left=False)


def _pad(seqs: Sequence[Sequence[int]], pad_id: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if len(seqs) == 0:
        raise ValueError("seqs: need at least one token list, got none")
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        if len(seq):
            cols = slice(width - len(seq), width) if left else slice(0, len(seq))
            ids[row, cols] = torch.tensor(list(seq), dtype=torch.long)
            mask[row, cols] = 1
    return ids, mask


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """(N, L) positions that count real tokens only (left padding gets position 0), from ``attention_mask``
    (N, L) 0/1."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


@dataclass(frozen=True)
class ScoredReplies:
    """Replies with their rewards, laid out as verl lays out a batch (the module's layout)."""

    input_ids: torch.Tensor  # (N, P + R) long: prompts left-padded to P, replies right-padded to R
    attention_mask: torch.Tensor  # (N, P + R) 0/1, 1 on prompt and reply tokens
    response_mask: torch.Tensor  # (N, R) float 0/1, 1 on reply tokens
    rewards: torch.Tensor  # (N, R) float: verl's token-level rewards (a reply's score at its last token)

    def __post_init__(self) -> None:
        n, width = self.input_ids.shape[0], self.input_ids.shape[-1]
        if self.input_ids.dim() != 2 or self.attention_mask.shape != self.input_ids.shape:
            raise ValueError(f"input_ids, attention_mask: need the same (N, P + R) shape, got "
                             f"{tuple(self.input_ids.shape)}, {tuple(self.attention_mask.shape)}")
        if (self.response_mask.dim() != 2 or self.response_mask.shape[0] != n
                or not 0 < self.response_mask.shape[1] < width or self.rewards.shape != self.response_mask.shape):
            raise ValueError(f"response_mask, rewards: need the same (N, R) shape with N = {n} and 0 < R < {width}, "
                             f"got {tuple(self.response_mask.shape)}, {tuple(self.rewards.shape)}")

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def prompt_width(self) -> int:
        """P, the common width of the left-padded prompts."""
        return int(self.input_ids.shape[1] - self.response_mask.shape[1])

    @property
    def responses(self) -> torch.Tensor:
        """(N, R) the reply tokens, right-padded."""
        return self.input_ids[:, self.prompt_width:]

    @property
    def scores(self) -> torch.Tensor:
        """(N,) each reply's total reward."""
        return self.rewards.sum(dim=-1)

    def select(self, rows: Rows) -> "ScoredReplies":
        """The replies at ``rows``."""
        return ScoredReplies(self.input_ids[rows], self.attention_mask[rows], self.response_mask[rows],
                             self.rewards[rows])


def lay_out(prompts: Sequence[Sequence[int]], replies: Sequence[Sequence[int]], scores: Sequence[float],
            pad_id: int) -> ScoredReplies:
    """:class:`ScoredReplies` from token lists: prompts left-padded and replies right-padded with ``pad_id``, each
    reply's score its reward at its last token."""
    if not len(prompts) == len(replies) == len(scores) or not prompts:
        raise ValueError(f"prompts, replies, scores: need the same non-zero length, got "
                         f"{len(prompts)}, {len(replies)}, {len(scores)}")
    if any(len(r) == 0 for r in replies):
        raise ValueError("replies: every reply needs at least one token")
    prompt_ids, prompt_mask = left_pad(prompts, pad_id)
    reply_ids, reply_mask = right_pad(replies, pad_id)
    rewards = torch.zeros(reply_ids.shape, dtype=torch.float32)
    last = torch.tensor([len(r) - 1 for r in replies])
    rewards[torch.arange(len(replies)), last] = torch.tensor(list(scores), dtype=torch.float32)
    return ScoredReplies(torch.cat([prompt_ids, reply_ids], dim=1), torch.cat([prompt_mask, reply_mask], dim=1),
                         reply_mask.float(), rewards)


def critic_values(critic: Any, batch: LaidOut) -> torch.Tensor:
    """(N, R) float32 values on the critic's device: ``values[:, t]`` is the critic's output at the position before
    reply token t. ``critic`` is a Hugging Face token-classification model with one label (verl's critic: the tiny
    task's and the maths-question task's alike)."""
    device = next(critic.parameters()).device
    mask = batch.attention_mask.to(device)
    out = critic(input_ids=batch.input_ids.to(device), attention_mask=mask, position_ids=position_ids(mask),
                 use_cache=False)
    start = batch.input_ids.shape[1] - batch.response_mask.shape[1]
    return out.logits[:, start - 1:-1, 0].float()


def predict_values(critic: Any, batch: ScoredReplies, batch_size: Optional[int] = None,
                   eval_mode: bool = True) -> torch.Tensor:
    """(N, R) :func:`critic_values` without gradients, in chunks of ``batch_size`` replies (None: one pass), on the
    critic's device. ``eval_mode``: read in eval mode, as verl's critic reads values (the critic's mode is restored
    after); False reads in the critic's current mode (a token-classification head's dropout is active in train
    mode)."""
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1 or None, got {batch_size}")
    step = batch_size or len(batch)
    was_training = critic.training
    if eval_mode:
        critic.eval()
    try:
        with torch.no_grad():
            return torch.cat([critic_values(critic, batch.select(slice(i, i + step)))
                              for i in range(0, len(batch), step)])
    finally:
        critic.train(was_training)


def lambda_returns(batch: ScoredReplies, values: torch.Tensor, gamma: float, lam: float) -> torch.Tensor:
    """(N, R) critic targets: verl's GAE returns of ``batch.rewards`` bootstrapped on ``values`` (N, R). With
    ``lam`` = 1 and zero ``values`` they are the Monte Carlo returns-to-go (:func:`monte_carlo_returns`)."""
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    if not 0.0 <= gamma <= 1.0 or not 0.0 <= lam <= 1.0:
        raise ValueError(f"gamma, lam: need values in [0, 1], got {gamma}, {lam}")
    mask = batch.response_mask.to(values.device)
    _, returns = compute_gae_advantage_return(batch.rewards.to(values.device), values, mask, gamma=gamma, lam=lam)
    return returns


def monte_carlo_returns(batch: ScoredReplies, gamma: float) -> torch.Tensor:
    """(N, R) discounted rewards-to-go of ``batch`` (on the rewards' device); with ``gamma`` = 1 and one reward at a reply's
    last token, that reward at every token of the reply."""
    return lambda_returns(batch, torch.zeros_like(batch.rewards), gamma, 1.0)


@dataclass(frozen=True)
class WarmupSettings:
    """How :func:`warmup_update` steps the critic: verl's critic settings of the same names."""

    cliprange_value: float = NO_CLIP  # values move at most this far from the pre-update values (NO_CLIP: off)
    grad_clip: float = 1.0  # the gradients' total norm is clipped to this before the optimiser steps
    loss_agg_mode: str = "token-mean"  # how verl's agg_loss reduces the per-token losses

    def __post_init__(self) -> None:
        for name in ("cliprange_value", "grad_clip"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")


def warmup_update(critic: Any, optimizer: torch.optim.Optimizer, batch: ScoredReplies, returns: torch.Tensor,
                  old_values: torch.Tensor, settings: WarmupSettings = WarmupSettings()) -> float:
    """One critic update on ``batch``: verl's ``compute_value_loss`` of the critic's values against ``returns``
    (N, R), clipped around ``old_values`` (N, R, the values before the step's first update), then back-propagation,
    the gradient clip and ``optimizer.step()``. Puts the critic in train mode. Returns the loss."""
    from verl.trainer.ppo.core_algos import compute_value_loss

    if returns.shape != batch.response_mask.shape or old_values.shape != batch.response_mask.shape:
        raise ValueError(f"returns, old_values: need the batch's {tuple(batch.response_mask.shape)} shape, got "
                         f"{tuple(returns.shape)}, {tuple(old_values.shape)}")
    critic.train()
    vpreds = critic_values(critic, batch)
    device = vpreds.device
    loss, _ = compute_value_loss(vpreds, returns.to(device), old_values.to(device), batch.response_mask.to(device),
                                 cliprange_value=settings.cliprange_value, loss_agg_mode=settings.loss_agg_mode)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(list(critic.parameters()), settings.grad_clip)
    optimizer.step()
    return float(loss.detach())


@dataclass(frozen=True)
class HeldOutFit:
    """How much of the returns' variance the critic explains on held-out replies (clipped to [-1, 1])."""

    all: float  # over every reply token: verl's critic/vf_explained_var
    first: float  # over each reply's first token: the value of the prompt alone


def heldout_explained_variance(critic: Any, held: ScoredReplies, gamma: float = 1.0,
                               batch_size: Optional[int] = None, eval_mode: bool = True) -> HeldOutFit:
    """The critic's explained variance on ``held`` against its Monte Carlo returns (discount ``gamma``), from
    :func:`verl_group_ppo.core_algos.explained_variance`; values as :func:`predict_values` reads them."""
    values = predict_values(critic, held, batch_size, eval_mode).cpu()
    returns = monte_carlo_returns(held, gamma).cpu()
    mask = held.response_mask.cpu()
    first = torch.zeros_like(mask)
    first[:, 0] = mask[:, 0]
    return HeldOutFit(explained_variance(returns, values, mask), explained_variance(returns, values, first))
