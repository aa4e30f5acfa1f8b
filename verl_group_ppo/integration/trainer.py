"""GROUP-PPO on verl's v1 trainers: one mixin over ``sync``, ``colocate_async`` and ``separate_async``.

The classes go into verl's ``TRAINER_REGISTRY`` under verl's own mode names (the mode string also
drives behaviour inside verl, so new names are not an option): this module installs them itself at the
end of its import (:func:`install_trainers`; a failure is recorded, see
:mod:`~verl_group_ppo.integration.failures`). The entry point's hook on ``verl.trainer.ppo.v1`` only
imports this module; when this module is what imported verl's v1 package, that hook gets this
half-imported module back and the install still happens here, once, when the import finishes.

With any estimator other than ``group_ppo`` every method below hands straight to verl's. With ``group_ppo``:

- ``__init__`` logs one INFO line (:func:`startup_line`), so the run's log shows GROUP-PPO is active::

    verl-group-ppo: algorithm.adv_estimator=group_ppo active (trainer: GroupPPOTrainerSync, trainer_mode: sync);
    gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True; group_params: group_variance_threshold=1.0, ...

  (one line in the log; its level follows ``VERL_LOGGING_LEVEL``, INFO by default, as verl's own lines).

- ``_compute_advantage`` takes the boundary values from ``group_params.value_source`` (:meth:`_boundary_values`:
  the critic's values from TransferQueue, the prompt's prefix tree, or ``mc``'s continuations through the rollout,
  :mod:`~verl_group_ppo.integration.mc_rollout`), fetches old log-probs for the ``low_prob`` rule (and
  ``loss_mask`` with a critic) and runs verl's own advantage step inside
  :func:`~verl_group_ppo.integration.estimator.estimator_inputs`, so KL-in-reward, rollout correction
  and the multi-trajectory handling stay verl's. It then stores the critic-loss weights next to the
  advantages (a second ``kv_batch_put``, whose metadata it returns so the critic's micro-batches carry
  them; only with a critic), updates the adaptive threshold and adds the core's ``group/*`` metrics. It runs in
  every step, critic warm-up (``trainer.critic_warmup``) included: its returns are the critic's targets.
- ``_setup`` installs the boundary critic loss after verl's setup installed verl's.
- ``_save_checkpoint`` / ``_load_checkpoint`` save and restore the threshold with verl's checkpoints.
- ``_log_rollout_data`` (verl calls it when ``trainer.rollout_data_dir`` is set) also writes
  ``{step}.groups.jsonl`` (:mod:`~verl_group_ppo.integration.rollout_groups`).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

import torch
import transfer_queue as tq
from tensordict import TensorDict
from transfer_queue import KVBatchMeta

from verl.trainer.ppo.v1 import trainer_base
from verl.trainer.ppo.v1.trainer_base import PPOTrainer
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.utils.debug import marked_timer
from verl.utils.ray_utils import auto_await
from verl.workers.utils.padding import response_to_nested

from verl_group_ppo.config import GROUP_PARAMS_PATH, AlgorithmSettings, read_algorithm_settings, select
from verl_group_ppo.core_algos import (AdaptiveThreshold, GroupPPOOutputs, boundary_loss_weights,
                                       find_group_endpoints, group_start_mask)
from verl_group_ppo.integration import ESTIMATOR_NAME, checkpoint, mc_rollout, rollout_groups
from verl_group_ppo.integration.startup import is_group_ppo
from verl_group_ppo.integration.critic_loss import CRITIC_WEIGHTS_KEY, make_critic_loss_fn
from verl_group_ppo.integration.estimator import estimator_inputs
from verl_group_ppo.integration.failures import guarded
from verl_group_ppo.value_sources import mc_boundary_values, prefix_tree_values

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))  # as verl's trainer modules: INFO lines show

DUMP_FIELDS = ["uid", "responses", "rm_scores"]
"""What the groups dump reads from TransferQueue besides the estimator's inputs."""


