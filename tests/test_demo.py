"""The CPU demo: verifier, tokenizer, a few-step smoke run of every estimator, determinism.

Everything here is tiny (a handful of RL steps on a 2-layer, 64-wide model) and runs in seconds.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("reasoning_gym")

from experiments.demo import main  # noqa: E402
from experiments.demo.arms import ARMS  # noqa: E402
from experiments.demo.rl import RunConfig, run_one  # noqa: E402
from verl_group_ppo.tasks.tiny.problems import ChainSumTask, ModChainTask, extract_answer, make_task, split_problems  # noqa: E402
from verl_group_ppo.tasks.tiny.tokenizer import CharTokenizer  # noqa: E402
from verl_group_ppo.tasks.tiny.warmstart import train_warmstart  # noqa: E402


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
    from verl_group_ppo.tasks.tiny.problems import Problem

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


@pytest.mark.parametrize("estimator", list(ARMS))
def test_each_estimator_runs_a_few_steps(tiny_setup, estimator):
    task, tok, train, evals, init, cfg = tiny_setup
    res = run_one(estimator, 0, cfg, task, tok, train, evals, init, keep_models=True)
    assert res["estimator"] == estimator and res["steps"] == 3
    models = res.pop("models")
    assert (models["critic"] is not None) == ARMS[estimator].needs_critic
    assert set(models["policy"].state_dict()) == set(init["state_dict"])
    assert [s for s, _ in res["curve"]] == [0, 2, 3]
    assert all(0.0 <= a <= 1.0 for _, a in res["curve"])
    for rec in res["history"]:
        assert math.isfinite(rec["actor/pg_loss"])
        assert math.isfinite(rec["reward/mean"])
        if ARMS[estimator].needs_critic:
            assert math.isfinite(rec["critic/vf_loss"])
        if ARMS[estimator].uses_groups:
            for key in ("group/num_groups", "group/mean_group_size", "group/threshold",
                        "group/boundary_explained_variance", "group/compression_ratio"):
                assert key in rec
    if ARMS[estimator].uses_groups:
        assert [s["step"] for s in res["group_samples"]] == [1, 3]
        row = res["group_samples"][0]["rows"][0]
        assert len(row["tokens"]) == len(row["group_ids"]) == len(row["advantages"])
    else:
        assert "group/num_groups" not in res["history"][0]


def test_endpoint_loss_arm_puts_the_actor_loss_on_group_endpoints_only(tiny_setup):
    """The ``endpoint_loss`` arm on a real demo batch, through the demo's own loss settings: the gradient of the
    actor loss reaches the group endpoints and no other token (at ratio 1 it is -A / N_valid), and for any policy
    the loss equals verl's loss with token-level GAE advantages and the endpoints as the loss mask."""
    import dataclasses

    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    from verl_group_ppo.core_algos import compute_group_ppo_outputs
    from verl_group_ppo.critic_readout import critic_values
    from experiments.demo.rl import _actor_loss_config, build_learner, collect, compute_advantages

    task, tok, train, _, init, cfg = tiny_setup
    cfg = cfg.resolved(task)
    learner = build_learner(ARMS["endpoint_loss"], 0, cfg, tok, init, "cpu")
    batch = collect(learner, cfg, task, tok, train)
    with torch.no_grad():  # a non-zero value head: non-zero advantages whatever the rewards
        learner.critic.score.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(0))
        batch.values = critic_values(learner.critic, batch.rollout)
    adv = compute_advantages(learner, batch)
    mask, endpoints = batch.mask, adv.groups.endpoint_mask
    assert 0 < int(endpoints.sum()) < int(mask.sum())  # groups longer than one token: the choice of tokens matters
    loss_fn, loss_cfg = get_policy_loss_fn("vanilla"), _actor_loss_config(cfg)

    def actor_loss(new_log_probs, advantages, loss_mask):
        return loss_fn(batch.old_log_probs, new_log_probs, advantages, loss_mask, loss_agg_mode="token-mean",
                       config=loss_cfg)[0]

    at_old = batch.old_log_probs.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(actor_loss(at_old, adv.advantages, mask), at_old)
    assert bool((adv.advantages[endpoints] != 0).all())
    assert torch.equal(grad != 0, endpoints)
    torch.testing.assert_close(grad, -adv.advantages * mask / mask.sum())
    token_level = dataclasses.replace(learner.settings, group=dataclasses.replace(
        learner.settings.group, group_max_size=1, policy_loss_on="all_tokens"))
    token_adv = compute_group_ppo_outputs(batch.rewards, mask, values=batch.values, settings=token_level,
                                          index=batch.index).advantages.float()
    moved = batch.old_log_probs + 0.3 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(actor_loss(moved, adv.advantages, mask), actor_loss(moved, token_adv, mask * endpoints))


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


