"""Outputs of the demo: results.json, summary.md, learning_curves.png, groups.html and groups.png."""

from __future__ import annotations

import html
import json
import math
from typing import Any

import numpy as np

LABELS = {
    "group_ppo": "GROUP-PPO",
    "group_ppo_all_tokens": "GROUP-PPO (critic on all tokens)",
    "gae": "PPO (GAE)",
    "grpo": "GRPO",
}
COLORS = {"group_ppo": "#d62728", "group_ppo_all_tokens": "#ff7f0e", "gae": "#1f77b4", "grpo": "#2ca02c"}


def mean_curve(runs: list[dict], key: str = "curve") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Steps, mean and std over seeds of an eval curve (runs share their eval steps)."""
    steps = np.array([s for s, _ in runs[0][key]], dtype=float)
    vals = np.array([[v for _, v in r[key]] for r in runs], dtype=float)
    return steps, vals.mean(0), vals.std(0)


def steps_to_reach(steps: np.ndarray, curve: np.ndarray, target: float) -> float | None:
    """First eval step at which ``curve`` is >= ``target`` (None if never)."""
    for s, v in zip(steps, curve):
        if v >= target - 1e-12:
            return float(s)
    return None


def summarise(runs: list[dict]) -> dict[str, Any]:
    by_est: dict[str, list[dict]] = {}
    for r in runs:
        by_est.setdefault(r["estimator"], []).append(r)
    ppo_final = None
    if "gae" in by_est:
        ppo_final = float(np.mean([r["final_eval_accuracy"] for r in by_est["gae"]]))
    rows = {}
    for est, rs in by_est.items():
        rs = sorted(rs, key=lambda r: r["seed"])
        finals = [r["final_eval_accuracy"] for r in rs]
        steps, m, _ = mean_curve(rs)
        rows[est] = {
            "estimator": est,
            "seeds": [r["seed"] for r in rs],
            "final_mean": float(np.mean(finals)),
            "final_std": float(np.std(finals)),
            "final_per_seed": finals,
            "start_mean": float(m[0]),
            "greedy_final_mean": float(np.mean([r.get("final_greedy_accuracy", float("nan")) for r in rs])),
            "steps_to_ppo_final": steps_to_reach(steps, m, ppo_final) if ppo_final is not None else None,
            "wall_time_s_mean": float(np.mean([r["wall_time_s"] for r in rs])),
            "final_threshold_mean": (float(np.mean([r["final_threshold"] for r in rs]))
                                     if rs[0].get("final_threshold") is not None else None),
        }
    return {"ppo_final_mean": ppo_final, "estimators": rows}


def write_results_json(path: str, runs: list[dict], meta: dict) -> None:
    slim = []
    for r in runs:
        slim.append({k: r[k] for k in ("estimator", "seed", "final_eval_accuracy", "steps", "curve", "greedy_curve",
                                       "final_greedy_accuracy", "wall_time_s", "final_threshold") if k in r})
    with open(path, "w") as f:
        json.dump({"runs": slim, "summary": summarise(runs), "meta": meta}, f, indent=1)


def _fmt(x, nd=3):
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def write_summary_md(path: str, runs: list[dict], meta: dict) -> str:
    s = summarise(runs)
    order = [e for e in ("group_ppo", "group_ppo_all_tokens", "gae", "grpo") if e in s["estimators"]]
    lines = [
        "# GROUP-PPO demo: summary",
        "",
        f"Task `{meta.get('task')}`, model `{meta.get('model_size')}`, {meta.get('steps')} RL steps x "
        f"{meta.get('prompts_per_step')} prompts x {meta.get('n_samples')} samples, seeds {meta.get('seeds')}.",
        f"Eval: mean verifier reward of {meta.get('eval_samples')} sampled responses (temperature 1) per prompt "
        f"on {meta.get('eval_size')} held-out prompts; greedy accuracy alongside.",
        f"Warm-start accuracy (sampled / greedy): {_fmt(meta.get('warmstart_eval_accuracy'))} / "
        f"{_fmt(meta.get('warmstart_greedy_accuracy'))}.",
        "",
        "| estimator | final eval acc (mean +- std) | per seed | greedy acc | steps to PPO's final mean | wall time / run (s) |",
        "|---|---|---|---|---|---|",
    ]
    for e in order:
        r = s["estimators"][e]
        per_seed = ", ".join(f"{v:.3f}" for v in r["final_per_seed"])
        reach = "never" if r["steps_to_ppo_final"] is None else f"{int(r['steps_to_ppo_final'])}"
        lines.append(f"| {LABELS.get(e, e)} | {r['final_mean']:.3f} +- {r['final_std']:.3f} | {per_seed} | "
                     f"{_fmt(r['greedy_final_mean'])} | {reach} | {r['wall_time_s_mean']:.0f} |")
    lines.append("")
    if s["ppo_final_mean"] is not None:
        lines.append(f"PPO's final mean accuracy: {s['ppo_final_mean']:.3f}. 'Steps to PPO's final mean' is the first eval "
                     f"step at which the estimator's mean curve reaches it.")
    for e in order:
        if s["estimators"][e].get("final_threshold_mean") is not None:
            lines.append(f"{LABELS.get(e, e)}: final adaptive threshold (mean over seeds) "
                         f"{s['estimators'][e]['final_threshold_mean']:.3f}.")
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
            c = COLORS.get(est)
            ax.plot(steps, m, label=f"{LABELS.get(est, est)} (n={len(rs)})", color=c)
            ax.fill_between(steps, m - sd, m + sd, color=c, alpha=0.15)
        ax.set_xlabel("RL step")
        ax.set_ylabel("accuracy")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_GROUP_COLORS = ["#fde2e4", "#e2ece9", "#dfe7fd", "#fff1c1", "#e8dff5", "#d0f4de", "#fce1c8", "#cde7f0"]


def write_groups_html(path: str, samples: list[dict], title: str = "GROUP-PPO groups") -> None:
    """Each sampled response token by token; background colour = group; a group's advantage under it."""
    parts = [f"<html><head><meta charset='utf-8'><title>{html.escape(title)}</title><style>",
             "body{font-family:sans-serif;margin:20px} table{border-collapse:collapse;margin:4px 0 14px 0}",
             "td{border:1px solid #bbb;padding:2px 5px;text-align:center;font-family:monospace;font-size:14px}",
             "td.adv{font-size:10px;color:#333} .pos{color:#0a0} .neg{color:#c00} .ep{border-right:3px solid #000}",
             "</style></head><body>",
             f"<h2>{html.escape(title)}</h2>",
             "<p>Each row is one sampled response. Cell colour = token group (contiguous tokens sharing one "
             "advantage); a thick right border marks a group endpoint. Second line: the group's advantage "
             "(after normalisation) on its first token, where the critic's value is read; third line: the "
             "critic's value V before the token. Reward 1 = verified correct.</p>"]
    for smp in samples:
        parts.append(f"<h3>{html.escape(smp.get('label', ''))} step {smp['step']} "
                     f"(threshold tau = {smp['threshold']:.3f})</h3>")
        for row in smp["rows"]:
            parts.append(f"<div><b>{html.escape(row['prompt'])}</b> (answer {html.escape(row['answer'])}) "
                         f"reward <b>{row['reward']:.0f}</b></div><table><tr>")
            gids = row["group_ids"]
            for i, (t, g) in enumerate(zip(row["tokens"], gids)):
                last = i == len(gids) - 1 or gids[i + 1] != g
                cls = " class='ep'" if last else ""
                shown = "&lt;eos&gt;" if t == "<eos>" else ("&nbsp;" if t == " " else html.escape(t))
                parts.append(f"<td{cls} style='background:{_GROUP_COLORS[(g - 1) % len(_GROUP_COLORS)]}'>{shown}</td>")
            parts.append("</tr><tr>")
            for i, (a, g) in enumerate(zip(row["advantages"], gids)):
                first = i == 0 or gids[i - 1] != g
                last = i == len(gids) - 1 or gids[i + 1] != g
                cls = "adv " + ("pos" if a > 0 else "neg") + (" ep" if last else "")
                parts.append(f"<td class='{cls}'>{a:+.2f}</td>" if first else f"<td class='adv{' ep' if last else ''}'></td>")
            parts.append("</tr><tr>")
            for v in row["values"]:
                parts.append(f"<td class='adv'>{v:.2f}</td>")
            parts.append("</tr></table>")
    parts.append("</body></html>")
    with open(path, "w") as f:
        f.write("\n".join(parts))


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
            ax.add_patch(Rectangle((x, yy + 0.15), 0.95, 0.5, color=_GROUP_COLORS[(g - 1) % len(_GROUP_COLORS)]))
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
