"""GROUP-PPO's trainer state in verl's checkpoint folders (``global_step_N/group_ppo_state.json``).

File format (JSON): ``{"threshold_state": {"threshold": tau}, "group_params": {...}, "global_step": N}``;
``threshold_state`` is :meth:`AdaptiveThreshold.state_dict`, the only part read back.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

from verl_group_ppo.config import GroupParams
from verl_group_ppo.core_algos import AdaptiveThreshold
from verl_group_ppo.files import write_json

STATE_FILE = "group_ppo_state.json"
"""GROUP-PPO's trainer state inside verl's ``global_step_N`` checkpoint folder."""


def step_folder(trainer_config: Any, global_step: int) -> str:
    """The folder verl's ``_save_checkpoint`` writes step ``global_step`` to."""
    return os.path.join(trainer_config.default_local_dir, f"global_step_{global_step}")


def save_group_state(folder: str, threshold: AdaptiveThreshold, params: GroupParams, global_step: int) -> str:
    """Write :data:`STATE_FILE` into ``folder`` (created if needed) atomically; returns its path."""
    state = {"threshold_state": threshold.state_dict(), "group_params": params.to_dict(), "global_step": global_step}
    return write_json(os.path.join(folder, STATE_FILE), state)


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
