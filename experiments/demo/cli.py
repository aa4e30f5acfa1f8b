"""``python -m experiments.demo``: train and compare GROUP-PPO, PPO (GAE) and GRPO on a CPU in minutes.

One process (plus optional worker processes): build the task and a character tokenizer, warm-start a tiny
Qwen2 policy with a short supervised phase (cached in the output directory and shared by every run), then
train one RL run per (arm, seed) and write the comparison. See docs/demo.md.

The flags are built from the fields of :class:`DemoOptions` (this run) and
:class:`~experiments.demo.rl.RunConfig` (every arm's hyperparameters): each default is written once,
on its field; ``--quick`` changes the few in :data:`QUICK`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

from verl_group_ppo.config import read_algorithm_settings

from .arms import ARMS, DEFAULT_ARMS, get_arm
from .options import add_arguments, given, option
from .pretrain import PretrainConfig
from .rl import RunConfig


@dataclass
class DemoOptions:
    """What to run and where: arms, seeds, task, warm start, evaluation set, parallelism, outputs."""

    quick: bool = option(False, "the default arms, 1 seed, 150 steps (a few minutes on a 2-core CPU)")
    output_dir: Optional[str] = option(None, "where results go (None: runs/demo-quick or runs/demo)", type=str)
    seeds: str = option("3", "number of seeds (e.g. 3) or a comma list (e.g. 0,1,2); --quick: 1")
    estimators: str = option(",".join(DEFAULT_ARMS), f"comma list of arms from {', '.join(ARMS)}")
    all_tokens_arm: bool = option(False, "add the arm group_ppo_all_tokens (critic_loss_on=all_tokens)")
    task: str = option("chain_sum", "chain_sum (reasoning-gym) or mod_chain (ours)")
    terms: Optional[str] = option(None, "terms per chain MIN-MAX, e.g. 10-12 (None: the task's own, 4-5 for "
                                        "chain_sum); sets the response length and the warm start's data",
                                  type=str)
    model_size: str = option("tiny", "tiny, small or base (Qwen2 config sizes)")
    warmstart_steps: Optional[int] = option(None, "supervised warm-start steps, cached (None: 2000 for 4-5 "
                                                  "terms, in proportion to the chain length beyond)", type=int)
    warmstart_slip_prob: Optional[float] = option(
        None, "probability that a warm-start solution step is replaced by a near miss, a noisy reasoner that RL "
              "has to make reliable (None: 0.25 for 4-5 terms, less for longer chains, then calibrated until the "
              "warm start samples about 0.1-0.5 correct)", type=float)
    train_size: int = option(20000, "problems in the training pool")
    final_eval_size: int = option(1024, "held-out prompts of the final eval (x eval_samples responses each); "
                                        "the periodic evals use the first eval_size of them")
    workers: Optional[int] = option(None, "runs trained in parallel processes (None: 2 on a CPU with >= 2 "
                                          "cores, 1 on CUDA)", type=int)
    threads: Optional[int] = option(None, "torch threads per run (None: cores / workers)", type=int)
    device: Optional[str] = option(None, "cpu or cuda (None: cuda when available)", type=str)
    no_progress: bool = option(False, "disable progress bars")


#: defaults that ``--quick`` changes (flags given explicitly still win)
QUICK: dict[str, Any] = {"steps": 150, "seeds": "1"}


def build_parser() -> argparse.ArgumentParser:
    """The demo's argument parser: one flag per field of DemoOptions and RunConfig, plus ``--group-param``."""
    p = argparse.ArgumentParser(
        prog="python -m experiments.demo",
        description="Train a tiny Qwen2 policy with GROUP-PPO, PPO (GAE) and GRPO on an offline arithmetic task "
                    "with an exact verifier, and compare them. CPU by default, CUDA when present.")
    add_arguments(p, DemoOptions)
    add_arguments(p, RunConfig)
    add_arguments(p, PretrainConfig)
    p.add_argument("--group-param", action="append", default=[], metavar="KEY=VALUE",
                   help="override an algorithm.group_params key (repeatable), e.g. policy_lam=0.95 "
                        "critic_lam=1.0 (read by group_ppo and gae_decoupled), target_group_size=4")
    return p


