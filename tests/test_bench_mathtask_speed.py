"""The maths-task speed sweep without its runs: each task's base is its launcher's settings, one lever changes a
configuration, old records match through the levers' defaults, and bad arguments are refused by name."""

from __future__ import annotations

import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_mathtask_speed as S  # noqa: E402
from verl_group_ppo.tasks.maths.spec import ARITH, TWOWAY  # noqa: E402


@pytest.mark.parametrize("spec", [ARITH, TWOWAY], ids=["arith", "twoway"])
def test_the_base_is_the_launchers_and_each_configuration_changes_one_lever(spec):
    sweep = S.configs(spec)
    b = sweep["base"]
    assert (b.threads, b.prompts, b.mini_batches, b.response_length, b.prompt_length) == (
        spec.threads, spec.train_batch, spec.actor_mini_batches, spec.response_length, spec.prompt_length)
    assert sweep["base_again"] == b and list(sweep)[0] == "base" and list(sweep)[-1] == "base_again"
    for name, levers in sweep.items():
        changed = [k for k, v in asdict(levers).items() if v != asdict(b)[k]]
        assert len(changed) <= (2 if name == "vllm_bf16" else 1), (name, changed)
    assert f"data.val_batch_size={4 * b.val_batch}" in sweep[f"val_batch{4 * b.val_batch}"].overrides()
    assert f"data.train_batch_size={2 * spec.train_batch}" in sweep[f"prompts{2 * spec.train_batch}"].overrides()


def test_a_record_from_before_a_lever_existed_matches_at_its_default_and_not_otherwise():
    b = S.base(ARITH)
    old = {k: v for k, v in asdict(b).items() if k != "val_batch"}
    assert b.matches(old) and b.matches(asdict(b))
    assert not replace(b, val_batch=256).matches(old) and not b.matches({**old, "prompts": 16})


def test_unknown_configurations_and_too_few_steps_are_refused_by_name():
    with pytest.raises(SystemExit, match="--configs: unknown \\['nope'\\]"):
        S.main(["--task", "arith", "--configs", "base,nope"])
    with pytest.raises(SystemExit, match="--steps: must be >= 2"):
        S.main(["--task", "arith", "--steps", "1"])
    with pytest.raises(SystemExit, match="--work-dir: .* holds no prepared task"):
        S.main(["--task", "arith", "--work-dir", "/nonexistent-work-dir", "--configs", "base"])
