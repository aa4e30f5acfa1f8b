#!/usr/bin/env python3
"""Install an offline bundle made by ``scripts/make_offline_bundle.py`` on a node with no network.

Run it from the folder the bundle was copied into, with the Python that has the node's CUDA torch::

    python3 offline_install.py                      # into that Python's environment
    python3 offline_install.py --target ~/verl-site # or into a folder for PYTHONPATH

In one step it checks every part against ``manifest.json`` (sha256), joins the parts of each split file and
checks the whole file, unpacks the bundle, and installs its wheels with ``pip install --no-index --no-deps``.
Files added with ``--include-file`` (the SmolLM2 GGUF, say) are left, whole and checked, in ``--files-to``.
Only the standard library and pip are used.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any, Optional, Sequence

MANIFEST_NAME = "manifest.json"
"""The bundle folder's table of files, their parts and their sha256 digests."""

CHUNK_BYTES = 1 << 20
"""Files are hashed and joined this many bytes at a time."""


class BundleCheckError(RuntimeError):
    """A part or a file of the bundle is missing or does not match its sha256 in ``manifest.json``."""


def sha256_of(path: Path) -> str:
    """The hex sha256 digest of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(CHUNK_BYTES), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_file(path: Path, expected_sha256: str) -> None:
    """Raise :class:`BundleCheckError` naming ``path`` when it is missing or its sha256 differs."""
    if not path.is_file():
        raise BundleCheckError(f"{path.name}: missing from {path.parent} (copy every file of the bundle folder)")
    found = sha256_of(path)
    if found != expected_sha256:
        raise BundleCheckError(f"{path.name}: sha256 {found} does not match {expected_sha256} in {MANIFEST_NAME} "
                               "(the copy is corrupt or incomplete; copy it again)")


def reassemble(folder: Path, entry: dict[str, Any]) -> Path:
    """Check one manifest entry's parts, join them into the whole file (when split) and check it; returns it.

    ``entry``: ``{"name", "sha256", "parts": [{"name", "sha256"}, ...]}`` (no parts: the file is whole).
    """
    whole = folder / entry["name"]
    parts = entry.get("parts") or []
    for part in parts:
        check_file(folder / part["name"], part["sha256"])
    if parts:
        with open(whole, "wb") as out:
            for part in parts:
                with open(folder / part["name"], "rb") as handle:
                    shutil.copyfileobj(handle, out, CHUNK_BYTES)
    check_file(whole, entry["sha256"])
    return whole


def read_manifest(folder: Path) -> dict[str, Any]:
    """The bundle folder's ``manifest.json``."""
    path = folder / MANIFEST_NAME
    if not path.is_file():
        raise BundleCheckError(f"{MANIFEST_NAME} is missing from {folder}: run this script from the bundle folder")
    return json.loads(path.read_text())


def unpack(archive: Path, into: Path) -> Path:
    """Extract the bundle's ``.tar.xz`` into ``into``; returns the folder of its wheels."""
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:xz") as tar:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4: refuse links and paths that leave ``into``
            tar.extractall(into, filter="data")
        else:
            tar.extractall(into)
    return into / "wheels"


def pip_install_command(wheels: Sequence[Path], target: Optional[Path], python: str) -> list[str]:
    """The pip command that installs ``wheels`` with no index and no dependency resolution."""
    command = [python, "-m", "pip", "install", "--no-index", "--no-deps", "--disable-pip-version-check"]
    if target is not None:
        command += ["--target", str(target), "--upgrade"]
    return command + [str(wheel) for wheel in wheels]


def install(folder: Path, target: Optional[Path], files_to: Optional[Path], python: str,
            dry_run: bool = False) -> list[str]:
    """Check, join, unpack and install the bundle in ``folder``; returns the pip command it ran."""
    manifest = read_manifest(folder)
    wholes = {entry["name"]: reassemble(folder, entry) for entry in manifest["files"]}
    wheels_dir = unpack(wholes[manifest["bundle"]], folder / "unpacked")
    wheels = sorted(wheels_dir.glob("*.whl"))
    if not wheels:
        raise BundleCheckError(f"{manifest['bundle']} holds no wheels")
    extra = [name for name in wholes if name != manifest["bundle"]]
    if extra:
        destination = files_to or folder / "files"
        destination.mkdir(parents=True, exist_ok=True)
        for name in extra:
            if wholes[name].parent.resolve() != destination.resolve():
                shutil.move(str(wholes[name]), destination / name)
            print(f"[offline-install] {name} -> {destination / name}")
    command = pip_install_command(wheels, target, python)
    if not dry_run:
        subprocess.run(command, check=True)
    print(f"[offline-install] installed {len(wheels)} wheels" + (f" into {target}" if target else ""))
    if target is not None:
        print(f"[offline-install] use them with: export PYTHONPATH={target}:$PYTHONPATH")
    return command


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folder", type=Path, default=Path(__file__).resolve().parent,
                        help="the bundle folder (default: this script's folder)")
    parser.add_argument("--target", type=Path, default=None,
                        help="install into this folder (pip --target) instead of the running environment")
    parser.add_argument("--files-to", type=Path, default=None,
                        help="where the bundle's extra files go (default: FOLDER/files)")
    parser.add_argument("--python", default=sys.executable, help="the Python whose pip installs (default: this one)")
    args = parser.parse_args(argv)
    try:
        install(args.folder, args.target, args.files_to, args.python)
    except BundleCheckError as exc:
        sys.exit(f"[offline-install] {exc}")


if __name__ == "__main__":
    main()
