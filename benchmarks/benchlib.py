"""The plumbing the benchmark scripts share: the repository root, JSON records, a CPU launcher run, paired
differences, timing and figures.

A benchmark is a script, run as ``python benchmarks/<name>.py`` from any folder: Python puts its folder first on
``sys.path``, so it imports this module by name and none loads another by path (tests put ``benchmarks/`` on
``sys.path`` the same way). The experiments (``experiments/``, run from the repository root as modules) import it as
``benchmarks.benchlib``. A record (one JSON file per finished run) holds no absolute path (:func:`write_json`).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, NamedTuple, Optional, Sequence, Union

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "examples" / "cpu" / "common.sh"
#: the paired metrics of a demo run's record (experiments/demo): final sampled accuracy and learning-curve area
DEMO_METRICS = {"final": "final_eval_accuracy", "area": "curve_area"}


def machine_paths(data: Any) -> list[str]:
    """The absolute paths in a JSON-like value: its strings' words (split at white space and ``= : , ;``) that
    start with ``/`` or ``~/``."""
    if isinstance(data, Mapping):
        return [p for k, v in data.items() for p in machine_paths(k) + machine_paths(v)]
    if isinstance(data, (list, tuple)):
        return [p for v in data for p in machine_paths(v)]
    return [w for w in re.split(r"[\s=:,;]+", data) if re.match(r"~?/[^/]", w)] if isinstance(data, str) else []


def portable(arg: str) -> str:
    """``arg`` (a path, or a ``key=path`` override) with an absolute path made relative to :data:`REPO`."""
    key, sep, value = arg.rpartition("=")
    return f"{key}{sep}{os.path.relpath(value, REPO)}" if os.path.isabs(value) else arg


def write_json(path: Union[str, Path], data: Any) -> None:
    """Write ``data`` atomically (an interrupted write leaves no half file); ValueError when it holds an
    absolute path (:func:`machine_paths`)."""
    if machine_paths(data):
        raise ValueError(f"data: a record holds no machine path, found {machine_paths(data)[:3]} (see portable)")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(f"{path}.tmp", "w") as f:
        json.dump(data, f, indent=1)
    os.replace(f"{path}.tmp", path)


def read_json(path: Union[str, Path]) -> Optional[Any]:
    """The JSON in ``path``, or None when it is missing or unreadable (e.g. half written)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def int_list(text: str, name: str) -> list[int]:
    """``"16,32"`` -> ``[16, 32]``; SystemExit naming the flag ``name`` on anything else or on no value."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{name}: expected a comma list of integers, got {text!r}") from None
    if not values:
        raise SystemExit(f"{name}: expected at least one value, got {text!r}")
    return values


def random_prompts(count: int, low: int, high: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of random token ids in ``[low, high)``, each of a random length in ``[min_len, max_len]``."""
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


class LauncherError(RuntimeError):
    """A launcher run that failed or logged other steps than asked for (the message ends with its output)."""


class LauncherRun(NamedTuple):
    """A finished launcher run: its command (paths relative to the repository), wall seconds, and verl's metrics
    per step, ``{step: {metric: value}}``."""

    command: str
    seconds: float
    steps: dict[int, dict[str, float]]


