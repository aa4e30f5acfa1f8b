"""The maths-question task's launcher runs (:data:`TWOWAY`, :data:`ARITH`) and its entry in the task list
(:data:`TASK`).

A number its ``prepare`` also uses (reply and prompt length, the temperature, the accuracy band) is its prepare
settings' default, which the spec reads; the rest is written here.
"""

from __future__ import annotations

from ..contract import Task, TaskSpec
from . import prepare, reward
from .task import DATA_SOURCE as TWOWAY_DATA_SOURCE
from .task import arith_data_source

_ARITH = prepare.PrepareSettings()
_TWOWAY = prepare.settings_from_flags({"variant": "twoway"})

#: the two-way variant (docs/mathtask.md): SmolLM2-135M-Instruct (the default model) on True/False and
#: which-is-bigger questions. Its shape was chosen by benchmarks/bench_mathtask_speed.py: 2 threads in one process,
#: 16 prompts x 4 responses a step in two actor and two critic updates; 20 steps, validated before training and
#: after the last step, take about 35 minutes on 2 cores
_TWOWAY_STEPS = 20
TWOWAY = TaskSpec(
    name="twoway", task="twoway", multi_turn=False, data_sources=(TWOWAY_DATA_SOURCE,),
    prepare_module="verl_group_ppo.tasks.maths.prepare", prepare_args=("--variant", "twoway"),
    work_dir="runs/cpu-twoway", prompt_length=_TWOWAY.max_prompt_length, response_length=_TWOWAY.response_length,
    train_batch=16, rollout_n=4, steps=_TWOWAY_STEPS, actor_lr=1e-5, critic_lr=5e-5, actor_mini_batches=2,
    critic_mini_batches=2, val_before_train=True, test_freq=_TWOWAY_STEPS, threads=2,
    project="verl_group_ppo_cpu_twoway", accuracy_band=(_TWOWAY.min_sampled_accuracy, _TWOWAY.max_sampled_accuracy))

#: the arithmetic variant (docs/mathtask.md): SmolLM2-135M-Instruct (the default model) on two- and three-step
#: integer arithmetic with free-form answers, one data source per module, replies of up to 64 tokens after a worked
#: example; validated on 1024 questions before training, in the middle and after the last step. Actor lr 5e-6: at
#: 2e-5 the validation accuracy fell with GROUP-PPO and with GRPO (results.md)
_ARITH_STEPS = 16
ARITH = TaskSpec(
    name="arith", task="arith", multi_turn=False,
    data_sources=tuple(arith_data_source(m) for m in _ARITH.modules.split(",")),
    prepare_module="verl_group_ppo.tasks.maths.prepare", prepare_args=(), work_dir="runs/cpu-arith",
    prompt_length=_ARITH.max_prompt_length, response_length=_ARITH.response_length, train_batch=8, rollout_n=4,
    steps=_ARITH_STEPS, actor_lr=5e-6, critic_lr=5e-5, actor_mini_batches=2, critic_mini_batches=2,
    val_before_train=True, test_freq=_ARITH_STEPS // 2, threads=2, project="verl_group_ppo_cpu_arith",
    accuracy_band=(_ARITH.min_sampled_accuracy, _ARITH.max_sampled_accuracy), temperature=_ARITH.temperature)

TASK = Task(name="maths", specs=(TWOWAY, ARITH), data_sources=reward.DATA_SOURCES,
            compute_score=reward.compute_score, scorer_modules=reward.SCORER_MODULES, extra=reward.SCORER_EXTRA)
