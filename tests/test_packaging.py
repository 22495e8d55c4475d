"""Packaging: the repo's kernels/ and conf/ ship inside flashtrain (never as top-level packages), a built wheel
holds every module and config, and the console entry point trains from the installed configs."""

import importlib.util
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import flashtrain
import flashtrain.kernels

REPO = Path(__file__).resolve().parents[1]
# repo folder -> the package it ships as
SHIPPED = {"flashtrain": "flashtrain", "kernels": "flashtrain/kernels", "conf": "flashtrain/conf"}


def test_kernels_ship_inside_flashtrain():
    assert Path(flashtrain.kernels.__file__).resolve().parent == REPO / "kernels"
    assert flashtrain.kernels.__name__ == "flashtrain.kernels"


def test_no_top_level_kernels_or_conf_from_this_repo():
    """`import kernels` / `import conf` never finds the repo's folders (PyPI's unrelated `kernels` may be installed,
    inside the repo's .venv too: that is not ours)."""
    for name in ("kernels", "conf"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            assert Path(spec.origin).resolve().parent != REPO / name, f"top-level {name!r} resolves to the repo's"


def _expected_files() -> set[str]:
    """The wheel paths of every module and config in the repo's shipped folders."""
    expected = set()
    for folder, package in SHIPPED.items():
        for path in (REPO / folder).rglob("*"):
            if path.suffix in (".py", ".yaml") and "__pycache__" not in path.parts:
                expected.add(f"{package}/{path.relative_to(REPO / folder).as_posix()}")
    return expected


@pytest.mark.slow
def test_wheel_holds_every_module_and_config(tmp_path):
    """``pip wheel .`` (what ``pip install .`` installs): every module of flashtrain, flashtrain.kernels (with its
    kernel families), flashtrain.integrations and flashtrain.conf; nothing top-level but flashtrain; the console
    entry point; numpy<2.4 as a runtime dependency and the trainer's packages as the ``train`` extra."""
    # built here without network, so without build isolation: setuptools makes wheels alone from 70.1, with the
    # `wheel` package (the test extra) before
    setuptools = pytest.importorskip("setuptools", minversion="64")
    if tuple(int(p) for p in setuptools.__version__.split(".")[:2]) < (70, 1):
        pytest.importorskip("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(REPO)], check=True, capture_output=True, text=True)
    (wheel,) = tmp_path.glob("flashtrain-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert _expected_files() <= names, sorted(_expected_files() - names)
    assert {n.split("/")[0] for n in names} == {"flashtrain", wheel.name.split("-py3")[0] + ".dist-info"}
    assert "flashtrain/kernels/hopper/fp8_fwd.py" in names and "flashtrain/integrations/transformers.py" in names
    info = wheel.name.split("-py3")[0] + ".dist-info"
    zf = zipfile.ZipFile(wheel)
    assert "flashtrain-train = flashtrain.trainer.cli:main" in zf.read(f"{info}/entry_points.txt").decode()
    requires = [line for line in zf.read(f"{info}/METADATA").decode().splitlines() if line.startswith("Requires-Dist")]
    assert "Requires-Dist: numpy<2.4" in requires
    assert any(line.startswith("Requires-Dist: lightning") and 'extra == "train"' in line for line in requires)


@pytest.mark.slow
def test_console_entry_point_composes_the_packaged_configs(tmp_path):
    """``flashtrain-train --cfg job`` (its module, as the console script runs it) prints the config composed from
    the installed ``flashtrain.conf``, with overrides, from any working directory."""
    command = [sys.executable, "-c", "from flashtrain.trainer.cli import main; main()", "--cfg", "job", "--resolve",
               "attn=flash", "seq_len=4k"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "name: flash" in result.stdout and "seq_len: 4096" in result.stdout
