"""The CPU demo: verifier, tokenizer, a few-step smoke run of every estimator, determinism.

Everything here is tiny (a handful of RL steps on a 2-layer, 64-wide model) and runs in seconds.
"""

from __future__ import annotations

import json
import math
import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("reasoning_gym")

from verl_group_ppo.demo import main  # noqa: E402
from verl_group_ppo.demo.rl import ESTIMATORS, RunConfig, run_one  # noqa: E402
from verl_group_ppo.demo.tasks import ChainSumTask, ModChainTask, extract_answer, make_task, split_problems  # noqa: E402
from verl_group_ppo.demo.tokenizer import CharTokenizer  # noqa: E402
from verl_group_ppo.demo.warmstart import train_warmstart  # noqa: E402


# ----------------------------------------------------------------------------------------------------------
# verifier


def test_chain_sum_problems_come_from_reasoning_gym_and_solutions_verify():
    task = ChainSumTask()
    problems = task.problems(50, seed=3)
    for p in problems:
        assert p.entry["metadata"]["source_dataset"] == "chain_sum"
        assert p.prompt.endswith("=")
        assert p.solution.endswith("#" + p.answer)
        assert task.verify(p.solution, p) == 1.0
        # the expression evaluates to the answer
        assert eval(p.prompt[:-1]) == int(p.answer)  # noqa: S307 - digits and +/- only


@pytest.mark.parametrize(
    "response, expected",
    [
        ("9 2 #2", 1.0),  # the worked solution
        ("9 2 #3", 0.0),  # wrong answer
        ("9 2 2", 0.0),  # no answer mark
        ("9 2 #", 0.0),  # empty answer
        ("9 3 #2", 0.0),  # right answer, wrong step (check_work)
        ("9 #2", 0.0),  # a step missing
        ("9 2 #+2", 0.0),  # not a plain integer
        ("9 2 #02", 0.0),
        ("9 2 #2.0", 0.0),
    ],
)
def test_chain_sum_verifier_known_answers(response, expected):
    task = ChainSumTask()
    p = _chain_problem(task, "4 + 5 - 7", "2", "9 2 #2")
    assert task.verify(response, p) == expected


def test_chain_sum_verifier_answer_only_mode_and_negative_answers():
    task = ChainSumTask()
    task.check_work = False
    p = _chain_problem(task, "1 - 5 - 2", "-6", "-4 -6 #-6")
    assert task.verify("-4 -6 #-6", p) == 1.0
    assert task.verify("0 0 #-6", p) == 1.0  # answer only: steps are not graded
    assert task.verify("-4 -6 #6", p) == 0.0
    assert task.verify("-4 -6 #--6", p) == 0.0


def test_mod_chain_verifier():
    task = ModChainTask()
    for p in task.problems(30, seed=1):
        assert task.verify(p.solution, p) == 1.0
        wrong = str((int(p.answer) + 1) % 10)
        assert task.verify(p.solution.rsplit("#", 1)[0] + "#" + wrong, p) == 0.0
    assert extract_answer("1 2 #7") == "7"
    assert extract_answer("no mark") is None


def test_noisy_solutions_slip_and_are_wrong_when_they_do():
    task = ChainSumTask()
    rng = random.Random(0)
    problems = task.problems(200, seed=5)
    noisy = [task.noisy_solution(p, rng, 0.5) for p in problems]
    changed = [(p, s) for p, s in zip(problems, noisy) if s != p.solution]
    assert len(changed) > 50
    assert all(task.verify(s, p) == 0.0 for p, s in changed)


def test_split_has_no_shared_prompts():
    task = make_task("chain_sum")
    train, evals = split_problems(task, 500, 64)
    assert len(evals) == 64
    assert not {p.prompt for p in train} & {p.prompt for p in evals}
    with pytest.raises(ValueError, match="unknown task"):
        make_task("gsm_symbolic")


def test_char_tokenizer_round_trip():
    task = ChainSumTask()
    tok = CharTokenizer.train(task.corpus(100) + [task.alphabet])
    text = "4+5-7=9 2 #-2"
    ids = tok.encode(text)
    assert len(ids) == len(text)
    assert tok.decode(ids + [tok.eos_id] + ids) == text
    assert CharTokenizer.from_str(tok.to_str()).encode(text) == ids


