"""GROUP-PPO on verl's v1 trainers: one mixin over ``sync``, ``colocate_async`` and ``separate_async``.

The plugin puts these classes into verl's ``TRAINER_REGISTRY`` under verl's own mode names (the mode
string also drives behaviour inside verl, so new names are not an option). With any estimator other
than ``group_ppo`` every method below hands straight to verl's. With ``group_ppo``:

- ``_compute_advantage`` fetches the critic's values (and old log-probs for the ``low_prob`` rule)
  from TransferQueue, then runs verl's own advantage step inside :func:`~verl_group_ppo.plugin.estimator_inputs`,
  so KL-in-reward, rollout correction and the multi-trajectory handling stay verl's; the registered
  estimator reads the values from that context. It then stores the critic mask and the critic-loss
  weights next to the advantages (a second ``kv_batch_put``, whose metadata it returns so the critic's
  micro-batches carry them), updates the adaptive threshold (spec Step 6) and adds the ``group/*`` metrics.
- ``_setup`` installs the boundary critic loss (spec Step 7) after verl's setup installed verl's.
- ``_save_checkpoint`` / ``_load_checkpoint`` save and restore the threshold with verl's checkpoints.

This module is verl glue only; the algorithm is in :mod:`verl_group_ppo.core_algos`.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Optional

import torch
import transfer_queue as tq
from tensordict import TensorDict
from transfer_queue import KVBatchMeta

from verl.trainer.ppo.v1.trainer_base import PPOTrainer
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path
from verl.workers.utils.padding import response_to_nested

from verl_group_ppo.config import GroupParams, read_algorithm_settings
from verl_group_ppo.core_algos import GroupPPOOutputs, ThresholdState
from verl_group_ppo.critic_loss import CRITIC_MASK_KEY, CRITIC_WEIGHTS_KEY, make_critic_loss_fn
from verl_group_ppo.plugin import estimator_inputs, is_group_ppo, run_deferred_trainer_install

logger = logging.getLogger("verl_group_ppo")

STATE_FILE = "group_ppo_state.json"
"""GROUP-PPO's trainer state inside verl's ``global_step_N`` checkpoint folder."""


class GroupPPOTrainerMixin:
    """GROUP-PPO behaviour for a verl v1 :class:`PPOTrainer` subclass; inert for other estimators."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.group_ppo_enabled: bool = is_group_ppo(config)
        self.group_params: Optional[GroupParams] = None
        self.group_threshold: Optional[ThresholdState] = None
        if self.group_ppo_enabled:
            if not self.use_critic:
                raise RuntimeError(
                    "algorithm.adv_estimator=group_ppo but verl decided to run without a critic: verl's "
                    "need_critic was bound before the verl-group-ppo plugin installed (was the plugin imported "
                    "by hand after verl's trainer, or VERL_USE_EXTERNAL_PLUGINS set to exclude group_ppo?)")
            self.group_params = read_algorithm_settings(config.algorithm).group
            self.group_threshold = ThresholdState.from_params(self.group_params)

    # ------------------------------------------------------------------ setup

    def _setup(self) -> None:
        """verl's setup, then the GROUP-PPO critic loss in place of verl's ``value_loss``."""
        super()._setup()
        if self.group_ppo_enabled and self.use_critic:
            self._install_group_critic_loss()

    def _install_group_critic_loss(self) -> None:
        """Set the boundary critic loss on the critic worker group; ``all_tokens`` keeps the ``value_loss``
        verl's setup installed."""
        if self.group_params.critic_loss_on == "boundaries":
            self.critic_wg.set_loss_fn(make_critic_loss_fn(self.config.critic, "boundaries"))

    # ------------------------------------------------------------------ advantage step

    def _compute_advantage(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        """verl's advantage step with the critic's values reaching the ``group_ppo`` estimator."""
        if not self.group_ppo_enabled:
            return super()._compute_advantage(batch, metrics)
        values, old_log_probs, nested_mask = fetch_estimator_inputs(
            batch, with_old_log_probs=self.group_params.boundary_rule == "low_prob")
        with estimator_inputs(values, old_log_probs, threshold=self.group_threshold.value) as inputs:
            batch = super()._compute_advantage(batch, metrics)
        if inputs.outputs is None:
            raise RuntimeError(
                "verl's advantage step did not call the group_ppo estimator; this verl version routes "
                "estimators differently from what verl-group-ppo supports (see docs/verl_integration.md).")
        batch = store_critic_fields(batch, inputs.outputs, nested_mask)
        self.group_threshold.update(inputs.outputs.boundary_explained_variance, self.group_params)
        metrics.update(inputs.outputs.metrics)
        return batch

    # ------------------------------------------------------------------ checkpoints

    def _save_checkpoint(self) -> None:
        """Write the GROUP-PPO state into the step folder first, then let verl save (and write its tracker
        file last), so a checkpoint verl can resume from always holds the threshold."""
        if self.group_ppo_enabled:
            folder = os.path.join(self.config.trainer.default_local_dir, f"global_step_{self.global_steps}")
            save_group_state(folder, self.group_threshold, self.group_params, self.global_steps)
        super()._save_checkpoint()

    def _load_checkpoint(self) -> None:
        """verl's resume, then the threshold from the same checkpoint folder."""
        super()._load_checkpoint()
        if not self.group_ppo_enabled or self.global_steps == 0:
            return
        folder = resume_folder(self.config.trainer)
        if folder is None:
            return
        state = load_group_state(folder)
        if state is None:
            logger.warning(
                "verl-group-ppo: checkpoint %s has no %s (saved by another estimator?); starting from "
                "group_params.group_variance_threshold=%s", folder, STATE_FILE, self.group_threshold.value)
            return
        self.group_threshold.load_state_dict(state["threshold_state"])
        logger.info("verl-group-ppo: resumed threshold %s from %s", self.group_threshold.value, folder)


# ==================================================================================================
# TransferQueue I/O


def fetch_estimator_inputs(batch: KVBatchMeta, with_old_log_probs: bool
                           ) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """The padded ``values`` (and ``old_log_probs``) verl's advantage step will line up with, plus the
    nested ``response_mask`` used to store per-token fields back."""
    fields = ["response_mask", "values"] + (["old_log_probs"] if with_old_log_probs else [])
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
    nested_mask = data["response_mask"]
    padded = data.to_padded_tensor()
    old_log_probs = padded["old_log_probs"] if with_old_log_probs else None
    return padded["values"], old_log_probs, nested_mask


def store_critic_fields(batch: KVBatchMeta, outputs: GroupPPOOutputs, nested_mask: torch.Tensor) -> KVBatchMeta:
    """Store the critic mask and loss weights per response; return this put's metadata (it lists every
    stored field, so the critic's micro-batches receive these two)."""
    fields = TensorDict(
        {
            CRITIC_MASK_KEY: response_to_nested(outputs.critic_mask, nested_mask),
            CRITIC_WEIGHTS_KEY: response_to_nested(outputs.critic_loss_weights, nested_mask),
        },
        batch_size=len(batch),
    )
    return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=fields)


