"""How much a segment method can gain on a task, and what each critic-free value source is worth per token it costs.

    python benchmarks/bench_value_headroom.py                  # the tiny task (runs/cpu-tiny), 256 prompts x 4
    python benchmarks/bench_value_headroom.py --report         # the tables from the records
    python benchmarks/bench_value_headroom.py --task twoway --prompts 32 --k-ref 16 --critic-prompts 64 \
        --critic-updates 40 --critic-mini-batch 16      # the two-way maths task (runs/cpu-twoway); no record yet

The warm-start policy samples ``--n`` replies to each of ``--prompts`` training prompts (temperature 1), scored by
the package's one scorer (:func:`verl_group_ppo.tasks.reward.compute_score`); the sampler's log-probabilities of the
sampled tokens (temperature 1, no top-k/top-p: the model's own) are the old log-probs the ``low_prob`` rule reads.
Each boundary rule (:data:`RULES`) cuts every reply into groups
(:func:`~verl_group_ppo.core_algos.find_group_endpoints`); a group's start is the state its value is read at
(verl's convention: ``values[b, t]`` is the value before reply token t).

Reference values: at every group start after position 0, the mean score of ``--k-ref`` continuations sampled from
the prompt plus the reply before that start; at position 0, the mean score of ``--k-ref`` fresh replies to the
prompt (one set per prompt). Continuations at a position are shared by every rule that starts a group there.

Headroom (per rule), with ``v0`` the prompt's reference value, ``R`` a reply's score and ``v_last`` the reference
value at the reply's last group start (``v0`` when the reply is one group):

* between prompts: ``Var(v0)`` over prompts; within prompts: ``E[(R - v0)^2]`` over replies.
* resolved at inner boundaries: ``E[(v_last - v0)^2] / E[(R - v0)^2]``, the part of a reply's outcome a segment
  method can assign inside it (the increments' squares add up under the martingale property); per boundary index
  ``k`` the share ``E[(v_k - v_{k-1})^2] / E[(R - v0)^2]`` (replies without a k-th inner start add 0), and the
  remainder ``E[(R - v_last)^2] / E[(R - v0)^2]`` inside the last group.
* credit spread: over how many tokens a segment method spreads each unit of outcome variance
  (:func:`credit_spread`; with GRPO's one group per reply in brackets): lower is sharper credit.
* "corrected": the same with each reference mean's own sampling noise taken out (``p(1 - p) / (K - 1)`` for a mean
  p of K scores in [0, 1] is an unbiased estimate of the variance of that mean; the noises of independent means add).

Value sources, read at the same group starts and scored by their explained variance against the reference,
``EV = 1 - Var(ref - v) / Var(ref)``, over the inner starts (position > 0) and over all starts:

* ``prompt_mean``: the mean score of the prompt's n replies (GRPO's baseline) at every start; ``prompt_mean_loo``
  the mean of the prompt's other n - 1 replies.
* ``prefix_tree``: :func:`verl_group_ppo.values.prefix_tree_values`.
* ``mc_K``: :func:`verl_group_ppo.values.mc_boundary_values` with K continuations per inner start, drawn
  independently of the reference's (K in :data:`MC_KS`).
* ``critic``: a value head on the warm start (verl's token-classification critic) trained by
  :func:`verl_group_ppo.critic_readout.warmup_update` on replies to ``--critic-prompts`` other training prompts x
  n (Monte Carlo returns as targets, ``--critic-updates`` mini-batches of ``--critic-mini-batch`` replies, Adam at
  ``--critic-lr``, no value clip): about the best a critic can do on this distribution.
* ``own_return`` (a yardstick, not a value source): the reply's own score R at every start. Sources that use R
  (prompt_mean, prefix_tree) gain EV from it at late starts without telling anything about the state.

The EV ceiling is ``1 - mean(noise of ref) / Var(ref)``: what the true values would score against the noisy
reference. Cost: tokens generated per reply (mc: K x the continuations' lengths at the rule's inner starts; the
others 0; the critic one forward pass) and the wall seconds of each part (sampling shared by the rules run
together is counted once and named ``shared``).

One JSON record per rule under ``benchmarks/results/value_headroom/<task>/``; a run skips the rules whose record
has the same settings, ``--report`` prints the tables from the records.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from benchlib import REPO, portable, read_json, timed, write_json

#: boundary rules: name -> find_group_endpoints keywords
RULES: dict[str, dict[str, Any]] = {
    "fixed4": {"boundary_rule": "fixed", "group_max_size": 4},
    "fixed8": {"boundary_rule": "fixed", "group_max_size": 8},
    "low_prob": {"boundary_rule": "low_prob", "group_max_size": 16, "low_prob_threshold": 0.9},
}
MC_KS = (2, 4, 8)
SOURCES = ("prompt_mean", "prompt_mean_loo", "prefix_tree", *(f"mc_{k}" for k in MC_KS), "critic", "own_return")
RESULTS = Path("benchmarks") / "results" / "value_headroom"


# ----------------------------------------------------------------------------------------------- pure math

def mean_noise(means: np.ndarray, k: int) -> np.ndarray:
    """Unbiased estimates of the sampling variance of each mean of ``k`` scores in [0, 1] with mean ``means``
    (any shape): ``p (1 - p) / (k - 1)`` (exact for 0/1 scores); 0 when ``k`` is 1 (unknown)."""
    means = np.asarray(means, dtype=np.float64)
    if k < 1:
        raise ValueError(f"k: must be >= 1, got {k}")
    return means * (1.0 - means) / (k - 1) if k > 1 else np.zeros_like(means)


def explained_variance_of(ref: np.ndarray, values: np.ndarray) -> float:
    """``1 - Var(ref - values) / Var(ref)`` over (N,) arrays, population variances in float64; NaN when N is 0 or
    ``ref`` is constant. Not clipped (a source worse than a constant scores below 0)."""
    ref, values = np.asarray(ref, dtype=np.float64), np.asarray(values, dtype=np.float64)
    if ref.shape != values.shape or ref.ndim != 1:
        raise ValueError(f"ref, values: need the same (N,) shape, got {ref.shape}, {values.shape}")
    if ref.size == 0 or float(ref.var()) == 0.0:
        return math.nan
    return float(1.0 - (ref - values).var() / ref.var())


def ev_ceiling(ref: np.ndarray, noise: np.ndarray) -> float:
    """The explained variance the true values would reach against a noisy ``ref`` (N,) whose entries carry the
    sampling variances ``noise`` (N,): ``1 - mean(noise) / Var(ref)``; NaN when N is 0 or ``ref`` is constant."""
    ref, noise = np.asarray(ref, dtype=np.float64), np.asarray(noise, dtype=np.float64)
    if ref.size == 0 or float(ref.var()) == 0.0:
        return math.nan
    return float(1.0 - noise.mean() / ref.var())


def variance_split(v0_prompt: np.ndarray, returns: np.ndarray, prompt_of: np.ndarray,
                   noise0: np.ndarray | None = None) -> dict[str, float]:
    """The return variance between and within prompts.

    Args:
        v0_prompt: (P,) each prompt's value (its reference mean reward).
        returns: (B,) each reply's score.
        prompt_of: (B,) int, the prompt (0..P-1) of each reply.
        noise0: (P,) optional sampling variance of each ``v0_prompt`` entry; when given, the ``*_corrected``
            figures take it out (``Var(v0) - mean(noise0)``, ``E[(R - v0)^2] - E[noise0]``).

    Returns:
        ``between`` = Var(v0) over prompts, ``within`` = E[(R - v0)^2] over replies, ``between_share`` =
        between / (between + within), and the corrected three when ``noise0`` is given.
    """
    v0_prompt, returns = np.asarray(v0_prompt, dtype=np.float64), np.asarray(returns, dtype=np.float64)
    prompt_of = np.asarray(prompt_of)
    between, within = float(v0_prompt.var()), float(((returns - v0_prompt[prompt_of]) ** 2).mean())
    out = {"between": between, "within": within, "between_share": _share(between, between + within)}
    if noise0 is not None:
        noise0 = np.asarray(noise0, dtype=np.float64)
        b, w = between - float(noise0.mean()), within - float(noise0[prompt_of].mean())
        out.update(between_corrected=b, within_corrected=w, between_share_corrected=_share(b, b + w))
    return out


def resolved_shares(path_values: Sequence[np.ndarray], returns: np.ndarray,
                    path_noise: Sequence[np.ndarray] | None = None) -> dict[str, Any]:
    """How much of the within-prompt variance each inner boundary resolves.

    Args:
        path_values: one (n_b,) array per reply: the values at its group starts in order, ``path_values[b][0]`` =
            v0 (the prompt's value), the rest at its inner starts.
        returns: (B,) each reply's score.
        path_noise: optional, the same shapes: each value's sampling variance (for the corrected figures).

    Returns:
        ``resolved`` = E[(v_last - v0)^2] / E[(R - v0)^2], ``remainder`` = E[(R - v_last)^2] / E[(R - v0)^2],
        ``by_index`` = [E[(v_k - v_{k-1})^2] / E[(R - v0)^2] for k = 1..] (replies with fewer starts add 0), and
        with ``path_noise`` ``resolved_corrected``: (E[(v_last - v0)^2] - E[noise_last + noise_0]) over
        (E[(R - v0)^2] - E[noise_0]) (noise_last = 0 for a reply of one group: its v_last is its v0).
    """
    returns = np.asarray(returns, dtype=np.float64)
    if len(path_values) != returns.shape[0]:
        raise ValueError(f"path_values: need one path per reply ({returns.shape[0]}), got {len(path_values)}")
    paths = [np.asarray(p, dtype=np.float64) for p in path_values]
    if any(p.ndim != 1 or p.size < 1 for p in paths):
        raise ValueError("path_values: every path needs at least v0")
    v0 = np.array([p[0] for p in paths])
    last = np.array([p[-1] for p in paths])
    total = float(((returns - v0) ** 2).mean())
    depth = max(p.size for p in paths)
    steps = [float(np.mean([(p[k] - p[k - 1]) ** 2 if p.size > k else 0.0 for p in paths])) for k in range(1, depth)]
    out: dict[str, Any] = {"within": total, "resolved": _share(float(((last - v0) ** 2).mean()), total),
                           "remainder": _share(float(((returns - last) ** 2).mean()), total),
                           "by_index": [_share(s, total) for s in steps]}
    if path_noise is not None:
        noise = [np.asarray(x, dtype=np.float64) for x in path_noise]
        n0 = np.array([x[0] for x in noise])
        n_last = np.array([x[-1] if x.size > 1 else 0.0 for x in noise])
        out["resolved_corrected"] = _share(float(((last - v0) ** 2).mean() - (n_last + n0).mean()),
                                           total - float(n0.mean()))
    return out


def credit_spread(path_values: Sequence[np.ndarray], returns: np.ndarray,
                  group_lengths: Sequence[np.ndarray]) -> float:
    """Over how many tokens a segment method spreads each unit of outcome variance: the mean length of the group an
    increment falls in, weighted by the increment's square, ``sum_b sum_g (v_{g+1} - v_g)^2 L_g / sum_b sum_g
    (v_{g+1} - v_g)^2`` with ``v_{G+1} = R`` (GRPO, one group per reply: the variance-weighted reply length).

    Args:
        path_values: one (G_b,) array per reply, the values at its group starts in order (v0 first).
        returns: (B,) each reply's score.
        group_lengths: one (G_b,) array per reply, its groups' token counts.

    Returns:
        The weighted mean group length; NaN when every increment is 0.
    """
    returns = np.asarray(returns, dtype=np.float64)
    if len(path_values) != returns.shape[0] or len(group_lengths) != returns.shape[0]:
        raise ValueError(f"path_values, group_lengths: need one entry per reply ({returns.shape[0]}), got "
                         f"{len(path_values)}, {len(group_lengths)}")
    weight = weighted = 0.0
    for path, ret, lengths in zip(path_values, returns, group_lengths):
        path, lengths = np.asarray(path, dtype=np.float64), np.asarray(lengths, dtype=np.float64)
        if path.shape != lengths.shape:
            raise ValueError(f"group_lengths: need one length per group start, got {lengths.shape} for {path.shape}")
        steps = np.diff(np.append(path, ret)) ** 2
        weight += float(steps.sum())
        weighted += float((steps * lengths).sum())
    return _share(weighted, weight)


def _share(part: float, whole: float) -> float:
    return part / whole if whole > 0 else math.nan


def group_starts(group_ids: Any) -> Any:
    """(B, T) bool, True at each group's first valid token, from ``endpoints_to_group_ids``' (B, T) long ids (0 on
    masked positions)."""
    import torch

    starts = torch.zeros_like(group_ids, dtype=torch.bool)
    starts[:, 0] = group_ids[:, 0] > 0
    starts[:, 1:] = (group_ids[:, 1:] > 0) & (group_ids[:, 1:] != group_ids[:, :-1])
    return starts


# ------------------------------------------------------------------------------------------------ the task

@dataclass
class TaskSetup:
    """What the benchmark needs of a task: the policy, its prompts as token ids, the scorer, the critic's build."""

    name: str
    policy: Any  # an HF causal LM in eval mode
    prompts: list[list[int]]  # every training prompt's token ids
    score: Callable[[int, list[int]], float]  # (training prompt index, reply token ids) -> reward
    response_length: int
    eos_ids: list[int]
    pad_id: int
    build_critic: Callable[[], Any]  # a fresh token-classification critic
    batch: int  # rows per generate_batch call and per critic read


def tiny_setup(work_dir: str) -> TaskSetup:
    """The prepared tiny task in ``work_dir`` (``python -m verl_group_ppo.tasks.tiny.prepare``)."""
    import pandas as pd
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_group_ppo.tasks.reward import compute_score
    from verl_group_ppo.tasks.tiny.model import build_critic
    from verl_group_ppo.tasks.tiny.chat import ChatTokenizer

    model_dir = os.path.join(work_dir, "model")
    if not os.path.exists(os.path.join(work_dir, "data", "prepare.json")):
        raise SystemExit(f"--work-dir: {work_dir} is not a prepared tiny task; run python -m "
                         f"verl_group_ppo.tasks.tiny.prepare --output-dir {work_dir} first")
    settings = json.loads(Path(work_dir, "data", "prepare.json").read_text())["settings"]
    tok = ChatTokenizer(AutoTokenizer.from_pretrained(model_dir))
    policy = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    rows = pd.read_parquet(os.path.join(work_dir, "data", "train.parquet")).to_dict("records")
    prompts = [tok.encode_prompt(r["prompt"][0]["content"]) for r in rows]

    def score(i: int, reply: list[int]) -> float:
        r = rows[i]
        return float(compute_score(r["data_source"], tok.decode(reply), r["reward_model"]["ground_truth"],
                                   r["extra_info"]))

    return TaskSetup("tiny", policy, prompts, score, int(settings["response_length"]), [tok.eos_id], tok.pad_id,
                     lambda: build_critic(policy, 0), batch=2048)


def twoway_setup(work_dir: str) -> TaskSetup:
    """The prepared two-way maths task in ``work_dir`` (``python -m verl_group_ppo.tasks.maths.prepare``): SmolLM2-135M-
    Instruct, its chat template, the task's rows; the critic is verl's ``AutoModelForTokenClassification`` with one
    label from the same checkpoint (a new, randomly initialised value head)."""
    import pandas as pd
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForTokenClassification,
        AutoTokenizer,
    )

    from verl_group_ppo.tasks.reward import compute_score
    from verl_group_ppo.tasks.maths.evaluation import prompt_ids

    model_dir = os.path.join(work_dir, "model")
    if not os.path.exists(os.path.join(work_dir, "data", "prepare.json")):
        raise SystemExit(f"--work-dir: {work_dir} is not a prepared two-way maths task; run python -m "
                         f"verl_group_ppo.tasks.maths.prepare --output-dir {work_dir} first")
    settings = json.loads(Path(work_dir, "data", "prepare.json").read_text())["settings"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    rows = pd.read_parquet(os.path.join(work_dir, "data", "train.parquet")).to_dict("records")
    prompts = [prompt_ids(tokenizer, [dict(m) for m in r["prompt"]]) for r in rows]

    def score(i: int, reply: list[int]) -> float:
        r = rows[i]
        out = compute_score(r["data_source"], tokenizer.decode(reply, skip_special_tokens=True),
                            str(r["reward_model"]["ground_truth"]), r.get("extra_info"))
        return float(out["score"] if isinstance(out, dict) else out)

    def build_critic() -> Any:
        return AutoModelForTokenClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32,
                                                               attn_implementation="sdpa")

    return TaskSetup("twoway", policy, prompts, score, int(settings["response_length"]),
                     [int(tokenizer.eos_token_id)], int(tokenizer.pad_token_id), build_critic, batch=64)


