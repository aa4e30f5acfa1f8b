"""``python -m verl_group_ppo.viz``: render a GROUP-PPO group dump (DIR/{step}.groups.jsonl) to HTML."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from verl_group_ppo import render, viz


def _record(step: int, uid: str, n_groups: int, score: float = 1.0) -> dict:
    """A response of 2 tokens per group; token strings name their step, uid and position."""
    tokens = [f"s{step}{uid}t{i}" for i in range(2 * n_groups)]
    group_ids = [1 + i // 2 for i in range(len(tokens))]
    return {"step": step, "uid": uid, "score": score, "tokens": tokens, "group_ids": group_ids,
            "advantages": [0.5 - g for g in group_ids], "endpoints": [i % 2 for i in range(len(tokens))]}


def _write_dump(directory, steps=(10, 20), uids=("b", "a", "c")) -> dict[int, list[dict]]:
    os.makedirs(directory, exist_ok=True)
    dump = {}
    for step in steps:
        dump[step] = [_record(step, uid, n_groups=k + 1) for k, uid in enumerate(uids)]
        with open(os.path.join(directory, f"{step}.groups.jsonl"), "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in dump[step]))
        with open(os.path.join(directory, f"{step}.jsonl"), "w") as f:  # verl's own dump sits beside it
            f.write(json.dumps({"input": "x", "output": "y", "score": 1.0}) + "\n")
    return dump


def test_default_renders_the_last_step_only(tmp_path):
    _write_dump(tmp_path / "dump")
    out = tmp_path / "groups.html"
    assert viz.main([str(tmp_path / "dump"), "--output", str(out)]) == 0
    page = out.read_text()
    assert "step 20: 3 of 3 responses" in page and "s20at0" in page
    assert "step 10" not in page and "s10" not in page
    # responses ordered by uid, each group's advantage shown once, on its first token
    assert page.index("uid a") < page.index("uid b") < page.index("uid c")
    assert page.count("+0.50") == 0 and page.count("-0.50") == 3  # group 1 of each response: 0.5 - 1


def test_steps_and_max_responses(tmp_path):
    _write_dump(tmp_path / "dump")
    out = tmp_path / "g.html"
    assert viz.main([str(tmp_path / "dump"), "-o", str(out), "--steps", "all", "--max-responses", "2"]) == 0
    page = out.read_text()
    assert "step 10: 2 of 3 responses" in page and "step 20: 2 of 3 responses" in page
    assert "uid c" not in page
    viz.main([str(tmp_path / "dump"), "-o", str(out), "--steps", "10"])
    assert "step 10: 3 of 3 responses" in out.read_text() and "step 20" not in out.read_text()


def test_padding_rows_are_counted_not_drawn(tmp_path):
    d = tmp_path / "dump"
    _write_dump(d, steps=(3,), uids=("a",))
    with open(d / "3.groups.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "uid": "pad", "score": 0.0, "tokens": [], "group_ids": [], "advantages": [],
                            "endpoints": []}) + "\n")
    viz.main([str(d), "-o", str(tmp_path / "g.html")])
    page = (tmp_path / "g.html").read_text()
    assert "step 3: 1 of 2 responses" in page and "uid pad" not in page


def test_endpoints_from_the_dump_mark_group_ends(tmp_path):
    rec = _record(5, "u", n_groups=3)
    rec["tokens"][0] = "<x&y>"  # token text is escaped
    row = viz.response_row(rec, "here")
    html = render.row_html(row)
    assert html.count("class='tok ep'") == 3 and "&lt;x&amp;y&gt;" in html
    rec["endpoints"] = [1] * 6  # the dump's endpoints are drawn as given
    assert render.row_html(viz.response_row(rec, "here")).count("class='tok ep'") == 6
    del rec["endpoints"]  # absent: derived from the group ids
    assert render.row_html(viz.response_row(rec, "here")).count("class='tok ep'") == 3


def test_demo_and_viz_share_the_renderer(tmp_path):
    from experiments.demo import report

    row = {"prompt": "1+2=", "answer": "3", "reward": 1.0, "tokens": ["3", " ", "#", "3", "<eos>"],
           "group_ids": [1, 1, 2, 2, 2], "advantages": [0.25, 0.25, -0.5, -0.5, -0.5],
           "values": [0.1, 0.2, 0.3, 0.4, 0.5]}
    path = tmp_path / "demo.html"
    report.write_groups_html(str(path), [{"label": "group_ppo seed 0", "step": 3, "threshold": 1.5, "rows": [row]}])
    page = path.read_text()
    assert render.row_html(row) in page and "threshold tau = 1.500" in page and "&lt;eos&gt;" in page


@pytest.mark.parametrize("setup, message", [
    (lambda d: None, "does not exist"),
    (lambda d: os.makedirs(d), "holds no {step}.groups.jsonl"),
    (lambda d: _write_dump(d, uids=()), "holds no response"),
])
def test_clear_errors_for_missing_or_empty_dumps(tmp_path, capsys, setup, message):
    directory = str(tmp_path / "dump")
    setup(directory)
    with pytest.raises(SystemExit) as e:
        viz.main([directory, "-o", str(tmp_path / "x.html")])
    assert e.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.html").exists()


def test_bad_steps_and_bad_records(tmp_path, capsys):
    d = tmp_path / "dump"
    _write_dump(d)
    with pytest.raises(SystemExit):
        viz.main([str(d), "-o", str(tmp_path / "x.html"), "--steps", "15"])
    assert "available: [10, 20]" in capsys.readouterr().err
    with open(d / "30.groups.jsonl", "w") as f:
        f.write(json.dumps({"uid": "a", "tokens": ["x"], "group_ids": [1, 1], "advantages": [0.0, 0.0]}) + "\n")
    with pytest.raises(SystemExit):
        viz.main([str(d), "-o", str(tmp_path / "x.html")])
    assert "'tokens' has 1 entries" in capsys.readouterr().err
    with open(d / "30.groups.jsonl", "w") as f:
        f.write(json.dumps({"uid": "a", "tokens": ["x"]}) + "\n")
    with pytest.raises(SystemExit):
        viz.main([str(d), "-o", str(tmp_path / "x.html")])
    assert "lacks key(s) ['group_ids', 'advantages']" in capsys.readouterr().err


@pytest.mark.slow
def test_runs_as_a_module(tmp_path):
    _write_dump(tmp_path / "dump")
    out = tmp_path / "groups.html"
    proc = subprocess.run([sys.executable, "-m", "verl_group_ppo.viz", str(tmp_path / "dump"), "--output", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "step(s) [20]" in proc.stdout and "s20cT5" not in out.read_text() and "s20ct5" in out.read_text()
