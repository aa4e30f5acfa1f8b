"""Ulysses sequence parallelism is refused on verl's CPU backend, before Ray starts.

verl's Ulysses all-to-all sits inside transformers' flash-attention path; on CPU the model attends with SDPA,
which verl leaves unpatched, so each sequence-parallel rank would attend over its own slice only. The launch
check (``verl_group_ppo.cpu.checks.check_cpu_sequence_parallel``) names the key instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import verl_group_ppo_testutils_integration as U
from verl_group_ppo.cpu.checks import ULYSSES_KEYS, check_cpu_sequence_parallel
from verl_group_ppo.integration.startup import make_validate_config

REPO = Path(__file__).resolve().parents[1]
CPU = ["trainer.device=cpu"]


@pytest.mark.parametrize("key", [
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
    "critic.ulysses_sequence_parallel_size",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
])
def test_cpu_device_refuses_ulysses_naming_the_key(key):
    cfg = U.compose_config(["algorithm.adv_estimator=group_ppo", *CPU, f"{key}=2"])
    with pytest.raises(ValueError, match=key.replace(".", r"\.") + "=2"):
        check_cpu_sequence_parallel(cfg, environ={})


def test_every_ulysses_key_exists_in_verls_config():
    from omegaconf import OmegaConf

    cfg = U.compose_config()
    for key in ULYSSES_KEYS:
        assert OmegaConf.select(cfg, key) == 1, key


def test_cpu_platform_variable_alone_refuses_ulysses():
    cfg = U.compose_config(["critic.ulysses_sequence_parallel_size=2"])
    with pytest.raises(ValueError, match="VERL_PLATFORM=cpu"):
        check_cpu_sequence_parallel(cfg, environ={"VERL_PLATFORM": "cpu"})


def test_ulysses_passes_on_gpus_and_size_one_passes_on_cpu():
    gpu = U.compose_config(["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                            "critic.ulysses_sequence_parallel_size=2"])
    check_cpu_sequence_parallel(gpu, environ={})  # trainer.device=cuda by default: verl's flash-attention path
    check_cpu_sequence_parallel(U.compose_config(CPU), environ={"VERL_PLATFORM": "cpu"})


def test_validate_config_runs_the_check_for_group_ppo_before_ray(monkeypatch):
    from verl_group_ppo.integration import startup

    monkeypatch.setattr(startup, "_ray_started", lambda: False)
    monkeypatch.setattr(startup, "check_accelerator", lambda config: None)
    validate = make_validate_config(lambda config, **kwargs: "verl")
    # sdpa: without flash-attn, any critic run with verl's default attention is refused (check_critic_attention)
    sp = ["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "+critic.model.override_config.attn_implementation=sdpa",
          *CPU]
    with pytest.raises(ValueError, match="ulysses_sequence_parallel_size"):
        validate(U.compose_config(["algorithm.adv_estimator=group_ppo", *sp]), use_critic=True)
    assert validate(U.compose_config(["algorithm.adv_estimator=gae", *sp]), use_critic=True) == "verl"


@pytest.mark.slow
def test_cpu_launcher_refuses_ulysses_before_ray_starts(tmp_path):
    # PREPARE=0: the launcher goes straight to main_ppo
    env = {**os.environ, "WORK_DIR": str(tmp_path), "PYTHON": sys.executable, "N_RANKS": "2", "PREPARE": "0",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(
        ["bash", str(REPO / "examples" / "cpu" / "common.sh"), "group_ppo",
         "actor_rollout_ref.model.use_remove_padding=True", "critic.model.use_remove_padding=True",
         "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "critic.ulysses_sequence_parallel_size=2"],
        env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "ulysses_sequence_parallel_size=2: Ulysses sequence parallelism does not run" in proc.stderr
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr
