"""Offline tasks with exact verifiers (the demo's and the CPU ``main_ppo`` runs' tiny task).

Every task yields problems as ``Problem(prompt, answer, solution, entry)``:

* ``prompt``   - the text the policy is conditioned on, e.g. ``"46+27-13="``;
* ``solution`` - a worked response used only by the supervised warm start, e.g. ``"73 60 #60"``:
  the running totals written out one by one (the reasoning tokens), then ``#`` and the final answer;
* ``answer``   - the ground-truth final answer (a string);
* ``entry``    - the task's own record (the reasoning-gym entry for ``chain_sum``), handed to its scorer.

The verifier is exact: a response earns reward 1 when it has the form ``... #<answer>`` and the text after
``#`` is judged equal to the ground truth by the task's scorer with full credit, else 0. With ``check_work``
(the default) the written steps before ``#`` must be exactly the correct running results as well: a tiny
model can otherwise reach a right answer through wrong steps, and rewarding that teaches it to write
wrong steps. Either way the reward is one bit at the last token, and a single wrong step anywhere makes
it 0: finding the token that went wrong is the credit-assignment problem the estimators have to solve.

Tasks
-----
``chain_sum`` (default)
    reasoning-gym's procedural ``chain_sum`` generator (``a + b - c ...`` with 1-2 digit terms), scored by
    reasoning-gym's own ``score_answer``. Its GSM-Symbolic templates are not used.
``mod_chain``
    a generator of ours: single-digit chains ``3+5*2-7`` evaluated left to right modulo 10; the running
    result after each operation is written out. Shorter responses, easier; useful for very fast checks.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

ANSWER_MARK = "#"


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    solution: str
    entry: Any = field(default=None, compare=False, repr=False)


def extract_answer(response: str) -> str | None:
    """The text after the last ``#``, stripped; None when the response has no ``#``."""
    if ANSWER_MARK not in response:
        return None
    return response.rsplit(ANSWER_MARK, 1)[1].strip()


class Task:
    """Base class: a deterministic problem generator plus an exact verifier."""

    name = "task"
    #: characters that may appear in prompts and responses (the tokenizer's alphabet)
    alphabet = "0123456789+-*= #"

    def problems(self, n: int, seed: int) -> list[Problem]:
        raise NotImplementedError

    def _score(self, answer: str, problem: Problem) -> float:
        return 1.0 if answer == problem.answer else 0.0

    #: also require every written intermediate step to be right (the worked solution is graded, not only
    #: the final answer); set False to grade the final answer alone.
    check_work: bool = True

    def verify(self, response: str, problem: Problem) -> float:
        """1.0 if ``response`` is ``<steps> #<answer>`` with the correct answer (and, with ``check_work``,
        exactly the correct intermediate steps), else 0.0."""
        answer = extract_answer(response)
        if not answer:
            return 0.0
        if self.check_work and response.rsplit(ANSWER_MARK, 1)[0].split() != problem.solution.rsplit(ANSWER_MARK, 1)[0].split():
            return 0.0
        return 1.0 if self._score(answer, problem) >= 1.0 else 0.0

    def noisy_solution(self, problem: Problem, rng: random.Random, slip_prob: float) -> str:
        """A worked solution in which each intermediate step slips with probability ``slip_prob``.

        Used only by the warm start (see :mod:`verl_group_ppo.tasks.tiny.warmstart`). Default: no slips.
        """
        return problem.solution

    def max_solution_len(self) -> int:
        """Characters in the longest worked solution the task can produce (EOS not counted)."""
        return max(len(p.solution) for p in self.problems(2000, 0))

    def spec(self) -> dict[str, Any]:
        """The task's name and settings (its public attributes): what the warm-start cache is keyed on."""
        return {"name": self.name, **{k: v for k, v in sorted(vars(self).items()) if not k.startswith("_")}}

    def corpus(self, n: int = 2000, seed: int = 0) -> list[str]:
        """Text the tokenizer is trained on."""
        return [p.prompt + p.solution for p in self.problems(n, seed)]


