"""Generation speed of the CPU backend's two rollouts, ``hf`` and verl's ``vllm`` (vLLM's CPU build), in one run.

    .venv/bin/python benchmarks/bench_cpu_rollout.py                       # both parts
    .venv/bin/python benchmarks/bench_cpu_rollout.py --part tiny --steps 6
    .venv/bin/python benchmarks/bench_cpu_rollout.py --part standin --prompts 32 --tokens 64

Part ``tiny``: the main job (``examples/cpu/common.sh group_ppo``, as ``run_tiny_group_ppo.sh``) on the tiny task
in ``--work-dir`` (its prepare runs first, a no-op when up to date) for ``--steps`` steps with ``rollout.name=hf``
(fp32), then ``vllm``
in each of :data:`DTYPES` (the actor stays fp32). Per run: start-up (wall time before the first step), verl's
``timing_s/gen`` and ``timing_s/step`` for step 1 and as the mean of steps 2..N, and the largest
``|actor/ppo_kl|`` (the launcher's bypass mode makes the rollout's log-probs the old ones: the rollout-vs-actor gap).

Part ``standin``: a random model with Qwen2.5-0.5B's full shape (:func:`build_standin`) samples ``--prompts`` x
``--tokens`` tokens (EOS ignored) through the ``hf`` rollout's ``generate_batch`` in fp32 and vLLM's engine in each
of :data:`DTYPES` (own process; engine start timed apart), with the max and mean absolute gap between vLLM's
log-prob of each sampled token and the fp32 model's (teacher-forced). Prints one markdown table per part.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchlib import REPO, random_prompts, run_launcher, timed
from verl_group_ppo.tasks.tiny.spec import TINY

#: vLLM's rollout dtypes measured, short name -> verl's ``rollout.dtype`` (bfloat16: verl's default)
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def tiny_row(work_dir: Path, steps: int, backend: str, dtype: str, extra: list[str]) -> dict:
    """One launcher run with ``rollout.name=backend``: its start-up seconds and generation and step times."""
    run = run_launcher("group_ppo", steps, [f"actor_rollout_ref.rollout.name={backend}", *extra],
                       env={"WORK_DIR": str(work_dir)})
    later = [run.steps[s] for s in sorted(run.steps) if s > 1]
    return {"rollout": backend, "dtype": dtype,
            "start_up_s": run.seconds - sum(m["timing_s/step"] for m in run.steps.values()),
            "gen_step1_s": run.steps[1]["timing_s/gen"], "gen_s": statistics.mean(m["timing_s/gen"] for m in later),
            "step_s": statistics.mean(m["timing_s/step"] for m in later),
            "ppo_kl_max": max(abs(m["actor/ppo_kl"]) for m in run.steps.values())}


def bench_tiny(work_dir: Path, steps: int) -> list[dict]:
    if steps < 2:
        raise ValueError(f"--steps={steps}: at least 2 (step 1 is reported apart)")
    # the task's prepare, as the launcher calls it: a no-op when work_dir holds the task
    subprocess.run([sys.executable, "-m", TINY.prepare_module, "--output-dir", str(work_dir)], check=True)
    return [tiny_row(work_dir, steps, "hf", "fp32", [])] + [
        tiny_row(work_dir, steps, "vllm", name, [f"actor_rollout_ref.rollout.dtype={dtype}"])
        for name, dtype in DTYPES.items()]


def tiny_table(rows: list[dict]) -> str:
    hf = next(r for r in rows if r["rollout"] == "hf")
    lines = ["| rollout | dtype | start-up s | gen s, step 1 | gen s/step (2..N) | x hf | step s (2..N) | x hf | "
             "max abs ppo_kl |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rollout']} | {r['dtype']} | {r['start_up_s']:.1f} | {r['gen_step1_s']:.2f} | "
                     f"{r['gen_s']:.2f} | {r['gen_s'] / hf['gen_s']:.2f} | {r['step_s']:.2f} | "
                     f"{r['step_s'] / hf['step_s']:.2f} | {r['ppo_kl_max']:.1e} |")
    return "\n".join(lines)


def build_standin(directory: str) -> None:
    """A random float32 model with Qwen2.5-0.5B's full shape, saved to ``directory`` (no tokenizer needed)."""
    import torch
    from transformers import AutoModelForCausalLM

    from verl_group_ppo.qwen_standin import standin_config

    config = standin_config(layers=24, hidden_size=896, heads=14)
    config.intermediate_size = 4864  # Qwen2.5-0.5B's (the stand-in script's default is 2 x hidden)
    config.pad_token_id = 151643
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)


