"""The saved critic's held-out explained variance (``benchmarks/bench_arith_critic.py``) on tiny stand-ins: the
checkpoint discovery and the refusals, verl's merger command, the critic loader on a folder laid out as the merger
writes a critic, the sampling and scoring of held-out replies, the table; and (slow: it runs verl's merger) the whole
script on a tiny actor and critic saved the way verl's FSDP2 checkpoint manager saves them."""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from verl_group_ppo_testutils_maths import write_tiny_gguf

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "benchmarks") not in sys.path:
    sys.path.insert(0, str(REPO / "benchmarks"))  # what `python benchmarks/<name>.py` does (benchlib's convention)

MODULE = "arith.mul_add"
SOURCE = "verl_group_ppo/arith/mul_add"


def bench():
    return importlib.import_module("bench_arith_critic")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from verl_group_ppo.tasks.maths import checkpoint

    directory = tmp_path_factory.mktemp("arith-critic")
    gguf = write_tiny_gguf(str(directory / "tiny.gguf"))
    return checkpoint.convert(str(directory / "model"), gguf_path=gguf, log=lambda m: None, expected=False)


def _layout(root: Path, roles=("actor", "critic"), files=("fsdp_config.json", "huggingface",
                                                         "model_world_size_1_rank_0.pt")) -> Path:
    """A checkpoint folder with empty stand-ins of verl's files."""
    for role in roles:
        (root / role).mkdir(parents=True)
        for name in files:
            (root / role / name).mkdir() if name == "huggingface" else (root / role / name).write_text("")
    return root


def _rows(n: int) -> list[dict]:
    return [{"data_source": SOURCE, "prompt": [{"role": "user", "content": f"What is {i} * 2 + 1?"}],
             "reward_model": {"style": "rule", "ground_truth": str(2 * i + 1)},
             "extra_info": {"module": MODULE, "index": i}} for i in range(n)]


def _length_parity(row: dict, reply: str) -> dict[str, float]:
    """A reward with variance for a tiny model that never answers: the reply's length in characters, odd or even."""
    return {"score": float(len(reply) % 2), "answered": 1.0}


# ---------------------------------------------------------------------------------------------- discovery, refusals


def test_the_default_checkpoint_is_the_largest_step_by_number(tmp_path):
    for name in ("global_step_2", "global_step_16", "global_step_9", "global_step_x", "step_40"):
        (tmp_path / name).mkdir()
    (tmp_path / "global_step_20").write_text("a file, not a checkpoint")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("16")
    assert bench().newest_checkpoint(str(tmp_path)) == str(tmp_path / "global_step_16")
    assert bench().checkpoint_step("a/b/global_step_16/") == 16 and bench().checkpoint_step("global_step_") is None


@pytest.mark.parametrize("make", [lambda p: None, lambda p: p.mkdir()], ids=["missing", "empty"])
def test_no_checkpoint_to_find_names_the_argument(tmp_path, make):
    root = tmp_path / "checkpoints" / "group_ppo"
    root.parent.mkdir()
    make(root)
    with pytest.raises(SystemExit, match=r"--checkpoint: no global_step_<N> folder under .*run_arith_group_ppo"):
        bench().newest_checkpoint(str(root))


def test_a_complete_checkpoint_gives_its_estimator_and_step(tmp_path):
    path = _layout(tmp_path / "checkpoints" / "gae" / "global_step_16")
    assert bench().check_checkpoint(str(path)) == ("gae", 16)


@pytest.mark.parametrize("roles, files, message", [
    (("actor",), ("fsdp_config.json", "huggingface", "model_world_size_1_rank_0.pt"), r"has no critic/ folder"),
    (("critic",), ("fsdp_config.json", "huggingface", "model_world_size_1_rank_0.pt"), r"has no actor/ folder"),
    (("actor", "critic"), ("huggingface", "model_world_size_1_rank_0.pt"), r"actor lacks fsdp_config.json"),
    (("actor", "critic"), ("fsdp_config.json", "huggingface"), r"lacks model_world_size_\*.pt \(an unfinished save"),
])
def test_an_incomplete_checkpoint_is_refused_naming_the_argument(tmp_path, roles, files, message):
    path = _layout(tmp_path / "global_step_3", roles, files)
    with pytest.raises(SystemExit, match=rf"--checkpoint: .*{message}"):
        bench().check_checkpoint(str(path))


