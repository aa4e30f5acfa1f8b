"""bench_critic_regimes: the pre-registered plan, one file per run, resuming after an interruption, and the
report on fake run records (nothing trains)."""

from __future__ import annotations

import pytest
from test_benchmarks import _load


def _fake_record(bench, job, shift: float = 0.0) -> dict:
    final = 0.5 + shift + 0.01 * job.seed + (0.02 if job.regime == "pretrained" else 0.0)
    return {"estimator": job.arm, "seed": job.seed, "regime": job.regime, "steps": 200, "final_eval_accuracy": final,
            "curve_area": final / 2, "curve": [[0, 0.1], [200, final]], "wall_time_s": 1.0,
            "final_critic_explained_variance": None if job.arm == "grpo" else 0.1 + 0.2 * (job.regime == "pretrained"),
            "pretrained_heldout_explained_variance": 0.35 if job.regime == "pretrained" else None}


def test_critic_regimes_plan_is_the_preregistered_one():
    bench = _load("bench_critic_regimes")
    jobs = bench.plan()
    assert len(jobs) == len(set(jobs)) == 37  # (4 + 4 + 3 + 3 + 3) x 2 regimes + GRPO's 3
    count = lambda arm, regime: sorted(j.seed for j in jobs if j.arm == arm and j.regime == regime)  # noqa: E731
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

    import verl_group_ppo.demo.cli as cli
    import verl_group_ppo.demo.rl as rl

    bench = _load("bench_critic_regimes")
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
    with pytest.raises(RuntimeError, match="interrupted"):
        bench.run_sweep(str(tmp_path), 200, log=logs.append)
    assert len(bench.pending(str(tmp_path), 200)) == 37 - 5
    assert len(bench.pending(str(tmp_path), 300)) == 37  # other step counts are other runs
    first = bench.load_run(bench.run_path(str(tmp_path), bench.plan()[0]))
    assert first["final_critic_explained_variance"] in (None, pytest.approx(0.2))
    (tmp_path / "runs" / "recipe" / "gae-seed0.json").write_text("{half a fi")  # a broken file is rerun
    ran.clear()
    stop_after[0] = None  # the rerun is not interrupted
    bench.run_sweep(str(tmp_path), 200, log=logs.append)
    assert len(ran) == 37 - 5 + 1 and not bench.pending(str(tmp_path), 200)  # and the broken file's run again
    assert ran.count(("gae", 0)) == 2 and ran.count(("group_ppo", 0)) == 1  # recipe's gae again; both pretrained
    assert setups == [False, False, True] and any("run 1/33" in line for line in logs)  # one setup a regime a call
    assert any("step 200/200, eval accuracy 0.500" in line for line in logs)
    pretrained = bench.load_run(bench.run_path(str(tmp_path), bench.Job("pretrained", "gae", 0)))
    assert pretrained["pretrained_heldout_explained_variance"] == 0.4


def test_critic_regimes_report_names_missing_runs_and_applies_the_rule(tmp_path):
    bench = _load("bench_critic_regimes")
    shift = {"group_ppo": 0.03, "gae": 0.0, "group_ppo_per_token": 0.0, "endpoint_loss": -0.05, "vapo": 0.0,
             "grpo": -0.02}
    jobs = bench.plan()
    for job in jobs[:-4]:  # the last four runs are still missing
        bench.write_json(bench.run_path(str(tmp_path), job), _fake_record(bench, job, shift[job.arm]))
    figure = tmp_path / "regimes.png"
    text = bench.report(str(tmp_path), str(figure))
    assert figure.stat().st_size > 0
    assert "Missing runs (4 of 37): " + ", ".join(f"{j.regime}/{j.arm}/seed {j.seed}" for j in jobs[-4:]) in text
    recipe, pretrained = text.split("### Regime `pretrained`")
    assert "Pretrained critic, held-out explained variance before RL: 0.350" in pretrained
    assert "| GROUP-PPO | 0.540 (3) | 0.100 | +0.030 +- 0.000 (3 seeds, win) |" in recipe  # seed 3 missing
    assert "| GROUP-PPO (policy loss at endpoints) | " in recipe and "(3 seeds, lose)" in recipe
    assert "| GRPO | 0.490 (3) | n/a | " in recipe and "| GRPO | 0.490 (3) | n/a | " in pretrained  # run once
    assert "| PPO (GAE) | " in pretrained and " | 0.300 | (PPO) | (PPO) |" in pretrained
    # what pretraining does to each arm (the fake pretrained runs are 0.02 better on every seed)
    assert "| PPO (GAE) | +0.020 +- 0.000 (3 seeds, win) | +0.010 +- 0.000 (3 seeds, win) |" in pretrained
    empty = tmp_path / "empty"
    assert "Missing runs (37 of 37)" in bench.report(str(empty), str(tmp_path / "none.png"))
    assert not (tmp_path / "none.png").exists()
