"""Scoring free-form numeric answers by the reply's final number.

Pure text in, numbers out (no torch, no verl). Meant for questions whose answer is one number (``-2``, ``57.2``,
``-1/269``) and replies that may show working before it: the reply's **final number** is its answer, so a reply
that restates the question or works through steps is scored on what it ends with ("12 + 30 = 42" answers 42).

What counts as a number (lenient, :func:`final_number`):

* integers and decimals with an optional sign: ``7``, ``-3``, ``+2``, ``0.25``, ``.5``, with the Unicode minus
  ``\u2212`` read as ``-``; a sign counts only when it touches the digits and does not follow a word or a digit
  (``5-3`` and ``5 - 3`` hold 5 and 3, ``= -3`` holds -3);
* thousands separators: ``1,234,567``; ``1,2`` and ``3, 4`` are two numbers;
* fractions ``a/b`` (spaces around the bar allowed) and LaTeX ``\\frac{a}{b}``; a zero denominator is no number;
* a trailing full stop ends the number (``42.`` is 42); digits glued to letters (``x2``) are not a number.

A number's canonical string is its exact rational value as :class:`fractions.Fraction` writes it: ``1234``,
``-3``, ``1/2`` (for ``0.5``), ``-7/4`` (for ``-1.75``); two answers are equal when their rationals are.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from fractions import Fraction

_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\ufe63": "-", "\uff0d": "-"})
_LATEX_FRACTION = re.compile(r"\\d?frac\s*\{\s*([-+]?\d+)\s*\}\s*\{\s*(\d+)\s*\}")
_NUMBER = re.compile(
    r"(?:(?<![\w)\].])(?P<sign>[-+]))?"  # a sign that follows neither a word, a digit nor a bracket
    r"(?<![\w.])"  # not glued to a word or another number's decimals
    r"(?P<whole>\d{1,3}(?:,\d{3})+(?!,?\d)|\d+|(?=\.\d))"  # 1,234,567 | 1234 | nothing before ".5"
    r"(?P<decimals>\.\d+)?"
    r"(?:\s*/\s*(?P<denominator>\d+)(?!\.\d))?"
)


def _fractions_in(text: str) -> list[Fraction]:
    """Every number in ``text``, in order, as exact rationals (see the module's rules)."""
    text = _LATEX_FRACTION.sub(r"\1/\2", text.translate(_MINUS_SIGNS))
    found = []
    for match in _NUMBER.finditer(text):
        whole, decimals, denominator = match.group("whole"), match.group("decimals"), match.group("denominator")
        if not whole and not decimals:
            continue
        value = Fraction((whole or "0").replace(",", "") + (decimals or ""))
        if denominator is not None:
            if int(denominator) == 0:
                continue
            value /= int(denominator)
        found.append(-value if match.group("sign") == "-" else value)
    return found


def canonical(value: Fraction) -> str:
    """The canonical string of a rational: ``Fraction``'s own (``1234``, ``-3``, ``1/2``)."""
    return str(value)


def parse_number(text: str) -> Fraction | None:
    """``text`` as an exact rational when it is one number and nothing else (surrounding spaces and a trailing
    full stop allowed, same rules as :func:`final_number`); None otherwise."""
    stripped = text.strip().rstrip(".").strip()
    values = _fractions_in(stripped)
    if len(values) != 1:
        return None
    probe = _LATEX_FRACTION.sub(r"\1/\2", stripped.translate(_MINUS_SIGNS))
    match = _NUMBER.fullmatch(probe)
    return values[0] if match is not None else None


def final_number(text: str) -> str | None:
    """The canonical string (:func:`canonical`) of the last number in ``text``; None when it holds none.

    >>> final_number("3 + 4 = 7, so the answer is 7.")
    '7'
    >>> final_number("Answer: \u22120.5")
    '-1/2'
    """
    if not isinstance(text, str):
        raise TypeError(f"text: expected a str, got {type(text).__name__}")
    values = _fractions_in(text)
    return canonical(values[-1]) if values else None


def _truth(truth: str) -> Fraction:
    value = parse_number(truth) if isinstance(truth, str) else None
    if value is None:
        raise ValueError(f"truth: {truth!r} is not one number")
    return value


def numbers_equal(predicted: str, truth: str) -> bool:
    """True when ``predicted`` and ``truth`` are the same rational number (``0.5`` and ``1/2``, ``-4`` and
    ``-4.0``, ``1,000`` and ``1000``). A ``predicted`` that is not one number is unequal; a ``truth`` that is not
    one number raises ValueError naming it."""
    expected = _truth(truth)
    value = parse_number(predicted) if isinstance(predicted, str) else None
    return value is not None and value == expected


def score_final_number(reply: str, ground_truth: str) -> dict[str, float]:
    """One reply scored by its final number, as verl's reward dict: ``score`` 1.0 when the reply's final number
    equals ``ground_truth`` (else 0.0, also for a reply without a number) and ``answered`` 1.0 when the reply
    holds a number at all."""
    expected = _truth(ground_truth)
    answer = final_number(reply)
    if answer is None:
        return {"score": 0.0, "answered": 0.0}
    return {"score": 1.0 if Fraction(answer) == expected else 0.0, "answered": 1.0}


def guessing_floor(answers: Sequence[str]) -> tuple[str, float]:
    """The best constant answer to questions with ``answers`` (the most frequent value, canonical; the first seen
    on a tie) and the share of the questions it gets right: the accuracy a policy reaches without reading the
    question. ValueError when ``answers`` is empty or holds something that is not one number."""
    if isinstance(answers, str) or not answers:
        raise ValueError(f"answers: give a non-empty sequence of answer strings, got {answers!r}")
    counts = Counter(canonical(_truth(a)) for a in answers)
    best, hits = counts.most_common(1)[0]
    return best, hits / len(answers)
