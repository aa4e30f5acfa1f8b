"""Which modules make a free-form numeric task for the maths task's model (SmolLM2-135M-Instruct) with room to reason.

    python benchmarks/bench_arith_task_choice.py [--work-dir runs/cpu-arith]   # measure what is missing, report
    python benchmarks/bench_arith_task_choice.py --report                      # the table from the kept records

For every candidate module (free-form numeric answers, :data:`MODULES`: DeepMind's ``mathematics_dataset`` modules at
``train-easy`` and the task's own two- and three-step generator, :mod:`verl_group_ppo.tasks.maths.arith`), prompt
(:data:`PROMPTS`, each inviting working and a final number; ``worked`` shows the module's worked example first) and
sampling temperature (:data:`TEMPERATURES`):

* the **guessing floor**: the best constant answer's share of 2000 generated questions
  (:func:`verl_group_ppo.tasks.maths.numeric.guessing_floor`);
* the model (the 4-bit GGUF converted once into WORK_DIR/model) sampled once per question, replies of at most 64
  tokens, on the first 64 of those questions, scored by the reply's final number
  (:func:`~verl_group_ppo.tasks.maths.numeric.score_final_number`): the answered rate (replies holding a number), the
  sampled accuracy, the accuracy among answered replies, the replies that end at EOS, the replies that write
  ``Answer:``, the mean reply length, and the greedy accuracy on the same questions (what verl's validation
  measures).

The rule (:data:`RULE`, :func:`keep`) keeps a module when its floor is at most 0.02, its answered rate at least 0.9
and its sampled accuracy in [0.05, 0.5]; :data:`CHOICE` (:func:`choose`) picks the task from the kept records. Each
(module, prompt, temperature) is one JSON record ``benchmarks/results/arith_task_choice/<prompt>-<module>.json``
(``-t<T>`` before ``.json`` at a temperature other than 1), so the script resumes where it stopped and ``--report``
prints the table without the model.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence

from benchlib import REPO, read_json, write_json

RESULTS = os.path.join("benchmarks", "results", "arith_task_choice")
#: candidate modules of DeepMind's ``mathematics_dataset``: each answers with one number the question does not offer
DATASET_MODULES: tuple[str, ...] = (
    "arithmetic.add_or_sub", "arithmetic.add_sub_multiple", "arithmetic.div", "arithmetic.mixed", "arithmetic.mul",
    "arithmetic.mul_div_multiple", "arithmetic.nearest_integer_root",
    "numbers.div_remainder", "numbers.gcd", "numbers.lcm", "numbers.place_value", "numbers.round_number",
)
#: candidate modules of the task's own generator (:mod:`verl_group_ppo.tasks.maths.arith`): small integers, 2-3 steps
ARITH_MODULES: tuple[str, ...] = ("arith.mul_add", "arith.mul_sub", "arith.mul_add_mul", "arith.add_sub")
MODULES: tuple[str, ...] = DATASET_MODULES + ARITH_MODULES
DIFFICULTY, FLOOR_QUESTIONS, QUESTIONS, MAX_TOKENS, SEED = "train-easy", 2000, 64, 64, 0
MAX_FLOOR, MIN_ANSWERED, ACCURACY_BAND = 0.02, 0.9, (0.05, 0.5)
#: sampling temperatures measured; 1.0 is verl's rollout default
TEMPERATURES: tuple[float, ...] = (1.0, 0.7)
RULE = (f"keep a module when floor <= {MAX_FLOOR}, answered rate >= {MIN_ANSWERED} and sampled accuracy in "
        f"[{ACCURACY_BAND[0]}, {ACCURACY_BAND[1]}]")
#: how the task is chosen from the kept records
CHOICE = ("the task takes the modules kept with the `worked` prompt at temperature 1.0 (verl's default), or at 0.7 "
          "when fewer than two are kept at 1.0, and its rollout samples at that temperature")
_ANSWER_TAG = "Solve step by step, briefly. End with 'Answer: <number>'."
_WORKING = "Work it out in a few short steps, then end with the final number."
_WORKED = "Solve the problem step by step. End with 'Answer: <number>'."


def _answer_tag(module: str, question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": _ANSWER_TAG}, {"role": "user", "content": question}]


def _working(module: str, question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{question} {_WORKING}"}]


def _worked(module: str, question: str) -> list[dict[str, str]]:
    from verl_group_ppo.tasks.maths.task import worked_messages

    return worked_messages(module, question)


#: prompt name -> the chat messages asking a question of a module (``working`` leaves the system message to the
#: chat template; ``worked`` shows the module's worked example first and is offered for :data:`ARITH_MODULES` only)
PROMPTS: dict[str, Callable[[str, str], list[dict[str, str]]]] = {
    "answer_tag": _answer_tag, "working": _working, "worked": _worked}


def offered(prompt: str, module: str) -> bool:
    """Whether ``prompt`` is measured on ``module`` (a worked example exists only for the task's own modules)."""
    return prompt != "worked" or module in ARITH_MODULES


def draw(module: str, count: int) -> list:
    """``count`` questions of ``module`` (:data:`DIFFICULTY` for the dataset's), seed :data:`SEED`."""
    from verl_group_ppo.tasks.maths import arith, questions

    if module in ARITH_MODULES:
        return arith.draw([module], count, SEED)
    return questions.draw([module], DIFFICULTY, count, SEED)


def record_name(prompt: str, module: str, temperature: float = 1.0) -> str:
    """The record's file name (no folder): ``<prompt>-<module>.json`` at temperature 1, else
    ``<prompt>-<module>-t<temperature>.json``."""
    return f"{prompt}-{module}.json" if temperature == 1.0 else f"{prompt}-{module}-t{temperature:g}.json"


def record_path(prompt: str, module: str, temperature: float = 1.0) -> str:
    return os.path.join(REPO, RESULTS, record_name(prompt, module, temperature))


def summarise(replies: Sequence[str], truths: Sequence[str], finished: Sequence[bool],
              lengths: Sequence[int]) -> dict[str, float]:
    """The sampled figures of one (module, prompt) from its replies (texts, ground truths, whether each ended at
    EOS, token counts; all of one length): answered, correct, correct_among_answered (0 when none answered),
    finished, tagged (holds ``Answer:``), mean_length and the reply count."""
    from verl_group_ppo.tasks.maths.numeric import score_final_number

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
                seconds: float, examples: Sequence[dict[str, str]] = (), temperature: float = 1.0,
                greedy: dict[str, float] | None = None) -> dict:
    """One (module, prompt, temperature) record: the settings, the floor (best constant answer and its share), the
    sampled figures (:func:`summarise`), the greedy ones on the same questions when measured, the rule's verdict
    and a few example replies. Holds no machine path."""
    record = {"module": module, "prompt": prompt, "difficulty": DIFFICULTY, "seed": SEED, "max_tokens": MAX_TOKENS,
              "temperature": temperature, "floor_questions": FLOOR_QUESTIONS,
              "floor": {"answer": floor[0], "share": round(floor[1], 4)},
              "prompt_tokens": prompt_tokens, "sampled": dict(sampled), "seconds": round(seconds, 1),
              "examples": [dict(e) for e in examples]}
    if greedy is not None:
        record["greedy"] = dict(greedy)
    record["kept"] = keep(record)
    return record


