"""Two- and three-step integer arithmetic with free-form answers, drawn reproducibly (the ``arith`` task's questions).

Each module asks one expression over small integers and answers with one integer, so a reply is scored by its final
number (:mod:`verl_group_ppo.tasks.maths.numeric`). The modules are built so that a model can reason in steps (a
product first, then a sum or a difference) and so that no constant answer is right often: every module's guessing
floor, the share of the most frequent answer, is at most 0.02 (measured by :func:`~.numeric.guessing_floor`, tested).

========================  ==========================  =====================================  ==============
module                    question                    ranges                                 steps
========================  ==========================  =====================================  ==============
``arith.mul_add``         ``What is a * b + c?``      a, b in 2..12, c in 2..30              2
``arith.mul_sub``         ``What is a * b - c?``      a, b in 2..12, c in 2..30              2
``arith.mul_add_mul``     ``What is a * b + c * d?``  a, b, c, d in 2..12                    3
``arith.add_sub``         ``What is a + b - c?``      a in 10..99, b, c in 2..9              2
========================  ==========================  =====================================  ==============

:data:`WORKED` holds one worked example per module, the one the ``worked`` prompt shows before the question; a draw
never returns an example's own question.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from . import questions
from .questions import Question


@dataclass(frozen=True)
class Module:
    """One question maker: ``draw(rng)`` returns (question text, integer answer)."""

    name: str
    draw: Callable[[random.Random], tuple[str, int]]
    worked_question: str  # the worked example's question
    worked_reply: str  # the worked example's reply: the steps, then "Answer: N"


def _mul_add(rng: random.Random) -> tuple[str, int]:
    a, b, c = rng.randint(2, 12), rng.randint(2, 12), rng.randint(2, 30)
    return f"What is {a} * {b} + {c}?", a * b + c


def _mul_sub(rng: random.Random) -> tuple[str, int]:
    a, b, c = rng.randint(2, 12), rng.randint(2, 12), rng.randint(2, 30)
    return f"What is {a} * {b} - {c}?", a * b - c


def _mul_add_mul(rng: random.Random) -> tuple[str, int]:
    a, b, c, d = (rng.randint(2, 12) for _ in range(4))
    return f"What is {a} * {b} + {c} * {d}?", a * b + c * d


def _add_sub(rng: random.Random) -> tuple[str, int]:
    a, b, c = rng.randint(10, 99), rng.randint(2, 9), rng.randint(2, 9)
    return f"What is {a} + {b} - {c}?", a + b - c


#: the modules by name
MODULES: dict[str, Module] = {m.name: m for m in (
    Module("arith.mul_add", _mul_add, "What is 6 * 7 + 12?", "6 * 7 = 42. 42 + 12 = 54.\nAnswer: 54"),
    Module("arith.mul_sub", _mul_sub, "What is 6 * 7 - 12?", "6 * 7 = 42. 42 - 12 = 30.\nAnswer: 30"),
    Module("arith.mul_add_mul", _mul_add_mul, "What is 6 * 7 + 3 * 4?",
           "6 * 7 = 42. 3 * 4 = 12. 42 + 12 = 54.\nAnswer: 54"),
    Module("arith.add_sub", _add_sub, "What is 46 + 7 - 5?", "46 + 7 = 53. 53 - 5 = 48.\nAnswer: 48"),
)}


def check_modules(modules: Sequence[str]) -> tuple[str, ...]:
    """``modules`` as a tuple, or ValueError naming the argument and listing :data:`MODULES`."""
    return questions.check_modules(modules, tuple(MODULES))


def draw(modules: Sequence[str], count: int, seed: int) -> list[Question]:
    """``count`` questions, taking the modules in turn (module i gets question i, i + len(modules), ...), from one
    ``random.Random(seed)``; a module's worked example is redrawn, never returned."""
    names = check_modules(modules)
    if count < 0:
        raise ValueError(f"count: must be >= 0, got {count}")
    rng = random.Random(seed)
    out = []
    for i in range(count):
        module = MODULES[names[i % len(names)]]
        while True:
            question, answer = module.draw(rng)
            if question != module.worked_question:
                break
        out.append(Question(module.name, question, str(answer)))
    return out


def train_test_split(modules: Sequence[str], n_train: int, n_test: int,
                     seed: int) -> tuple[list[Question], list[Question]]:
    """Disjoint train and test questions: the test set is drawn with ``seed``, the training set with ``seed + 1``,
    and any training question whose text is also a test question's is dropped (so ``len(train) <= n_train``)."""
    test = draw(modules, n_test, seed)
    seen = {q.question for q in test}
    train = [q for q in draw(modules, n_train, seed + 1) if q.question not in seen]
    return train, test