def test_main_writes_all_outputs(tmp_path, monkeypatch):
    from verl_group_ppo.tasks.tiny import warmstart

    monkeypatch.setattr(warmstart, "MIN_SAMPLED_ACCURACY", 0.0)  # a 5-step warm start: plumbing only
    out = tmp_path / "demo"
    rc = main(["--steps", "2", "--seeds", "1", "--warmstart-steps", "5", "--eval-size", "8", "--eval-samples", "1",
               "--prompts-per-step", "3", "--n-samples", "2", "--train-size", "200", "--workers", "1",
               "--final-eval-size", "12",
               "--all-tokens-arm", "--no-progress", "--output-dir", str(out)])
    assert rc == 0
    for name in ("results.json", "summary.md", "learning_curves.png", "metrics.jsonl", "groups.html", "groups.png"):
        assert (out / name).stat().st_size > 0, name
    results = json.loads((out / "results.json").read_text())
    ests = {r["estimator"] for r in results["runs"]}
    assert ests == {"group_ppo", "gae", "grpo", "group_ppo_all_tokens"}
    for r in results["runs"]:
        assert set(r) >= {"estimator", "seed", "final_eval_accuracy", "steps", "curve"}
        assert r["final_eval_samples"] == 12  # the final eval: --final-eval-size prompts x --eval-samples
        assert r["curve_area"] == pytest.approx(np.mean([a for _, a in r["curve"]]))
    assert len(results["summary"]["paired_differences"]) == 6  # every pair of the four arms
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("group/mean_group_size" in x for x in lines if x["estimator"] == "group_ppo")
    assert "| GROUP-PPO |" in (out / "summary.md").read_text()
    # the warm start is cached: a second run loads it
    assert list((out / "cache").glob("warmstart-*.pt"))


# ----------------------------------------------------------------------------------------------------------
# arms, knobs (issue 10) and the report


def test_one_record_per_arm():
    from experiments.demo.arms import ALL_TOKENS, BOUNDARIES, DEFAULT_ARMS, get_arm

    assert set(DEFAULT_ARMS) <= set(ARMS)
    assert len({a.label for a in ARMS.values()}) == len({a.color for a in ARMS.values()}) == len(ARMS)
    for name, arm in ARMS.items():
        assert arm.name == name
        assert arm.critic_loss_on in (None, ALL_TOKENS, BOUNDARIES)
        if arm.uses_groups:  # the arm's critic mode and definition are the group_params keys it fixes
            assert arm.group_overrides() == {"critic_loss_on": arm.critic_loss_on, **arm.group_params}
    assert not ARMS["grpo"].needs_critic and ARMS["gae_decoupled"].needs_critic
    with pytest.raises(ValueError, match="unknown estimator 'ppo'"):
        get_arm("ppo")


def _gae_batch(seed=0, B=6, T=9):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T, dtype=torch.float64)
    for b in range(B):
        mask[b, int(torch.randint(2, T + 1, (1,), generator=g)):] = 0
    rewards = torch.randn(B, T, generator=g, dtype=torch.float64) * mask
    values = torch.randn(B, T, generator=g, dtype=torch.float64)
    return rewards, values, mask


@pytest.mark.parametrize("policy_lam, critic_lam", [(0.9, 1.0), (0.5, 0.95), (0.8, 0.8), (1.0, 0.0)])
def test_gae_decoupled_arm_is_verl_gae_for_each_lambda(policy_lam, critic_lam):
    from verl.trainer.ppo.core_algos import compute_gae_advantage_return

    from verl_group_ppo.config import read_algorithm_settings
    from experiments.demo.arms import AdvantageInputs

    rewards, values, mask = _gae_batch()
    cfg = RunConfig(lam=0.3, group_params={"policy_lam": policy_lam, "critic_lam": critic_lam})
    settings = read_algorithm_settings(cfg.algorithm_config("gae_decoupled"))
    out = ARMS["gae_decoupled"].advantage(AdvantageInputs(rewards, mask, values, np.arange(6), rewards * 0,
                                                          settings))
    adv_p, ret_p = compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=policy_lam)
    _, ret_c = compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=critic_lam)
    on = mask.bool()
    torch.testing.assert_close(out.advantages[on], adv_p[on])
    torch.testing.assert_close(out.returns[on], ret_c[on])
    if policy_lam != critic_lam:  # the returns really are the critic lambda's, not the policy lambda's
        assert not torch.allclose(out.returns[on], ret_p[on])
    assert out.metrics == {"gae/policy_lam": policy_lam, "gae/critic_lam": critic_lam}


