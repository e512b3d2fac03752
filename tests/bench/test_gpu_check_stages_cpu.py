"""gpu-check's crash-proof test runner and its W = 4 stage, run on the CPU.

The runner is given a stand-in test file whose second test kills its own process with
SIGSEGV: the crash must become one named failure and every other test must still run and
be counted. The W = 4 stage runs with ``--device cpu``: the same launcher, ranks and checks
as on a GPU, with CPU tensors on both sides (and zcomm's reference backend, so that no
numba compile is timed here).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from bench.gpu_check import stages, test_runner, w4
from bench.harness.checkout import REPO, checkout_environment

PY = sys.executable

_CRASHY = """
import os, signal

def test_a(): pass

def test_b(): os.kill(os.getpid(), signal.SIGSEGV)

def test_c(): pass

def test_d(): assert False
"""


def test_a_crashing_test_is_a_named_failure_and_the_rest_still_run(tmp_path):
    (tmp_path / "test_crashy.py").write_text(_CRASHY)
    (tmp_path / "test_fine.py").write_text("def test_one(tmp_path): assert tmp_path.is_dir()\n")
    out = tmp_path / "out"
    done = subprocess.run([PY, "-m", "bench.gpu_check.test_runner", "--out", str(out), "--jobs", "2",
                           "test_crashy.py", "test_fine.py"], cwd=tmp_path, env=checkout_environment(os.environ),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "test_crashy.py: 2 run(s); crashed: test_crashy.py::test_b (signal 11)" in done.stdout
    assert "tests: 3 passed, 2 failed, 0 errors, 0 skipped" in done.stdout
    merged = out / test_runner.MERGED
    assert stages.crashed_tests(merged) == ["test_crashy.py::test_b"]
    assert stages.junit_counts(merged) == {"tests": 5, "failures": 2, "errors": 0, "skipped": 0}
    failed = stages.failed_tests(merged)
    assert "test_crashy::test_d" in failed and any(name.endswith("test_crashy.py::test_b") for name in failed)
    assert "--deselect=test_crashy.py::test_b" not in (out / "test_crashy_py.log").read_text().split("(run 1")[0]


def test_the_stage_names_crashes_and_failures(tmp_path):
    (tmp_path / stages.TESTS_DIR).mkdir()
    outcome = test_runner.FileOutcome("t.py", (), (test_runner.Crash("t.py", "t.py::test_b", -11, (("t.py::test_a", "FAILED"),)),), 1)
    test_runner.merge([outcome], stages.tests_xml(tmp_path))
    assert stages._verify_tests(tmp_path) == ["crashed its process: t.py::test_b", "failed: t.py::t.py::test_a"]


def test_progress_reads_pytest_verbose_output():
    log = ("t.py::test_a PASSED [ 25%]\nt.py::test_b[x-1] FAILED [ 50%]\nt.py::test_c \n"
           "Fatal Python error: Segmentation fault\n")  # fmt: skip
    assert test_runner.progress(log, "t.py") == ([("t.py::test_a", "PASSED"), ("t.py::test_b[x-1]", "FAILED")], "t.py::test_c")
    assert test_runner.progress("t.py::test_a PASSED\n", "t.py") == ([("t.py::test_a", "PASSED")], None)


def test_w4_compares_bytes():
    a = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert w4._same_bytes([a], [a.clone()]) == (True, 0.0)
    same, diff = w4._same_bytes([a], [torch.tensor([1.0, 2.015625], dtype=torch.bfloat16)])
    assert not same and diff == pytest.approx(0.015625)


def test_w4_without_a_gpu_exits_2():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert w4.main(["--device", "cuda"]) == 2


@pytest.mark.slow
def test_w4_runs_its_checks_on_four_cpu_ranks(tmp_path):
    out = tmp_path / "w4.json"
    env = checkout_environment({**os.environ, "ZCOMM_BACKEND": "reference"})
    done = subprocess.run([PY, "-m", "bench.gpu_check.w4", "--device", "cpu", "--cpu-backend", "reference",
                           "--dtypes", "bf16", "--timeout", "400", "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=500)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    names = [c["check"] for c in report["checks"]]
    assert report["passed"] and (report["world_size"], report["local_size"], report["backend"]) == (4, 2, "gloo")
    assert len(names) == 15 and all(c["ok"] for c in report["checks"])
    for needle in ("all_gather_q8 bf16 stages=4", "reduce_scatter_q4_coalesced bf16 stages=4 first_hop=INT8",
                   "hadamard=256", "zero_runtime ZeRO++"):
        assert any(needle in name for name in names), needle
    assert all("bytes identical" in c["detail"] for c in report["checks"][:-1])
    assert stages._verify_w4(tmp_path) == []
