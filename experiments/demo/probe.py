"""``python -m experiments.demo.probe``: how good is each advantage estimator's credit assignment?

On the demo's task, models and warm-start cache, at two checkpoints (the warm start, after ``--critic-steps``
critic-only steps; and after ``--rl-steps`` more RL steps of ``--arm``), sample responses, estimate the true
value of every prefix by ``--mc`` Monte Carlo completions (batched), and score every estimator configuration
(:func:`~experiments.demo.probe_analysis.default_configs`) with the trained critic and, as an upper bound,
with the Monte Carlo values in the critic's place. Writes ``DIR/probe.md`` (tables), ``DIR/probe.json`` and
``DIR/probe.png``. What the scores mean: :mod:`~experiments.demo.probe_analysis`; what they showed:
docs/results.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from .options import add_arguments, given, option
from .probe_analysis import (
    blame_share,
    correlation,
    default_configs,
    estimator_advantages,
    first_wrong_tokens,
    monte_carlo_advantages,
)


@dataclass
class ProbeOptions:
    """What the probe samples and how hard it looks."""

    output_dir: str = option("runs/probe", "where probe.md, probe.json and probe.png go")
    demo_dir: str = option("runs/demo", "the demo's output dir whose warm-start cache the probe shares (and fills)")
    task: str = option("chain_sum", "chain_sum (reasoning-gym) or mod_chain (ours)")
    terms: Optional[str] = option(None, "terms per chain MIN-MAX (None: the task's own)", type=str)
    arm: str = option("gae", "the arm whose RL steps make the second checkpoint (its critic is the 'trained' one)")
    critic_steps: int = option(30, "critic-only steps on the warm-start policy before the first checkpoint "
                                           "(after value pretraining when --critic-pretrain-steps is given)")
    rl_steps: int = option(100, "RL steps between the two checkpoints")
    prompts: int = option(32, "held-out prompts sampled at each checkpoint")
    samples: int = option(4, "responses per prompt")
    mc: int = option(8, "Monte Carlo completions per prefix")
    seed: int = option(0, "seed of the run and of the sampling")
    warmstart_steps: Optional[int] = option(None, "supervised warm-start steps (None: the demo's default; cached)",
                                            type=int)
    threads: Optional[int] = option(None, "torch threads (None: torch's default)", type=int)


@dataclass
class ProbeBatch:
    """Responses sampled at one checkpoint, with everything the scores need; tensors (B, T)."""

    rewards: torch.Tensor
    mask: torch.Tensor
    values: torch.Tensor  # the trained critic's
    values_mc: torch.Tensor  # Monte Carlo
    old_log_probs: torch.Tensor
    index: np.ndarray
    first_wrong: list[Optional[int]]
    accuracy: float


@torch.no_grad()
def monte_carlo_values(policy, task, tok, problems, rollout, k: int, response_len: int, generator,
                       chunk: int = 1024) -> torch.Tensor:
    """(B, T) ``V_mc[b, t]``: the mean verifier reward of ``k`` completions sampled from the prompt plus the
    response's first ``t`` tokens (the state before token t), with the remaining token budget; 0 at masked t."""
    from verl_group_ppo.tasks.tiny.model import sample
    from verl_group_ppo.tasks.tiny.warmstart import encode_prompt

    responses = rollout.responses.tolist()
    lengths = rollout.response_mask.sum(-1).long().tolist()
    values = torch.zeros(rollout.responses.shape)
    for t in range(max(lengths, default=0)):
        rows = [b for b in range(len(problems)) if lengths[b] > t for _ in range(k)]
        prefixes = [encode_prompt(tok, problems[b]) + responses[b][:t] for b in rows]
        scores = []
        for start in range(0, len(rows), chunk):
            part = slice(start, start + chunk)
            cont = sample(policy, prefixes[part], response_len - t, tok.pad_id, tok.eos_id, generator=generator)
            scores += _completion_scores(task, tok, [problems[b] for b in rows[part]],
                                         [responses[b][:t] for b in rows[part]], cont.responses.tolist())
        per_row = torch.tensor(scores).view(-1, k).mean(-1)
        values[[b for b in range(len(problems)) if lengths[b] > t], t] = per_row
    return values


