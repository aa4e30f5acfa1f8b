"""The critic that verl's ``main_ppo`` saved on the arith task: how much of the reward's variance it explains on
held-out replies (test questions the run never trained on), against a fresh value head on the same replies.

    python benchmarks/bench_arith_critic.py                                  # newest group_ppo checkpoint, 512 x 2
    python benchmarks/bench_arith_critic.py --questions 256 --samples 2      # the first 256 test questions
    python benchmarks/bench_arith_critic.py --estimator gae                  # the newest checkpoint of a gae run
    python benchmarks/bench_arith_critic.py --checkpoint runs/cpu-arith/checkpoints/group_ppo/global_step_16

The checkpoint is what verl 0.9.1's FSDP engine saves under ``WORK_DIR/checkpoints/<estimator>/global_step_<N>/``
(the launchers' ``trainer.default_local_dir``): ``actor/`` and ``critic/`` each hold
``model_world_size_<W>_rank_<r>.pt`` (every rank's ``torch.save`` of its sharded state dict: DTensors under the
plain Hugging Face names), optimiser and extra-state files of the same pattern, ``fsdp_config.json`` (FSDP version,
world size) and ``huggingface/`` (the model's config and tokenizer, no weights). verl's model merger
(``python -m verl.model_merger merge --backend fsdp``) turns each into a Hugging Face folder. It handles the critic
too: the critic's saved config keeps the pretrained ``LlamaForCausalLM`` architecture (verl builds the critic with
``AutoModelForTokenClassification.from_pretrained(config=...)``, which leaves ``architectures`` as it was), so the
merger builds a causal LM to save with, but it saves the state dict it merged, ``score.weight`` and ``score.bias``
included, and ``num_labels=1`` is in the config; :func:`load_critic` reads the folder as
``AutoModelForTokenClassification`` and refuses one without the value head. The merger casts every weight to
bfloat16 (the run trains in float32); both models are read back in float32.

The replies are sampled from the saved actor as the run samples them (:func:`verl_group_ppo.tasks.maths.evaluation.
sample`, the ``hf`` rollout's sampler: the row's prompt messages through the chat template, the spec's temperature,
at most the spec's reply length) and scored by the task's reward (:func:`verl_group_ppo.tasks.maths.reward.
compute_score` with the row's ``data_source``). The layout and the explained variance are
:mod:`verl_group_ppo.critic_readout`'s (:func:`~verl_group_ppo.critic_readout.lay_out`,
:func:`~verl_group_ppo.critic_readout.heldout_explained_variance`): over every reply token (verl's
``critic/vf_explained_var``) and over each reply's first token (the value of the prompt alone), against the Monte
Carlo returns (the run's gamma = lambda = 1). The baseline is the critic verl starts from: the task's model with a new
value head (seeded), on the same replies. One record per estimator and step:
benchmarks/results/arith/critic/<estimator>-step<N>.json.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import asdict
from typing import Any, Callable, Optional, Sequence

from benchlib import REPO, portable, write_json

RESULTS = os.path.join("benchmarks", "results", "arith", "critic")
TAG = "[arith critic]"
STEP_DIR = re.compile(r"global_step_(\d+)")
#: what verl's FSDP checkpoint manager writes into a role's folder that the merger needs
MERGER_INPUTS = ("fsdp_config.json", "huggingface")
SAMPLE_BATCH, CRITIC_BATCH = 32, 32


def checkpoint_step(path: str) -> Optional[int]:
    """N of a ``global_step_<N>`` folder, else None."""
    found = STEP_DIR.fullmatch(os.path.basename(os.path.normpath(path)))
    return int(found.group(1)) if found else None


def newest_checkpoint(root: str) -> str:
    """The ``global_step_<N>`` folder under ``root`` with the largest N (by number, not by name); SystemExit naming
    ``--checkpoint`` when there is none."""
    steps = sorted((step, name) for name in (os.listdir(root) if os.path.isdir(root) else ())
                   if (step := checkpoint_step(name)) is not None and os.path.isdir(os.path.join(root, name)))
    if not steps:
        raise SystemExit(f"--checkpoint: no global_step_<N> folder under {root}; train first (e.g. bash "
                         f"examples/cpu/run_arith_group_ppo.sh, which saves after its last step) or name one")
    return os.path.join(root, steps[-1][1])


def check_checkpoint(path: str) -> tuple[str, int]:
    """(estimator, step) of a verl checkpoint folder ``.../<estimator>/global_step_<N>`` holding ``actor/`` and
    ``critic/`` as verl's FSDP checkpoint manager saves them; SystemExit naming ``--checkpoint`` otherwise."""
    step = checkpoint_step(path)
    if step is None or not os.path.isdir(path):
        raise SystemExit(f"--checkpoint: {path} is not a global_step_<N> folder of a verl run"
                         + ("" if os.path.isdir(path) else " (it does not exist)"))
    for role in ("actor", "critic"):
        folder = os.path.join(path, role)
        if not os.path.isdir(folder):
            hint = " (was the run's critic enabled? group_ppo and gae train one)" if role == "critic" else ""
            raise SystemExit(f"--checkpoint: {path} has no {role}/ folder{hint}")
        missing = [name for name in MERGER_INPUTS if not os.path.exists(os.path.join(folder, name))]
        shards = [n for n in os.listdir(folder) if n.startswith("model_world_size_") and n.endswith(".pt")]
        if not shards:
            missing.append("model_world_size_*.pt")
        if missing:
            raise SystemExit(f"--checkpoint: {folder} lacks {', '.join(missing)} (an unfinished save, or not "
                             f"verl's FSDP checkpoint)")
    estimator = os.path.basename(os.path.dirname(os.path.normpath(os.path.abspath(path))))
    return estimator, step


