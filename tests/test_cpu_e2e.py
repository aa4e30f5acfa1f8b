"""The tiny real task (``verl_group_ppo.tasks.tiny.prepare`` / ``.reward``) and verl's real ``main_ppo`` on CPU.

Fast tests check the tokenizer, the verl rows, the reward and the cache. The ``slow`` tests run
``examples/cpu/common.sh`` (the launcher behind ``examples/cpu/run_tiny_*.sh``: verl's
``python -m verl.trainer.main_ppo`` with the CPU backend) for 2-3 steps each on a task built once per
session with a short warm start. Each ``main_ppo`` start costs about 40 s of Ray / worker start-up, so the
checks share as few runs as possible:

* group_ppo on 2 ranks (FSDP1, dynamic batches, remove-padding), 2 steps, checkpoint at step 2 (sync trainer);
* group_ppo resumed from it to step 3 in verl's ``colocate_async`` trainer, ``critic_loss_on=all_tokens``: the
  threshold comes from the checkpoint;
* grpo, 2 steps;
* group_ppo with ``value_source=mc`` on 2 ranks, on verl's vLLM rollout (the `small` model) when vLLM's CPU build
  is installed, else on the hf rollout, and with ``value_source=prefix_tree`` on the tree rollout, 2 steps each, no
  critic worker (``value_source=prefix_tree`` on independent replies, in the fixed rule the launcher gives it, runs
  in tests/test_multiturn_masks.py through verl's tool agent loop, with that run's checks).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from verl_group_ppo_testutils_vllm import VLLM_SKIP_REASON, vllm_installed

from verl_group_ppo.tasks import contract
from verl_group_ppo.tasks.tiny import chat, variants, warmstart
from verl_group_ppo.tasks.tiny import prepare as prep
from verl_group_ppo import logs as summarize_log
from verl_group_ppo.config import GroupParams
from verl_group_ppo.tasks.reward import compute_score  # the one reward function
from verl_group_ppo.tasks.tiny.reward import data_source_for, task_for
from verl_group_ppo.tasks.tiny.problems import make_task, split_problems

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "examples" / "cpu" / "common.sh"
# the tiny model, briefly warm-started: these runs check plumbing, not learning
TINY = prep.PrepareSettings(model_size="tiny", warmstart_steps=60, n_train=2000, n_test=64, min_sampled_accuracy=0.0)
# the threshold every run starts from (the launchers leave group_params at the package defaults)
TAU_0 = GroupParams().group_variance_threshold


# ---------------------------------------------------------------------------------------------- fast tests


@pytest.fixture(scope="module")
def problems():
    task = make_task("chain_sum")
    train, test = split_problems(task, 300, 20)
    return task, train, test


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, problems):
    _, train, _ = problems
    hf, vocab, merges = chat.train_tokenizer(variants.single_turn_texts(train, prep.PrepareSettings()), 300)
    path = tmp_path_factory.mktemp("tok")
    chat.save_tokenizer(hf, vocab, merges, str(path))
    return path


def test_tokenizer_loads_as_qwen2_with_chat_template(tokenizer_dir, problems):
    from transformers import AutoTokenizer
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    _, train, _ = problems
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert isinstance(tok, Qwen2Tokenizer)
    assert len(tok.encode("\n", add_special_tokens=False)) == 1  # verl's continuous-token check
    assert tok.eos_token == chat.IM_END and tok.pad_token == chat.PAD_TOKEN
    ids = chat.ChatTokenizer(tok).encode_prompt(train[0].prompt)
    text = tok.decode(ids)
    assert text == f"<|im_start|>user\n{train[0].prompt}<|im_end|>\n<|im_start|>assistant\n"
    solution_ids = tok.encode(train[0].solution, add_special_tokens=False)
    assert tok.decode(solution_ids + [tok.eos_token_id], skip_special_tokens=True) == train[0].solution


def test_vocab_and_merges_alone_rebuild_the_same_tokenizer(tokenizer_dir, tmp_path, problems):
    """transformers may build a Qwen2Tokenizer from vocab.json + merges.txt: it must tokenize alike."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

    _, train, test = problems
    full = AutoTokenizer.from_pretrained(tokenizer_dir)
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, tmp_path / name)
    rebuilt = AutoTokenizer.from_pretrained(tmp_path)
    assert isinstance(rebuilt, Qwen2Tokenizer) and len(rebuilt) == len(full)
    for p in train[:50] + test:
        for text in (p.prompt, p.solution, "user\n" + p.prompt):
            assert rebuilt.encode(text, add_special_tokens=False) == full.encode(text, add_special_tokens=False)


