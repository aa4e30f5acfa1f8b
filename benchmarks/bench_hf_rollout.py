"""The CPU backend's ``hf`` rollout server vs one batched Hugging Face ``generate``, same model, same run.

    .venv/bin/python benchmarks/bench_hf_rollout.py                   # 256 responses, 3 rounds
    .venv/bin/python benchmarks/bench_hf_rollout.py --responses 64 --rounds 5 --layers 2

On a small random Qwen2 causal LM, per round, alternating which goes first: ``--responses`` ``generate`` calls
sent at once to the rollout server, a Ray actor as the ``hf`` replica starts it (one call per response, as
verl's agent loop sends them), against the same prompts as one left-padded ``model.generate`` batch in this
process, log-probs of the sampled tokens included. Both sample exactly ``--response-length`` tokens per
response (EOS ignored), one torch thread each. Prints the median times, the ratio rollout / baseline (target:
at most 2) and the batch sizes the server formed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import torch
from benchlib import random_prompts, timed


def build_model(directory: str, hidden: int, layers: int, vocab: int, seed: int) -> Any:
    """Save a random Qwen2 causal LM (float32) to ``directory`` and return it."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    model.save_pretrained(directory)
    return model


SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}


def time_rollout(server: Any, prompts: list[list[int]]) -> float:
    """Seconds until every prompt's response is back from ``generate`` calls sent at once (served concurrently)."""
    import ray

    outputs, elapsed = timed(lambda: ray.get([server.generate.remote(request_id=str(i), prompt_ids=p,
                                                                      sampling_params=dict(SAMPLING))
                                              for i, p in enumerate(prompts)]))
    assert all(out.log_probs is not None and len(out.log_probs) == len(out.token_ids) for out in outputs)
    return elapsed


def time_hf_generate(model: Any, prompts: list[list[int]], response_length: int) -> float:
    """Seconds for one left-padded batched ``generate`` of ``prompts``, log-probs of sampled tokens included."""
    from verl_group_ppo.rollout.generation import left_pad

    input_ids, attention_mask = left_pad(prompts, pad_id=0)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=attention_mask, do_sample=True, temperature=1.0, top_p=1.0,
                             top_k=0, max_new_tokens=response_length, min_new_tokens=response_length,
                             eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        logprobs = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
    elapsed = time.perf_counter() - start
    assert logprobs.shape == (len(prompts), response_length)
    return elapsed


def start_server(model_dir: str, args: argparse.Namespace) -> Any:
    """The rollout server as a Ray actor (as the ``hf`` replica starts it), its model loaded."""
    import ray
    from omegaconf import OmegaConf

    from verl_group_ppo.rollout.server import HFRolloutServer

    config = OmegaConf.create({"prompt_length": args.max_prompt_len, "response_length": args.response_length,
                               "seed": 0, "max_num_seqs": max(256, args.responses), "ignore_eos": True})
    model_config = OmegaConf.create({"path": model_dir, "override_config": {"attn_implementation": "sdpa"}})
    server = ray.remote(HFRolloutServer).options(num_cpus=0, max_concurrency=1000).remote(
        config=config, model_config=model_config)
    ray.get(server.stats.remote())
    return server


def run_rounds(server: Any, model: Any, prompts: list[list[int]], args: argparse.Namespace) -> dict[str, list]:
    """Alternate rollout-first and baseline-first rounds after one warm-up of each (on 8 prompts)."""
    calls = {"rollout": lambda some: time_rollout(server, some),
             "baseline": lambda some: time_hf_generate(model, some, args.response_length)}
    for call in calls.values():
        call(prompts[:8])
    times: dict[str, list] = {name: [] for name in calls}
    for round_index in range(args.rounds):
        for name in (list(calls) if round_index % 2 == 0 else list(calls)[::-1]):
            times[name].append(calls[name](prompts))
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--responses", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--response-length", type=int, default=32)
    parser.add_argument("--min-prompt-len", type=int, default=16)
    parser.add_argument("--max-prompt-len", type=int, default=48)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=259)
    args = parser.parse_args()

    import ray

    torch.set_num_threads(1)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}})
    with tempfile.TemporaryDirectory() as model_dir:
        model = build_model(model_dir, args.hidden, args.layers, args.vocab, seed=0)
        prompts = random_prompts(args.responses, 2, args.vocab, args.min_prompt_len, args.max_prompt_len, seed=1)
        server = start_server(model_dir, args)
        times = run_rounds(server, model, prompts, args)
        batches = ray.get(server.stats.remote())["batch_sizes"]
    ray.shutdown()
    rollout, baseline = statistics.median(times["rollout"]), statistics.median(times["baseline"])
    print(f"model: Qwen2 hidden={args.hidden} layers={args.layers} vocab={args.vocab}; {args.responses} responses x "
          f"{args.response_length} tokens, prompts {args.min_prompt_len}-{args.max_prompt_len} tokens; "
          f"{args.rounds} rounds, one torch thread per side, cpu count {os.cpu_count()}")
    print(f"rollout server (concurrent requests): median {rollout:.3f} s  {[round(t, 3) for t in times['rollout']]}")
    print(f"one batched HF generate:              median {baseline:.3f} s  {[round(t, 3) for t in times['baseline']]}")
    print(f"ratio rollout / generate: {rollout / baseline:.2f}  (target <= 2)")
    print(f"server batch sizes (warm-up first): {batches}")


if __name__ == "__main__":
    main()
