"""Reading the final answer out of a model's reply and scoring it against ``mathematics_dataset``'s answer.

Pure text in, numbers out (no torch, no verl). The rule, for every reply:

* the **final answer** is the *last* answer-shaped item of the reply, of the kind the ground truth has:

  ========================  ==========================================  ========================================
  ground truth              answer-shaped item in the reply             equal when
  ========================  ==========================================  ========================================
  a number: ``-2``,         a number: optional sign, digits with        the two are the same rational number
  ``57.2``, ``-1/269``      optional decimals, optional ``/digits``     (``0.5`` equals ``1/2``, ``-3.0`` equals
                            (``1,234`` and ``\u2212`` 5 are read too)   ``-3``)
  ``True`` / ``False``      ``true``, ``false``, ``yes`` or ``no``      same truth value
  an option letter ``c``    ``(c)``, or the whole reply ``c`` / ``c)``  same letter
  ========================  ==========================================  ========================================

* a reply with no such item has **no answer** and scores 0.

Taking the last item, not the first, scores what the model concludes rather than the question it may restate
("1419 + 2 = 1421" answers 1421). A reply that ends on a wrong number scores 0 even if a right one came earlier:
the reward teaches the model to end on its answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Optional, Union

Answer = Union[Fraction, bool, str]

_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\u2013": "-"})
#: a number: sign, digits (thousands groups with commas allowed), decimals, an optional fraction bar and digits
_NUMBER = re.compile(r"(?<![\w.])([-+]?)\s?(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?(?:\s?/\s?(\d+)(?!\.\d))?")
_BOOLEAN = re.compile(r"\b(true|false|yes|no)\b", re.IGNORECASE)
_OPTION = re.compile(r"\(([a-z])\)")
_BARE_OPTION = re.compile(r"^\s*\(?([a-z])[).]?\s*$")
_GROUND_TRUTH_NUMBER = re.compile(r"^-?\d+(?:\.\d+)?(?:/\d+)?$")


@dataclass(frozen=True)
class Scored:
    """One reply scored: ``score`` 1.0 or 0.0, whether it held an answer of the right kind at all, and whether
    the reply is nothing but that answer (optionally with a full stop): the answer format the prompt asks for."""

    score: float
    answered: bool
    bare: bool


def answer_kind(ground_truth: str) -> str:
    """``number``, ``boolean`` or ``option`` for a ground-truth answer string; ValueError for any other (lists,
    surds, polynomials: answers this scorer does not read)."""
    text = ground_truth.strip()
    if text in ("True", "False"):
        return "boolean"
    if re.fullmatch(r"[a-z]", text):
        return "option"
    if _GROUND_TRUTH_NUMBER.match(text):
        return "number"
    raise ValueError(f"ground_truth: {ground_truth!r} is not a number, True/False or an option letter")


def parse_ground_truth(ground_truth: str) -> Answer:
    """The ground truth as the value :func:`final_answer` returns for a reply of its kind."""
    kind, text = answer_kind(ground_truth), ground_truth.strip()
    if kind == "boolean":
        return text == "True"
    return text if kind == "option" else Fraction(text)


def numbers_in(text: str) -> list[Fraction]:
    """Every number in ``text``, in order, as exact rationals: ``-0.989``, ``1735/4``, ``1,421``, ``\u22125``.
    A fraction with a zero denominator is skipped."""
    found = []
    for sign, digits, decimals, denominator in _NUMBER.findall(text.translate(_MINUS_SIGNS)):
        value = Fraction(digits.replace(",", "") + (decimals or ""))
        if denominator:
            if int(denominator) == 0:
                continue
            value /= int(denominator)
        found.append(-value if sign == "-" else value)
    return found


def final_answer(reply: str, kind: str) -> Optional[Answer]:
    """The last answer-shaped item of ``kind`` (see :func:`answer_kind`) in ``reply``; None when there is none."""
    if kind == "number":
        values = numbers_in(reply)
        return values[-1] if values else None
    if kind == "boolean":
        words = _BOOLEAN.findall(reply)
        return words[-1].lower() in ("true", "yes") if words else None
    if kind == "option":
        letters = _OPTION.findall(reply)
        if letters:
            return letters[-1]
        bare = _BARE_OPTION.match(reply)
        return bare.group(1) if bare else None
    raise ValueError(f"kind: expected number, boolean or option, got {kind!r}")


def score_reply(reply: str, ground_truth: str) -> Scored:
    """Score ``reply`` against ``ground_truth`` by the module's rule (exact match of the final answer)."""
    kind = answer_kind(ground_truth)
    answer = final_answer(reply, kind)
    if answer is None:
        return Scored(0.0, False, False)
    correct = answer == parse_ground_truth(ground_truth)
    return Scored(1.0 if correct else 0.0, True, _is_bare(reply, kind))


def _is_bare(reply: str, kind: str) -> bool:
    """True when the reply is one item of ``kind`` and nothing else (a trailing full stop allowed)."""
    text = reply.strip().rstrip(".").strip()
    if kind == "number":
        return bool(text) and _NUMBER.fullmatch(text.translate(_MINUS_SIGNS)) is not None
    if kind == "boolean":
        return _BOOLEAN.fullmatch(text) is not None
    return _BARE_OPTION.match(text) is not None or _OPTION.fullmatch(text) is not None
