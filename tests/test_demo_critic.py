"""The demo's arms of issue 26 (group_ppo_per_token, endpoint_loss, vapo) and value pretraining (tiny settings)."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from test_demo import tiny_setup  # noqa: F401  (the module-scoped tiny task, tokenizer and warm start)

from verl_group_ppo.config import read_algorithm_settings
from verl_group_ppo.demo.arms import ARMS, get_arm
from verl_group_ppo.demo.cli import build_parser, resolve_pretrain
from verl_group_ppo.demo.pretrain import (
    PretrainConfig,
    ScoredBatch,
    heldout_explained_variance,
    policy_batches,
    pretrain_critic,
    pretrained_critic_state,
)
from verl_group_ppo.demo.rl import RunConfig, build_learner, run_one
from verl_group_ppo.tinytask.model import build_critic, build_policy


def test_new_arms_are_the_settings_they_name():
    cfg = RunConfig()
    base = read_algorithm_settings(cfg.algorithm_config("group_ppo")).group
    per_token = read_algorithm_settings(cfg.algorithm_config("group_ppo_per_token")).group
    diff = {k for k, v in per_token.to_dict().items() if base.to_dict()[k] != v}
    assert diff == {"within_group"} and per_token.within_group == "per_token"  # the one-key ablation
    endpoint = read_algorithm_settings(cfg.algorithm_config("endpoint_loss")).group
    assert {k for k, v in endpoint.to_dict().items() if base.to_dict()[k] != v} == {"policy_loss_on"}
    assert get_arm("endpoint_loss").critic_loss_on == "boundaries"
    vapo = read_algorithm_settings(cfg.algorithm_config("vapo"))
    assert vapo.group.group_max_size == 1 and vapo.group.length_adaptive_alpha == 0.05
    assert vapo.critic_lam == 1.0 and vapo.group.critic_loss_on == "all_tokens"
    assert get_arm("vapo").critic_loss_on == "all_tokens"


def test_vapo_and_endpoint_arms_log_what_they_do(tiny_setup):  # noqa: F811
    task, tok, train, evals, init, cfg = tiny_setup
    vapo = run_one("vapo", 0, cfg, task, tok, train, evals, init)
    lengths = [h["response_length/mean"] for h in vapo["history"]]
    for h, length in zip(vapo["history"], lengths):  # every token its own group; lambda = 1 - 1/(0.05 L) < 1
        assert h["group/mean_group_size"] == 1.0
        assert 0.0 <= h["group/policy_lam"] <= max(0.0, 1 - 1 / (0.05 * 24)) + 1e-12
    ends = run_one("endpoint_loss", 0, cfg, task, tok, train, evals, init)
    assert all(h["group/policy_lam"] == 0.95 for h in ends["history"])
    assert all(math.isfinite(h["actor/pg_loss"]) for h in ends["history"])


def _tiny_pool(tiny_setup, n: int = 3):  # noqa: F811
    task, tok, train, evals, init, cfg = tiny_setup
    policy = build_policy(tok.vocab_size, "tiny", 0, tok.pad_id, tok.eos_id)
    policy.load_state_dict(init["state_dict"])
    batches = list(itertools.islice(policy_batches(policy, task, tok, train, 24, 4, 2), n))
    return policy, batches


def test_pretraining_fits_the_critic_and_logs_held_out_explained_variance(tiny_setup):  # noqa: F811
    policy, batches = _tiny_pool(tiny_setup, 1)
    batch = batches[0]
    # a learnable signal whatever the tiny policy samples: reward 1 for responses whose first token is even
    rewards = torch.zeros_like(batch.rewards)
    lengths = batch.mask.sum(-1).long()
    for b in range(len(lengths)):
        rewards[b, lengths[b] - 1] = float(int(batch.rollout.responses[b, 0]) % 2 == 0)
    assert 0 < float(rewards.sum()) < len(lengths)
    data = ScoredBatch(batch.rollout, rewards)
    critic = build_critic(policy, 0)
    assert heldout_explained_variance(critic, data, 1.0) == pytest.approx(0.0, abs=1e-3)  # value head at zero
    pc = PretrainConfig(critic_pretrain_steps=30, critic_pretrain_lr=1e-2, critic_pretrain_eval_every=10)
    history = pretrain_critic(critic, itertools.repeat(data), data, pc, mini_batch_size=8, lr_warmup_steps=1,
                              log=lambda m: None)
    assert [h["step"] for h in history] == [0, 10, 20, 30]
    assert history[-1]["heldout_explained_variance"] > 0.3
    assert all(math.isfinite(h["vf_loss"]) for h in history[1:])


def test_pretrained_critic_is_cached_and_every_critic_arm_starts_from_it(tiny_setup, tmp_path):  # noqa: F811
    task, tok, train, evals, init, cfg = tiny_setup
    policy, _ = _tiny_pool(tiny_setup, 0)
    cfg = cfg.resolved(task)
    pc = PretrainConfig(critic_pretrain_steps=2, critic_pretrain_eval_every=1)
    logs: list[str] = []
    state, info = pretrained_critic_state(pc, str(tmp_path), "ws-key", policy, task, tok, train, evals, cfg,
                                          logs.append)
    assert not info["cached"] and [h["step"] for h in info["history"]] == [0, 1, 2]
    assert any("held-out explained variance" in line for line in logs)
    again, info2 = pretrained_critic_state(pc, str(tmp_path), "ws-key", policy, task, tok, train, evals, cfg,
                                           logs.append)
    assert info2["cached"] and all(torch.equal(state[k], again[k]) for k in state)
    other, info3 = pretrained_critic_state(dataclasses.replace(pc, critic_pretrain_lr=5e-3), str(tmp_path), "ws-key",
                                           policy, task, tok, train, evals, cfg, logs.append)
    assert not info3["cached"]  # another setting, another cache entry
    assert pretrained_critic_state(PretrainConfig(), str(tmp_path), "ws-key", policy, task, tok, train, evals,
                                   cfg) == (None, {})
    from verl_group_ppo.demo.report import _header_lines

    header = "\n".join(_header_lines({"critic_pretrain": info}))
    assert "critic trained alone for 2 steps" in header
    assert "Value pretraining" not in "\n".join(_header_lines({}))
    marked = {k: v + 0.01 for k, v in state.items()}  # (the tiny warm start's rewards may all be 0: no gradient)
    with_critic = {**init, "critic_state_dict": marked}
    for name in ("gae", "group_ppo", "vapo"):
        learner = build_learner(ARMS[name], 3, cfg, tok, with_critic, "cpu")
        assert all(torch.equal(p, marked[k]) for k, p in learner.critic.state_dict().items())
    assert build_learner(ARMS["grpo"], 3, cfg, tok, with_critic, "cpu").critic is None


def test_pretraining_flags():
    from verl_group_ppo.demo.options import flag_of

    flags = {s for a in build_parser()._actions for s in a.option_strings}
    assert all(flag_of(f) in flags for f in dataclasses.fields(PretrainConfig))
    args = build_parser().parse_args(["--critic-pretrain-steps", "50", "--critic-pretrain-lr", "3e-3",
                                      "--critic-pretrain-lam", "0.95"])
    pc = resolve_pretrain(args)
    assert (pc.critic_pretrain_steps, pc.critic_pretrain_lr, pc.critic_pretrain_lam) == (50, 3e-3, 0.95)
    assert pc.enabled and not resolve_pretrain(build_parser().parse_args([])).enabled
    with pytest.raises(SystemExit, match="critic_pretrain_lam"):
        resolve_pretrain(build_parser().parse_args(["--critic-pretrain-lam", "1.5"]))
