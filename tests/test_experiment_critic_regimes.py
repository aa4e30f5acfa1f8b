"""experiments/critic_regimes.py: the pre-registered plan, one file per run, resuming after an interruption, and the
report's numbers on fake run records and on the committed ones (nothing trains)."""

from __future__ import annotations

import math
import re

import pytest
from test_benchmarks import REPO, _load, _numbers, _table


def _fake_record(job, shift: float = 0.0) -> dict:
    final = 0.5 + shift + 0.01 * job.seed + (0.02 if job.condition == "pretrained" else 0.0)
    return {"estimator": job.arm, "seed": job.seed, "regime": job.condition, "steps": 200, "final_eval_accuracy": final,
            "curve_area": final / 2, "curve": [[0, 0.1], [200, final]], "wall_time_s": 1.0,
            "final_critic_explained_variance": (None if job.arm == "grpo"
                                                else 0.1 + 0.2 * (job.condition == "pretrained")),
            "pretrained_heldout_explained_variance": 0.35 if job.condition == "pretrained" else None}


SHIFT = {"group_ppo": 0.03, "gae": 0.0, "group_ppo_per_token": 0.0, "endpoint_loss": -0.05, "vapo": 0.0, "grpo": -0.02}


def _fake_sweep(bench, out_dir: str, missing: int = 4):
    runs = bench.sweep(out_dir)
    for job in runs.runs[:len(runs.runs) - missing]:  # the last runs are still missing
        runs.save(job, _fake_record(job, SHIFT[job.arm]))
    return runs


def test_critic_regimes_plan_is_the_preregistered_one():
    bench = _load("experiments.critic_regimes")
    jobs = bench.sweep("out").runs
    assert len(jobs) == len(set(jobs)) == 37  # (4 + 4 + 3 + 3 + 3) x 2 regimes + GRPO's 3
    count = lambda arm, regime: sorted(j.seed for j in jobs if j.arm == arm and j.condition == regime)  # noqa: E731
    for regime in bench.REGIMES:
        assert count("group_ppo", regime) == count("gae", regime) == [0, 1, 2, 3]
        for arm in ("group_ppo_per_token", "endpoint_loss", "vapo"):
            assert count(arm, regime) == [0, 1, 2]
    assert count("grpo", "recipe") == [0, 1, 2] and count("grpo", "pretrained") == []
    assert [j.seed for j in jobs] == sorted(j.seed for j in jobs)  # whole seeds first
    with pytest.raises(SystemExit):
        bench.main(["--steps", "150", "--output-dir", "/nonexistent"])  # fewer than 200 steps: refused


def test_critic_regimes_resume_runs_only_unfinished_runs(tmp_path, monkeypatch):
    from types import SimpleNamespace

    import experiments.demo.cli as cli
    import experiments.demo.rl as rl

    bench = _load("experiments.critic_regimes")
    setups, ran = [], []
    monkeypatch.setattr(cli, "setup_demo", lambda opts, cfg, device, log, pretrain: setups.append(pretrain.enabled)
                        or SimpleNamespace(cfg=cfg, task=None, tok=None, train=None, evals=None, init_state={},
                                           critic_pretrain={"heldout_explained_variance": 0.4} if pretrain.enabled
                                           else {}))

    stop_after = [5]

    def fake_run(arm, seed, cfg, *args, on_step=None, **kwargs):
        if len(ran) == stop_after[0]:
            raise RuntimeError("interrupted")  # the sweep is interrupted during its sixth run
        ran.append((arm, seed))
        on_step({"step": cfg.steps, "eval/accuracy": 0.5})
        history = [{"critic/vf_explained_var": 0.2}] * 12 if arm != "grpo" else [{}]
        return {"estimator": arm, "seed": seed, "final_eval_accuracy": 0.5, "curve_area": 0.3, "steps": cfg.steps,
                "curve": [[0, 0.1]], "wall_time_s": 1.0, "history": history}

    monkeypatch.setattr(rl, "run_one", fake_run)
    logs: list[str] = []
    runs = bench.sweep(str(tmp_path))
    with pytest.raises(RuntimeError, match="interrupted"):
        bench.run_sweep(str(tmp_path), 200, log=logs.append)
    assert len(runs.pending(bench.finished(200))) == 37 - 5
    assert len(runs.pending(bench.finished(300))) == 37  # other step counts are other runs
    first = runs.load(runs.runs[0])
    assert first["final_critic_explained_variance"] in (None, pytest.approx(0.2))
    (tmp_path / "runs" / "recipe" / "gae-seed0.json").write_text("{half a fi")  # a broken file is rerun
    ran.clear()
    stop_after[0] = None  # the rerun is not interrupted
    assert bench.run_sweep(str(tmp_path), 200, log=logs.append) == 37 - 5 + 1
    assert len(ran) == 37 - 5 + 1 and not runs.pending(bench.finished(200))  # and the broken file's run again
    assert ran.count(("gae", 0)) == 2 and ran.count(("group_ppo", 0)) == 1  # recipe's gae again; both pretrained
    assert setups == [False, False, True] and any("run 1/33" in line for line in logs)  # one setup a regime a call
    assert any("step 200/200, eval accuracy 0.500" in line for line in logs)
    pretrained = runs.load(bench.Run("gae", 0, "pretrained"))
    assert pretrained["pretrained_heldout_explained_variance"] == 0.4 and pretrained["regime"] == "pretrained"