def test_gae_decoupled_arm_matches_group_ppo_with_one_token_groups():
    """Spec V2.1: GROUP-PPO with group_max_size=1 is decoupled-lambda GAE; the two arms agree."""
    from verl_group_ppo.config import read_algorithm_settings
    from verl_group_ppo.core_algos import AdaptiveThreshold
    from experiments.demo.arms import AdvantageInputs

    rewards, values, mask = _gae_batch(seed=3)
    cfg = RunConfig(group_params={"policy_lam": 0.7, "critic_lam": 0.95, "group_max_size": 1,
                                  "adaptive_threshold": False})
    outs = {}
    for name in ("gae_decoupled", "group_ppo"):
        settings = read_algorithm_settings(cfg.algorithm_config(name))
        outs[name] = ARMS[name].advantage(AdvantageInputs(rewards, mask, values, np.arange(6), rewards * 0,
                                                          settings, AdaptiveThreshold(settings.group)))
    on = mask.bool()
    torch.testing.assert_close(outs["group_ppo"].returns[on], outs["gae_decoupled"].returns[on])
    torch.testing.assert_close(outs["group_ppo"].advantages[on], outs["gae_decoupled"].advantages[on])


def test_critic_warmup_updates_only_the_critic_and_the_threshold_still_adapts(tiny_setup):
    import dataclasses

    from experiments.demo.rl import build_learner, train_step

    task, tok, train, evals, init, cfg = tiny_setup
    cfg = dataclasses.replace(cfg, critic_warmup=2).resolved(task)
    for name in ("gae", "group_ppo"):
        learner = build_learner(ARMS[name], 0, cfg, tok, init, "cpu")
        with torch.no_grad():  # a non-zero value head: a critic loss with a gradient even when every reward is 0
            learner.critic.score.weight.fill_(0.05)
        actor0 = [p.detach().clone() for p in learner.policy.parameters()]
        critic0 = [p.detach().clone() for p in learner.critic.parameters()]
        tau0 = learner.threshold.value if learner.threshold is not None else None
        for step in (1, 2):
            rec, _, _ = train_step(learner, step, cfg, task, tok, train)
            assert "actor/pg_loss" not in rec and math.isfinite(rec["critic/vf_loss"])
        assert all(torch.equal(a, p) for a, p in zip(actor0, learner.policy.parameters()))
        assert not all(torch.equal(c, p) for c, p in zip(critic0, learner.critic.parameters()))
        if tau0 is not None:
            assert rec["group/next_threshold"] != tau0  # the advantage step ran and tau adapted
        rec, _, _ = train_step(learner, 3, cfg, task, tok, train)
        assert math.isfinite(rec["actor/pg_loss"])
        assert not all(torch.equal(a, p) for a, p in zip(actor0, learner.policy.parameters()))
    with pytest.raises(ValueError, match="critic_warmup"):
        RunConfig(steps=3, critic_warmup=3)


@pytest.mark.parametrize("name, terms", [("chain_sum", (4, 5)), ("chain_sum", (10, 12)), ("chain_sum", (2, 3)),
                                         ("mod_chain", (4, 6)), ("mod_chain", (12, 14))])
def test_terms_set_the_chain_length_and_the_response_length(name, terms):
    task = make_task(name, terms)
    problems = task.problems(300, seed=2)
    n_terms = [len([c for c in p.prompt if c in "+-*"]) + 1 for p in problems]
    assert min(n_terms) >= terms[0] and max(n_terms) <= terms[1] and max(n_terms) == terms[1]
    assert max(len(p.solution) for p in problems) <= task.max_solution_len()
    response_len = RunConfig().resolved(task).response_len
    assert response_len == task.max_solution_len() + 4
    if (name, terms) == ("chain_sum", (4, 5)):
        assert response_len == 24  # the demo's historical default
    assert RunConfig(response_len=40).resolved(task).response_len == 40


