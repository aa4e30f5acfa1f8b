"""The comparison rule, the paired SE and the rule's simulated power (benchmarks/stats.py)."""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import stats  # noqa: E402


@pytest.mark.parametrize("per_seed, expected", [
    ([0.03, 0.04, 0.05], "win"),           # all positive, mean 0.04 > 2 * 0.0058
    ([-0.03, -0.04, -0.05], "lose"),       # the mirror
    ([0.10, 0.10, -0.001], "level"),       # mean far above 2 SE, but one seed negative
    ([0.01, 0.20, 0.01], "level"),         # all positive, mean 0.073 < 2 SE 0.13
    ([0.02, 0.02], "win"),                 # SE 0 and all positive
    ([0.0, 0.0, 0.0], "level"),            # no difference at all
    ([0.001, 0.026, 0.024], "win"),        # the demo's default task, GROUP-PPO - decoupled GAE: 0.017 > 2 x 0.008
    ([0.05], "level"),                     # one seed: no standard error
    ([], "level"),
])
def test_rule_cases(per_seed, expected):
    assert stats.rule_verdict(per_seed) == expected


def test_paired_difference_uses_common_seeds_and_sample_sd():
    diff = stats.paired_difference({0: 0.5, 1: 0.6, 2: 0.7, 9: 1.0}, {0: 0.4, 1: 0.4, 2: 0.4, 5: 0.0})
    assert diff["seeds"] == [0, 1, 2]
    assert diff["per_seed"] == pytest.approx([0.1, 0.2, 0.3])
    assert diff["mean"] == pytest.approx(0.2)
    assert diff["se"] == pytest.approx(0.1 / math.sqrt(3))
    assert stats.verdict(diff) == "win"


def test_power_is_monotone_in_the_effect_and_near_zero_at_no_effect():
    powers = [stats.power_under_rule(e, 1.0, 6, sims=4000) for e in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0)]
    assert powers == sorted(powers)
    assert powers[0] < 0.03          # the all-same-sign clause: spurious wins are rare at 6 seeds
    assert powers[-1] > 0.97


def test_power_counts_the_same_sign_clause():
    """At 2 SE a t-like rule would win about half the time; the all-positive clause takes much more away."""
    effect = 2.0 / math.sqrt(6)  # 2 paired SE at SD 1, 6 seeds
    assert stats.power_under_rule(effect, 1.0, 6, sims=20000) < 0.4


def test_detectable_difference_is_about_4_4_se_at_6_seeds():
    assert stats.detectable_in_se(6) == pytest.approx(4.4, abs=0.1)
    sd = 0.03
    d = stats.detectable_difference(sd, 6)
    assert d == pytest.approx(4.4 * sd / math.sqrt(6), rel=0.03)
    assert stats.power_under_rule(d, sd, 6) == pytest.approx(0.8, abs=0.01)


def test_detectable_difference_scales_with_the_sd_and_is_zero_without_noise():
    assert stats.detectable_difference(0.02, 4) == pytest.approx(2 * stats.detectable_difference(0.01, 4), rel=1e-3)
    assert stats.detectable_difference(0.0, 4) == 0.0


def test_level_reads_not_measurable_when_the_detectable_difference_exceeds_half_the_rise():
    diff = stats.paired_difference({s: v for s, v in enumerate([0.01, -0.02, 0.03, 0.0])}, {s: 0.0 for s in range(4)})
    detectable = stats.detectable_of(diff["per_seed"])
    assert stats.verdict(diff) == "level"
    assert stats.verdict(diff, rise=2 * detectable * 0.9) == "not measurable"
    assert stats.verdict(diff, rise=2 * detectable * 1.1) == "level"
    win = stats.paired_difference({0: 0.1, 1: 0.11, 2: 0.12}, {0: 0.0, 1: 0.0, 2: 0.0})
    assert stats.verdict(win, rise=0.001) == "win"  # a win stays a win


@pytest.mark.parametrize("kwargs, name", [
    ({"sd_paired": -1.0, "n_seeds": 4}, "sd_paired"),
    ({"sd_paired": float("nan"), "n_seeds": 4}, "sd_paired"),
    ({"sd_paired": 1.0, "n_seeds": 1}, "n_seeds"),
    ({"sd_paired": 1.0, "n_seeds": 4, "sims": 0}, "sims"),
    ({"sd_paired": 1.0, "n_seeds": 4, "power": 1.0}, "power"),
])
def test_bad_design_names_the_argument(kwargs, name):
    with pytest.raises(ValueError, match=name):
        stats.detectable_difference(**kwargs)


def test_rule_codes_refuses_one_seed():
    with pytest.raises(ValueError, match="d:"):
        stats.rule_codes(np.zeros((3, 1)))


def test_unpaired_sd_pairs_each_seed_with_the_next_and_shows_what_pairing_saves():
    shared = {0: 0.1, 1: 0.5, 2: 0.9, 3: 0.3}  # each seed's own level, shared by both arms
    a = {s: v + 0.02 for s, v in shared.items()}
    assert stats.paired_sd([a[s] - shared[s] for s in shared]) == pytest.approx(0.0, abs=1e-12)
    expected = np.std([a[0] - shared[1], a[1] - shared[2], a[2] - shared[3], a[3] - shared[0]], ddof=1)
    assert stats.unpaired_sd(a, shared) == pytest.approx(expected) and expected > 0.3
    assert stats.unpaired_sd({0: 1.0}, {0: 2.0}) is None


def test_seeds_needed_is_the_first_seed_count_whose_detectable_difference_reaches_the_target():
    n = stats.seeds_needed(0.02, 0.034, sims=4000)
    assert n > 2 and stats.detectable_difference(0.02, n, sims=4000) <= 0.034
    assert stats.detectable_difference(0.02, n - 1, sims=4000) > 0.034
    # the all-same-sign clause: every seed must come out positive, so below about 1.7 paired SD no seed count will do
    assert stats.seeds_needed(0.02, 0.03, sims=4000) is None
    with pytest.raises(ValueError, match="target"):
        stats.seeds_needed(0.02, 0.0)
