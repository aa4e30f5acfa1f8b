"""The CPU launcher's tasks, one :class:`~verl_group_ppo.taskdir.TaskSpec` each: :data:`TINY`, :data:`TINY_TOOLS`,
:data:`TWOWAY`.

    python -m verl_group_ppo.task_specs shell TASK MULTI_TURN

prints the spec that the launcher's ``TASK`` and ``MULTI_TURN`` pick as shell assignments (``response_length=16``,
values quoted for the shell); examples/cpu/common.sh evaluates them and reads the variables in its one list of
Hydra keys. The benchmarks read the same objects. A number a task's ``prepare`` also uses (reply and prompt length,
the accuracy band, the turn limit) is its prepare settings' default, which the spec reads; the rest is written here.
Every task is scored through the one reward function :data:`REWARD` (:mod:`verl_group_ppo.reward`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import shlex
import sys
from typing import Sequence

from .mathtask import prepare as mathtask_prepare
from .mathtask.task import DATA_SOURCE as TWOWAY_DATA_SOURCE
from .mathtask.task import arith_data_source
from .taskdir import TaskSpec
from .tinytask import prepare as tiny_prepare
from .tinytask.reward import TOOLS_SUFFIX, data_source_for

#: verl's reward.custom_reward_function.path of every task
REWARD = "pkg://verl_group_ppo.reward"
#: the function tool file verl's tool agent loop executes for the tool task
TOOL_MODULE = "verl_group_ppo.tinytask.calculator_tool"

_TINY = tiny_prepare.PrepareSettings()
_TOOLS = tiny_prepare.settings_from_flags({"variant": tiny_prepare.TOOLS.name})
_ARITH = mathtask_prepare.PrepareSettings()
_TWOWAY = mathtask_prepare.settings_from_flags({"variant": "twoway"})

#: the tiny task (docs/cpu.md): 32 prompts x 4 responses a step, one actor and two critic updates, 40 steps; on the
#: model prepare builds, verl's reward rose by +0.05 to +0.11 from the first to the last 10 of 40 steps
TINY = TaskSpec(
    name="tiny", task="tiny", multi_turn=False, data_sources=(data_source_for(_TINY.task),),
    prepare_module="verl_group_ppo.tinytask.prepare", prepare_args=(), work_dir="runs/cpu-tiny",
    prompt_length=32, response_length=_TINY.response_length, train_batch=32, rollout_n=4, steps=40,
    actor_lr=2e-4, critic_lr=1e-3, actor_mini_batches=1, critic_mini_batches=2, val_before_train=False,
    test_freq=-1, threads=1, project="verl_group_ppo_cpu_tiny", accuracy_band=(_TINY.min_sampled_accuracy, 1.0))

#: the tiny tool task through verl's tool agent loop (docs/multiturn.md): the tiny task's run with longer responses
TINY_TOOLS = dataclasses.replace(
    TINY, name="tiny_multiturn", multi_turn=True, data_sources=(data_source_for(_TOOLS.task, TOOLS_SUFFIX),),
    prepare_args=("--tools",), work_dir="runs/cpu-tiny-tools", response_length=_TOOLS.response_length,
    accuracy_band=(_TOOLS.min_sampled_accuracy, 1.0), max_assistant_turns=_TOOLS.max_assistant_turns)

#: the maths-question task's two-way variant (docs/mathtask.md): SmolLM2-135M-Instruct (the default model) on
#: True/False and which-is-bigger questions. Its shape was chosen by benchmarks/bench_mathtask_speed.py: 2 threads in
#: one process, 16 prompts x 4 responses a step in two actor and two critic updates; 20 steps, validated before
#: training and after the last step, take about 35 minutes on 2 cores
_TWOWAY_STEPS = 20
TWOWAY = TaskSpec(
    name="twoway", task="twoway", multi_turn=False, data_sources=(TWOWAY_DATA_SOURCE,),
    prepare_module="verl_group_ppo.mathtask.prepare", prepare_args=("--variant", "twoway"), work_dir="runs/cpu-twoway",
    prompt_length=_TWOWAY.max_prompt_length, response_length=_TWOWAY.response_length, train_batch=16, rollout_n=4,
    steps=_TWOWAY_STEPS, actor_lr=1e-5, critic_lr=5e-5, actor_mini_batches=2, critic_mini_batches=2,
    val_before_train=True, test_freq=_TWOWAY_STEPS, threads=2, project="verl_group_ppo_cpu_twoway",
    accuracy_band=(_TWOWAY.min_sampled_accuracy, _TWOWAY.max_sampled_accuracy))

#: the maths-question task's arithmetic variant (docs/mathtask.md): SmolLM2-135M-Instruct (the default model) on two-
#: and three-step integer arithmetic with free-form answers, one data source per module, replies of up to 64 tokens
#: after a worked example; validated on 1024 questions before training, in the middle and after the last step. Actor
#: lr 5e-6: at 2e-5 the validation accuracy fell with GROUP-PPO and with GRPO (results.md)
_ARITH_STEPS = 16
ARITH = TaskSpec(
    name="arith", task="arith", multi_turn=False,
    data_sources=tuple(arith_data_source(m) for m in _ARITH.modules.split(",")),
    prepare_module="verl_group_ppo.mathtask.prepare", prepare_args=(), work_dir="runs/cpu-arith",
    prompt_length=_ARITH.max_prompt_length, response_length=_ARITH.response_length, train_batch=8, rollout_n=4,
    steps=_ARITH_STEPS, actor_lr=5e-6, critic_lr=5e-5, actor_mini_batches=2, critic_mini_batches=2,
    val_before_train=True, test_freq=_ARITH_STEPS // 2, threads=2, project="verl_group_ppo_cpu_arith",
    accuracy_band=(_ARITH.min_sampled_accuracy, _ARITH.max_sampled_accuracy), temperature=_ARITH.temperature)

SPECS: tuple[TaskSpec, ...] = (TINY, TINY_TOOLS, TWOWAY, ARITH)


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
        "prepare_args": spec.prepare_args, "reward_path": REWARD, "project": spec.project,
        **{name: str(getattr(spec, name)) for name in (
            "prompt_length", "response_length", "train_batch", "rollout_n", "steps", "actor_lr", "critic_lr",
            "actor_mini_batch", "critic_mini_batch", "rank_unit", "val_before_train", "test_freq", "threads",
            "max_assistant_turns", "value_group_size", "temperature")}}
    if spec.multi_turn:
        values["tool_file"] = importlib.util.find_spec(TOOL_MODULE).origin
    return values


def shell_assignments(spec: TaskSpec) -> str:
    """``name=value`` lines (a tuple as a bash array), each value quoted with :func:`shlex.quote`."""
    def quoted(value: str | tuple[str, ...]) -> str:
        return f"({' '.join(map(shlex.quote, value))})" if isinstance(value, tuple) else shlex.quote(value)

    return "".join(f"{name}={quoted(value)}\n" for name, value in shell_values(spec).items())


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3 or args[0] != "shell":
        print("usage: python -m verl_group_ppo.task_specs shell TASK MULTI_TURN", file=sys.stderr)
        return 2
    try:
        spec = spec_for(args[1], args[2])
    except ValueError as error:
        print(f"task_specs: {error}", file=sys.stderr)
        return 2
    sys.stdout.write(shell_assignments(spec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
