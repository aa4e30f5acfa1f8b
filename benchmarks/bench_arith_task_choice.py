"""Which ``mathematics_dataset`` modules make a numeric task for SmolLM2-135M-Instruct with short working.

    python benchmarks/bench_arith_task_choice.py [--work-dir runs/cpu-smollm2]   # measure what is missing, report
    python benchmarks/bench_arith_task_choice.py --report                        # the table from the kept records

For every candidate module (free-form numeric answers, :data:`MODULES`) and prompt (:data:`PROMPTS`, both inviting
brief working and a final number):

* the **guessing floor**: the best constant answer's share of 2000 generated ``train-easy`` questions
  (:func:`verl_group_ppo.mathtask.numeric.guessing_floor`);
* SmolLM2-135M-Instruct (the 4-bit GGUF converted once into WORK_DIR/model) sampled once per question at
  temperature 1, replies of at most 64 tokens, on the first 64 of those questions, scored by the reply's final
  number (:func:`~verl_group_ppo.mathtask.numeric.score_final_number`): the answered rate (replies holding a
  number), the sampled accuracy, the accuracy among answered replies, the replies that end at EOS, the replies that
  write ``Answer:``, and the mean reply length.

The rule (:data:`RULE`, :func:`keep`) keeps a module when its floor is at most 0.02, its answered rate at least 0.9
and its sampled accuracy in [0.05, 0.5]. Each (module, prompt) is one JSON record
``benchmarks/results/arith_task_choice/<prompt>-<module>.json``, so the script resumes where it stopped and
``--report`` prints the table without the model.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence

from benchlib import REPO, read_json, write_json

RESULTS = os.path.join("benchmarks", "results", "arith_task_choice")
#: candidate modules: each answers with one number the question does not offer as an option
MODULES: tuple[str, ...] = (
    "arithmetic.add_or_sub", "arithmetic.add_sub_multiple", "arithmetic.div", "arithmetic.mixed", "arithmetic.mul",
    "arithmetic.mul_div_multiple", "arithmetic.nearest_integer_root",
    "numbers.div_remainder", "numbers.gcd", "numbers.lcm", "numbers.place_value", "numbers.round_number",
)
DIFFICULTY, FLOOR_QUESTIONS, QUESTIONS, MAX_TOKENS, SEED = "train-easy", 2000, 64, 64, 0
MAX_FLOOR, MIN_ANSWERED, ACCURACY_BAND = 0.02, 0.9, (0.05, 0.5)
RULE = (f"keep a module when floor <= {MAX_FLOOR}, answered rate >= {MIN_ANSWERED} and sampled accuracy in "
        f"[{ACCURACY_BAND[0]}, {ACCURACY_BAND[1]}]")
_ANSWER_TAG = "Solve step by step, briefly. End with 'Answer: <number>'."
_WORKING = "Work it out in a few short steps, then end with the final number."


def _answer_tag(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": _ANSWER_TAG}, {"role": "user", "content": question}]


def _working(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{question} {_WORKING}"}]


#: prompt name -> the chat messages asking a question (``working`` leaves the system message to the chat template)
PROMPTS: dict[str, Callable[[str], list[dict[str, str]]]] = {"answer_tag": _answer_tag, "working": _working}


def record_name(prompt: str, module: str) -> str:
    """The record's file name (no folder): ``<prompt>-<module>.json``."""
    return f"{prompt}-{module}.json"


def record_path(prompt: str, module: str) -> str:
    return os.path.join(REPO, RESULTS, record_name(prompt, module))


def summarise(replies: Sequence[str], truths: Sequence[str], finished: Sequence[bool],
              lengths: Sequence[int]) -> dict[str, float]:
    """The sampled figures of one (module, prompt) from its replies (texts, ground truths, whether each ended at
    EOS, token counts; all of one length): answered, correct, correct_among_answered (0 when none answered),
    finished, tagged (holds ``Answer:``), mean_length and the reply count."""
    from verl_group_ppo.mathtask.numeric import score_final_number

    n = len(replies)
    if n == 0 or not len(truths) == len(finished) == len(lengths) == n:
        raise ValueError(f"replies, truths, finished, lengths: need equal non-zero lengths, got "
                         f"{n}, {len(truths)}, {len(finished)}, {len(lengths)}")
    scored = [score_final_number(r, t) for r, t in zip(replies, truths)]
    answered = sum(s["answered"] for s in scored)
    correct = sum(s["score"] for s in scored)
    return {"answered": round(answered / n, 4), "correct": round(correct / n, 4),
            "correct_among_answered": round(correct / answered, 4) if answered else 0.0,
            "finished": round(sum(map(bool, finished)) / n, 4),
            "tagged": round(sum("answer:" in r.lower() for r in replies) / n, 4),
            "mean_length": round(sum(lengths) / n, 2), "replies": n}


def make_record(module: str, prompt: str, floor: tuple[str, float], sampled: dict[str, float], prompt_tokens: int,
                seconds: float, examples: Sequence[dict[str, str]] = ()) -> dict:
    """One (module, prompt) record: the settings, the floor (best constant answer and its share), the sampled
    figures (:func:`summarise`), the rule's verdict and a few example replies. Holds no machine path."""
    record = {"module": module, "prompt": prompt, "difficulty": DIFFICULTY, "seed": SEED, "max_tokens": MAX_TOKENS,
              "floor_questions": FLOOR_QUESTIONS, "floor": {"answer": floor[0], "share": round(floor[1], 4)},
              "prompt_tokens": prompt_tokens, "sampled": dict(sampled), "seconds": round(seconds, 1),
              "examples": [dict(e) for e in examples]}
    record["kept"] = keep(record)
    return record


