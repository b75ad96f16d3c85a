"""The wheel: everything under one `moectl` namespace, the data files inside it, and a
non-editable install that runs from outside the repository."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile

import pytest

from tests.paths import REPO


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation",
                            "-q", "-w", str(out)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    (path,) = out.glob("moectl-*.whl")
    return path


def test_wheel_installs_one_namespace_with_its_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"moectl", wheel.name.split("-py3")[0] + ".dist-info"}
    for shipped in ("moectl/engine/sample_model/model.safetensors", "moectl/engine/sample_model/tokenizer.json",
                    "moectl/engine/sample_model_dsv3/model.safetensors", "moectl/engine/sample_model_dsv3/config.json",
                    "moectl/engine/sample_model/config.json", "moectl/themes/moectl.tcss"):
        assert shipped in names
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "moectl = moectl.cli.main:main" in entry


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """The wheel installed (not editable) into its own folder; run with `python -S` so that the
    editable install in this virtualenv's site-packages is not on the path, only its dependencies."""
    target = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                           str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    deps = sysconfig.get_paths()["purelib"]

    def run(*args: str) -> subprocess.CompletedProcess:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(target), deps]), OMP_NUM_THREADS="1")
        return subprocess.run([sys.executable, "-S", *args], cwd=target.parent, env=env, capture_output=True,
                              text=True, timeout=300)
    return target, run


def test_installed_wheel_runs_from_outside_the_repo(installed):
    target, run = installed
    where = run("-c", "import moectl.engine, moectl.console; print(moectl.engine.__file__)")
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(str(target))
    assert run("-c", "import engine").returncode != 0  # nothing generic is importable
    helped = run("-m", "moectl.cli", "--help")
    assert helped.returncode == 0 and "generate" in helped.stdout, helped.stderr
    info = run("-m", "moectl.cli", "model", "info")
    assert info.returncode == 0 and "sample_model" in info.stdout and str(target) in info.stdout, info.stderr


def test_installed_wheel_generates_with_the_shipped_sample_model(installed):
    _, run = installed
    out = run("-m", "moectl.cli", "generate", "def f(", "--max-tokens", "8")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("def f(") and len(out.stdout.strip()) > len("def f(")
