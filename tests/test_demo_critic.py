"""The demo's arms of issue 26 (group_ppo_per_token, endpoint_loss, vapo) and value pretraining (tiny settings)."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math

import pytest
import torch
from test_demo import tiny_setup  # noqa: F401  (the module-scoped tiny task, tokenizer and warm start)

from verl_group_ppo.config import read_algorithm_settings
from verl_group_ppo.critic_readout import ScoredReplies, heldout_explained_variance
from experiments.demo.arms import ARMS, get_arm
from experiments.demo.cli import build_parser, resolve_pretrain
from experiments.demo.optim import minibatches, set_warmup_lr
from experiments.demo.pretrain import (
    CriticRecipe,
    PretrainConfig,
    PretrainSamples,
    policy_batches,
    pretrain_critic,
    pretrain_key,
    pretrained_critic_state,
)
from experiments.demo.rl import RunConfig, build_learner, run_one
from verl_group_ppo.tasks.tiny.model import build_critic, build_policy


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
    lengths = batch.response_mask.sum(-1).long()
    for b in range(len(lengths)):
        rewards[b, lengths[b] - 1] = float(int(batch.responses[b, 0]) % 2 == 0)
    assert 0 < float(rewards.sum()) < len(lengths)
    data = ScoredReplies(batch.input_ids, batch.attention_mask, batch.response_mask, rewards)
    critic = build_critic(policy, 0)
    at_zero = heldout_explained_variance(critic, data, 1.0, eval_mode=False)  # the value head starts at zero
    assert at_zero.all == pytest.approx(0.0, abs=1e-3)
    pc = PretrainConfig(critic_pretrain_steps=30, critic_pretrain_lr=1e-2, critic_pretrain_eval_every=10)
    recipe = CriticRecipe(mini_batch_size=8, lr_warmup_steps=1)
    history = pretrain_critic(critic, itertools.repeat(data), data, pc, recipe, log=lambda m: None)
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
    warm_up = dataclasses.replace(cfg, lr_warmup_steps=cfg.lr_warmup_steps + 5)
    _, info4 = pretrained_critic_state(pc, str(tmp_path), "ws-key", policy, task, tok, train, evals, warm_up,
                                       logs.append)
    assert not info4["cached"] and info4["key"] != info["key"]  # the run's warm-up is the pretraining's too
    assert pretrained_critic_state(PretrainConfig(), str(tmp_path), "ws-key", policy, task, tok, train, evals,
                                   cfg) == (None, {})
    from experiments.demo.report import _header_lines

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
    from experiments.demo.options import flag_of

    flags = {s for a in build_parser()._actions for s in a.option_strings}
    assert all(flag_of(f) in flags for f in dataclasses.fields(PretrainConfig))
    args = build_parser().parse_args(["--critic-pretrain-steps", "50", "--critic-pretrain-lr", "3e-3",
                                      "--critic-pretrain-lam", "0.95"])
    pc = resolve_pretrain(args)
    assert (pc.critic_pretrain_steps, pc.critic_pretrain_lr, pc.critic_pretrain_lam) == (50, 3e-3, 0.95)
    assert pc.enabled and not resolve_pretrain(build_parser().parse_args([])).enabled
    with pytest.raises(SystemExit, match="critic_pretrain_lam"):
        resolve_pretrain(build_parser().parse_args(["--critic-pretrain-lam", "1.5"]))


def test_pretrain_key_covers_every_argument_of_pretrain_critic():
    # pretrain_critic takes its settings only through pc and recipe; the key reads every field of both, and of the
    # sampling settings: a field added to any of them is keyed without anyone remembering to
    params = list(inspect.signature(pretrain_critic).parameters)
    assert params == ["critic", "batches", "held", "pc", "recipe", "log"]
    pc, recipe = PretrainConfig(critic_pretrain_steps=5), CriticRecipe()
    samples = PretrainSamples(24, 4, 2, 1.0, 8, 2)
    key = pretrain_key(pc, recipe, samples, "ws")
    assert key == pretrain_key(dataclasses.replace(pc), CriticRecipe(), dataclasses.replace(samples), "ws")
    for obj in (pc, recipe, samples):
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name)
            changed = dataclasses.replace(obj, **{field.name: value / 2 if isinstance(value, float) else value + 1})
            args = [changed if o is obj else o for o in (pc, recipe, samples)]
            assert pretrain_key(*args, "ws") != key, field.name
    assert pretrain_key(pc, recipe, samples, "other warm start") != key


def test_critic_recipe_and_samples_read_the_run_config():
    cfg = dataclasses.replace(RunConfig(), lr_warmup_steps=7, critic_mini_batch_size=32, grad_clip=0.5, gamma=0.9)
    assert CriticRecipe.of_run(cfg) == CriticRecipe(gamma=0.9, mini_batch_size=32, grad_clip=0.5, lr_warmup_steps=7)
    samples = PretrainSamples.of_run(cfg)
    assert (samples.prompts_per_step, samples.n_samples, samples.eval_samples) == (
        cfg.prompts_per_step, cfg.n_samples, cfg.eval_samples)


def test_warmup_lr_rises_linearly_then_holds():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    lrs = []
    for update in range(6):
        set_warmup_lr(opt, 0.4, update, 4)
        lrs.append(opt.param_groups[0]["lr"])
    assert lrs == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.4, 0.4])
    set_warmup_lr(opt, 0.4, 0, 0)  # no warm-up
    assert opt.param_groups[0]["lr"] == 0.4


def test_minibatches_cover_every_index_once_per_epoch():
    batches = list(minibatches(10, 4, 2, torch.Generator().manual_seed(0), "cpu"))
    assert [len(b) for b in batches] == [4, 4, 2, 4, 4, 2]
    for epoch in (batches[:3], batches[3:]):
        assert sorted(torch.cat(epoch).tolist()) == list(range(10))
    assert not torch.equal(torch.cat(batches[:3]), torch.cat(batches[3:]))  # a fresh order each pass
    with pytest.raises(ValueError, match="size"):
        next(minibatches(10, 0, 1, torch.Generator(), "cpu"))
