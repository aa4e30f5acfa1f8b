"""The comparison engine: run any comparison spec through verl's ``main_ppo`` launchers, resumably, and report it.

    python benchmarks/compare.py --list                       # the specs in benchmarks/specs/
    python benchmarks/compare.py --run tiny_value_sources     # run the missing runs (resumable)
    python benchmarks/compare.py --run tiny_value_sources --worker 2/2   # a second worker takes the other half
    python benchmarks/compare.py --report tiny_value_sources  # each pair's verdict per metric

A comparison is data: one JSON file ``benchmarks/specs/NAME.json`` (:func:`load_spec`, docs/benchmarks.md "The
comparison engine") names its arms (a launcher command and the arm's own Hydra overrides and environment), seeds,
steps, the metrics read from verl's per-step log lines, and the registered pairs. Each planned run (arm, seed) is
one JSON record ``RESULTS/ARM-seedSEED.json``, written atomically when the run ends and skipped when present, so an
interrupted sweep resumes where it stopped. A record carries the run's exact command (paths relative to the
repository), the code version (commit, ``git describe`` and whether the tree was dirty), the build of the task it
trained on (:func:`folder_build`), its status and verl's metrics per step. A run whose output shows no progress for
the spec's ``stall_seconds`` (e.g. a Ray worker killed by the memory monitor leaves verl's agent loop waiting
forever, printing only its once-a-minute status line) is killed and recorded as failed with the reason; the sweep
goes on. ``--retry-failed`` runs the failed ones again. ``--run`` refuses to add runs on another build of the task
than the spec's records name (:func:`check_same_build`).

The report applies the comparison rule of :mod:`stats` to every pair and metric: the mean paired difference, its
paired standard error, the 80%-detectable difference at the observed paired SD, the run's rise (where the metric
names its start) and the verdict: win, lose, level, or not measurable when the detectable difference exceeds half
the rise. A pair gives no verdict while one of its seeds pairs runs made on different builds of the task.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import mean
from typing import Any, Callable, Optional, Sequence

from benchlib import REPO, portable, read_json, write_json
from stats import detectable_of, paired_difference, paired_sd, seeds_needed, unpaired_sd, verdict

SPECS = REPO / "benchmarks" / "specs"
WINDOWS = ("last", "first", "all", "step")
#: the share of the run's rise a comparison should detect with 80% power (the seeds a report asks for)
TARGET_SHARE = 0.25
#: the fields a spec with a ``base`` takes from that spec where it does not give them (the regime; the arms only as
#: the ones its arms' ``from`` may name)
INHERITED = ("steps", "env", "overrides", "start", "metrics", "keep", "stall_seconds")
#: the metric prefixes a record keeps when its spec names none
KEEP = ("critic/score/", "critic/vf_explained_var", "response_length/mean", "group/", "timing_s/", "actor/entropy",
        "val-")


@dataclass(frozen=True)
class Metric:
    """One number per run read from its per-step metrics ``{step: {key: value}}``.

    ``keys`` (one or more, combined with ``weights``: a weighted mean) at ``window``: ``last`` / ``first`` (mean
    over the last / first ``steps`` training steps, steps >= 1), ``all`` (mean over every training step), or
    ``step`` (the value at step ``step``; ``"end"`` is the run's planned last step). ``start: true`` reads it from
    the spec's start run (every run's shared step 0). ``rise_from`` names the metric giving the same quantity at the
    run's start: the rise is the mean over a pair's runs of this metric minus that one. ``compare: false`` keeps a
    metric out of the pairs (a start value, shown in the arm table only)."""

    name: str
    keys: tuple[str, ...]
    window: str
    steps: int = 1
    step: Any = "end"
    weights: Optional[tuple[float, ...]] = None
    start: bool = False
    rise_from: Optional[str] = None
    compare: bool = True


@dataclass(frozen=True)
class Arm:
    """An arm: the launcher command (split like a shell), its own overrides and environment, its seeds.

    ``seed_offset`` shifts the seed its runs are given (``{seed}`` in the overrides) while it is still paired on the
    nominal seed: the same arm under another name and an offset is an A/A test on other seeds. ``records_of`` names
    the spec that runs this arm (the same command, its records in that spec's folder ``records_in``): this spec
    reads them and runs none of its own."""

    name: str
    launcher: tuple[str, ...]
    overrides: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    seeds: tuple[int, ...] = ()
    seed_offset: int = 0
    records_of: Optional[str] = None
    records_in: Optional[str] = None


@dataclass(frozen=True)
class Spec:
    """A comparison (see :func:`load_spec` for the file's fields)."""

    name: str
    description: str
    results: str
    steps: int
    arms: dict
    pairs: tuple
    metrics: dict
    overrides: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    keep: tuple[str, ...] = KEEP
    stall_seconds: float = 1800.0
    start: Optional[Arm] = None

    def runs(self) -> list[tuple[str, int]]:
        """The planned runs (arm, seed): the start run first, then seed by seed, every arm of a seed in the arms'
        order before the next seed (an interrupted sweep holds whole seeds)."""
        seeds = sorted({s for arm in self.arms.values() for s in arm.seeds})
        plan = [(a, s) for s in seeds for a, arm in self.arms.items() if s in arm.seeds]
        return ([(self.start.name, 0)] if self.start else []) + plan

    def arm(self, name: str) -> Optional[Arm]:
        """The arm ``name``, or the start run; None for neither."""
        return self.start if self.start and name == self.start.name else self.arms.get(name)

    def path(self, arm: str, seed: int) -> Path:
        found = self.arm(arm)
        return REPO / (found.records_in if found and found.records_in else self.results) / f"{arm}-seed{seed}.json"


def _need(value: Any, ok: bool, name: str, what: str) -> Any:
    if not ok:
        raise ValueError(f"{name}: need {what}, got {value!r}")
    return value


def _with_origin(data: dict, known: dict, where: str) -> dict:
    """An arm's fields with ``from`` resolved: the named arm's (in ``known``, resolved already) but its seeds, this
    arm's ``overrides`` after its and ``env`` over its, this arm's other fields in place of its."""
    if "from" not in data:
        return data
    origin = known.get(data["from"])
    _need(data["from"], isinstance(origin, dict), f"{where}.from", f"the name of an earlier arm, one of {list(known)}")
    own = {k: v for k, v in data.items() if k not in ("from", "overrides", "env")}
    origin = {k: v for k, v in origin.items() if k != "seeds"}  # the seeds are this spec's
    return {**origin, **own, "overrides": [*origin.get("overrides", ()), *data.get("overrides", ())],
            "env": {**origin.get("env", {}), **data.get("env", {})}}


def _arm(name: str, data: dict, seeds: Sequence[int], where: str) -> Arm:
    launcher = data.get("launcher")
    _need(launcher, isinstance(launcher, str) and launcher.strip() != "", f"{where}.launcher", "a command string")
    arm_seeds = data.get("seeds", list(seeds))
    _need(arm_seeds, isinstance(arm_seeds, list) and all(isinstance(s, int) for s in arm_seeds),
          f"{where}.seeds", "a list of integers")
    offset = _need(data.get("seed_offset", 0), isinstance(data.get("seed_offset", 0), int), f"{where}.seed_offset",
                   "an integer")
    return Arm(name, tuple(shlex.split(launcher)), tuple(data.get("overrides", ())), dict(data.get("env", {})),
               tuple(arm_seeds), offset)


def _metric(name: str, data: dict) -> Metric:
    where = f"metrics.{name}"
    keys = data.get("key", data.get("keys"))
    keys = [keys] if isinstance(keys, str) else keys
    _need(keys, isinstance(keys, list) and keys and all(isinstance(k, str) for k in keys), f"{where}.key",
          "a metric key or a list of them")
    window = _need(data.get("window"), data.get("window") in WINDOWS, f"{where}.window", f"one of {WINDOWS}")
    weights = data.get("weights")
    if weights is not None:
        _need(weights, isinstance(weights, list) and len(weights) == len(keys), f"{where}.weights",
              "one weight per key")
    return Metric(name, tuple(keys), window, int(data.get("steps", 1)), data.get("step", "end"),
                  tuple(weights) if weights else None, bool(data.get("start", False)), data.get("rise_from"),
                  bool(data.get("compare", True)))


def load_spec(path: os.PathLike | str, _seen: frozenset = frozenset()) -> Spec:
    """The spec in ``path`` (JSON). Fields: ``description``; ``results`` (the records' folder, relative to the
    repository); ``steps``; ``seeds``; ``arms`` (name -> ``launcher``, optional ``overrides``, ``env``, ``seeds``,
    ``seed_offset``; or ``from``: another arm's, this arm's ``overrides`` after its and ``env`` over its);
    or ``records_of``: the name of another spec with an arm of this name and the same command, whose records this
    arm reads and does not run, optional ``seeds`` beside it; ``base`` (optional): the name of a spec in the same
    folder whose :data:`INHERITED` fields this one takes where it does not give them, and whose arms ``from`` may
    name;
    ``pairs`` (``[arm, baseline]`` lists); ``metrics`` (name -> :class:`Metric` fields: ``key`` or ``keys``,
    ``window``, ``steps``, ``step``, ``weights``, ``start``, ``rise_from``, ``compare``); optional ``overrides`` and
    ``env`` every run gets, ``keep`` (the metric prefixes a record keeps), ``stall_seconds``, and ``start`` (one
    run, seed 0, shared by every arm as its step 0: its own launcher, overrides and env; the spec's env applies to
    it, the spec's overrides do not). Overrides may hold ``{arm}``, ``{seed}``, ``{steps}``, ``{spec}``; an env
    value ``{repo}``. ValueError naming the first bad field."""
    path = Path(path)
    data = json.loads(path.read_text())
    known: dict = {}  # the arms ``from`` may name, resolved: the base's, then this spec's before it
    base_start: dict = {}  # the base's start run, where this spec runs it too (it gives no start of its own)
    if "base" in data:  # the regime of another spec: its fields, where this one does not give them
        base_path = path.parent / f"{data['base']}.json"
        base = json.loads(base_path.read_text()) if isinstance(data["base"], str) and base_path.is_file() else None
        _need(data["base"], isinstance(base, dict) and "base" not in base, "base",
              f"the name of a spec in {path.parent.name}/ without a base of its own")
        for name, arm in base.get("arms", {}).items():
            known[name] = _with_origin(arm, known, f"base arms.{name}")
        if "start" in base and "start" not in data:
            base_start = {"name": data["base"], "results": base.get("results")}
        data = {**{k: v for k, v in base.items() if k in INHERITED}, **data}
    steps = _need(data.get("steps"), isinstance(data.get("steps"), int) and data["steps"] >= 0, "steps",
                  "an integer >= 0")
    seeds = data.get("seeds", [])
    arms_data = _need(data.get("arms"), isinstance(data.get("arms"), dict) and data["arms"], "arms",
                      "a non-empty object of arms")
    arms = {}
    for name, arm in arms_data.items():
        if isinstance(arm, dict) and "records_of" in arm:
            arms[name] = reused = _reused_arm(name, arm, seeds, path.parent, _seen | {path.stem})
            known[name] = {"launcher": shlex.join(reused.launcher), "overrides": list(reused.overrides),
                           "env": dict(reused.env), "seed_offset": reused.seed_offset}
            continue
        known[name] = _with_origin(arm, known, f"arms.{name}")
        arms[name] = _arm(name, known[name], seeds, f"arms.{name}")
    for name, arm in arms.items():
        _need(list(arm.seeds), bool(arm.seeds), f"arms.{name}.seeds", "at least one seed (or top-level seeds)")
    pairs = tuple(tuple(p) for p in data.get("pairs", []))
    for p in pairs:
        _need(list(p), len(p) == 2 and all(a in arms for a in p), "pairs", f"[arm, baseline] of the arms {list(arms)}")
    metrics_data = _need(data.get("metrics"), isinstance(data.get("metrics"), dict) and data["metrics"], "metrics",
                         "a non-empty object")
    metrics = {name: _metric(name, m) for name, m in metrics_data.items()}
    for m in metrics.values():
        _need(m.rise_from, m.rise_from is None or m.rise_from in metrics, f"metrics.{m.name}.rise_from",
              "the name of another metric")
    start = _arm("start", data["start"], [0], "start") if data.get("start") else None
    if start and base_start:  # the base's own start run: its record, in the base's folder
        start = replace(start, records_of=base_start["name"], records_in=base_start["results"])
    _need(start, start is not None or not any(m.start for m in metrics.values()), "start",
          "a start run for the metrics read from it")
    results = _need(data.get("results"), isinstance(data.get("results"), str) and not os.path.isabs(data["results"]),
                    "results", "a folder relative to the repository")
    spec = Spec(path.stem, data.get("description", ""), results, steps, arms, pairs, metrics,
                tuple(data.get("overrides", ())), dict(data.get("env", {})), tuple(data.get("keep", KEEP)),
                float(data.get("stall_seconds", 1800.0)), start)
    for arm in arms.values():
        if arm.records_of:
            _check_same_runs(spec, arm, load_spec(path.parent / f"{arm.records_of}.json", _seen | {path.stem}))
    return spec


def _reused_arm(name: str, data: dict, seeds: Sequence[int], folder: Path, seen: frozenset) -> Arm:
    """The arm ``name`` of the spec ``data["records_of"]`` (in ``folder``), read from there: its records are kept
    where the spec that runs them keeps them (followed through specs that read them in turn)."""
    where, other = f"arms.{name}.records_of", data["records_of"]
    _need(other, isinstance(other, str) and (folder / f"{other}.json").is_file() and other not in seen, where,
          f"the name of another spec in {folder.name}/ that does not read this one's records")
    _need(sorted(data), set(data) <= {"records_of", "seeds"}, f"arms.{name}", "only records_of and seeds beside it")
    source = load_spec(folder / f"{other}.json", seen)
    arm = _need(source.arms.get(name), name in source.arms, where, f"a spec with an arm {name!r}")
    arm_seeds = _need(data.get("seeds", list(seeds)), isinstance(data.get("seeds", list(seeds)), list),
                      f"arms.{name}.seeds", "a list of integers")
    return Arm(name, arm.launcher, arm.overrides, dict(arm.env), tuple(arm_seeds), arm.seed_offset,
               arm.records_of or source.name, arm.records_in or source.results)


def _check_same_runs(spec: Spec, arm: Arm, source: Spec) -> None:
    """ValueError unless ``source`` (the spec that runs ``arm``) plans each of its seeds with the command this spec
    would give (the spec's name aside: it only names the run)."""
    where = f"arms.{arm.name}.records_of"
    planned = set(source.arms[arm.name].seeds)
    _need(list(arm.seeds), set(arm.seeds) <= planned, f"arms.{arm.name}.seeds", f"seeds {source.name} plans, "
          f"{sorted(planned)}")
    as_source = replace(spec, name=source.name)
    for seed in arm.seeds:
        mine, theirs = command(as_source, arm.name, seed, "-"), command(source, arm.name, seed, "-")
        _need(arm.records_of, mine == theirs, where, f"a spec that runs the same command: {source.name} runs "
              f"{' '.join(theirs[0])} with {theirs[1]}, this spec {' '.join(mine[0])} with {mine[1]}")


def list_specs(folder: Path = SPECS) -> list[tuple[str, str]]:
    """(name, description) of every spec in ``folder``."""
    return [(p.stem, load_spec(p).description) for p in sorted(folder.glob("*.json"))]


def spec_path(name: str, folder: Path = SPECS) -> Path:
    """A spec's file from its name (or a path to one); SystemExit naming the known ones when missing."""
    path = Path(name) if name.endswith(".json") else folder / f"{name}.json"
    if not path.exists():
        raise SystemExit(f"spec {name!r}: no {path}; the specs: {', '.join(n for n, _ in list_specs(folder))}")
    return path


# ---------------------------------------------------------------------------------------------------- running


def code_version(repo: Path = REPO) -> dict[str, Any]:
    """The tree's commit, ``git describe --always`` and whether its code had uncommitted changes: any tracked file
    outside ``benchmarks/results`` (a bench that runs several commands rewrites its own records there as it goes).
    None values outside a git checkout."""
    def git(*args: str) -> Optional[str]:
        try:
            return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout=60,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results")
    return {"commit": git("rev-parse", "HEAD"), "describe": git("describe", "--always", "--tags"),
            "dirty": None if status is None else status != ""}


def command(spec: Spec, arm_name: str, seed: int, checkpoint_dir: str) -> tuple[list[str], dict[str, str]]:
    """The run's argument list and its own environment (the spec's, then the arm's; ``{repo}`` in a value is the
    repository root, for a path the launcher's processes read from another folder)."""
    is_start = spec.start is not None and arm_name == spec.start.name
    arm = spec.start if is_start else spec.arms[arm_name]
    steps = 0 if is_start else spec.steps
    fill = {"arm": arm_name, "seed": seed + arm.seed_offset, "steps": steps, "spec": spec.name}
    overrides = arm.overrides if is_start else (*spec.overrides, *arm.overrides)
    args = [*arm.launcher, f"trainer.total_training_steps={steps}", *(o.format(**fill) for o in overrides),
            f"trainer.default_local_dir={checkpoint_dir}"]
    env = {key: _in_repo(value) for key, value in {**spec.env, **arm.env}.items()}
    return args, env


def _in_repo(value: Any) -> str:
    """An env value of a spec with ``{repo}`` made the repository root."""
    return str(value).replace("{repo}", str(REPO))


@dataclass
class Outcome:
    """What a watched process did: its exit code (None when killed), the reason it was killed, wall seconds."""

    returncode: Optional[int]
    killed: Optional[str]
    seconds: float


#: lines that a stalled run keeps printing (verl's agent loop reports its requests once a minute while it waits for
#: a dead worker forever): output made only of these is not progress
HEARTBEAT = re.compile(rb"pending: \d+, running: \d+, finished: \d+, failure: \d+\s*$")


#: causes of a failure that a run's output names, and how a record says them (Ray's wording)
CAUSES = ((re.compile(r"OutOfMemoryError|worker\(s\) were killed due to the node running low on memory"),
           "Ray's memory monitor killed workers: the machine ran low on memory"),)


def failure_cause(output: str) -> Optional[str]:
    """What a failed run's ``output`` says killed it (:data:`CAUSES`), None when it names none of them."""
    return next((said for pattern, said in CAUSES if pattern.search(output)), None)


def _progress(new_output: bytes) -> bool:
    """Whether ``new_output`` holds a line other than a :data:`HEARTBEAT` (or blank) line."""
    return any(line.strip() and not HEARTBEAT.search(line) for line in new_output.splitlines())


def run_watched(args: Sequence[str], env: dict[str, str], log_path: Path, stall_seconds: float,
                poll: float = 1.0, cwd: Path = REPO) -> Outcome:
    """Run ``args`` with its output to ``log_path``; kill its whole process group when the log has shown no progress
    for ``stall_seconds`` (the run stalls: nothing moves, nothing ends). Progress is any new line but the status
    lines a stalled agent loop keeps printing (:data:`HEARTBEAT`)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = last_progress = time.monotonic()
    read = 0
    with open(log_path, "wb") as log, open(log_path, "rb") as reader:
        proc = subprocess.Popen(list(args), env={**os.environ, **env}, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        while proc.poll() is None:
            time.sleep(poll)
            reader.seek(read)
            new = reader.read()
            cut = max(new.rfind(b"\n"), new.rfind(b"\r")) + 1  # whole lines (a progress bar's "\r" ends one too)
            read += cut
            if _progress(new[:cut]):
                last_progress = time.monotonic()
            elif time.monotonic() - last_progress > stall_seconds:
                _kill_group(proc)
                reason = f"stalled: no progress in the output for {stall_seconds:g} s; killed"
                return Outcome(None, reason, time.monotonic() - start)
    return Outcome(proc.returncode, None, time.monotonic() - start)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the process group ``proc`` leads (started with ``start_new_session``), SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


#: the launcher's line naming the folder of the task a run trains on (examples/cpu/common.sh)
TASK_LINE = re.compile(r"^\[launcher\] task: (.+?)\s*$", re.M)
#: the files of a task folder that decide what a run trains on: the model's weights and the data
TASK_FILES = ("model/*.safetensors", "model/*.bin", "data/*.parquet")


def task_build(output: str) -> Optional[dict[str, Any]]:
    """:func:`folder_build` of the task folder the launcher names in a run's ``output`` (:data:`TASK_LINE`); None
    when it names none."""
    found = TASK_LINE.findall(output)
    return folder_build(Path(found[-1])) if found else None


def folder_build(folder: Path) -> Optional[dict[str, Any]]:
    """Which build of the task the folder ``folder`` holds: ``{"fingerprint": sha256 of the weights and data files
    (:data:`TASK_FILES`), 12 hex digits, "warm_start": what the key file says its warm start measured}``; None when
    it holds no key file. ``prepare`` gives another warm start on a CPU with other float kernels (docs/results.md,
    "The bench"), so two runs are paired only on one build."""
    if not (folder / "data" / "prepare.json").is_file():
        return None
    digest = hashlib.sha256()
    for path in sorted(p for pattern in TASK_FILES for p in folder.glob(pattern)):
        digest.update(path.relative_to(folder).as_posix().encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    key = read_json(folder / "data" / "prepare.json") or {}
    return {"fingerprint": digest.hexdigest()[:12], "warm_start": key.get("test_accuracy")}


def run_one(spec: Spec, arm: str, seed: int, runs_dir: Path) -> dict:
    """Run one (arm, seed) of ``spec`` and return its record: status ``ok`` or ``failed`` with the reason."""
    from verl_group_ppo.logs import parse_step_metrics

    label = f"{arm}-seed{seed}"
    checkpoints = runs_dir / "checkpoints" / label
    args, env = command(spec, arm, seed, str(checkpoints))
    log_path = runs_dir / f"{label}.log"
    version = code_version()
    outcome = run_watched(args, {"PYTHON": sys.executable, **env}, log_path, spec.stall_seconds)
    shutil.rmtree(checkpoints, ignore_errors=True)  # no comparison reads checkpoints
    output = log_path.read_text(errors="replace")
    metrics = parse_step_metrics(output)
    steps_planned = 0 if spec.start and arm == spec.start.name else spec.steps
    logged = sorted(set(metrics) - {0})
    wrong_steps = logged != list(range(1, steps_planned + 1))
    reason = outcome.killed or (f"exit code {outcome.returncode}" if outcome.returncode else None) or (
        f"logged steps {logged[:3]}..., not 1..{steps_planned}" if wrong_steps else None)
    cause = failure_cause(output) if reason and not outcome.killed else None
    if cause:
        reason += f" ({cause})"
    return {"spec": spec.name, "arm": arm, "seed": seed, "steps_planned": steps_planned,
            "status": "failed" if reason else "ok", "reason": reason, "code_version": version,
            "task": task_build(output),
            "command": " ".join([*(f"{k}={portable(str(v))}" for k, v in env.items()), *(portable(a) for a in args)]),
            "log": portable(str(log_path)), "seconds": round(outcome.seconds, 1),
            "steps": {str(s): {k: v for k, v in m.items() if k.startswith(spec.keep)} for s, m in metrics.items()}}


def finished(record: Optional[dict], retry_failed: bool = False) -> bool:
    """Whether a kept record ends its run: present, and not a failure to retry."""
    return isinstance(record, dict) and not (retry_failed and record.get("status") == "failed")


def pending(spec: Spec, worker: tuple[int, int] = (1, 1), retry_failed: bool = False) -> list[tuple[str, int]]:
    """The runs of worker K of N (every N-th planned run from the K-th, the arms another spec runs left out) without
    a finished record."""
    k, n = worker
    own = [(arm, seed) for arm, seed in spec.runs() if not spec.arm(arm).records_of]
    mine = [run for i, run in enumerate(own) if i % n == k - 1]
    return [run for run in mine if not finished(read_json(spec.path(*run)), retry_failed)]


def check_same_build(spec: Spec) -> None:
    """SystemExit naming both builds when the spec's task folder (its ``WORK_DIR``, where it gives one and the folder
    is built) is another build of the task than one its kept records name: its new runs could pair with none of them."""
    work_dir = spec.env.get("WORK_DIR")
    here = folder_build(Path(_in_repo(work_dir))) if work_dir else None
    if here is None:
        return
    other = sorted({b for r in records(spec).values() if (b := fingerprint(r))} - {here["fingerprint"]})
    if other:
        raise SystemExit(f"[compare {spec.name}] WORK_DIR {work_dir} holds build {here['fingerprint']} of the task (warm "
                         f"start {here['warm_start']}), but the spec's records were made on {', '.join(other)}: runs on "
                         "two builds pair into no verdict. Run it where that build is, or give the spec a new results "
                         "folder.")


def run_spec(spec: Spec, worker: tuple[int, int] = (1, 1), retry_failed: bool = False,
             runner: Callable[[Spec, str, int, Path], dict] = run_one, runs_dir: Optional[Path] = None,
             log: Callable[[str], Any] = print) -> int:
    """Run the pending runs of ``worker``, each record written as its run ends; returns how many ran."""
    runs_dir = runs_dir or REPO / "runs" / "compare" / spec.name
    todo = pending(spec, worker, retry_failed)
    if todo:
        check_same_build(spec)
    log(f"[compare {spec.name}] worker {worker[0]}/{worker[1]}: {len(todo)} runs to run")
    ran = 0
    for arm, seed in todo:
        if finished(read_json(spec.path(arm, seed)), retry_failed):  # another worker finished it meanwhile
            continue
        log(f"[compare {spec.name}] {arm} seed {seed}")
        record = runner(spec, arm, seed, runs_dir)
        write_json(spec.path(arm, seed), record)
        ran += 1
        log(f"[compare {spec.name}] {arm} seed {seed}: {record['status']}"
            + (f" ({record['reason']})" if record.get("reason") else "") + f", {record['seconds']:.0f} s")
    return ran


# ---------------------------------------------------------------------------------------------------- report


def metric_value(metric: Metric, record: dict, start: Optional[dict] = None) -> Optional[float]:
    """``metric`` of one run's record (of ``start`` for a start metric); None when a key it needs is missing."""
    source = start if metric.start else record
    if source is None:
        return None
    steps = {int(s): m for s, m in source["steps"].items()}

    def value(m: dict) -> Optional[float]:
        if not all(k in m for k in metric.keys):
            return None
        weights = metric.weights or (1.0,) * len(metric.keys)
        return sum(w * m[k] for w, k in zip(weights, metric.keys)) / sum(weights)

    if metric.window == "step":
        step = source.get("steps_planned", max(steps)) if metric.step == "end" else int(metric.step)
        return value(steps[step]) if step in steps else None
    trained = [v for s in sorted(steps) if s > 0 and (v := value(steps[s])) is not None]
    if not trained:
        return None
    chosen = {"last": trained[-metric.steps:], "first": trained[:metric.steps], "all": trained}[metric.window]
    return mean(chosen)


def records(spec: Spec) -> dict[tuple[str, int], dict]:
    """The kept records of the planned runs."""
    found = {run: read_json(spec.path(*run)) for run in spec.runs()}
    return {run: r for run, r in found.items() if isinstance(r, dict)}


def values(spec: Spec, kept: dict[tuple[str, int], dict]) -> dict[str, dict[str, dict[int, float]]]:
    """``{metric: {arm: {seed: value}}}`` over the successful runs of the arms."""
    start = kept.get((spec.start.name, 0)) if spec.start else None
    out: dict[str, dict[str, dict[int, float]]] = {m: {a: {} for a in spec.arms} for m in spec.metrics}
    for (arm, seed), record in kept.items():
        if arm not in spec.arms or record.get("status", "ok") != "ok":
            continue
        for name, metric in spec.metrics.items():
            v = metric_value(metric, record, start)
            if v is not None:
                out[name][arm][seed] = v
    return out


def fingerprint(record: dict) -> Optional[str]:
    """The fingerprint of the task build a record names (:func:`folder_build`), None where it names none."""
    return (record.get("task") or {}).get("fingerprint")


def different_builds(kept: dict[tuple[str, int], dict], arm: str, base: str) -> list[int]:
    """The seeds at which the records of ``arm`` and ``base`` name different builds of the task (a record that names
    none pairs with any)."""
    seeds = sorted({s for a, s in kept if a == arm} & {s for a, s in kept if a == base})
    builds = [(s, fingerprint(kept[(arm, s)]), fingerprint(kept[(base, s)])) for s in seeds]
    return [s for s, a, b in builds if a and b and a != b]


def compare_pair(spec: Spec, vals: dict, arm: str, base: str, metric: str,
                 kept: Optional[dict[tuple[str, int], dict]] = None) -> dict[str, Any]:
    """One pair and metric: the paired difference, the 80%-detectable difference, the rise and the verdict
    (``no verdict`` until every planned common seed has a record, and while the records ``kept`` pair runs made on
    different builds of the task at some seed)."""
    diff = paired_difference(vals[metric][arm], vals[metric][base])
    rise = None
    start_name = spec.metrics[metric].rise_from
    if start_name:
        rises = [vals[metric][a][s] - vals[start_name][a][s] for a in (arm, base) for s in vals[metric][a]
                 if s in vals[start_name][a]]
        rise = mean(rises) if rises else None
    planned = sorted(set(spec.arms[arm].seeds) & set(spec.arms[base].seeds))
    complete = diff["seeds"] == planned
    sd = paired_sd(diff["per_seed"])
    target = TARGET_SHARE * abs(rise) if rise else None
    mixed = different_builds(kept, arm, base) if kept else []
    return {**diff, "planned": planned, "rise": rise, "detectable": detectable_of(diff["per_seed"]), "sd": sd,
            "unpaired_sd": unpaired_sd(vals[metric][arm], vals[metric][base]),
            "seeds_needed": seeds_needed(sd, target) if sd is not None and target else None,
            "verdict": (f"no verdict (task builds differ at seed {', '.join(map(str, mixed))})" if mixed
                        else verdict(diff, rise) if complete
                        else f"no verdict ({len(diff['seeds'])} of {len(planned)} seeds)")}


def _f(x: Optional[float], fmt: str = ".3f") -> str:
    return "n/a" if x is None else format(x, fmt)


def report(spec: Spec) -> str:
    """The arm table (each metric's mean over seeds), each pair's verdict per metric, and the runs missing or
    failed."""
    kept = records(spec)
    vals = values(spec, kept)
    out = [f"# {spec.name}: {spec.description}", "", f"{spec.steps} steps; records in {spec.results}/", "",
           "| arm | seeds | " + " | ".join(spec.metrics) + " |", "|---" * (len(spec.metrics) + 2) + "|"]
    for arm in spec.arms:
        seeds = sorted(set().union(*(vals[m][arm] for m in spec.metrics)))
        if seeds:
            out.append(f"| {arm} | {', '.join(map(str, seeds))} | " + " | ".join(
                _f(mean(vals[m][arm].values()) if vals[m][arm] else None) for m in spec.metrics) + " |")
    out += ["", "Per pair and metric: mean paired difference, paired SE, per-seed differences, the difference the rule "
            "detects with 80% power at the observed paired SD (benchmarks/stats.py), the run's rise, the verdict; then "
            "the paired SD, the SD of differences between runs of different seeds (what pairing saves), and the seeds "
            f"the rule needs to detect {TARGET_SHARE:g} of the rise with 80% power at the paired SD.", "",
            "| pair | metric | mean | paired SE | per seed | 80%-detectable | rise | verdict | paired SD | unpaired SD "
            f"| seeds for {TARGET_SHARE:g} x rise |", "|---" * 11 + "|"]
    for arm, base in spec.pairs:
        for metric in (name for name, m in spec.metrics.items() if m.compare):
            c = compare_pair(spec, vals, arm, base, metric, kept)
            out.append(f"| {arm} - {base} | {metric} | {_f(c['mean'], '+.3f')} | {_f(c['se'])} | "
                       + ", ".join(f"{d:+.3f}" for d in c["per_seed"]) + f" | {_f(c['detectable'])} | "
                       f"{_f(c['rise'], '+.3f')} | {c['verdict']} | {_f(c['sd'])} | {_f(c['unpaired_sd'])} | "
                       f"{c['seeds_needed'] or ('n/a' if c['sd'] is None or not c['rise'] else '> 40')} |")
    failed = [f"{a} seed {s} ({r.get('reason')})" for (a, s), r in kept.items() if r.get("status") == "failed"]
    missing = [f"{a} seed {s}" + (f" (run by {spec.arm(a).records_of})" if spec.arm(a).records_of else "")
               for a, s in spec.runs() if (a, s) not in kept]
    out += [""] + ([f"failed runs: {'; '.join(failed)}"] if failed else []) + (
        [f"missing runs: {', '.join(missing)}"] if missing else []) + (
        ["every planned run has its record"] if not failed and not missing else [])
    return "\n".join(out)


def worker_arg(text: str) -> tuple[int, int]:
    """``"2/3"`` -> (2, 3); SystemExit unless 1 <= K <= N."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise SystemExit(f"--worker: K/N, e.g. 2/2, got {text!r}") from None
    if not 1 <= k <= n:
        raise SystemExit(f"--worker: need 1 <= K <= N, got {text!r}")
    return k, n


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--list", action="store_true", help="list the specs")
    what.add_argument("--run", metavar="SPEC", help="run the missing runs of SPEC (a name or a .json path)")
    what.add_argument("--report", metavar="SPEC", help="print SPEC's verdicts from its records")
    parser.add_argument("--worker", type=worker_arg, default=(1, 1), metavar="K/N",
                        help="take every N-th planned run from the K-th (a second worker: 2/2)")
    parser.add_argument("--retry-failed", action="store_true", help="run the runs recorded as failed again")
    args = parser.parse_args(argv)
    if args.list:
        for name, description in list_specs():
            print(f"{name}: {description}")
        return 0
    spec = load_spec(spec_path(args.run or args.report))
    if args.run:
        run_spec(spec, args.worker, args.retry_failed)
    print(report(spec))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