def test_a_folder_that_is_no_global_step_is_refused(tmp_path):
    with pytest.raises(SystemExit, match=r"--checkpoint: .*not a global_step_<N> folder.*does not exist"):
        bench().check_checkpoint(str(tmp_path / "global_step_3"))
    with pytest.raises(SystemExit, match=r"--checkpoint: .*not a global_step_<N> folder of a verl run$"):
        bench().check_checkpoint(str(_layout(tmp_path / "actor_critic")))


def test_a_task_dir_without_model_or_test_split_is_refused_naming_the_argument(tmp_path):
    with pytest.raises(SystemExit, match=r"--work-dir: .*model holds no model"):
        bench().check_work_dir(str(tmp_path))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(SystemExit, match=r"--work-dir: .*test.parquet is missing"):
        bench().check_work_dir(str(tmp_path))
    with pytest.raises(SystemExit, match=r"--work-dir: "):  # main checks the task dir before any checkpoint
        bench().main(["--work-dir", str(tmp_path / "nowhere")])


@pytest.mark.parametrize("flag", ["--questions", "--samples", "--threads"])
def test_counts_below_one_are_refused_naming_the_argument(tmp_path, flag):
    with pytest.raises(SystemExit, match=rf"{flag}: must be >= 1, got 0"):
        bench().main(["--work-dir", str(tmp_path), flag, "0"])


def test_the_merger_command_is_verls_cli():
    assert bench().merger_command("ck/global_step_16/critic", "out", "py") == [
        "py", "-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir", "ck/global_step_16/critic",
        "--target_dir", "out"]


# ------------------------------------------------------------------------------------------------- the critic loader


def test_the_critic_loads_from_a_folder_laid_out_as_the_merger_writes_it(tiny_model, tmp_path):
    """The merger saves the critic's weights (value head included, in bfloat16) beside the config verl saved, whose
    architecture is still the causal LM's: the loader reads the value head; an actor's folder is refused."""
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(3)
    critic = AutoModelForTokenClassification.from_pretrained(tiny_model, num_labels=1, dtype=torch.bfloat16)
    critic.save_pretrained(tmp_path / "critic")
    config = json.loads((tmp_path / "critic" / "config.json").read_text())
    (tmp_path / "critic" / "config.json").write_text(json.dumps({**config, "architectures": ["LlamaForCausalLM"]}))
    loaded = bench().load_critic(str(tmp_path / "critic"))
    assert not loaded.training and next(loaded.parameters()).dtype == torch.float32
    assert loaded.state_dict().keys() == critic.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v.float()) for k, v in critic.state_dict().items())
    with pytest.raises(ValueError, match=r"not a critic .*score"):
        bench().load_critic(tiny_model)


def test_the_fresh_critic_is_seeded(tiny_model):
    a, b, c = (bench().fresh_critic(tiny_model, seed).score.weight for seed in (0, 0, 1))
    assert torch.equal(a, b) and not torch.equal(a, c)


# ------------------------------------------------------------------------------------------ replies, stats, table


