"""What the benchmark scripts share: the repository root, records on disk, a CPU launcher run, resumable sweeps,
paired differences, timing and figures.

Convention: a benchmark is a script run as ``python benchmarks/<name>.py`` (from any folder). Python puts the
script's folder first on ``sys.path``, so every script imports this module by name (``from benchlib import
...``), and none loads another file by its path. Tests put ``benchmarks/`` on ``sys.path`` once
(tests/test_benchmarks.py) and import the scripts by name.

A record (one JSON file per finished run) holds no machine path: :func:`portable` makes a path relative to the
repository, and :func:`write_json` refuses data that holds an absolute path.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Optional, Sequence, Union

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / "examples" / "cpu" / "common.sh"

# ----------------------------------------------------------------------------------------------------- records

_WORD = re.compile(r"[^\s=:,;'\"()\[\]]+")


def machine_paths(data: Any) -> list[str]:
    """Every absolute path in a JSON-like value: a string that is one, or a word of a string (words split at
    white space and ``= : , ;`` quotes and brackets) that is one (``/...`` or ``~/...``)."""
    if isinstance(data, Mapping):
        return [p for k, v in data.items() for p in machine_paths(k) + machine_paths(v)]
    if isinstance(data, (list, tuple)):
        return [p for v in data for p in machine_paths(v)]
    if not isinstance(data, str):
        return []
    if os.path.isabs(data):
        return [data]
    return [w for w in _WORD.findall(data) if (w.startswith("/") and len(w) > 1) or w.startswith("~/")]


def portable(arg: str) -> str:
    """``arg`` (a path, or a ``key=path`` override) with its absolute path made relative to :data:`REPO`."""
    key, sep, value = arg.partition("=")
    if sep and os.path.isabs(value):
        return f"{key}={os.path.relpath(value, REPO)}"
    return os.path.relpath(arg, REPO) if os.path.isabs(arg) else arg


def write_json(path: Union[str, Path], data: Any) -> None:
    """Write ``data`` atomically (an interrupted write leaves no half file); ValueError naming them when ``data``
    holds absolute paths (:func:`machine_paths`)."""
    found = machine_paths(data)
    if found:
        raise ValueError(f"data: a record holds no machine path, found {found[:3]} (use benchlib.portable)")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


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


# ---------------------------------------------------------------------------------------------- the launcher


class LauncherError(RuntimeError):
    """A launcher run that failed or logged other steps than asked for; the message ends with its output's tail."""


@dataclass(frozen=True)
class LauncherRun:
    """One finished launcher run: its command (paths relative to the repository), wall seconds, and verl's
    metrics per step (``{step: {metric: value}}``, :func:`verl_group_ppo.logs.parse_step_metrics`)."""

    command: str
    seconds: float
    steps: dict[int, dict[str, float]]


def run_launcher(estimator: str, steps: int, overrides: Sequence[str] = (), env: Optional[Mapping[str, str]] = None,
                 log_path: Optional[Union[str, Path]] = None, checkpoint_dir: Optional[str] = None) -> LauncherRun:
    """``bash examples/cpu/common.sh ESTIMATOR trainer.total_training_steps=STEPS OVERRIDES...`` with ``env`` over
    this process's environment (``PYTHON`` defaults to this interpreter); its output goes to ``log_path`` (or is
    kept in memory), its checkpoints to ``checkpoint_dir`` (a temporary folder when None), removed after the run.
    Raises :class:`LauncherError` when the run fails or does not log exactly steps 1..``steps``."""
    from verl_group_ppo.logs import parse_step_metrics

    ckpt = checkpoint_dir or tempfile.mkdtemp(prefix="bench-ckpt-")
    cmd = ["bash", str(LAUNCHER), estimator, f"trainer.total_training_steps={steps}", *overrides,
           f"trainer.default_local_dir={ckpt}"]
    start = time.perf_counter()
    returncode, output = _run(cmd, {"PYTHON": sys.executable, **os.environ, **(env or {})}, log_path)
    seconds = time.perf_counter() - start
    shutil.rmtree(ckpt, ignore_errors=True)  # no benchmark compares checkpoints
    metrics = parse_step_metrics(output)
    if returncode != 0 or sorted(metrics) != list(range(1, steps + 1)):
        raise LauncherError(f"{estimator} {' '.join(overrides)}: exit code {returncode}, {len(metrics)} of {steps} "
                            f"steps logged{f'; see {log_path}' if log_path else ''}; the output ends:\n{output[-3000:]}")
    return LauncherRun(" ".join(portable(a) for a in cmd), seconds, metrics)