def run_launcher(estimator: str, steps: int, overrides: Sequence[str] = (), env: Optional[Mapping[str, str]] = None,
                 log_path: Optional[Union[str, Path]] = None, checkpoint_dir: Optional[str] = None) -> LauncherRun:
    """Run ``examples/cpu/common.sh ESTIMATOR trainer.total_training_steps=STEPS OVERRIDES...`` with ``env`` over
    this environment (``PYTHON``: this interpreter unless set), its output to ``log_path`` (else kept in memory)
    and its checkpoints to ``checkpoint_dir`` (else a temporary folder), removed after the run. Raises
    :class:`LauncherError` when the run fails or does not log exactly steps 1..``steps`` (and perhaps step 0, verl's
    validation before training). The run's ``command`` starts with ``env``'s settings, paths made relative."""
    from verl_group_ppo.logs import parse_step_metrics

    ckpt = checkpoint_dir or tempfile.mkdtemp(prefix="bench-checkpoints-")
    cmd = ["bash", str(LAUNCHER), estimator, f"trainer.total_training_steps={steps}", *overrides,
           f"trainer.default_local_dir={ckpt}"]
    if log_path:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log_path or os.devnull, "w") as log:
        proc = subprocess.run(cmd, env={"PYTHON": sys.executable, **os.environ, **(env or {})}, text=True,
                              stdout=log if log_path else subprocess.PIPE, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    shutil.rmtree(ckpt, ignore_errors=True)  # no benchmark compares checkpoints
    output = Path(log_path).read_text(errors="replace") if log_path else proc.stdout
    metrics = parse_step_metrics(output)
    if proc.returncode != 0 or sorted(set(metrics) - {0}) != list(range(1, steps + 1)):
        raise LauncherError(f"{estimator} {' '.join(overrides)}: exit code {proc.returncode}, {len(metrics)} of "
                            f"{steps} steps logged (log: {log_path or 'below'}); the output ends:\n{output[-3000:]}")
    settings = [f"{key}={portable(value)}" for key, value in (env or {}).items()]
    return LauncherRun(" ".join([*settings, *(portable(a) for a in cmd)]), seconds, metrics)


def differences(records: Iterable[dict], pairs: Iterable[tuple[str, str]], metrics: Mapping[str, str],
                arm_key: str = "estimator") -> dict[str, dict[str, dict]]:
    """``{"arm-baseline": {metric: difference}}`` per ``(arm, baseline)`` of ``pairs`` and per metric (its name ->
    a record's key): the paired difference over the seeds both have (:func:`stats.paired_difference`: seeds,
    mean, se, per_seed) with the comparison rule's ``"verdict"`` (:func:`stats.verdict`). A record's arm is
    ``record[arm_key]``."""
    if __package__:  # imported as benchmarks.benchlib (the experiments, run from the repository root)
        from .stats import paired_difference, verdict
    else:  # a benchmark script: its folder is first on sys.path
        from stats import paired_difference, verdict

    records = list(records)

    def difference(arm: str, base: str, key: str) -> dict:
        diff = paired_difference(*({int(r["seed"]): r[key] for r in records if r[arm_key] == x} for x in (arm, base)))
        return {**diff, "verdict": verdict(diff)}

    return {f"{arm}-{base}": {name: difference(arm, base, key) for name, key in metrics.items()} for arm, base in pairs}


def plus_minus(diff: dict) -> str:
    """``"+0.030 +- 0.012"``: a difference's mean and 2 standard errors (``n/a`` without one)."""
    return f"{diff['mean']:+.3f} +- {'n/a' if diff['se'] is None else format(2 * diff['se'], '.3f')}"


def cell(diff: dict) -> str:
    """A table cell: ``"+0.030 +- 0.012 (3 seeds, win)"``, or ``"n/a"`` without a common seed."""
    return "n/a" if diff["mean"] is None else f"{plus_minus(diff)} ({len(diff['seeds'])} seeds, {diff['verdict']})"


def timed(call: Callable[[], Any]) -> tuple[Any, float]:
    """``call()``'s result and the wall seconds it took."""
    start = time.perf_counter()
    result = call()
    return result, time.perf_counter() - start


def time_round_robin(calls: Mapping[str, Callable[[], Any]], repeats: int, sync: Callable[[], Any] = lambda: None,
                     on_repeat: Callable[[int], Any] = lambda r: None) -> tuple[dict, dict[str, tuple[float, float]]]:
    """Each call once untimed (warm-up), then ``repeats`` times round-robin so machine noise hits all alike, with
    ``sync()`` around each timed call (e.g. CUDA's) and ``on_repeat(r)`` after repeat r. Returns (each call's
    first result, ``{name: (median wall s, median process CPU s)}``, NaN with no repeat)."""
    results = {name: call() for name, call in calls.items()}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in calls}
    for r in range(repeats):
        for name, call in calls.items():
            sync()
            wall, cpu = time.perf_counter(), time.process_time()
            call()
            sync()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
        on_repeat(r)
    return results, {name: (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts)) if ts
                     else (math.nan, math.nan) for name, ts in times.items()}


@contextmanager
def figure(path: Union[str, Path], ncols: int = 1, figsize: tuple[float, float] = (10, 4), **kwargs) -> Iterator:
    """``with figure(path) as axes:`` ``ncols`` matplotlib panels side by side, drawn off-screen (Agg); at the
    block's end the figure is laid out, written to ``path`` (120 dpi) and closed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=figsize, **kwargs)
    yield axes
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
