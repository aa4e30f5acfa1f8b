"""Per-step cost of the CPU demo: default chains vs ``--terms`` chains, and the evals, measured in one process.

Builds the demo's setup (task, tokenizer, cached warm start) for two term ranges, then runs GROUP-PPO
training steps alternately on the two (ABAB..., so load from other processes hits both alike) and times
them; then times one periodic eval and one final eval on the default setup. Prints JSON: median seconds
per step for each, their ratio, and the evals in units of one default step (what the final eval adds to
a run). Absolute seconds depend on the machine's load; the ratios are the figures to use.

    python -m experiments.demo_step --steps 6 --long-terms 10-12 --warmstart-steps 300
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

from benchmarks.benchlib import timed


def _setup(terms, args):
    from experiments.demo.cli import DemoOptions, setup_demo
    from experiments.demo.rl import RunConfig

    opts = DemoOptions(output_dir=os.path.join(args.cache_dir, f"terms-{terms or 'default'}"), terms=terms,
                       warmstart_steps=args.warmstart_steps, final_eval_size=args.final_eval_size, no_progress=True)
    return setup_demo(opts, RunConfig(steps=args.steps + 1), "cpu", log=lambda m: None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6, help="timed steps per setup")
    p.add_argument("--long-terms", default="10-12")
    p.add_argument("--warmstart-steps", type=int, default=300)
    p.add_argument("--final-eval-size", type=int, default=1024)
    p.add_argument("--cache-dir", default="runs/bench-demo-step")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()

    import torch

    from experiments.demo.arms import ARMS
    from experiments.demo.rl import Evaluator, build_learner, train_step

    torch.set_num_threads(args.threads)
    setups = {"default": _setup(None, args), args.long_terms: _setup(args.long_terms, args)}
    learners = {k: build_learner(ARMS["group_ppo"], 0, s.cfg, s.tok, s.init_state, "cpu") for k, s in setups.items()}
    times: dict[str, list[float]] = {k: [] for k in setups}
    lengths: dict[str, list[float]] = {k: [] for k in setups}
    for step in range(1, args.steps + 1):
        for k, s in setups.items():  # alternate: both see the same background load
            (rec, _, _), seconds = timed(lambda: train_step(learners[k], step, s.cfg, s.task, s.tok, s.train))
            times[k].append(seconds)
            lengths[k].append(rec["response_length/mean"])
    d = setups["default"]
    ev = Evaluator(d.task, d.tok, d.evals, d.cfg)
    _, periodic_s = timed(lambda: ev(learners["default"].policy, 1))
    _, final_s = timed(lambda: ev.final_eval(learners["default"].policy))
    step_s = {k: statistics.median(v) for k, v in times.items()}
    print(json.dumps({
        "median_step_s": step_s,
        "mean_response_length": {k: statistics.mean(v) for k, v in lengths.items()},
        "response_len_cap": {k: s.cfg.response_len for k, s in setups.items()},
        "long_over_default_step_ratio": step_s[args.long_terms] / step_s["default"],
        "periodic_eval_in_default_steps": periodic_s / step_s["default"],
        "final_eval_in_default_steps": final_s / step_s["default"],
        "final_eval_samples": len(d.evals) * d.cfg.eval_samples,
    }, indent=1))


if __name__ == "__main__":
    main()
