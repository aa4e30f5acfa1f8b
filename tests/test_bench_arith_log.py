"""One arithmetic run's summary from its log: pooled accuracy, the rise's SE test, reward windows, explained
variance, step times, and --log."""

from __future__ import annotations

import math
import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_arith_log as B  # noqa: E402
from verl_group_ppo.tasks.maths.spec import ARITH  # noqa: E402

SOURCES = B.SOURCES
MIDDLE = ARITH.test_freq  # the launcher validates in the middle
STEPS = ARITH.steps


def steps(val: tuple[float, float, float] = (0.1, 0.15, 0.2), reward=lambda s: 0.3, ev=None,
          answered: float = 0.9) -> dict[int, dict[str, float]]:
    """A launcher run's ``{step: metrics}``: every source at accuracy ``val[i]`` at step 0, the middle and the end."""
    out: dict[int, dict[str, float]] = {0: {}}
    for s in range(1, STEPS + 1):
        out[s] = {"critic/score/mean": reward(s), "critic/score/max": 1.0, "critic/score/min": 0.0,
                  "timing_s/step": 10.0, "timing_s/gen": 6.0}
        if ev is not None:
            out[s][B.EV] = ev(s)
    for s, v in zip((0, MIDDLE, STEPS), val):
        out[s].update({B.VAL.format(src): v for src in SOURCES} | {B.ANSWERED.format(src): answered for src in SOURCES})
    for s in (MIDDLE, STEPS):
        out[s]["timing_s/testing"] = 4.0
    return out


def test_counts_follow_the_test_split_and_pooling_weights_modules_by_them():
    from verl_group_ppo.tasks.maths import arith
    from verl_group_ppo.tasks.maths.prepare import PrepareSettings
    from verl_group_ppo.tasks.maths.task import arith_data_source

    modules = PrepareSettings().modules.split(",")
    drawn = Counter(arith_data_source(q.module) for q in arith.draw(modules, B.N_TEST, 0))
    assert B.COUNTS == dict(drawn) and list(B.COUNTS.values()) == [342, 341, 341] and B.N_TEST == 1024
    assert list(B.counts(512).values()) == [171, 171, 170]
    a, b, c = SOURCES
    assert B.pooled({a: 1.0, b: 0.0, c: 0.0}) == pytest.approx(342 / 1024)
    assert B.pooled({a: 0.0, b: 0.0, c: 1.0}, 512) == pytest.approx(170 / 512)
    s = B.summarise(steps())
    assert sorted(s["val"]) == [0, MIDDLE, STEPS] and s["val"][STEPS]["pooled"] == pytest.approx(0.2)


def test_the_rise_is_measured_in_binomial_standard_errors_of_the_difference():
    diff, se, flag = B.rise(0.10, 0.15, 512)
    assert diff == pytest.approx(0.05) and se == pytest.approx(math.sqrt((0.09 + 0.1275) / 512))
    assert flag == "yes"  # 0.05 > 2 x 0.0206
    assert B.rise(0.10, 0.13, 512)[2] == "no" and B.rise(0.15, 0.10, 512)[2] == "drop"
    assert B.rise(0.10, 0.125, 1024)[2] == "no" and B.rise(0.10, 0.13, 1024)[2] == "yes"  # more questions, smaller SE


def test_reward_windows_ev_over_the_second_half_of_varying_batches_and_step_time():
    ev = {s: (-1.0 if s <= STEPS // 2 else 0.5) for s in range(1, STEPS + 1)}
    ev[STEPS] = 9.0
    data = steps(reward=lambda s: s / 100, ev=ev.get)
    data[STEPS]["critic/score/max"] = 0.0  # every reward equal: its EV is left out
    s = B.summarise(data)
    assert s["first"] == pytest.approx(0.025) and s["last"] == pytest.approx((STEPS - 1.5) / 100)
    assert s["area"] == pytest.approx((STEPS + 1) / 200) and s["ev"] == 0.5
    assert s["timing"]["timing_s/step"] == (10.0, list(range(1, STEPS + 1)))
    assert s["timing"]["timing_s/testing"] == (4.0, [MIDDLE, STEPS])
    assert B.summarise(steps())["ev"] is None  # no critic


def log_text(data: dict[int, dict[str, float]]) -> str:
    lines = ["(TaskRunner pid=1) some other line"]
    for s, m in data.items():
        lines.append(f"(TaskRunner pid=1) step:{s} - " + " - ".join(f"{k}:np.float64({v})" for k, v in m.items()))
    return "\n".join(lines) + "\n"


def test_log_summary_of_one_launcher_run(tmp_path, capsys):
    data = steps(val=(0.10, 0.12, 0.20), ev=lambda s: 0.2, answered=0.8)
    a, b, c = SOURCES
    data[STEPS][B.VAL.format(a)] = 0.4
    path = tmp_path / "arith_full.log"
    path.write_text(log_text(data))
    assert B.main(["--log", str(path), "--n-test", "512"]) == 0
    text = capsys.readouterr().out
    assert f"| {STEPS} | mul_add (171) | 0.400 | 0.800 | 0.500 |" in text
    pooled = (171 * 0.4 + 171 * 0.2 + 170 * 0.2) / 512
    assert f"| {STEPS} | pooled (512) | {pooled:.3f} | 0.800 | {pooled / 0.8:.3f} |" in text
    assert f"pooled accuracy, step 0 -> {STEPS}: 0.100 -> {pooled:.3f}" in text and "> 2 SE: yes" in text
    assert "first 4 steps 0.300" in text and "median over the second half (batches whose rewards differ): +0.20" in text
    assert "| timing_s/step | 16 | 10.00 | 100.0% |" in text and "| timing_s/gen | 16 | 6.00 | 60.0% |" in text
    assert f"4.0 s at steps {MIDDLE}, {STEPS}" in text and "| timing_s/testing |" not in text
