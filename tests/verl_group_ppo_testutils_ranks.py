"""Run verl's own critic / actor update (``TrainingWorker.train_mini_batch``: verl's FSDP engine, its
micro-batching and its gradient all-reduce) on fixed batches in N processes (gloo, CPU backend), and
return the updated parameters, to compare data-parallel sizes.

Each rank is a fresh interpreter running this file: ``RANK``/``WORLD_SIZE``/``MASTER_*`` as Ray would set
them, ``VERL_PLATFORM=cpu``, then, for each case in turn, verl's ``TrainingWorker`` built from the
``TrainingWorkerConfig`` the v1 trainer builds, fed its dp shard as verl's dispatch splits it
(``chunk_tensordict``). All cases share one process group per world size (verl initialises it once), so the
interpreters start once for every case.

Imported by its unique module name (see conftest.py), never as ``tests.<name>``.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from typing import Any

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_updates(specs: dict[str, dict[str, Any]], world_sizes: tuple[int, ...] = (1, 2),
                timeout: float = 900) -> dict[str, list[dict]]:
    """Run one ``train_mini_batch`` of every case in ``specs`` at each of ``world_sizes`` ranks (the world sizes
    at once, the cases one after another); return, per case, each world size's rank-0 result.

    ``specs`` maps a case name to ``worker_config`` (verl's TrainingWorkerConfig), ``loss_fn``, ``batch`` (the
    global TensorDict) and ``extra`` (the non-tensor fields the trainer adds: mini_batch_size,
    global_batch_size...). A result holds ``before`` and ``after`` (full state dicts) and ``metrics``.
    """
    if not specs:
        raise ValueError("specs: no case to run")
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = os.path.join(tmp, "specs.pt")
        torch.save(specs, spec_path)
        runs = [(world, os.path.join(tmp, f"out{world}.pt"), _launch(spec_path, os.path.join(tmp, f"out{world}.pt"),
                                                                      world))
                for world in world_sizes]
        for world, _, procs in runs:
            for rank, proc in enumerate(procs):
                log = proc.communicate(timeout=timeout)[0]
                assert proc.returncode == 0, f"world {world} rank {rank} failed (rc={proc.returncode}):\n{log[-5000:]}"
        outputs = [torch.load(out, weights_only=False) for _, out, _ in runs]
        return {name: [output[name] for output in outputs] for name in specs}


def _launch(spec_path: str, out_path: str, world_size: int) -> list[subprocess.Popen]:
    """Start ``world_size`` rank processes of this file, with the environment Ray gives verl's workers."""
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_ENGINE_DEVICE",)}
    env.update(VERL_PLATFORM="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join([REPO_ROOT] + [p for p in [env.get("PYTHONPATH")] if p]))
    return [subprocess.Popen([sys.executable, os.path.abspath(__file__), spec_path, out_path],
                             env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, cwd=REPO_ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for r in range(world_size)]


def _full_state_dict(module: Any) -> dict[str, torch.Tensor]:
    """The full (unsharded) fp32 state dict of an FSDP1 or FSDP2 module, on CPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: v.detach().float().clone() for k, v in get_model_state_dict(module, options=options).items()}


def _train_one(spec: dict[str, Any]) -> dict[str, Any]:
    """One case on this rank: build verl's TrainingWorker, train one call of ``train_mini_batch`` on this rank's
    shard; return the full parameters before and after, and the metrics."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import TrainingWorker

    worker = TrainingWorker(spec["worker_config"])
    worker.reset()
    worker.set_loss_fn(spec["loss_fn"])
    before = _full_state_dict(worker.engine.module)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    shard = tu.chunk_tensordict(spec["batch"], world)[rank]
    tu.assign_non_tensor(shard, **spec["extra"])
    output = worker.train_mini_batch(shard)
    after = _full_state_dict(worker.engine.module)
    metrics = tu.get(output, "metrics") if output is not None else {}
    return {"before": before, "after": after, "metrics": metrics}


def _rank_main(spec_path: str, out_path: str) -> None:
    """One rank: every case of the specs file in turn; rank 0 saves the results by case name."""
    import verl_group_ppo.cpu as cpu_backend

    cpu_backend.install_if_requested()
    specs = torch.load(spec_path, weights_only=False)
    results = {}
    for name, spec in specs.items():
        results[name] = _train_one(spec)
        print(f"[rank {os.environ['RANK']}/{os.environ['WORLD_SIZE']}] {name}: done", flush=True)
    if torch.distributed.get_rank() == 0:
        torch.save(results, out_path)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    _rank_main(sys.argv[1], sys.argv[2])
