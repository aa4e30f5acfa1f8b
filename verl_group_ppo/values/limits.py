"""What a value source needs of the run, checked before Ray starts (a ValueError naming the keys).

Pure: reads the run's config (a DictConfig, nested mappings or verl's config objects), imports no verl.
"""

from __future__ import annotations

from typing import Any

from verl_group_ppo.config import GROUP_PARAMS_PATH, read_algorithm_settings, select
from verl_group_ppo.tree.limits import AGENT_LOOP_KEY, TREE_AGENT, uses_tree_rollout

__all__ = ["MC_ROLLOUTS", "MIN_REPLIES", "ROLLOUT_N", "check_mc_rollout", "check_value_source_config"]

ROLLOUT_N = "actor_rollout_ref.rollout.n"
"""The key of the replies sampled per prompt."""

MIN_REPLIES = {
    "prefix_tree": ("the value of a prefix is the mean reward of the prompt's replies that share it; with one reply "
                    "every value is that reply's own reward and every advantage is 0, so the run learns nothing"),
    "mc": ("the value before the first token is the mean reward of the prompt's replies; with one reply it is that "
           "reply's own reward, so the first group has no baseline"),
}
"""Value sources that read a prompt's other replies, each with why one reply is not enough (they need 2)."""


def check_value_source_config(config: Any) -> None:
    """The value source's start-up limits: ``boundary_rule: tree`` only with the tree rollout, ``mc``'s rollout
    (:func:`check_mc_rollout`), then ``actor_rollout_ref.rollout.n`` < 2 refused for the value sources of
    :data:`MIN_REPLIES`.

    Args:
        config: the run's full config (``algorithm`` and ``actor_rollout_ref``); ``rollout.n`` missing reads as
            verl's default, 1.

    Raises:
        ValueError: naming ``actor_rollout_ref.rollout.n`` and ``algorithm.group_params.value_source``.
    """
    group = read_algorithm_settings(select(config, "algorithm")).group
    source = group.value_source
    if group.boundary_rule == "tree" and not uses_tree_rollout(config):
        raise ValueError(f"{GROUP_PARAMS_PATH}.boundary_rule=tree cuts groups at the tree rollout's branch points, "
                         f"but {AGENT_LOOP_KEY}={select(config, AGENT_LOOP_KEY)!r} samples independent replies (whose "
                         f"prefix-tree values are mostly each reply's own reward); set {AGENT_LOOP_KEY}={TREE_AGENT} "
                         f"or another {GROUP_PARAMS_PATH}.boundary_rule.")
    if source == "mc":
        check_mc_rollout(config)
    if source not in MIN_REPLIES:
        return
    n = select(config, ROLLOUT_N, 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"{ROLLOUT_N}={n}: {GROUP_PARAMS_PATH}.value_source={source} needs at least 2 replies per "
                         f"prompt ({MIN_REPLIES[source]}); set {ROLLOUT_N}=2 or more, or use "
                         f"{GROUP_PARAMS_PATH}.value_source=critic.")


#: Rollouts whose servers take token ids and continue them (verl's token-in/token-out ``generate``).
MC_ROLLOUTS = ("hf", "vllm", "sglang")


def check_mc_rollout(config: Any) -> None:
    """``value_source: mc`` samples its continuations through the run's own rollout servers, from the prompt plus
    the reply up to each boundary, between the rollout and the actor update (ValueError naming the key).

    Refused: a rollout without a token-in ``generate`` (:data:`MC_ROLLOUTS`); the multi-turn tool loop (one
    ``generate`` call continues a reply but runs no tools); trainer modes other than ``sync`` (in the asynchronous
    modes the servers are generating the next batch, possibly with newer weights, while the advantages are formed).
    """
    name = str(select(config, "actor_rollout_ref.rollout.name", "vllm"))
    if name not in MC_ROLLOUTS:
        raise ValueError(f"actor_rollout_ref.rollout.name={name}: {GROUP_PARAMS_PATH}.value_source=mc continues "
                         f"replies from their boundaries through the rollout's token-in generate, which only "
                         f"{list(MC_ROLLOUTS)} have; use one of them or value_source=prefix_tree.")
    if bool(select(config, "actor_rollout_ref.rollout.multi_turn.enable", False)):
        raise ValueError(f"actor_rollout_ref.rollout.multi_turn.enable=true: {GROUP_PARAMS_PATH}.value_source=mc "
                         "continues a reply with one generate call, which runs no tools, so a continuation of a "
                         "tool-calling reply is not a sample of the policy's episode; use value_source=prefix_tree "
                         "(or critic) in the multi-turn loop.")
    if bool(select(config, "reward.reward_model.enable", False)):
        raise ValueError(f"reward.reward_model.enable=true: {GROUP_PARAMS_PATH}.value_source=mc scores its "
                         "continuations with the run's rule reward function (reward.custom_reward_function or "
                         "verl's default_compute_score) in the driver, not with a reward model; use "
                         "value_source=prefix_tree.")
    manager = str(select(config, "reward.reward_manager.name", "naive"))
    if manager != "naive":
        raise ValueError(f"reward.reward_manager.name={manager}: {GROUP_PARAMS_PATH}.value_source=mc scores its "
                         "continuations as verl's naive reward manager scores a reply (the reward function's score, "
                         "nothing added); use reward.reward_manager.name=naive or value_source=prefix_tree.")
    mode = str(select(config, "trainer.v1.trainer_mode", "sync"))
    if mode != "sync":
        raise ValueError(f"trainer.v1.trainer_mode={mode}: {GROUP_PARAMS_PATH}.value_source=mc samples its "
                         "continuations with the weights that generated the batch, which only the sync trainer "
                         "holds still between the rollout and the actor update; use trainer.v1.trainer_mode=sync or "
                         "value_source=prefix_tree.")
