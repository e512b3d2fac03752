"""The package builds without setuptools warnings and ships the CUDA kernel sources.

Runs setuptools' ``build_py`` (what ``pip install`` runs to collect the packages) on a copy
of the packaging files and the three packages, so nothing is written into the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("zcomm", "zcomm_cuda", "zero_runtime")


def test_build_is_quiet_and_ships_the_kernel_sources(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    for package in PACKAGES:
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    build = tmp_path / "build"
    result = subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q", "build_py", "-d",
                             str(build)], cwd=source, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stderr and "absent from the `packages`" not in result.stderr, result.stderr
    kernels = {p.name for p in (REPO / "zcomm_cuda" / "kernels").iterdir() if p.suffix in (".cu", ".cuh")}
    assert kernels and {p.name for p in (build / "zcomm_cuda" / "kernels").iterdir()} >= kernels
    assert sorted(p.name for p in build.iterdir()) == sorted(PACKAGES)  # bench/ and tests/ stay out
    # every module ships, those of sub-packages included
    for package in PACKAGES:
        ours = {p.relative_to(REPO).as_posix() for p in (REPO / package).rglob("*.py") if "__pycache__" not in p.parts}
        shipped = {p.relative_to(build).as_posix() for p in (build / package).rglob("*.py")}
        assert ours == shipped, sorted(ours ^ shipped)
