"""The demo's optimiser plumbing, shared by its RL loop (:mod:`.rl`) and value pretraining (:mod:`.pretrain`):
shuffled mini-batches, the learning-rate warm-up, and one clipped gradient step."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch


def minibatches(n: int, size: int, epochs: int, generator: torch.Generator, device) -> Iterator[torch.Tensor]:
    """Index tensors (each (<= size,), long) of shuffled mini-batches: ``epochs`` passes over ``range(n)``, a fresh
    order each."""
    if n < 1 or size < 1 or epochs < 0:
        raise ValueError(f"minibatches: n and size must be >= 1 and epochs >= 0, got n={n}, size={size}, "
                         f"epochs={epochs}")
    for _ in range(epochs):
        perm = torch.randperm(n, generator=generator).to(device)
        for start in range(0, n, min(size, n)):
            yield perm[start:start + size]


def set_warmup_lr(opt: torch.optim.Optimizer, base_lr: float, updates_so_far: int, warmup: int) -> None:
    """Linear learning-rate warm-up over the optimiser's first ``warmup`` updates (fresh Adam moments are noisy):
    ``base_lr * min(1, (updates_so_far + 1) / warmup)``; ``warmup`` <= 1 means no warm-up."""
    for g in opt.param_groups:
        g["lr"] = base_lr * min(1.0, (updates_so_far + 1) / max(1, warmup))


def gradient_step(opt: torch.optim.Optimizer, loss: torch.Tensor, parameters: Iterable[torch.Tensor],
                  grad_clip: float) -> float:
    """One update: back-propagate the scalar ``loss``, clip the gradients' total norm to ``grad_clip``, step
    ``opt``. Returns the norm before clipping."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(list(parameters), grad_clip)
    opt.step()
    return float(norm)
