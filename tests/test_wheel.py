"""The wheel works outside the repo: it is built, installed into a fresh venv in a temporary folder, and run from
there. The demo's and calibration's documents and questions ship inside the package (ragcache/data)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.real_model


def run(*args, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{args}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def test_the_wheel_runs_the_demo_and_calibrate_outside_the_repo(tmp_path):
    source = tmp_path / "source"  # setuptools writes build/ beside the sources: not into the checkout
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "build", "*.egg-info", "__pycache__", "results"))
    built = run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v", "-w",
                tmp_path / "dist", source, cwd=tmp_path)
    # the package data is declared as setuptools expects: a first install prints none of its warnings about it
    assert "absent from the `packages` configuration" not in built.stdout + built.stderr
    [wheel] = (tmp_path / "dist").glob("ragcache-*.whl")
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    run(venv / "bin" / "python", "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel, cwd=tmp_path)
    # the dependencies come from this environment's site-packages, added as a plain path: its .pth files (this
    # checkout's editable install among them) are not read, so `ragcache` is the wheel's
    (Path(run(venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
              cwd=tmp_path).stdout.strip()) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}
    where = run(venv / "bin" / "python", "-c", "import ragcache; print(ragcache.__file__)", cwd=tmp_path, env=env)
    assert where.stdout.strip().startswith(str(venv)), where.stdout
    assert "--target" in run(venv / "bin" / "ragcache", "calibrate", "--help", cwd=tmp_path, env=env).stdout
    demo = run(venv / "bin" / "ragcache", "demo", "--questions", "1", cwd=tmp_path, env=env)
    assert "focus" in demo.stdout and "full" in demo.stdout and "TTFT" in demo.stdout
    assert (tmp_path / ".ragcache").is_dir()  # the default store, under the folder it ran in
