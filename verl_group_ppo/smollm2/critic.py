"""The real-model task's critic on held-out replies: how well verl's critic predicts the reward after critic-only
warm-up, measured outside the trainer.

The critic is what verl's FSDP critic loads: ``AutoModelForTokenClassification`` with one label from the task's
checkpoint (the pretrained LM with a new value head), read at the position before each reply token, as verl's
critic reads its values. With the launchers' ``gamma = lam = 1`` and a reward at the last reply token only, the
return at every reply token is the reply's score. A warm-up step is what verl's ``trainer.critic_warmup`` does
with the launchers' batch: 64 fresh replies of the frozen warm-start policy, cut into two mini-batches of 32, one
AdamW update each on half the token-mean squared error (verl's default weight decay 0.01 and gradient clip 1.0;
verl's value clip, 0.5 around the pre-update values, is left out). The held-out replies are sampled from the test
split's prompts, and the figure is :func:`verl_group_ppo.core_algos.explained_variance` over every reply token
(verl's ``critic/vf_explained_var``) and over the first reply token alone (the value of the prompt).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from verl_group_ppo.core_algos import explained_variance

from .answers import score_reply


@dataclass(frozen=True)
class ScoredReplies:
    """Sampled replies and their scores, laid out for the critic.

    ``input_ids``, ``attention_mask`` and ``position_ids`` are (N, P + R): prompts left-padded to width P, replies
    right-padded to width R. ``response_mask`` is (N, R), 1 on reply tokens; ``scores`` is (N,) in {0, 1}.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    response_mask: torch.Tensor
    scores: torch.Tensor

    def __len__(self) -> int:
        return int(self.scores.shape[0])

    @property
    def prompt_width(self) -> int:
        return int(self.input_ids.shape[1] - self.response_mask.shape[1])

    def returns(self) -> torch.Tensor:
        """(N, R) float32: the score at every reply token (the return with gamma = lam = 1)."""
        return self.scores[:, None] * self.response_mask

    def select(self, rows: slice) -> "ScoredReplies":
        return ScoredReplies(self.input_ids[rows], self.attention_mask[rows], self.position_ids[rows],
                             self.response_mask[rows], self.scores[rows])


def lay_out(prompts: Sequence[Sequence[int]], replies: Sequence[Sequence[int]], scores: Sequence[float],
            pad_id: int) -> ScoredReplies:
    """:class:`ScoredReplies` from token lists: prompts left-padded, replies right-padded with ``pad_id``."""
    if not len(prompts) == len(replies) == len(scores) or not prompts:
        raise ValueError(f"prompts, replies, scores: need the same non-zero length, got "
                         f"{len(prompts)}, {len(replies)}, {len(scores)}")
    if any(len(r) == 0 for r in replies):
        raise ValueError("replies: every reply needs at least one token")
    width_p, width_r = max(len(p) for p in prompts), max(len(r) for r in replies)
    ids = torch.full((len(prompts), width_p + width_r), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (prompt, reply) in enumerate(zip(prompts, replies)):
        ids[i, width_p - len(prompt):width_p] = torch.tensor(prompt)
        ids[i, width_p:width_p + len(reply)] = torch.tensor(reply)
        mask[i, width_p - len(prompt):width_p + len(reply)] = 1
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    return ScoredReplies(ids, mask, positions, mask[:, width_p:].float(), torch.tensor(scores, dtype=torch.float32))


def sample_replies(model: Any, tokenizer: Any, rows: Sequence[dict], samples: int, max_tokens: int,
                   generator: torch.Generator, batch_size: int = 64) -> ScoredReplies:
    """``samples`` replies (temperature 1, at most ``max_tokens``) to each of ``rows`` (verl's parquet rows:
    ``prompt`` messages and ``reward_model.ground_truth``), scored by the task's reward."""
    from .evaluation import sample

    items = [row for row in rows for _ in range(samples)]
    done = sample(model, tokenizer, [row["prompt"] for row in items], max_tokens, False, generator, batch_size)
    scores = [score_reply(text, str(row["reward_model"]["ground_truth"])).score
              for row, (_, _, text) in zip(items, done)]
    return lay_out([prompt for prompt, _, _ in done], [c.token_ids for _, c, _ in done], scores,
                   int(tokenizer.pad_token_id))


def critic_values(critic: Any, batch: ScoredReplies) -> torch.Tensor:
    """(N, R) values: the critic's output at the position before each reply token (float32, on the critic's
    device)."""
    device = next(critic.parameters()).device
    out = critic(input_ids=batch.input_ids.to(device), attention_mask=batch.attention_mask.to(device),
                 position_ids=batch.position_ids.to(device))
    start = batch.prompt_width
    return out.logits[:, start - 1:-1, 0].float()


def update(critic: Any, optimizer: torch.optim.Optimizer, batch: ScoredReplies, grad_clip: float = 1.0) -> float:
    """One critic update on ``batch``: half the token-mean squared error against the returns. Returns the loss."""
    critic.train()
    device = next(critic.parameters()).device
    mask, returns = batch.response_mask.to(device), batch.returns().to(device)
    loss = 0.5 * (((critic_values(critic, batch) - returns) ** 2) * mask).sum() / mask.sum()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(critic.parameters(), grad_clip)
    optimizer.step()
    return float(loss.detach())


def heldout_explained_variance(critic: Any, held: ScoredReplies, batch_size: int = 64) -> dict[str, float]:
    """The critic's explained variance on ``held``: over every reply token (``all``, verl's
    ``vf_explained_var``) and over the first reply token of each reply (``first``)."""
    critic.eval()
    with torch.no_grad():
        values = torch.cat([critic_values(critic, held.select(slice(i, i + batch_size))).cpu()
                            for i in range(0, len(held), batch_size)])
    first = torch.zeros_like(held.response_mask)
    first[:, 0] = 1.0
    returns = held.returns()
    return {"all": explained_variance(returns, values, held.response_mask),
            "first": explained_variance(returns, values, first)}