def _run(cmd: list[str], env: dict[str, str], log_path: Optional[Union[str, Path]]) -> tuple[int, str]:
    """(exit code, output) of ``cmd``, its stdout and stderr written to ``log_path`` when given."""
    if log_path is None:
        proc = subprocess.run(cmd, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        return proc.returncode, proc.stdout
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    return proc.returncode, Path(log_path).read_text(errors="replace")


# ---------------------------------------------------------------------------------------------------- sweeps


class Run(NamedTuple):
    """One run of a sweep: an arm, a seed, and what else the sweep varies (e.g. a critic regime; "" for nothing)."""

    arm: str
    seed: int
    condition: str = ""


def plan(runs: Iterable[Run], arm_order: Sequence[str], condition_order: Sequence[str] = ("",)) -> list[Run]:
    """``runs`` seed by seed, then by condition and arm: an interrupted sweep holds whole seeds of every arm."""
    return sorted(runs, key=lambda r: (r.seed, list(condition_order).index(r.condition), list(arm_order).index(r.arm)))


@dataclass(frozen=True)
class Sweep:
    """A resumable sweep: the planned ``runs``, each finished one kept as one JSON record,
    ``results_dir/[condition/]<arm>-seed<seed>.json``, written when the run ends (an interrupted run has none)."""

    results_dir: str
    runs: tuple[Run, ...]

    def path(self, run: Run) -> str:
        return os.path.join(self.results_dir, run.condition, f"{run.arm}-seed{run.seed}.json")

    def load(self, run: Run, accept: Optional[Callable[[dict], bool]] = None) -> Optional[dict]:
        """``run``'s record, or None when it is missing, unreadable or not ``accept(record)``."""
        record = read_json(self.path(run))
        return record if isinstance(record, dict) and (accept is None or accept(record)) else None

    def pending(self, accept: Optional[Callable[[dict], bool]] = None) -> list[Run]:
        """The planned runs without an (accepted) record: those to run, or the report's missing runs."""
        return [run for run in self.runs if self.load(run, accept) is None]

    def records(self, accept: Optional[Callable[[dict], bool]] = None) -> list[tuple[Run, dict]]:
        """Every finished run with its (accepted) record, in plan order."""
        return [(run, rec) for run in self.runs if (rec := self.load(run, accept)) is not None]

    def save(self, run: Run, record: dict) -> None:
        write_json(self.path(run), record)


# ----------------------------------------------------------------------------------------- paired differences


def mean_se(values: Sequence[float]) -> tuple[float, Optional[float]]:
    """Mean and standard error of the mean (None below 2 values)."""
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None)


Metric = Union[str, Callable[[dict], float]]


def differences(records: Iterable[dict], pairs: Iterable[tuple[str, str]], metrics: Mapping[str, Metric],
                arm_key: str = "estimator", rule: Optional[Callable[[dict], str]] = None) -> dict[str, dict[str, dict]]:
    """``{"arm-baseline": {metric: difference}}`` for each ``(arm, baseline)`` of ``pairs``: the per-seed paired
    difference over the seeds both have (:func:`verl_group_ppo.demo.report.paired_difference`: seeds, mean, se,
    per_seed) with ``"verdict": rule(difference)`` (default: the comparison rule, ``demo.report.verdict``).
    A metric is a record's key or a function of the record; a record's arm is ``record[arm_key]``."""
    from verl_group_ppo.demo.report import paired_difference, verdict

    records = list(records)
    value = {name: (m if callable(m) else (lambda r, key=m: r[key])) for name, m in metrics.items()}

    def per_seed(arm: str, name: str) -> dict[int, float]:
        return {int(r["seed"]): value[name](r) for r in records if r[arm_key] == arm}

    out: dict[str, dict[str, dict]] = {}
    for arm, base in pairs:
        out[f"{arm}-{base}"] = {}
        for name in metrics:
            diff = paired_difference(per_seed(arm, name), per_seed(base, name))
            out[f"{arm}-{base}"][name] = {**diff, "verdict": (rule or verdict)(diff)}
    return out


def plus_minus(diff: dict) -> str:
    """``"+0.030 +- 0.012"``: a difference's mean and 2 standard errors (``n/a`` without one)."""
    return f"{diff['mean']:+.3f} +- {'n/a' if diff['se'] is None else format(2 * diff['se'], '.3f')}"


def cell(diff: dict) -> str:
    """A table cell: ``"+0.030 +- 0.012 (3 seeds, win)"``, or ``"n/a"`` without a common seed."""
    return "n/a" if diff["mean"] is None else f"{plus_minus(diff)} ({len(diff['seeds'])} seeds, {diff['verdict']})"


# ------------------------------------------------------------------------------------------ timing, figures


def time_round_robin(calls: Mapping[str, Callable[[], Any]], repeats: int, sync: Callable[[], None] = lambda: None,
                     on_repeat: Callable[[int], None] = lambda r: None) -> tuple[dict, dict[str, tuple[float, float]]]:
    """Each call once untimed (warm-up), then ``repeats`` times round-robin, so machine noise hits all alike.
    Returns (each call's first result, ``{name: (median wall s, median process CPU s)}``; NaN with 0 repeats).
    ``sync`` runs around every timed call (e.g. ``torch.cuda.synchronize``), ``on_repeat(r)`` after repeat r."""
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


def figure(ncols: int = 1, figsize: tuple[float, float] = (10, 4), **kwargs):
    """A matplotlib figure and its axes (``ncols`` panels), drawn off-screen (Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=figsize, **kwargs)


def save_figure(fig, path: Union[str, Path]) -> None:
    """Lay out, write (120 dpi) and close a figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