def keep(record: dict) -> bool:
    """The rule (:data:`RULE`) on one record."""
    s = record["sampled"]
    return (record["floor"]["share"] <= MAX_FLOOR and s["answered"] >= MIN_ANSWERED
            and ACCURACY_BAND[0] <= s["correct"] <= ACCURACY_BAND[1])


def _replies(model, tokenizer, messages, temperature: float, batch_size: int) -> list:
    """(prompt ids, completion, text) per chat: greedy at temperature 0, else sampled from a seeded generator."""
    import torch

    from verl_group_ppo.tasks.maths import evaluation

    generator = torch.Generator().manual_seed(SEED)
    greedy = temperature <= 0
    return evaluation.sample(model, tokenizer, messages, MAX_TOKENS, greedy=greedy, generator=generator,
                             batch_size=batch_size, temperature=1.0 if greedy else temperature)


def measure_all(args: argparse.Namespace) -> None:
    import torch

    from verl_group_ppo.tasks.maths import checkpoint, evaluation
    from verl_group_ppo.tasks.maths.numeric import guessing_floor

    torch.set_num_threads(args.threads)
    wanted = [(p, m, t) for p in args.prompts for m in args.modules for t in args.temperatures if offered(p, m)]
    todo = [(p, m, t) for p, m, t in wanted if read_json(record_path(p, m, t)) is None]
    print(f"[arith] {len(wanted) - len(todo)} records kept, {len(todo)} to measure", flush=True)
    if not todo:
        return
    model_dir = os.path.join(args.work_dir, "model")
    checkpoint.ensure_model(model_dir)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    drawn: dict[str, list] = {}
    for i, (prompt, module, temperature) in enumerate(todo, 1):
        t0 = time.time()
        if module not in drawn:
            drawn[module] = draw(module, FLOOR_QUESTIONS)
        qs = drawn[module][:QUESTIONS]
        floor = guessing_floor([q.answer for q in drawn[module]])
        messages = [PROMPTS[prompt](module, q.question) for q in qs]
        truths = [q.answer for q in qs]

        def figures(out):
            return summarise([text for _, _, text in out], truths, [c.stopped_at_eos for _, c, _ in out],
                             [len(c.token_ids) for _, c, _ in out])

        out = _replies(model, tokenizer, messages, temperature, args.batch_size)
        sampled = figures(out)
        greedy = figures(_replies(model, tokenizer, messages, 0.0, args.batch_size)) if args.greedy else None
        examples = [{"question": q.question, "answer": q.answer, "reply": t} for q, (_, _, t) in zip(qs[:4], out[:4])]
        record = make_record(module, prompt, floor, sampled, len(evaluation.prompt_ids(tokenizer, messages[0])),
                             time.time() - t0, examples, temperature, greedy)
        write_json(record_path(prompt, module, temperature), record)
        print(f"[arith] {i}/{len(todo)} {prompt} {module} T={temperature:g}: floor {floor[1]:.3f} ({floor[0]}), "
              f"answered {sampled['answered']:.2f}, sampled {sampled['correct']:.3f}, among answered "
              f"{sampled['correct_among_answered']:.3f}, finished {sampled['finished']:.2f}"
              + (f", greedy {greedy['correct']:.3f}" if greedy else "")
              + f"{', kept' if record['kept'] else ''} ({record['seconds']} s)", flush=True)


