"""Which value-pretraining settings give the demo's critic the highest held-out explained variance.

    .venv/bin/python -m experiments.value_pretraining --setup-dir runs/critic-regimes/setup --steps 100

Every setting pretrains a fresh critic (backbone from the warm start, value head at zero) for ``--steps``
critic-only steps on one pool of the warm-start policy's samples and measures its explained variance on the same
held-out responses (:mod:`experiments.demo.pretrain`, through :mod:`verl_group_ppo.critic_readout`). The warm
start is the demo's default one, cached under ``--setup-dir`` (trained there when missing). The settings: the
demo's recipe (lr 1e-3, 1 epoch, value clip 0.5, Monte Carlo targets), one change at a time from it
(:data:`SETTINGS`), and the ``--combine`` combinations.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import time

from benchmarks.benchlib import REPO, timed, write_json

#: the demo's RL critic recipe as pretraining settings, and one change at a time from it
RECIPE = {"critic_pretrain_lr": 1e-3, "critic_pretrain_epochs": 1, "critic_pretrain_clip": 0.5,
          "critic_pretrain_lam": 1.0}
SETTINGS = {
    "recipe": {},
    "lr 1e-4": {"critic_pretrain_lr": 1e-4},
    "lr 3e-4": {"critic_pretrain_lr": 3e-4},
    "lr 3e-3": {"critic_pretrain_lr": 3e-3},
    "lr 1e-2": {"critic_pretrain_lr": 1e-2},
    "4 epochs": {"critic_pretrain_epochs": 4},
    "no value clip": {"critic_pretrain_clip": 1e9},
    "lam 0.95 targets": {"critic_pretrain_lam": 0.95},
}


def parse_combination(text: str) -> dict:
    """A setting's changes, or a combination's (``"lr 3e-3+4 epochs"``: the union of those settings')."""
    names = [name.strip() for name in text.split("+")]
    if unknown := [name for name in names if name not in SETTINGS]:
        raise SystemExit(f"unknown setting {unknown[0]!r}; known: {', '.join(SETTINGS)}")
    return {key: value for name in names for key, value in SETTINGS[name].items()}


def consistency_oracle_ev(held, problems: list, task, tok) -> float:
    """Explained variance on ``held`` of a value function that knows only whether a response's prefix is still
    consistent with the problem's clean worked solution: 0 once it is not, else the success rate of the
    consistent prefixes of that length (a ceiling-like reference for what the critic could learn)."""
    import random

    import torch

    from verl_group_ppo.core_algos import explained_variance

    mask, success = held.response_mask, held.scores
    B, T = mask.shape
    consistent = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        clean = task.noisy_solution(problems[b], random.Random(0), 0.0)
        ids = held.responses[b, :int(mask[b].sum())].tolist()
        for t in range(len(ids)):
            consistent[b, t] = clean.startswith(tok.decode(ids[:t]))
    values = torch.zeros(B, T)
    for t in range(T):
        rows = consistent[:, t] & mask[:, t].bool()
        if rows.any():
            values[rows, t] = success[rows].mean()
    return explained_variance(success[:, None] * mask, values, mask)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--setup-dir", default=os.path.join(REPO, "runs", "critic-regimes", "setup"),
                   help="where the demo's default warm start is cached")
    p.add_argument("--steps", type=int, default=100, help="pretraining steps per setting")
    p.add_argument("--eval-every", type=int, default=25, help="steps between held-out measurements")
    p.add_argument("--settings", default=",".join(SETTINGS), help="comma list of settings to run")
    p.add_argument("--combine", action="append", default=[], help="a combination, e.g. 'lr 3e-3+4 epochs'")
    p.add_argument("--output", default=None, help="JSON of every curve (default: SETUP_DIR/value_pretraining.json)")
    args = p.parse_args(argv)
    runs = {name: parse_combination(name) for name in [*args.settings.split(","), *args.combine] if name}

    import torch

    from experiments.demo.cli import DemoOptions, setup_demo
    from experiments.demo.pretrain import (CriticRecipe, PretrainConfig, PretrainSamples, pretrain_critic,
                                              pretraining_data)
    from experiments.demo.rl import RunConfig
    from verl_group_ppo.tasks.tiny.model import build_critic, build_policy

    torch.set_num_threads(1)
    setup = setup_demo(DemoOptions(output_dir=args.setup_dir, no_progress=True), RunConfig(), "cpu",
                       log=lambda m: print(m, flush=True))
    cfg, tok = setup.cfg, setup.tok
    policy = build_policy(tok.vocab_size, setup.init_state["size"], 0, tok.pad_id, tok.eos_id)
    policy.load_state_dict(setup.init_state["state_dict"])
    t0 = time.time()
    batches, held = pretraining_data(policy, setup.task, tok, setup.train, setup.evals, PretrainSamples.of_run(cfg))
    pool = list(itertools.islice(batches, args.steps))
    print(f"[value pretraining] {len(pool)} batches sampled in {time.time() - t0:.0f}s", flush=True)
    problems = [p for p in setup.evals[:cfg.eval_size] for _ in range(cfg.eval_samples)]
    print(f"[value pretraining] held-out success rate {float(held.scores.mean()):.3f}; consistency "
          f"oracle explained variance {consistency_oracle_ev(held, problems, setup.task, tok):.3f}", flush=True)
    results = {}
    for name, change in runs.items():
        pc = PretrainConfig(critic_pretrain_steps=args.steps, critic_pretrain_eval_every=args.eval_every,
                            **{**RECIPE, **change})
        history, seconds = timed(lambda: pretrain_critic(build_critic(policy, 0).train(), iter(pool), held, pc,
                                                         CriticRecipe.of_run(cfg), log=lambda m: None))
        results[name] = {"settings": dataclasses.asdict(pc), "history": history, "seconds": seconds}
        curve = " ".join(f"{h['heldout_explained_variance']:.3f}" for h in history)
        print(f"[value pretraining] {name:>28s}: held-out explained variance by step {curve} ({seconds:.0f}s)",
              flush=True)
    write_json(args.output or os.path.join(args.setup_dir, "value_pretraining.json"), results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