# ==================================================================================================
# checkpoint state


def save_group_state(folder: str, threshold: ThresholdState, params: GroupParams, global_step: int) -> str:
    """Write ``group_ppo_state.json`` into ``folder`` (created if needed); returns its path."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, STATE_FILE)
    state = {"threshold_state": threshold.state_dict(), "group_params": params.to_dict(), "global_step": global_step}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f, indent=2)
    os.replace(tmp, path)
    return path


def load_group_state(folder: str) -> Optional[dict[str, Any]]:
    """The state saved by :func:`save_group_state` in ``folder``, or None when there is none."""
    path = os.path.join(folder, STATE_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def resume_folder(trainer_config: Any) -> Optional[str]:
    """The ``global_step_N`` folder verl's ``_load_checkpoint`` resumed from (same rules as verl's)."""
    mode = trainer_config.resume_mode
    if mode == "auto":
        return find_latest_ckpt_path(_absolute(trainer_config.default_local_dir))
    if mode == "resume_path":
        return _absolute(trainer_config.resume_from_path)
    return None


def _absolute(path: str) -> str:
    return path if os.path.isabs(path) else os.path.join(os.getcwd(), path)


# ==================================================================================================
# the registered classes


class GroupPPOTrainerSync(GroupPPOTrainerMixin, PPOTrainerSync):
    """verl's ``sync`` trainer with GROUP-PPO support."""


class GroupPPOTrainerColocateAsync(GroupPPOTrainerMixin, PPOTrainerColocateAsync):
    """verl's ``colocate_async`` trainer with GROUP-PPO support."""


class GroupPPOTrainerSeparateAsync(GroupPPOTrainerMixin, PPOTrainerSeparateAsync):
    """verl's ``separate_async`` trainer with GROUP-PPO support."""


TRAINER_CLASSES: dict[str, tuple[type[PPOTrainer], type[PPOTrainer]]] = {
    "sync": (PPOTrainerSync, GroupPPOTrainerSync),
    "colocate_async": (PPOTrainerColocateAsync, GroupPPOTrainerColocateAsync),
    "separate_async": (PPOTrainerSeparateAsync, GroupPPOTrainerSeparateAsync),
}
"""trainer.v1.trainer_mode -> (verl's class, our subclass)."""


def install_trainers(registry: dict[str, type]) -> None:
    """Put the GROUP-PPO subclasses into verl's ``TRAINER_REGISTRY`` in place of verl's classes.

    Raises RuntimeError (after installing every other mode) when an entry is missing or holds a class
    other than verl's: someone else replaced it, or verl renamed its modes.
    """
    problems = []
    for mode, (verl_cls, group_cls) in TRAINER_CLASSES.items():
        current = registry.get(mode)
        if current is group_cls:
            continue
        if current is not verl_cls:
            problems.append(f"{mode!r} holds {current!r}, expected verl's {verl_cls.__name__}")
            continue
        registry[mode] = group_cls
    if problems:
        raise RuntimeError("verl's v1 TRAINER_REGISTRY is not as verl-group-ppo expects: " + "; ".join(problems))


run_deferred_trainer_install(install_trainers)
