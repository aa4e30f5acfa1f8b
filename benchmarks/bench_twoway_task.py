"""Choose the two-way maths task by the rule in docs/mathtask.md ("How the task was chosen"), from measurements.

    python benchmarks/bench_twoway_task.py [--work-dir runs/cpu-twoway]   # measure what is missing, then report
    python benchmarks/bench_twoway_task.py --report                        # the tables from the kept records

Measures SmolLM2-135M-Instruct (the 4-bit GGUF converted once into WORK_DIR/model) on 40 ``train-easy`` questions of
every candidate module with every candidate prompt: greedy, and 2 samples per question at temperature 1, at most 24
new tokens. Then, for the prompt and modules the rule picks, the mixture's sampled accuracy at 16, 24 and 32 tokens.
Each measurement is kept as one JSON record under benchmarks/results/twoway_task/, so the script resumes where it
stopped and ``--report`` reproduces the tables without the model.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from statistics import mean

from benchlib import REPO, read_json, write_json
from verl_group_ppo.tasks.maths.spec import TWOWAY

RESULTS = os.path.join("benchmarks", "results", "twoway_task")
QUESTIONS, SAMPLES, MAX_TOKENS, LENGTHS, SEED = 40, 2, 24, (16, 24, 32), 0
BAND, WIDE_BAND = TWOWAY.accuracy_band, (0.05, 0.70)  # the task's band (prepare refuses outside it); the fallback


def record_path(name: str) -> str:
    return os.path.join(REPO, RESULTS, name + ".json")


def load(name: str) -> dict | None:
    return read_json(record_path(name))


def save(name: str, record: dict) -> None:
    write_json(record_path(name), record)


def choose(records: dict[tuple[str, str], dict], prompt_lengths: dict[str, int]) -> tuple[str, list[str], tuple]:
    """The rule's steps 4 and 5: (prompt, modules, band) from the per-(prompt, module) records."""
    prompts = sorted({p for p, _ in records})
    sampled = {p: mean(r["sampled"]["correct"] for (q, _), r in records.items() if q == p) for p in prompts}
    best = max(sampled.values())
    prompt = min((p for p in prompts if sampled[p] >= best - 0.01), key=lambda p: prompt_lengths[p])
    for band in (BAND, WIDE_BAND):
        modules = sorted(m for (p, m), r in records.items()
                         if p == prompt and band[0] <= r["sampled"]["correct"] <= band[1])
        if len(modules) >= 2:
            return prompt, modules, band
    return prompt, modules, band


def shortest_length(by_length: dict[int, float]) -> int:
    """The rule's step 6: the shortest length whose sampled accuracy is within 0.02 of the longest's."""
    longest = by_length[max(by_length)]
    return min(length for length, acc in by_length.items() if acc >= longest - 0.02)


def measure_all(args) -> None:
    import torch

    from verl_group_ppo.tasks.maths import checkpoint, evaluation, questions
    from verl_group_ppo.tasks.maths.task import PROMPTS, MathTask

    torch.set_num_threads(args.threads)
    model_dir = os.path.join(args.work_dir, "model")
    checkpoint.ensure_model(model_dir)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def run(name: str, task: MathTask, qs, max_tokens: int, greedy_too: bool) -> dict:
        record = load(name)
        if record is not None:
            return record
        t0 = time.time()
        record = {"prompt": task.prompt, "modules": list(task.modules), "questions": len(qs), "max_tokens": max_tokens,
                  "prompt_tokens": len(evaluation.prompt_ids(tokenizer, task.messages(qs[0]))),
                  "sampled": evaluation.measure(model, tokenizer, qs, task.messages, max_tokens, greedy=False,
                                                score=task.score, samples=SAMPLES, seed=SEED).as_dict()}
        if greedy_too:
            greedy = evaluation.measure(model, tokenizer, qs, task.messages, max_tokens, greedy=True,
                                        score=task.score)
            record["greedy"] = greedy.as_dict()
        record["seconds"] = round(time.time() - t0, 1)
        save(name, record)
        print(f"[task] {name}: sampled {record['sampled']['correct']:.3f}"
              + (f", greedy {record['greedy']['correct']:.3f}" if greedy_too else "") + f" ({record['seconds']} s)",
              flush=True)
        return record

    for prompt in PROMPTS:
        for module in questions.MODULES:
            qs = questions.draw([module], "train-easy", QUESTIONS, SEED)
            run(f"{prompt}-{module}", MathTask((module,), prompt=prompt), qs, MAX_TOKENS, greedy_too=True)
    prompt, modules, _ = choose(*collect())
    task = MathTask(tuple(modules), prompt=prompt)
    qs = [q for m in modules for q in questions.draw([m], "train-easy", QUESTIONS, SEED)]
    for length in LENGTHS:
        run(f"mixture-{length}", task, qs, length, greedy_too=False)


def collect() -> tuple[dict, dict]:
    """The per-(prompt, module) records and each prompt's token count."""
    records, lengths = {}, {}
    directory = os.path.join(REPO, RESULTS)
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        if name.endswith(".json") and not name.startswith("mixture-"):
            record = load(name[:-5])
            records[(record["prompt"], record["modules"][0])] = record
            lengths[record["prompt"]] = record["prompt_tokens"]
    return records, lengths


def report() -> str:
    records, lengths = collect()
    if not records:
        raise SystemExit(f"no records under {RESULTS}: run the script without --report first")
    prompts = sorted(lengths)
    modules = sorted({m for _, m in records})
    lines = ["| module | " + " | ".join(f"{p} greedy | {p} sampled" for p in prompts) + " |",
             "|---|" + "---|" * (2 * len(prompts))]
    for m in modules:
        cells = [f"{records[(p, m)]['greedy']['correct']:.2f} | {records[(p, m)]['sampled']['correct']:.2f}"
                 if (p, m) in records else "- | -" for p in prompts]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    prompt, chosen, band = choose(records, lengths)
    means = {p: mean(r["sampled"]["correct"] for (q, _), r in records.items() if q == p) for p in prompts}
    lines += ["", "prompt tokens: " + ", ".join(f"{p} {lengths[p]}" for p in prompts),
              "mean sampled accuracy over the modules: " + ", ".join(f"{p} {means[p]:.3f}" for p in prompts),
              f"chosen prompt: {prompt}; modules with sampled accuracy in {list(band)}: {', '.join(chosen)}"]
    by_length = {}
    for length in LENGTHS:
        record = load(f"mixture-{length}")
        if record is not None:
            by_length[length] = record["sampled"]["correct"]
            s = record["sampled"]
            lines.append(f"mixture at {length} tokens: sampled {s['correct']:.3f} (answered {s['answered']:.2f}, bare "
                         f"{s['bare']:.2f}, finished {s['finished']:.2f}, mean length {s['mean_length']:.1f})")
    if len(by_length) == len(LENGTHS):
        lines.append(f"chosen response length: {shortest_length(by_length)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work-dir", default=os.path.join(REPO, "runs", "cpu-twoway"),
                   help="where the converted model is kept (WORK_DIR/model)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    p.add_argument("--report", action="store_true", help="only print the tables from the kept records")
    args = p.parse_args(argv)
    if not args.report:
        measure_all(args)
    print(report())
    return 0


if __name__ == "__main__":
    sys.exit(main())
