"""Time verl's GAE, verl's GRPO and GROUP-PPO on the same inputs, in the same run.

    .venv/bin/python benchmarks/bench_estimators.py                 # CPU, and CUDA too when available
    .venv/bin/python benchmarks/bench_estimators.py --device cpu    # CPU only
    .venv/bin/python benchmarks/bench_estimators.py --shapes 64x512 --repeats 3

Estimators run round-robin inside every repeat, so machine noise hits them alike; the table gives the median
wall and process CPU time per call, the ratio to verl's GAE, and the peak memory a call needs beyond its inputs
and outputs (in a fresh subprocess per estimator: on CPU the resident-set high-water mark, reset right before
the call, glibc's mmap threshold fixed so every large buffer shows; on CUDA torch's peak allocation). Inputs:
fp32 rewards (a 0/1 outcome at each response's last token), values ~ N(0, 1), response lengths uniform in
[T/4, T], 8 responses per prompt.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from benchlib import time_round_robin, write_json

#: ``segment_scan`` is step 4 of the pass alone (the TD residuals and the groups made once, outside the timing)
ESTIMATORS = ("gae", "grpo", "group_ppo", "group_ppo_outputs", "segment_scan")


def make_inputs(batch: int, length: int, device: str, seed: int = 0) -> dict:
    """Rewards, values, mask and prompt ids shaped like a verl batch."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 4, length + 1, (batch,), generator=g)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).float()
    rewards = torch.zeros(batch, length)
    rewards[torch.arange(batch), lengths - 1] = (torch.rand(batch, generator=g) < 0.5).float()
    values = torch.randn(batch, length, generator=g)
    index = np.array([f"prompt-{i // 8}" for i in range(batch)], dtype=object)
    return {"rewards": rewards.to(device), "values": values.to(device), "mask": mask.to(device), "index": index}


def estimator_fn(name: str, x: dict) -> Callable[[], object]:
    """A zero-argument call of one estimator on the inputs ``x``."""
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return, compute_grpo_outcome_advantage

    from verl_group_ppo.config import read_algorithm_settings
    from verl_group_ppo.core_algos import compute_group_advantage, compute_group_ppo_outputs

    config = {"gamma": 1.0, "lam": 0.95, "group_params": {"adaptive_threshold": False}}
    settings = read_algorithm_settings(config)
    calls = {
        "gae": lambda: compute_gae_advantage_return(x["rewards"], x["values"], x["mask"], 1.0, 0.95),
        "grpo": lambda: compute_grpo_outcome_advantage(x["rewards"], x["mask"], x["index"]),
        "group_ppo": lambda: compute_group_advantage(x["rewards"], x["mask"], values=x["values"], index=x["index"],
                                                     config=config),
        "group_ppo_outputs": lambda: compute_group_ppo_outputs(x["rewards"], x["mask"], values=x["values"],
                                                               index=x["index"], settings=settings),
    }
    if name == "segment_scan":
        return _segment_scan_fn(x, settings)
    return calls[name]


def _segment_scan_fn(x: dict, settings) -> Callable[[], object]:
    """A zero-argument call of step 4's segment scan, with the advantages' lambda, on the TD residuals (step 1)
    and the group ends (step 2) of the inputs ``x``, both made here, once."""
    from verl_group_ppo.estimator import fast

    batch = fast.prepare(x["rewards"], x["mask"], x["values"], x["index"], None, settings.group)
    delta = fast.td_residuals(batch.values, batch, settings.gamma)
    ends = fast.group_ends(delta, batch, settings.group, settings.group.group_variance_threshold)
    return lambda: fast.segment_scan(delta, ends, batch.invalid, settings.gamma, settings.policy_lam)


def _rss_kib(field: str) -> int:
    """A memory figure of this process in KiB, e.g. ``VmRSS`` (/proc/self/status)."""
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE).group(1))


def peak_extra_bytes(name: str, batch: int, length: int, device: str) -> int:
    """Peak bytes a call allocates beyond its inputs and outputs (run inside a fresh subprocess)."""
    x = make_inputs(batch, length, device)
    fn = estimator_fn(name, x)
    fn()  # warm-up on the same shapes, then measure a second call
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed warm-up memory back, so reuse cannot hide
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the resident-set high-water mark (VmHWM)
        base = _rss_kib("VmRSS")
        out = fn()
        peak = (_rss_kib("VmHWM") - base) * 1024
    if isinstance(out, torch.Tensor):
        out = (out,)
    outputs = out if isinstance(out, tuple) else vars(out).values()
    out_bytes = sum(t.numel() * t.element_size() for t in outputs if isinstance(t, torch.Tensor))
    return max(0, peak - out_bytes)


