"""The shared supervised warm start: a short teacher-forced run on worked solutions, done once and cached.

RL from a random tiny model would see almost no reward; a brief supervised phase on the task's worked
solutions (running totals, then ``#answer``) gives a policy with a modest non-zero accuracy. It is trained
once per (task and its term counts, model size, steps, data, response length) and reused by every
estimator and seed, so all arms start from the very same weights.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from typing import Any, Callable

import torch

from ...files import write_file
from .model import Rollout, build_policy, left_pad, log_probs_and_entropy
from .problems import Problem, Task
from .tokenizer import CharTokenizer


def encode_prompt(tok: CharTokenizer, p: Problem) -> list[int]:
    """The ids the policy is conditioned on: BOS + the prompt, or ``tok.encode_prompt(prompt)`` when the
    tokenizer defines it (the chat-templated tokenizer of :mod:`verl_group_ppo.tasks.tiny.prepare`)."""
    own = getattr(tok, "encode_prompt", None)
    return own(p.prompt) if own is not None else [tok.bos_id] + tok.encode(p.prompt)


def teacher_forced_batch(tok: CharTokenizer, problems: list[Problem], device, response_len: int,
                         solutions: list[str] | None = None) -> Rollout:
    """Prompts left-padded, worked solutions + EOS right-padded to the longest one in the batch (at most
    ``response_len`` tokens). Padding at the right end changes no logit of a causal model, so trimming it
    only saves compute."""
    prompt_ids, prompt_mask = left_pad([encode_prompt(tok, p) for p in problems], tok.pad_id, device)
    rows = [(tok.encode(p.solution if solutions is None else solutions[i]) + [tok.eos_id])[:response_len]
            for i, p in enumerate(problems)]
    width = max(len(ids) for ids in rows)
    responses = torch.full((len(rows), width), tok.pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width))
    for i, ids in enumerate(rows):
        responses[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
    return Rollout(prompt_ids, prompt_mask, responses.to(device), mask.to(device))


def warmstart_key(task: Task, size: str, steps: int, batch_size: int, lr: float, seed: int, n_train: int,
                  slip_prob: float, response_len: int | None = None) -> str:
    """Cache key of a warm start: the task with its settings (``Task.spec``: term counts...), the model size,
    the training settings and the response length the solutions were cut to."""
    spec = task.spec() if hasattr(task, "spec") else task.name
    blob = json.dumps([spec, size, steps, batch_size, lr, seed, n_train, slip_prob, response_len, 3],
                      sort_keys=True)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def train_warmstart(task: Task, tok: CharTokenizer, train: list[Problem], size: str, steps: int,
                    batch_size: int, lr: float, seed: int, response_len: int, device, progress=None,
                    slip_prob: float = 0.0, make_batch=None):
    """Teacher-forced cross-entropy on response tokens (EOS included); cosine learning rate.

    With ``slip_prob`` > 0 each intermediate step of a worked solution is replaced by a near miss with that
    probability (the chain then continues from the wrong total): the warm-started policy is a noisy
    reasoner that usually knows the right step but sometimes slips, and a single slip anywhere makes
    the final answer wrong. RL has to find which token slipped from the outcome reward alone.

    ``make_batch(problems, rng) -> (rollout, loss_mask)`` replaces the worked solutions with other training
    rows (the tool task's episodes, :func:`verl_group_ppo.tasks.tiny.tool_episodes.episode_batch`); the loss is
    then taken where ``loss_mask`` (B, T) is 1.
    """
    policy = build_policy(tok.vocab_size, size, seed, tok.pad_id, tok.eos_id).to(device)
    policy.train()
    opt = torch.optim.AdamW(policy.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    rng = random.Random(seed)
    warm = max(1, steps // 20)
    losses = []
    for step in range(steps):
        scale = (step + 1) / warm if step < warm else 0.5 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))
        for g in opt.param_groups:
            g["lr"] = lr * scale
        chosen = rng.sample(train, batch_size)
        if make_batch is None:
            sols = [task.noisy_solution(p, rng, slip_prob) for p in chosen]
            batch = teacher_forced_batch(tok, chosen, device, response_len, sols)
            loss_mask = batch.response_mask
        else:
            batch, loss_mask = make_batch(chosen, rng)
        logp, _ = log_probs_and_entropy(policy, batch)
        loss = -(logp * loss_mask).sum() / loss_mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if progress is not None:
            progress.update(1)
            if step % 20 == 0:
                progress.set_postfix(loss=f"{loss.item():.3f}")
    return policy, losses


def load_or_train_warmstart(cache_dir: str, task: Task, tok: CharTokenizer, train: list[Problem], size: str,
                            steps: int, batch_size: int, lr: float, seed: int, response_len: int, device,
                            progress_factory=None, log=print, slip_prob: float = 0.0):
    """Return (policy, info); trained weights are cached under ``cache_dir``."""
    key = warmstart_key(task, size, steps, batch_size, lr, seed, len(train), slip_prob, response_len)
    path = os.path.join(cache_dir, f"warmstart-{task.name}-{size}-{key}.pt")
    policy = build_policy(tok.vocab_size, size, seed, tok.pad_id, tok.eos_id).to(device)
    if os.path.exists(path):
        blob = torch.load(path, map_location=device, weights_only=False)
        if blob.get("tokenizer") == tok.to_str():
            policy.load_state_dict(blob["state_dict"])
            log(f"[warm start] loaded cached weights from {path}")
            return policy, {**blob["info"], "cached": True, "path": path}
        log(f"[warm start] cache {path} was built with another tokenizer; retraining")
    t0 = time.time()
    bar = progress_factory(total=steps, desc="warm start (SFT)") if progress_factory else None
    policy, losses = train_warmstart(task, tok, train, size, steps, batch_size, lr, seed, response_len, device, bar,
                                     slip_prob=slip_prob)
    if bar is not None:
        bar.close()
    info = {"steps": steps, "batch_size": batch_size, "lr": lr, "slip_prob": slip_prob, "final_loss": losses[-1],
            "seconds": time.time() - t0, "key": key}
    write_file(path, lambda tmp: torch.save({"state_dict": policy.state_dict(), "tokenizer": tok.to_str(),
                                             "info": info}, tmp))
    return policy, {**info, "cached": False, "path": path}


# --------------------------------------------------------------------------------------------------
# room for RL: a warm start that samples some, but not most, answers right

#: the sampled accuracy a warm start should land in (about 0.1 to 0.5): reward signal, and room to learn
ROOM = (0.08, 0.5)
#: below this sampled accuracy RL sees almost no reward: the demo and ``prepare`` refuse to go on
MIN_SAMPLED_ACCURACY = 0.02
#: the default task (chain_sum, 4-5 terms: 3.5 running totals per solution) warm-starts with slip 0.25 for
#: 2000 steps; :func:`auto_slip_prob` and :func:`auto_warmstart_steps` carry this to other chain lengths
BASE_SOLUTION_STEPS, BASE_SLIP_PROB, BASE_WARMSTART_STEPS = 3.5, 0.25, 2000


def mean_solution_steps(problems: list[Problem]) -> float:
    """Mean number of running totals per worked solution (each one a place where the warm start may slip)."""
    if not problems:
        raise ValueError("problems must not be empty")
    return sum(max(1, len(p.solution.split()) - 1) for p in problems) / len(problems)


def auto_slip_prob(steps_per_solution: float) -> float:
    """The slip probability that leaves as many worked solutions slip-free as the default task's 0.25 does:
    ``1 - 0.75 ** (3.5 / steps_per_solution)``, rounded to 0.01 (0.25 for 4-5 terms, 0.12 for 8-10, 0.08
    for 12-14 terms). A fixed slip probability leaves less room for RL the longer the chain.
    """
    if steps_per_solution <= 0:
        raise ValueError(f"steps_per_solution must be > 0, got {steps_per_solution}")
    keep = (1.0 - BASE_SLIP_PROB) ** (BASE_SOLUTION_STEPS / steps_per_solution)
    return round(1.0 - keep, 2)


def auto_warmstart_steps(steps_per_solution: float) -> int:
    """Warm-start steps in proportion to the solution's running totals (2000 for the default task, never
    fewer), rounded to hundreds: longer chains need longer supervised training to be imitated."""
    scale = max(1.0, steps_per_solution / BASE_SOLUTION_STEPS)
    return int(round(BASE_WARMSTART_STEPS * scale / 100.0)) * 100


def rescale_slip_prob(slip_prob: float, sampled_accuracy: float, steps_per_solution: float,
                      room: tuple[float, float] = ROOM) -> float:
    """The next slip probability of a calibration, from one warm start's sampled accuracy.

    Aims at the middle of ``room`` assuming accuracy ~ c * (1 - slip) ** steps_per_solution; 0 when nothing was
    sampled right (the most room the slip knob can give). Clipped to [0, 0.5].
    """
    if sampled_accuracy <= 0.0:
        return 0.0
    aim = sum(room) / 2.0
    keep = (1.0 - slip_prob) * (aim / sampled_accuracy) ** (1.0 / steps_per_solution)
    return min(0.5, max(0.0, 1.0 - keep))


def in_room(sampled_accuracy: float, room: tuple[float, float] = ROOM) -> bool:
    """Whether a warm start's sampled accuracy leaves room for RL (within ``room``)."""
    return room[0] <= sampled_accuracy <= room[1]