def parse_seeds(text: str) -> list[int]:
    """``"3"`` -> [0, 1, 2]; ``"0,4"`` -> [0, 4]."""
    if "," in text:
        return [int(x) for x in text.split(",") if x.strip()]
    return list(range(int(text)))


def parse_group_params(items: list[str]) -> dict:
    """``["KEY=VALUE", ...]`` -> dict, values parsed as JSON when they are JSON, else kept as strings."""
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


def resolve(args: argparse.Namespace) -> tuple[DemoOptions, RunConfig]:
    """Field defaults, then ``--quick``'s, then the flags given; the arm list checked."""
    quick = getattr(args, "quick", False)
    overrides = {**(QUICK if quick else {}), **given(args, DemoOptions), **given(args, RunConfig)}
    opt_names = {f.name for f in dataclasses.fields(DemoOptions)}
    opts = DemoOptions(**{k: v for k, v in overrides.items() if k in opt_names})
    try:
        cfg = RunConfig(**{k: v for k, v in overrides.items() if k not in opt_names},
                        group_params=parse_group_params(args.group_param))
        for name in arm_names(opts):  # unknown arms and bad group params fail here, before any training
            read_algorithm_settings(cfg.algorithm_config(get_arm(name)))
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if opts.output_dir is None:
        opts.output_dir = os.path.join("runs", "demo-quick" if quick else "demo")
    return opts, cfg


def resolve_pretrain(args: argparse.Namespace) -> PretrainConfig:
    """The value-pretraining settings: field defaults, then the flags given."""
    try:
        return PretrainConfig(**given(args, PretrainConfig))
    except ValueError as e:
        raise SystemExit(str(e)) from None


def arm_names(opts: DemoOptions) -> list[str]:
    names = [e.strip() for e in opts.estimators.split(",") if e.strip()]
    if opts.all_tokens_arm and "group_ppo_all_tokens" not in names:
        names.append("group_ppo_all_tokens")
    return names


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
    from verl_group_ppo.tasks.tiny.problems import make_task
    from verl_group_ppo.tasks.tiny.tokenizer import CharTokenizer

    from .rl import run_one

    c = _CTX
    q = c.get("queue")
    task = make_task(c["task"], c["terms"])
    tok = CharTokenizer.from_str(c["tokenizer"])
    return run_one(estimator, seed, c["cfg"], task, tok, c["train"], c["evals"], c["init_state"], c["device"],
                   on_step=(q.put if q is not None else c.get("on_step")))


def run_jobs(jobs: list[tuple[str, int]], ctx: dict, workers: int, on_step) -> list[dict]:
    """Train every (arm, seed) job, in this process or in ``workers`` spawned processes."""
    if workers == 1:
        _worker_init(None, ctx)
        _CTX["on_step"] = on_step
        return [_worker_run(e, s) for e, s in jobs]
    import multiprocessing as mp
    import queue as queue_mod
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    def drain(timeout: float) -> None:
        while True:
            try:
                on_step(q.get(timeout=timeout) if timeout else q.get_nowait())
            except queue_mod.Empty:
                return

    mpctx = mp.get_context("spawn")
    q = mpctx.Queue()
    results = []
    with ProcessPoolExecutor(max_workers=workers, mp_context=mpctx, initializer=_worker_init,
                             initargs=(q, ctx)) as pool:
        pending = {pool.submit(_worker_run, e, s) for e, s in jobs}
        while pending:
            done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            drain(0)
            results.extend(f.result() for f in done)
        drain(0.5)
    return results


