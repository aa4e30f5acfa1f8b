"""Value pretraining: the critic trained alone on the warm-start policy's samples before RL starts.

verl's ``trainer.critic_warmup`` is critic-only steps on the *current* policy's samples inside RL; this is the
same idea done once, up front, with its own settings (:class:`PretrainConfig`), cached beside the warm start
and shared by every critic arm and seed (the critic's initial weights do not depend on the seed: its backbone
is the warm start's and its value head starts at zero). Each pretraining step samples
``prompts_per_step x n_samples`` responses from the frozen warm-start policy, computes their targets (lambda
returns with ``lam``; 1 = Monte Carlo returns) and takes ``epochs`` passes of verl's clipped value loss over
them. Progress is the critic's explained variance on a fixed held-out set: responses of the same policy to
held-out prompts, against their Monte Carlo returns, over every response token (verl's ``vf_explained_var``). The
layout, the critic's values, the update and the explained variance are :mod:`verl_group_ppo.critic_readout`'s.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator, Optional

import numpy as np
import torch

from verl_group_ppo.critic_readout import (NO_CLIP, ScoredReplies, WarmupSettings, heldout_explained_variance,
                                           lambda_returns, predict_values, warmup_update)
from verl_group_ppo.files import write_file
from verl_group_ppo.tasks.tiny.evaluation import rewards_for
from verl_group_ppo.tasks.tiny.model import build_critic, sample
from verl_group_ppo.tasks.tiny.problems import Problem, Task
from verl_group_ppo.tasks.tiny.tokenizer import CharTokenizer

from .optim import minibatches, set_warmup_lr
from .options import option


@dataclass(frozen=True)
class PretrainConfig:
    """Value pretraining: critic-only steps on the warm-start policy's samples, before RL."""

    critic_pretrain_steps: int = option(0, "critic-only steps on the warm-start policy's samples before RL, "
                                           "shared by every critic arm and cached (0: off)")
    critic_pretrain_lr: float = option(1e-3, "critic learning rate (Adam) during value pretraining")
    critic_pretrain_epochs: int = option(1, "passes over each pretraining batch")
    critic_pretrain_clip: float = option(NO_CLIP, "value clip range during pretraining (1e9: no clipping)")
    critic_pretrain_lam: float = option(1.0, "lambda of the pretraining targets (1.0: Monte Carlo returns)")
    critic_pretrain_eval_every: int = option(25, "steps between held-out explained-variance measurements")

    def __post_init__(self) -> None:
        for name in ("critic_pretrain_steps", "critic_pretrain_epochs", "critic_pretrain_eval_every"):
            if getattr(self, name) < (0 if name == "critic_pretrain_steps" else 1):
                raise ValueError(f"{name} must be >= {0 if name == 'critic_pretrain_steps' else 1}, "
                                 f"got {getattr(self, name)}")
        if not 0.0 <= self.critic_pretrain_lam <= 1.0:
            raise ValueError(f"critic_pretrain_lam must be in [0, 1], got {self.critic_pretrain_lam}")
        if not self.critic_pretrain_lr > 0 or not self.critic_pretrain_clip > 0:
            raise ValueError("critic_pretrain_lr and critic_pretrain_clip must be > 0")

    @property
    def enabled(self) -> bool:
        return self.critic_pretrain_steps > 0


@dataclass(frozen=True)
class CriticRecipe:
    """How :func:`pretrain_critic` updates the critic besides :class:`PretrainConfig`: the RL run's critic recipe
    (discount, mini-batch in responses, gradient clip, learning-rate warm-up) and the shuffling seed."""

    gamma: float = 1.0
    mini_batch_size: int = 64
    grad_clip: float = 1.0
    lr_warmup_steps: int = 10
    seed: int = 0

    @classmethod
    def of_run(cls, cfg) -> "CriticRecipe":
        """The recipe of the run config ``cfg`` (a :class:`~experiments.demo.rl.RunConfig`)."""
        return cls(gamma=cfg.gamma, mini_batch_size=cfg.critic_mini_batch_size, grad_clip=cfg.grad_clip,
                   lr_warmup_steps=cfg.lr_warmup_steps)


