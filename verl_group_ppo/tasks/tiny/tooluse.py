"""The tiny tool-use task: the chain task where the model may call a calculator between its turns.

Prompt and verifier are the chain task's (:class:`~verl_group_ppo.tasks.tiny.problems.ChainSumTask`): ``4+7-3+8=``,
reward 1 when the final answer after ``#`` is right. What changes is the response: it is an episode of
assistant turns with tool replies in between. At each step of the chain the model either writes the
running total itself (``11 ``) or ends its turn with a call of the ``add`` tool, written as the step's
arithmetic between two markers::

    assistant: <tool_call>4+7</tool_call>         -> tool: 11
    assistant: 8 <tool_call>8+8</tool_call>       -> tool: 16
    assistant: #16

(here the model computed 11-3 = 8 itself, and called the tool for the first and the last step). The tool
is exact; the model's own steps may slip. So calling the tool pays, but only if the call copies the right
operands (the last total, the prompt's next term). The supervised warm start imitates episodes in which
each step calls the tool with probability ``tool_prob`` and slips with probability ``slip_prob`` when it
does not: a noisy agent that calls the tool on some steps and slips on others, with room for RL to learn
to call it (:func:`scripted_episode`).

This module is the task alone (text in, text out; no verl, no torch). verl's side: the function tool
``add`` and the ``tinycalc`` tool-call format (:mod:`verl_group_ppo.tasks.tiny.calculator_tool`,
:mod:`verl_group_ppo.tasks.tiny.tool_parser`); the model, tokenizer and data: :mod:`verl_group_ppo.tasks.tiny.prepare`
with ``--tools``.
"""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass

from .problems import ANSWER_MARK, ChainSumTask, Problem, answer_is_right

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
#: the tool-call format's name, as ``actor_rollout_ref.rollout.multi_turn.format`` names it
TOOL_FORMAT = "tinycalc"
#: the tool's name (``add(a, b)``)
TOOL_NAME = "add"
#: the one definition of how a call of ``add(a, b)`` is written: literal text and three fields, ``a``, ``op``
#: (``+``, or ``-`` for a negative ``b``) and ``abs_b``. :func:`format_call`, the pattern :func:`parse_calls`
#: reads and the chat template's Jinja (:func:`call_jinja`) are all built from it.
CALL_LAYOUT = CALL_OPEN + "{a}{op}{abs_b}" + CALL_CLOSE
#: each field of :data:`CALL_LAYOUT` as (the regex it is read with, its Jinja over the arguments ``args``)
_FIELDS = {"a": (r"-?\d+", "{{ args['a'] }}"),
           "op": (r"[+-]", "{{ '-' if args['b'] < 0 else '+' }}"),
           "abs_b": (r"\d+", "{{ args['b'] | abs }}")}


def _layout_pieces() -> list[tuple[str, str | None]]:
    """:data:`CALL_LAYOUT` as (literal text, field name or None) pairs, in order."""
    return [(literal, field) for literal, field, _, _ in string.Formatter().parse(CALL_LAYOUT)]


def _call_pattern() -> re.Pattern[str]:
    """The regex of a call: the layout's literal text and its fields as named groups, spaces allowed between."""
    parts = []
    for literal, field in _layout_pieces():
        parts += [re.escape(literal)] if literal else []
        parts += [f"(?P<{field}>{_FIELDS[field][0]})"] if field else []
    return re.compile(r"\s*".join(parts))


_CALL = _call_pattern()


def add(a: int, b: int) -> int:
    """The calculator: ``a + b`` (subtraction is the addition of a negative ``b``)."""
    return int(a) + int(b)


def format_call(a: int, b: int) -> str:
    """The text of a call of ``add(a, b)``: ``<tool_call>11-3</tool_call>`` for ``add(11, -3)``."""
    return CALL_LAYOUT.format(a=int(a), op="-" if b < 0 else "+", abs_b=abs(int(b)))


def parse_calls(text: str) -> tuple[str, list[tuple[int, int]]]:
    """The calls in an assistant turn's text as ``(a, b)`` pairs of ``add``, and the text without them.

    A marker pair whose inside is not ``<int>+<int>`` or ``<int>-<int>`` is not a call (it stays in the text).
    """
    calls = [(int(m["a"]), int(m["abs_b"]) if m["op"] == "+" else -int(m["abs_b"])) for m in _CALL.finditer(text)]
    return _CALL.sub("", text), calls


def call_jinja() -> str:
    """Jinja that writes the call :func:`format_call` writes, for the call's arguments in the Jinja variable
    ``args`` (a mapping with ``a`` and ``b``, as in an OpenAI-style ``tool_calls`` entry); it writes nothing for
    arguments of any other shape. Chat templates write an assistant message's calls with it."""
    body = "".join(literal + (_FIELDS[field][1] if field else "") for literal, field in _layout_pieces())
    return "{% if args is mapping and 'a' in args and 'b' in args %}" + body + "{% endif %}"


def chain_steps(problem: Problem) -> tuple[int, list[int]]:
    """A chain problem's first term and its signed later terms: ``4+7-3+8=`` -> ``(4, [7, -3, 8])``."""
    tokens = problem.entry["metadata"]["expression"].split()
    terms = [int(num) if op == "+" else -int(num) for op, num in zip(tokens[1::2], tokens[2::2])]
    return int(tokens[0]), terms


@dataclass(frozen=True)
class Episode:
    """A scripted episode: the assistant turns' texts and the tool's reply after each turn but the last."""

    turns: tuple[str, ...]
    replies: tuple[str, ...]

    @property
    def num_calls(self) -> int:
        return len(self.replies)


def scripted_episode(problem: Problem, rng: random.Random, tool_prob: float, slip_prob: float) -> Episode:
    """An episode the warm start imitates: each step calls the tool with probability ``tool_prob``; a step the
    model writes itself slips to a near miss (off by 1-3) with probability ``slip_prob``, and the chain
    goes on from the slipped total (so the answer is wrong)."""
    for name, p in (("tool_prob", tool_prob), ("slip_prob", slip_prob)):
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {p}")
    total, terms = chain_steps(problem)
    turns, replies, text = [], [], ""
    for term in terms:
        if rng.random() < tool_prob:
            turns.append(text + format_call(total, term))
            total = add(total, term)
            replies.append(str(total))
            text = ""
        else:
            total = add(total, term)
            if rng.random() < slip_prob:
                total += rng.choice((-3, -2, -1, 1, 2, 3))
            text += f"{total} "
    turns.append(f"{text}{ANSWER_MARK}{total}")
    return Episode(tuple(turns), tuple(replies))


def score_transcript(transcript: str, problem: Problem, task: ChainSumTask) -> float:
    """1.0 when the episode's final answer (the text after its last ``#``) is right by the chain task's scorer,
    else 0.0. ``transcript`` is the whole response as verl decodes it, tool replies included (they never hold
    ``#``); only the final answer is graded, since the running totals are partly the tool's."""
    return answer_is_right(transcript, problem, task)
