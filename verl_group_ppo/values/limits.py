"""What a value source needs of the run, checked before Ray starts (a ValueError naming the keys).

Pure: reads the run's config (a DictConfig, nested mappings or verl's config objects), imports no verl.
"""

from __future__ import annotations

from typing import Any

from verl_group_ppo.config import GROUP_PARAMS_PATH, read_algorithm_settings, select

__all__ = ["MIN_REPLIES", "ROLLOUT_N", "check_value_source_config"]

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
    """Refuse ``actor_rollout_ref.rollout.n`` < 2 for the value sources of :data:`MIN_REPLIES`.

    Args:
        config: the run's full config (``algorithm`` and ``actor_rollout_ref``); ``rollout.n`` missing reads as
            verl's default, 1.

    Raises:
        ValueError: naming ``actor_rollout_ref.rollout.n`` and ``algorithm.group_params.value_source``.
    """
    source = read_algorithm_settings(select(config, "algorithm")).group.value_source
    if source not in MIN_REPLIES:
        return
    n = select(config, ROLLOUT_N, 1)
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"{ROLLOUT_N}={n}: {GROUP_PARAMS_PATH}.value_source={source} needs at least 2 replies per "
                         f"prompt ({MIN_REPLIES[source]}); set {ROLLOUT_N}=2 or more, or use "
                         f"{GROUP_PARAMS_PATH}.value_source=critic.")