#: task name -> (its setup, its default prepared folder)
TASKS: dict[str, tuple[Callable[[str], TaskSetup], str]] = {"tiny": (tiny_setup, "runs/cpu-tiny"),
                                                              "twoway": (twoway_setup, "runs/cpu-twoway")}
#: the critic's default learning rate per task: on the tiny task the best of 3e-4 and 1e-4 (2048 prompts x 4 replies,
#: 400 updates: held-out EV 0.027 and 0.023 on other prompts; 512 prompts x 4 overfit to -0.13, and 1e-3 is worse,
#: docs/results.md), on the two-way maths task the best of benchmarks/bench_mathtask_critic.py
CRITIC_LR = {"tiny": 3e-4, "twoway": 2e-4}


# ---------------------------------------------------------------------------------------------- sampling

class Sampler:
    """Batched sampling at temperature 1 from token-id prefixes, with a score cache keyed by (prompt, reply)."""

    def __init__(self, setup: TaskSetup):
        self.setup = setup
        self.cache: dict[tuple[int, tuple[int, ...]], float] = {}

    def score(self, prompt: int, reply: Sequence[int]) -> float:
        key = (prompt, tuple(reply))
        if key not in self.cache:
            self.cache[key] = self.setup.score(prompt, list(reply))
        return self.cache[key]

    def sample(self, jobs: Sequence[tuple[int, Sequence[int]]], seed: int) -> tuple[list[Any], np.ndarray]:
        """One completion per job ``(prompt index, reply prefix ids)``, at most ``response_length - len(prefix)``
        tokens; returns (the completions, (J,) scores of prefix + completion)."""
        import torch

        from verl_group_ppo.rollout.generation import SamplingRequest, generate_batch

        s = self.setup
        gen = torch.Generator().manual_seed(seed)
        completions: list[Any] = []
        for i in range(0, len(jobs), s.batch):
            reqs = [SamplingRequest(tuple(s.prompts[p]) + tuple(prefix), s.response_length - len(prefix))
                    for p, prefix in jobs[i:i + s.batch]]
            completions += generate_batch(s.policy, reqs, s.eos_ids, s.pad_id, generator=gen)
        scores = np.array([self.score(p, list(prefix) + c.token_ids) for (p, prefix), c in zip(jobs, completions)])
        return completions, scores


