"""What the verl-group-ppo plugin adds to ``import verl`` (and to importing verl's trainer), same run.

    .venv/bin/python benchmarks/bench_plugin_import.py              # 7 rounds
    .venv/bin/python benchmarks/bench_plugin_import.py --rounds 15

Each measurement is a fresh interpreter; rounds alternate the plugin on (``VERL_USE_EXTERNAL_PLUGINS`` unset,
verl's default ``auto``) and off (``none``). Three stages, timed inside the process: ``import verl``; then
``verl.trainer.ppo.core_algos`` + ``ppo.utils`` (the plugin registers the estimator and replaces need_critic);
then ``verl.trainer.ppo.v1`` (it installs the trainer classes). Prints medians and the on-minus-off difference
per stage. As that difference is within the noise of fresh interpreters, the plugin-off processes also time the
plugin's own work in process, after the three stages: verl's entry-point discovery, then importing
``verl_group_ppo.integration.entry_point``, whose hooks fire at once for the hooked verl modules already
imported (``verl.trainer.main_ppo`` is not, so its hook stays pending).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

PROBE = r"""
import json, time
t0 = time.perf_counter()
import verl
t1 = time.perf_counter()
import verl.trainer.ppo.core_algos, verl.trainer.ppo.utils
t2 = time.perf_counter()
import verl.trainer.ppo.v1
t3 = time.perf_counter()
times = {"import verl": t1 - t0, "+ core_algos, utils": t2 - t1, "+ ppo.v1 trainers": t3 - t2}
if verl._plugins_policy == "none":
    from importlib.metadata import entry_points
    t4 = time.perf_counter()
    list(entry_points(group="verl.plugins"))
    t5 = time.perf_counter()
    import verl_group_ppo.integration.entry_point as entry_point
    t6 = time.perf_counter()
    assert not entry_point.install_errors()
    times.update({"entry-point discovery": t5 - t4, "plugin, all installs": t6 - t5})
print(json.dumps(times))
"""


def measure(plugin_on: bool) -> dict[str, float]:
    """Stage times (seconds) in one fresh interpreter, plugin on or off."""
    env = {k: v for k, v in os.environ.items() if k != "VERL_USE_EXTERNAL_PLUGINS"}
    if not plugin_on:
        env["VERL_USE_EXTERNAL_PLUGINS"] = "none"
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, check=True,
                         cwd="/")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()

    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    measure(True)  # warm the file cache
    for _ in range(args.rounds):
        for plugin_on in (False, True):
            runs[plugin_on].append(measure(plugin_on))

    print(f"median of {args.rounds} fresh interpreters per setting (seconds)")
    print(f"{'stage':<22}{'plugin off':>12}{'plugin on':>12}{'added':>10}")
    for stage in runs[True][0]:
        off = statistics.median(r[stage] for r in runs[False])
        on = statistics.median(r[stage] for r in runs[True])
        print(f"{stage:<22}{off:>12.3f}{on:>12.3f}{on - off:>+10.3f}")
    print("measured directly, in process (median, milliseconds)")
    for stage in ("entry-point discovery", "plugin, all installs"):
        print(f"{stage:<22}{1000 * statistics.median(r[stage] for r in runs[False]):>12.1f}")


if __name__ == "__main__":
    main()
