"""The maths-question task's two variants: which questions, how they are asked, how a reply is scored, and the rows
verl trains on.

* :class:`ArithTask` (``arith``, the launcher's ``TASK=arith``): two- and three-step integer arithmetic
  (:mod:`.arith`), each question shown after its module's worked example (:func:`worked_messages`), a reply scored
  by its final number (:func:`~.numeric.score_final_number`), and one ``data_source`` per module
  (:func:`arith_data_source`), so verl's validation reports every module apart.
* :class:`MathTask` (``twoway``): DeepMind's ``mathematics_dataset`` modules, every one of the chosen three a choice
  between two answers, scored by the last answer-shaped item (:func:`~.answers.score_reply`), one ``data_source``.
  :data:`PROMPTS` are the ways of asking its choice measured (docs/mathtask.md).

Each task gives the verl rows (``data_source``, ``prompt`` as chat messages, ``reward_model.ground_truth``,
``extra_info``) and its ``score(reply, ground_truth)``, which verl's reward reaches through
:func:`verl_group_ppo.tasks.maths.reward.compute_score`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from . import arith
from .answers import score_reply
from .numeric import score_final_number
from .questions import DIFFICULTIES, Question, check_modules, train_test_split

DATA_SOURCE = "verl_group_ppo/smollm2_math"
_ANSWER_ONLY = "Give only the final answer."


def _default(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{question} {_ANSWER_ONLY}"}]


def _short(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": _ANSWER_ONLY}, {"role": "user", "content": question}]


def _calculator(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": "You are a calculator. Reply with the answer only."},
            {"role": "user", "content": question}]


#: prompt name -> the chat messages asking a question. ``default`` leaves the system message to SmolLM2's chat
#: template (which then adds its default one, about 20 tokens).
PROMPTS: dict[str, Callable[[str], list[dict[str, str]]]] = {
    "default": _default, "short": _short, "calculator": _calculator}


#: the prompt the task-choice rule picked
DEFAULT_PROMPT = "calculator"


@dataclass(frozen=True)
class MathTask:
    """A variant of the task: questions of ``modules`` at ``difficulty``, asked with ``prompt``."""

    modules: tuple[str, ...]
    difficulty: str = "train-easy"
    prompt: str = DEFAULT_PROMPT

    def __post_init__(self) -> None:
        object.__setattr__(self, "modules", check_modules(self.modules))
        if self.difficulty not in DIFFICULTIES:
            raise ValueError(f"difficulty: {self.difficulty!r} is not one of {list(DIFFICULTIES)}")
        if self.prompt not in PROMPTS:
            raise ValueError(f"prompt: {self.prompt!r} is not one of {list(PROMPTS)}")

    def messages(self, question: Question) -> list[dict[str, str]]:
        """The chat messages asking ``question``."""
        return PROMPTS[self.prompt](question.question)

    @staticmethod
    def score(reply: str, ground_truth: str) -> dict[str, float]:
        """verl's reward dict of one reply: ``score`` (1.0 for the right answer), ``answered`` (the reply holds an
        answer of the right kind) and ``bare`` (it is nothing but the answer)."""
        scored = score_reply(reply, ground_truth)
        return {"score": scored.score, "answered": float(scored.answered), "bare": float(scored.bare)}

    def split(self, n_train: int, n_test: int, seed: int) -> tuple[list[Question], list[Question]]:
        """Disjoint (train, test) questions, drawn reproducibly (:func:`questions.train_test_split`)."""
        return train_test_split(self.modules, self.difficulty, n_train, n_test, seed)

    def row(self, question: Question, split: str, index: int) -> dict[str, Any]:
        """One row in verl's RL dataset format."""
        return {
            "data_source": DATA_SOURCE,
            "prompt": self.messages(question),
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": question.answer},
            "extra_info": {"split": split, "index": index, "module": question.module, "question": question.question},
        }


#: the system message of the ``arith`` task's prompt
WORKED_SYSTEM = "Solve the problem step by step. End with 'Answer: <number>'."
#: the ``arith`` task's data sources: this prefix and the module's name without ``arith.``
ARITH_SOURCE_PREFIX = "verl_group_ppo/arith/"


def worked_messages(module: str, question: str) -> list[dict[str, str]]:
    """The ``arith`` prompt: :data:`WORKED_SYSTEM`, the module's worked example as a finished exchange, then
    ``question``."""
    worked = arith.MODULES[arith.check_modules([module])[0]]
    return [{"role": "system", "content": WORKED_SYSTEM}, {"role": "user", "content": worked.worked_question},
            {"role": "assistant", "content": worked.worked_reply}, {"role": "user", "content": question}]


def arith_data_source(module: str) -> str:
    """The ``data_source`` of a module's rows: ``verl_group_ppo/arith/mul_add`` for ``arith.mul_add``."""
    return ARITH_SOURCE_PREFIX + arith.check_modules([module])[0].split(".", 1)[1]


#: every ``arith`` data source
ARITH_DATA_SOURCES = frozenset(arith_data_source(m) for m in arith.MODULES)


@dataclass(frozen=True)
class ArithTask:
    """The ``arith`` variant: questions of ``modules`` (:data:`arith.MODULES`), each asked after its module's worked
    example and scored by the reply's final number."""

    modules: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "modules", arith.check_modules(self.modules))

    @property
    def data_sources(self) -> tuple[str, ...]:
        return tuple(arith_data_source(m) for m in self.modules)

    def messages(self, question: Question) -> list[dict[str, str]]:
        """The chat messages asking ``question`` (:func:`worked_messages`)."""
        return worked_messages(question.module, question.question)

    @staticmethod
    def score(reply: str, ground_truth: str) -> dict[str, float]:
        """verl's reward dict of one reply: ``score`` (1.0 when its final number is the answer) and ``answered``
        (it holds a number)."""
        return score_final_number(reply, ground_truth)

    def split(self, n_train: int, n_test: int, seed: int) -> tuple[list[Question], list[Question]]:
        """Disjoint (train, test) questions, drawn reproducibly (:func:`arith.train_test_split`)."""
        return arith.train_test_split(self.modules, n_train, n_test, seed)

    def row(self, question: Question, split: str, index: int) -> dict[str, Any]:
        """One row in verl's RL dataset format; ``data_source`` names the question's module."""
        return {
            "data_source": arith_data_source(question.module),
            "prompt": self.messages(question),
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": question.answer},
            "extra_info": {"split": split, "index": index, "module": question.module, "question": question.question},
        }