def keep(record: dict) -> bool:
    """The rule (:data:`RULE`) on one record."""
    s = record["sampled"]
    return (record["floor"]["share"] <= MAX_FLOOR and s["answered"] >= MIN_ANSWERED
            and ACCURACY_BAND[0] <= s["correct"] <= ACCURACY_BAND[1])


def measure_all(args: argparse.Namespace) -> None:
    import torch

    from verl_group_ppo.mathtask import checkpoint, evaluation, questions
    from verl_group_ppo.mathtask.numeric import guessing_floor

    torch.set_num_threads(args.threads)
    todo = [(p, m) for p in args.prompts for m in args.modules if read_json(record_path(p, m)) is None]
    print(f"[arith] {len(args.prompts) * len(args.modules) - len(todo)} records kept, {len(todo)} to measure",
          flush=True)
    if not todo:
        return
    model_dir = os.path.join(args.work_dir, "model")
    checkpoint.ensure_model(model_dir)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    drawn: dict[str, list] = {}
    for i, (prompt, module) in enumerate(todo, 1):
        t0 = time.time()
        if module not in drawn:
            drawn[module] = questions.draw([module], DIFFICULTY, FLOOR_QUESTIONS, SEED)
        qs = drawn[module][:QUESTIONS]
        floor = guessing_floor([q.answer for q in drawn[module]])
        messages = [PROMPTS[prompt](q.question) for q in qs]
        generator = torch.Generator().manual_seed(SEED)
        out = evaluation.sample(model, tokenizer, messages, MAX_TOKENS, greedy=False, generator=generator,
                                batch_size=args.batch_size)
        texts = [text for _, _, text in out]
        sampled = summarise(texts, [q.answer for q in qs], [c.stopped_at_eos for _, c, _ in out],
                            [len(c.token_ids) for _, c, _ in out])
        examples = [{"question": q.question, "answer": q.answer, "reply": t} for q, t in zip(qs[:4], texts[:4])]
        record = make_record(module, prompt, floor, sampled, len(evaluation.prompt_ids(tokenizer, messages[0])),
                             time.time() - t0, examples)
        write_json(record_path(prompt, module), record)
        print(f"[arith] {i}/{len(todo)} {prompt} {module}: floor {floor[1]:.3f} ({floor[0]}), answered "
              f"{sampled['answered']:.2f}, sampled {sampled['correct']:.3f}, among answered "
              f"{sampled['correct_among_answered']:.3f}, finished {sampled['finished']:.2f}"
              f"{', kept' if record['kept'] else ''} ({record['seconds']} s)", flush=True)


def collect() -> list[dict]:
    """The kept records, ordered by prompt then module."""
    directory = os.path.join(REPO, RESULTS)
    names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    records = [r for n in names if n.endswith(".json") and (r := read_json(os.path.join(directory, n)))]
    return sorted(records, key=lambda r: (r["prompt"], r["module"]))


def report(records: Sequence[dict]) -> str:
    """The table of ``records`` (module, prompt, floor, answered, sampled accuracy, accuracy among answered,
    finished, tagged, mean length, kept?) and the rule."""
    if not records:
        raise SystemExit(f"no records under {RESULTS}: run the script without --report first")
    lines = [("| module | prompt | floor | answered | sampled accuracy | accuracy among answered | finished | "
             "Answer: | mean tokens | kept? |"), "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        s = r["sampled"]
        lines.append(f"| {r['module']} | {r['prompt']} | {r['floor']['share']:.3f} ({r['floor']['answer']}) | "
                     f"{s['answered']:.2f} | {s['correct']:.3f} | {s['correct_among_answered']:.3f} | "
                     f"{s['finished']:.2f} | {s['tagged']:.2f} | {s['mean_length']:.1f} | "
                     f"{'yes' if keep(r) else 'no'} |")
    first = records[0]
    kept = [f"{r['module']} ({r['prompt']})" for r in records if keep(r)]
    lines += ["", (f"{first['difficulty']} questions; floor over {first['floor_questions']} questions; "
              f"{first['sampled']['replies']} replies of at most {first['max_tokens']} tokens at temperature 1"),
              f"rule: {RULE}", "kept: " + (", ".join(kept) if kept else "none")]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", default=os.path.join(REPO, "runs", "cpu-smollm2"),
                   help="where the converted model is kept (WORK_DIR/model)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--batch-size", type=int, default=64, help="replies generated together")
    p.add_argument("--modules", default=",".join(MODULES), help="comma list, a subset of the candidates")
    p.add_argument("--prompts", default=",".join(PROMPTS), help="comma list of prompt names")
    p.add_argument("--report", action="store_true", help="only print the table from the kept records")
    args = p.parse_args(argv)
    args.modules = [m for m in args.modules.split(",") if m]
    args.prompts = [x for x in args.prompts.split(",") if x]
    if bad := [m for m in args.modules if m not in MODULES] + [x for x in args.prompts if x not in PROMPTS]:
        raise SystemExit(f"--modules/--prompts: unknown {bad}; modules {list(MODULES)}, prompts {list(PROMPTS)}")
    if not args.report:
        measure_all(args)
    print(report(collect()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