def measure_memory(name: str, batch: int, length: int, device: str) -> int | None:
    cmd = [sys.executable, __file__, "--_memory-child", name, f"{batch}x{length}", "--device", device]
    # A fixed mmap threshold: every large buffer is mapped on allocation and unmapped on free, so the
    # resident-set high-water mark counts each one (glibc's adaptive threshold would recycle them unseen).
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=900, env=env)
        return int(res.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as err:
        print(f"  memory measurement for {name} failed: {err}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="256x1024,1024x4096", help="comma-separated BxT shapes")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (cpu, then cuda when available)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per estimator and shape")
    p.add_argument("--estimators", default=",".join(ESTIMATORS), help=f"subset of {','.join(ESTIMATORS)}")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--json", default="", help="also write the results to this JSON file")
    p.add_argument("--_memory-child", nargs=2, metavar=("NAME", "SHAPE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args._memory_child:
        name, shape = args._memory_child
        b, t = (int(v) for v in shape.split("x"))
        print(peak_extra_bytes(name, b, t, args.device))
        return 0
    if args.device == "auto":
        devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    elif args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda asked for, but torch.cuda.is_available() is False")
    else:
        devices = [args.device]
    names = [n.strip() for n in args.estimators.split(",") if n.strip()]
    if unknown := [n for n in names if n not in ESTIMATORS]:
        p.error(f"--estimators: unknown estimator {unknown[0]!r}; choose from {ESTIMATORS}")

    print(f"devices={devices} torch={torch.__version__} threads={torch.get_num_threads()} "
          f"cpus={os.cpu_count()} repeats={args.repeats}")
    results = []
    for device in devices:
        for shape in args.shapes.split(","):
            b, t = (int(v) for v in shape.strip().split("x"))
            results += _measure_shape(b, t, device, args, names)

    header = (f"{'device':<6} {'B':>5} {'T':>5}  {'estimator':<18} {'median s':>9} {'cpu s':>8} {'/ GAE':>7} "
              f"{'extra MiB':>10} {'x BxTx4':>8}")
    print(f"{header}\n{'-' * len(header)}")
    for r in results:
        ratio = "" if r["ratio_to_gae"] is None else f"{r['ratio_to_gae']:.3f}"
        mem = "" if r["peak_extra_bytes"] is None else f"{r['peak_extra_bytes'] / 2**20:.1f}"
        units = "" if r["peak_extra_in_BxTx4"] is None else f"{r['peak_extra_in_BxTx4']:.2f}"
        print(f"{r['device']:<6} {r['B']:>5} {r['T']:>5}  {r['estimator']:<18} {r['wall_s']:>9.4f} {r['cpu_s']:>8.4f} "
              f"{ratio:>7} {mem:>10} {units:>8}")
    if args.json:
        write_json(args.json, results)
    return 0


def _measure_shape(b: int, t: int, device: str, args: argparse.Namespace, names: list[str]) -> list[dict]:
    """Timings (median wall and CPU seconds a call, round-robin after one warm-up call) and peak memory
    (subprocesses) of every estimator at one shape."""
    x = make_inputs(b, t, device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    _, times = time_round_robin({n: estimator_fn(n, x) for n in names}, args.repeats, sync, lambda r: print(
        f"  [{b}x{t}] repeat {r + 1}/{args.repeats}", file=sys.stderr, flush=True))
    unit = b * t * 4  # bytes of one fp32 (B, T) tensor
    rows = []
    for n in names:
        mem = None if args.no_memory else measure_memory(n, b, t, device)
        rows.append({"device": device, "B": b, "T": t, "estimator": n, "wall_s": times[n][0], "cpu_s": times[n][1],
                     "ratio_to_gae": times[n][0] / times["gae"][0] if "gae" in times else None,
                     "peak_extra_bytes": mem, "peak_extra_in_BxTx4": None if mem is None else mem / unit})
    return rows


if __name__ == "__main__":
    sys.exit(main())
