"""The numeric scorer (``verl_group_ppo.tasks.maths.numeric``) and the pure parts of the numeric task's choice
benchmark (``benchmarks/bench_arith_task_choice.py``); no model."""

from __future__ import annotations

import importlib
import sys
from collections import Counter
from fractions import Fraction
from pathlib import Path

import pytest

from verl_group_ppo.tasks.maths import questions
from verl_group_ppo.tasks.maths.numeric import (
    final_number,
    guessing_floor,
    numbers_equal,
    score_final_number,
)

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "benchmarks") not in sys.path:
    sys.path.insert(0, str(REPO / "benchmarks"))  # what `python benchmarks/<name>.py` does (benchlib's convention)


def bench():
    return importlib.import_module("bench_arith_task_choice")


# ----------------------------------------------------------------------------------------------------------------------
# final_number


@pytest.mark.parametrize("reply, expected", [
    ("42", "42"),
    ("The answer is 42.", "42"),
    ("Answer: 7", "7"),
    ("3 + 4 = 7, so the answer is 7.", "7"),
    ("First 12 * 3 = 36. Then 36 - 5 = 31. Answer: 31", "31"),
    ("It is 3/4.", "3/4"),
    ("It is 3 / 4", "3/4"),
    (r"So $\frac{3}{4}$.", "3/4"),
    ("Answer: -2.5", "-5/2"),
    ("Answer: \u22122.5", "-5/2"),
    ("x = -0.75", "-3/4"),
    ("about .5", "1/2"),
    ("The total is 1,234,567.", "1234567"),
    ("1,234, then 5", "5"),
    ("costs 1,234, in all", "1234"),
    ("the list 1,2", "2"),
    ("5-3", "3"),
    ("5 - 3", "3"),
    ("(-3)", "-3"),
    ("2*-3", "-3"),
    ("step-2", "2"),
    ("+4", "4"),
    ("7.0", "7"),
])
def test_final_number_reads_the_last_number(reply, expected):
    assert final_number(reply) == expected


@pytest.mark.parametrize("reply", ["", "I do not know.", "x2 and y3", "1/0", "Answer: none"])
def test_final_number_is_none_without_a_number(reply):
    assert final_number(reply) is None


def test_final_number_names_a_bad_argument():
    with pytest.raises(TypeError, match="text"):
        final_number(42)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------------------------------
# numbers_equal and score_final_number


@pytest.mark.parametrize("predicted, truth", [
    ("0.5", "1/2"), ("-4", "-4.0"), ("1,000", "1000"), ("\u22123", "-3"), ("6/4", "3/2"), (" 12. ", "12"),
    ("-1/269", "-1/269"), ("0", "-0"), ("2/1", "2"),
])
def test_numbers_equal_is_exact_rational_equality(predicted, truth):
    assert numbers_equal(predicted, truth)


@pytest.mark.parametrize("predicted, truth", [
    ("0.333", "1/3"), ("4", "-4"), ("1,00", "100"), ("", "3"), ("three", "3"), ("3 4", "3"), ("1/0", "0"),
])
def test_numbers_equal_is_false_otherwise(predicted, truth):
    assert not numbers_equal(predicted, truth)


@pytest.mark.parametrize("truth", ["", "True", "3 4", "x"])
def test_numbers_equal_refuses_a_truth_that_is_not_a_number(truth):
    with pytest.raises(ValueError, match="truth"):
        numbers_equal("3", truth)


def test_score_final_number_right_wrong_and_missing():
    assert score_final_number("2 + 3 = 5. Answer: 5", "5") == {"score": 1.0, "answered": 1.0}
    assert score_final_number("Answer: 0.5", "1/2") == {"score": 1.0, "answered": 1.0}
    assert score_final_number("5 is right? No: Answer: 6", "5") == {"score": 0.0, "answered": 1.0}
    assert score_final_number("I cannot tell.", "5") == {"score": 0.0, "answered": 0.0}


def test_score_final_number_on_generated_questions():
    for module in bench().MODULES:
        q = bench().draw(module, 1)[0]
        wrong = str(Fraction(q.answer) + 1)
        assert score_final_number(f"Working... so {q.answer}.", q.answer)["score"] == 1.0, q
        assert score_final_number(f"Answer: {wrong}", q.answer) == {"score": 0.0, "answered": 1.0}, q


# ----------------------------------------------------------------------------------------------------------------------
# guessing_floor


def test_guessing_floor_on_hand_made_answers():
    assert guessing_floor(["1", "2", "2", "3"]) == ("2", 0.5)
    assert guessing_floor(["0.5", "1/2", "2", "-4", "-4.0", "2/4"]) == ("1/2", 0.5)  # equal rationals pool
    assert guessing_floor(["7", "8"]) == ("7", 0.5)  # a tie: the first seen
    assert guessing_floor(["9"]) == ("9", 1.0)


