"""The comparison rule, the paired standard error and the rule's power, by simulation under the rule itself.

The one home of the rule every comparison in this repository reports (docs/results.md, "The rule"). For two arms
A and B run on the same seeds, per metric:

* the paired difference per seed, ``d_s = A_s - B_s``, its mean and paired standard error
  ``sd(d_s, ddof=1) / sqrt(S)`` over the S seeds both arms have;
* **win** when every ``d_s`` is positive and the mean exceeds 2 paired standard errors, **lose** by the mirror
  rule, else **level** (also with fewer than 2 seeds);
* **not measurable** in place of level when the design cannot see a difference that matters: the difference the
  rule calls a win with 80% probability (:func:`detectable_difference`, from the observed paired SD and S) exceeds
  half the run's rise (how much the metric rose within a run).

The rule's power is not a t-test's: the all-same-sign clause costs power, so 80% needs about 4.4 paired standard
errors at 6 seeds, not 2. :func:`power_under_rule` draws normal paired differences and applies the rule itself
(:func:`rule_codes`, the one implementation, which :func:`verdict` applies to a single comparison).

Benchmark scripts import this module by name (``from stats import ...``: a script's folder is first on
``sys.path``); code run from the repository root imports it as ``benchmarks.stats``. It needs only numpy.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Mapping, Optional, Sequence

import numpy as np

#: the rule's threshold: the mean paired difference must exceed this many paired standard errors
SE_MULTIPLE = 2.0
#: the power at which the detectable difference is taken
POWER = 0.8
#: a level verdict reads "not measurable" when the detectable difference exceeds this share of the run's rise
RISE_SHARE = 0.5
#: simulated comparisons per power estimate
SIMS = 20000
WIN, LOSE, LEVEL, NOT_MEASURABLE = "win", "lose", "level", "not measurable"
_CODES = (WIN, LOSE, LEVEL)


def rule_codes(d: np.ndarray) -> np.ndarray:
    """The rule on every row of ``d``, shape (comparisons, seeds), seeds >= 2: 0 win, 1 lose, 2 level, shape
    (comparisons,).

    Win: every difference of the row positive and its mean above :data:`SE_MULTIPLE` paired standard errors
    (``std(ddof=1) / sqrt(seeds)``); lose: the mirror; else level. A standard error of 0 with every difference of
    one sign is a win or a lose."""
    d = np.asarray(d, dtype=float)
    if d.ndim != 2 or d.shape[1] < 2:
        raise ValueError(f"d: need shape (comparisons, seeds >= 2), got {d.shape}")
    mean = d.mean(axis=1)
    se = d.std(axis=1, ddof=1) / math.sqrt(d.shape[1])
    win = (d > 0).all(axis=1) & (mean > SE_MULTIPLE * se)
    lose = (d < 0).all(axis=1) & (-mean > SE_MULTIPLE * se)
    return np.where(win, 0, np.where(lose, 1, 2))


def paired_se(differences: Sequence[float]) -> Optional[float]:
    """The paired standard error of per-seed differences (S,): ``sd(ddof=1) / sqrt(S)``; None below 2."""
    d = np.asarray(differences, dtype=float)
    return float(d.std(ddof=1) / math.sqrt(d.size)) if d.size >= 2 else None


def paired_sd(differences: Sequence[float]) -> Optional[float]:
    """The sample SD (ddof=1) of per-seed differences (S,); None below 2."""
    d = np.asarray(differences, dtype=float)
    return float(d.std(ddof=1)) if d.size >= 2 else None


def paired_difference(a: Mapping[int, float], b: Mapping[int, float]) -> dict[str, Any]:
    """Per-seed differences ``a - b`` over the seeds both have (seed -> value): ``{"seeds", "per_seed", "mean",
    "se"}`` (mean None without a common seed, se None below 2)."""
    seeds = sorted(set(a) & set(b))
    d = [float(a[s]) - float(b[s]) for s in seeds]
    return {"seeds": seeds, "per_seed": d, "mean": float(np.mean(d)) if d else None, "se": paired_se(d)}


def unpaired_sd(a: Mapping[int, float], b: Mapping[int, float]) -> Optional[float]:
    """The SD (ddof=1) of differences ``a - b`` between runs of *different* seeds: over the S seeds both have,
    sorted, seed i of ``a`` against seed i + 1 of ``b`` (cyclically). Set beside :func:`paired_sd` of the matched
    differences it says how much pairing the arms on a seed cut the noise; None below 2 common seeds."""
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return None
    return paired_sd([float(a[s]) - float(b[t]) for s, t in zip(seeds, seeds[1:] + seeds[:1])])


def seeds_needed(sd_paired: float, target: float, max_seeds: int = 40, power: float = POWER,
                 sims: int = SIMS) -> Optional[int]:
    """The fewest seeds (2..``max_seeds``) at which the rule detects ``target`` with probability ``power`` when the
    per-seed paired differences have SD ``sd_paired`` (:func:`detectable_difference`); None when ``max_seeds`` do
    not suffice. More seeds do not always help: every seed's difference must be positive, so the detectable
    difference is lowest at about 4 seeds (1.64 paired SDs) and grows beyond (1.80 at 6, 2.01 at 10): under this
    rule only a smaller paired SD, not more seeds, brings a smaller difference within reach."""
    if not (isinstance(target, (int, float)) and math.isfinite(target) and target > 0):
        raise ValueError(f"target: need a finite number > 0, got {target!r}")
    _check_design(sd_paired, 2, sims)
    for n in range(2, max_seeds + 1):  # the rule is scale-free: the detectable difference is sd_paired times its
        if _detectable_per_sd(n, power, sims) * sd_paired <= target:  # value at SD 1, simulated once per seed count
            return n
    return None


@functools.lru_cache(maxsize=None)
def _detectable_per_sd(n_seeds: int, power: float, sims: int) -> float:
    """:func:`detectable_difference` at paired SD 1 (kept: every report asks for the same seed counts)."""
    return detectable_difference(1.0, n_seeds, power, sims)


def rule_verdict(per_seed: Sequence[float]) -> str:
    """``"win"``, ``"lose"`` or ``"level"`` for per-seed paired differences A - B (the rule, :func:`rule_codes`);
    level below 2 seeds."""
    d = np.asarray(per_seed, dtype=float)
    if d.ndim != 1:
        raise ValueError(f"per_seed: need one difference per seed, got shape {d.shape}")
    return LEVEL if d.size < 2 else _CODES[int(rule_codes(d[None, :])[0])]


def power_under_rule(effect: float, sd_paired: float, n_seeds: int, sims: int = SIMS, seed: int = 0) -> float:
    """The share of ``sims`` simulated comparisons the rule calls a win when the per-seed paired differences are
    normal with mean ``effect`` and SD ``sd_paired``, ``n_seeds`` of them.

    Every call with one ``seed`` draws the same standard normals (common random numbers), so the share is
    non-decreasing in ``effect``."""
    _check_design(sd_paired, n_seeds, sims)
    z = np.random.default_rng(seed).standard_normal((sims, n_seeds))
    return float(np.mean(rule_codes(effect + sd_paired * z) == 0))


def detectable_difference(sd_paired: float, n_seeds: int, power: float = POWER, sims: int = SIMS,
                          seed: int = 0) -> float:
    """The smallest true difference the rule calls a win with probability ``power`` (:func:`power_under_rule`),
    by bisection to 1e-4 of ``sd_paired``; 0 when ``sd_paired`` is 0 (every positive difference wins)."""
    _check_design(sd_paired, n_seeds, sims)
    if not 0 < power < 1:
        raise ValueError(f"power: need 0 < power < 1, got {power}")
    if sd_paired == 0:
        return 0.0
    z = np.random.default_rng(seed).standard_normal((sims, n_seeds))

    def wins(effect: float) -> float:
        return float(np.mean(rule_codes(effect + sd_paired * z) == 0))

    low, high = 0.0, sd_paired
    while wins(high) < power:
        low, high = high, 2 * high
        if high > 1e6 * sd_paired:
            raise ValueError(f"power: {power} is out of reach with n_seeds={n_seeds} and sims={sims}")
    while high - low > 1e-4 * sd_paired:
        mid = (low + high) / 2
        low, high = (mid, high) if wins(mid) < power else (low, mid)
    return high


def detectable_in_se(n_seeds: int, power: float = POWER, sims: int = SIMS, seed: int = 0) -> float:
    """:func:`detectable_difference` in paired standard errors (``sd / sqrt(n_seeds)``): the rule's threshold for
    ``power``, independent of the SD."""
    return detectable_difference(1.0, n_seeds, power, sims, seed) * math.sqrt(n_seeds)


def verdict(diff: Mapping[str, Any], rise: Optional[float] = None, sims: int = SIMS) -> str:
    """The verdict on one paired difference (:func:`paired_difference`'s dict, or any mapping with ``per_seed``).

    The rule's win, lose or level; with the run's ``rise`` given, a level reads ``"not measurable"`` when the
    80%-detectable difference at the observed paired SD exceeds :data:`RISE_SHARE` of ``|rise|``."""
    base = rule_verdict(diff["per_seed"])
    if base != LEVEL or rise is None:
        return base
    detectable = detectable_of(diff["per_seed"], sims=sims)
    return NOT_MEASURABLE if detectable is None or detectable > RISE_SHARE * abs(rise) else LEVEL


def detectable_of(per_seed: Sequence[float], power: float = POWER, sims: int = SIMS) -> Optional[float]:
    """The 80%-detectable difference (:func:`detectable_difference`) at the observed paired SD and seed count of
    per-seed differences (S,); None below 2 seeds."""
    sd = paired_sd(per_seed)
    return None if sd is None else detectable_difference(sd, len(per_seed), power, sims)


def _check_design(sd_paired: float, n_seeds: int, sims: int) -> None:
    """ValueError naming the first argument out of range."""
    if not (isinstance(sd_paired, (int, float)) and math.isfinite(sd_paired) and sd_paired >= 0):
        raise ValueError(f"sd_paired: need a finite number >= 0, got {sd_paired!r}")
    if not (isinstance(n_seeds, int) and n_seeds >= 2):
        raise ValueError(f"n_seeds: need an integer >= 2, got {n_seeds!r}")
    if not (isinstance(sims, int) and sims >= 1):
        raise ValueError(f"sims: need an integer >= 1, got {sims!r}")


def main() -> int:
    """``python benchmarks/stats.py``: the rule's 80%-detectable difference in paired SE per seed count."""
    print("| seeds | 80%-detectable difference (paired SE) | (paired SD) |\n|---|---|---|")
    for n in (3, 4, 5, 6, 8, 10, 12):
        in_se = detectable_in_se(n)
        print(f"| {n} | {in_se:.2f} | {in_se / math.sqrt(n):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
