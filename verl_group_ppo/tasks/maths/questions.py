"""School-level maths questions from DeepMind's ``mathematics_dataset`` (Saxton et al., 2019), drawn reproducibly.

A module is named ``area.module`` (``comparison.pair``, ``arithmetic.mixed``, ...) and draws its questions within
an entropy range; ``train-easy`` is the first third of that range, ``train-medium`` the second, ``train-hard`` the
last, as the dataset's own generator splits it. Draws are made with the three generators the dataset uses, Python's,
NumPy's and sympy's own (``numbers.is_prime`` draws primes with ``sympy.randprime``), all seeded per draw, so a
(modules, difficulty, seed, count) tuple gives the same questions in every process. Questions longer than the
dataset's own limits (160 characters, answers of 30) are dropped and redrawn, as its generator does.

Only modules whose answers :mod:`verl_group_ppo.tasks.maths.answers` reads (a number, True/False or an option letter)
are offered (:data:`MODULES`); the ``*_composed`` modules also need a NumPy alias that NumPy 2 removed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from . import sympy_shim
from .answers import answer_kind

#: the modules offered, each answering with a number, True/False or an option letter
MODULES: tuple[str, ...] = (
    "arithmetic.add_or_sub", "arithmetic.add_sub_multiple", "arithmetic.div", "arithmetic.mixed", "arithmetic.mul",
    "arithmetic.mul_div_multiple", "arithmetic.nearest_integer_root",
    "comparison.closest", "comparison.kth_biggest", "comparison.pair",
    "numbers.div_remainder", "numbers.gcd", "numbers.is_factor", "numbers.is_prime", "numbers.lcm",
    "numbers.place_value", "numbers.round_number",
)
#: difficulty name -> the third of each module's entropy range it draws from
DIFFICULTIES: dict[str, int] = {"train-easy": 0, "train-medium": 1, "train-hard": 2}
MAX_QUESTION_LENGTH, MAX_ANSWER_LENGTH = 160, 30


@dataclass(frozen=True)
class Question:
    """One question: the module it came from, its text and its exact answer (as the dataset writes it)."""

    module: str
    question: str
    answer: str


def check_modules(modules: Sequence[str], offered: Sequence[str] = MODULES) -> tuple[str, ...]:
    """``modules`` as a tuple, or ValueError naming the argument and listing ``offered`` (default :data:`MODULES`)."""
    if isinstance(modules, str) or not modules:
        raise ValueError(f"modules: give a non-empty list of module names, got {modules!r}")
    unknown = [m for m in modules if m not in offered]
    if unknown:
        raise ValueError(f"modules: {unknown} not offered; choose from {list(offered)}")
    if len(set(modules)) != len(modules):
        raise ValueError(f"modules: {list(modules)} names a module twice")
    return tuple(modules)


def generators(modules: Sequence[str], difficulty: str) -> dict[str, object]:
    """The dataset's question generator of each module at ``difficulty`` (callables returning a problem)."""
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty: {difficulty!r} is not one of {list(DIFFICULTIES)}")
    level = DIFFICULTIES[difficulty]

    def entropy_fn(range_: tuple[float, float]) -> tuple[float, float]:
        low, high = range_
        return low + level * (high - low) / 3, low + (level + 1) * (high - low) / 3

    registry = sympy_shim.import_modules().train(entropy_fn)
    return {name: registry[name.split(".")[0]][name.split(".")[1]] for name in check_modules(modules)}


def draw(modules: Sequence[str], difficulty: str, count: int, seed: int) -> list[Question]:
    """``count`` questions, taking the modules in turn (module i gets question i, i + len(modules), ...)."""
    import numpy as np
    import sympy.core.random

    if count < 0:
        raise ValueError(f"count: must be >= 0, got {count}")
    makers = generators(modules, difficulty)
    random.seed(seed)
    np.random.seed(seed)
    sympy.core.random.seed(seed)
    names = list(makers)
    return [_draw_one(names[i % len(names)], makers[names[i % len(names)]]) for i in range(count)]


def _draw_one(module: str, maker) -> Question:
    while True:
        problem = maker()
        question, answer = str(problem.question), str(problem.answer)
        if len(question) <= MAX_QUESTION_LENGTH and len(answer) <= MAX_ANSWER_LENGTH:
            answer_kind(answer)  # a module offered must answer in a form the scorer reads
            return Question(module, question, answer)


def train_test_split(modules: Sequence[str], difficulty: str, n_train: int, n_test: int,
                     seed: int) -> tuple[list[Question], list[Question]]:
    """Disjoint train and test questions: the test set is drawn with ``seed``, the training set with ``seed + 1``,
    and any training question whose text is also a test question's is dropped (so ``len(train) <= n_train``)."""
    test = draw(modules, difficulty, n_test, seed)
    seen = {q.question for q in test}
    train = [q for q in draw(modules, difficulty, n_train, seed + 1) if q.question not in seen]
    return train, test