def test_rows_are_in_verl_format_and_score_with_the_demo_verifier(problems):
    task, train, _ = problems
    rng = random.Random(0)
    checked_wrong = 0
    for i, p in enumerate(train[:60]):
        row = variants.verl_row(p, task, "train", i)
        assert row["data_source"] == data_source_for("chain_sum") == "verl_group_ppo/chain_sum"
        assert row["prompt"] == [{"role": "user", "content": p.prompt}]
        assert row["reward_model"] == {"style": "rule", "ground_truth": p.answer}
        args = (row["data_source"], p.solution, row["reward_model"]["ground_truth"], dict(row["extra_info"]))
        assert compute_score(*args) == 1.0
        noisy = task.noisy_solution(p, rng, slip_prob=0.5)
        expected = task.verify(noisy, p)
        assert compute_score(row["data_source"], noisy, p.answer, dict(row["extra_info"])) == expected
        checked_wrong += expected == 0.0
    assert checked_wrong > 5  # the noisy solutions did exercise the 0 branch
    assert compute_score(data_source_for("chain_sum"), train[0].solution + "1", train[0].answer,
                         variants.verl_row(train[0], task, "train", 0)["extra_info"]) == 0.0


def test_reward_rejects_foreign_rows():
    with pytest.raises(ValueError, match="data_source"):
        task_for("openai/gsm8k")
    with pytest.raises(ValueError, match="extra_info"):
        compute_score("verl_group_ppo/chain_sum", "3 #3", "3", {"prompt": "1+2="})
    with pytest.raises(ValueError, match="task_name"):
        data_source_for("nope")


def test_settings_reject_bad_values():
    with pytest.raises(ValueError, match="warmstart_steps"):
        prep.PrepareSettings(warmstart_steps=-1)
    with pytest.raises(ValueError, match="warmstart_batch_size"):
        prep.PrepareSettings(n_train=10)


def test_prepare_writes_outputs_and_skips_when_cached(tmp_path, monkeypatch):
    import pandas as pd

    settings = prep.PrepareSettings(warmstart_steps=2, warmstart_batch_size=8, n_train=100, n_test=8,
                                    min_sampled_accuracy=0.0)
    info = prep.prepare(str(tmp_path), settings, log=lambda m: None)
    assert info["settings"]["warmstart_steps"] == 2 and 0.0 <= info["test_accuracy"]["sampled"] <= 1.0
    train = pd.read_parquet(tmp_path / "data" / "train.parquet")
    assert len(train) == 100 and set(train.columns) >= {"data_source", "prompt", "reward_model", "extra_info"}
    assert len(pd.read_parquet(tmp_path / "data" / "test.parquet")) == 8
    assert {"config.json", "model.safetensors", "vocab.json", "merges.txt",
            "tokenizer_config.json"} <= set(os.listdir(tmp_path / "model"))
    assert json.loads((tmp_path / contract.KEY_FILE).read_text()) == info

    def fail(*args, **kwargs):
        raise AssertionError("the warm start ran again although the outputs were cached")

    monkeypatch.setattr(warmstart, "warm_start", fail)
    assert prep.prepare(str(tmp_path), settings, log=lambda m: None) == info
    with pytest.raises(AssertionError, match="ran again"):  # other settings: rebuilt
        prep.prepare(str(tmp_path), prep.PrepareSettings(warmstart_steps=3, warmstart_batch_size=8, n_train=100,
                                                         n_test=8, min_sampled_accuracy=0.0), log=lambda m: None)


def test_prepare_refuses_a_warm_start_without_room(tmp_path):
    """Two warm-start steps sample nothing right: prepare stops, naming the settings, and writes no model."""
    settings = prep.PrepareSettings(warmstart_steps=2, warmstart_batch_size=8, n_train=100, n_test=8)
    with pytest.raises(RuntimeError, match="--warmstart-steps.*--warmstart-slip-prob"):
        prep.prepare(str(tmp_path), settings, log=lambda m: None)
    assert not (tmp_path / contract.KEY_FILE).exists() and not (tmp_path / "model").exists()