class StepSink:
    """Receives every step record: appends it to metrics.jsonl and moves that run's progress bar."""

    def __init__(self, path: str, jobs: list[tuple[str, int]], steps: int, progress: bool):
        from tqdm.auto import tqdm

        self.file = open(path, "w")
        self.bars = {job: tqdm(total=steps, desc=f"{job[0]:>20s} seed {job[1]}", position=i, leave=True)
                     for i, job in enumerate(jobs)} if progress else {}
        self.last_eval: dict = {}

    def __call__(self, rec: dict) -> None:
        rec = dict(rec)
        prog = rec.pop("progress", None)
        self.file.write(json.dumps(rec) + "\n")
        self.file.flush()
        job = (rec["estimator"], rec["seed"])
        bar = self.bars.get(job)
        if bar is None or prog is None:
            return
        bar.n = prog
        if "eval/accuracy" in rec:
            self.last_eval[job] = rec["eval/accuracy"]
        post = {"reward": f"{rec.get('reward/mean', float('nan')):.2f}"}
        if job in self.last_eval:
            post["eval"] = f"{self.last_eval[job]:.3f}"
        if "group/mean_group_size" in rec:
            post["grp"] = f"{rec['group/mean_group_size']:.1f}"
        bar.set_postfix(post, refresh=False)
        bar.refresh()

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()
        self.file.close()


@dataclass
class DemoSetup:
    """What every run shares: the task, the resolved run config, tokenizer, data and the warm start.

    Attributes:
        task: the task (with ``--terms`` applied); ``terms``: (min, max) or None for the task's own.
        cfg: the RunConfig with its None defaults resolved for ``task``.
        tok: the character tokenizer; ``train``/``evals``: training pool and held-out set (no shared prompt).
        init_state: ``{"state_dict", "size"}`` of the warm-started policy (what ``run_one`` starts from), and
            ``"critic_state_dict"``, the pretrained critic every critic arm starts from, with value pretraining.
        warmstart: the warm start's info (cached or not, seconds, key...); ``warmstart_accuracy`` and
            ``warmstart_greedy_accuracy`` on the periodic-eval prompts.
    """

    task: Any
    terms: Optional[tuple[int, int]]
    cfg: RunConfig
    tok: Any
    train: list
    evals: list
    init_state: dict
    warmstart: dict
    warmstart_accuracy: float
    warmstart_greedy_accuracy: float
    critic_pretrain: dict = dataclasses.field(default_factory=dict)


def setup_demo(opts: DemoOptions, cfg: RunConfig, device: str = "cpu", log=print,
               pretrain: PretrainConfig = PretrainConfig()) -> DemoSetup:
    """Task, data split, tokenizer (also written to ``opts.output_dir``) and the shared warm start (cached
    under ``opts.output_dir/cache``), with its eval accuracies; with ``pretrain`` enabled, the pretrained
    critic (cached there too, :mod:`.pretrain`). ``opts.output_dir`` must be set."""
    from tqdm.auto import tqdm

    from verl_group_ppo.tasks.tiny.evaluation import evaluate
    from verl_group_ppo.tasks.tiny.problems import make_task, parse_terms, split_problems
    from verl_group_ppo.tasks.tiny.tokenizer import CharTokenizer
    from verl_group_ppo.tasks.tiny.warmstart import load_or_train_warmstart, mean_solution_steps

    from .pretrain import pretrained_critic_state

    terms = parse_terms(opts.terms) if opts.terms else None
    task = make_task(opts.task, terms)
    cfg = cfg.resolved(task)
    train, evals = split_problems(task, opts.train_size, max(opts.final_eval_size, cfg.eval_size))
    tok = CharTokenizer.train(task.corpus() + [task.alphabet])
    os.makedirs(opts.output_dir, exist_ok=True)
    with open(os.path.join(opts.output_dir, "tokenizer.json"), "w") as f:
        f.write(tok.to_str())
    factory = (lambda **kw: tqdm(**kw)) if not opts.no_progress else None
    periodic = evals[:cfg.eval_size]

    def warm_start(steps: int, slip_prob: float):
        policy, info = load_or_train_warmstart(
            os.path.join(opts.output_dir, "cache"), task, tok, train, opts.model_size, steps, 64, 2e-3, 0,
            cfg.response_len, device, progress_factory=factory, log=log, slip_prob=slip_prob)
        acc = evaluate(policy, task, tok, periodic, cfg.response_len, greedy=False, samples=cfg.eval_samples,
                       seed=30_000)
        log(f"[demo] warm start ({steps} steps, slip {slip_prob:.2f}): eval accuracy {acc:.3f} sampled "
            f"({'cached' if info.get('cached') else '%.0fs' % info['seconds']})")
        return policy, info, acc

    policy, ws_info, ws_acc = calibrated_warmstart(opts, mean_solution_steps(train), warm_start, log)
    ws_greedy = evaluate(policy, task, tok, periodic, cfg.response_len, greedy=True)
    log(f"[demo] warm start: eval accuracy {ws_acc:.3f} sampled, {ws_greedy:.3f} greedy")
    init_state = {"state_dict": {k: v.detach().cpu() for k, v in policy.state_dict().items()},
                  "size": opts.model_size}
    critic_state, pretrain_info = pretrained_critic_state(pretrain, os.path.join(opts.output_dir, "cache"),
                                                          ws_info["key"], policy, task, tok, train, evals, cfg, log)
    if critic_state is not None:
        init_state["critic_state_dict"] = critic_state
        pretrain_info = {"settings": dataclasses.asdict(pretrain), **pretrain_info}
    return DemoSetup(task, terms, cfg, tok, train, evals, init_state, ws_info, ws_acc, ws_greedy, pretrain_info)