def _chain_problem(task, expression, answer, solution):
    from verl_group_ppo.demo.tasks import Problem

    entry = {"question": f"... {expression} =", "answer": answer,
             "metadata": {"source_dataset": "chain_sum", "expression": expression}}
    return Problem(expression.replace(" ", "") + "=", answer, solution, entry)


# ----------------------------------------------------------------------------------------------------------
# RL loop


@pytest.fixture(scope="module")
def tiny_setup():
    torch.set_num_threads(1)
    task = ChainSumTask()
    train, evals = split_problems(task, 400, 16)
    tok = CharTokenizer.train(task.corpus(200) + [task.alphabet])
    policy, _ = train_warmstart(task, tok, train, "tiny", steps=15, batch_size=16, lr=2e-3, seed=0,
                                response_len=24, device="cpu")
    init = {"state_dict": {k: v.clone() for k, v in policy.state_dict().items()}, "size": "tiny"}
    cfg = RunConfig(steps=3, prompts_per_step=4, n_samples=2, mini_batch_size=4, eval_every=2, eval_samples=1,
                    record_groups_at=(1, 3))
    return task, tok, train, evals, init, cfg


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_each_estimator_runs_a_few_steps(tiny_setup, estimator):
    task, tok, train, evals, init, cfg = tiny_setup
    res = run_one(estimator, 0, cfg, task, tok, train, evals, init)
    assert res["estimator"] == estimator and res["steps"] == 3
    assert [s for s, _ in res["curve"]] == [0, 2, 3]
    assert all(0.0 <= a <= 1.0 for _, a in res["curve"])
    for rec in res["history"]:
        assert math.isfinite(rec["actor/pg_loss"])
        assert math.isfinite(rec["reward/mean"])
        if estimator != "grpo":
            assert math.isfinite(rec["critic/vf_loss"])
        if estimator.startswith("group_ppo"):
            for key in ("group/num_groups", "group/mean_group_size", "group/threshold",
                        "group/boundary_explained_variance", "group/compression_ratio"):
                assert key in rec
    if estimator.startswith("group_ppo"):
        assert [s["step"] for s in res["group_samples"]] == [1, 3]
        row = res["group_samples"][0]["rows"][0]
        assert len(row["tokens"]) == len(row["group_ids"]) == len(row["advantages"])
    else:
        assert "group/num_groups" not in res["history"][0]


def test_same_seed_same_run(tiny_setup):
    task, tok, train, evals, init, cfg = tiny_setup
    a = run_one("group_ppo", 7, cfg, task, tok, train, evals, init)
    b = run_one("group_ppo", 7, cfg, task, tok, train, evals, init)
    keys = ("actor/pg_loss", "actor/entropy", "critic/vf_loss", "reward/mean", "response_length/mean",
            "group/num_groups", "group/threshold")
    assert a["curve"] == b["curve"]
    assert [[h[k] for k in keys] for h in a["history"]] == [[h[k] for k in keys] for h in b["history"]]
    c = run_one("group_ppo", 8, cfg, task, tok, train, evals, init)
    assert [h["actor/entropy"] for h in c["history"]] != [h["actor/entropy"] for h in a["history"]]


def test_main_writes_all_outputs(tmp_path):
    out = tmp_path / "demo"
    rc = main(["--steps", "2", "--seeds", "1", "--warmstart-steps", "5", "--eval-size", "8", "--eval-samples", "1",
               "--prompts-per-step", "3", "--n-samples", "2", "--train-size", "200", "--workers", "1",
               "--all-tokens-arm", "--no-progress", "--output-dir", str(out)])
    assert rc == 0
    for name in ("results.json", "summary.md", "learning_curves.png", "metrics.jsonl", "groups.html", "groups.png"):
        assert (out / name).stat().st_size > 0, name
    results = json.loads((out / "results.json").read_text())
    ests = {r["estimator"] for r in results["runs"]}
    assert ests == {"group_ppo", "gae", "grpo", "group_ppo_all_tokens"}
    for r in results["runs"]:
        assert set(r) >= {"estimator", "seed", "final_eval_accuracy", "steps", "curve"}
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("group/mean_group_size" in x for x in lines if x["estimator"] == "group_ppo")
    assert "| GROUP-PPO |" in (out / "summary.md").read_text()
    # the warm start is cached: a second run loads it
    assert list((out / "cache").glob("warmstart-*.pt"))