def test_summarize_log_reads_verl_console_metrics():
    text = ("noise line\n(TaskRunnerV1 pid=1) step:1 - critic/score/mean:0.25 - timing_s/step:2.0 - "
            "timing_s/adv:np.float64(0.5) - note:abc\nstep:2 - critic/score/mean:0.5 - timing_s/step:4.0 - "
            "timing_s/adv:1.0\n")
    steps = summarize_log.parse_step_metrics(text)
    assert steps == {1: {"critic/score/mean": 0.25, "timing_s/step": 2.0, "timing_s/adv": 0.5},
                     2: {"critic/score/mean": 0.5, "timing_s/step": 4.0, "timing_s/adv": 1.0}}
    assert summarize_log.timing_breakdown(steps) == {"timing_s/adv": 1.0, "timing_s/step": 4.0}  # step 1 left out
    assert summarize_log.reward_rise(steps, window=1) == (0.25, 0.5, 0.25)
    with pytest.raises(ValueError, match="window"):
        summarize_log.reward_rise(steps, window=3)


def stub_python(directory: Path) -> Path:
    """A stand-in interpreter for the launcher: it appends each call's arguments, then a ``----`` line, to
    ``directory/calls.txt`` instead of running them; the task spec (``-m verl_group_ppo.tasks.launcher``) it hands to
    this interpreter, as the launcher reads its variables from it."""
    stub = directory / "python"
    stub.write_text(f'#!/bin/sh\n[ "$2" = verl_group_ppo.tasks.launcher ] && exec {sys.executable} "$@"\n'
                    'printf "%s\\n" "$@" ---- >> "$(dirname "$0")/calls.txt"\n')
    stub.chmod(0o755)
    return stub


def stub_calls(directory: Path) -> list[list[str]]:
    """The calls :func:`stub_python` recorded, in order."""
    return [call.splitlines() for call in (directory / "calls.txt").read_text().split("----\n") if call]


def _launcher_args(tmp_path: Path, *extra: str) -> list[str]:
    """The arguments common.sh hands to the interpreter for main_ppo, through a stub PYTHON (no prepare, no verl
    run)."""
    (tmp_path / "calls.txt").unlink(missing_ok=True)
    env = {**os.environ, "WORK_DIR": str(tmp_path), "PYTHON": str(stub_python(tmp_path))}
    subprocess.run(["bash", str(LAUNCHER), "group_ppo", *extra], env=env, check=True, capture_output=True)
    return stub_calls(tmp_path)[-1]


@pytest.mark.slow
def test_launcher_plugs_in_the_short_poll_sampler_unless_the_run_needs_verls_own(tmp_path):
    hook = "trainer.v1.sampler.custom_sampler.path=pkg://verl_group_ppo.rollout.sampler"
    args = _launcher_args(tmp_path)
    assert args[:2] == ["-m", "verl.trainer.main_ppo"]
    assert hook in args and "trainer.v1.sampler.custom_sampler.name=replay_buffer" in args
    # verl gives a custom sampler no DAPO / failed-group refill arguments: those runs keep verl's own buffer
    for extra in ("algorithm.filter_groups.enable=True", "trainer.v1.sampler.sync_refill_failed_groups=True"):
        assert hook not in _launcher_args(tmp_path, extra), extra


@pytest.mark.slow
def test_launcher_computes_in_fp32_and_reuses_rollout_log_probs_unless_rollout_correction_is_asked_for(tmp_path):
    args = _launcher_args(tmp_path)
    # verl's FSDP engine reads mixed_precision.param_dtype (bf16 when absent), not fsdp_config.dtype
    assert "++actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32" in args
    assert "++critic.fsdp.mixed_precision.param_dtype=fp32" in args
    bypass = "algorithm.rollout_correction.bypass_mode=True"
    assert bypass in args
    # verl's v1 trainer skips rollout-correction IS/RS in bypass mode: a run that asks for them recomputes
    asked = _launcher_args(tmp_path, "algorithm.rollout_correction.rollout_rs=token_k1")
    assert bypass not in asked and asked[-1] == "algorithm.rollout_correction.rollout_rs=token_k1"