def calibrated_warmstart(opts: DemoOptions, steps_per_solution: float, warm_start, log=print, tries: int = 3):
    """The warm start RL starts from, with room to learn: ``warm_start(steps, slip_prob) -> (policy, info,
    sampled accuracy)`` is called until the accuracy is in :data:`~verl_group_ppo.tasks.tiny.warmstart.ROOM`.

    Unset ``--warmstart-steps`` / ``--warmstart-slip-prob`` take the chain length's automatic values; an
    automatic slip probability is then rescaled from the measured accuracy, at most ``tries`` warm starts in
    all (each one cached). A given slip probability is used as it is. RuntimeError (naming the flags) when the
    last warm start samples under :data:`~verl_group_ppo.tasks.tiny.warmstart.MIN_SAMPLED_ACCURACY` correct.
    """
    from verl_group_ppo.tasks.tiny import warmstart as ws

    steps = opts.warmstart_steps or ws.auto_warmstart_steps(steps_per_solution)
    auto = opts.warmstart_slip_prob is None
    slip = ws.auto_slip_prob(steps_per_solution) if auto else opts.warmstart_slip_prob
    for attempt in range(tries if auto else 1):
        policy, info, acc = warm_start(steps, slip)
        if ws.in_room(acc) or not auto:
            break
        new_slip = ws.rescale_slip_prob(slip, acc, steps_per_solution)
        if new_slip == slip or attempt == tries - 1:
            break
        log(f"[demo] warm start outside {ws.ROOM[0]}-{ws.ROOM[1]} correct; calibrating: slip {new_slip:.2f}")
        slip = new_slip
    ws.check_room(acc, "--warmstart-steps (more), --warmstart-slip-prob (lower), --model-size (larger) or "
                       "--terms (shorter chains)")
    return policy, {**info, "slip_prob": slip, "calibration_tries": attempt + 1}, acc


def write_outputs(out_dir: str, results: list[dict], meta: dict, first_seed: int) -> str:
    """results.json, summary.md, learning_curves.png, groups.json/html/png; returns the summary text."""
    from . import report

    report.write_results_json(os.path.join(out_dir, "results.json"), results, meta)
    text = report.write_summary_md(os.path.join(out_dir, "summary.md"), results, meta)
    report.plot_learning_curves(os.path.join(out_dir, "learning_curves.png"), results)
    samples = [{**smp, "label": f"{r['estimator']} seed {r['seed']}"}
               for r in results if ARMS[r["estimator"]].uses_groups and r["seed"] == first_seed
               for smp in r["group_samples"]]
    with open(os.path.join(out_dir, "groups.json"), "w") as f:
        json.dump(samples, f)
    if samples:
        report.write_groups_html(os.path.join(out_dir, "groups.html"), samples)
        report.plot_groups_png(os.path.join(out_dir, "groups.png"),
                               [s for s in samples if s["label"].startswith("group_ppo seed")] or samples)
    return text


