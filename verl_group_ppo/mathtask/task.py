"""The maths-question task (DeepMind's questions for a pretrained LM): which questions, how they are asked, and the
rows verl trains on.

:class:`MathTask` holds everything a variant of the task is: the modules and difficulty of the questions, the prompt
that asks them, the reply length, and from these the verl rows (``data_source``, ``prompt`` as chat messages,
``reward_model.ground_truth``, ``extra_info``). verl scores the rows with
:func:`verl_group_ppo.mathtask.reward.compute_score`.
:data:`PROMPTS` are the ways of asking that the task's choice measured (docs/mathtask.md, "How the task was chosen").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

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

    def messages(self, question: str) -> list[dict[str, str]]:
        """The chat messages asking ``question``."""
        return PROMPTS[self.prompt](question)

    def split(self, n_train: int, n_test: int, seed: int) -> tuple[list[Question], list[Question]]:
        """Disjoint (train, test) questions, drawn reproducibly (:func:`questions.train_test_split`)."""
        return train_test_split(self.modules, self.difficulty, n_train, n_test, seed)

    def row(self, question: Question, split: str, index: int) -> dict[str, Any]:
        """One row in verl's RL dataset format."""
        return {
            "data_source": DATA_SOURCE,
            "prompt": self.messages(question.question),
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": question.answer},
            "extra_info": {"split": split, "index": index, "module": question.module, "question": question.question},
        }