SAMPLER_HOOK = "trainer.v1.sampler.custom_sampler.path=pkg://verl_group_ppo.rollout.sampler"
BYPASS = "algorithm.rollout_correction.bypass_mode=True"


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra,keeps_sampler,keeps_bypass",
    [
        # a value or another key that merely contains the words leaves both settings in
        ("trainer.experiment_name=no_filter_groups", True, True),
        ("trainer.experiment_name=rollout_correction_custom_sampler", True, True),
        ("+trainer.my_filter_groups=1", True, True),
        ("algorithm.rollout_correction_note=x", True, True),
        # the keys themselves, with or without a Hydra prefix, take them out
        ("++algorithm.filter_groups.enable=True", False, True),
        ("+algorithm.filter_groups.metric=acc", False, True),
        ("trainer.v1.sampler.sync_refill_failed_groups=True", False, True),
        ("trainer.v1.sampler.custom_sampler.name=other", False, True),
        ("~algorithm.rollout_correction", True, False),
        ("++algorithm.rollout_correction.rollout_is=token", True, False),
    ],
)
def test_launcher_leaves_settings_out_by_override_key_not_substring(tmp_path, extra, keeps_sampler, keeps_bypass):
    args = _launcher_args(tmp_path, extra)
    assert (SAMPLER_HOOK in args) == keeps_sampler, args
    assert (BYPASS in args) == keeps_bypass, args
    assert args[-1] == extra