def _machine(opts: DemoOptions, n_jobs: int) -> tuple[str, int, int]:
    """(device, workers, torch threads per run)."""
    import torch

    device = opts.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cores = os.cpu_count() or 1
    workers = opts.workers if opts.workers is not None else (1 if device != "cpu" else min(2, cores, n_jobs))
    workers = max(1, min(workers, n_jobs))
    return device, workers, opts.threads or max(1, cores // workers)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    opts, cfg = resolve(args)
    pretrain = resolve_pretrain(args)
    for key, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)
    import torch
    from tqdm.auto import tqdm

    t_start = time.time()
    seeds, arms = parse_seeds(opts.seeds), arm_names(opts)
    os.makedirs(opts.output_dir, exist_ok=True)
    jobs = [(e, s) for s in seeds for e in arms]
    device, workers, threads = _machine(opts, len(jobs))
    torch.set_num_threads(threads)

    def log(msg: str) -> None:
        tqdm.write(msg) if not opts.no_progress else print(msg, flush=True)

    log(f"[demo] task={opts.task} terms={opts.terms or 'default'} model={opts.model_size} device={device} "
        f"estimators={arms} seeds={seeds} steps={cfg.steps} workers={workers} threads/run={threads} "
        f"-> {opts.output_dir}")
    prep = setup_demo(opts, cfg, device, log, pretrain)
    cfg = prep.cfg
    meta = _meta(argv, opts, prep, seeds, arms, device, workers, threads)
    sink = StepSink(os.path.join(opts.output_dir, "metrics.jsonl"), jobs, cfg.steps, not opts.no_progress)
    ctx = {"task": opts.task, "terms": prep.terms, "tokenizer": prep.tok.to_str(), "train": prep.train,
           "evals": prep.evals, "init_state": prep.init_state, "cfg": cfg, "device": device, "threads": threads}
    try:
        results = run_jobs(jobs, ctx, workers, sink)
    finally:
        sink.close()
    results.sort(key=lambda r: (arms.index(r["estimator"]), r["seed"]))
    meta["total_wall_time_s"] = time.time() - t_start
    text = write_outputs(opts.output_dir, results, meta, seeds[0])
    log("\n" + text)
    log(f"[demo] done in {meta['total_wall_time_s'] / 60:.1f} min; outputs in {os.path.abspath(opts.output_dir)}: "
        "summary.md, results.json, learning_curves.png, metrics.jsonl, groups.html, groups.png")
    return 0


def _meta(argv, opts: DemoOptions, prep: DemoSetup, seeds: list[int], arms: list[str], device: str,
          workers: int, threads: int) -> dict[str, Any]:
    cfg = prep.cfg
    return {
        "command": "python -m experiments.demo " + " ".join(sys.argv[1:] if argv is None else argv),
        "task": prep.task.name, "task_spec": prep.task.spec(), "model_size": opts.model_size,
        "steps": cfg.steps, "seeds": seeds, "estimators": arms, "prompts_per_step": cfg.prompts_per_step,
        "n_samples": cfg.n_samples, "eval_size": min(cfg.eval_size, len(prep.evals)),
        "final_eval_size": len(prep.evals), "eval_samples": cfg.eval_samples, "device": device,
        "workers": workers, "threads": threads, "critic_warmup": cfg.critic_warmup,
        "warmstart": {k: v for k, v in prep.warmstart.items() if k != "path"},
        "warmstart_eval_accuracy": prep.warmstart_accuracy,
        "warmstart_greedy_accuracy": prep.warmstart_greedy_accuracy,
        "critic_pretrain": prep.critic_pretrain,
        "options": asdict(opts), "run_config": asdict(cfg),
    }