def _completion_scores(task, tok, problems, heads: list[list[int]], tails: list[list[int]]) -> list[float]:
    """Verifier reward of each response ``head + tail`` (0 when the tail never emits EOS)."""
    return [task.verify(tok.decode(head + tail), p) if tok.eos_id in tail else 0.0
            for p, head, tail in zip(problems, heads, tails)]


def sample_probe_batch(policy, critic, setup, opts: ProbeOptions, generator) -> ProbeBatch:
    """Sample ``prompts x samples`` held-out responses and measure them (critic values, MC values, first wrong token)."""
    from verl_group_ppo.critic_readout import critic_values
    from verl_group_ppo.tasks.tiny.evaluation import rewards_for
    from verl_group_ppo.tasks.tiny.model import log_probs_and_entropy, sample
    from verl_group_ppo.tasks.tiny.warmstart import encode_prompt

    task, tok, cfg = setup.task, setup.tok, setup.cfg
    problems = [p for p in setup.evals[:opts.prompts] for _ in range(opts.samples)]
    rollout = sample(policy, [encode_prompt(tok, p) for p in problems], cfg.response_len, tok.pad_id, tok.eos_id,
                     generator=generator)
    rewards, scores, _ = rewards_for(task, tok, rollout, problems)
    mask = rollout.response_mask
    lengths = mask.sum(-1).long().tolist()
    got = [rollout.responses[b, :lengths[b]].tolist() for b in range(len(problems))]
    wrong = first_wrong_tokens(got, [tok.encode(p.solution) + [tok.eos_id] for p in problems])
    old_log_probs, _ = log_probs_and_entropy(policy, rollout)
    values = critic_values(critic, rollout)
    values_mc = monte_carlo_values(policy, task, tok, problems, rollout, opts.mc, cfg.response_len, generator)
    index = np.repeat(np.arange(opts.prompts), opts.samples)
    return ProbeBatch(rewards, mask, values * mask, values_mc, old_log_probs, index,
                      [w if s == 0 else None for w, s in zip(wrong, scores)], float(np.mean(scores)))


def score_configs(batch: ProbeBatch) -> list[dict[str, Any]]:
    """One row per (configuration, critic): correlation with the MC advantages, blame share, groups."""
    truth = monte_carlo_advantages(batch.values_mc, batch.rewards, batch.mask)
    rows = []
    for config in default_configs():
        for critic, values in (("trained", batch.values), ("monte_carlo", batch.values_mc)):
            adv, facts = estimator_advantages(config, batch.rewards, batch.mask, values, batch.index,
                                              batch.old_log_probs)
            rows.append({"config": config.name, "critic": critic,
                         "correlation": correlation(adv, truth, batch.mask),
                         "blame": blame_share(adv, batch.mask, batch.first_wrong), **facts})
    return rows


def run_checkpoints(setup, opts: ProbeOptions, log) -> dict[str, Any]:
    """Critic-only steps, probe (warm start); RL steps, probe again. ``setup`` is the demo's
    :class:`~experiments.demo.cli.DemoSetup`. Returns the JSON record."""
    from .arms import get_arm
    from .rl import build_learner, train_step

    cfg = dataclasses.replace(setup.cfg, steps=opts.critic_steps + opts.rl_steps, critic_warmup=opts.critic_steps)
    learner = build_learner(get_arm(opts.arm), opts.seed, cfg, setup.tok, setup.init_state, "cpu")
    generator = torch.Generator().manual_seed(50_000 + opts.seed)
    result: dict[str, Any] = {"options": dataclasses.asdict(opts), "checkpoints": {}}
    done = 0
    for name, upto in (("warm start", opts.critic_steps), (f"after {opts.rl_steps} RL steps", cfg.steps)):
        for step in range(done + 1, upto + 1):
            train_step(learner, step, cfg, setup.task, setup.tok, setup.train)
        done = upto
        t0 = time.time()
        batch = sample_probe_batch(learner.policy, learner.critic, setup, opts, generator)
        rows = score_configs(batch)
        log(f"[probe] {name}: accuracy {batch.accuracy:.3f}, {len(rows)} rows in {time.time() - t0:.0f}s")
        result["checkpoints"][name] = {"accuracy": batch.accuracy, "failed_with_wrong_token":
                                       sum(w is not None for w in batch.first_wrong), "rows": rows}
    return result