class GroupPPOTrainerMixin:
    """GROUP-PPO behaviour for a verl v1 :class:`PPOTrainer` subclass; inert for other estimators."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.group_ppo_enabled: bool = is_group_ppo(config)
        self.group_settings: Optional[AlgorithmSettings] = None
        self.group_threshold: Optional[AdaptiveThreshold] = None
        self._group_records: list[dict[str, Any]] = []
        self._mc_score_fn: Optional[Any] = None
        if self.group_ppo_enabled:
            self.group_settings = read_algorithm_settings(config.algorithm)
            if self.use_critic != self.group_settings.group.uses_critic:
                raise RuntimeError(
                    f"algorithm.adv_estimator={ESTIMATOR_NAME} with {GROUP_PARAMS_PATH}.value_source="
                    f"{self.group_settings.group.value_source} but verl decided to run "
                    f"{'with' if self.use_critic else 'without'} a critic: verl's need_critic was bound before the "
                    "verl-group-ppo plugin installed (was the plugin imported by hand after verl's trainer, or "
                    "VERL_USE_EXTERNAL_PLUGINS set to exclude group_ppo?)")
            self.group_threshold = AdaptiveThreshold(self.group_settings.group)
            logger.info(startup_line(type(self).__name__, select(config, "trainer.v1.trainer_mode", "sync"),
                                     self.group_settings))

    # ------------------------------------------------------------------ setup

    def _setup(self) -> None:
        """verl's setup, then the GROUP-PPO boundary critic loss in place of verl's ``value_loss``
        (``critic_loss_on: all_tokens`` keeps verl's)."""
        super()._setup()
        if self.group_ppo_enabled and self.use_critic and self.group_settings.group.critic_loss_on == "boundaries":
            self.critic_wg.set_loss_fn(make_critic_loss_fn(self.config.critic, "boundaries"))

    # ------------------------------------------------------------------ advantage step

    def _compute_advantage(self, batch: KVBatchMeta, metrics: dict) -> KVBatchMeta:
        """verl's advantage step with the critic's values reaching the ``group_ppo`` estimator."""
        if not self.group_ppo_enabled:
            return super()._compute_advantage(batch, metrics)
        fetched = fetch_fields(batch, self._advantage_fields())
        values, mc_starts = self._boundary_values(batch, fetched, metrics)
        with estimator_inputs(values, fetched.get("old_log_probs"), threshold=self.group_threshold.value) as inputs:
            batch = super()._compute_advantage(batch, metrics)
        outputs: Optional[GroupPPOOutputs] = inputs.outputs
        if outputs is None:
            raise RuntimeError(
                "verl's advantage step did not call the group_ppo estimator; this verl version routes "
                "estimators differently from what verl-group-ppo supports (see docs/verl_integration.md).")
        if mc_starts is not None and not torch.equal(outputs.critic_mask.bool(), mc_starts):
            raise RuntimeError(
                f"{GROUP_PARAMS_PATH}.value_source=mc: the estimator's groups differ from the boundaries the "
                "continuations were sampled from (verl's advantage step handed the estimator another response_mask)")
        if self.use_critic:
            weights = boundary_loss_weights(outputs.critic_mask, fetched["loss_mask"])
            batch = store_per_token(batch, {CRITIC_WEIGHTS_KEY: weights}, fetched["nested_response_mask"])
        self.group_threshold.update(outputs)
        metrics.update(outputs.metrics)
        if self._rollout_data_dir():
            self._group_records.extend(self._records(batch, fetched, outputs, values))
        return batch

    def _advantage_fields(self) -> list[str]:
        group = self.group_settings.group
        inputs = ["values", "loss_mask"] if group.uses_critic else ["responses", "rm_scores", "uid"]
        fields = ["response_mask", *inputs]
        if group.boundary_rule == "low_prob":
            fields.append("old_log_probs")
        fields += DUMP_FIELDS if self._rollout_data_dir() else []
        return list(dict.fromkeys(fields))

    def _boundary_values(self, batch: KVBatchMeta, fetched: dict,
                         metrics: dict) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The (B, T) values the estimator reads, by ``group_params.value_source`` (docs/algorithm.md, "Value
        sources"), and for ``mc`` the group starts the continuations were sampled from (else None)."""
        group = self.group_settings.group
        if group.value_source == "critic":
            return fetched["values"], None
        response_mask = fetched["response_mask"]
        scores = fetched["rm_scores"].sum(dim=-1)
        if group.value_source == "prefix_tree":
            exists = reply_positions(fetched["nested_response_mask"], response_mask.shape[1])
            return prefix_tree_values(fetched["responses"], exists, scores, fetched["uid"]), None
        starts = group_start_mask(find_group_endpoints(
            torch.zeros_like(response_mask, dtype=torch.float32), response_mask,
            old_log_probs=fetched.get("old_log_probs"), gamma=self.group_settings.gamma,
            group_max_size=group.group_max_size, group_epsilon=group.group_epsilon, boundary_rule=group.boundary_rule,
            low_prob_threshold=group.low_prob_threshold), response_mask)
        with marked_timer("group_mc", self.timing_raw):
            continuation_scores, n_tokens = self._mc_continuations(batch, fetched["responses"], starts)
        metrics["group/mc_responses"] = int(continuation_scores.numel())
        metrics["group/mc_tokens"] = n_tokens
        return mc_boundary_values(starts, continuation_scores, scores, fetched["uid"]), starts

    def _mc_continuations(self, batch: KVBatchMeta, responses: torch.Tensor,
                          starts: torch.Tensor) -> tuple[torch.Tensor, int]:
        """(S, K) scores of K continuations from every group start after position 0, and the tokens they took.

        The sync trainer put the rollout replicas to sleep after sampling; they are woken with the same weights
        (the actor has not updated yet) and put back to sleep after the continuations."""
        fields = ["prompts", "data_source", "reward_model"]
        try:
            data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                   select_fields=fields + ["extra_info"])
            extra_info = data.get("extra_info").tolist()
        except Exception:  # noqa: BLE001 - a dataset without an extra_info column: the reward gets {} (verl's default)
            data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
            extra_info = None
        prompts = [row.tolist() for row in data["prompts"].unbind()]
        info = mc_rollout.row_info(data.get("data_source").tolist(), data.get("reward_model").tolist(), extra_info)
        response_length = int(select(self.config, "actor_rollout_ref.rollout.response_length"))
        prefixes, rows = mc_rollout.boundary_prefixes(prompts, responses, starts, response_length)
        k = self.group_settings.group.mc_samples
        if not prefixes:
            return torch.empty((0, k)), 0
        with marked_timer("group_mc_generate", self.timing_raw):
            self.checkpoint_manager.update_weights(self.global_steps)
            try:
                continuations = run_async(mc_rollout.sample_continuations(
                    self.get_llm_client(), prefixes, k, mc_rollout.rollout_sampling_params(self.config)))
            finally:
                self.checkpoint_manager.sleep_replicas()
        if self._mc_score_fn is None:
            self._mc_score_fn = mc_rollout.reward_function(self.config)
        with marked_timer("group_mc_score", self.timing_raw):
            scores = mc_rollout.score_continuations(self._mc_score_fn, self.tokenizer, prefixes, continuations, rows,
                                                    info)
        return scores, sum(len(c) for samples in continuations for c in samples)

    def _records(self, batch: KVBatchMeta, fetched: dict, outputs: GroupPPOOutputs,
                 values: torch.Tensor) -> list[dict[str, Any]]:
        """This batch's groups-file records, over the valid tokens of the mask the estimator saw."""
        # as the estimator saw them: verl stores token_level_rewards only when the KL penalty rewrote them
        # (PPOTrainer._compute_advantage in verl's v1 trainer_base); else they are the rm_scores
        kl_in_reward = bool(select(self.config, "algorithm.use_kl_in_reward", False))
        seen = fetch_fields(batch, ["response_mask"] + (["token_level_rewards"] if kl_in_reward else []))
        rewards = seen["token_level_rewards"] if kl_in_reward else fetched["rm_scores"]
        return rollout_groups.response_records(
            self.global_steps, fetched["uid"], fetched["rm_scores"].sum(dim=-1), fetched["responses"],
            seen["response_mask"], outputs, self.tokenizer, rewards, values)

    def _rollout_data_dir(self) -> Optional[str]:
        return select(self.config, "trainer.rollout_data_dir")

    # ------------------------------------------------------------------ rollout dump

    def _log_rollout_data(self, batch: KVBatchMeta, timing_raw: dict, rollout_data_dir: str) -> None:
        """verl's rollout dump, then this step's ``{step}.groups.jsonl`` beside it."""
        super()._log_rollout_data(batch, timing_raw, rollout_data_dir)
        if self.group_ppo_enabled:
            path = rollout_groups.groups_file(rollout_data_dir, self.global_steps)
            rollout_groups.write_records(path, self._group_records)
            self._group_records = []

    # ------------------------------------------------------------------ checkpoints

    def _save_checkpoint(self) -> None:
        """Write the GROUP-PPO state into the step folder first, then let verl save (and write its tracker
        file last), so a checkpoint verl can resume from always holds the threshold."""
        if self.group_ppo_enabled:
            checkpoint.save_group_state(checkpoint.step_folder(self.config.trainer, self.global_steps),
                                        self.group_threshold, self.group_settings.group, self.global_steps)
        super()._save_checkpoint()

    def _load_checkpoint(self) -> None:
        """verl's resume, then the threshold from the same checkpoint folder."""
        super()._load_checkpoint()
        if not self.group_ppo_enabled or self.global_steps == 0:
            return
        folder = checkpoint.resume_folder(self.config.trainer)
        if folder is None:
            return
        state = checkpoint.load_group_state(folder)
        if state is None:
            logger.warning(
                "verl-group-ppo: checkpoint %s has no %s (saved by another estimator?); starting from "
                "algorithm.group_params.group_variance_threshold=%s", folder, checkpoint.STATE_FILE,
                self.group_threshold.value)
            return
        self.group_threshold.load_state_dict(state["threshold_state"])
        logger.info("verl-group-ppo: resumed threshold %s from %s", self.group_threshold.value, folder)


def startup_line(trainer: str, trainer_mode: str, settings: AlgorithmSettings) -> str:
    """The line a GROUP-PPO run logs when its trainer is built: the estimator, the trainer class and mode,
    and every setting the estimator reads."""
    group = ", ".join(f"{key}={value}" for key, value in settings.group.to_dict().items())
    return (f"verl-group-ppo: algorithm.adv_estimator={ESTIMATOR_NAME} active (trainer: {trainer}, "
            f"trainer_mode: {trainer_mode}); gamma={settings.gamma}, lam={settings.lam}, "
            f"norm_adv_by_std_in_grpo={settings.norm_adv_by_std_in_grpo}; group_params: {group}")


# ==================================================================================================
# TransferQueue I/O


def fetch_fields(batch: KVBatchMeta, fields: list[str]) -> dict[str, Any]:
    """The batch's stored ``fields`` right-padded to (B, T) as verl's advantage step sees them (``uid``
    as a list of B strings), plus ``nested_response_mask`` when ``response_mask`` is fetched (the
    layout per-token fields are stored back in)."""
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
    padded = data.to_padded_tensor()
    out: dict[str, Any] = {name: padded[name] for name in fields if name != "uid"}
    if "uid" in fields:
        out["uid"] = [str(uid) for uid in padded.get("uid").tolist()]
    if "response_mask" in fields:
        out["nested_response_mask"] = data["response_mask"]
    return out


def reply_positions(nested_mask: torch.Tensor, width: int) -> torch.Tensor:
    """(B, width) 0/1: 1 at the positions each reply has (assistant tokens and tool observations), from the
    per-row lengths of the stored (jagged) ``response_mask``."""
    lengths = torch.tensor([len(row) for row in nested_mask.unbind()])
    return (torch.arange(width)[None, :] < lengths[:, None]).long()


@auto_await
async def run_async(coroutine: Any) -> Any:
    """Await ``coroutine`` from the driver's synchronous step (verl's ``auto_await`` picks the event loop)."""
    return await coroutine


def store_per_token(batch: KVBatchMeta, fields: dict[str, torch.Tensor], nested_mask: torch.Tensor) -> KVBatchMeta:
    """Store (B, T) per-token ``fields`` per response; return this put's metadata (it lists every stored
    field, so the critic's micro-batches receive these)."""
    nested = TensorDict({name: response_to_nested(value, nested_mask) for name, value in fields.items()},
                        batch_size=len(batch))
    return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=nested)


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

INSTALL_STEP = "installing the GROUP-PPO v1 trainer classes"


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


guarded(INSTALL_STEP, install_trainers)(trainer_base.TRAINER_REGISTRY)
