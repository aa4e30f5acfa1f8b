"""Outputs of the demo: results.json, summary.md, learning_curves.png, groups.html and groups.png.

Paired differences and verdicts come from the comparison rule's one home, ``benchmarks/stats.py``. Arm names,
labels and colours come from :data:`experiments.demo.arms.ARMS`; groups.html is drawn by the
project's one renderer, :mod:`verl_group_ppo.render` (``python -m verl_group_ppo.viz`` uses it too).
"""

from __future__ import annotations

import json
import math
from itertools import combinations
from typing import Any, Optional

import numpy as np

from benchmarks.stats import detectable_of, paired_difference, verdict
from verl_group_ppo import render

from .arms import ARMS


def _label(name: str) -> str:
    return ARMS[name].label if name in ARMS else name


def _color(name: str) -> Optional[str]:
    return ARMS[name].color if name in ARMS else None


def _order(names) -> list[str]:
    """Arm names in the ARMS order (unknown names last)."""
    rank = {n: i for i, n in enumerate(ARMS)}
    return sorted(names, key=lambda n: rank.get(n, len(rank)))


def mean_curve(runs: list[dict], key: str = "curve") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Steps, mean and std over seeds of an eval curve (runs share their eval steps)."""
    steps = np.array([s for s, _ in runs[0][key]], dtype=float)
    vals = np.array([[v for _, v in r[key]] for r in runs], dtype=float)
    return steps, vals.mean(0), vals.std(0)


def curve_area(curve: list) -> float:
    """Learning-curve area: the mean accuracy over a run's eval points ``[[step, acc], ...]``."""
    return float(np.mean([a for _, a in curve]))


def steps_to_reach(steps: np.ndarray, curve: np.ndarray, target: float) -> float | None:
    """First eval step at which ``curve`` is >= ``target`` (None if never)."""
    for s, v in zip(steps, curve):
        if v >= target - 1e-12:
            return float(s)
    return None


def _arm_row(name: str, rs: list[dict], ppo_end: Optional[float]) -> dict[str, Any]:
    finals = [r["final_eval_accuracy"] for r in rs]
    areas = [r.get("curve_area", curve_area(r["curve"])) for r in rs]
    steps, m, _ = mean_curve(rs)
    return {
        "estimator": name,
        "seeds": [r["seed"] for r in rs],
        "final_mean": float(np.mean(finals)),
        "final_std": float(np.std(finals)),
        "final_per_seed": finals,
        "area_mean": float(np.mean(areas)),
        "area_std": float(np.std(areas)),
        "area_per_seed": areas,
        "final_eval_samples": rs[0].get("final_eval_samples"),
        "start_mean": float(m[0]),
        "greedy_final_mean": float(np.mean([r.get("final_greedy_accuracy", float("nan")) for r in rs])),
        "steps_to_ppo_final": steps_to_reach(steps, m, ppo_end) if ppo_end is not None else None,
        "wall_time_s_mean": float(np.mean([r["wall_time_s"] for r in rs])),
        "final_threshold_mean": (float(np.mean([r["final_threshold"] for r in rs]))
                                 if rs[0].get("final_threshold") is not None else None),
    }


def summarise(runs: list[dict]) -> dict[str, Any]:
    """Per arm: final accuracy and curve area (mean, std, per seed) and more; paired differences of every
    pair of arms over their common seeds (final accuracy and curve area)."""
    by_est: dict[str, list[dict]] = {}
    for r in runs:
        by_est.setdefault(r["estimator"], []).append(r)
    by_est = {e: sorted(by_est[e], key=lambda r: r["seed"]) for e in _order(by_est)}
    ppo_final = float(np.mean([r["final_eval_accuracy"] for r in by_est["gae"]])) if "gae" in by_est else None
    ppo_end = float(mean_curve(by_est["gae"])[1][-1]) if "gae" in by_est else None  # same prompts as the curves
    rows = {e: _arm_row(e, rs, ppo_end) for e, rs in by_est.items()}
    pairs = []
    for a, b in combinations(rows, 2):
        pairs.append({"a": a, "b": b, **{
            key: paired_difference(dict(zip(rows[a]["seeds"], rows[a][f"{key}_per_seed"])),
                                   dict(zip(rows[b]["seeds"], rows[b][f"{key}_per_seed"])))
            for key in ("final", "area")}})
    return {"ppo_final_mean": ppo_final, "ppo_curve_end_mean": ppo_end, "estimators": rows,
            "paired_differences": pairs}


