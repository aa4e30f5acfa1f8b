"""benchmarks/bench_value_headroom.py without its long run: the variance shares, the explained variance, the
reference-noise corrections on hand-made numbers, the group starts, the report, and the committed records."""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "benchmarks") not in sys.path:
    sys.path.insert(0, str(REPO / "benchmarks"))  # what `python benchmarks/<name>.py` does (benchlib's convention)

bench = importlib.import_module("bench_value_headroom")
benchlib = importlib.import_module("benchlib")


def test_explained_variance_of_known_answers():
    ref = np.array([0.0, 1.0, 0.0, 1.0])
    assert bench.explained_variance_of(ref, ref) == 1.0
    assert bench.explained_variance_of(ref, np.full(4, 0.5)) == 0.0  # a constant explains nothing
    assert bench.explained_variance_of(ref, np.full(4, 3.0)) == 0.0  # an offset costs nothing
    # residual (0, 0, 0, 1): variance 3/16 against Var(ref) = 1/4
    assert bench.explained_variance_of(ref, np.array([0.0, 1.0, 0.0, 0.0])) == pytest.approx(0.25)
    assert bench.explained_variance_of(ref, 1.0 - ref) == pytest.approx(-3.0)  # not clipped
    assert math.isnan(bench.explained_variance_of(np.ones(3), np.zeros(3)))
    assert math.isnan(bench.explained_variance_of(np.zeros(0), np.zeros(0)))
    with pytest.raises(ValueError, match="ref, values"):
        bench.explained_variance_of(ref, ref[:3])


def test_mean_noise_and_ev_ceiling():
    np.testing.assert_allclose(bench.mean_noise(np.array([0.0, 0.5, 1.0]), 5), [0.0, 0.0625, 0.0])
    assert bench.mean_noise(np.array([0.5]), 1)[0] == 0.0
    ref = np.array([0.0, 1.0, 0.0, 1.0])  # Var 1/4
    assert bench.ev_ceiling(ref, np.full(4, 0.05)) == pytest.approx(0.8)
    assert math.isnan(bench.ev_ceiling(np.ones(2), np.zeros(2)))


def test_variance_split_between_and_within_prompts():
    # two prompts of value 0.25 and 0.75 (Var 1/16), two replies each
    v0 = np.array([0.25, 0.75])
    returns = np.array([0.0, 1.0, 1.0, 1.0])
    prompt_of = np.array([0, 0, 1, 1])
    split = bench.variance_split(v0, returns, prompt_of)
    within = (0.25 ** 2 + 0.75 ** 2 + 2 * 0.25 ** 2) / 4
    assert split["between"] == pytest.approx(1 / 16) and split["within"] == pytest.approx(within)
    assert split["between_share"] == pytest.approx((1 / 16) / (1 / 16 + within))
    corrected = bench.variance_split(v0, returns, prompt_of, noise0=np.array([0.01, 0.03]))
    assert corrected["between_corrected"] == pytest.approx(1 / 16 - 0.02)
    assert corrected["within_corrected"] == pytest.approx(within - 0.02)


def test_resolved_shares_add_up_along_a_martingale():
    # v0 = 0.5; reply 0 learns its outcome at its second start, reply 1 halfway at its only inner start,
    # reply 2 is one group (nothing resolved inside it)
    paths = [np.array([0.5, 0.5, 1.0]), np.array([0.5, 0.25]), np.array([0.5])]
    returns = np.array([1.0, 0.0, 1.0])
    out = bench.resolved_shares(paths, returns)
    total = (0.25 + 0.25 + 0.25) / 3
    assert out["within"] == pytest.approx(total)
    assert out["resolved"] == pytest.approx((0.25 + 0.0625) / 3 / total)
    assert out["remainder"] == pytest.approx((0.0 + 0.0625 + 0.25) / 3 / total)
    np.testing.assert_allclose(out["by_index"], [(0.0 + 0.0625) / 3 / total, 0.25 / 3 / total])
    noise = [np.array([0.01, 0.0, 0.02]), np.array([0.01, 0.03]), np.array([0.01])]
    corrected = bench.resolved_shares(paths, returns, noise)["resolved_corrected"]
    assert corrected == pytest.approx(((0.25 + 0.0625) / 3 - (0.03 + 0.04 + 0.01) / 3) / (total - 0.01))
    with pytest.raises(ValueError, match="path_values"):
        bench.resolved_shares(paths[:2], returns)