def check_work_dir(work_dir: str) -> tuple[str, str]:
    """(model folder, test parquet) of the task directory; SystemExit naming ``--work-dir`` when one is missing."""
    model, test = os.path.join(work_dir, "model"), os.path.join(work_dir, "data", "test.parquet")
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise SystemExit(f"--work-dir: {model} holds no model (the Hugging Face model actor and critic start from); "
                         f"run bash examples/cpu/run_arith_group_ppo.sh or python -m verl_group_ppo.tasks.maths.prepare "
                         f"--output-dir {work_dir} first")
    if not os.path.isfile(test):
        raise SystemExit(f"--work-dir: {test} is missing (the test split); run python -m "
                         f"verl_group_ppo.tasks.maths.prepare --output-dir {work_dir} first")
    return model, test


def merger_command(local_dir: str, target_dir: str, python: str = sys.executable) -> list[str]:
    """verl's model merger on one role's checkpoint folder: ``python -m verl.model_merger merge --backend fsdp
    --local_dir LOCAL_DIR --target_dir TARGET_DIR``."""
    return [python, "-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir", local_dir,
            "--target_dir", target_dir]


def merge_checkpoint(local_dir: str, target_dir: str, threads: int) -> float:
    """Run verl's model merger (:func:`merger_command`) on ``local_dir`` into ``target_dir``; returns its wall
    seconds. RuntimeError with the end of its output when it fails."""
    start = time.perf_counter()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(merger_command(local_dir, target_dir), env=env, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise RuntimeError(f"verl's model merger failed on {local_dir} (exit code {proc.returncode}); its output "
                           f"ends:\n{proc.stdout[-3000:]}")
    return time.perf_counter() - start


def load_critic(path: str) -> Any:
    """The critic in a merged folder: ``AutoModelForTokenClassification`` (one label) in float32, eval mode.
    ValueError when the folder's weights lack the value head (e.g. an actor) or have the wrong number of labels."""
    import torch
    from transformers import AutoModelForTokenClassification

    critic, info = AutoModelForTokenClassification.from_pretrained(
        path, num_labels=1, dtype=torch.float32, attn_implementation="sdpa", output_loading_info=True)
    if info["missing_keys"] or info["mismatched_keys"]:
        raise ValueError(f"{path}: not a critic with one label (verl's value head); missing "
                         f"{sorted(info['missing_keys'])[:4]}, mismatched {list(info['mismatched_keys'])[:4]}")
    return critic.eval()


def fresh_critic(model_dir: str, seed: int) -> Any:
    """The critic verl starts from: the task's model with a new value head drawn after ``torch.manual_seed(seed)``,
    float32, eval mode."""
    import torch
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(seed)
    return AutoModelForTokenClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32,
                                                           attn_implementation="sdpa").eval()


def score(row: dict, reply: str) -> dict[str, float]:
    """The task's reward dict of one reply to ``row`` (verl's reward path: the row's ``data_source`` and ground
    truth)."""
    from verl_group_ppo.tasks.maths.reward import compute_score

    return compute_score(row["data_source"], reply, str(row["reward_model"]["ground_truth"]))