def test_held_out_replies_are_sampled_scored_and_laid_out(tiny_model, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.setattr(bench(), "score", _length_parity)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    actor = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    lines = []
    held, info = bench().sample_held_out(actor, tokenizer, _rows(3), 2, 5, 0.7, torch.Generator().manual_seed(0),
                                         lines.append, batch_size=4)
    assert len(held) == len(info) == 6 and held.response_mask.shape[1] <= 5
    assert held.scores.tolist() == [i["score"] for i in info]
    assert held.response_mask.sum(dim=1).tolist() == [i["length"] for i in info]
    assert [line.split(" replies")[0] for line in lines] == ["[arith critic] sampled 4/6", "[arith critic] sampled 6/6"]
    again, _ = bench().sample_held_out(actor, tokenizer, _rows(3), 2, 5, 0.7, torch.Generator().manual_seed(0),
                                       lambda m: None, batch_size=4)
    assert torch.equal(again.input_ids, held.input_ids), "the seed (and the batch size) fix the replies"


def test_reply_stats_and_the_table():
    info = [{"module": "mul_add", "score": s, "answered": 1.0, "finished": f, "length": n}
            for s, f, n in ((1.0, True, 10), (0.0, False, 20), (1.0, True, 30), (1.0, True, 40))]
    stats = bench().reply_stats(info)
    assert stats["reward_mean"] == 0.75 and stats["reward_variance"] == pytest.approx(0.1875)
    assert stats["finished"] == 0.75 and stats["mean_length"] == 25 and stats["per_module"] == {
        "mul_add": {"replies": 4, "reward_mean": 0.75}}
    record = {"estimator": "group_ppo", "step": 16, "questions": 2, "samples": 2, "seed": 0, **stats,
              "seconds": {"total": 12.0}, "explained_variance": {"trained": {"all": 0.25, "first": 0.125},
                                                                "fresh": {"all": -1.0, "first": -0.5}}}
    text = bench().table(record)
    assert "group_ppo step 16: 4 held-out replies (2 test questions x 2), reward mean 0.750" in text
    assert "| trained (step 16) | +0.250 | +0.125 |" in text and "| fresh value head (seed 0) | -1.000 | -0.500 |" in text
    assert "mean nothing" in bench().table({**record, "reward_variance": 0.0})


# -------------------------------------------------------------------------- the whole script on verl-saved weights


def _save_like_verl(model, tokenizer, folder: Path, store: Path) -> dict[str, torch.Tensor]:
    """Save ``model`` as verl's FSDP checkpoint manager saves one role on one rank (FSDP2): ``torch.save`` of the
    sharded state dict (DTensors under the Hugging Face names) to ``model_world_size_1_rank_0.pt``, the config and
    tokenizer under ``huggingface/``, ``fsdp_config.json``. Returns the full float32 state dict."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        state = model.state_dict()
        assert all(isinstance(v, DTensor) for v in state.values())
        folder.mkdir(parents=True)
        torch.save(state, folder / "model_world_size_1_rank_0.pt")
    finally:
        torch.distributed.destroy_process_group()
    model.config.save_pretrained(folder / "huggingface")  # the config as the model holds it: verl's critic keeps
    tokenizer.save_pretrained(folder / "huggingface")     # the causal LM's architecture
    (folder / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}))
    return full


@pytest.mark.slow
def test_the_script_reads_a_checkpoint_saved_like_verls_through_the_merger(tiny_model, tmp_path, monkeypatch):
    import pandas as pd
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer

    work = tmp_path / "work"
    (work / "data").mkdir(parents=True)
    os.symlink(tiny_model, work / "model")
    pd.DataFrame(_rows(4)).to_parquet(work / "data" / "test.parquet")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    step = work / "checkpoints" / "group_ppo" / "global_step_5"
    torch.manual_seed(7)
    actor = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    for p in actor.parameters():
        p.data.add_(0.01 * torch.randn_like(p))  # a trained actor: not the starting model
    config = AutoConfig.from_pretrained(tiny_model)
    config.num_labels = 1  # as verl builds its critic
    critic = AutoModelForTokenClassification.from_pretrained(tiny_model, config=config, dtype=torch.float32)
    assert critic.config.architectures == ["LlamaForCausalLM"]
    _save_like_verl(actor, tokenizer, step / "actor", tmp_path / "store-actor")
    want = _save_like_verl(critic, tokenizer, step / "critic", tmp_path / "store-critic")

    merged = tmp_path / "merged"
    bench().merge_checkpoint(str(step / "critic"), str(merged), threads=1)
    got = bench().load_critic(str(merged)).state_dict()
    assert got.keys() == want.keys() and {"score.weight", "score.bias"} <= set(got)
    assert all(torch.equal(got[k], v.bfloat16().float()) for k, v in want.items()), "the merger rounds to bf16"

    monkeypatch.setattr(bench(), "score", _length_parity)
    results = tmp_path / "results"
    assert bench().main(["--work-dir", str(work), "--questions", "3", "--samples", "2", "--threads", "1",
                         "--results-dir", str(results)]) == 0
    record = json.loads((results / "group_ppo-step5.json").read_text())
    assert (record["estimator"], record["step"], record["replies"], record["questions"]) == ("group_ppo", 5, 6, 3)
    assert record["merge_command"].startswith("python -m verl.model_merger merge --backend fsdp --local_dir ")
    assert record["merge_command"].endswith("/checkpoints/group_ppo/global_step_5/ROLE --target_dir MERGED")
    fits = record["explained_variance"]
    assert set(fits) == {"trained", "fresh"} and all(-1 <= f[k] <= 1 for f in fits.values() for k in ("all", "first"))
    assert fits["trained"] != fits["fresh"]
    assert not any(str(v).startswith("/") for v in (record["checkpoint"], record["work_dir"]))
