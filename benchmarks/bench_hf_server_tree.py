"""What the ``hf`` rollout's server spends on a prompt's replies sampled as a tree against independent ones, and what
its prefix cache (``actor_rollout_ref.rollout.enable_prefix_caching``) saves, with no trainer and no Ray around it.

    python benchmarks/bench_hf_server_tree.py --work-dir runs/cpu-tiny --repeats 9 \
        --json benchmarks/results/tree/cpu_hf_server.json

The tiny task's model and its first ``--prompts`` training prompts (rendered with the model's chat template, as
verl's agent loop does), served by one :class:`~verl_group_ppo.rollout.server.HFRolloutServer` in this process.
Each arm sends every prompt's ``n`` replies as the agent loop would: ``independent`` all at once; ``tree`` and
``tree_prefix_ready`` through the tree's own coordinator
(:func:`~verl_group_ppo.tree.coordinator.sample_in_tree`, ``branch_start`` ``parent_done`` and ``prefix_ready``),
each branch sent when its parent's prefix is there. Every arm runs with the prefix cache off and on; the cache is
emptied before each arm (a run's weight sync empties it every step). The arms run in turn, ``--repeats`` times
(the order rotating), and each ratio is taken against the independent arm of the same repeat and cache setting;
the table gives the medians.

Per arm: the seconds from the first request to the last reply, the model's forward passes (prefills and decoding
steps), the prompt tokens the prefills ran, and the cache's hits. This is the server's share of a step only: in a
``main_ppo`` step verl's agent loop around it (Ray calls, the transfer queue, the reward) costs several times more,
the same for a tree's row as for an independent one (``benchmarks/bench_tree_rollout.py`` times whole steps).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any, Optional

import torch

from benchlib import REPO, portable, write_json
from compare import code_version

ARMS = ("independent", "tree", "tree_prefix_ready")
"""The ways a prompt's replies are sent (module docstring)."""


class CountingModel(torch.nn.Module):
    """A causal LM around ``model`` that counts its forward passes and the tokens each ran."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model, self.generation_config, self.config = model, model.generation_config, model.config
        self.counts = {"prefills": 0, "prefill_tokens": 0, "decoding_steps": 0}

    def forward(self, **kwargs: Any) -> Any:
        if kwargs.get("past_key_values") is None:
            self.counts["prefills"] += 1
            self.counts["prefill_tokens"] += int(kwargs["attention_mask"].sum())
        else:
            self.counts["decoding_steps"] += 1
        return self.model(**kwargs)


def load_task(work_dir: Path, prompts: int) -> tuple[Any, list[list[int]], dict[str, Any]]:
    """(the tiny model, the first ``prompts`` training prompts as token ids, the task's prepare settings)."""
    import pandas as pd
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_group_ppo.tasks.maths.evaluation import prompt_ids

    model_dir, data = work_dir / "model", work_dir / "data" / "train.parquet"
    if not model_dir.is_dir() or not data.is_file():
        raise SystemExit(f"--work-dir: {work_dir} has no prepared tiny task (model/ and data/train.parquet); "
                         f"run `bash examples/cpu/run_tiny_group_ppo.sh` or the launcher's prepare step first")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    frame = pd.read_parquet(data).head(prompts)
    ids = [prompt_ids(tokenizer, list(messages)) for messages in frame["prompt"]]
    settings = json.loads((work_dir / "data" / "prepare.json").read_text())["settings"]
    return AutoModelForCausalLM.from_pretrained(model_dir).eval(), ids, settings


async def send(server: Any, arm: str, prompts: list[list[int]], n: int, response_length: int,
               stop_ids: frozenset[int]) -> None:
    """Every prompt's ``n`` replies, sent to ``server`` as arm ``arm`` sends them."""
    from verl_group_ppo.tree.assemble import Reply
    from verl_group_ppo.tree.coordinator import Tree, sample_in_tree
    from verl_group_ppo.tree.shape import TreeShape, tree_plan

    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1}
    if arm == "independent":
        await asyncio.gather(*(server.generate(f"{i}-{j}", p, dict(params)) for i, p in enumerate(prompts)
                               for j in range(n)))
        return
    shape = TreeShape(branch_start="prefix_ready" if arm == "tree_prefix_ready" else "parent_done")
    if shape.size != n:
        raise SystemExit(f"--n: the default tree shape holds {shape.size} replies per prompt, not {n}")

    async def generate(ids: list[int], max_tokens: Optional[int]) -> Reply:
        out = await server.generate("t", ids, {**params, **({} if max_tokens is None else {"max_tokens": max_tokens})})
        return Reply(ids=list(out.token_ids), mask=[1] * len(out.token_ids), log_probs=None)

    async def one_tree(prompt: list[int]) -> None:
        tree = Tree()
        await asyncio.gather(*(sample_in_tree(tree, plan, shape, prompt, generate, response_length, stop_ids=stop_ids)
                               for plan in tree_plan(shape, n)))

    await asyncio.gather(*(one_tree(p) for p in prompts))


