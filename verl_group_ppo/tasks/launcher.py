"""The CPU launcher's view of the tasks: ``TASK`` and ``MULTI_TURN`` pick one :class:`~.contract.TaskSpec` of
:data:`SPECS` (every launcher run of every task in :data:`verl_group_ppo.tasks.registry.TASKS`).

    python -m verl_group_ppo.tasks.launcher shell TASK MULTI_TURN

prints the spec that the launcher's ``TASK`` and ``MULTI_TURN`` pick as shell assignments (``response_length=16``,
values quoted for the shell); examples/cpu/common.sh evaluates them and reads the variables in its one list of
Hydra keys. Every task is scored through the one reward function :data:`~.reward.REWARD_PATH`.
"""

from __future__ import annotations

import importlib.util
import shlex
import sys
from typing import Sequence

from .registry import TASKS
from .contract import TaskSpec
from .reward import REWARD_PATH

#: every launcher run of every task
SPECS: tuple[TaskSpec, ...] = tuple(spec for task in TASKS for spec in task.specs)


def spec_for(task: str, multi_turn: str | int | bool = False) -> TaskSpec:
    """The spec the launcher's ``TASK`` and ``MULTI_TURN`` (0 or 1) pick; ValueError naming the one that picks none."""
    if str(multi_turn) not in ("0", "1", "False", "True"):
        raise ValueError(f"MULTI_TURN: must be 0 or 1, got {multi_turn!r}")
    turns = str(multi_turn) in ("1", "True")
    tasks = sorted({s.task for s in SPECS})
    if task not in tasks:
        raise ValueError(f"TASK: {task!r} must be one of {tasks}")
    found = [s for s in SPECS if s.task == task and s.multi_turn == turns]
    if not found:
        raise ValueError(f"MULTI_TURN: TASK={task} has no {'multi' if turns else 'single'}-turn variant")
    return found[0]


def shell_values(spec: TaskSpec) -> dict[str, str | tuple[str, ...]]:
    """The launcher's variables for ``spec``: Hydra's spelling of each value (``True``, ``2e-05``)."""
    values: dict[str, str | tuple[str, ...]] = {
        "spec_name": spec.name, "default_work_dir": spec.work_dir, "prepare_module": spec.prepare_module,
        "prepare_args": spec.prepare_args, "reward_path": REWARD_PATH, "project": spec.project,
        **{name: str(getattr(spec, name)) for name in (
            "prompt_length", "response_length", "train_batch", "rollout_n", "steps", "actor_lr", "critic_lr",
            "actor_mini_batch", "critic_mini_batch", "rank_unit", "val_before_train", "test_freq", "threads",
            "max_assistant_turns", "value_group_size", "temperature")}}
    if spec.multi_turn:
        values["tool_file"] = importlib.util.find_spec(spec.tool_module).origin
    return values


def shell_assignments(spec: TaskSpec) -> str:
    """``name=value`` lines (a tuple as a bash array), each value quoted with :func:`shlex.quote`."""
    def quoted(value: str | tuple[str, ...]) -> str:
        return f"({' '.join(map(shlex.quote, value))})" if isinstance(value, tuple) else shlex.quote(value)

    return "".join(f"{name}={quoted(value)}\n" for name, value in shell_values(spec).items())


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3 or args[0] != "shell":
        print("usage: python -m verl_group_ppo.tasks.launcher shell TASK MULTI_TURN", file=sys.stderr)
        return 2
    try:
        spec = spec_for(args[1], args[2])
    except ValueError as error:
        print(f"launcher: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(shell_assignments(spec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