def test_terms_parsing_and_the_warmstart_cache_key():
    from verl_group_ppo.tasks.tiny.problems import parse_terms
    from verl_group_ppo.tasks.tiny.warmstart import warmstart_key

    assert parse_terms("4-5") == (4, 5) and parse_terms("7") == (7, 7)
    for bad in ("5-4", "1-3", "a-b", "4-5-6", ""):
        with pytest.raises(ValueError, match="--terms"):
            parse_terms(bad)
    with pytest.raises(ValueError, match="terms"):
        make_task("chain_sum", (6, 3))
    args = ("tiny", 100, 64, 2e-3, 0, 1000, 0.25)
    keys = {warmstart_key(make_task("chain_sum", t), *args, response_len=r)
            for t, r in (((4, 5), 24), ((10, 12), 24), ((10, 12), 52), ((4, 5), 52))}
    assert len(keys) == 4
    assert warmstart_key(make_task("chain_sum"), *args, 24) == warmstart_key(make_task("chain_sum", (4, 5)), *args, 24)


def test_cli_flags_come_from_the_config_fields_and_quick_changes_only_its_defaults():
    from dataclasses import fields

    from experiments.demo.cli import QUICK, DemoOptions, build_parser, resolve
    from experiments.demo.options import flag_of

    parser = build_parser()
    flags = {s for a in parser._actions for s in a.option_strings}
    for cls in (DemoOptions, RunConfig):
        for f in fields(cls):
            assert (flag_of(f) in flags) == f.metadata["cli"], f.name
    assert {"--response-length", "--critic-warmup", "--terms", "--lam", "--final-eval-size"} <= flags
    opts, cfg = resolve(parser.parse_args([]))
    assert (cfg.steps, opts.seeds, opts.output_dir) == (400, "3", "runs/demo")
    opts, cfg = resolve(parser.parse_args(["--quick"]))
    assert (cfg.steps, opts.seeds) == (QUICK["steps"], QUICK["seeds"]) and opts.output_dir == "runs/demo-quick"
    opts, cfg = resolve(parser.parse_args(["--quick", "--steps", "7", "--critic-warmup", "2", "--lam", "0.9",
                                           "--group-param", "policy_lam=0.8"]))
    assert (cfg.steps, cfg.critic_warmup, cfg.lam, cfg.group_params) == (7, 2, 0.9, {"policy_lam": 0.8})
    for bad, match in ((["--estimators", "group_ppo,ppo"], "unknown estimator 'ppo'"),
                       (["--group-param", "critic_loss_on=all_tokens"], "critic_loss_on"),
                       (["--steps", "3", "--critic-warmup", "3"], "critic_warmup"),
                       (["--group-param", "policy_lam=1.5"], "policy_lam")):
        with pytest.raises(SystemExit, match=match):
            resolve(parser.parse_args(bad))


def _fake_run(est, seed, curve, wall=1.0):
    return {"estimator": est, "seed": seed, "final_eval_accuracy": curve[-1][1], "curve": curve,
            "greedy_curve": curve, "final_greedy_accuracy": curve[-1][1], "wall_time_s": wall, "steps": 20,
            "final_threshold": 1.0 if est == "group_ppo" else None, "final_eval_samples": 2048}


def test_summary_reports_per_seed_areas_and_paired_differences(tmp_path):
    from experiments.demo import report

    finals = {"group_ppo": [0.5, 0.7, 0.6], "gae": [0.4, 0.5, 0.6]}
    runs = [_fake_run(e, s, [[0, 0.1], [10, 0.3], [20, f]]) for e, fs in finals.items() for s, f in enumerate(fs)]
    s = report.summarise(runs)
    assert s["estimators"]["group_ppo"]["area_per_seed"] == pytest.approx([0.9 / 3, 1.1 / 3, 1.0 / 3])
    (pair,) = s["paired_differences"]
    assert (pair["a"], pair["b"]) == ("group_ppo", "gae")
    d = np.array([0.1, 0.2, 0.0])
    assert pair["final"]["per_seed"] == pytest.approx(d.tolist())
    assert pair["final"]["mean"] == pytest.approx(d.mean())
    assert pair["final"]["se"] == pytest.approx(d.std(ddof=1) / np.sqrt(3))
    assert pair["area"]["mean"] == pytest.approx(d.mean() / 3)  # only the last of three eval points differs
    one = report.paired_difference({0: 0.5}, {0: 0.25, 1: 0.9})
    assert one == {"seeds": [0], "mean": 0.25, "se": None, "per_seed": [0.25]}
    meta = {"task": "chain_sum", "seeds": [0, 1, 2], "eval_size": 256, "final_eval_size": 1024, "eval_samples": 2}
    text = report.write_summary_md(str(tmp_path / "summary.md"), runs, meta)
    assert "| GROUP-PPO - PPO (GAE) | 0.100 +- 0.058 |" in text and "| level / level |" in text
    assert f"| level / level | {report.detectable_of([0.1, 0.2, 0.0]):.3f} / " in text  # 80%-detectable, final
    assert "2048 samples" in text and "curve area" in text.lower()
    report.write_results_json(str(tmp_path / "results.json"), runs, meta)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["summary"]["paired_differences"][0]["final"]["se"] == pytest.approx(pair["final"]["se"])