def collect() -> list[dict]:
    """The kept records, ordered by prompt, module and falling temperature."""
    directory = os.path.join(REPO, RESULTS)
    names = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
    records = [r for n in names if n.endswith(".json") and (r := read_json(os.path.join(directory, n)))]
    return sorted(records, key=lambda r: (r["prompt"], r["module"], -r.get("temperature", 1.0)))


def choose(records: Sequence[dict]) -> tuple[float, list[str]] | None:
    """The task :data:`CHOICE` picks from ``records``: (temperature, modules), or None when no temperature keeps two
    modules with the ``worked`` prompt."""
    for temperature in TEMPERATURES:
        kept = [r["module"] for r in records
                if r["prompt"] == "worked" and r.get("temperature", 1.0) == temperature and keep(r)]
        if len(kept) >= 2:
            return temperature, kept
    return None


def report(records: Sequence[dict]) -> str:
    """The table of ``records`` (module, prompt, temperature, floor, answered, sampled accuracy, accuracy among
    answered, greedy accuracy, finished, tagged, mean length, kept?), the rule and the choice."""
    if not records:
        raise SystemExit(f"no records under {RESULTS}: run the script without --report first")
    lines = [("| module | prompt | T | floor | answered | sampled accuracy | accuracy among answered | greedy | "
              "finished | Answer: | mean tokens | kept? |"), "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        s = r["sampled"]
        greedy = f"{r['greedy']['correct']:.3f}" if "greedy" in r else "-"
        lines.append(f"| {r['module']} | {r['prompt']} | {r.get('temperature', 1.0):g} | "
                     f"{r['floor']['share']:.3f} ({r['floor']['answer']}) | "
                     f"{s['answered']:.2f} | {s['correct']:.3f} | {s['correct_among_answered']:.3f} | {greedy} | "
                     f"{s['finished']:.2f} | {s['tagged']:.2f} | {s['mean_length']:.1f} | "
                     f"{'yes' if keep(r) else 'no'} |")
    first = records[0]
    kept = [f"{r['module']} ({r['prompt']}, T={r.get('temperature', 1.0):g})" for r in records if keep(r)]
    chosen = choose(records)
    lines += ["", (f"{first['difficulty']} questions of the dataset's modules; floor over {first['floor_questions']} "
              f"questions; {first['sampled']['replies']} replies of at most {first['max_tokens']} tokens a record"),
              f"rule: {RULE}", "kept: " + (", ".join(kept) if kept else "none"), f"choice: {CHOICE}",
              "chosen: " + (f"temperature {chosen[0]:g}, modules {', '.join(chosen[1])}" if chosen else "none")]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", default=os.path.join(REPO, "runs", "cpu-arith"),
                   help="where the converted model is kept (WORK_DIR/model)")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--batch-size", type=int, default=64, help="replies generated together")
    p.add_argument("--modules", default=",".join(MODULES), help="comma list, a subset of the candidates")
    p.add_argument("--prompts", default=",".join(PROMPTS), help="comma list of prompt names")
    p.add_argument("--temperatures", default=",".join(f"{t:g}" for t in TEMPERATURES),
                   help="comma list of sampling temperatures")
    p.add_argument("--no-greedy", dest="greedy", action="store_false",
                   help="skip the greedy replies on the same questions")
    p.add_argument("--report", action="store_true", help="only print the table from the kept records")
    args = p.parse_args(argv)
    args.modules = [m for m in args.modules.split(",") if m]
    args.prompts = [x for x in args.prompts.split(",") if x]
    try:
        args.temperatures = [float(t) for t in args.temperatures.split(",") if t]
    except ValueError:
        raise SystemExit(f"--temperatures: comma list of numbers, got {args.temperatures!r}") from None
    if not args.temperatures or any(t <= 0 for t in args.temperatures):
        raise SystemExit(f"--temperatures: need numbers > 0, got {args.temperatures}")
    if bad := [m for m in args.modules if m not in MODULES] + [x for x in args.prompts if x not in PROMPTS]:
        raise SystemExit(f"--modules/--prompts: unknown {bad}; modules {list(MODULES)}, prompts {list(PROMPTS)}")
    if not args.report:
        measure_all(args)
    print(report(collect()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