@dataclass
class Replies:
    """The n replies to each of P prompts, right-padded to the response length."""

    prompt_rows: list[int]  # (P,) training prompt indices
    prompt_of: np.ndarray  # (B,) 0..P-1
    ids: Any  # (B, T) long
    mask: Any  # (B, T) long 0/1
    old_log_probs: Any  # (B, T) float, 0 on padding
    scores: np.ndarray  # (B,)
    tokens: list[list[int]]  # (B,) each reply's ids


def sample_replies(sampler: Sampler, prompt_rows: list[int], n: int, seed: int) -> Replies:
    import torch

    T = sampler.setup.response_length
    jobs = [(p, ()) for p in prompt_rows for _ in range(n)]
    comps, scores = sampler.sample(jobs, seed)
    B = len(jobs)
    ids = torch.full((B, T), sampler.setup.pad_id, dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.long)
    logp = torch.zeros((B, T), dtype=torch.float32)
    for b, c in enumerate(comps):
        L = len(c.token_ids)
        ids[b, :L] = torch.tensor(c.token_ids)
        mask[b, :L] = 1
        logp[b, :L] = torch.tensor(c.log_probs)
    return Replies(prompt_rows, np.repeat(np.arange(len(prompt_rows)), n), ids, mask, logp, scores,
                   [c.token_ids for c in comps])