def test_the_report_applies_the_rule_of_the_statistics_module():
    """The summary's verdicts are the rule's (benchmarks/stats.py): a same-sign difference above 2 SE wins, one
    negative seed makes it level."""
    from experiments.demo import report

    finals = {"group_ppo": [0.43, 0.47, 0.45], "gae": [0.40, 0.45, 0.42], "grpo": [0.40, 0.40, 0.46]}
    runs = [_fake_run(e, s, [[0, 0.1], [20, f]]) for e, fs in finals.items() for s, f in enumerate(fs)]
    pairs = {(p["a"], p["b"]): p for p in report.summarise(runs)["paired_differences"]}
    assert report.verdict(pairs["group_ppo", "gae"]["final"]) == "win"     # +0.03, +0.02, +0.03
    assert report.verdict(pairs["group_ppo", "grpo"]["final"]) == "level"  # +0.03, +0.07, -0.01


def test_importing_the_demo_loads_nothing_else():
    """``import experiments.demo`` runs no import of ours at the top level: the command line loads when called."""
    import ast

    tree = ast.parse((Path(__file__).resolve().parents[1] / "experiments" / "demo" / "__init__.py").read_text())
    top_level = [ast.unparse(node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
                 and not (isinstance(node, ast.ImportFrom) and node.module == "__future__")]
    assert top_level == ["from typing import Sequence"]


def test_version_1_command_in_docs_gives_the_version_1_settings():
    """docs/demo.md's version-1 command: no critic warm-up and config.V1_GROUP_PARAMS; the default warm-up is
    5% of the steps for every critic arm."""
    from verl_group_ppo.config import V1_GROUP_PARAMS, GroupParams
    from experiments.demo.cli import build_parser, resolve

    parser = build_parser()
    argv = ["--critic-warmup", "0", "--group-param", "policy_lam=null", "--group-param", "threshold_lr=0.01",
            "--group-param", "adaptive_target=explained_variance", "--group-param", "target_group_size=8"]
    doc = (Path(__file__).resolve().parents[1] / "docs" / "demo.md").read_text()
    assert " ".join(argv) in doc.replace("\\\n    ", "")
    _, cfg = resolve(parser.parse_args(argv))
    assert cfg.critic_warmup == 0
    assert GroupParams.from_config(cfg.group_params) == GroupParams(**V1_GROUP_PARAMS)
    _, default = resolve(parser.parse_args([]))
    task = make_task("chain_sum")
    assert default.critic_warmup is None and default.resolved(task).critic_warmup == 20
    assert RunConfig(steps=150).resolved(task).critic_warmup == 7 and RunConfig(steps=3).resolved(task).critic_warmup == 0


# ----------------------------------------------------------------------------------------------------------
# a warm start that leaves room for RL


def test_automatic_warmstart_settings_keep_the_default_task_and_scale_with_length():
    from verl_group_ppo.tasks.tiny import warmstart as ws

    assert ws.auto_slip_prob(3.5) == 0.25 and ws.auto_warmstart_steps(3.5) == 2000  # the default task's
    slips = [ws.auto_slip_prob(k) for k in (3.5, 8.0, 12.0)]
    assert slips == sorted(slips, reverse=True) and slips[-1] > 0
    for k in (3.5, 8.0, 12.0):  # the same slip-free fraction at every length (up to rounding)
        assert (1 - ws.auto_slip_prob(k)) ** k == pytest.approx(0.75 ** 3.5, abs=0.03)
    assert ws.auto_warmstart_steps(8.0) > ws.auto_warmstart_steps(3.5)
    with pytest.raises(ValueError, match="steps_per_solution"):
        ws.auto_slip_prob(0.0)


def test_slip_rescaling_moves_the_accuracy_toward_the_room():
    from verl_group_ppo.tasks.tiny import warmstart as ws

    assert ws.rescale_slip_prob(0.25, 0.8, 3.5) > 0.25  # too easy: more slips
    assert ws.rescale_slip_prob(0.25, 0.03, 3.5) < 0.25  # too hard: fewer slips
    assert ws.rescale_slip_prob(0.1, 0.0, 8.0) == 0.0  # nothing right: the most room the slips can give
    assert ws.in_room(0.3) and not ws.in_room(0.01) and not ws.in_room(0.7)


def _demo_options(**kw):
    from experiments.demo.cli import DemoOptions

    return DemoOptions(output_dir="unused", **kw)


def test_calibration_stops_before_rl_when_the_warm_start_leaves_no_room():
    """The cheap case: a stand-in warm start that samples nothing right, whatever the slip."""
    from experiments.demo.cli import calibrated_warmstart

    calls = []

    def warm_start(steps, slip):
        calls.append((steps, slip))
        return object(), {"seconds": 0.0}, 0.0

    with pytest.raises(RuntimeError, match="--warmstart-steps.*--warmstart-slip-prob"):
        calibrated_warmstart(_demo_options(), 8.0, warm_start, log=lambda m: None)
    assert calls == [(4600, 0.12), (4600, 0.0)]  # automatic settings, then the most room, then stop
    calls.clear()
    with pytest.raises(RuntimeError, match="0.000 correct"):  # a given slip probability is used as it is
        calibrated_warmstart(_demo_options(warmstart_slip_prob=0.3, warmstart_steps=50), 8.0, warm_start,
                             log=lambda m: None)
    assert calls == [(50, 0.3)]


def test_calibration_rescales_the_slip_until_the_accuracy_is_in_the_room():
    from experiments.demo.cli import calibrated_warmstart

    def warm_start(steps, slip):  # a stand-in whose accuracy follows the slip-free fraction
        return object(), {"seconds": 0.0}, 0.9 * (1 - slip) ** 8

    _, info, acc = calibrated_warmstart(_demo_options(), 8.0, warm_start, log=lambda m: None)
    assert 0.08 <= acc <= 0.5 and info["slip_prob"] == 0.12 and info["calibration_tries"] == 1

    def too_easy(steps, slip):
        return object(), {"seconds": 0.0}, min(1.0, 2.0 * (1 - slip) ** 8)

    _, info, acc = calibrated_warmstart(_demo_options(), 8.0, too_easy, log=lambda m: None)
    assert info["calibration_tries"] == 2 and info["slip_prob"] > 0.12 and 0.08 <= acc <= 0.5


def test_calibration_on_a_real_tiny_warm_start_refuses_rl(tmp_path):
    """End to end on the cheapest real case: a 5-step warm start of the tiny model samples nothing right,
    and the demo stops before RL with a message naming the flags."""
    with pytest.raises(RuntimeError, match="warm start samples .* correct"):
        main(["--steps", "1", "--seeds", "1", "--warmstart-steps", "5", "--eval-size", "8", "--eval-samples", "1",
              "--prompts-per-step", "2", "--n-samples", "2", "--train-size", "200", "--workers", "1",
              "--final-eval-size", "8", "--estimators", "grpo", "--no-progress", "--output-dir", str(tmp_path)])
    assert not (tmp_path / "results.json").exists()


def test_sae_arm_is_per_token_advantages_on_low_probability_cuts(tiny_setup):
    from verl_group_ppo.config import read_algorithm_settings
    from experiments.demo.arms import SAE_GROUP_PARAMS, get_arm

    task, tok, train, evals, init, cfg = tiny_setup
    arm = get_arm("sae")
    settings = read_algorithm_settings(cfg.algorithm_config(arm))
    assert settings.group.within_group == "per_token" and settings.group.boundary_rule == "low_prob"
    assert settings.group.low_prob_threshold == SAE_GROUP_PARAMS["low_prob_threshold"]
    assert settings.group.group_max_size > cfg.resolved(task).response_len  # SAE's segments end at low-probability tokens only
    assert arm.critic_loss_on == "all_tokens" and settings.group.critic_loss_on == "all_tokens"
    assert read_algorithm_settings(cfg.algorithm_config("group_ppo")).group.within_group == "broadcast"
