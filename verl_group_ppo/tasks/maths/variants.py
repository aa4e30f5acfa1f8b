"""The maths-question task's variants: which questions each asks and the settings whose defaults differ for it.

Each variant is one :class:`MathsVariant` in :data:`VARIANTS` under its ``name`` (the prepare settings'
``variant``, ``--variant``); :func:`~.prepare.prepare` looks the settings' variant up once and the rest of its
pipeline is shared. A variant holds, beyond its ``name`` and ``defaults``
(:class:`~verl_group_ppo.tasks.contract.Variant`), ``make_task(modules, difficulty, prompt)``: the task object
(:mod:`.task`) that draws its questions, asks them, scores a reply and writes verl's rows.

* ``arith`` (the dataclass defaults): two- and three-step integer arithmetic (:class:`~.task.ArithTask`);
* ``twoway``: DeepMind's ``mathematics_dataset`` questions with two possible answers (:class:`~.task.MathTask`).

Another variant of the task is one more :class:`MathsVariant` in :data:`VARIANTS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Callable

from ..contract import Variant
from .task import DEFAULT_PROMPT, ArithTask, MathTask

#: the modules of each variant its task-choice rule picked (docs/mathtask.md)
ARITH_MODULES = "arith.mul_add,arith.mul_sub,arith.mul_add_mul"
TWOWAY_MODULES = "comparison.pair,numbers.is_factor,numbers.is_prime"
#: the sampling temperature the arith task's choice picked (the launcher's rollout temperature)
ARITH_TEMPERATURE = 0.7


@dataclass(frozen=True)
class MathsVariant(Variant):
    """One variant of the maths-question task (the module docstring lists the members)."""

    make_task: Callable[[tuple[str, ...], str, str], ArithTask | MathTask]


VARIANTS: dict[str, MathsVariant] = {v.name: v for v in (
    MathsVariant(name="arith", defaults=MappingProxyType({}),
                 make_task=lambda modules, difficulty, prompt: ArithTask(modules)),
    MathsVariant(name="twoway", defaults=MappingProxyType({
        "modules": TWOWAY_MODULES, "prompt": DEFAULT_PROMPT, "n_test": 128, "response_length": 16,
        "max_prompt_length": 48, "temperature": 1.0, "check_questions": 0, "check_samples": 2,
        "min_sampled_accuracy": 0.10, "max_sampled_accuracy": 0.60, "min_answered": 0.0}),
                 make_task=lambda modules, difficulty, prompt: MathTask(modules, difficulty, prompt)),
)}