def test_critic_regimes_report_names_missing_runs_and_applies_the_rule(tmp_path):
    bench = _load("experiments.critic_regimes")
    runs = _fake_sweep(bench, str(tmp_path))
    text = bench.report(str(tmp_path), str(tmp_path / "regimes.png"))
    missing = re.search(r"Missing runs \((\d+) of (\d+)\): (.*)", text)
    assert missing.group(1, 2) == ("4", "37")
    assert missing.group(3).split(", ") == [f"{j.condition}/{j.arm}/seed {j.seed}" for j in runs.runs[-4:]]
    recipe, pretrained = text.split("### Regime `pretrained`")
    assert _numbers(pretrained.split("held-out explained variance before RL:")[1].splitlines()[0]) == [0.35]
    rows = {row[0]: row for row in _table(recipe, "arm")}
    # GROUP-PPO: seeds 0-2 (seed 3 missing), 0.5 + 0.03 + 0.01 s; PPO's seeds 0-3; paired over 0-2: +0.03 each
    assert _numbers(rows["GROUP-PPO"][1]) == pytest.approx([0.54, 3]) and _numbers(rows["GROUP-PPO"][2]) == [0.1]
    assert _numbers(rows["GROUP-PPO"][3]) == pytest.approx([0.03, 0.0, 3]) and rows["GROUP-PPO"][3].endswith("win)")
    assert rows["GROUP-PPO (policy loss at endpoints)"][3].endswith("lose)")
    assert rows["GRPO"][2] == "n/a" and rows["PPO (GAE)"][3:] == ["(PPO)", "(PPO)"]
    assert {row[0]: row[1] for row in _table(pretrained, "arm")}["GRPO"] == rows["GRPO"][1]  # run once, in both
    # what pretraining does to each arm (the fake pretrained runs are 0.02 better on every seed)
    shift = {row[0]: row for row in _table(text.split("`pretrained` - `recipe`")[1], "arm")}
    assert _numbers(shift["PPO (GAE)"][1]) == pytest.approx([0.02, 0.0, 3]) and shift["PPO (GAE)"][1].endswith("win)")
    assert "GRPO" not in shift
    empty = tmp_path / "empty"
    assert "Missing runs (37 of 37)" in bench.report(str(empty), str(tmp_path / "none.png"))
    assert not (tmp_path / "none.png").exists()  # nothing to draw


def test_critic_regimes_figure_shows_each_arms_mean_and_two_standard_errors(tmp_path):
    bench = _load("experiments.critic_regimes")
    _fake_sweep(bench, str(tmp_path))
    by_regime = bench.load_runs(bench.sweep(str(tmp_path)))
    data = bench.figure_data({r: bench.arm_summary(by_regime[r]) for r in bench.REGIMES})
    bars = {regime: {arm: (mean, err) for arm, mean, err in data[regime]} for regime in bench.REGIMES}
    assert bars["recipe"]["group_ppo"] == pytest.approx((0.54, 2 * 0.01 / math.sqrt(3)))
    assert bars["pretrained"]["gae"] == pytest.approx((0.53, 2 * 0.01 / math.sqrt(3)))  # seed 3 missing
    assert bars["pretrained"]["grpo"] == bars["recipe"]["grpo"]  # one set of GRPO runs, drawn in both
    assert [arm for arm, _, _ in data["recipe"]] == list(bench.ARM_ORDER)


def test_critic_regimes_report_reproduces_the_committed_tables(tmp_path):
    """docs/results.md's critic-regime tables are what --report prints from benchmarks/results/critic_regimes/."""
    bench = _load("experiments.critic_regimes")
    text = bench.report(str(REPO / "benchmarks" / "results" / "critic_regimes"), str(tmp_path / "regimes.png"))
    docs = (REPO / "docs" / "results.md").read_text()
    assert "All 37 runs finished." in text
    for regime in text.split("### Regime ")[1:]:
        for row in _table(regime, "arm"):
            ev = "|" if row[2] == "n/a" else f"| {row[2]} |"
            assert f"| {row[1]} {ev}" in docs, row  # final accuracy (seeds) and critic explained variance
            for cell in row[3:]:
                if cell != "(PPO)":
                    diff, verdict = re.match(r"(.*) \(\d+ seeds, (\w+)\)", cell).groups()
                    assert re.search(re.escape(diff) + rf", (\*\*)?{verdict}", docs), (row[0], cell)
