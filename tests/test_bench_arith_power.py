"""The comparison rule's power simulation (``benchmarks/bench_arith_power.py``): the rule, the simulated verdict
shares, the smallest detectable difference and the argument checks; numpy only, no model."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "benchmarks") not in sys.path:
    sys.path.insert(0, str(REPO / "benchmarks"))  # what `python benchmarks/<name>.py` does (benchlib's convention)


def bench():
    return importlib.import_module("bench_arith_power")


@pytest.mark.parametrize("differences, expected", [
    ([0.05, 0.06, 0.04], "win"),             # all positive, mean far above 2 se
    ([0.05, -0.01, 0.06], "level"),          # mixed signs
    ([0.001, 0.001, 0.2], "level"),          # all positive, mean 0.067 <= 2 se 0.133
    ([-0.05, -0.06, -0.04], "lose"),         # the mirror
    ([0.01, 0.01, 0.01], "win"),             # se 0, all positive: the rule calls it a win
    ([-0.02, -0.02], "lose"),                # se 0, all negative
    ([0.0, 0.05, 0.05], "level"),            # a tie is not a positive difference
])
def test_verdict_hand_made(differences, expected):
    assert bench().verdict(differences) == expected


def test_verdict_needs_two_seeds():
    with pytest.raises(ValueError, match="differences"):
        bench().verdict([0.1])


def share(n=512, seeds=3, diff=0.0, run_sd=0.0, trials=2000, base=0.15):
    return bench().simulate(n, seeds, base, diff, run_sd, trials, np.random.default_rng(0))


def test_simulate_shares_sum_to_one_and_spurious_is_small_and_symmetric():
    null = share()
    assert sum(null.values()) == pytest.approx(1.0)
    assert null["win"] < 0.1 and null["lose"] < 0.1
    assert abs(null["win"] - null["lose"]) < 0.03


def test_power_rises_with_the_difference_and_with_n_questions():
    wins = [share(diff=d)["win"] for d in (0.0, 0.02, 0.04, 0.06)]
    assert wins == sorted(wins) and wins[-1] > 0.9
    assert share(n=2048, diff=0.03)["win"] > share(n=512, diff=0.03)["win"] + 0.2


def test_spurious_win_falls_with_seeds():
    assert share(seeds=6)["win"] < share(seeds=3)["win"] / 3


def test_smallest_detectable():
    small = bench().smallest_detectable
    assert small(512, 3, 0.15, 0.0, trials=1000) < small(512, 2, 0.15, 0.0, trials=1000)
    assert small(2048, 3, 0.15, 0.0, trials=1000) < small(512, 3, 0.15, 0.0, trials=1000)
    # beyond 3-4 seeds the rule's "every seed positive" clause outweighs the smaller standard error: no gain
    assert small(512, 6, 0.15, 0.02, trials=1000) >= small(512, 4, 0.15, 0.02, trials=1000)
    assert small(16, 3, 0.5, 0.2, trials=200) is None


@pytest.mark.parametrize("kwargs, name", [
    ({"seeds": 1}, "seeds"), ({"n_questions": 0}, "n_questions"), ({"base_accuracy": 1.2}, "base_accuracy"),
    ({"base_accuracy": -0.1}, "base_accuracy"), ({"run_sd": -0.01}, "run_sd"), ({"trials": 0}, "trials"),
])
def test_bad_arguments(kwargs, name):
    args = {"n_questions": 512, "seeds": 3, "base_accuracy": 0.15, "true_difference": 0.0, "run_sd": 0.0,
            "trials": 10, "rng": np.random.default_rng(0), **kwargs}
    with pytest.raises(ValueError, match=name):
        bench().simulate(**args)


def test_main_table_and_json(tmp_path, capsys):
    from benchlib import machine_paths

    out = tmp_path / "power.json"
    assert bench().main(["--n-questions", "64", "--seeds", "3", "--run-sd", "0,0.01", "--trials", "50",
                         "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| n questions | seeds | run SD |") and table.count("\n| 64 | 3 |") == 2
    record = json.loads(out.read_text())
    assert [r["run_sd"] for r in record["rows"]] == [0.0, 0.01] and not machine_paths(record)