class ChainSumTask(Task):
    """reasoning-gym ``chain_sum``: ``46 + 27 - 13 =`` -> ``73 60 #60``."""

    name = "chain_sum"

    def __init__(self, min_terms: int = 4, max_terms: int = 5, min_digits: int = 1, max_digits: int = 1):
        self.min_terms, self.max_terms = min_terms, max_terms
        self.min_digits, self.max_digits = min_digits, max_digits

    def max_solution_len(self) -> int:
        """``max_terms - 1`` running totals and the answer, each at most ``max_terms * (10**max_digits - 1)``
        in absolute value with a sign, plus the separators and ``#``: ``max_terms * (width + 1)``."""
        width = len(str(self.max_terms * (10 ** self.max_digits - 1))) + 1
        return self.max_terms * (width + 1)

    def _dataset(self, n: int, seed: int):
        import reasoning_gym

        return reasoning_gym.create_dataset(
            "chain_sum",
            size=n,
            seed=seed,
            min_terms=self.min_terms,
            max_terms=self.max_terms,
            min_digits=self.min_digits,
            max_digits=self.max_digits,
        )

    def problems(self, n: int, seed: int) -> list[Problem]:
        ds = self._dataset(n, seed)
        self._ds = ds
        out = []
        for entry in ds:
            tokens = entry["metadata"]["expression"].split()
            total = int(tokens[0])
            totals = []
            for op, num in zip(tokens[1::2], tokens[2::2]):
                total = total + int(num) if op == "+" else total - int(num)
                totals.append(str(total))
            assert str(total) == entry["answer"], (entry, total)
            prompt = "".join(tokens) + "="
            solution = " ".join(totals) + " " + ANSWER_MARK + entry["answer"]
            out.append(Problem(prompt, entry["answer"], solution, entry))
        return out

    def noisy_solution(self, problem: Problem, rng: random.Random, slip_prob: float) -> str:
        """Running totals where each step slips with probability ``slip_prob`` to a near miss (off by 1-3);
        later steps continue correctly from the slipped total, so the final answer is wrong."""
        if slip_prob <= 0:
            return problem.solution
        tokens = problem.entry["metadata"]["expression"].split()
        total = int(tokens[0])
        totals = []
        for op, num in zip(tokens[1::2], tokens[2::2]):
            total = total + int(num) if op == "+" else total - int(num)
            if rng.random() < slip_prob:
                total += rng.choice((-3, -2, -1, 1, 2, 3))
            totals.append(str(total))
        return " ".join(totals) + " " + ANSWER_MARK + str(total)

    def _score(self, answer: str, problem: Problem) -> float:
        from reasoning_gym.utils import compute_decimal_reward

        # reasoning-gym's chain_sum scorer (ChainSumDataset.score_answer) is compute_decimal_reward;
        # only full credit counts as correct. Our answers are plain integers, so reject anything else
        # (the decimal scorer would also accept "+060" or "60.0").
        if not _is_int(answer):
            return 0.0
        return compute_decimal_reward(answer, oracle_answer=problem.entry["answer"], strip_commas=False)


def _is_int(s: str) -> bool:
    body = s[1:] if s.startswith("-") else s
    return body.isdigit() and (body == "0" or not body.startswith("0"))


class ModChainTask(Task):
    """Ours: ``3+5*2-7=`` evaluated left to right mod 10 -> ``8 6 9 #9``."""

    name = "mod_chain"

    def __init__(self, min_terms: int = 4, max_terms: int = 6):
        self.min_terms, self.max_terms = min_terms, max_terms

    def max_solution_len(self) -> int:
        """``max_terms - 1`` one-digit results and the answer with separators and ``#``."""
        return 2 * self.max_terms

    def problems(self, n: int, seed: int) -> list[Problem]:
        rng = random.Random(seed)
        ops: dict[str, Callable[[int, int], int]] = {
            "+": lambda a, b: a + b,
            "-": lambda a, b: a - b,
            "*": lambda a, b: a * b,
        }
        out = []
        for _ in range(n):
            k = rng.randint(self.min_terms, self.max_terms)
            nums = [rng.randint(0, 9) for _ in range(k)]
            sym = [rng.choice("+-*") for _ in range(k - 1)]
            total, totals, prompt = nums[0], [], str(nums[0])
            for o, x in zip(sym, nums[1:]):
                total = ops[o](total, x) % 10
                totals.append(str(total))
                prompt += o + str(x)
            out.append(Problem(prompt + "=", str(total), " ".join(totals) + " " + ANSWER_MARK + str(total),
                               {"nums": nums, "ops": sym}))
        return out

    def noisy_solution(self, problem: Problem, rng: random.Random, slip_prob: float) -> str:
        if slip_prob <= 0:
            return problem.solution
        nums, ops = problem.entry["nums"], problem.entry["ops"]
        fns = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
        total, totals = nums[0], []
        for o, x in zip(ops, nums[1:]):
            total = fns[o](total, x) % 10
            if rng.random() < slip_prob:
                total = (total + rng.randint(1, 9)) % 10
            totals.append(str(total))
        return " ".join(totals) + " " + ANSWER_MARK + str(total)