def check_room(sampled_accuracy: float, flags: str) -> None:
    """RuntimeError when a warm start samples under :data:`MIN_SAMPLED_ACCURACY` correct: RL would see almost
    no reward. ``flags`` names the settings that change the warm start (said in the message)."""
    if sampled_accuracy < MIN_SAMPLED_ACCURACY:
        raise RuntimeError(
            f"the warm start samples {sampled_accuracy:.3f} correct answers (< {MIN_SAMPLED_ACCURACY}): RL from it "
            f"would see almost no reward. Give the warm start more room with {flags}.")


# ------------------------------------------------------------------------------ prepare's warm start and model

class PrintProgress:
    """The progress object :func:`train_warmstart` drives (``update``/``set_postfix``), printed every 10%."""

    def __init__(self, total: int, log: Callable[[str], None]):
        self.total, self.log, self.done, self.postfix, self.t0 = total, log, 0, "", time.time()

    def update(self, n: int) -> None:
        self.done += n
        if self.done == self.total or self.done % max(1, self.total // 10) == 0:
            self.log(f"[prepare] warm start step {self.done}/{self.total} {self.postfix} "
                     f"({time.time() - self.t0:.0f} s)")

    def set_postfix(self, **kwargs: Any) -> None:
        self.postfix = " ".join(f"{k}={v}" for k, v in kwargs.items())


def warm_start(settings: Any, task: Task, tok: Any, train: list[Problem], log: Callable[[str], None],
               make_batch: Callable | None = None):
    """``prepare``'s supervised warm start on chat-templated prompts with the prepare settings' model size, steps,
    batch, lr, seed, response length and slip probability, on ``make_batch``'s batches (None: the task's worked
    solutions). Returns (policy in eval mode, final loss)."""
    policy, losses = train_warmstart(
        task, tok, train, settings.model_size, settings.warmstart_steps, settings.warmstart_batch_size,
        settings.warmstart_lr, settings.seed, settings.response_length, torch.device("cpu"),
        PrintProgress(settings.warmstart_steps, log), slip_prob=settings.warmstart_slip_prob, make_batch=make_batch)
    return policy.eval(), (losses[-1] if losses else float("nan"))


def save_model(policy, tok: Any, vocab: dict[str, int], merges, path: str) -> None:
    """The warm-started policy as a Hugging Face checkpoint in ``path``: weights, generation config (EOS and pad of
    ``tok``, a :class:`~.chat.ChatTokenizer`) and the tokenizer files."""
    from transformers import GenerationConfig

    from .chat import save_tokenizer

    policy.save_pretrained(path)
    GenerationConfig(eos_token_id=tok.eos_id, pad_token_id=tok.pad_id).save_pretrained(path)
    save_tokenizer(tok.hf, vocab, merges, path)
