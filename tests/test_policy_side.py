"""The policy-side options: ``policy_loss_on: endpoints`` (token-level GAE kept at group endpoints) against
verl's GAE and verl's policy loss, and ``length_adaptive_alpha`` (VAPO's per-response lambda) against the
loop reference and per-response verl GAE; both through verl's own advantage step."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from test_core_algos import algo_settings, assert_close, config, make_batch
from verl.trainer.ppo.core_algos import compute_gae_advantage_return, get_policy_loss_fn

from verl_group_ppo.core_algos import compute_group_advantage, compute_group_ppo_outputs, length_adaptive_lambda
from verl_group_ppo.estimator.reference import reference_group_ppo

RULES = ("variance", "fixed", "low_prob")


def vapo_lambdas(mask: torch.Tensor, alpha: float) -> list[float]:
    """1 - 1/(alpha * L) per row, clipped to [0, 1], written out per row (0 for an empty row)."""
    out = []
    for row in mask.tolist():
        n = sum(1 for m in row if m != 0)
        out.append(0.0 if n == 0 else min(1.0, max(0.0, 1.0 - 1.0 / (alpha * n))))
    return out


def endpoint_outputs(rule: str, mask_kind: str, adv_norm: str = "batch", seed: int = 3, policy_lam: float = 0.9):
    rewards, mask, values, olp, index = make_batch(seed, 7, 30, mask_kind, dense=True, junk=True)
    common = dict(boundary_rule=rule, adv_norm=adv_norm, policy_lam=policy_lam, critic_lam=1.0, group_max_size=5)
    args = dict(values=values, index=index, old_log_probs=olp, threshold=2.0)
    ends = compute_group_ppo_outputs(rewards, mask, settings=algo_settings(0.99, 1.0, policy_loss_on="endpoints",
                                                                           **common), **args)
    everywhere = compute_group_ppo_outputs(rewards, mask, settings=algo_settings(0.99, 1.0, **common), **args)
    return rewards, mask, values, ends, everywhere


# --------------------------------------------------------------------------------------------------
# policy_loss_on: endpoints


@pytest.mark.parametrize("mask_kind", ["prefix", "holes"])
@pytest.mark.parametrize("rule", RULES)
def test_endpoints_are_verl_gae_at_group_endpoints_scaled_by_valid_over_endpoints(rule, mask_kind):
    rewards, mask, values, out, everywhere = endpoint_outputs(rule, mask_kind)
    valid, at = mask.bool(), out.endpoint_mask
    clean_values = values.masked_fill(~valid, 0.0)
    verl_adv, _ = compute_gae_advantage_return(rewards.masked_fill(~valid, 0.0), clean_values, mask, gamma=0.99,
                                               lam=0.9)
    scale = int(valid.sum()) / int(at.sum())
    assert 1 < scale < int(valid.sum())  # several groups, not every token an endpoint: the scaling matters
    assert_close(out.advantages[at], verl_adv[at] * scale)
    assert torch.all(out.advantages[~at] == 0)
    # the groups, returns and the critic's side are those of the same settings with the loss on all tokens
    assert torch.equal(out.endpoint_mask, everywhere.endpoint_mask)
    assert torch.equal(out.returns, everywhere.returns)
    assert torch.equal(out.critic_loss_weights, everywhere.critic_loss_weights)
    assert not torch.equal(out.advantages, everywhere.advantages)
    # verl's token-mean over the valid tokens is the mean over the endpoints
    assert float(out.advantages[valid].mean()) == pytest.approx(float(verl_adv[at].mean()), abs=1e-9)


def test_endpoints_without_normalisation_are_the_policy_lambda_gae_residuals():
    rewards, mask, values, out, _ = endpoint_outputs("variance", "holes", adv_norm="none", policy_lam=0.7)
    valid, at = mask.bool(), out.endpoint_mask
    clean = values.masked_fill(~valid, 0.0)
    _, policy_returns = compute_gae_advantage_return(rewards.masked_fill(~valid, 0.0), clean, mask, gamma=0.99,
                                                     lam=0.7)
    assert_close(out.advantages[at], (policy_returns - clean)[at] * (int(valid.sum()) / int(at.sum())))


def test_endpoints_with_prompt_normalisation_normalise_the_token_level_advantages():
    rewards, mask, values, out, _ = endpoint_outputs("fixed", "prefix", adv_norm="prompt")
    valid, at = mask.bool(), out.endpoint_mask
    _, _, _, olp, index = make_batch(3, 7, 30, "prefix", dense=True, junk=True)
    token_level = reference_group_ppo(rewards, mask, values, gamma=0.99, lam=0.9, critic_lam=1.0, threshold=0.0,
                                      group_max_size=1, adv_norm="prompt", index=index)
    assert_close(out.advantages[at], token_level.advantages[at] * (int(valid.sum()) / int(at.sum())))


def test_endpoint_advantages_under_verls_policy_loss_equal_the_endpoint_loss_mask():
    """The design notes' sparse loss (loss mask = response_mask * endpoints) and ours (scaled advantages, full
    mask) give the same verl vanilla PPO loss, clipping included."""
    rewards, mask, values, out, _ = endpoint_outputs("variance", "prefix")
    valid = mask.bool()
    verl_adv, _ = compute_gae_advantage_return(rewards.masked_fill(~valid, 0.0), values.masked_fill(~valid, 0.0),
                                               mask, gamma=0.99, lam=0.9)
    g = torch.Generator().manual_seed(0)
    old = torch.randn(mask.shape, generator=g, dtype=torch.float64) * 0.3 - 1.0
    new = old + torch.randn(mask.shape, generator=g, dtype=torch.float64) * 0.4  # ratios outside the clip range too
    loss_cfg = OmegaConf.create({"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0,
                                 "global_batch_info": {}})
    loss = get_policy_loss_fn("vanilla")
    ours, _ = loss(old, new, out.advantages, mask, loss_agg_mode="token-mean", config=loss_cfg)
    sparse, _ = loss(old, new, verl_adv, mask * out.endpoint_mask, loss_agg_mode="token-mean", config=loss_cfg)
    assert float(ours) == pytest.approx(float(sparse), rel=1e-9, abs=1e-12)


def test_endpoints_with_every_token_an_endpoint_is_verl_gae():
    rewards, mask, values, _, index = make_batch(5, 6, 25, "holes", junk=True)
    valid = mask.bool()
    out = compute_group_ppo_outputs(rewards, mask, values=values, index=index, threshold=0.0,
                                    settings=algo_settings(1.0, 1.0, policy_lam=0.8, policy_loss_on="endpoints"))
    verl_adv, _ = compute_gae_advantage_return(rewards.masked_fill(~valid, 0.0), values.masked_fill(~valid, 0.0),
                                               mask, gamma=1.0, lam=0.8)
    assert_close(out.advantages[valid], verl_adv[valid])


# --------------------------------------------------------------------------------------------------
# length_adaptive_alpha


def test_length_adaptive_lambda_per_response():
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]])
    lam = length_adaptive_lambda(mask, 0.5)
    assert lam.tolist() == pytest.approx([0.5, 0.6, 0.0, 0.0])  # 1 - 1/2, 1 - 1/2.5, empty, clipped from -1
    assert length_adaptive_lambda(mask, 1e9).tolist() == pytest.approx([1.0, 1.0, 0.0, 1.0])
    for bad in (0.0, -1.0, math.inf, math.nan, True):
        with pytest.raises(ValueError, match="length_adaptive_alpha"):
            length_adaptive_lambda(mask, bad)


@pytest.mark.parametrize("adv_norm", ["none", "batch", "prompt"])
@pytest.mark.parametrize("mask_kind", ["prefix", "holes"])
@pytest.mark.parametrize("rule", RULES)
def test_length_adaptive_lambda_equals_the_per_response_loop_reference(rule, mask_kind, adv_norm):
    rewards, mask, values, olp, index = make_batch(11, 9, 40, mask_kind, dense=False, junk=True, empty_rows=True)
    alpha = 0.1  # lengths 1-40: lambdas from 0 (clipped) to 0.75
    settings = algo_settings(0.98, 1.0, group_max_size=6, boundary_rule=rule, adv_norm=adv_norm, critic_lam=0.95,
                             length_adaptive_alpha=alpha)
    out = compute_group_ppo_outputs(rewards, mask, values=values, index=index, old_log_probs=olp, threshold=1.5,
                                    settings=settings)
    lams = vapo_lambdas(mask, alpha)
    assert len(set(lams)) > 3
    ref = reference_group_ppo(rewards, mask, values, gamma=0.98, lam=0.0, critic_lam=0.95, threshold=1.5,
                              group_max_size=6, boundary_rule=rule, adv_norm=adv_norm, old_log_probs=olp,
                              index=index, policy_lams=lams)
    assert torch.equal(out.endpoint_mask, ref.endpoints)
    assert_close(out.advantages, ref.advantages)
    assert_close(out.returns, ref.returns)
    nonempty = [lam for lam, row in zip(lams, mask.tolist()) if any(row)]
    assert out.metrics["group/policy_lam"] == pytest.approx(sum(nonempty) / len(nonempty))


def test_reference_with_per_response_lambdas_and_no_critic_lam_keeps_the_returns_on_lam():
    """The loop reference: ``critic_lam`` None means ``lam`` with ``policy_lams`` too, as the settings read
    ``critic_lam: null`` beside ``length_adaptive_alpha``; a wrong number of lambdas is named."""
    rewards, mask, values, olp, index = make_batch(23, 6, 20, "holes", dense=False, junk=True)
    lams = vapo_lambdas(mask, 0.2)
    common = dict(gamma=0.98, lam=0.6, threshold=1.5, group_max_size=5, adv_norm="batch", policy_lams=lams)
    implicit = reference_group_ppo(rewards, mask, values, **common)
    explicit = reference_group_ppo(rewards, mask, values, critic_lam=0.6, **common)
    assert torch.equal(implicit.returns, explicit.returns) and torch.equal(implicit.advantages, explicit.advantages)
    out = compute_group_ppo_outputs(rewards, mask, values=values, index=index, threshold=1.5,
                                    settings=algo_settings(0.98, 0.6, group_max_size=5, length_adaptive_alpha=0.2))
    assert_close(out.returns, implicit.returns)
    assert_close(out.advantages, implicit.advantages)
    with pytest.raises(ValueError, match="policy_lams"):
        reference_group_ppo(rewards, mask, values, **{**common, "policy_lams": lams[:-1]})


@pytest.mark.parametrize("mask_kind", ["prefix", "holes"])
def test_length_adaptive_lambda_at_tau_0_is_per_response_decoupled_gae(mask_kind):
    rewards, mask, values, _, index = make_batch(13, 6, 45, mask_kind, junk=False)
    cfg = config(1.0, 1.0, adv_norm="none", critic_lam=1.0, length_adaptive_alpha=0.05)
    adv, ret = compute_group_advantage(rewards, mask, values=values, index=index, config=cfg, threshold=0.0)
    valid = mask.bool()
    for b, lam in enumerate(vapo_lambdas(mask, 0.05)):
        row = slice(b, b + 1)
        _, policy_ret = compute_gae_advantage_return(rewards[row], values[row], mask[row], gamma=1.0, lam=lam)
        assert_close(adv[row][valid[row]], (policy_ret - values[row])[valid[row]])
    _, critic_ret = compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=1.0)
    assert_close(ret[valid], critic_ret[valid])


def test_length_adaptive_lambda_is_off_by_default_and_overrides_policy_lam():
    rewards, mask, values, _, index = make_batch(17, 5, 20, "prefix", junk=False)
    base = dict(values=values, index=index, threshold=1.0)
    plain = compute_group_ppo_outputs(rewards, mask, settings=algo_settings(1.0, 1.0, policy_lam=0.9), **base)
    huge = compute_group_ppo_outputs(rewards, mask, settings=algo_settings(1.0, 1.0, policy_lam=0.9,
                                                                           length_adaptive_alpha=1e12), **base)
    at_one = compute_group_ppo_outputs(rewards, mask, settings=algo_settings(1.0, 1.0, policy_lam=1.0), **base)
    assert plain.metrics["group/policy_lam"] == 0.9
    assert_close(huge.advantages, at_one.advantages, tol=1e-6)  # alpha -> inf: lambda -> 1, whatever policy_lam says
    assert not torch.allclose(plain.advantages, at_one.advantages)


# --------------------------------------------------------------------------------------------------
# through verl's own advantage step (what the trainer calls), without Ray


def test_both_options_reach_the_estimator_through_verls_compute_advantage():
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage

    from verl_group_ppo.integration.estimator import estimator_inputs

    rewards, mask, values, _, index = make_batch(19, 8, 24, "prefix", dense=False, junk=False, dtype=torch.float32)
    group_params = {"policy_loss_on": "endpoints", "length_adaptive_alpha": 0.1, "adaptive_threshold": False}
    algorithm = OmegaConf.create({"adv_estimator": "group_ppo", "gamma": 1.0, "lam": 1.0,
                                  "norm_adv_by_std_in_grpo": True, "group_params": group_params})
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": mask},
                               non_tensors={"uid": np.asarray(index)})
    with estimator_inputs(values, threshold=1.0) as inputs:
        data = compute_advantage(data, adv_estimator="group_ppo", config=algorithm)
    expected = compute_group_ppo_outputs(rewards, mask, values=values, index=index, threshold=1.0,
                                         settings=algo_settings(1.0, 1.0, **group_params))
    assert torch.equal(data.batch["advantages"], expected.advantages)
    assert torch.equal(data.batch["returns"], expected.returns)
    assert torch.all(data.batch["advantages"][~expected.endpoint_mask] == 0)
    assert inputs.outputs.metrics["group/policy_lam"] == expected.metrics["group/policy_lam"] < 0.95


def test_endpoints_handed_to_estimator_inputs_are_the_groups_verls_advantage_step_uses():
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage

    from verl_group_ppo.integration.estimator import estimator_inputs

    rewards, mask, values, old_log_probs, index = make_batch(23, 6, 20, "prefix", junk=False, dtype=torch.float32)
    endpoints = mask.bool() & (torch.arange(20) % 5 == 4)  # every fifth token, decided before the advantage step
    algorithm = OmegaConf.create({"adv_estimator": "group_ppo", **config(1.0, 0.9)})
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": mask},
                               non_tensors={"uid": np.asarray(index)})
    with estimator_inputs(values, old_log_probs, threshold=1.0, endpoints=endpoints) as inputs:
        data = compute_advantage(data, adv_estimator="group_ppo", config=algorithm)
    last_valid = mask.bool() & ~torch.cat([mask[:, 1:].bool(), torch.zeros(6, 1, dtype=torch.bool)], 1)
    assert torch.equal(inputs.outputs.endpoint_mask, endpoints | last_valid)
    expected = compute_group_ppo_outputs(rewards, mask, values=values, index=index, threshold=1.0,
                                         settings=algo_settings(1.0, 0.9), endpoints=endpoints)
    assert torch.equal(data.batch["advantages"], expected.advantages)