def sample_held_out(actor: Any, tokenizer: Any, rows: Sequence[dict], samples: int, max_tokens: int,
                    temperature: float, generator: Any, log: Callable[[str], Any] = print,
                    batch_size: int = SAMPLE_BATCH) -> tuple[Any, list[dict]]:
    """``samples`` replies to each of ``rows`` (consecutive), sampled as the run samples and scored by
    :func:`score`, ``batch_size`` a batch (the draws, so the replies, depend on it as on the generator's seed) with
    progress to ``log``: (the replies laid out by
    :func:`~verl_group_ppo.critic_readout.lay_out`, one dict per reply: module, score, answered, finished, length)."""
    from verl_group_ppo.critic_readout import lay_out
    from verl_group_ppo.tasks.maths.evaluation import sample

    items = [row for row in rows for _ in range(samples)]
    prompts, replies, info = [], [], []
    start = time.perf_counter()
    for first in range(0, len(items), batch_size):
        chunk = items[first:first + batch_size]
        done = sample(actor, tokenizer, [list(row["prompt"]) for row in chunk], max_tokens, False, generator,
                      batch_size, temperature)
        for row, (prompt, completion, text) in zip(chunk, done):
            scored = score(row, text)
            prompts.append(prompt)
            replies.append(completion.token_ids)
            info.append({"module": str(row["data_source"]).rsplit("/", 1)[-1], "score": float(scored["score"]),
                         "answered": float(scored.get("answered", 0.0)), "finished": bool(completion.stopped_at_eos),
                         "length": len(completion.token_ids)})
        log(f"{TAG} sampled {len(info)}/{len(items)} replies (reward so far "
            f"{sum(i['score'] for i in info) / len(info):.3f}) in {time.perf_counter() - start:.0f} s")
    return lay_out(prompts, replies, [i["score"] for i in info], int(tokenizer.pad_token_id)), info


def reply_stats(info: Sequence[dict]) -> dict[str, Any]:
    """The held-out replies' reward mean and (population) variance, answered and finished rates, mean length, and
    the reward mean per module."""
    n = len(info)
    mean = sum(i["score"] for i in info) / n
    modules: dict[str, list[float]] = defaultdict(list)
    for i in info:
        modules[i["module"]].append(i["score"])
    return {"replies": n, "reward_mean": mean, "reward_variance": sum((i["score"] - mean) ** 2 for i in info) / n,
            "answered": sum(i["answered"] for i in info) / n, "finished": sum(i["finished"] for i in info) / n,
            "mean_length": sum(i["length"] for i in info) / n,
            "per_module": {m: {"replies": len(s), "reward_mean": sum(s) / len(s)} for m, s in sorted(modules.items())}}


