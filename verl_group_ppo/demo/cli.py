"""``python -m verl_group_ppo.demo``: train and compare GROUP-PPO, PPO (GAE) and GRPO on a CPU in minutes.

One process (plus optional worker processes): build the task and a character tokenizer, warm-start a tiny
Qwen2 policy with a short supervised phase (cached in the output directory and shared by every run), then
train one RL run per (estimator, seed) and write the comparison. See docs/demo.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict

DEFAULT_ESTIMATORS = ("group_ppo", "gae", "grpo")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m verl_group_ppo.demo",
        description="Train a tiny Qwen2 policy with GROUP-PPO, PPO (GAE) and GRPO on an offline arithmetic task "
                    "with an exact verifier, and compare them. CPU by default, CUDA when present.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--quick", action="store_true",
                   help="all three estimators, 1 seed, fewer steps (a few minutes on a 2-core CPU)")
    p.add_argument("--output-dir", default=None, help="where results go (default runs/demo-quick or runs/demo)")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default 150 quick, 400 full)")
    p.add_argument("--seeds", default=None,
                   help="number of seeds (e.g. 3) or a comma list (e.g. 0,1,2); default 1 quick, 3 full")
    p.add_argument("--estimators", default=",".join(DEFAULT_ESTIMATORS),
                   help="comma list from group_ppo, gae, grpo, group_ppo_all_tokens")
    p.add_argument("--all-tokens-arm", action="store_true",
                   help="add a fourth arm: group_ppo with critic_loss_on=all_tokens")
    p.add_argument("--task", default="chain_sum", help="chain_sum (reasoning-gym) or mod_chain (ours)")
    p.add_argument("--model-size", default="tiny", help="tiny, small or base (Qwen2 config sizes)")
    p.add_argument("--response-length", type=int, default=24, help="max response tokens")
    p.add_argument("--prompts-per-step", type=int, default=64)
    p.add_argument("--n-samples", type=int, default=4, help="responses per prompt")
    p.add_argument("--mini-batch-size", type=int, default=256, help="actor mini-batch (responses per update)")
    p.add_argument("--critic-mini-batch-size", type=int, default=64, help="critic mini-batch (gae and group_ppo)")
    p.add_argument("--actor-lr", type=float, default=2e-4)
    p.add_argument("--critic-lr", type=float, default=1e-3)
    p.add_argument("--lam", type=float, default=1.0, help="algorithm.lam for gae and group_ppo (verl default 1.0)")
    p.add_argument("--gamma", type=float, default=1.0)
    p.add_argument("--group-param", action="append", default=[], metavar="KEY=VALUE",
                   help="override an algorithm.group_params key for the group_ppo arms (repeatable)")
    p.add_argument("--warmstart-steps", type=int, default=2000, help="supervised warm-start steps (cached)")
    p.add_argument("--warmstart-slip-prob", type=float, default=0.25,
                   help="probability that a warm-start solution step is replaced by a near miss (a noisy reasoner "
                        "that RL has to make reliable)")
    p.add_argument("--train-size", type=int, default=20000, help="problems in the training pool")
    p.add_argument("--eval-size", type=int, default=256, help="held-out prompts")
    p.add_argument("--eval-samples", type=int, default=2, help="sampled responses per held-out prompt")
    p.add_argument("--eval-every", type=int, default=None, help="eval interval in steps (default steps/15)")
    p.add_argument("--workers", type=int, default=None,
                   help="runs trained in parallel processes (default: 2 on a CPU with >= 2 cores, 1 on CUDA)")
    p.add_argument("--threads", type=int, default=None, help="torch threads per run (default cores / workers)")
    p.add_argument("--device", default=None, help="cpu or cuda (default cuda when available)")
    p.add_argument("--no-progress", action="store_true", help="disable progress bars")
    return p


def _parse_seeds(s: str | None, quick: bool) -> list[int]:
    if s is None:
        return [0] if quick else [0, 1, 2]
    if "," in s:
        return [int(x) for x in s.split(",") if x.strip()]
    return list(range(int(s)))


def _parse_group_params(items: list[str]) -> dict:
    out = {}
    for it in items:
        if "=" not in it:
            raise SystemExit(f"--group-param expects KEY=VALUE, got {it!r}")
        k, v = it.split("=", 1)
        try:
            out[k] = json.loads(v)
        except json.JSONDecodeError:
            out[k] = v
    return out


# ---------------------------------------------------------------------------------------------------------
# worker-process plumbing

_CTX: dict = {}


def _worker_init(queue, ctx_blob: dict) -> None:
    import torch

    _CTX.clear()
    _CTX.update(ctx_blob)
    _CTX["queue"] = queue
    torch.set_num_threads(ctx_blob["threads"])


def _worker_run(estimator: str, seed: int) -> dict:
    from .rl import run_one
    from .tasks import make_task
    from .tokenizer import CharTokenizer

    c = _CTX
    q = c.get("queue")
    task = make_task(c["task"])
    tok = CharTokenizer.from_str(c["tokenizer"])
    return run_one(estimator, seed, c["cfg"], task, tok, c["train"], c["evals"], c["init_state"], c["device"],
                   on_step=(q.put if q is not None else c.get("on_step")))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch
    from tqdm.auto import tqdm

    from . import report
    from .rl import ESTIMATORS, RunConfig, evaluate
    from .tasks import make_task, split_problems
    from .tokenizer import CharTokenizer
    from .warmstart import load_or_train_warmstart

    t_start = time.time()
    quick = args.quick
    steps = args.steps if args.steps is not None else (150 if quick else 400)
    seeds = _parse_seeds(args.seeds, quick)
    estimators = [e.strip() for e in args.estimators.split(",") if e.strip()]
    if args.all_tokens_arm and "group_ppo_all_tokens" not in estimators:
        estimators.append("group_ppo_all_tokens")
    for e in estimators:
        if e not in ESTIMATORS:
            raise SystemExit(f"unknown estimator {e!r}; choose from {', '.join(ESTIMATORS)}")
    out_dir = args.output_dir or os.path.join("runs", "demo-quick" if quick else "demo")
    os.makedirs(out_dir, exist_ok=True)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cores = os.cpu_count() or 1
    jobs = [(e, s) for s in seeds for e in estimators]
    workers = args.workers if args.workers is not None else (1 if device != "cpu" else min(2, cores, len(jobs)))
    workers = max(1, min(workers, len(jobs)))
    threads = args.threads or max(1, cores // workers)
    torch.set_num_threads(threads)
    progress = not args.no_progress
    eval_every = args.eval_every or max(1, steps // 15)

    def log(msg: str) -> None:
        tqdm.write(msg) if progress else print(msg, flush=True)

    log(f"[demo] task={args.task} model={args.model_size} device={device} estimators={estimators} seeds={seeds} "
        f"steps={steps} workers={workers} threads/run={threads} -> {out_dir}")

    # task, data, tokenizer
    task = make_task(args.task)
    train, evals = split_problems(task, args.train_size, args.eval_size)
    tok = CharTokenizer.train(task.corpus() + [task.alphabet])
    with open(os.path.join(out_dir, "tokenizer.json"), "w") as f:
        f.write(tok.to_str())

    # shared warm start (cached)
    bar_factory = (lambda **kw: tqdm(**kw)) if progress else None
    policy, ws_info = load_or_train_warmstart(
        os.path.join(out_dir, "cache"), task, tok, train, args.model_size, args.warmstart_steps, 64, 2e-3, 0,
        args.response_length, device, progress_factory=bar_factory, log=log, slip_prob=args.warmstart_slip_prob)
    ws_acc = evaluate(policy, task, tok, evals, args.response_length, greedy=False, samples=args.eval_samples,
                      seed=30_000)
    ws_greedy = evaluate(policy, task, tok, evals, args.response_length, greedy=True)
    ws_how = "cached" if ws_info.get("cached") else "%.0fs" % ws_info["seconds"]
    log(f"[demo] warm start: eval accuracy {ws_acc:.3f} sampled, {ws_greedy:.3f} greedy ({ws_how})")
    init_state = {"state_dict": {k: v.detach().cpu() for k, v in policy.state_dict().items()},
                  "size": args.model_size}

    cfg = RunConfig(
        steps=steps, prompts_per_step=args.prompts_per_step, n_samples=args.n_samples,
        response_len=args.response_length, mini_batch_size=args.mini_batch_size,
        critic_mini_batch_size=args.critic_mini_batch_size, actor_lr=args.actor_lr, critic_lr=args.critic_lr, gamma=args.gamma,
        lam=args.lam, eval_every=eval_every, eval_samples=args.eval_samples,
        group_params=_parse_group_params(args.group_param),
        record_groups_at=tuple(sorted({1, max(1, steps // 2), steps})),
    )
    meta = {
        "command": "python -m verl_group_ppo.demo " + " ".join(sys.argv[1:] if argv is None else argv),
        "task": task.name, "model_size": args.model_size, "steps": steps, "seeds": seeds, "estimators": estimators,
        "prompts_per_step": cfg.prompts_per_step, "n_samples": cfg.n_samples, "eval_size": len(evals),
        "eval_samples": cfg.eval_samples, "device": device, "workers": workers, "threads": threads,
        "warmstart": {k: v for k, v in ws_info.items() if k != "path"},
        "warmstart_eval_accuracy": ws_acc, "warmstart_greedy_accuracy": ws_greedy, "run_config": asdict(cfg),
    }

    metrics_path = os.path.join(out_dir, "metrics.jsonl")
    metrics_f = open(metrics_path, "w")
    bars = {}
    if progress:
        for i, (e, s) in enumerate(jobs):
            bars[(e, s)] = tqdm(total=steps, desc=f"{e:>20s} seed {s}", position=i, leave=True)

    def on_step(rec: dict) -> None:
        rec = dict(rec)
        prog = rec.pop("progress", None)
        metrics_f.write(json.dumps(rec) + "\n")
        metrics_f.flush()
        b = bars.get((rec["estimator"], rec["seed"]))
        if b is not None and prog is not None:
            b.n = prog
            post = {"reward": f"{rec.get('reward/mean', float('nan')):.2f}"}
            if "eval/accuracy" in rec:
                b._last_eval = rec["eval/accuracy"]
            if getattr(b, "_last_eval", None) is not None:
                post["eval"] = f"{b._last_eval:.3f}"
            if "group/mean_group_size" in rec:
                post["grp"] = f"{rec['group/mean_group_size']:.1f}"
            b.set_postfix(post, refresh=False)
            b.refresh()

    ctx = {"task": args.task, "tokenizer": tok.to_str(), "train": train, "evals": evals, "init_state": init_state,
           "cfg": cfg, "device": device, "threads": threads}
    results: list[dict] = []
    if workers == 1:
        _worker_init(None, ctx)
        _CTX["on_step"] = on_step
        for e, s in jobs:
            results.append(_worker_run(e, s))
    else:
        import multiprocessing as mp
        import queue as queue_mod
        from concurrent.futures import ProcessPoolExecutor, wait, FIRST_COMPLETED

        mpctx = mp.get_context("spawn")
        q = mpctx.Queue()
        with ProcessPoolExecutor(max_workers=workers, mp_context=mpctx, initializer=_worker_init,
                                 initargs=(q, ctx)) as pool:
            pending = {pool.submit(_worker_run, e, s) for e, s in jobs}
            while pending:
                done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                while True:
                    try:
                        on_step(q.get_nowait())
                    except queue_mod.Empty:
                        break
                for f in done:
                    results.append(f.result())
            while True:
                try:
                    on_step(q.get(timeout=0.5))
                except queue_mod.Empty:
                    break
    for b in bars.values():
        b.close()
    metrics_f.close()
    results.sort(key=lambda r: (estimators.index(r["estimator"]), r["seed"]))

    meta["total_wall_time_s"] = time.time() - t_start
    report.write_results_json(os.path.join(out_dir, "results.json"), results, meta)
    text = report.write_summary_md(os.path.join(out_dir, "summary.md"), results, meta)
    report.plot_learning_curves(os.path.join(out_dir, "learning_curves.png"), results)
    samples = []
    for r in results:
        if r["estimator"].startswith("group_ppo") and r["seed"] == seeds[0]:
            for smp in r["group_samples"]:
                samples.append({**smp, "label": f"{r['estimator']} seed {r['seed']}"})
    with open(os.path.join(out_dir, "groups.json"), "w") as f:
        json.dump(samples, f)
    if samples:
        report.write_groups_html(os.path.join(out_dir, "groups.html"), samples)
        report.plot_groups_png(os.path.join(out_dir, "groups.png"),
                               [s for s in samples if s["label"].startswith("group_ppo seed")] or samples)
    log("\n" + text)
    log(f"[demo] done in {meta['total_wall_time_s'] / 60:.1f} min; outputs in {os.path.abspath(out_dir)}: "
        "summary.md, results.json, learning_curves.png, metrics.jsonl, groups.html, groups.png")
    return 0
