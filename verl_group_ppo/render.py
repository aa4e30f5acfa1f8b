"""The one HTML renderer of GROUP-PPO groups, shared by the demo (``groups.html``) and
``python -m verl_group_ppo.viz`` (a verl rollout dump).

Input: a list of *sections*, each ``{"title": str, "rows": [row, ...]}``. A row is one response over its
valid tokens (all lists of one length L):

* ``tokens``      - L token strings;
* ``group_ids``   - L ints, the 1-based group of each token;
* ``advantages``  - L floats, the (broadcast) advantage of each token;
* optional ``endpoints`` (L 0/1, 1 at a group's last token; derived from ``group_ids`` when absent),
  ``values`` (L floats, the critic's V before each token), ``reward`` (float), ``prompt`` and ``answer``
  (str), ``heading`` (str, replaces the prompt line).

Pure string building: no torch, no matplotlib.
"""

from __future__ import annotations

import html
from typing import Any, Optional, Sequence

GROUP_COLORS = ("#fde2e4", "#e2ece9", "#dfe7fd", "#fff1c1", "#e8dff5", "#d0f4de", "#fce1c8", "#cde7f0")

_STYLE = (
    "body{font-family:sans-serif;margin:20px} table{border-collapse:collapse;margin:4px 0 14px 0}",
    "td{border:1px solid #bbb;padding:2px 5px;text-align:center;font-family:monospace;font-size:14px}",
    "td.adv{font-size:10px;color:#333} .pos{color:#0a0} .neg{color:#c00} .ep{border-right:3px solid #000}",
)
_LEGEND = ("<p>Each row is one response. Cell colour = token group (contiguous tokens sharing one advantage); a "
           "thick right border marks a group endpoint. Second line: the group's advantage on its first token, "
           "where the critic's value is read; third line (when known): the critic's value V before the token. "
           "Reward 1 = verified correct.</p>")


def group_color(group_id: int) -> str:
    """Background colour of 1-based group ``group_id`` (cycles through :data:`GROUP_COLORS`)."""
    return GROUP_COLORS[(int(group_id) - 1) % len(GROUP_COLORS)]


def endpoint_flags(row: dict[str, Any]) -> list[bool]:
    """L booleans, True at a group's last token: the row's ``endpoints`` if given, else from ``group_ids``.

    Raises ValueError when the row's lists disagree in length.
    """
    gids = list(row["group_ids"])
    n = len(gids)
    for key in ("tokens", "advantages", "endpoints", "values"):
        if row.get(key) is not None and len(row[key]) != n:
            raise ValueError(f"row[{key!r}] has {len(row[key])} entries, row['group_ids'] has {n}")
    if row.get("endpoints") is not None:
        return [bool(e) for e in row["endpoints"]]
    return [i == n - 1 or gids[i + 1] != gids[i] for i in range(n)]


def _token_cell(token: str) -> str:
    if token == "<eos>":
        return "&lt;eos&gt;"
    return "&nbsp;" if token == " " else html.escape(token)


def _heading(row: dict[str, Any]) -> str:
    if row.get("heading") is not None:
        head = html.escape(str(row["heading"]))
    elif row.get("prompt") is not None:
        head = f"<b>{html.escape(str(row['prompt']))}</b>"
        if row.get("answer") is not None:
            head += f" (answer {html.escape(str(row['answer']))})"
    else:
        head = ""
    if row.get("reward") is not None:
        head += f" reward <b>{float(row['reward']):g}</b>"
    return f"<div>{head}</div>"


def row_html(row: dict[str, Any]) -> str:
    """One response as a three-line table: tokens coloured by group, group advantages, values (if any)."""
    gids = list(row["group_ids"])
    ends = endpoint_flags(row)
    ep = [" ep" if e else "" for e in ends]
    tokens = "".join(f"<td class='tok{ep[i]}' style='background:{group_color(g)}'>{_token_cell(t)}</td>"
                     for i, (t, g) in enumerate(zip(row["tokens"], gids)))
    advs = []
    for i, a in enumerate(row["advantages"]):
        first = i == 0 or ends[i - 1]
        sign = "pos" if a > 0 else "neg"
        advs.append(f"<td class='adv {sign}{ep[i]}'>{a:+.2f}</td>" if first else f"<td class='adv{ep[i]}'></td>")
    lines = [f"<tr>{tokens}</tr>", f"<tr>{''.join(advs)}</tr>"]
    if row.get("values") is not None:
        lines.append("<tr>" + "".join(f"<td class='adv'>{v:.2f}</td>" for v in row["values"]) + "</tr>")
    return _heading(row) + "<table>" + "".join(lines) + "</table>"


def groups_html(sections: Sequence[dict[str, Any]], title: str = "GROUP-PPO groups",
                intro: Optional[str] = None) -> str:
    """A complete HTML page: a heading per section, then one table per response (see module docstring)."""
    parts = ["<html><head><meta charset='utf-8'>", f"<title>{html.escape(title)}</title><style>",
             *_STYLE, "</style></head><body>", f"<h2>{html.escape(title)}</h2>", _LEGEND]
    if intro:
        parts.append(f"<p>{html.escape(intro)}</p>")
    for section in sections:
        parts.append(f"<h3>{html.escape(str(section.get('title', '')))}</h3>")
        parts.extend(row_html(row) for row in section["rows"])
    parts.append("</body></html>")
    return "\n".join(parts)


def write_groups_html(path: str, sections: Sequence[dict[str, Any]], title: str = "GROUP-PPO groups",
                      intro: Optional[str] = None) -> None:
    """Write :func:`groups_html` to ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(groups_html(sections, title, intro))