def fp32_logprobs(model, prompts: list[list[int]], responses: list[list[int]]) -> list[list[float]]:
    """The fp32 model's log-prob of each response token (teacher-forced), one sequence at a time."""
    import torch

    out = []
    with torch.no_grad():
        for prompt, response in zip(prompts, responses):
            ids = torch.tensor([prompt + response])
            logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), dim=-1)
            out.append(logp.gather(-1, torch.tensor(response)[:, None])[:, 0].tolist())
    return out


def hf_generate(directory: str, prompts: list[list[int]], tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from verl_group_ppo.rollout.generation import SamplingRequest, generate_batch

    model, load = timed(lambda: AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                                     attn_implementation="sdpa").eval())
    requests = [SamplingRequest(prompt_ids=tuple(p), max_tokens=tokens) for p in prompts]
    completions, gen = timed(lambda: generate_batch(model, requests, eos_token_ids=[], pad_token_id=151643,
                                                    generator=torch.Generator().manual_seed(0)))
    assert all(len(c.token_ids) == tokens for c in completions)
    return {"start_s": load, "gen_s": gen}


VLLM_CHILD = r'''
import json, sys, time
from vllm import LLM, SamplingParams
directory, dtype, tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
prompts = json.loads(sys.stdin.read())
start = time.perf_counter()
llm = LLM(model=directory, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True, max_model_len=256,
          max_num_seqs=len(prompts), seed=0, enable_prefix_caching=False)
engine = time.perf_counter() - start
params = SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=1.0, logprobs=0,
                        detokenize=False, seed=0)
start = time.perf_counter()
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
gen = time.perf_counter() - start
responses = [list(o.outputs[0].token_ids) for o in outs]
logprobs = [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
print("VLLMBENCH " + json.dumps({"start_s": engine, "gen_s": gen, "responses": responses, "logprobs": logprobs}))
'''


def vllm_generate(directory: str, prompts: list[list[int]], tokens: int, dtype: str) -> dict:
    from verl_group_ppo.cpu.vllm_rollout import engine_env_vars

    env = {**os.environ, **engine_env_vars(), "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, "-c", VLLM_CHILD, directory, dtype, str(tokens)], input=json.dumps(prompts),
                          env=env, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("VLLMBENCH ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM ({dtype}) failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("VLLMBENCH "):])


def bench_standin(prompts_n: int, tokens: int) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM

    prompts = random_prompts(prompts_n, 1000, 150000, 24, 48)
    with tempfile.TemporaryDirectory() as directory:
        build_standin(directory)
        rows = [{"rollout": "hf", "dtype": "fp32", **hf_generate(directory, prompts, tokens), "gap_max": 0.0,
                 "gap_mean": 0.0}]
        vllm = {name: vllm_generate(directory, prompts, tokens, dtype) for name, dtype in DTYPES.items()}
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="sdpa").eval()
        for name, result in vllm.items():
            actor = fp32_logprobs(model, prompts, result["responses"])
            gaps = [abs(a - b) for xs, ys in zip(actor, result["logprobs"]) for a, b in zip(xs, ys)]
            rows.append({"rollout": "vllm", "dtype": name, "start_s": result["start_s"], "gen_s": result["gen_s"],
                         "gap_max": max(gaps), "gap_mean": statistics.mean(gaps)})
    return rows


def standin_table(rows: list[dict], prompts: int, tokens: int) -> str:
    hf = rows[0]
    lines = [f"| rollout | dtype | start s (load / engine) | gen s ({prompts} x {tokens} tokens) | x hf | "
             "log-prob gap max | mean |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rollout']} | {r['dtype']} | {r['start_s']:.1f} | {r['gen_s']:.1f} | "
                     f"{r['gen_s'] / hf['gen_s']:.2f} | {r['gap_max']:.2g} | {r['gap_mean']:.2g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--part", choices=("tiny", "standin", "both"), default="both")
    parser.add_argument("--steps", type=int, default=6, help="tiny part: steps per run (default 6)")
    parser.add_argument("--work-dir", default=str(REPO / "runs" / "cpu-tiny"),
                        help="tiny part: the tiny task's directory (default runs/cpu-tiny)")
    parser.add_argument("--prompts", type=int, default=32, help="stand-in part: prompts (default 32)")
    parser.add_argument("--tokens", type=int, default=64, help="stand-in part: sampled tokens each (default 64)")
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.tokens < 1:
        parser.error(f"--prompts={args.prompts} and --tokens={args.tokens} must be positive")
    if args.part in ("tiny", "both"):
        rows = bench_tiny(Path(args.work_dir).resolve(), args.steps)
        print(f"\ntiny task, main job (run_tiny_group_ppo.sh settings), {args.steps} steps each:\n{tiny_table(rows)}",
              flush=True)
    if args.part in ("standin", "both"):
        rows = bench_standin(args.prompts, args.tokens)
        print(f"\nQwen2.5-0.5B-shaped stand-in:\n{standin_table(rows, args.prompts, args.tokens)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