@dataclass(frozen=True)
class PretrainSamples:
    """What the pretraining batches (``prompts_per_step x n_samples`` responses) and the held-out responses
    (``eval_size`` prompts x ``eval_samples``) are sampled with."""

    response_len: int
    prompts_per_step: int
    n_samples: int
    temperature: float
    eval_size: int
    eval_samples: int

    @classmethod
    def of_run(cls, cfg) -> "PretrainSamples":
        """The sampling settings of the resolved run config ``cfg`` (a :class:`~experiments.demo.rl.RunConfig`)."""
        return cls(cfg.response_len, cfg.prompts_per_step, cfg.n_samples, cfg.temperature, cfg.eval_size,
                   cfg.eval_samples)


def sample_scored(policy, task: Task, tok: CharTokenizer, problems: list[Problem], response_len: int,
                  generator: torch.Generator, temperature: float = 1.0) -> ScoredReplies:
    """One response per entry of ``problems`` from ``policy`` (no gradient), scored by the verifier; tensors on the
    policy's device."""
    from verl_group_ppo.tasks.tiny.warmstart import encode_prompt

    with torch.no_grad():
        rollout = sample(policy, [encode_prompt(tok, p) for p in problems], response_len, tok.pad_id, tok.eos_id,
                         generator=generator, temperature=temperature)
    rewards, _, _ = rewards_for(task, tok, rollout, problems)
    return ScoredReplies(rollout.input_ids, rollout.attention_mask, rollout.response_mask, rewards)


def pretrain_step(critic, opt: torch.optim.Optimizer, batch: ScoredReplies, pc: PretrainConfig, recipe: CriticRecipe,
                  shuffle: torch.Generator) -> float:
    """``pc.critic_pretrain_epochs`` passes of shuffled mini-batches over ``batch``, one
    :func:`~verl_group_ppo.critic_readout.warmup_update` each (verl's clipped value loss, token-mean) against
    lambda returns on the critic's values before the step; the mean loss. Values are read in the critic's train mode,
    as the demo's RL loop reads them."""
    settings = WarmupSettings(cliprange_value=pc.critic_pretrain_clip, grad_clip=recipe.grad_clip)
    old_values = predict_values(critic, batch, eval_mode=False)
    returns = lambda_returns(batch, old_values, recipe.gamma, pc.critic_pretrain_lam)
    losses = [warmup_update(critic, opt, batch.select(idx), returns[idx], old_values[idx], settings)
              for idx in minibatches(len(batch), recipe.mini_batch_size, pc.critic_pretrain_epochs, shuffle,
                                     old_values.device)]
    return float(np.mean(losses))


def _heldout_ev(critic, held: ScoredReplies, gamma: float) -> float:
    """The held-out explained variance over every response token (verl's ``vf_explained_var``), the critic read in
    its train mode, as the demo's RL loop reads it."""
    return heldout_explained_variance(critic, held, gamma, eval_mode=False).all


def pretrain_critic(critic, batches: Iterator[ScoredReplies], held: ScoredReplies, pc: PretrainConfig,
                    recipe: CriticRecipe = CriticRecipe(), log: Callable[[str], None] = print) -> list[dict]:
    """Train ``critic`` in place for ``pc.critic_pretrain_steps`` batches from ``batches``; returns the log:
    ``{"step", "heldout_explained_variance", "vf_loss"}`` at step 0, every ``critic_pretrain_eval_every`` steps
    and at the last step. Everything else it depends on is in ``pc`` and ``recipe``, which key the cache
    (:func:`pretrain_key`)."""
    opt = torch.optim.Adam(critic.parameters(), lr=pc.critic_pretrain_lr)
    shuffle = torch.Generator().manual_seed(60_000 + recipe.seed)
    history = [{"step": 0, "heldout_explained_variance": _heldout_ev(critic, held, recipe.gamma)}]
    log(f"[critic pretrain] step 0: held-out explained variance {history[0]['heldout_explained_variance']:.3f}")
    losses: list[float] = []
    for step in range(1, pc.critic_pretrain_steps + 1):
        set_warmup_lr(opt, pc.critic_pretrain_lr, step - 1, recipe.lr_warmup_steps)
        losses.append(pretrain_step(critic, opt, next(batches), pc, recipe, shuffle))
        if step % pc.critic_pretrain_eval_every == 0 or step == pc.critic_pretrain_steps:
            ev = _heldout_ev(critic, held, recipe.gamma)
            history.append({"step": step, "heldout_explained_variance": ev, "vf_loss": float(np.mean(losses))})
            losses = []
            log(f"[critic pretrain] step {step}: held-out explained variance {ev:.3f}")
    return history


