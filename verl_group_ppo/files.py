"""Atomic file writes: a reader never sees half a file or half a folder.

:func:`write_file` is the package's one way to put a file in place (a temporary file beside it, then
``os.replace``); :func:`write_json` and :func:`write_parquet` write through it, and :func:`replace_dir` does the same
for a folder. The tasks' prepared directories (:mod:`verl_group_ppo.tasks.contract`), the warm-start caches and the
plugin's records use them. It imports nothing else of the package.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable, Mapping, Sequence


def write_file(path: str, write: Callable[[str], None]) -> str:
    """``write(tmp)`` writes a temporary file beside ``path`` (its folder created), which then replaces ``path``: a
    reader never sees half a file. Returns ``path``."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    write(tmp)
    os.replace(tmp, path)
    return path


def write_json(path: str, data: Any) -> str:
    """Write ``data`` as indented JSON through :func:`write_file`."""
    def dump(tmp: str) -> None:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2)

    return write_file(path, dump)


def write_parquet(path: str, rows: Sequence[Mapping[str, Any]]) -> str:
    """Write ``rows`` (one dict per row) as a parquet file through :func:`write_file`."""
    import pandas as pd

    return write_file(path, pd.DataFrame(list(rows)).to_parquet)


def replace_dir(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` fills a fresh temporary folder beside ``path``, which then replaces ``path``."""
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
