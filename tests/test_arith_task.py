"""The maths task's arithmetic variant (``TASK=arith``): its questions, floors, prompt, scorer, splits, prepare
settings, data sources through verl's validation metrics, and its launcher spec; no model."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from verl_group_ppo.tasks import launcher, reward
from verl_group_ppo.tasks.maths import spec as maths_spec
from verl_group_ppo.tasks.maths import arith
from verl_group_ppo.tasks.maths import prepare as maths_prepare
from verl_group_ppo.tasks.maths import reward as maths_reward
from verl_group_ppo.tasks.maths import variants as maths_variants
from verl_group_ppo.tasks.maths.numeric import guessing_floor, score_final_number
from verl_group_ppo.tasks.maths.task import (
    ARITH_DATA_SOURCES,
    WORKED_SYSTEM,
    ArithTask,
    arith_data_source,
    worked_messages,
)

FLOOR_DRAWS = 2000


# ----------------------------------------------------------------------------------------------------------------------
# questions and floors


@pytest.mark.parametrize("module", list(arith.MODULES))
def test_every_module_answers_its_own_expression_with_an_integer(module):
    for q in arith.draw([module], 200, 3):
        expression = q.question.removeprefix("What is ").removesuffix("?")
        assert set(expression) <= set("0123456789 +-*"), q
        assert int(q.answer) == eval(expression), q  # noqa: S307 (digits and + - * only, checked above)


@pytest.mark.parametrize("module", list(arith.MODULES))
def test_every_module_keeps_its_guessing_floor_at_most_0_02_computed_two_ways(module):
    answers = [q.answer for q in arith.draw([module], FLOOR_DRAWS, 0)]
    best, share = guessing_floor(answers)
    counts = Counter(int(a) for a in answers)
    top = max(counts.values())
    assert share == top / FLOOR_DRAWS and counts[int(best)] == top
    assert share <= 0.02, (module, best, share)


def test_a_known_module_floor_and_a_constant_reply_scores_it():
    answers = [q.answer for q in arith.draw(["arith.mul_add"], FLOOR_DRAWS, 0)]
    best, share = guessing_floor(answers)
    constant = sum(score_final_number(f"Answer: {best}", a)["score"] for a in answers) / len(answers)
    assert constant == share and 0.005 < share <= 0.02


def test_draws_are_reproducible_take_modules_in_turn_and_skip_the_worked_examples():
    modules = ["arith.mul_add", "arith.mul_sub", "arith.mul_add_mul"]
    a, b = arith.draw(modules, 300, 5), arith.draw(modules, 300, 5)
    assert a == b and a != arith.draw(modules, 300, 6)
    assert [q.module for q in a[:6]] == modules * 2
    worked = {m.worked_question for m in arith.MODULES.values()}
    assert not any(q.question in worked for q in arith.draw(list(arith.MODULES), 20000, 0))


def test_mul_sub_has_negative_answers():
    assert any(int(q.answer) < 0 for q in arith.draw(["arith.mul_sub"], 500, 0))


@pytest.mark.parametrize("bad, match", [("arith.mul_add", "non-empty list"), ([], "non-empty list"),
                                        (["arith.nope"], "not offered"), (["arith.mul_add"] * 2, "twice")])
def test_bad_modules_are_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=f"modules: .*{match}|modules: {match}"):
        arith.draw(bad, 1, 0)


def test_a_negative_count_is_refused():
    with pytest.raises(ValueError, match="count"):
        arith.draw(["arith.mul_add"], -1, 0)


# ----------------------------------------------------------------------------------------------------------------------
# the lenient final-number scorer on real generated questions


def test_final_number_scorer_on_generated_arith_questions():
    for module in arith.MODULES:
        for q in arith.draw([module], 20, 1):
            truth, value = q.answer, int(q.answer)
            right = f"Let me see. {q.question.removeprefix('What is ').rstrip('?')} takes two steps.\nAnswer: {truth}"
            assert score_final_number(right, truth) == {"score": 1.0, "answered": 1.0}, q
            assert score_final_number(f"Answer: {value + 1}", truth) == {"score": 0.0, "answered": 1.0}, q
            assert score_final_number("I do not know.", truth) == {"score": 0.0, "answered": 0.0}, q
            # several numbers: the last one is the answer, wherever the right one appears before it
            assert score_final_number(f"{truth} or {value - 2}? Answer: {value - 2}", truth)["score"] == 0.0, q
            assert score_final_number(f"{value - 2}, no: {truth}", truth)["score"] == 1.0, q
            assert score_final_number(f"Answer: {value}.0", truth)["score"] == 1.0, q  # a decimal form


def test_negative_answers_with_a_unicode_minus_and_fractions():
    q = next(q for q in arith.draw(["arith.mul_sub"], 500, 0) if int(q.answer) < 0)
    magnitude = q.answer.lstrip("-")
    assert score_final_number(f"Answer: \u2212{magnitude}", q.answer)["score"] == 1.0
    assert score_final_number(f"Answer: {magnitude}", q.answer)["score"] == 0.0  # the sign matters
    assert score_final_number(f"Answer: {2 * int(q.answer)}/2", q.answer)["score"] == 1.0
    assert score_final_number("so -2.5", "-5/2")["score"] == 1.0  # a negative decimal against a fraction


# ----------------------------------------------------------------------------------------------------------------------
# the prompt, the rows, the splits


def test_worked_prompt_shows_the_module_example_before_the_question():
    q = arith.draw(["arith.mul_add_mul"], 1, 0)[0]
    messages = ArithTask(("arith.mul_add_mul",)).messages(q)
    worked = arith.MODULES["arith.mul_add_mul"]
    assert messages == worked_messages(q.module, q.question) == [
        {"role": "system", "content": WORKED_SYSTEM}, {"role": "user", "content": worked.worked_question},
        {"role": "assistant", "content": worked.worked_reply}, {"role": "user", "content": q.question}]
    # the worked reply is right by the task's own scorer
    for m in arith.MODULES.values():
        expression = m.worked_question.removeprefix("What is ").removesuffix("?")
        assert score_final_number(m.worked_reply, str(eval(expression)))["score"] == 1.0  # noqa: S307


def test_rows_name_their_module_as_data_source():
    task = ArithTask(("arith.mul_add", "arith.mul_sub"))
    train, test = task.split(10, 4, 0)
    rows = [task.row(q, "test", i) for i, q in enumerate(test)]
    assert [r["data_source"] for r in rows] == ["verl_group_ppo/arith/mul_add", "verl_group_ppo/arith/mul_sub"] * 2
    assert task.data_sources == ("verl_group_ppo/arith/mul_add", "verl_group_ppo/arith/mul_sub")
    assert rows[0]["reward_model"] == {"style": "rule", "ground_truth": test[0].answer}
    assert rows[0]["extra_info"]["module"] == "arith.mul_add"
    assert set(ARITH_DATA_SOURCES) == {arith_data_source(m) for m in arith.MODULES}


def test_the_launchers_splits_are_disjoint_at_their_sizes():
    settings = maths_prepare.PrepareSettings()
    task = settings.task()
    train, test = task.split(settings.n_train, settings.n_test, settings.seed)
    assert len(test) == settings.n_test >= 512
    assert len(train) > 0.9 * settings.n_train
    assert not {q.question for q in train} & {q.question for q in test}
    per_module = Counter(q.module for q in test)
    assert set(per_module) == set(task.modules) and max(per_module.values()) - min(per_module.values()) <= 1
    assert all(n >= 170 for n in per_module.values())  # every module's validation accuracy has its own SE


# ----------------------------------------------------------------------------------------------------------------------
# the reward through the package's one reward function, and verl's per-source validation metrics


def test_the_reward_dispatches_every_arith_source():
    for source in ARITH_DATA_SOURCES:
        assert reward.compute_score(source, "6 * 7 = 42. 42 + 12 = 54.\nAnswer: 54", "54") == {
            "score": 1.0, "answered": 1.0}
        assert source in maths_reward.DATA_SOURCES
    with pytest.raises(ValueError, match="data_source"):
        maths_reward.compute_score("verl_group_ppo/arith/nope", "1", "1")


def test_per_module_data_sources_reach_verls_validation_metrics():
    from verl.trainer.ppo.metric_utils import process_validation_metrics

    task = ArithTask(("arith.mul_add", "arith.mul_sub", "arith.mul_add_mul"))
    _, test = task.split(0, 30, 0)
    rows = [task.row(q, "test", i) for i, q in enumerate(test)]
    # module i answers its first 10 - 3i... questions right: each module gets its own accuracy
    replies = [f"Answer: {q.answer}" if (i // 3) < 10 - 3 * (i % 3) else "Answer: 100000" for i, q in enumerate(test)]
    scored = [reward.compute_score(r["data_source"], reply, r["reward_model"]["ground_truth"])
              for r, reply in zip(rows, replies)]
    infos = {"reward": [s["score"] for s in scored], "answered": [s["answered"] for s in scored]}
    metrics = process_validation_metrics([r["data_source"] for r in rows], [str(i) for i in range(len(rows))], infos)
    expected = {"verl_group_ppo/arith/mul_add": 1.0, "verl_group_ppo/arith/mul_sub": 0.7,
                "verl_group_ppo/arith/mul_add_mul": 0.4}
    assert set(metrics) == set(expected)
    for source, accuracy in expected.items():
        assert np.isclose(metrics[source]["reward"]["mean@1"], accuracy), (source, metrics[source])
        assert metrics[source]["answered"]["mean@1"] == 1.0


# ----------------------------------------------------------------------------------------------------------------------
# prepare's settings and the launcher's spec


def test_prepare_defaults_are_the_arith_variant_and_twoway_changes_its_own():
    arith_settings = maths_prepare.PrepareSettings()
    assert arith_settings.variant == "arith" and isinstance(arith_settings.task(), ArithTask)
    assert (arith_settings.n_test, arith_settings.response_length, arith_settings.min_answered) == (1024, 64, 0.9)
    twoway = maths_prepare.settings_from_flags({"variant": "twoway", "seed": None})
    assert (twoway.modules, twoway.n_test, twoway.response_length) == (maths_variants.TWOWAY_MODULES, 128, 16)
    assert maths_prepare.settings_from_flags({"variant": "twoway", "n_test": 64}).n_test == 64


@pytest.mark.parametrize("flags, name", [
    ({"variant": "threeway"}, "variant"),
    ({"prompt": "calculator"}, "prompt"),
    ({"difficulty": "train-hard"}, "difficulty"),
    ({"modules": "comparison.pair"}, "modules"),
    ({"variant": "twoway", "modules": "arith.mul_add"}, "modules"),
    ({"temperature": 0.0}, "temperature"),
    ({"check_questions": -1}, "check_questions"),
    ({"min_answered": 1.5}, "min_answered"),
])
def test_bad_prepare_settings_are_refused_by_name(flags, name):
    with pytest.raises(ValueError, match=name):
        maths_prepare.settings_from_flags(flags)


def test_accuracy_check_refuses_a_format_confound_and_the_band():
    settings = maths_prepare.PrepareSettings()
    good = {"greedy": {"correct": 0.3, "answered": 1.0}, "sampled": {"correct": 0.1, "answered": 0.95}}
    maths_prepare.check_accuracy(good, settings)
    with pytest.raises(RuntimeError, match="--min-answered"):
        maths_prepare.check_accuracy({**good, "greedy": {"correct": 0.3, "answered": 0.8}}, settings)
    with pytest.raises(RuntimeError, match="--min-sampled-accuracy"):
        maths_prepare.check_accuracy({**good, "sampled": {"correct": 0.01, "answered": 1.0}}, settings)


def test_pooled_figures_weight_by_replies():
    parts = [{"correct": 0.5, "answered": 1.0, "replies": 10}, {"correct": 0.2, "answered": 0.5, "replies": 30}]
    assert maths_prepare.pooled(parts) == {"correct": 0.275, "answered": 0.625, "replies": 40}
    with pytest.raises(ValueError, match="parts"):
        maths_prepare.pooled([{"correct": 0.0, "replies": 0}])


def test_the_arith_spec_reads_prepare_and_the_launcher_reads_its_temperature():
    spec, settings = maths_spec.ARITH, maths_prepare.PrepareSettings()
    assert launcher.spec_for("arith", 0) is spec
    assert (spec.response_length, spec.prompt_length) == (settings.response_length, settings.max_prompt_length)
    assert spec.accuracy_band == (settings.min_sampled_accuracy, settings.max_sampled_accuracy)
    assert spec.temperature == settings.temperature
    assert spec.data_sources == tuple(arith_data_source(m) for m in settings.modules.split(","))
    assert 0 < spec.test_freq < spec.steps and spec.val_before_train  # validated before, in the middle and at the end
    assert f"temperature={settings.temperature}" in launcher.shell_assignments(spec)
    assert maths_spec.TWOWAY.prepare_args == ("--variant", "twoway")