def policy_batches(policy, task: Task, tok: CharTokenizer, train: list[Problem], response_len: int,
                   prompts_per_step: int, n_samples: int, seed: int = 0,
                   temperature: float = 1.0) -> Iterator[ScoredReplies]:
    """Endless batches of ``prompts_per_step`` training prompts x ``n_samples`` responses of ``policy``."""
    rng = np.random.default_rng(70_000 + seed)
    gen = torch.Generator(device=next(policy.parameters()).device).manual_seed(80_000 + seed)
    while True:
        pidx = rng.choice(len(train), size=prompts_per_step, replace=False)
        yield sample_scored(policy, task, tok, [train[i] for i in pidx for _ in range(n_samples)], response_len,
                            gen, temperature)


def heldout_batch(policy, task: Task, tok: CharTokenizer, evals: list[Problem], response_len: int,
                  samples: int, temperature: float = 1.0) -> ScoredReplies:
    """The fixed held-out responses the explained variance is measured on (a fixed generator)."""
    gen = torch.Generator(device=next(policy.parameters()).device).manual_seed(90_000)
    return sample_scored(policy, task, tok, [p for p in evals for _ in range(samples)], response_len, gen,
                         temperature)


def pretraining_data(policy, task: Task, tok: CharTokenizer, train: list[Problem], evals: list[Problem],
                     samples: PretrainSamples) -> tuple[Iterator[ScoredReplies], ScoredReplies]:
    """(endless training batches, the held-out responses) of ``policy``, sampled as ``samples`` says."""
    held = heldout_batch(policy, task, tok, evals[:samples.eval_size], samples.response_len, samples.eval_samples,
                         samples.temperature)
    batches = policy_batches(policy, task, tok, train, samples.response_len, samples.prompts_per_step,
                             samples.n_samples, temperature=samples.temperature)
    return batches, held


def pretrain_key(pc: PretrainConfig, recipe: CriticRecipe, samples: PretrainSamples, warmstart_key: str) -> str:
    """Cache key of a pretrained critic: every setting :func:`pretrain_critic` receives (``pc``, ``recipe``), how
    its data were sampled (``samples``) and from which warm start (``warmstart_key``)."""
    blob = json.dumps([asdict(pc), asdict(recipe), asdict(samples), warmstart_key], sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def load_or_pretrain_critic(cache_dir: str, key: str, policy, train_fn: Callable[[torch.nn.Module], list[dict]],
                            log: Callable[[str], None] = print) -> tuple[dict, dict]:
    """(critic state_dict, info) from ``cache_dir`` when cached under ``key``, else ``train_fn(critic)`` on a
    fresh critic built from ``policy``, then cached. ``info`` holds the explained-variance ``history``."""
    path = os.path.join(cache_dir, f"critic-pretrain-{key}.pt")
    if os.path.exists(path):
        blob = torch.load(path, map_location="cpu", weights_only=False)
        log(f"[critic pretrain] loaded cached critic from {path}")
        return blob["state_dict"], {**blob["info"], "cached": True}
    critic = build_critic(policy, 0).train()
    t0 = time.time()
    history = train_fn(critic)
    info = {"key": key, "history": history, "seconds": time.time() - t0,
            "heldout_explained_variance": history[-1]["heldout_explained_variance"]}
    state = {k: v.detach().cpu() for k, v in critic.state_dict().items()}
    write_file(path, lambda tmp: torch.save({"state_dict": state, "info": info}, tmp))
    return state, {**info, "cached": False}


def pretrained_critic_state(pc: PretrainConfig, cache_dir: str, warmstart_key: str, policy, task: Task,
                            tok: CharTokenizer, train: list[Problem], evals: list[Problem], cfg,
                            log: Callable[[str], None] = print) -> tuple[Optional[dict], dict]:
    """The demo's entry: (state_dict, info) of the pretrained critic for the run config ``cfg`` (a resolved
    :class:`~experiments.demo.rl.RunConfig`), or (None, {}) when pretraining is off."""
    if not pc.enabled:
        return None, {}
    recipe, samples = CriticRecipe.of_run(cfg), PretrainSamples.of_run(cfg)
    batches, held = pretraining_data(policy, task, tok, train, evals, samples)
    return load_or_pretrain_critic(cache_dir, pretrain_key(pc, recipe, samples, warmstart_key), policy,
                                   lambda critic: pretrain_critic(critic, batches, held, pc, recipe, log), log)
