"""verl's ``main_ppo`` on the maths task's two variants with the default model (SmolLM2-135M-Instruct):
``examples/cpu/run_arith_group_ppo.sh`` and ``run_twoway_group_ppo.sh`` for 2 steps each.

Marked ``real_model`` (and ``slow``): left out of ``pytest`` and of ``pytest -m "not slow"``, because their minutes
(the arith run validates 1,024 questions twice) would take the suite past 15; run them with ``pytest -m real_model``
(docs/mathtask.md). Each builds its task in ``ARITH_WORK_DIR`` / ``TWOWAY_WORK_DIR`` (default ``runs/cpu-arith``,
``runs/cpu-twoway``, kept between runs: the conversion and data are made once).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from verl_group_ppo.logs import parse_step_metrics
from verl_group_ppo.tasks.maths.spec import ARITH, TWOWAY

REPO = Path(__file__).resolve().parents[1]


def two_steps(task: str, tmp_path: Path) -> dict[int, dict[str, float]]:
    """Run ``run_<task>_group_ppo.sh`` for 2 steps; its validated and trained steps' metrics, after the checks
    every variant shares (exit 0, steps 0-2, actor and critic updated, the checkpoint saved)."""
    work_dir = os.environ.get(f"{task.upper()}_WORK_DIR", str(REPO / "runs" / f"cpu-{task}"))
    env = {**os.environ, "WORK_DIR": work_dir, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(REPO / f"examples/cpu/run_{task}_group_ppo.sh"), "trainer.total_training_steps=2",
                           f"trainer.default_local_dir={tmp_path / 'checkpoints'}"],
                          env=env, capture_output=True, text=True, timeout=3600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    steps = parse_step_metrics(output)
    assert sorted(steps) == [0, 1, 2], sorted(steps)
    for step in (1, 2):
        m = steps[step]
        assert 0.0 <= m["critic/score/mean"] <= 1.0 and m["group/num_groups"] >= 32, m
        assert all(k in m for k in ("critic/vf_loss", "actor/pg_loss", "critic/vf_explained_var")), sorted(m)
    assert (tmp_path / "checkpoints" / "global_step_2").is_dir()
    return steps


@pytest.mark.slow
@pytest.mark.real_model
def test_arith_validates_every_module_then_trains_actor_and_critic_two_steps(tmp_path):
    steps = two_steps("arith", tmp_path)
    for source in ARITH.data_sources:  # one accuracy and one answered rate per module, before any training
        assert steps[0][f"val-core/{source}/reward/mean@1"] > 0.0, steps[0]
        assert steps[0][f"val-aux/{source}/answered/mean@1"] >= 0.9, steps[0]
        assert f"val-core/{source}/reward/mean@1" in steps[2]  # verl validates again after the last step


@pytest.mark.slow
@pytest.mark.real_model
def test_twoway_validates_the_pretrained_model_then_trains_actor_and_critic_two_steps(tmp_path):
    steps = two_steps("twoway", tmp_path)
    val = f"val-core/{TWOWAY.data_sources[0]}/reward/mean@1"
    # the pretrained weights answer some test questions before any training (random weights answer none)
    assert steps[0][val] > 0.02, steps[0]
    assert val in steps[2]  # verl validates again after the last step