def rule_starts(replies: Replies, rule: dict[str, Any]) -> Any:
    """(B, T) bool group starts of ``rule`` (:data:`RULES` entry)."""
    import torch

    from verl_group_ppo.core_algos import endpoints_to_group_ids, find_group_endpoints

    rewards = torch.zeros(replies.ids.shape, dtype=torch.float32)
    lengths = replies.mask.sum(dim=1)
    rewards[torch.arange(len(lengths)), lengths - 1] = torch.tensor(replies.scores, dtype=torch.float32)
    ends = find_group_endpoints(rewards, replies.mask, old_log_probs=replies.old_log_probs, **rule)
    return group_starts(endpoints_to_group_ids(ends, replies.mask))


def continuation_table(sampler: Sampler, replies: Replies, keys: list[tuple[int, int]], k: int,
                       seed: int) -> tuple[dict[tuple[int, int], np.ndarray], dict[tuple[int, int], int], float]:
    """``k`` continuations at each (reply, position) of ``keys``: ({key: (k,) scores}, {key: tokens generated},
    wall seconds)."""
    jobs = [(replies.prompt_rows[replies.prompt_of[b]], replies.tokens[b][:t]) for b, t in keys for _ in range(k)]
    (comps, scores), seconds = timed(lambda: sampler.sample(jobs, seed))
    table = {key: scores[i * k:(i + 1) * k] for i, key in enumerate(keys)}
    tokens = {key: sum(len(c.token_ids) for c in comps[i * k:(i + 1) * k]) for i, key in enumerate(keys)}
    return table, tokens, seconds


