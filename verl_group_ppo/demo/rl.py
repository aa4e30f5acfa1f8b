"""The demo's RL loop: one (estimator, seed) run from the shared warm start.

Every arm runs exactly the same loop with the same hyperparameters, the same prompts (drawn from a
generator seeded only by the seed) and the same sample budget; only the advantage estimator differs:

* ``group_ppo``            - ours: ``verl_group_ppo.core_algos.compute_group_ppo_outputs`` with the adaptive
                             threshold; critic trained at group boundaries only (spec Step 7).
* ``group_ppo_all_tokens`` - the same with ``critic_loss_on: all_tokens`` (optional fourth arm).
* ``gae``                  - PPO: verl's ``compute_gae_advantage_return``; critic trained on all tokens.
* ``grpo``                 - verl's ``compute_grpo_outcome_advantage``; no critic.

The losses are verl's own: the actor uses ``get_policy_loss_fn("vanilla")`` (verl's clipped PPO objective)
and the critic ``compute_value_loss`` (verl's clipped value loss), both from ``verl.trainer.ppo.core_algos``.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from omegaconf import OmegaConf

from .model import Rollout, build_critic, critic_values, log_probs_and_entropy, sample
from .tasks import Problem, Task
from .tokenizer import CharTokenizer

ESTIMATORS = ("group_ppo", "gae", "grpo", "group_ppo_all_tokens")
NEEDS_CRITIC = {"group_ppo": True, "group_ppo_all_tokens": True, "gae": True, "grpo": False}


@dataclass
class RunConfig:
    """Hyperparameters shared by every arm (nothing here depends on the estimator)."""

    steps: int = 400
    prompts_per_step: int = 64
    n_samples: int = 4
    response_len: int = 24
    temperature: float = 1.0
    actor_lr: float = 2e-4
    critic_lr: float = 1e-3
    lr_warmup_steps: int = 10  # linear warm-up of both learning rates (fresh Adam moments are noisy)
    ppo_epochs: int = 1
    mini_batch_size: int = 256
    critic_mini_batch_size: int = 64  # verl's critic.ppo_mini_batch_size (gae and group_ppo alike)
    clip_ratio: float = 0.2
    cliprange_value: float = 0.5
    grad_clip: float = 1.0
    gamma: float = 1.0
    lam: float = 1.0
    eval_every: int = 10
    eval_samples: int = 2
    group_params: dict = field(default_factory=dict)
    record_groups_at: tuple = ()  # steps at which to keep sampled responses for the groups figure

    def algorithm_config(self, estimator: str) -> dict:
        gp = dict(self.group_params)
        if estimator == "group_ppo_all_tokens":
            gp["critic_loss_on"] = "all_tokens"
        return {"gamma": self.gamma, "lam": self.lam, "norm_adv_by_std_in_grpo": True, "group_params": gp}


def _actor_loss_config(cfg: RunConfig):
    # The fields verl's vanilla policy loss reads from its ActorConfig.
    return OmegaConf.create({
        "clip_ratio": cfg.clip_ratio,
        "clip_ratio_low": cfg.clip_ratio,
        "clip_ratio_high": cfg.clip_ratio,
        "clip_ratio_c": 3.0,
        "global_batch_info": {},
    })


def set_seed(seed: int) -> None:
    import random

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def rewards_for(task: Task, tok: CharTokenizer, rollout: Rollout, problems: list[Problem]):
    """Exact verifier -> reward at the last valid response token (0 for responses cut off without EOS)."""
    B, T = rollout.responses.shape
    rewards = torch.zeros((B, T), dtype=torch.float32, device=rollout.responses.device)
    scores, texts = [], []
    resp = rollout.responses.tolist()
    lengths = rollout.response_mask.sum(-1).long().tolist()
    for b in range(B):
        text = tok.decode(resp[b])
        finished = tok.eos_id in resp[b]
        s = task.verify(text, problems[b]) if finished else 0.0
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
    from .warmstart import encode_prompt

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


def _masked_stats(x: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    sel = x[mask.bool()]
    if sel.numel() == 0:
        return 0.0, 0.0
    return float(sel.mean()), float(sel.std(correction=0))


def compute_advantages(estimator: str, cfg: RunConfig, rewards, mask, values, index, old_log_probs, threshold_state,
                       group_params):
    """Returns (advantages, returns, critic_weights, extra_metrics, group_info)."""
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return, compute_grpo_outcome_advantage

    metrics: dict[str, float] = {}
    group_info = None
    if estimator == "gae":
        adv, ret = compute_gae_advantage_return(rewards, values, mask, gamma=cfg.gamma, lam=cfg.lam)
        weights = mask
    elif estimator == "grpo":
        adv, ret = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=True)
        weights = None
    elif estimator in ("group_ppo", "group_ppo_all_tokens"):
        from verl_group_ppo.core_algos import compute_group_ppo_outputs

        out = compute_group_ppo_outputs(rewards, mask, values, index=index,
                                        config=cfg.algorithm_config(estimator), old_log_probs=old_log_probs,
                                        threshold=threshold_state.value)
        threshold_state.update(out.boundary_explained_variance, group_params)
        adv, ret = out.advantages, out.returns
        weights = out.critic_loss_weights if group_params.critic_loss_on == "boundaries" else mask
        metrics.update(out.metrics)
        metrics["group/next_threshold"] = float(threshold_state.value)
        group_info = out
    else:
        raise ValueError(f"unknown estimator {estimator!r}; choose from {ESTIMATORS}")
    return adv, ret, weights, metrics, group_info


def run_one(estimator: str, seed: int, cfg: RunConfig, task: Task, tok: CharTokenizer, train: list[Problem],
            evals: list[Problem], init_state: dict, device="cpu",
            on_step: Callable[[dict], None] | None = None) -> dict:
    """Train one arm from ``init_state`` (the warm-start weights); returns the run record."""
    from verl.trainer.ppo.core_algos import compute_value_loss, get_policy_loss_fn

    from verl_group_ppo.config import GroupParams
    from verl_group_ppo.core_algos import ThresholdState

    from .model import build_policy
    from .warmstart import encode_prompt

    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; choose from {ESTIMATORS}")
    t_start = time.time()
    set_seed(seed)
    policy = build_policy(tok.vocab_size, _size_of(init_state), seed, tok.pad_id, tok.eos_id).to(device)
    policy.load_state_dict(init_state["state_dict"])
    policy.train()
    critic = build_critic(policy, seed).train() if NEEDS_CRITIC[estimator] else None
    actor_opt = torch.optim.Adam(policy.parameters(), lr=cfg.actor_lr)
    critic_opt = torch.optim.Adam(critic.parameters(), lr=cfg.critic_lr) if critic is not None else None
    policy_loss_fn = get_policy_loss_fn("vanilla")
    actor_loss_cfg = _actor_loss_config(cfg)
    group_params = GroupParams.from_config(cfg.algorithm_config(estimator)["group_params"])
    threshold = ThresholdState.from_params(group_params)

    # Same prompts for every estimator (seeded by the seed alone); sampling noise seeded likewise.
    prompt_rng = np.random.default_rng(seed)
    gen = torch.Generator(device=device).manual_seed(10_000 + seed)
    shuffle_gen = torch.Generator().manual_seed(20_000 + seed)
    critic_shuffle_gen = torch.Generator().manual_seed(40_000 + seed)

    curve: list[list[float]] = []
    history: list[dict] = []
    group_samples: list[dict] = []

    greedy_curve: list[list[float]] = []

    def do_eval(step: int) -> dict:
        acc = evaluate(policy, task, tok, evals, cfg.response_len, greedy=False, samples=cfg.eval_samples,
                       seed=30_000 + step)
        g = evaluate(policy, task, tok, evals, cfg.response_len, greedy=True)
        curve.append([step, acc])
        greedy_curve.append([step, g])
        return {"eval/accuracy": acc, "eval/greedy_accuracy": g}

    ev0 = do_eval(0)
    if on_step is not None:
        on_step({"estimator": estimator, "seed": seed, "step": 0, **ev0, "progress": 0})

    for step in range(1, cfg.steps + 1):
        t0 = time.time()
        warm = min(1.0, step / max(1, cfg.lr_warmup_steps))
        for g in actor_opt.param_groups:
            g["lr"] = cfg.actor_lr * warm
        if critic_opt is not None:
            for g in critic_opt.param_groups:
                g["lr"] = cfg.critic_lr * warm
        pidx = prompt_rng.choice(len(train), size=cfg.prompts_per_step, replace=False)
        problems = [train[i] for i in pidx for _ in range(cfg.n_samples)]
        index = np.repeat(pidx, cfg.n_samples)
        rollout = sample(policy, [encode_prompt(tok, p) for p in problems], cfg.response_len, tok.pad_id,
                         tok.eos_id, generator=gen, temperature=cfg.temperature)
        mask = rollout.response_mask
        rewards, scores, texts = rewards_for(task, tok, rollout, problems)
        t_gen = time.time() - t0

        with torch.no_grad():
            old_log_probs, _ = log_probs_and_entropy(policy, rollout)
            values = critic_values(critic, rollout) if critic is not None else None

        adv, ret, weights, m, ginfo = compute_advantages(estimator, cfg, rewards, mask, values, index, old_log_probs,
                                                         threshold, group_params)
        adv = adv.detach().float()
        ret = ret.detach().float()

        B = mask.shape[0]
        mb = min(cfg.mini_batch_size, B)
        pg_losses, vf_losses, clipfracs, kls, ents, vf_clipfracs, grad_norms = [], [], [], [], [], [], []
        cmb = min(cfg.critic_mini_batch_size, B)
        if critic is not None:  # critic update first, as verl's trainer does
            for idx in _minibatches(B, cmb, cfg.ppo_epochs, critic_shuffle_gen, mask.device):
                sub = rollout.select(idx)
                sub_mask = mask[idx]
                vpreds = critic_values(critic, sub)
                if weights is mask:  # all tokens: verl's value loss unchanged
                    vf_loss, vf_clip = compute_value_loss(vpreds, ret[idx], values[idx], sub_mask,
                                                          cliprange_value=cfg.cliprange_value,
                                                          loss_agg_mode="token-mean")
                else:  # boundaries: per-token weights N_valid/N_boundary, token-mean over response tokens
                    vf_loss, vf_clip = compute_value_loss(vpreds, ret[idx], values[idx], weights[idx],
                                                          cliprange_value=cfg.cliprange_value,
                                                          loss_agg_mode="token-mean",
                                                          batch_num_tokens=sub_mask.sum())
                critic_opt.zero_grad(set_to_none=True)
                vf_loss.backward()
                torch.nn.utils.clip_grad_norm_(critic.parameters(), cfg.grad_clip)
                critic_opt.step()
                vf_losses.append(float(vf_loss.detach()))
                vf_clipfracs.append(float(vf_clip))
        for idx in _minibatches(B, mb, cfg.ppo_epochs, shuffle_gen, mask.device):
            sub = rollout.select(idx)
            sub_mask = mask[idx]
            logp, entropy = log_probs_and_entropy(policy, sub, with_entropy=True)
            pg_loss, pg_metrics = policy_loss_fn(old_log_probs[idx], logp, adv[idx], sub_mask,
                                                 loss_agg_mode="token-mean", config=actor_loss_cfg)
            actor_opt.zero_grad(set_to_none=True)
            pg_loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.grad_clip)
            actor_opt.step()
            pg_losses.append(float(pg_loss.detach()))
            clipfracs.append(pg_metrics["actor/pg_clipfrac"])
            kls.append(pg_metrics["actor/ppo_kl"])
            ents.append(float((entropy.detach() * sub_mask).sum() / sub_mask.sum().clamp(min=1)))
            grad_norms.append(float(gn))

        rec: dict[str, Any] = {
            "estimator": estimator,
            "seed": seed,
            "step": step,
            "reward/mean": float(np.mean(scores)),
            "response_length/mean": float(mask.sum(-1).mean()),
            "actor/pg_loss": float(np.mean(pg_losses)),
            "actor/pg_clipfrac": float(np.mean(clipfracs)),
            "actor/ppo_kl": float(np.mean(kls)),
            "actor/entropy": float(np.mean(ents)),
            "actor/grad_norm": float(np.mean(grad_norms)),
        }
        rec["advantages/mean"], rec["advantages/std"] = _masked_stats(adv, mask)
        rec["returns/mean"], rec["returns/std"] = _masked_stats(ret, mask)
        if critic is not None:
            rec["critic/vf_loss"] = float(np.mean(vf_losses))
            rec["critic/vf_clipfrac"] = float(np.mean(vf_clipfracs))
            rec["critic/values_mean"], _ = _masked_stats(values, mask)
            sel = mask.bool()
            err = (ret - values)[sel]
            var_r = ret[sel].var(correction=0)
            rec["critic/vf_explained_var"] = float(1 - err.var(correction=0) / (var_r + 1e-8))
        rec.update(m)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            rec.update(do_eval(step))
        rec["time/gen_s"] = t_gen
        rec["time/step_s"] = time.time() - t0
        if ginfo is not None and step in cfg.record_groups_at:
            group_samples.append(_group_sample(step, tok, problems, rollout, scores, ginfo, values))
        history.append(rec)
        if on_step is not None:
            on_step({**rec, "progress": step})
        for k in ("actor/pg_loss",):
            if not math.isfinite(rec[k]):
                raise FloatingPointError(f"{estimator} seed {seed}: non-finite {k} at step {step}")

    return {
        "estimator": estimator,
        "seed": seed,
        "final_eval_accuracy": curve[-1][1],
        "steps": cfg.steps,
        "curve": curve,
        "greedy_curve": greedy_curve,
        "final_greedy_accuracy": greedy_curve[-1][1],
        "wall_time_s": time.time() - t_start,
        "final_threshold": float(threshold.value) if estimator.startswith("group_ppo") else None,
        "history": history,
        "group_samples": group_samples,
        "config": asdict(cfg),
    }


def _minibatches(n: int, size: int, epochs: int, generator: torch.Generator, device):
    """Index tensors of shuffled mini-batches: ``epochs`` passes over ``range(n)``, a fresh order each."""
    for _ in range(epochs):
        perm = torch.randperm(n, generator=generator).to(device)
        for start in range(0, n, size):
            yield perm[start:start + size]


def _size_of(init_state: dict) -> str:
    return init_state["size"]


def _group_sample(step: int, tok: CharTokenizer, problems, rollout: Rollout, scores, ginfo, values,
                  n_prompts: int = 3, per_prompt: int = 3) -> dict:
    """A few responses with their groups and group advantages, for groups.html / groups.png.

    Picks prompts whose responses have mixed rewards when possible (those carry the learning signal).
    """
    n = len(problems)
    group_size = max(1, n // max(1, len({p.prompt for p in problems})))
    rows = []
    starts = list(range(0, n, group_size))
    mixed = [s for s in starts if 0 < sum(scores[s:s + group_size]) < group_size]
    chosen = (mixed + [s for s in starts if s not in mixed])[:n_prompts]
    for s in chosen:
        for b in range(s, min(s + per_prompt, n)):
            L = int(rollout.response_mask[b].sum())
            toks = [tok.token_str(i) for i in rollout.responses[b, :L].tolist()]
            rows.append({
                "prompt": problems[b].prompt,
                "answer": problems[b].answer,
                "reward": scores[b],
                "tokens": toks,
                "group_ids": ginfo.group_ids[b, :L].tolist(),
                "advantages": [round(float(x), 4) for x in ginfo.advantages[b, :L].tolist()],
                "values": [round(float(x), 4) for x in values[b, :L].tolist()],
            })
    return {"step": step, "threshold": float(ginfo.threshold), "rows": rows}
