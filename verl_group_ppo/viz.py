"""``python -m verl_group_ppo.viz DIR --output groups.html``: draw GROUP-PPO groups from a verl rollout dump.

The trainer glue writes, per training step and beside verl's own ``{step}.jsonl`` rollout dump, a file
``DIR/{step}.groups.jsonl`` with one JSON object per response, over its valid response tokens::

    {"step": int, "uid": str, "score": float, "tokens": [str, ...], "group_ids": [int, ...],
     "advantages": [float, ...], "endpoints": [0/1, ...]}

This tool renders the chosen steps (default: the last) with the project's one group renderer
(:mod:`verl_group_ppo.render`, the same as the demo's ``groups.html``): tokens coloured by group, group
endpoints marked, each group's advantage under its first token.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any, Optional, Sequence

from .render import write_groups_html

_DUMP_NAME = re.compile(r"^(\d+)\.groups\.jsonl$")
REQUIRED_KEYS = ("tokens", "group_ids", "advantages")


def find_dumps(directory: str) -> dict[int, str]:
    """``{step: path}`` of every ``{step}.groups.jsonl`` in ``directory``.

    Raises ValueError when ``directory`` is missing, not a directory, or holds no such file.
    """
    if not os.path.exists(directory):
        raise ValueError(f"DIR {directory!r} does not exist")
    if not os.path.isdir(directory):
        raise ValueError(f"DIR {directory!r} is not a directory")
    found = {int(m.group(1)): os.path.join(directory, name)
             for name in os.listdir(directory) if (m := _DUMP_NAME.match(name))}
    if not found:
        raise ValueError(f"DIR {directory!r} holds no {{step}}.groups.jsonl file (the GROUP-PPO group dump "
                         "written beside verl's {step}.jsonl rollout dump)")
    return found


def choose_steps(available: Sequence[int], wanted: str) -> list[int]:
    """``"last"`` -> the last step, ``"all"`` -> every step, ``"10,20"`` -> those (each must exist)."""
    steps = sorted(available)
    if wanted == "last":
        return steps[-1:]
    if wanted == "all":
        return steps
    try:
        chosen = [int(x) for x in wanted.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--steps expects 'last', 'all' or a comma list of steps, got {wanted!r}") from None
    missing = [s for s in chosen if s not in available]
    if missing or not chosen:
        raise ValueError(f"--steps: step(s) {missing or wanted!r} not in the dump; available: {steps}")
    return chosen


def response_row(obj: dict[str, Any], where: str) -> dict[str, Any]:
    """One dump record -> one renderer row (``heading`` from the uid, ``reward`` from the score)."""
    missing = [k for k in REQUIRED_KEYS if k not in obj]
    if missing:
        raise ValueError(f"{where}: record lacks key(s) {missing}")
    n = len(obj["group_ids"])
    for key in ("tokens", "advantages", "endpoints"):
        if obj.get(key) is not None and len(obj[key]) != n:
            raise ValueError(f"{where}: {key!r} has {len(obj[key])} entries, 'group_ids' has {n}")
    return {"heading": f"uid {obj.get('uid', '?')}", "reward": obj.get("score"), "tokens": obj["tokens"],
            "group_ids": obj["group_ids"], "advantages": obj["advantages"], "endpoints": obj.get("endpoints")}


def read_step(path: str, max_responses: Optional[int]) -> tuple[list[dict[str, Any]], int]:
    """(rows ordered by uid, at most ``max_responses`` of them; the number of responses in the file).

    Responses with no valid token (verl's padding rows) are counted but not drawn."""
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                records.append((line_no, json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not JSON ({e})") from None
    if not records:
        raise ValueError(f"{path} holds no response")
    records.sort(key=lambda r: str(r[1].get("uid", "")))  # responses to one prompt side by side (stable)
    drawable = [r for r in records if r[1].get("tokens") != []]
    keep = drawable if max_responses is None else drawable[:max_responses]
    return [response_row(obj, f"{path}:{line_no}") for line_no, obj in keep], len(records)


def render_dump(directory: str, output: str, steps: str = "last", max_responses: Optional[int] = 32) -> list[int]:
    """Render the chosen steps of the dump in ``directory`` to ``output``; returns the steps drawn."""
    dumps = find_dumps(directory)
    chosen = choose_steps(list(dumps), steps)
    sections = []
    for step in chosen:
        rows, total = read_step(dumps[step], max_responses)
        sections.append({"title": f"step {step}: {len(rows)} of {total} responses", "rows": rows})
    write_groups_html(output, sections, title=f"GROUP-PPO groups: {os.path.basename(os.path.abspath(directory))}")
    return chosen


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m verl_group_ppo.viz",
                                description="Render the GROUP-PPO groups of a verl rollout dump "
                                            "(DIR/{step}.groups.jsonl) as HTML.")
    p.add_argument("dir", metavar="DIR", help="the rollout dump folder (trainer.rollout_data_dir)")
    p.add_argument("--output", "-o", default="groups.html", help="HTML file to write (default: groups.html)")
    p.add_argument("--steps", default="last", help="'last' (default), 'all' or a comma list of steps")
    p.add_argument("--max-responses", type=int, default=32,
                   help="responses drawn per step, ordered by uid (default 32; 0 = all)")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_responses < 0:
        parser.error(f"--max-responses must be >= 0, got {args.max_responses}")
    try:
        drawn = render_dump(args.dir, args.output, args.steps, args.max_responses or None)
    except ValueError as e:
        parser.error(str(e))
    print(f"[viz] step(s) {drawn} -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
