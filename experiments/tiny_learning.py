"""How fast the training reward rises on the prepared tiny task, through the demo's own RL loop (seconds, not
verl's minutes): a cheap way to choose the CPU launcher's batch, steps and learning rate before a real run.

    python -m experiments.tiny_learning --work-dir runs/cpu-tiny --prompts 32 --steps 40 --seeds 0,1,2

It loads ``WORK_DIR/model`` (made by ``python -m verl_group_ppo.tasks.tiny.prepare``) with its BPE tokenizer and chat
template, rebuilds the same problem split, and runs :func:`experiments.demo.rl.run_one` with the
launcher's shape (``--prompts`` x 4 responses, one actor update per step, no KL, gamma = lam = 1, no lr or
critic warm-up: verl's defaults). For each seed it prints the training reward over the first and the last
10 steps and the rise, the quantity the launcher's target is stated in; then the mean and spread over seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.benchlib import int_list, timed
from verl_group_ppo.tasks import contract
from verl_group_ppo.tasks.tiny.spec import TINY


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", required=True, help="a prepared tiny task (WORK_DIR of examples/cpu)")
    p.add_argument("--estimator", default="group_ppo", help="group_ppo, gae or grpo (a demo arm)")
    p.add_argument("--prompts", type=int, default=TINY.train_batch, help="prompts per step (x 4 responses)")
    p.add_argument("--steps", type=int, default=TINY.steps, help="RL steps (at least 20: two 10-step windows)")
    p.add_argument("--actor-lr", type=float, default=TINY.actor_lr, help="actor Adam learning rate")
    p.add_argument("--critic-mini-batch", type=int, default=TINY.critic_mini_batch * TINY.rollout_n,
                   help="critic mini-batch in responses")
    p.add_argument("--seeds", default="0,1,2", help="comma list of seeds")
    args = p.parse_args(argv)
    seeds = int_list(args.seeds, "--seeds")
    if args.steps < 20:
        raise SystemExit(f"--steps: need at least 20 (two 10-step windows), got {args.steps}")
    if args.prompts < 1:
        raise SystemExit(f"--prompts: must be >= 1, got {args.prompts}")
    key = Path(args.work_dir) / contract.KEY_FILE
    if not key.exists():
        raise SystemExit(f"--work-dir: {key} is missing; run python -m verl_group_ppo.tasks.tiny.prepare --output-dir "
                         f"{args.work_dir} first")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_group_ppo.tasks.tiny.chat import ChatTokenizer
    from verl_group_ppo.tasks.tiny.prepare import PrepareSettings, task_and_split
    from experiments.demo.rl import RunConfig, run_one

    torch.set_num_threads(1)
    settings = json.loads(key.read_text())["settings"]
    task, train, test = task_and_split(PrepareSettings(**settings))
    model_dir = str(Path(args.work_dir) / "model")
    tok = ChatTokenizer(AutoTokenizer.from_pretrained(model_dir))
    init = {"size": settings["model_size"], "state_dict": AutoModelForCausalLM.from_pretrained(model_dir).state_dict()}
    cfg = RunConfig(steps=args.steps, prompts_per_step=args.prompts, actor_lr=args.actor_lr, critic_warmup=0,
                    lr_warmup_steps=1, mini_batch_size=4 * args.prompts, critic_mini_batch_size=args.critic_mini_batch,
                    response_len=settings["response_length"], eval_every=args.steps, eval_size=64, eval_samples=1,
                    record_groups_at=())
    rises = []
    for seed in seeds:
        result, seconds = timed(lambda: run_one(args.estimator, seed, cfg, task, tok, train, test[:64], init))
        rewards = [h["reward/mean"] for h in result["history"]]
        first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
        rises.append(last - first)
        print(f"seed {seed}: reward first 10 steps {first:.3f}, last 10 {last:.3f}, rise {last - first:+.3f} "
              f"({seconds:.0f} s)", flush=True)
    spread = f", min {min(rises):+.3f}, max {max(rises):+.3f}" if len(rises) > 1 else ""
    print(f"{args.estimator}, {args.prompts} x 4 responses, {args.steps} steps, actor lr {args.actor_lr:g}: "
          f"mean rise {statistics.mean(rises):+.3f} over {len(rises)} seed(s){spread}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