def write_results_json(path: str, runs: list[dict], meta: dict) -> None:
    keep = ("estimator", "seed", "final_eval_accuracy", "final_eval_samples", "curve_area", "steps", "curve",
            "greedy_curve", "final_greedy_accuracy", "wall_time_s", "final_threshold")
    slim = [{k: r[k] for k in keep if k in r} for r in runs]
    with open(path, "w") as f:
        json.dump({"runs": slim, "summary": summarise(runs), "meta": meta}, f, indent=1)


def _fmt(x, nd=3):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _pm(mean, se) -> str:
    return f"{_fmt(mean, 3)} +- {_fmt(se, 3)}" if se is not None else f"{_fmt(mean, 3)} (1 seed, no SE)"


def _terms(spec: Optional[dict]) -> str:
    if not spec or "min_terms" not in spec:
        return ""
    return f" ({spec['min_terms']}-{spec['max_terms']} terms per problem)"


def _header_lines(meta: dict) -> list[str]:
    return [
        "# GROUP-PPO demo: summary",
        "",
        f"Task `{meta.get('task')}`{_terms(meta.get('task_spec'))}, model `{meta.get('model_size')}`, "
        f"{meta.get('steps')} RL steps x {meta.get('prompts_per_step')} prompts x {meta.get('n_samples')} samples "
        f"(critic warm-up {meta.get('critic_warmup', 0)} steps), seeds {meta.get('seeds')}.",
        f"Periodic evals (the curves, step 0 to the last step): mean verifier reward of {meta.get('eval_samples')} "
        f"sampled responses (temperature 1) per prompt on the same {meta.get('eval_size')} held-out prompts. "
        f"Final eval (after the last step; 'final eval acc' below): the same on "
        f"{meta.get('final_eval_size', meta.get('eval_size'))} held-out prompts "
        f"({(meta.get('final_eval_size') or 0) * (meta.get('eval_samples') or 0)} samples). "
        "Curve area = mean accuracy over the periodic eval points (step 0 and the last step included).",
        f"Warm-start accuracy (sampled / greedy): {_fmt(meta.get('warmstart_eval_accuracy'))} / "
        f"{_fmt(meta.get('warmstart_greedy_accuracy'))}.",
        *_pretrain_line(meta.get("critic_pretrain") or {}),
        "",
    ]


def _pretrain_line(info: dict) -> list[str]:
    """One line on value pretraining (``meta.critic_pretrain``), or none without it."""
    if not info.get("history"):
        return []
    steps = info["history"][-1]["step"]
    return [f"Value pretraining: every critic arm starts from a critic trained alone for {steps} steps on the warm "
            f"start's samples; held-out explained variance {_fmt(info['heldout_explained_variance'])} before RL."]


def _arm_table(s: dict) -> list[str]:
    lines = ["| estimator | final eval acc (mean +- std) | per seed | curve area (mean +- std) | greedy acc | "
             "steps to PPO's final mean | wall time / run (s) |", "|---|---|---|---|---|---|---|"]
    for e, r in s["estimators"].items():
        per_seed = ", ".join(f"{v:.3f}" for v in r["final_per_seed"])
        reach = "never" if r["steps_to_ppo_final"] is None else f"{int(r['steps_to_ppo_final'])}"
        lines.append(f"| {_label(e)} | {r['final_mean']:.3f} +- {r['final_std']:.3f} | {per_seed} | "
                     f"{r['area_mean']:.3f} +- {r['area_std']:.3f} | {_fmt(r['greedy_final_mean'])} | {reach} | "
                     f"{r['wall_time_s_mean']:.0f} |")
    return lines + [""]


def _pair_table(s: dict) -> list[str]:
    if not s["paired_differences"]:
        return []
    lines = ["Paired differences over common seeds (mean +- paired standard error = std of the per-seed "
             "differences / sqrt(seeds)); verdict by the rule of docs/results.md (win: every seed's difference "
             "positive and the mean above 2 paired standard errors; lose: the mirror; else level), and the "
             "difference the rule detects with 80% power at the observed paired SD (simulated under the rule, "
             "benchmarks/stats.py):",
             "",
             "| difference | final eval acc | curve area | per seed (final) | per seed (area) | "
             "verdict (final / area) | 80%-detectable difference (final / area) |",
             "|---|---|---|---|---|---|---|"]
    for p in s["paired_differences"]:
        per_seed = ", ".join(f"{v:+.3f}" for v in p["final"]["per_seed"])
        per_seed_area = ", ".join(f"{v:+.3f}" for v in p["area"]["per_seed"])
        lines.append(f"| {_label(p['a'])} - {_label(p['b'])} | {_pm(p['final']['mean'], p['final']['se'])} | "
                     f"{_pm(p['area']['mean'], p['area']['se'])} | {per_seed} | {per_seed_area} | "
                     f"{verdict(p['final'])} / {verdict(p['area'])} | "
                     f"{_fmt(detectable_of(p['final']['per_seed']))} / "
                     f"{_fmt(detectable_of(p['area']['per_seed']))} |")
    return lines + [""]