async def run_arm(server: Any, model: CountingModel, arm: str, prompts: list[list[int]], n: int,
                  response_length: int, stop_ids: frozenset[int]) -> dict[str, Any]:
    """One arm's seconds, forward passes and cache hits (the cache emptied first)."""
    cache = server.prefix_cache
    if cache is not None:
        cache.clear()
    hits_before = cache.hits if cache is not None else 0
    model.counts = dict.fromkeys(model.counts, 0)
    start = time.perf_counter()
    await send(server, arm, prompts, n, response_length, stop_ids)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, **model.counts, "cache_hits": (cache.hits - hits_before) if cache is not None else 0}


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (cache, arm): medians over the repeats of its seconds, its ratio to the same repeat's independent arm
    with the same cache setting, and its counts. ``records`` carry ``cache``, ``arm``, ``repeat`` and the arm's
    figures."""
    base = {(r["cache"], r["repeat"]): r["seconds"] for r in records if r["arm"] == "independent"}
    rows = []
    for cache in sorted({r["cache"] for r in records}):
        for arm in ARMS:
            mine = [r for r in records if r["cache"] == cache and r["arm"] == arm]
            if not mine:
                continue
            rows.append({"cache": cache, "arm": arm, "repeats": len(mine),
                         "seconds": median(r["seconds"] for r in mine),
                         "ratio": median(r["seconds"] / base[(cache, r["repeat"])] for r in mine),
                         **{k: median(r[k] for r in mine) for k in ("prefills", "prefill_tokens", "decoding_steps",
                                                                     "cache_hits")}})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of :func:`summarize`'s rows."""
    lines = ["| prefix cache | arm | s (median) | / independent | prefills | prefill tokens | decoding steps | "
             "cache hits |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['cache']} | {r['arm']} | {r['seconds']:.3f} | {r['ratio']:.2f} | {r['prefills']:.0f} | "
                     f"{r['prefill_tokens']:.0f} | {r['decoding_steps']:.0f} | {r['cache_hits']:.0f} |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work-dir", type=Path, default=REPO / "runs/cpu-tiny", help="prepared tiny task")
    parser.add_argument("--prompts", type=int, default=32, help="prompts per arm (the launcher's batch)")
    parser.add_argument("--n", type=int, default=8, help="replies per prompt (the default tree shape holds 8)")
    parser.add_argument("--repeats", type=int, default=5, help="times every arm runs (medians reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a run's rollout server uses one)")
    parser.add_argument("--json", type=Path, help="write the record here")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.n < 2 or args.repeats < 1:
        raise SystemExit("--prompts and --repeats must be >= 1 and --n 2 or more")
    torch.set_num_threads(args.threads)
    from verl_group_ppo.rollout.server import HFRolloutServer

    model, prompts, settings = load_task(args.work_dir, args.prompts)
    counting = CountingModel(model)
    response_length = int(settings["response_length"])
    stop_ids = frozenset({int(model.config.eos_token_id)})
    servers = {cache: HFRolloutServer({"prompt_length": max(len(p) for p in prompts), "seed": 0,
                                       "response_length": response_length, "enable_prefix_caching": cache == "on"},
                                      None, model=counting) for cache in ("off", "on")}
    plan = [(cache, arm) for cache in ("off", "on") for arm in ARMS]

    async def every_arm() -> list[dict[str, Any]]:  # one event loop: the servers' queues and locks live on it
        records = []
        for repeat in range(args.repeats):
            for cache, arm in plan[repeat % len(plan):] + plan[:repeat % len(plan)]:
                record = {"cache": cache, "arm": arm, "repeat": repeat,
                          **await run_arm(servers[cache], counting, arm, prompts, args.n, response_length, stop_ids)}
                records.append(record)
                print(f"[repeat {repeat + 1}/{args.repeats}] cache {cache} {arm}: {record['seconds']:.3f} s, "
                      f"{record['decoding_steps']} steps, {record['prefills']} prefills, "
                      f"{record['cache_hits']} hits", flush=True)
        return records

    records = asyncio.run(every_arm())
    rows = summarize(records)
    print(table(rows))
    if args.json:
        write_json(args.json, {"command": " ".join(["python benchmarks/bench_hf_server_tree.py", *map(portable, argv)]),
                               "code": code_version(), "prompts": args.prompts, "n": args.n,
                               "response_length": response_length, "threads": args.threads, "rows": rows,
                               "records": records})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
