"""The maths-question task's critic on held-out replies: how well verl's critic predicts the reward after
critic-only warm-up, measured outside the trainer.

The critic is what verl's FSDP critic loads: ``AutoModelForTokenClassification`` with one label from the task's
checkpoint (the pretrained LM with a new value head). The layout, the values, the update and the explained variance
are :mod:`verl_group_ppo.critic_readout`'s; this module samples and scores the replies and takes a warm-up step as
verl's ``trainer.critic_warmup`` does with the launchers' batch (:func:`warmup_step`). The held-out replies are
sampled from the test split's prompts; the figures are the explained variance over every reply token (verl's
``critic/vf_explained_var``) and over the first reply token alone (the value of the prompt).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from verl_group_ppo.critic_readout import (ScoredReplies, WarmupSettings, lay_out, monte_carlo_returns,
                                           predict_values, warmup_update)

from .reward import compute_score


def sample_replies(model: Any, tokenizer: Any, rows: Sequence[dict], samples: int, max_tokens: int,
                   generator: torch.Generator, batch_size: int = 64) -> ScoredReplies:
    """``samples`` replies (temperature 1, at most ``max_tokens``) to each of ``rows`` (verl's parquet rows:
    ``prompt`` messages, ``data_source`` and ``reward_model.ground_truth``), scored by the task's reward for the
    row's ``data_source`` (:func:`~verl_group_ppo.tasks.maths.reward.compute_score`, as verl scores it)."""
    from .evaluation import sample

    if lacking := [i for i, row in enumerate(rows) if "data_source" not in row]:
        raise ValueError(f"rows: row {lacking[0]} has no data_source (verl's parquet rows carry one; it picks the "
                         "reward)")
    items = [row for row in rows for _ in range(samples)]
    done = sample(model, tokenizer, [row["prompt"] for row in items], max_tokens, False, generator, batch_size)
    scores = [compute_score(row["data_source"], text, str(row["reward_model"]["ground_truth"]))["score"]
              for row, (_, _, text) in zip(items, done)]
    return lay_out([prompt for prompt, _, _ in done], [c.token_ids for _, c, _ in done], scores,
                   int(tokenizer.pad_token_id))


def warmup_step(critic: Any, optimizer: torch.optim.Optimizer, batch: ScoredReplies, updates: int,
                settings: WarmupSettings = WarmupSettings(), batch_size: int = 64) -> list[float]:
    """One critic-only warm-up step on ``batch``, as verl's ``trainer.critic_warmup`` takes it: the critic's values
    before the step (``batch_size`` replies a pass), then ``updates`` updates (:func:`~verl_group_ppo.critic_readout.
    warmup_update`), one per consecutive mini-batch of ``len(batch) / updates`` replies, against the reply's score
    at every reply token (its return with the launchers' ``gamma = lam = 1``). Returns the losses.

    The recorded figures (docs/results.md, the critic on held-out replies) are the launchers' batch of 64 replies,
    ``updates=2``, AdamW with weight decay 0.01 and the default ``settings``: gradient clip 1.0 and no value clip
    (``cliprange_value=NO_CLIP``; verl's critic clips at 0.5, ``WarmupSettings(cliprange_value=0.5)``). Without
    the clip, verl's loss is half the token-mean squared error and takes the same update."""
    if updates < 1 or len(batch) % updates:
        raise ValueError(f"updates: must be >= 1 and divide the batch's {len(batch)} replies, got {updates}")
    old_values = predict_values(critic, batch, batch_size)
    returns = monte_carlo_returns(batch, 1.0)
    size = len(batch) // updates
    return [warmup_update(critic, optimizer, batch.select(rows), returns[rows], old_values[rows], settings)
            for rows in (slice(u * size, (u + 1) * size) for u in range(updates))]
