"""The demo's RL loop: one (arm, seed) run from the shared warm start.

Every arm (see :mod:`.arms`) runs exactly this loop with the same hyperparameters, the same prompts (drawn
from a generator seeded only by the seed) and the same sample budget; only the advantage estimator and
the critic's loss mode differ. Per step: sample, verify, compute advantages (:func:`compute_advantages`),
update the critic (:func:`update_critic`), update the actor (:func:`update_actor`, skipped during the
first ``critic_warmup`` steps), record (:func:`step_record`).

The losses are verl's own: the actor uses ``get_policy_loss_fn("vanilla")`` (verl's clipped PPO objective)
and the critic ``compute_value_loss`` (verl's clipped value loss), both from ``verl.trainer.ppo.core_algos``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
from omegaconf import OmegaConf

from verl_group_ppo.critic_readout import critic_values
from verl_group_ppo.tasks.tiny.evaluation import evaluate, rewards_for
from verl_group_ppo.tasks.tiny.model import Rollout, build_critic, log_probs_and_entropy, sample
from verl_group_ppo.tasks.tiny.problems import Problem, Task
from verl_group_ppo.tasks.tiny.tokenizer import CharTokenizer

from .arms import BOUNDARIES, AdvantageInputs, Advantages, Arm, get_arm
from .optim import gradient_step, minibatches, set_warmup_lr
from .options import option


@dataclass
class RunConfig:
    """Hyperparameters shared by every arm (nothing here depends on the estimator)."""

    steps: int = option(400, "RL steps per run (--quick: 150)")
    prompts_per_step: int = option(64, "prompts per RL step")
    n_samples: int = option(4, "sampled responses per prompt")
    response_len: Optional[int] = option(None, "max response tokens (None: the task's longest worked solution "
                                               "+ EOS + 3)", flag="--response-length", type=int)
    temperature: float = option(1.0, "sampling temperature")
    actor_lr: float = option(2e-4, "actor learning rate (Adam)")
    critic_lr: float = option(1e-3, "critic learning rate (Adam)")
    lr_warmup_steps: int = option(10, "linear warm-up of each learning rate over its first updates")
    critic_warmup: Optional[int] = option(None, "first steps that update only the critic (actor frozen; verl's "
                                                "trainer.critic_warmup), every arm alike (GRPO's actor waits too); GROUP-PPO's "
                                                "advantage step and threshold still run (None: steps // 20, "
                                                "20 of 400; version 1: 0)", type=int)
    ppo_epochs: int = option(1, "passes over each batch")
    mini_batch_size: int = option(256, "actor mini-batch (responses per update)")
    critic_mini_batch_size: int = option(64, "critic mini-batch (responses per update; every critic arm)")
    clip_ratio: float = option(0.2, "PPO clip ratio")
    cliprange_value: float = option(0.5, "value clip range")
    grad_clip: float = option(1.0, "gradient-norm clip")
    gamma: float = option(1.0, "algorithm.gamma")
    lam: float = option(1.0, "algorithm.lam for every critic arm (verl default 1.0)")
    eval_every: Optional[int] = option(None, "eval interval in steps (None: steps/15)", type=int)
    eval_size: int = option(256, "held-out prompts of the periodic evals (the first ones of the eval set)")
    eval_samples: int = option(2, "sampled responses per held-out prompt")
    group_params: dict = option(None, "algorithm.group_params overrides (every arm reads policy_lam/critic_lam)",
                                cli=False, factory=dict)
    record_groups_at: Optional[tuple] = option(None, "steps whose responses are kept for the groups figure "
                                                     "(None: 1, steps/2, steps)", cli=False)

    def __post_init__(self) -> None:
        if self.critic_warmup is not None and not 0 <= self.critic_warmup < self.steps:
            raise ValueError(f"critic_warmup must be in [0, steps={self.steps}), got {self.critic_warmup}")
        if "critic_loss_on" in (self.group_params or {}):
            raise ValueError("group_params.critic_loss_on is set by the arm: choose group_ppo (boundaries) or "
                             "group_ppo_all_tokens (all_tokens) instead")

    def resolved(self, task: Task) -> "RunConfig":
        """A copy with every None default filled in (response length from the task's longest solution)."""
        return dataclasses.replace(
            self,
            response_len=self.response_len or task.max_solution_len() + 4,
            critic_warmup=self.steps // 20 if self.critic_warmup is None else self.critic_warmup,
            eval_every=self.eval_every or max(1, self.steps // 15),
            record_groups_at=(tuple(sorted({1, max(1, self.steps // 2), self.steps}))
                              if self.record_groups_at is None else tuple(self.record_groups_at)))

    def algorithm_config(self, arm: Arm | str) -> dict:
        """verl's ``algorithm`` config of ``arm`` (a plain dict)."""
        arm = get_arm(arm) if isinstance(arm, str) else arm
        group_params = {**(self.group_params or {}), **arm.group_overrides()}
        return {"gamma": self.gamma, "lam": self.lam, "norm_adv_by_std_in_grpo": True, "group_params": group_params}


def set_seed(seed: int) -> None:
    import random

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _masked_stats(x: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    sel = x[mask.bool()]
    if sel.numel() == 0:
        return 0.0, 0.0
    return float(sel.mean()), float(sel.std(correction=0))


# ---------------------------------------------------------------------------------------------------------
# one run's state, one step's batch


@dataclass
class Learner:
    """Everything one run updates: models, optimisers, GROUP-PPO's threshold, and its random generators."""

    arm: Arm
    seed: int
    settings: Any  # AlgorithmSettings
    policy: torch.nn.Module
    critic: Optional[torch.nn.Module]
    actor_opt: torch.optim.Optimizer
    critic_opt: Optional[torch.optim.Optimizer]
    threshold: Any  # AdaptiveThreshold or None
    prompt_rng: np.random.Generator
    sample_gen: torch.Generator
    actor_shuffle: torch.Generator
    critic_shuffle: torch.Generator


@dataclass
class StepBatch:
    """One step's sampled batch; tensors (B, T), ``index`` (B,) prompt ids."""

    problems: list[Problem]
    index: np.ndarray
    rollout: Rollout
    rewards: torch.Tensor
    scores: list[float]
    old_log_probs: torch.Tensor
    values: Optional[torch.Tensor]

    @property
    def mask(self) -> torch.Tensor:
        return self.rollout.response_mask


def build_learner(arm: Arm, seed: int, cfg: RunConfig, tok: CharTokenizer, init_state: dict, device) -> Learner:
    """Policy from the warm start, a critic initialised from it or from the pretrained critic in ``init_state``
    (critic arms), optimisers, generators."""
    from verl_group_ppo.config import read_algorithm_settings
    from verl_group_ppo.core_algos import AdaptiveThreshold

    from verl_group_ppo.tasks.tiny.model import build_policy

    set_seed(seed)
    settings = read_algorithm_settings(cfg.algorithm_config(arm))
    policy = build_policy(tok.vocab_size, init_state["size"], seed, tok.pad_id, tok.eos_id).to(device)
    policy.load_state_dict(init_state["state_dict"])
    policy.train()
    critic = build_critic(policy, seed).train() if arm.needs_critic else None
    if critic is not None and "critic_state_dict" in init_state:  # value pretraining (.pretrain)
        critic.load_state_dict(init_state["critic_state_dict"])
    return Learner(
        arm=arm, seed=seed, settings=settings, policy=policy, critic=critic,
        actor_opt=torch.optim.Adam(policy.parameters(), lr=cfg.actor_lr),
        critic_opt=torch.optim.Adam(critic.parameters(), lr=cfg.critic_lr) if critic is not None else None,
        threshold=AdaptiveThreshold(settings.group) if arm.uses_groups else None,
        # same prompts for every arm (seeded by the seed alone); sampling noise seeded likewise
        prompt_rng=np.random.default_rng(seed),
        sample_gen=torch.Generator(device=device).manual_seed(10_000 + seed),
        actor_shuffle=torch.Generator().manual_seed(20_000 + seed),
        critic_shuffle=torch.Generator().manual_seed(40_000 + seed),
    )


def collect(learner: Learner, cfg: RunConfig, task: Task, tok: CharTokenizer, train: list[Problem]) -> StepBatch:
    """Draw ``prompts_per_step`` prompts, sample ``n_samples`` responses each, verify, score old log-probs/values."""
    from verl_group_ppo.tasks.tiny.warmstart import encode_prompt

    pidx = learner.prompt_rng.choice(len(train), size=cfg.prompts_per_step, replace=False)
    problems = [train[i] for i in pidx for _ in range(cfg.n_samples)]
    rollout = sample(learner.policy, [encode_prompt(tok, p) for p in problems], cfg.response_len, tok.pad_id,
                     tok.eos_id, generator=learner.sample_gen, temperature=cfg.temperature)
    rewards, scores, _ = rewards_for(task, tok, rollout, problems)
    with torch.no_grad():
        old_log_probs, _ = log_probs_and_entropy(learner.policy, rollout)
        values = critic_values(learner.critic, rollout) if learner.critic is not None else None
    return StepBatch(problems, np.repeat(pidx, cfg.n_samples), rollout, rewards, scores, old_log_probs, values)


def compute_advantages(learner: Learner, batch: StepBatch) -> Advantages:
    """The arm's advantage step on ``batch`` (GROUP-PPO also updates its threshold); detached float tensors."""
    inp = AdvantageInputs(batch.rewards, batch.mask, batch.values, batch.index, batch.old_log_probs,
                          learner.settings, learner.threshold)
    adv = learner.arm.advantage(inp)
    adv.advantages = adv.advantages.detach().float()
    adv.returns = adv.returns.detach().float()
    return adv


def update_critic(learner: Learner, batch: StepBatch, adv: Advantages, cfg: RunConfig) -> dict[str, float]:
    """verl's clipped value loss toward ``adv.returns``, on all response tokens or (``boundaries``) with
    GROUP-PPO's per-token weights N_valid/N_boundary, token-mean over the mini-batch's response tokens."""
    from verl.trainer.ppo.core_algos import compute_value_loss

    mask, values = batch.mask, batch.values
    losses, clipfracs = [], []
    for idx in minibatches(mask.shape[0], cfg.critic_mini_batch_size, cfg.ppo_epochs, learner.critic_shuffle,
                            mask.device):
        vpreds = critic_values(learner.critic, batch.rollout.select(idx))
        if learner.arm.critic_loss_on == BOUNDARIES:
            loss, clipfrac = compute_value_loss(vpreds, adv.returns[idx], values[idx], adv.critic_weights[idx],
                                                cliprange_value=cfg.cliprange_value, loss_agg_mode="token-mean",
                                                batch_num_tokens=mask[idx].sum())
        else:
            loss, clipfrac = compute_value_loss(vpreds, adv.returns[idx], values[idx], mask[idx],
                                                cliprange_value=cfg.cliprange_value, loss_agg_mode="token-mean")
        gradient_step(learner.critic_opt, loss, learner.critic.parameters(), cfg.grad_clip)
        losses.append(float(loss.detach()))
        clipfracs.append(float(clipfrac))
    return {"critic/vf_loss": float(np.mean(losses)), "critic/vf_clipfrac": float(np.mean(clipfracs))}


def _actor_loss_config(cfg: RunConfig):
    """The fields verl's vanilla policy loss reads from its ActorConfig."""
    return OmegaConf.create({"clip_ratio": cfg.clip_ratio, "clip_ratio_low": cfg.clip_ratio,
                             "clip_ratio_high": cfg.clip_ratio, "clip_ratio_c": 3.0, "global_batch_info": {}})


def update_actor(learner: Learner, batch: StepBatch, adv: Advantages, cfg: RunConfig) -> dict[str, float]:
    """verl's vanilla (clipped PPO) policy loss, token-mean, over shuffled mini-batches."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    policy_loss_fn, loss_cfg = get_policy_loss_fn("vanilla"), _actor_loss_config(cfg)
    mask, old = batch.mask, batch.old_log_probs
    logs: dict[str, list[float]] = {k: [] for k in ("pg_loss", "pg_clipfrac", "ppo_kl", "entropy", "grad_norm")}
    for idx in minibatches(mask.shape[0], cfg.mini_batch_size, cfg.ppo_epochs, learner.actor_shuffle,
                            mask.device):
        sub_mask = mask[idx]
        logp, entropy = log_probs_and_entropy(learner.policy, batch.rollout.select(idx), with_entropy=True)
        pg_loss, pg_metrics = policy_loss_fn(old[idx], logp, adv.advantages[idx], sub_mask,
                                             loss_agg_mode="token-mean", config=loss_cfg)
        grad_norm = gradient_step(learner.actor_opt, pg_loss, learner.policy.parameters(), cfg.grad_clip)
        logs["pg_loss"].append(float(pg_loss.detach()))
        logs["pg_clipfrac"].append(float(pg_metrics["actor/pg_clipfrac"]))
        logs["ppo_kl"].append(float(pg_metrics["actor/ppo_kl"]))
        logs["entropy"].append(float((entropy.detach() * sub_mask).sum() / sub_mask.sum().clamp(min=1)))
        logs["grad_norm"].append(grad_norm)
    return {f"actor/{k}": float(np.mean(v)) for k, v in logs.items()}


def step_record(learner: Learner, step: int, batch: StepBatch, adv: Advantages,
                updates: dict[str, float]) -> dict[str, Any]:
    """The step's metrics: reward, lengths, update metrics, advantage/return stats, critic fit, ``group/*``."""
    from verl_group_ppo.core_algos import explained_variance

    mask = batch.mask
    rec: dict[str, Any] = {"estimator": learner.arm.name, "seed": learner.seed, "step": step,
                           "reward/mean": float(np.mean(batch.scores)),
                           "response_length/mean": float(mask.sum(-1).mean()), **updates}
    rec["advantages/mean"], rec["advantages/std"] = _masked_stats(adv.advantages, mask)
    rec["returns/mean"], rec["returns/std"] = _masked_stats(adv.returns, mask)
    if batch.values is not None:
        rec["critic/values_mean"], _ = _masked_stats(batch.values, mask)
        rec["critic/vf_explained_var"] = explained_variance(adv.returns, batch.values, mask)
    rec.update(adv.metrics)
    return rec


# ---------------------------------------------------------------------------------------------------------
# evaluation and the run


@dataclass
class Evaluator:
    """Periodic evals (the learning curve) on the first ``eval_size`` held-out prompts, always the same ones;
    the final eval on the whole held-out set."""

    task: Task
    tok: CharTokenizer
    evals: list[Problem]
    cfg: RunConfig
    curve: list = dataclasses.field(default_factory=list)
    greedy_curve: list = dataclasses.field(default_factory=list)
    final: dict = dataclasses.field(default_factory=dict)

    def _accuracies(self, policy, problems: list[Problem], seed: int) -> tuple[float, float]:
        acc = evaluate(policy, self.task, self.tok, problems, self.cfg.response_len, greedy=False,
                       samples=self.cfg.eval_samples, seed=seed)
        return acc, evaluate(policy, self.task, self.tok, problems, self.cfg.response_len, greedy=True)

    def __call__(self, policy, step: int) -> dict[str, float]:
        """Evaluate ``policy`` at ``step`` (sampled and greedy) and append to the curves."""
        acc, greedy = self._accuracies(policy, self.evals[:self.cfg.eval_size], 30_000 + step)
        self.curve.append([step, acc])
        self.greedy_curve.append([step, greedy])
        return {"eval/accuracy": acc, "eval/greedy_accuracy": greedy}

    def final_eval(self, policy) -> dict[str, float]:
        """The final eval: every held-out prompt, ``eval_samples`` responses each (and greedy)."""
        acc, greedy = self._accuracies(policy, self.evals, 50_000)
        self.final = {"eval/final_accuracy": acc, "eval/final_greedy_accuracy": greedy,
                      "eval/final_samples": len(self.evals) * self.cfg.eval_samples}
        return dict(self.final)


def train_step(learner: Learner, step: int, cfg: RunConfig, task: Task, tok: CharTokenizer,
               train: list[Problem]) -> tuple[dict[str, Any], StepBatch, Advantages]:
    """One RL step: sample, advantages, critic update, then (after ``critic_warmup`` steps) actor update."""
    t0 = time.time()
    batch = collect(learner, cfg, task, tok, train)
    t_gen = time.time() - t0
    adv = compute_advantages(learner, batch)
    updates: dict[str, float] = {}
    if learner.critic is not None:  # critic first, as verl's trainer does
        set_warmup_lr(learner.critic_opt, cfg.critic_lr, step - 1, cfg.lr_warmup_steps)
        updates.update(update_critic(learner, batch, adv, cfg))
    if step > cfg.critic_warmup:
        set_warmup_lr(learner.actor_opt, cfg.actor_lr, step - 1 - cfg.critic_warmup, cfg.lr_warmup_steps)
        updates.update(update_actor(learner, batch, adv, cfg))
    rec = step_record(learner, step, batch, adv, updates)
    rec["time/gen_s"] = t_gen
    return rec, batch, adv


def run_one(estimator: str, seed: int, cfg: RunConfig, task: Task, tok: CharTokenizer, train: list[Problem],
            evals: list[Problem], init_state: dict, device="cpu",
            on_step: Callable[[dict], None] | None = None, keep_models: bool = False) -> dict:
    """Train one arm from ``init_state`` (the warm-start weights); returns the run record.

    ``evals`` is the held-out set: the periodic evals (the curve, last point at the last step included) use
    its first ``cfg.eval_size`` prompts, the final eval after the last step all of it. With ``keep_models`` the record also holds
    ``"models": {"policy": module, "critic": module or None}``, the trained modules (in-process use only;
    results.json never stores them)."""
    arm = get_arm(estimator)
    cfg = cfg.resolved(task)
    t_start = time.time()
    learner = build_learner(arm, seed, cfg, tok, init_state, device)
    evaluator = Evaluator(task, tok, evals, cfg)
    report = on_step or (lambda rec: None)
    report({"estimator": arm.name, "seed": seed, "step": 0, **evaluator(learner.policy, 0), "progress": 0})
    history, group_samples = [], []
    for step in range(1, cfg.steps + 1):
        t0 = time.time()
        rec, batch, adv = train_step(learner, step, cfg, task, tok, train)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            rec.update(evaluator(learner.policy, step))
        if step == cfg.steps:
            rec.update(evaluator.final_eval(learner.policy))
        rec["time/step_s"] = time.time() - t0
        if adv.groups is not None and step in cfg.record_groups_at:
            group_samples.append(_group_sample(step, tok, batch, adv.groups))
        history.append(rec)
        report({**rec, "progress": step})
        if "actor/pg_loss" in rec and not math.isfinite(rec["actor/pg_loss"]):
            raise FloatingPointError(f"{arm.name} seed {seed}: non-finite actor/pg_loss at step {step}")
    result = _run_result(arm, seed, cfg, evaluator, learner, history, group_samples, time.time() - t_start)
    if keep_models:
        result["models"] = {"policy": learner.policy, "critic": learner.critic}
    return result


def _run_result(arm: Arm, seed: int, cfg: RunConfig, evaluator: Evaluator, learner: Learner, history: list,
                group_samples: list, wall_time_s: float) -> dict:
    return {
        "estimator": arm.name,
        "seed": seed,
        "final_eval_accuracy": evaluator.final["eval/final_accuracy"],
        "final_eval_samples": evaluator.final["eval/final_samples"],
        "final_greedy_accuracy": evaluator.final["eval/final_greedy_accuracy"],
        "curve_area": float(np.mean([a for _, a in evaluator.curve])),
        "steps": cfg.steps,
        "curve": evaluator.curve,
        "greedy_curve": evaluator.greedy_curve,
        "wall_time_s": wall_time_s,
        "final_threshold": float(learner.threshold.value) if learner.threshold is not None else None,
        "history": history,
        "group_samples": group_samples,
        "config": asdict(cfg),
    }


def _group_sample(step: int, tok: CharTokenizer, batch: StepBatch, groups, n_prompts: int = 3,
                  per_prompt: int = 3) -> dict:
    """A few responses with their groups, group advantages and values, for groups.html / groups.png.

    Picks prompts whose responses have mixed rewards when possible (those carry the learning signal).
    """
    n, scores = len(batch.problems), batch.scores
    group_size = max(1, n // max(1, len({p.prompt for p in batch.problems})))
    starts = list(range(0, n, group_size))
    mixed = [s for s in starts if 0 < sum(scores[s:s + group_size]) < group_size]
    rows = []
    for s in (mixed + [s for s in starts if s not in mixed])[:n_prompts]:
        for b in range(s, min(s + per_prompt, n)):
            length = int(batch.mask[b].sum())
            rows.append({
                "prompt": batch.problems[b].prompt,
                "answer": batch.problems[b].answer,
                "reward": scores[b],
                "tokens": [tok.token_str(i) for i in batch.rollout.responses[b, :length].tolist()],
                "group_ids": groups.group_ids[b, :length].tolist(),
                "advantages": [round(float(x), 4) for x in groups.advantages[b, :length].tolist()],
                "values": [round(float(x), 4) for x in batch.values[b, :length].tolist()],
            })
    return {"step": step, "threshold": float(groups.threshold), "rows": rows}
