"""Scoring the tiny task's responses with its exact verifier, and held-out accuracy of a policy.

Used by the demo's RL loop (`experiments/demo/rl.py`) and by :mod:`verl_group_ppo.tasks.tiny.prepare`,
which measures the warm start's accuracy the same way.
"""

from __future__ import annotations

import torch

from .model import Rollout, sample
from .problems import Problem, Task
from .tokenizer import CharTokenizer
from .warmstart import encode_prompt


def rewards_for(task: Task, tok: CharTokenizer, rollout: Rollout, problems: list[Problem]):
    """Exact verifier -> (rewards (B, T) with the score at the last valid token, scores, texts).

    Responses cut off without EOS score 0."""
    B, T = rollout.responses.shape
    rewards = torch.zeros((B, T), dtype=torch.float32, device=rollout.responses.device)
    scores, texts = [], []
    resp = rollout.responses.tolist()
    lengths = rollout.response_mask.sum(-1).long().tolist()
    for b in range(B):
        text = tok.decode(resp[b])
        s = task.verify(text, problems[b]) if tok.eos_id in resp[b] else 0.0
        scores.append(s)
        texts.append(text)
        if lengths[b] > 0:
            rewards[b, lengths[b] - 1] = s
    return rewards, scores, texts


@torch.no_grad()
def evaluate(policy, task: Task, tok: CharTokenizer, problems: list[Problem], response_len: int,
             greedy: bool = True, samples: int = 1, seed: int = 0, batch_size: int = 1024) -> float:
    """Accuracy on a held-out set: greedy decoding, or the mean verifier reward of ``samples`` responses
    per prompt sampled at temperature 1 (a fixed generator, so two calls on the same weights agree)."""
    gen = None if greedy else torch.Generator(device=next(policy.parameters()).device).manual_seed(seed)
    items = [p for p in problems for _ in range(1 if greedy else samples)]
    correct = 0.0
    for i in range(0, len(items), batch_size):
        chunk = items[i:i + batch_size]
        r = sample(policy, [encode_prompt(tok, p) for p in chunk], response_len, tok.pad_id, tok.eos_id,
                   greedy=greedy, generator=gen)
        _, scores, _ = rewards_for(task, tok, r, chunk)
        correct += sum(scores)
    return correct / max(1, len(items))