#: the problem generators by name (the prepare setting ``task``; a row's data source names one)
PROBLEM_SETS: dict[str, Callable[[], Task]] = {"chain_sum": ChainSumTask, "mod_chain": ModChainTask}


def make_task(name: str, terms: tuple[int, int] | None = None) -> Task:
    """Task ``name`` with its default term counts, or ``terms = (min_terms, max_terms)`` terms per chain."""
    if name not in PROBLEM_SETS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(PROBLEM_SETS)}")
    if terms is None:
        return PROBLEM_SETS[name]()
    lo, hi = terms
    if not 2 <= lo <= hi:
        raise ValueError(f"terms must be MIN-MAX with 2 <= MIN <= MAX, got {lo}-{hi}")
    return PROBLEM_SETS[name](min_terms=lo, max_terms=hi)


def parse_terms(text: str) -> tuple[int, int]:
    """``"4-5"`` -> (4, 5); ``"6"`` -> (6, 6). ValueError naming ``--terms`` otherwise."""
    try:
        parts = [int(x) for x in text.split("-")]
    except ValueError:
        parts = []
    if len(parts) not in (1, 2) or not 2 <= parts[0] <= parts[-1]:
        raise ValueError(f"--terms expects MIN-MAX with 2 <= MIN <= MAX (e.g. 4-5), got {text!r}")
    return parts[0], parts[-1]


def split_problems(task: Task, n_train: int, n_eval: int, seed: int = 1234) -> tuple[list[Problem], list[Problem]]:
    """A training pool and a held-out evaluation set with no prompt in common."""
    train = task.problems(n_train, seed)
    seen = {p.prompt for p in train}
    evals: list[Problem] = []
    offset = 1
    while len(evals) < n_eval:
        for p in task.problems(4 * n_eval, seed + 7919 * offset):
            if p.prompt not in seen:
                seen.add(p.prompt)
                evals.append(p)
                if len(evals) == n_eval:
                    break
        offset += 1
    return train, evals


def answer_is_right(response: str, problem: Problem, task: Task) -> float:
    """1.0 when the text after ``response``'s last ``#`` is right by ``task``'s scorer, steps not graded (the tool
    task's rule: its running totals are partly the tool's), else 0.0."""
    answer = extract_answer(response)
    return 1.0 if answer and task._score(answer, problem) >= 1.0 else 0.0


def guessing_floor(task: Task, problems: Sequence[Problem], answer_only: bool = False) -> tuple[str, float]:
    """The best constant response to ``problems`` and the share of them it solves: what a policy scores without
    reading the prompt.

    Graded by ``task.verify`` with ``check_work``, a response solves exactly the problems whose running totals and
    answer it writes, so the best one is the most frequent worked solution; graded on the final answer alone
    (``answer_only``, :func:`answer_is_right`, or a task without ``check_work``) it is ``#`` and the most frequent
    answer. The share is measured by that grader over ``problems`` (the first solution seen wins a tie).
    ValueError when ``problems`` is empty."""
    if not problems:
        raise ValueError("problems: give at least one problem")
    by_answer = answer_only or not task.check_work
    key = (lambda p: p.answer) if by_answer else (lambda p: p.solution)
    best = Counter(key(p) for p in problems).most_common(1)[0][0]
    response = f"{ANSWER_MARK}{best}" if by_answer else best
    grade = (lambda p: answer_is_right(response, p, task)) if answer_only else (lambda p: task.verify(response, p))
    return response, sum(grade(p) for p in problems) / len(problems)