def write_report(out_dir: str, result: dict[str, Any]) -> str:
    """probe.json, probe.md (one table per checkpoint) and probe.png; returns the markdown."""
    with open(os.path.join(out_dir, "probe.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = ["# Estimator-quality probe", "",
             "correlation: Pearson correlation of per-token advantages with the Monte Carlo advantages "
             "V(s_t+1) - V(s_t); blame: in failed responses, the share of negative advantage on the first wrong "
             "token (a flat advantage gives 1/L). Columns per critic: the trained critic, and Monte Carlo values "
             "in its place (an upper bound).", ""]
    for name, ckpt in result["checkpoints"].items():
        lines += [f"## {name} (sampled accuracy {ckpt['accuracy']:.3f}, {ckpt['failed_with_wrong_token']} failed "
                  "responses with a wrong token)", "",
                  "| configuration | corr (trained) | corr (MC) | blame (trained) | blame (MC) | groups/resp (trained) |",
                  "|---|---|---|---|---|---|"]
        by_config: dict[str, dict[str, dict]] = {}
        for row in ckpt["rows"]:
            by_config.setdefault(row["config"], {})[row["critic"]] = row
        for config, pair in by_config.items():
            tr, mc = pair["trained"], pair["monte_carlo"]
            groups = tr.get("groups_per_response")
            lines.append(f"| {config} | {tr['correlation']:.3f} | {mc['correlation']:.3f} | {tr['blame']:.3f} | "
                         f"{mc['blame']:.3f} | {'' if groups is None else f'{groups:.1f}'} |")
        lines.append("")
    text = "\n".join(lines)
    with open(os.path.join(out_dir, "probe.md"), "w") as f:
        f.write(text)
    _plot(out_dir, result)
    return text


def _plot(out_dir: str, result: dict[str, Any]) -> None:
    """probe.png: correlation per configuration, trained critic vs Monte Carlo values, one panel per checkpoint."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    checkpoints = list(result["checkpoints"].items())
    fig, axes = plt.subplots(len(checkpoints), 1, figsize=(12, 4.5 * len(checkpoints)), squeeze=False)
    for ax, (name, ckpt) in zip(axes[:, 0], checkpoints):
        configs = list(dict.fromkeys(row["config"] for row in ckpt["rows"]))
        for offset, critic in ((-0.2, "trained"), (0.2, "monte_carlo")):
            scores = {r["config"]: r["correlation"] for r in ckpt["rows"] if r["critic"] == critic}
            ax.bar(np.arange(len(configs)) + offset, [scores[c] for c in configs], width=0.4, label=critic)
        ax.set_xticks(np.arange(len(configs)), configs, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("corr. with MC advantage")
        ax.set_title(f"{name} (accuracy {ckpt['accuracy']:.2f})")
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "probe.png"), dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> int:
    """Parse the flags, prepare the demo's task and warm start (cached in the output dir), probe, report."""
    from .cli import DemoOptions, setup_demo
    from .pretrain import PretrainConfig
    from .rl import RunConfig

    parser = argparse.ArgumentParser(prog="python -m experiments.demo.probe", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser, ProbeOptions)
    add_arguments(parser, PretrainConfig)
    args = parser.parse_args(argv)
    opts = ProbeOptions(**given(args, ProbeOptions))
    pretrain = PretrainConfig(**given(args, PretrainConfig))
    if opts.threads:
        torch.set_num_threads(opts.threads)
    os.makedirs(opts.output_dir, exist_ok=True)
    os.makedirs(opts.demo_dir, exist_ok=True)
    given_steps = {} if opts.warmstart_steps is None else {"warmstart_steps": opts.warmstart_steps}
    demo = DemoOptions(output_dir=opts.demo_dir, task=opts.task, terms=opts.terms, no_progress=True, **given_steps)
    t0 = time.time()
    setup = setup_demo(demo, RunConfig(steps=opts.critic_steps + opts.rl_steps), "cpu", log=print, pretrain=pretrain)
    result = run_checkpoints(setup, opts, log=print)
    result["critic_pretrain"] = setup.critic_pretrain
    result["wall_time_s"] = time.time() - t0
    print(write_report(opts.output_dir, result))
    print(f"[probe] wrote {opts.output_dir}/probe.md, probe.json, probe.png in {result['wall_time_s']:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