def write_summary_md(path: str, runs: list[dict], meta: dict) -> str:
    s = summarise(runs)
    lines = _header_lines(meta) + _arm_table(s) + _pair_table(s)
    if s["ppo_final_mean"] is not None:
        lines.append(f"PPO's final mean accuracy: {s['ppo_final_mean']:.3f} (final eval); its mean curve ends at "
                     f"{s['ppo_curve_end_mean']:.3f}. 'Steps to PPO's final mean' is the first eval step at which "
                     "the estimator's mean curve reaches PPO's curve end (the same periodic-eval prompts).")
    for e, r in s["estimators"].items():
        if r.get("final_threshold_mean") is not None:
            lines.append(f"{_label(e)}: final adaptive threshold (mean over seeds) {r['final_threshold_mean']:.3f}.")
    if meta.get("total_wall_time_s") is not None:
        lines.append(f"Total wall time: {meta['total_wall_time_s'] / 60:.1f} min.")
    text = "\n".join(lines) + "\n"
    with open(path, "w") as f:
        f.write(text)
    return text


def plot_learning_curves(path: str, runs: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_est: dict[str, list[dict]] = {}
    for r in runs:
        by_est.setdefault(r["estimator"], []).append(r)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "curve", "eval accuracy (sampled, T=1)"),
                           (axes[1], "greedy_curve", "eval accuracy (greedy)")):
        for est, rs in by_est.items():
            if key not in rs[0]:
                continue
            steps, m, sd = mean_curve(rs, key)
            c = _color(est)
            ax.plot(steps, m, label=f"{_label(est)} (n={len(rs)})", color=c)
            ax.fill_between(steps, m - sd, m + sd, color=c, alpha=0.15)
        ax.set_xlabel("RL step")
        ax.set_ylabel("accuracy")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_groups_html(path: str, samples: list[dict], title: str = "GROUP-PPO groups") -> None:
    """The demo's recorded group samples (``{label, step, threshold, rows}``) through the shared renderer."""
    sections = [{"title": f"{smp.get('label', '')} step {smp['step']} (threshold tau = {smp['threshold']:.3f})",
                 "rows": smp["rows"]} for smp in samples]
    render.write_groups_html(path, sections, title)


def plot_groups_png(path: str, samples: list[dict], max_rows: int = 9) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    if not samples:
        return

    def groups_per_row(smp: dict) -> float:
        rs = smp["rows"][:max_rows]
        return sum(max(r["group_ids"] or [0]) for r in rs) / max(1, len(rs))

    # the recorded step whose responses have the most groups: the one that shows endpoints best
    smp = max(reversed(samples), key=groups_per_row)
    rows = [(smp, r) for r in smp["rows"][:max_rows]]
    if not rows:
        return
    width = max(len(r["tokens"]) for _, r in rows) + 9
    fig, ax = plt.subplots(figsize=(0.42 * width, 0.75 * len(rows) + 1.0))
    for y, (_, row) in enumerate(rows):
        yy = len(rows) - 1 - y
        ax.text(0, yy + 0.35, f"{row['prompt']}", fontsize=9, family="monospace", va="center")
        ax.text(0, yy + 0.0, f"r={row['reward']:.0f}", fontsize=8, va="center",
                color="#0a0" if row["reward"] > 0 else "#c00")
        gids = row["group_ids"]
        for i, (t, g, a) in enumerate(zip(row["tokens"], gids, row["advantages"])):
            x = 7 + i
            ax.add_patch(Rectangle((x, yy + 0.15), 0.95, 0.5, color=render.group_color(g)))
            ax.text(x + 0.47, yy + 0.4, "$" if t == "<eos>" else ("\u2423" if t == " " else t), ha="center",
                    va="center", fontsize=10, family="monospace")
            if i == 0 or gids[i - 1] != g:
                ax.text(x + 0.05, yy - 0.02, f"{a:+.2f}", fontsize=6.5, va="center",
                        color="#0a0" if a > 0 else "#c00")
            if i == len(gids) - 1 or gids[i + 1] != g:
                ax.plot([x + 0.97, x + 0.97], [yy + 0.12, yy + 0.68], color="black", lw=1.5)
    ax.set_xlim(0, width)
    ax.set_ylim(-0.4, len(rows))
    ax.axis("off")
    smp = rows[0][0]
    ax.set_title(f"GROUP-PPO groups at step {smp['step']} (tau={smp['threshold']:.2f}): colour = group, "
                 f"bar = endpoint, number = group advantage", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
