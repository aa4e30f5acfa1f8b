"""Helpers for the verl integration tests: configs, trainers, TransferQueue batches, the critic path.

Everything here drives real verl 0.9.1 objects; only the training engines (cuda/npu only) are absent,
so the critic's forward pass is replaced by a per-token value field stored with the batch.
"""

from __future__ import annotations

import os
import uuid
from typing import Any, Callable, Optional

import torch
from omegaconf import DictConfig

import verl_group_ppo

CONFIG_DIR = os.path.join(os.path.dirname(verl_group_ppo.__file__), "configs")
FAKE_VPRED_KEY = "test_vpred"
"""Per-sequence (prompt + response) values standing in for the critic model's output."""


# --------------------------------------------------------------------------------------------------
# configs and trainers


def compose_config(overrides: Optional[list[str]] = None, config_name: str = "ppo_trainer") -> DictConfig:
    """Hydra-compose verl's stock ``ppo_trainer`` (or our ``group_ppo_trainer``) with overrides."""
    from hydra import compose, initialize_config_dir, initialize_config_module

    if config_name == "ppo_trainer":
        with initialize_config_module(config_module="verl.trainer.config", version_base=None):
            return compose(config_name, overrides=overrides or [])
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name, overrides=overrides or [])


MODE_OVERRIDES = {
    "sync": [],
    "colocate_async": [],
    # what verl's separate_async constructor asserts: a standalone rollout pool, a non-naive weight sync
    # and train_batch_size == parameter_sync_step (4) * ppo_mini_batch_size
    "separate_async": ["actor_rollout_ref.rollout.nnodes=1", "actor_rollout_ref.rollout.n_gpus_per_node=1",
                       "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl", "data.train_batch_size=256",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=64"],
}


def make_trainer(overrides: Optional[list[str]] = None, mode: str = "sync"):
    """The registered v1 trainer for ``mode`` built by its real ``__init__`` (no workers: ``_setup`` needs GPUs)."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    config = compose_config(["algorithm.adv_estimator=group_ppo", f"trainer.v1.trainer_mode={mode}",
                             *MODE_OVERRIDES[mode], *(overrides or [])])
    return get_trainer_cls(mode)(config)


# --------------------------------------------------------------------------------------------------
# batches


def make_samples(n_prompts: int = 3, n_per_prompt: int = 2, max_response: int = 12, seed: int = 0,
                 holes: bool = True, with_padding_row: bool = True) -> list[dict[str, Any]]:
    """Per-response dicts as verl's agent loop stores them, plus the fields later steps add.

    Responses have different lengths; some have holes (tool-observation tokens) in ``response_mask``;
    the last one (``with_padding_row``) has no valid token, like verl's padding rows.
    """
    g = torch.Generator().manual_seed(seed)
    samples = []
    n = n_prompts * n_per_prompt
    for i in range(n):
        uid = f"uid{i // n_per_prompt}"
        prompt_len = 2 + i % 3
        response_len = max_response - (i * 5) % (max_response // 2)
        mask = torch.ones(response_len, dtype=torch.int64)
        if holes and i % 2 == 1 and response_len > 6:
            mask[2:4] = 0
        if with_padding_row and i == n - 1:
            mask[:] = 0
        scores = torch.zeros(response_len)
        valid = mask.nonzero().flatten()
        if len(valid):
            scores[valid[-1]] = float(torch.randint(0, 2, (1,), generator=g))
        old = -torch.rand(response_len, generator=g)
        samples.append({
            "uid": uid,
            "prompts": torch.randint(1, 100, (prompt_len,), generator=g),
            "responses": torch.randint(1, 100, (response_len,), generator=g),
            "response_mask": mask,
            "loss_mask": mask.clone(),
            "rm_scores": scores,
            "values": torch.randn(response_len, generator=g),
            "old_log_probs": old,
            "ref_log_prob": old - 0.1 * torch.rand(response_len, generator=g),
            "rollout_log_probs": old + torch.where(torch.rand(response_len, generator=g) < 0.2, -1.5, 0.0),
            FAKE_VPRED_KEY: torch.randn(prompt_len + response_len, generator=g),
        })
    return samples


def put_samples(samples: list[dict[str, Any]], partition_id: str = "train"):
    """Store the samples in TransferQueue under fresh keys (``{uid}_{session}_{index}``); returns the metadata."""
    import transfer_queue as tq
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    run = uuid.uuid4().hex[:8]
    keys = [f"{s['uid']}-{run}_{i}_0" for i, s in enumerate(samples)]
    fields = list_of_dict_to_tensordict(samples)
    assert fields["response_mask"].is_nested, "test batches need responses of different lengths"
    tags = [{"status": "success", "global_steps": 1, "min_global_steps": 0, "max_global_steps": 0}
            for _ in samples]
    return tq.kv_batch_put(keys=keys, partition_id=partition_id, fields=fields, tags=tags)


def get_padded(meta, fields: list[str]) -> dict[str, torch.Tensor]:
    """Stored fields for the batch's keys, right-padded to (B, T_max) as verl's advantage step sees them."""
    import transfer_queue as tq

    data = tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=fields)
    padded = data.to_padded_tensor()
    return {name: padded[name] for name in fields}


# --------------------------------------------------------------------------------------------------
# the critic's path: metadata -> dispatch -> worker TensorDict -> mini-batches -> micro-batches -> loss


def critic_losses_through_verl(meta, loss_fn: Callable, dp_size: int, mini_batch_size: int,
                               micro_batch_size: int) -> tuple[list[float], list[dict]]:
    """Run ``loss_fn`` on the critic micro-batches verl would build from ``meta``.

    Uses verl's dispatch chunking (``BatchData(meta).chunk``), its TransferQueue bridge (``tqbridge``),
    its mini-batch iterator (``make_iterator``) and ``prepare_micro_batches``, and counts
    ``batch_num_tokens`` from ``loss_mask`` over all dp ranks as verl's engines do. Returns, per global
    mini-batch, the loss whose gradient the engines apply (micro-batch losses summed per rank, averaged
    over ranks), and every micro-batch's metrics.
    """
    from verl.protocol import BatchData
    from verl.utils import tensordict_utils as tu
    from verl.utils.transferqueue_utils import tqbridge
    from verl.workers.engine.utils import prepare_micro_batches

    @tqbridge()
    def receive(data):
        return [data]  # a list, so the bridge does not write it back

    rank_data = [receive(chunk)[0] for chunk in BatchData(meta).chunk(dp_size)]
    per_rank = mini_batch_size // dp_size
    rank_minis = [list(tu.make_iterator(td, mini_batch_size=per_rank, epochs=1, seed=42 + rank,
                                        dataloader_kwargs={"shuffle": False}))
                  for rank, td in enumerate(rank_data)]
    losses, metrics = [], []
    for minis in zip(*rank_minis):
        batch_num_tokens = int(sum(int(m["loss_mask"].values().sum()) for m in minis))
        rank_losses = []
        for mini in minis:
            tu.assign_non_tensor(mini, batch_num_tokens=batch_num_tokens, dp_size=dp_size,
                                 global_batch_size=mini_batch_size, use_dynamic_bsz=False,
                                 micro_batch_size_per_gpu=micro_batch_size)
            micro_batches, _ = prepare_micro_batches(mini)
            total = 0.0
            for micro in micro_batches:
                loss, micro_metrics = loss_fn(model_output={"values": micro[FAKE_VPRED_KEY]}, data=micro, dp_group=None)
                total += float(loss)
                metrics.append(micro_metrics)
            rank_losses.append(total)
        losses.append(sum(rank_losses) / dp_size)
    return losses, metrics