@pytest.mark.slow
def test_launcher_usage_prints_exactly_its_header_comment(tmp_path):
    proc = subprocess.run(["bash", str(LAUNCHER)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    lines = LAUNCHER.read_text().splitlines()
    end = next(i for i, line in enumerate(lines[1:], start=1) if not line.startswith("#"))
    header = [line[2:] if line.startswith("# ") else line[1:] for line in lines[1:end]]
    assert proc.stderr.splitlines() == header
    assert "N_RANKS" in proc.stderr and "set -euo" not in proc.stderr


def _arg_value(args: list[str], key: str) -> str:
    values = [a.split("=", 1)[1] for a in args if a.split("=", 1)[0] == key]
    assert values, key
    return values[-1]


@pytest.mark.slow
@pytest.mark.parametrize("n_ranks,micro", [(None, 32), ("2", 32), ("4", 16)])
def test_launcher_n_ranks_sets_the_gpu_count_and_a_micro_batch_that_divides(tmp_path, monkeypatch, n_ranks, micro):
    if n_ranks is None:
        monkeypatch.delenv("N_RANKS", raising=False)
    else:
        monkeypatch.setenv("N_RANKS", n_ranks)
    args = _launcher_args(tmp_path)
    ranks = int(n_ranks or 1)
    assert _arg_value(args, "trainer.n_gpus_per_node") == str(ranks)
    assert _arg_value(args, "++ray_kwargs.ray_init.num_gpus") == str(ranks)
    n = int(_arg_value(args, "actor_rollout_ref.rollout.n"))
    for mini_key, micro_key in [("actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"),
                                ("critic.ppo_mini_batch_size", "critic.ppo_micro_batch_size_per_gpu")]:
        assert int(_arg_value(args, micro_key)) == micro
        per_rank = int(_arg_value(args, mini_key)) * n // ranks
        assert per_rank % micro == 0, (mini_key, per_rank, micro)


@pytest.mark.slow
@pytest.mark.parametrize("rollout,work_dir,model_args", [
    (None, "cpu-tiny-tools", []), ("hf", "cpu-tiny-tools", []),
    ("vllm", "cpu-tiny-tools-small", ["--model-size", "small"])])
def test_multiturn_launcher_builds_a_model_vllm_can_serve_for_the_vllm_rollout(tmp_path, rollout, work_dir, model_args):
    # the tool task's tiny model has heads of 16 dimensions, which vLLM's CPU attention refuses: with the vllm rollout
    # the launcher's default task is the tool task on the small model, in a directory of its own
    root = tmp_path / "repo"
    (root / "examples" / "cpu").mkdir(parents=True)
    shutil.copy(LAUNCHER, root / "examples" / "cpu" / "common.sh")
    stub = stub_python(tmp_path)
    env = {**{k: v for k, v in os.environ.items() if k != "WORK_DIR"}, "PYTHON": str(stub), "MULTI_TURN": "1"}
    extra = [f"actor_rollout_ref.rollout.name={rollout}"] if rollout else []
    proc = subprocess.run(["bash", str(root / "examples" / "cpu" / "common.sh"), "group_ppo", *extra], env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    prepare = stub_calls(tmp_path)[0]
    assert prepare == ["-m", "verl_group_ppo.tasks.tiny.prepare", "--output-dir", str(root / "runs" / work_dir), "--variant", "tools",
                       *model_args]
    assert ("the tool task on the small model" in proc.stdout) == (rollout == "vllm")


@pytest.mark.slow
@pytest.mark.parametrize("bad", ["0", "3", "two", "-2"])
def test_launcher_rejects_a_rank_count_that_does_not_divide_the_batch(tmp_path, bad):
    env = {**os.environ, "WORK_DIR": str(tmp_path), "PYTHON": str(stub_python(tmp_path)), "N_RANKS": bad}
    proc = subprocess.run(["bash", str(LAUNCHER), "group_ppo"], env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and "N_RANKS" in proc.stderr, proc.stderr
    assert not (tmp_path / "calls.txt").exists()  # stopped before prepare


# ---------------------------------------------------------------------------------------- end-to-end


@pytest.fixture(scope="session")
def tiny_task(tmp_path_factory) -> Path:
    """The tiny task, built once per session (a short warm start: the runs check plumbing, not learning)."""
    path = tmp_path_factory.mktemp("cpu_tiny")
    prep.prepare(str(path), TINY, log=lambda m: None)
    return path


# Small steps: 8 prompts x 4 responses; mini-batches follow the batch.
SMALL = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
         "critic.ppo_mini_batch_size=8", "trainer.total_training_steps=2"]


def run_main_ppo(work_dir: Path, estimator: str, *overrides: str, timeout: int = 600) -> dict[int, dict[str, float]]:
    """Run the CPU launcher; assert rc 0; return verl's console metrics per step."""
    return run_main_ppo_logged(work_dir, estimator, *overrides, timeout=timeout)[0]


def run_main_ppo_logged(work_dir: Path, estimator: str, *overrides: str,
                        timeout: int = 600) -> tuple[dict[int, dict[str, float]], str]:
    """:func:`run_main_ppo`, also returning the run's output (stdout + stderr). ``work_dir`` holds the task prepared
    with :data:`TINY`, so the launcher runs without its prepare (``PREPARE=0``)."""
    env = {**os.environ, "WORK_DIR": str(work_dir), "PYTHON": sys.executable, "PREPARE": "0",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(["bash", str(LAUNCHER), estimator, *SMALL, *overrides], env=env, capture_output=True,
                          text=True, timeout=timeout)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"main_ppo ({estimator}) failed, rc={proc.returncode}:\n{output[-6000:]}"
    return summarize_log.parse_step_metrics(output), output


def assert_trained(steps: dict[int, dict[str, float]], expected_steps: list[int], critic: bool) -> None:
    assert sorted(steps) == expected_steps, f"steps logged: {sorted(steps)}"
    for step, m in steps.items():
        assert 0.0 <= m["critic/score/mean"] <= 1.0, (step, m.get("critic/score/mean"))
        assert math.isfinite(m["actor/pg_loss"]) and m["timing_s/step"] > 0
        assert ("critic/vf_loss" in m) == critic, (step, sorted(m))
        if critic:
            assert math.isfinite(m["critic/vf_loss"])


# Two trainer ranks (dp 2) for actor and critic under the GPU recipes' strategy (verl's default fsdp, torch FSDP1;
# the other e2e tests run fsdp2), with dynamic batch sizes and remove-padding on
TWO_RANKS_FSDP1 = [
    "actor_rollout_ref.actor.strategy=fsdp", "actor_rollout_ref.ref.strategy=fsdp", "critic.strategy=fsdp",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "critic.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=512",
    "critic.use_dynamic_bsz=True", "critic.ppo_max_token_len_per_gpu=512",
    "actor_rollout_ref.model.use_remove_padding=True", "critic.model.use_remove_padding=True",
]


@pytest.mark.slow
def test_group_ppo_on_two_ranks_saves_at_step_2_and_resumes_to_step_3_in_verls_colocate_async_mode(
        tiny_task, tmp_path, monkeypatch):
    # N_RANKS=2 (TWO_RANKS_FSDP1). Steps 1-2 in the launcher's sync mode, saved at step 2: the advantage step sees
    # the whole batch (8 prompts x 4 responses), not one rank's half, and step 2 samples with the weights the
    # sharded FSDP1 actor synced after its step-1 update. Step 3 resumed from that checkpoint in verl's
    # colocate_async trainer: our advantage step runs there too, from the saved threshold, and saves the one its
    # update moved to.
    monkeypatch.setenv("N_RANKS", "2")
    ckpt, rollouts = tmp_path / "ckpt", tmp_path / "rollouts"
    common = [f"trainer.default_local_dir={ckpt}", "trainer.save_freq=2", *TWO_RANKS_FSDP1]
    first = run_main_ppo(tiny_task, "group_ppo", *common, f"trainer.rollout_data_dir={rollouts}",
                         "algorithm.rollout_correction.bypass_mode=False")  # recompute: checks the weight sync
    assert_trained(first, [1, 2], critic=True)
    assert first[2]["training/rollout_probs_diff_max"] < 1e-4, first[2]
    responses = 8 * 4
    for step, m in first.items():
        assert m["group/num_groups"] >= responses, (step, m)
        assert m["group/groups_per_response"] * responses == pytest.approx(m["group/num_groups"], rel=1e-6), (step, m)
    _assert_groups_dump_renders(rollouts, tmp_path / "groups.html")
    assert first[1]["group/threshold"] == pytest.approx(TAU_0)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    saved_tau = _saved_threshold(ckpt, 2)
    assert saved_tau != pytest.approx(TAU_0), "the adaptive threshold did not move: the resume check would be blind"

    resumed = run_main_ppo(tiny_task, "group_ppo", *common, "trainer.resume_mode=auto",
                           "trainer.total_training_steps=3", "++algorithm.group_params.critic_loss_on=all_tokens",
                           "trainer.v1.trainer_mode=colocate_async")
    assert_trained(resumed, [3], critic=True)
    assert resumed[3]["group/threshold"] == pytest.approx(saved_tau, rel=1e-6)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert _saved_threshold(ckpt, 3) != pytest.approx(saved_tau, rel=1e-6), "step 3's threshold update did not run"


def _saved_threshold(ckpt: Path, step: int) -> float:
    state = json.loads((ckpt / f"global_step_{step}" / "group_ppo_state.json").read_text())
    return state["threshold_state"]["threshold"]


def _assert_groups_dump_renders(rollouts: Path, html: Path) -> None:
    """A real run's {step}.groups.jsonl beside verl's {step}.jsonl, rendered by python -m verl_group_ppo.viz."""
    from verl_group_ppo.viz import render_dump

    for step in (1, 2):
        assert (rollouts / f"{step}.jsonl").is_file() and (rollouts / f"{step}.groups.jsonl").is_file(), step
        first = json.loads((rollouts / f"{step}.groups.jsonl").read_text().splitlines()[0])
        assert len(first["tokens"]) == len(first["group_ids"]) == len(first["advantages"]) == len(first["endpoints"])
        assert first["group_ids"][0] == 1 and first["endpoints"][-1] == 1
    assert render_dump(str(rollouts), str(html), steps="all") == [1, 2]
    assert "<html" in html.read_text().lower()


@pytest.mark.slow
def test_grpo_baseline_with_its_replies_sampled_as_a_tree_runs_two_steps(tiny_task, tmp_path, monkeypatch):
    # The baseline without a critic (a reference model and verl's KL loss instead): the plugin leaves verl's worker
    # layout and advantage estimator to it. gae differs from the group_ppo runs above only in verl's own advantage
    # estimator, which tests/test_trainer.py checks through the plugin's trainer
    # (test_other_estimators_get_verls_trainer_behaviour). Its replies are sampled as a tree (ROLLOUT=tree, the
    # tree+GRPO arm of the comparisons; the group_ppo runs above sample them independently). verl recomputes the old
    # log-probs here (no bypass), and logs how far they are from the rollout's
    monkeypatch.setenv("ROLLOUT", "tree")
    steps = run_main_ppo(tiny_task, "grpo", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
                         "algorithm.rollout_correction.bypass_mode=False")
    assert_trained(steps, [1, 2], critic=False)
    # The hf rollout and the fp32 actor give the same token probabilities, before and after the step-1 update
    # (weight sync exact), on the tokens a row generated and on the prefix it copied from its parent: what lets the
    # launcher reuse the rollout's log-probs. In bf16 this is ~2e-2.
    for step in (1, 2):
        assert steps[step]["training/rollout_probs_diff_max"] < 1e-4, (step, steps[step])
        assert 0 < steps[step]["group/tree_generated_tokens"] < steps[step]["group/tree_path_tokens"], steps[step]
    assert all(k.startswith("group/tree_") for m in steps.values() for k in m if k.startswith("group/"))
    assert (tmp_path / "ckpt" / "global_step_2").is_dir()  # the launcher saves at the last step


# ---------------------------------------------------------------------------------------------- value sources


def _worker_groups(output: str) -> list[str]:
    """verl's "create worker group dict_keys([...])" lines: which workers the run built."""
    return [line.split("create worker group", 1)[1] for line in output.splitlines() if "create worker group" in line]


@pytest.fixture(scope="session")
def small_model_task(tmp_path_factory) -> Path:
    """The tiny task on the `small` model (attention heads vLLM's CPU attention serves), briefly warm-started."""
    path = tmp_path_factory.mktemp("cpu_tiny_small")
    prep.prepare(str(path), dataclasses.replace(TINY, model_size="small"), log=lambda m: None)
    return path


@pytest.mark.slow
@pytest.mark.skipif(not vllm_installed(), reason=VLLM_SKIP_REASON)
def test_tree_rollout_runs_on_verls_vllm_rollout_and_dumps_each_rows_tree_position(
        small_model_task, tmp_path, monkeypatch):
    # ROLLOUT=tree VALUE_SOURCE=prefix_tree on verl's vLLM rollout (one rank; the hf rollout's tree test runs two):
    # each sample asks only for its tail, a root in pieces (branch_start: prefix_ready, the hf test runs the default)
    monkeypatch.setenv("ROLLOUT", "tree")
    monkeypatch.setenv("VALUE_SOURCE", "prefix_tree")
    dump = tmp_path / "rollouts"
    steps, output = run_main_ppo_logged(small_model_task, "group_ppo", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
                                        "actor_rollout_ref.rollout.name=vllm",
                                        "++tree_rollout.branch_start=prefix_ready",
                                        f"trainer.rollout_data_dir={dump}")
    assert_trained(steps, [1, 2], critic=False)
    assert "CPUvLLMHttpServer" in output and "boundary_rule=tree" in output
    for step, m in steps.items():
        assert 0 < m["group/tree_generated_tokens"] < m["group/tree_path_tokens"], (step, m)
        assert m["group/tree_round0_generate_s"] > 0 and m["group/tree_round1_generate_s"] > 0, (step, m)
    records = [json.loads(line) for line in (dump / "2.groups.jsonl").read_text().splitlines()]
    assert len(records) == 8 * 4
    by_prompt: dict = {}
    for r in records:
        by_prompt.setdefault(r["uid"], []).append(r)
    for rows in by_prompt.values():  # 2 roots, each with one branch (branching [2])
        assert sorted(r["tree"]["level"] for r in rows) == [0, 0, 1, 1]
        for r in rows:
            assert (r["tree"]["parent"] == -1) == (r["tree"]["level"] == 0)


def _server_addresses(output: str) -> list[str]:
    """The rollout replicas' addresses verl's ``LLMServerManager`` prints at start-up."""
    line = next(line for line in output.splitlines() if "LLMServerManager: [" in line)
    return ast.literal_eval(line[line.index("LLMServerManager: ") + len("LLMServerManager: "):].strip())


#: the rollout the mc run takes: verl's vLLM rollout when vLLM's CPU build is installed, else the hf rollout
MC_ROLLOUT = "vllm" if vllm_installed() else "hf"


@pytest.mark.slow
@pytest.mark.parametrize("rollout", [MC_ROLLOUT])
def test_mc_on_two_ranks_samples_k_continuations_from_every_inner_group_start_through_the_rollout_replicas(
        rollout, request, tmp_path, monkeypatch):
    # Two ranks, so two rollout replicas share the continuations (verl's load balancer), and the advantage step
    # runs once in the driver over the whole batch, without a critic. On vLLM (the `small` model, whose attention
    # heads vLLM's CPU attention serves) the sync trainer put the replicas to sleep after sampling: mc wakes them
    # with the batch's weights, sends every continuation at once, and puts them back to sleep before the update.
    monkeypatch.setenv("N_RANKS", "2")
    task = request.getfixturevalue("small_model_task" if rollout == "vllm" else "tiny_task")
    steps, output = run_main_ppo_logged(task, "group_ppo", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
                                        *TWO_RANKS_FSDP1, f"actor_rollout_ref.rollout.name={rollout}",
                                        "++algorithm.group_params.value_source=mc",
                                        "++algorithm.group_params.mc_samples=3")
    assert_trained(steps, [1, 2], critic=False)
    assert not any("critic" in g for g in _worker_groups(output))
    assert ("CPUvLLMHttpServer" in output) == (rollout == "vllm")
    assert len(_server_addresses(output)) == 2, _server_addresses(output)  # one replica per rank
    responses = 8 * 4
    for step, m in steps.items():
        # every reply has a first group (its value is the prompt's mean); each later group start gets K = 3
        inner_starts = m["group/num_groups"] - responses
        assert inner_starts > 0 and m["group/mc_responses"] == 3 * inner_starts, (step, m)
        assert 0 < m["group/mc_tokens"] <= m["group/mc_responses"] * TINY.response_length, (step, m)
        assert m["timing_s/group_mc"] > 0 and m["timing_s/group_mc_generate"] <= m["timing_s/group_mc"], (step, m)


@pytest.mark.slow
def test_launcher_rollout_tree_sets_the_tree_agent_loop_its_shape_and_the_segment_rule(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLOUT", "tree")
    monkeypatch.setenv("VALUE_SOURCE", "prefix_tree")
    args = _launcher_args(tmp_path)
    assert "actor_rollout_ref.rollout.agent.default_agent_loop=tree_single_turn" in args
    n = int(_arg_value(args, "actor_rollout_ref.rollout.n"))
    roots, branching = int(_arg_value(args, "++tree_rollout.roots")), _arg_value(args, "++tree_rollout.branching")
    assert (roots, branching) == ((n // 4, "[2,2]") if n % 4 == 0 and n >= 8 else (n // 2, "[2]"))
    assert "++algorithm.group_params.boundary_rule=tree" in args and "++algorithm.group_params.policy_lam=0.0" in args
    assert not any(a.startswith("++algorithm.group_params.group_max_size") for a in args)
    own = _launcher_args(tmp_path, "++tree_rollout.roots=1")
    assert not any(a.startswith("++tree_rollout.branching") for a in own)
    assert _arg_value(own, "++tree_rollout.segment_tokens") == _arg_value(args, "++tree_rollout.segment_tokens")
    # a key that is not the shape's leaves the shape in place
    other = _launcher_args(tmp_path, "++tree_rollout.branch_start=prefix_ready")
    assert (int(_arg_value(other, "++tree_rollout.roots")), _arg_value(other, "++tree_rollout.branching")) == (
        roots, branching)
    assert "++tree_rollout.branch_start=prefix_ready" in other


@pytest.mark.slow
def test_tree_rollout_on_two_ranks_with_prefix_tree_values_trains_without_a_critic_on_fewer_generated_tokens(
        tiny_task, monkeypatch):
    # ROLLOUT=tree VALUE_SOURCE=prefix_tree on two hf rollout replicas: each prompt's 4 replies are one tree (2 roots,
    # branching [2]) that meets in one agent-loop worker whichever replica serves a sample, each reply generating
    # only its tail; groups are the tree's segments
    monkeypatch.setenv("ROLLOUT", "tree")
    monkeypatch.setenv("VALUE_SOURCE", "prefix_tree")
    monkeypatch.setenv("N_RANKS", "2")
    steps, output = run_main_ppo_logged(tiny_task, "group_ppo", *TWO_RANKS_FSDP1)
    assert_trained(steps, [1, 2], critic=False)
    assert "boundary_rule=tree" in output
    assert len(_server_addresses(output)) == 2, _server_addresses(output)  # one replica per rank
    for step, m in steps.items():
        assert 0 < m["group/tree_generated_tokens"] < m["group/tree_path_tokens"], (step, m)