@pytest.mark.parametrize("answers", [[], "12", ["1", "True"]])
def test_guessing_floor_refuses_bad_answers(answers):
    with pytest.raises(ValueError):
        guessing_floor(answers)


def test_guessing_floor_of_generated_gcd_questions_two_ways():
    answers = [q.answer for q in questions.draw(["numbers.gcd"], "train-easy", 300, 0)]
    counts = Counter(int(a) for a in answers)  # gcd answers are positive integers: count them directly
    _, hits = max(counts.items(), key=lambda item: item[1])
    best, share = guessing_floor(answers)
    assert share == hits / len(answers)
    assert counts[int(best)] == hits
    assert 0 < share < 1


# ----------------------------------------------------------------------------------------------------------------------
# the benchmark's pure parts


def _record():
    b = bench()
    sampled = b.summarise(["3 + 4 = 7. Answer: 7", "Answer: 8", "no idea", "so 1/2"], ["7", "7", "7", "0.5"],
                          [True, True, False, True], [10, 4, 64, 6])
    return b.make_record("arithmetic.add_or_sub", "answer_tag", ("7", 0.01), sampled, 40, 12.34,
                         [{"question": "What is 3 + 4?", "answer": "7", "reply": "Answer: 7"}])


def test_summarise_counts_the_figures():
    s = _record()["sampled"]
    assert s == {"answered": 0.75, "correct": 0.5, "correct_among_answered": round(2 / 3, 4), "finished": 0.75,
                 "tagged": 0.5, "mean_length": 21.0, "replies": 4}
    with pytest.raises(ValueError, match="replies"):
        bench().summarise(["1"], [], [], [])


def test_the_rule_and_the_record_hold_no_machine_path():
    from benchlib import machine_paths

    b = bench()
    record = _record()
    assert machine_paths(record) == [] and not b.record_name("answer_tag", "numbers.gcd").startswith("/")
    assert record["kept"] is False  # answered 0.75 < 0.9
    good = {**record, "floor": {"answer": "7", "share": 0.02}, "sampled": {**record["sampled"], "answered": 0.9}}
    assert b.keep(good)
    assert not b.keep({**good, "floor": {"answer": "7", "share": 0.03}})
    assert not b.keep({**good, "sampled": {**good["sampled"], "correct": 0.04}})
    assert not b.keep({**good, "sampled": {**good["sampled"], "correct": 0.51}})
    table = b.report([record, good])
    assert "| arithmetic.add_or_sub | answer_tag | 1 | 0.010 (7) | 0.75 | 0.500 | 0.667 | - |" in table
    assert b.RULE in table and "kept: arithmetic.add_or_sub (answer_tag, T=1)" in table
    assert "chosen: none" in table  # the choice takes the worked prompt's records only


def test_the_choice_takes_temperature_1_when_two_modules_are_kept_else_0_7():
    b = bench()
    base = _record()
    good = {**base, "prompt": "worked", "floor": {"answer": "7", "share": 0.02},
            "sampled": {**base["sampled"], "answered": 0.95, "correct": 0.1}}

    def at(module, temperature, correct=0.1):
        return {**good, "module": module, "temperature": temperature,
                "sampled": {**good["sampled"], "correct": correct}}

    both = [at("arith.mul_add", 1.0), at("arith.mul_sub", 1.0), at("arith.mul_add", 0.7), at("arith.mul_sub", 0.7)]
    assert b.choose(both) == (1.0, ["arith.mul_add", "arith.mul_sub"])
    one_at_1 = [at("arith.mul_add", 1.0), at("arith.mul_sub", 1.0, 0.01), at("arith.mul_add", 0.7),
                at("arith.mul_sub", 0.7)]
    assert b.choose(one_at_1) == (0.7, ["arith.mul_add", "arith.mul_sub"])
    assert b.choose(one_at_1[:2]) is None
    assert b.record_name("worked", "arith.mul_add", 0.7) == "worked-arith.mul_add-t0.7.json"
    assert b.record_name("worked", "arith.mul_add", 1.0) == "worked-arith.mul_add.json"
    assert not b.offered("worked", "numbers.gcd") and b.offered("worked", "arith.mul_add")


def test_every_candidate_module_is_offered_and_numeric():
    from verl_group_ppo.tasks.maths import arith

    b = bench()
    assert set(b.DATASET_MODULES) <= set(questions.MODULES) and set(b.ARITH_MODULES) == set(arith.MODULES)
    for module in b.DATASET_MODULES:
        guessing_floor([q.answer for q in questions.draw([module], "train-easy", 20, 1)])  # raises unless numbers
