"""The tiny task's launcher runs (:data:`TINY`, :data:`TINY_TOOLS`) and its entry in the task list (:data:`TASK`).

A number its ``prepare`` also uses (the reply length, the accuracy band, the turn limit) is its prepare settings'
default, which the spec reads; the rest is written here.
"""

from __future__ import annotations

import dataclasses

from ..contract import Task, TaskSpec
from . import prepare, reward
from .variants import TOOLS

_TINY = prepare.PrepareSettings()
_TOOLS = prepare.settings_from_flags({"variant": TOOLS.name})

#: the tiny task (docs/cpu.md): 32 prompts x 4 responses a step, one actor and two critic updates, 40 steps; on the
#: model prepare builds, verl's reward rose by +0.05 to +0.11 from the first to the last 10 of 40 steps
TINY = TaskSpec(
    name="tiny", task="tiny", multi_turn=False, data_sources=(reward.data_source_for(_TINY.task),),
    prepare_module="verl_group_ppo.tasks.tiny.prepare", prepare_args=(), work_dir="runs/cpu-tiny",
    prompt_length=32, response_length=_TINY.response_length, train_batch=32, rollout_n=4, steps=40,
    actor_lr=2e-4, critic_lr=1e-3, actor_mini_batches=1, critic_mini_batches=2, val_before_train=False,
    test_freq=-1, threads=1, project="verl_group_ppo_cpu_tiny", accuracy_band=(_TINY.min_sampled_accuracy, 1.0))

#: the tiny tool task through verl's tool agent loop (docs/multiturn.md): the tiny task's run with longer responses
TINY_TOOLS = dataclasses.replace(
    TINY, name="tiny_multiturn", multi_turn=True,
    data_sources=(reward.data_source_for(_TOOLS.task, TOOLS.data_source_suffix),),
    prepare_args=("--variant", TOOLS.name), work_dir="runs/cpu-tiny-tools", response_length=_TOOLS.response_length,
    accuracy_band=(_TOOLS.min_sampled_accuracy, 1.0), max_assistant_turns=_TOOLS.max_assistant_turns,
    tool_module="verl_group_ppo.tasks.tiny.calculator_tool")

TASK = Task(name="tiny", specs=(TINY, TINY_TOOLS), data_sources=reward.DATA_SOURCES,
            compute_score=reward.compute_score, scorer_modules=reward.SCORER_MODULES, extra=reward.SCORER_EXTRA)