def test_credit_spread_weights_group_lengths_by_squared_increments():
    # reply 0: groups of 4 and 6 tokens, all of its change (0.5 -> 1.0) in the first group; reply 1: one group of
    # 10 tokens, change 0.5 -> 0.0
    paths = [np.array([0.5, 1.0]), np.array([0.5])]
    returns = np.array([1.0, 0.0])
    assert bench.credit_spread(paths, returns, [np.array([4, 6]), np.array([10])]) == pytest.approx(
        (0.25 * 4 + 0.25 * 10) / 0.5)
    # GRPO: every reply one group, the weighted reply length
    assert bench.credit_spread([p[:1] for p in paths], returns, [np.array([10]), np.array([10])]) == 10.0
    assert math.isnan(bench.credit_spread([np.array([1.0])], np.array([1.0]), [np.array([3])]))
    with pytest.raises(ValueError, match="group_lengths"):
        bench.credit_spread(paths, returns, [np.array([4]), np.array([10])])


def test_group_starts_are_the_first_tokens_of_each_group_id():
    from verl_group_ppo.core_algos import endpoints_to_group_ids, find_group_endpoints

    mask = torch.tensor([[1] * 10 + [0] * 2, [1] * 3 + [0] * 9])
    ends = find_group_endpoints(torch.zeros(2, 12), mask, boundary_rule="fixed", group_max_size=4)
    starts = bench.group_starts(endpoints_to_group_ids(ends, mask))
    assert starts[0].nonzero().flatten().tolist() == [0, 4, 8]
    assert starts[1].nonzero().flatten().tolist() == [0]
    logp = torch.zeros(2, 12)
    logp[0, 5] = math.log(0.5)  # a low-probability token starts a group
    ends = find_group_endpoints(torch.zeros(2, 12), mask, old_log_probs=logp, **bench.RULES["low_prob"])
    assert bench.group_starts(endpoints_to_group_ids(ends, mask))[0].nonzero().flatten().tolist() == [0, 5]


def _fake_record(rule: str) -> dict:
    source = {"ev_inner": 0.5, "ev_all": 0.4, "tokens_per_reply": 0.0, "wall_s": 0.0}
    return {
        "rule": rule, "replies": 8, "mean_reply_tokens": 10.0, "reply_score_mean": 0.5, "groups_per_reply": 2.0,
        "inner_starts": 8, "variance_split": bench.variance_split(np.array([0.2, 0.8]), np.array([0, 1, 1, 1.0]),
                                                                  np.array([0, 0, 1, 1])),
        "resolved": {"resolved": 0.3, "remainder": 0.7, "by_index": [0.3], "resolved_corrected": 0.25,
                     "credit_spread_tokens": 4.0, "credit_spread_tokens_grpo": 10.0},
        "ev_ceiling": {"inner": 0.9, "all": 0.8}, "sources": {name: dict(source) for name in bench.SOURCES},
        "ref_tokens_per_reply": {"inner": 100.0}, "ref_wall_s": 1.0,
        "critic": {"train_prompts": 4, "train_replies": 16, "updates": 2, "mini_batch": 8, "lr": 1e-3,
                   "history": [{"updates": 0, "heldout_ev_all_tokens": 0.0, "heldout_ev_first_token": 0.0}]},
        "settings": {"task": "tiny", "prompts": 2, "n": 4, "k_ref": 4, "seed": 0},
        "rules_run_together": [rule], "seconds_shared": {"total": 1.0},
        "command": "python benchmarks/bench_value_headroom.py --prompts 2",
    }


def test_report_prints_every_table_and_the_record_holds_no_machine_path(tmp_path):
    records = {rule: _fake_record(rule) for rule in bench.RULES}
    text = bench.report(records)
    for header in ("| return variance |", "| rule | groups / reply |", "| rule | source | EV inner |"):
        assert header in text
    assert text.count("| prefix_tree |") == len(bench.RULES)
    assert bench.report({}) == "no records"
    benchlib.write_json(tmp_path / "r.json", records["fixed4"])  # refuses a record with an absolute path


def test_committed_records_hold_no_machine_path():
    for path in (REPO / bench.RESULTS).rglob("*.json"):
        record = benchlib.read_json(path)
        assert record is not None and benchlib.machine_paths(record) == [], path
        assert record["rule"] == path.stem and set(record["sources"]) == set(bench.SOURCES)


def test_bad_flags_fail_before_anything_runs():
    with pytest.raises(SystemExit, match="--rules"):
        bench.main(["--rules", "fixed4,nope"])
    with pytest.raises(SystemExit, match="--k-ref"):
        bench.main(["--k-ref", "1"])
