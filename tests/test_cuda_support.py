"""The GPU markers of cuda_support: skip where the requirement is missing, fail under ZCOMM_GPU_CHECK=1.

A throwaway test module using ``requires_gpu`` and ``requires_nvrtc`` in every way a mark
is used (decorator, ``pytestmark``, ``pytest.param``) runs in a pytest subprocess, with and
without the variable. Where a requirement is met here its tests must pass either way.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cuda_support import GPU_CHECK_VARIABLE, GPU_UNAVAILABLE, NVRTC_UNAVAILABLE, REPO

TESTS = Path(__file__).resolve().parent

GPU_MODULE = """
import pytest
from cuda_support import requires_gpu

pytestmark = requires_gpu

def test_module_marked():
    pass
"""

MIXED_MODULE = """
import pytest
from cuda_support import requires_gpu, requires_nvrtc

@requires_gpu
def test_gpu_decorated():
    pass

@pytest.mark.parametrize("x", [pytest.param(1, marks=requires_gpu)])
def test_gpu_param(x):
    pass

@requires_nvrtc
def test_nvrtc_decorated():
    pass
"""


def _outcomes(tmp_path: Path, gpu_check: bool) -> tuple[dict[str, str], str]:
    """Each listed test's outcome (PASSED / FAILED / ERROR) and the whole output."""
    (tmp_path / "test_gpu_module.py").write_text(GPU_MODULE)
    (tmp_path / "test_mixed_module.py").write_text(MIXED_MODULE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop(GPU_CHECK_VARIABLE, None)
    if gpu_check:
        env[GPU_CHECK_VARIABLE] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )
    # -rA lists passed, failed and errored tests by node id (skipped ones by location only)
    found = re.findall(r"^(PASSED|FAILED|ERROR) (\S+)", done.stdout, re.M)
    return {test.split("::")[-1]: status for status, test in found}, done.stdout


def _expect(outcomes: dict[str, str], output: str, names: list[str], reason: str | None, gpu_check: bool) -> None:
    if reason is None:
        assert all(outcomes.get(name) == "PASSED" for name in names), output
    elif gpu_check:
        assert all(outcomes.get(name) in ("FAILED", "ERROR") for name in names), output
        assert f"{GPU_CHECK_VARIABLE}=1" in output and reason in output, output
    else:
        assert not any(name in outcomes for name in names), output  # skipped (listed by location)
        assert reason in output, output


@pytest.mark.parametrize("gpu_check", (False, True), ids=("plain", "gpu-check"))
def test_markers_skip_or_fail(tmp_path, gpu_check):
    outcomes, output = _outcomes(tmp_path, gpu_check)
    gpu_tests = ["test_module_marked", "test_gpu_decorated", "test_gpu_param[1]"]
    _expect(outcomes, output, gpu_tests, GPU_UNAVAILABLE, gpu_check)
    _expect(outcomes, output, ["test_nvrtc_decorated"], NVRTC_UNAVAILABLE, gpu_check)
    expected_skips = 0 if gpu_check else (3 if GPU_UNAVAILABLE else 0) + (1 if NVRTC_UNAVAILABLE else 0)
    summary = output.strip().splitlines()[-1]
    skipped = re.search(r"(\d+) skipped", summary)
    assert (int(skipped.group(1)) if skipped else 0) == expected_skips, output