def measure(args: argparse.Namespace, log: Callable[[str], Any] = print) -> dict:
    """The record: held-out replies of the saved actor, and the explained variance of the saved and of a fresh
    critic on them."""
    import pandas as pd
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_group_ppo.critic_readout import heldout_explained_variance
    from verl_group_ppo.tasks.maths.spec import ARITH

    model_dir, test_path = check_work_dir(args.work_dir)
    estimator, step = check_checkpoint(args.checkpoint)
    rows = pd.read_parquet(test_path).to_dict("records")
    questions = len(rows) if args.questions is None else args.questions
    if questions > len(rows):
        raise SystemExit(f"--questions: the test split has {len(rows)} questions, asked for {questions}")
    rows = rows[:questions]
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    seconds: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="arith-critic-") as merged:
        targets = {role: os.path.join(merged, role) for role in ("actor", "critic")}
        for role, target in targets.items():
            source = os.path.join(os.path.abspath(args.checkpoint), role)
            seconds[f"merge_{role}"] = round(merge_checkpoint(source, target, args.threads), 1)
            log(f"{TAG} merged {portable(source)} with verl's model merger in {seconds[f'merge_{role}']:.0f} s")
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        actor = AutoModelForCausalLM.from_pretrained(targets["actor"], dtype=torch.float32,
                                                     attn_implementation="sdpa").eval()
        sampled = time.perf_counter()
        held, info = sample_held_out(actor, tokenizer, rows, args.samples, ARITH.response_length, ARITH.temperature,
                                     torch.Generator().manual_seed(args.seed), log)
        seconds["sampling"] = round(time.perf_counter() - sampled, 1)
        del actor
        stats = reply_stats(info)
        log(f"{TAG} {len(held)} held-out replies: reward {stats['reward_mean']:.3f} (variance "
            f"{stats['reward_variance']:.3f})")
        fits = {}
        for name, build in (("trained", lambda: load_critic(targets["critic"])),
                            ("fresh", lambda: fresh_critic(model_dir, args.seed))):
            read = time.perf_counter()
            critic = build()
            fits[name] = asdict(heldout_explained_variance(critic, held, batch_size=CRITIC_BATCH))
            del critic
            seconds[f"critic_{name}"] = round(time.perf_counter() - read, 1)
            log(f"{TAG} {name} critic: explained variance {fits[name]['all']:+.3f} every reply token, "
                f"{fits[name]['first']:+.3f} first reply token")
    seconds["total"] = round(time.perf_counter() - start, 1)
    checkpoint = os.path.abspath(args.checkpoint)
    command = " ".join(portable(a) for a in merger_command(os.path.join(checkpoint, "ROLE"), "MERGED", "python"))
    return {"task": "arith", "estimator": estimator, "step": step, "checkpoint": portable(checkpoint),
            "work_dir": portable(os.path.abspath(args.work_dir)), "merge_command": command,
            "weights": "verl's model merger saves bfloat16 weights (the run trains in float32); read in float32",
            "questions": questions, "samples": args.samples, "seed": args.seed, "sample_batch": SAMPLE_BATCH,
            "critic_batch": CRITIC_BATCH, "threads": args.threads,
            "temperature": ARITH.temperature, "response_length": ARITH.response_length, "gamma": 1.0,
            **stats, "explained_variance": fits, "seconds": seconds, "torch": torch.__version__}


def record_path(results_dir: str, estimator: str, step: int) -> str:
    """``results_dir/<estimator>-step<N>.json``."""
    return os.path.join(results_dir, f"{estimator}-step{step}.json")


def table(record: dict) -> str:
    """The record as a short table: the held-out replies, then each critic's two figures."""
    fits = record["explained_variance"]
    lines = [f"arith critic, {record['estimator']} step {record['step']}: {record['replies']} held-out replies "
             f"({record['questions']} test questions x {record['samples']}), reward mean {record['reward_mean']:.3f} "
             f"(variance {record['reward_variance']:.3f}), {record['seconds']['total']:.0f} s", "",
             "| critic | explained variance, every reply token | first reply token |", "|---|---|---|",
             f"| trained (step {record['step']}) | {fits['trained']['all']:+.3f} | {fits['trained']['first']:+.3f} |",
             f"| fresh value head (seed {record['seed']}) | {fits['fresh']['all']:+.3f} | "
             f"{fits['fresh']['first']:+.3f} |"]
    if record["reward_variance"] == 0.0:
        lines.append("(every held-out reply scored the same: the figures mean nothing)")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", default=os.path.join(REPO, "runs", "cpu-arith"),
                   help="the task's directory: model/ and data/test.parquet (default runs/cpu-arith)")
    p.add_argument("--estimator", default="group_ppo",
                   help="whose run: the default checkpoint is the newest under WORK_DIR/checkpoints/ESTIMATOR")
    p.add_argument("--checkpoint", default=None, help="a global_step_<N> folder of verl's (default: the newest "
                   "under WORK_DIR/checkpoints/ESTIMATOR)")
    p.add_argument("--questions", type=int, default=None, help="the first N test questions (default: all, 512)")
    p.add_argument("--samples", type=int, default=2, help="replies per question")
    p.add_argument("--threads", type=int, default=2, help="torch threads (and the merger's)")
    p.add_argument("--seed", type=int, default=0, help="the sampling generator's and the fresh value head's seed")
    p.add_argument("--results-dir", default=os.path.join(REPO, RESULTS), help="where the record goes")
    args = p.parse_args(argv)
    for name in ("questions", "samples", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"--{name}: must be >= 1, got {value}")
    check_work_dir(args.work_dir)
    if args.checkpoint is None:
        args.checkpoint = newest_checkpoint(os.path.join(args.work_dir, "checkpoints", args.estimator))
    estimator, step = check_checkpoint(args.checkpoint)
    record = measure(args)
    path = record_path(args.results_dir, estimator, step)
    write_json(path, record)
    print(table(record))
    print(f"{TAG} record: {portable(os.path.abspath(path))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
