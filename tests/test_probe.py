"""The estimator-quality probe's measurements (experiments.demo.probe_analysis): exact small cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from verl.trainer.ppo.core_algos import compute_gae_advantage_return

from experiments.demo.probe_analysis import (
    EstimatorConfig,
    blame_share,
    correlation,
    default_configs,
    estimator_advantages,
    first_wrong_tokens,
    monte_carlo_advantages,
)


def test_monte_carlo_advantages_telescope_to_reward_minus_first_value():
    values_mc = torch.tensor([[0.5, 0.25, 1.0, 0.0], [0.5, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    rewards = torch.tensor([[0.0, 0, 1, 0], [0, 0, 0, 0]])
    adv = monte_carlo_advantages(values_mc, rewards, mask)
    assert adv.tolist() == [[-0.25, 0.75, 0.0, 0.0], [-0.5, 0.0, 0.0, 0.0]]
    assert torch.allclose(adv.sum(-1), (rewards.sum(-1) - values_mc[:, 0]))


def test_correlation_is_pearson_over_valid_tokens_only():
    a = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1, 1, 0]])
    assert correlation(a, 2 * a + 1, mask) == pytest.approx(1.0)
    assert correlation(a, -a, mask) == pytest.approx(-1.0)
    assert math.isnan(correlation(a, torch.ones_like(a), mask))


def test_blame_share_counts_negative_mass_on_the_first_wrong_token():
    adv = torch.tensor([[-1.0, -3.0, 2.0], [-1.0, -1.0, -1.0], [0.5, 0.5, 0.5]])
    mask = torch.ones(3, 3)
    assert blame_share(adv, mask, [1, None, None]) == pytest.approx(0.75)
    assert blame_share(adv, mask, [None, 2, None]) == pytest.approx(1 / 3)  # flat: 1/L
    assert blame_share(adv, mask, [None, None, 0]) == 0.0  # no negative advantage at all
    assert math.isnan(blame_share(adv, mask, [None, None, None]))


def test_first_wrong_token():
    eos = 9
    correct = [[1, 2, 3, eos]] * 4
    got = [[1, 2, 3, eos], [1, 5, 3, eos], [1, 2, eos], [1, 2]]  # right, slip, stops early, cut off
    assert first_wrong_tokens(got, correct) == [None, 1, 2, None]


def test_gae_and_grpo_configs_match_their_definitions():
    g = torch.Generator().manual_seed(0)
    mask = (torch.arange(6)[None] < torch.tensor([[6], [4], [5], [6]])).float()
    rewards = torch.zeros(4, 6)
    rewards[torch.arange(4), mask.sum(-1).long() - 1] = torch.tensor([1.0, 0.0, 1.0, 1.0])
    values = torch.rand(4, 6, generator=g) * mask
    index = np.array([0, 0, 1, 1])
    adv, _ = estimator_advantages(EstimatorConfig("gae", "gae", 0.9), rewards, mask, values, index, values)
    _, ret = compute_gae_advantage_return(rewards, values, mask, gamma=1.0, lam=0.9)
    assert torch.allclose(adv, (ret - values) * mask)
    adv, _ = estimator_advantages(EstimatorConfig("grpo", "grpo"), rewards, mask, values, index, values)
    assert torch.allclose(adv[:, 0], torch.tensor([0.5, -0.5, 0.0, 0.0]))
    assert torch.all((adv == adv[:, :1])[mask.bool()]) and torch.all(adv[~mask.bool()] == 0)  # flat per response


def test_every_default_configuration_runs_and_group_ppo_at_tau0_is_gae():
    g = torch.Generator().manual_seed(1)
    mask = (torch.arange(8)[None] < torch.tensor([[8], [5], [7], [3]])).float()
    rewards = torch.zeros(4, 8)
    rewards[torch.arange(4), mask.sum(-1).long() - 1] = 1.0
    values = torch.rand(4, 8, generator=g) * mask
    olp = torch.rand(4, 8, generator=g).clamp(min=0.01).log()
    index = np.array([0, 0, 1, 1])
    for config in default_configs():
        adv, facts = estimator_advantages(config, rewards, mask, values, index, olp)
        assert adv.shape == (4, 8) and torch.isfinite(adv).all() and torch.all(adv[~mask.bool()] == 0), config.name
        if config.estimator == "group_ppo":
            assert facts["groups_per_response"] >= 1
    tau0 = EstimatorConfig("g", "group_ppo", 0.9, {"adaptive_threshold": False, "group_variance_threshold": 0.0})
    adv, _ = estimator_advantages(tau0, rewards, mask, values, index, olp)
    gae, _ = estimator_advantages(EstimatorConfig("gae", "gae", 0.9), rewards, mask, values, index, olp)
    assert torch.allclose(adv, gae, atol=1e-6)
