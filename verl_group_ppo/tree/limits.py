"""The tree rollout's start-up checks, before Ray starts (a ValueError naming the keys).

Pure: reads the run's config (a DictConfig, nested mappings or verl's config objects), imports no verl.
"""

from __future__ import annotations

from typing import Any

from verl_group_ppo.config import select
from verl_group_ppo.tree.shape import TREE_PATH, TreeShape

__all__ = ["AGENT_LOOP_KEY", "TREE_AGENT", "check_tree_config", "tree_shape", "uses_tree_rollout"]

TREE_AGENT = "tree_single_turn"
"""The tree rollout's agent-loop name (:mod:`verl_group_ppo.tree.agent_loop`)."""

AGENT_LOOP_KEY = "actor_rollout_ref.rollout.agent.default_agent_loop"
ROLLOUT_N = "actor_rollout_ref.rollout.n"


def uses_tree_rollout(config: Any) -> bool:
    """True when the run's default agent loop is the tree rollout's."""
    return str(select(config, AGENT_LOOP_KEY, "")) == TREE_AGENT


def tree_shape(config: Any) -> TreeShape:
    """The run's :class:`~verl_group_ppo.tree.shape.TreeShape` (``tree_rollout``; defaults when absent)."""
    return TreeShape.from_config(select(config, TREE_PATH))


def check_tree_config(config: Any) -> None:
    """With the tree rollout: the ``tree_rollout`` keys valid, ``actor_rollout_ref.rollout.n`` equal to the tree's
    size, no multi-turn tool loop, rollout log-probs for ``branch_rule: low_prob``. Without it: no ``tree_rollout``
    block (it would be ignored). ValueError naming the keys."""
    if not uses_tree_rollout(config):
        if select(config, TREE_PATH) is not None:
            raise ValueError(f"{TREE_PATH} is set but {AGENT_LOOP_KEY}={select(config, AGENT_LOOP_KEY)!r}: the tree "
                             f"shape is read only by the tree rollout; set {AGENT_LOOP_KEY}={TREE_AGENT} or remove "
                             f"{TREE_PATH}.")
        return
    shape = tree_shape(config)
    shape.check_samples(select(config, ROLLOUT_N, 1), ROLLOUT_N)
    if bool(select(config, "actor_rollout_ref.rollout.multi_turn.enable", False)):
        raise ValueError(f"actor_rollout_ref.rollout.multi_turn.enable=true with {AGENT_LOOP_KEY}={TREE_AGENT}: the "
                         "tree rollout branches single-turn replies and runs no tools; use the tool agent loop "
                         "without the tree, or multi_turn.enable=false.")
    if shape.branch_rule == "low_prob" and not bool(select(config, "actor_rollout_ref.rollout.calculate_log_probs",
                                                           False)):
        raise ValueError(f"{TREE_PATH}.branch_rule=low_prob branches at the parent's least likely token, read from "
                         "the rollout's log-probs; set actor_rollout_ref.rollout.calculate_log_probs=True or "
                         f"{TREE_PATH}.branch_rule=fixed.")