# ------------------------------------------------------------------------------------------------ the critic

def train_critic(setup: TaskSetup, sampler: Sampler, prompt_rows: list[int], n: int, updates: int, mini_batch: int,
                 lr: float, seed: int, eval_replies: Replies, log: Callable[[str], Any]) -> tuple[Any, dict]:
    """A value head trained on ``prompt_rows`` x ``n`` fresh replies (module docstring); returns (the critic's
    (B, T) values on ``eval_replies``, info: the held-out explained variance over every reply token and at the
    first token at a few update counts, seconds of sampling, training, reading)."""
    import torch

    from verl_group_ppo.critic_readout import (
        heldout_explained_variance,
        lay_out,
        monte_carlo_returns,
        predict_values,
        warmup_update,
    )

    (train, t_sample) = timed(lambda: sample_replies(sampler, prompt_rows, n, seed))
    pad = setup.pad_id
    data = lay_out([setup.prompts[train.prompt_rows[p]] for p in train.prompt_of], train.tokens,
                   train.scores.tolist(), pad)
    held = lay_out([setup.prompts[eval_replies.prompt_rows[p]] for p in eval_replies.prompt_of], eval_replies.tokens,
                   eval_replies.scores.tolist(), pad)
    torch.manual_seed(seed)
    critic = setup.build_critic().train()
    opt = torch.optim.Adam(critic.parameters(), lr=lr)
    returns = monte_carlo_returns(data, 1.0)
    old = torch.zeros_like(returns)  # no value clip: the old values are never read
    shuffle = torch.Generator().manual_seed(seed)
    history, order, t0 = [], torch.empty(0, dtype=torch.long), time.perf_counter()
    checkpoints = sorted({0, updates // 4, updates // 2, updates})
    for u in range(updates + 1):
        if u in checkpoints:
            fit = heldout_explained_variance(critic, held, 1.0, batch_size=setup.batch)
            history.append({"updates": u, "heldout_ev_all_tokens": fit.all, "heldout_ev_first_token": fit.first})
            log(f"[critic] {u} updates: held-out EV all tokens {fit.all:.3f}, first token {fit.first:.3f}")
        if u == updates:
            break
        if order.numel() < mini_batch:
            order = torch.randperm(len(data), generator=shuffle)
        idx, order = order[:mini_batch], order[mini_batch:]
        warmup_update(critic, opt, data.select(idx), returns[idx], old[idx])
    t_train = time.perf_counter() - t0
    values, t_read = timed(lambda: predict_values(critic, held, batch_size=setup.batch))
    full = torch.zeros(eval_replies.ids.shape, dtype=torch.float32)
    full[:, :values.shape[1]] = values
    info = {"train_prompts": len(prompt_rows), "train_replies": len(data), "updates": updates,
            "mini_batch": mini_batch, "lr": lr, "history": history, "train_score_mean": float(train.scores.mean()),
            "seconds": {"sample": t_sample, "train": t_train, "read": t_read}}
    return full, info


# ------------------------------------------------------------------------------------------------ one rule

def rule_record(rule_name: str, replies: Replies, starts: Any, v0_ref: np.ndarray, noise0: np.ndarray,
                ref: dict, ref_noise: dict, mc: dict[int, dict], mc_tokens: dict[int, dict],
                critic_values: Any) -> dict[str, Any]:
    """The record's figures for one rule (headroom, EV per source, tokens per reply)."""
    import torch

    from verl_group_ppo.values import mc_boundary_values, prefix_tree_values

    B = len(replies.scores)
    scores_t = torch.tensor(replies.scores, dtype=torch.float32)
    index = replies.prompt_of
    inner = starts.clone()
    inner[:, 0] = False
    keys = [tuple(x) for x in inner.nonzero().tolist()]  # row-major: mc_boundary_values' order
    # headroom
    paths, noises = [], []
    for b in range(B):
        ts = [t for t in starts[b].nonzero().flatten().tolist() if t > 0]
        paths.append(np.array([v0_ref[index[b]], *(ref[(b, t)] for t in ts)]))
        noises.append(np.array([noise0[index[b]], *(ref_noise[(b, t)] for t in ts)]))
    split = variance_split(v0_ref, replies.scores, index, noise0)
    resolved = resolved_shares(paths, replies.scores, noises)
    lengths = replies.mask.sum(dim=1)
    group_lengths = [np.diff(np.append(starts[b].nonzero().flatten().numpy(), int(lengths[b]))) for b in range(B)]
    resolved["credit_spread_tokens"] = credit_spread(paths, replies.scores, group_lengths)
    resolved["credit_spread_tokens_grpo"] = credit_spread([p[:1] for p in paths], replies.scores,
                                                          [lengths[b:b + 1].numpy() for b in range(B)])
    # reference and sources at the starts, in nonzero(starts) order
    all_keys = [tuple(x) for x in starts.nonzero().tolist()]
    is_inner = np.array([t > 0 for _, t in all_keys])
    ref_at = np.array([ref[k] if k[1] > 0 else v0_ref[index[k[0]]] for k in all_keys])
    noise_at = np.array([ref_noise[k] if k[1] > 0 else noise0[index[k[0]]] for k in all_keys])
    sums = np.bincount(index, weights=replies.scores)
    counts = np.bincount(index)
    pm = sums[index] / counts[index]
    loo = (sums[index] - replies.scores) / np.maximum(counts[index] - 1, 1)
    tree = prefix_tree_values(replies.ids, replies.mask, scores_t, index)
    rows_b = np.array([k[0] for k in all_keys])
    values = {"prompt_mean": pm[rows_b], "prompt_mean_loo": loo[rows_b],
              "prefix_tree": tree[starts].numpy().astype(np.float64)}
    tokens = {name: 0.0 for name in values}
    for k in MC_KS:
        cont = torch.tensor(np.array([mc[k][key] for key in keys]).reshape(len(keys), k), dtype=torch.float32)
        values[f"mc_{k}"] = mc_boundary_values(starts, cont, scores_t, index)[starts].numpy().astype(np.float64)
        tokens[f"mc_{k}"] = sum(mc_tokens[k][key] for key in keys) / B
    values["critic"] = critic_values[starts].numpy().astype(np.float64)
    tokens["critic"] = 0.0
    values["own_return"] = replies.scores[rows_b]
    tokens["own_return"] = 0.0
    sources = {name: {"ev_inner": explained_variance_of(ref_at[is_inner], v[is_inner]),
                      "ev_all": explained_variance_of(ref_at, v), "tokens_per_reply": tokens[name]}
               for name, v in values.items()}
    return {
        "rule": rule_name, "rule_settings": RULES[rule_name],
        "replies": B, "mean_reply_tokens": float(lengths.float().mean()), "reply_score_mean": float(replies.scores.mean()),
        "groups_per_reply": float(starts.sum()) / B, "inner_starts": len(keys),
        "variance_split": split, "resolved": resolved,
        "ev_ceiling": {"inner": ev_ceiling(ref_at[is_inner], noise_at[is_inner]), "all": ev_ceiling(ref_at, noise_at)},
        "sources": sources,
    }


# --------------------------------------------------------------------------------------------------- driver

def settings_of(args: argparse.Namespace) -> dict[str, Any]:
    """The settings a record must match to be reused."""
    return {"task": args.task, "prompts": args.prompts, "n": args.n, "k_ref": args.k_ref, "seed": args.seed,
            "mc_ks": list(MC_KS), "critic_prompts": args.critic_prompts, "critic_updates": args.critic_updates,
            "critic_mini_batch": args.critic_mini_batch, "critic_lr": args.critic_lr}


def record_path(task: str, rule: str) -> Path:
    return REPO / RESULTS / task / f"{rule}.json"


def run(args: argparse.Namespace, rules: list[str], log: Callable[[str], Any] = print) -> None:
    import torch

    torch.set_num_threads(1)
    t_all = time.perf_counter()
    setup, t_load = timed(lambda: TASKS[args.task][0](args.work_dir))
    sampler = Sampler(setup)
    rng = np.random.default_rng(args.seed)
    perm = rng.permutation(len(setup.prompts))
    if args.prompts + args.critic_prompts > len(perm):
        raise SystemExit(f"--prompts + --critic-prompts: {args.prompts + args.critic_prompts} exceed the "
                         f"{len(perm)} training prompts")
    eval_rows = perm[:args.prompts].tolist()
    critic_rows = perm[args.prompts:args.prompts + args.critic_prompts].tolist()
    seconds: dict[str, float] = {"load": t_load}
    replies, seconds["replies"] = timed(lambda: sample_replies(sampler, eval_rows, args.n, args.seed * 1000 + 1))
    log(f"[headroom] {len(replies.scores)} replies in {seconds['replies']:.1f} s, mean score "
        f"{replies.scores.mean():.3f}, mean length {float(replies.mask.sum(1).float().mean()):.1f} tokens")
    starts = {name: rule_starts(replies, RULES[name]) for name in rules}
    keys = sorted({(b, t) for s in starts.values() for b, t in s.nonzero().tolist() if t > 0})
    log(f"[headroom] {len(keys)} inner group starts over rules {', '.join(rules)}")
    # reference at position 0: K_ref fresh replies per prompt
    (_, fresh), seconds["ref_v0"] = timed(lambda: sampler.sample(
        [(p, ()) for p in eval_rows for _ in range(args.k_ref)], args.seed * 1000 + 2))
    v0_ref = fresh.reshape(len(eval_rows), args.k_ref).mean(axis=1)
    noise0 = mean_noise(v0_ref, args.k_ref)
    ref, ref_tok, seconds["ref_inner"] = continuation_table(sampler, replies, keys, args.k_ref,
                                                            args.seed * 1000 + 3)
    log(f"[headroom] reference: {len(keys)} x {args.k_ref} continuations in {seconds['ref_inner']:.1f} s")
    ref_mean = {k: float(v.mean()) for k, v in ref.items()}
    ref_noise = {k: float(mean_noise(np.array(v), args.k_ref)) for k, v in ref_mean.items()}
    mc, mc_tok = {}, {}
    for i, k in enumerate(MC_KS):
        mc[k], mc_tok[k], seconds[f"mc_{k}"] = continuation_table(sampler, replies, keys, k,
                                                                   args.seed * 1000 + 10 + i)
        log(f"[headroom] mc K={k}: {len(keys)} x {k} continuations in {seconds[f'mc_{k}']:.1f} s")
    critic_values, critic_info = train_critic(setup, sampler, critic_rows, args.n, args.critic_updates,
                                              args.critic_mini_batch, args.critic_lr, args.seed * 1000 + 4,
                                              replies, log)
    for part, s in critic_info["seconds"].items():
        seconds[f"critic_{part}"] = s
    seconds["total"] = time.perf_counter() - t_all
    for name in rules:
        rec = rule_record(name, replies, starts[name], v0_ref, noise0, ref_mean, ref_noise, mc, mc_tok,
                          critic_values)
        inner_keys = [tuple(x) for x in starts[name].nonzero().tolist() if x[1] > 0]
        rec["ref_tokens_per_reply"] = {"inner": sum(ref_tok[k] for k in inner_keys) / len(replies.scores),
                                       "v0_per_prompt_k_ref_replies": float(args.k_ref * replies.mask.sum(1)
                                                                            .float().mean())}
        for k in MC_KS:  # the shared sampling's seconds in proportion to this rule's tokens
            rec["sources"][f"mc_{k}"]["wall_s"] = seconds[f"mc_{k}"] * _share(
                sum(mc_tok[k][key] for key in inner_keys), sum(mc_tok[k].values()))
        for src in ("prompt_mean", "prompt_mean_loo", "prefix_tree", "own_return"):
            rec["sources"][src]["wall_s"] = 0.0
        rec["sources"]["critic"]["wall_s"] = sum(critic_info["seconds"].values())
        rec["ref_wall_s"] = seconds["ref_inner"] * _share(sum(ref_tok[k] for k in inner_keys),
                                                          sum(ref_tok.values()))
        rec.update(settings=settings_of(args), critic=critic_info, seconds_shared=seconds, rules_run_together=rules,
                   command="python benchmarks/bench_value_headroom.py " + " ".join(portable(a) for a in args.argv))
        write_json(record_path(args.task, name), rec)
        log(f"[headroom] wrote {RESULTS / args.task / (name + '.json')}")


# --------------------------------------------------------------------------------------------------- report

def _f(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def report(records: dict[str, dict]) -> str:
    """The markdown tables of ``records`` ({rule: record})."""
    if not records:
        return "no records"
    first = next(iter(records.values()))
    s = first["settings"]
    head = (f"Task {s['task']}: {s['prompts']} prompts x {s['n']} replies, K_ref {s['k_ref']}, seed {s['seed']}; "
            f"reply score mean {first['reply_score_mean']:.3f}, mean reply length {first['mean_reply_tokens']:.1f} "
            "tokens.")
    lines = [head, ""]
    split = first["variance_split"]
    lines += ["| return variance | raw | noise-corrected |", "|---|---|---|",
              f"| between prompts Var(v0) | {_f(split['between'], 4)} | {_f(split.get('between_corrected'), 4)} |",
              f"| within prompts E[(R - v0)^2] | {_f(split['within'], 4)} | {_f(split.get('within_corrected'), 4)} |",
              f"| between share | {_f(split['between_share'])} | {_f(split.get('between_share_corrected'))} |", ""]
    lines += [("| rule | groups / reply | inner starts | resolved share (raw) | resolved share (corrected) | "
               "remainder share | by boundary index (raw) | credit spread, tokens (GRPO) |"),
              "|---|---|---|---|---|---|---|---|"]
    for name, r in records.items():
        res = r["resolved"]
        lines.append(f"| {name} | {r['groups_per_reply']:.2f} | {r['inner_starts']} | {_f(res['resolved'])} | "
                     f"{_f(res.get('resolved_corrected'))} | {_f(res['remainder'])} | "
                     f"{' '.join(_f(x) for x in res['by_index'])} | {_f(res.get('credit_spread_tokens'), 2)} "
                     f"({_f(res.get('credit_spread_tokens_grpo'), 2)}) |")
    lines += ["", "| rule | source | EV inner | EV all | generated tokens / reply | wall s (this rule's share) |",
              "|---|---|---|---|---|---|"]
    for name, r in records.items():
        for src, v in r["sources"].items():
            lines.append(f"| {name} | {src} | {_f(v['ev_inner'])} | {_f(v['ev_all'])} | "
                         f"{v['tokens_per_reply']:.1f} | {_f(v['wall_s'], 1)} |")
        ceil = r["ev_ceiling"]
        lines.append(f"| {name} | (ceiling: true values vs the K_ref reference) | {_f(ceil['inner'])} | "
                     f"{_f(ceil['all'])} | {r['ref_tokens_per_reply']['inner']:.1f} (reference) | "
                     f"{_f(r['ref_wall_s'], 1)} |")
    c = first["critic"]
    hist = ", ".join(f"{h['updates']}: {h['heldout_ev_all_tokens']:.3f}/{h['heldout_ev_first_token']:.3f}"
                     for h in c["history"])
    critic = (f"Critic: {c['train_prompts']} other prompts x {s['n']} = {c['train_replies']} replies, "
              f"{c['updates']} updates of {c['mini_batch']} replies, lr {c['lr']:g}; its EV on these replies' "
              f"returns (all tokens/first token) by updates: {hist}.")
    walls = ("Wall seconds (shared by " + ", ".join(first["rules_run_together"]) + "): "
             + ", ".join(f"{k} {v:.1f}" for k, v in first["seconds_shared"].items()) + ".")
    lines += ["", critic, walls]
    return "\n".join(lines)


def load_records(task: str, settings: dict | None = None) -> dict[str, dict]:
    out = {}
    for name in RULES:
        rec = read_json(record_path(task, name))
        if isinstance(rec, dict) and (settings is None or rec.get("settings") == settings):
            out[name] = rec
    return out


def main(argv: list[str] | None = None) -> int:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="tiny", choices=sorted(TASKS), help="which prepared task")
    p.add_argument("--work-dir", default=None, help="the prepared task (default: runs/cpu-tiny, runs/cpu-twoway)")
    p.add_argument("--prompts", type=int, default=256, help="training prompts measured")
    p.add_argument("--n", type=int, default=4, help="replies per prompt")
    p.add_argument("--k-ref", type=int, default=32, help="continuations per reference value")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rules", default=",".join(RULES), help=f"comma list of {', '.join(RULES)}")
    p.add_argument("--critic-prompts", type=int, default=2048, help="other training prompts the critic learns on")
    p.add_argument("--critic-updates", type=int, default=400, help="critic mini-batch updates")
    p.add_argument("--critic-mini-batch", type=int, default=64, help="replies per critic update")
    p.add_argument("--critic-lr", type=float, default=None, help="Adam learning rate (default: per task, CRITIC_LR)")
    p.add_argument("--report", action="store_true", help="print the tables from the records and stop")
    args = p.parse_args(argv)
    args.argv = argv
    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    if unknown := [r for r in rules if r not in RULES]:
        raise SystemExit(f"--rules: unknown rule {unknown[0]!r}; known: {', '.join(RULES)}")
    for name in ("prompts", "n", "k_ref", "critic_prompts", "critic_updates", "critic_mini_batch"):
        if getattr(args, name) < (2 if name in ("n", "k_ref") else 1):
            raise SystemExit(f"--{name.replace('_', '-')}: too small, got {getattr(args, name)}")
    args.work_dir = args.work_dir or str(REPO / TASKS[args.task][1])
    args.critic_lr = args.critic_lr or CRITIC_LR[args.task]
    if args.report:
        print(report(load_records(args.task)))
        return 0
    done = load_records(args.task, settings_of(args))
    todo = [r for r in rules if r not in done]
    print(f"[headroom] {len(rules) - len(todo)} of {len(rules)} rules have a record; running {todo}", flush=True)
    if todo:
        run(args, todo, log=lambda m: print(m, flush=True))
    print(report({r: rec for r, rec in load_records(args.task, settings_of(args)).items() if r in rules}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
