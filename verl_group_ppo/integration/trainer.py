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

- ``_compute_advantage`` fetches the fields the value source reads (:func:`verl_group_ppo.values.fields_needed`),
  asks :func:`verl_group_ppo.values.boundary_values` once for the step's boundary values (lending it the run's rollout
  for ``mc``'s continuations: :class:`~verl_group_ppo.values.mc_rollout.RolloutSampler`) and runs verl's own
  advantage step inside :func:`~verl_group_ppo.integration.estimator.estimator_inputs`, with the values, the old
  log-probs and, when the source fixed them, the group endpoints; so KL-in-reward, rollout correction and the
  multi-trajectory handling stay verl's. It then stores the critic-loss weights next to the advantages (a second
  ``kv_batch_put``, whose metadata it returns so the critic's micro-batches carry them; only with a critic), updates
  the adaptive threshold and adds the source's and the core's ``group/*`` metrics. It runs in every step, critic
  warm-up (``trainer.critic_warmup``) included: its returns are the critic's targets.
- With the tree rollout (``actor_rollout_ref.rollout.agent.default_agent_loop=tree_single_turn``, any estimator)
  ``_compute_advantage`` adds ``group/tree_generated_tokens`` and ``group/tree_path_tokens`` (:func:`tree_metrics`).
- ``_setup`` installs the boundary critic loss after verl's setup installed verl's.
- ``_save_checkpoint`` / ``_load_checkpoint`` save and restore the threshold with verl's checkpoints.
- ``_log_rollout_data`` (verl calls it when ``trainer.rollout_data_dir`` is set) also writes
  ``{step}.groups.jsonl`` (:mod:`~verl_group_ppo.integration.rollout_groups`).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional, Sequence

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
from verl.workers.utils.padding import response_to_nested

from verl_group_ppo.config import GROUP_PARAMS_PATH, AlgorithmSettings, read_algorithm_settings, select
from verl_group_ppo import values
from verl_group_ppo.core_algos import AdaptiveThreshold, GroupPPOOutputs, boundary_loss_weights
from verl_group_ppo.estimator.checks import prompt_ids
from verl_group_ppo.integration import ESTIMATOR_NAME, checkpoint, rollout_groups
from verl_group_ppo.integration.startup import is_group_ppo
from verl_group_ppo.integration.critic_loss import CRITIC_WEIGHTS_KEY, make_critic_loss_fn
from verl_group_ppo.integration.estimator import estimator_inputs
from verl_group_ppo.integration.failures import guarded
from verl_group_ppo.metrics import prompts_scored_alike
from verl_group_ppo.tree.cost import tree_round_seconds, tree_token_counts
from verl_group_ppo.tree.limits import uses_tree_rollout
from verl_group_ppo.values import mc_rollout

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))  # as verl's trainer modules: INFO lines show

DUMP_FIELDS = ["responses"]
"""What the groups dump reads from TransferQueue besides the value source's fields and the advantage step's own."""


class GroupPPOTrainerMixin:
    """GROUP-PPO behaviour for a verl v1 :class:`PPOTrainer` subclass; inert for other estimators."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.group_ppo_enabled: bool = is_group_ppo(config)
        self.group_settings: Optional[AlgorithmSettings] = None
        self.group_threshold: Optional[AdaptiveThreshold] = None
        self._group_records: list[dict[str, Any]] = []
        self._value_sampler: Optional[mc_rollout.RolloutSampler] = None
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
        """verl's advantage step with the boundary values reaching the ``group_ppo`` estimator; with the tree
        rollout (any estimator) also the tree's ``group/tree_*`` token counts."""
        tree_rows = None  # with the tree rollout: each row's extra_fields (its place in the tree), fetched once
        if uses_tree_rollout(self.config):
            tree_data = fetch(batch, ["response_mask", "extra_fields"])
            tree_rows = extra_fields_of(tree_data)
            metrics.update(tree_metrics(tree_data))
        if not self.group_ppo_enabled:
            return super()._compute_advantage(batch, metrics)
        needed = values.fields_needed(self.group_settings)
        data = fetch(batch, [*needed.required, *self._own_fields()], optional=needed.optional)
        fields = values.batch_fields(data)
        boundary = values.boundary_values(self.group_settings, fields, sampler=self._sample_continuations)
        metrics.update(boundary.metrics)
        with estimator_inputs(boundary.values, fields.old_log_probs, threshold=self.group_threshold.value,
                              endpoints=boundary.endpoints, parent_nodes=boundary.parent_nodes) as inputs:
            batch = super()._compute_advantage(batch, metrics)
        outputs: Optional[GroupPPOOutputs] = inputs.outputs
        if outputs is None:
            raise RuntimeError(
                "verl's advantage step did not call the group_ppo estimator; this verl version routes "
                "estimators differently from what verl-group-ppo supports (see docs/verl_integration.md).")
        if self.use_critic:
            weights = boundary_loss_weights(outputs.critic_mask, padded_field(data, "loss_mask"))
            batch = store_per_token(batch, {CRITIC_WEIGHTS_KEY: weights}, data["response_mask"])
        self.group_threshold.update(outputs)
        metrics.update(outputs.metrics)
        alike = prompts_scored_alike(fields.scores, prompt_ids(fields.uid, len(fields.uid)))
        metrics["group/prompts_scored_alike"] = alike
        if alike == 1.0:  # no prompt's replies differ: the values' fit at the boundaries means nothing this step
            metrics.pop("group/boundary_explained_variance", None)
        if self._rollout_data_dir():
            self._group_records.extend(self._records(batch, data, fields, outputs, boundary.values, tree_rows))
        return batch

    def _own_fields(self) -> list[str]:
        """What the advantage step reads besides the value source's fields: ``loss_mask`` for the critic's
        weights, ``old_log_probs`` for the ``low_prob`` rule, ``rm_scores`` and ``uid`` for
        ``group/prompts_scored_alike``, the groups dump's fields."""
        fields = ["response_mask", "rm_scores", "uid", *(["loss_mask"] if self.use_critic else [])]
        if self.group_settings.group.boundary_rule == "low_prob":
            fields.append("old_log_probs")
        return fields + (DUMP_FIELDS if self._rollout_data_dir() else [])

    def _sample_continuations(self, prefixes: Sequence[values.Prefix], k: int) -> values.Continuations:
        """The run's rollout lent to the value sources (a :class:`~verl_group_ppo.values.ContinuationSampler`;
        only ``mc`` calls it): K scored continuations of each prefix, the sampler made on first use."""
        if self._value_sampler is None:
            self._value_sampler = mc_rollout.RolloutSampler(
                config=self.config, tokenizer=self.tokenizer, client=self.get_llm_client,
                wake=lambda: self.checkpoint_manager.update_weights(self.global_steps),
                sleep=lambda: self.checkpoint_manager.sleep_replicas(),
                timer=lambda name: marked_timer(name, self.timing_raw))
        return self._value_sampler(prefixes, k)

    def _records(self, batch: KVBatchMeta, data: Any, fields: values.BatchFields, outputs: GroupPPOOutputs,
                 boundary_values: torch.Tensor, tree_rows: Optional[list[dict[str, Any]]]) -> list[dict[str, Any]]:
        """This batch's groups-file records, over the valid tokens of the mask the estimator saw (with each row's
        place in the tree when ``tree_rows`` holds the rows' ``extra_fields``)."""
        # as the estimator saw them: verl stores token_level_rewards only when the KL penalty rewrote them
        # (PPOTrainer._compute_advantage in verl's v1 trainer_base); else they are the rm_scores
        kl_in_reward = bool(select(self.config, "algorithm.use_kl_in_reward", False))
        seen = fetch(batch, ["response_mask"] + (["token_level_rewards"] if kl_in_reward else []))
        rm_scores = padded_field(data, "rm_scores")
        rewards = padded_field(seen, "token_level_rewards") if kl_in_reward else rm_scores
        return rollout_groups.response_records(
            self.global_steps, fields.uid, rm_scores.sum(dim=-1), fields.responses,
            padded_field(seen, "response_mask"), outputs, self.tokenizer, rewards, boundary_values, tree=tree_rows)

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


def fetch(batch: KVBatchMeta, fields: list[str], optional: Sequence[str] = ()) -> Any:
    """The batch's stored ``fields`` (a ``TensorDict``, per-response fields jagged), with each of ``optional`` when
    the batch stores it."""
    fields = list(dict.fromkeys(fields))
    wanted = fields + [name for name in optional if name not in fields]
    if len(wanted) > len(fields):
        try:
            return tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=wanted)
        except Exception:  # noqa: BLE001 - an optional column the dataset lacks (extra_info): fetch without it
            pass
    return tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)


def extra_fields_of(data: Any) -> list[dict[str, Any]]:
    """The rows' ``extra_fields`` dicts (stored as a ``NonTensorStack``) as a list."""
    stored = data.get("extra_fields")
    return stored.tolist() if hasattr(stored, "tolist") else list(stored)


def tree_metrics(data: Any) -> dict[str, float]:
    """``group/tree_generated_tokens`` and ``group/tree_path_tokens`` from the rows' ``extra_fields`` (the tree
    rollout records each row's own generated tokens there) and their jagged ``response_mask``; and
    ``group/tree_round{l}_generate_s``, the rounds' time in the server (:func:`tree_round_seconds`)."""
    extra = extra_fields_of(data)
    missing = [i for i, fields in enumerate(extra) if "tree_generated_tokens" not in (fields or {})]
    if missing:
        raise RuntimeError(f"{len(missing)} of {len(extra)} rows carry no tree position in extra_fields: the rows "
                           "were not generated by the tree_single_turn agent loop (a row's agent_name column "
                           "overrides actor_rollout_ref.rollout.agent.default_agent_loop?)")
    lengths = torch.tensor([len(row) for row in data["response_mask"].unbind()], dtype=torch.long)
    generated = torch.tensor([int(fields["tree_generated_tokens"]) for fields in extra], dtype=torch.long)
    metrics = tree_token_counts(lengths, generated)
    if all("tree_generate_s" in fields for fields in extra):
        levels = torch.tensor([int(fields["tree_level"]) for fields in extra], dtype=torch.long)
        seconds = torch.tensor([float(fields["tree_generate_s"]) for fields in extra], dtype=torch.float64)
        metrics.update(tree_round_seconds(levels, seconds))
    return metrics


def padded_field(data: Any, name: str) -> torch.Tensor:
    """The stored per-token field ``name`` right-padded to (B, T), as verl's advantage step sees it."""
    return data.to_padded_tensor()[name] if data[name].is_nested else data[name]


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
