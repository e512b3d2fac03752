"""gpu-check's crash-proof test runner, its W = 4 stage and its NCCL stage's planning and wiring, run on the CPU.

The runner is given a stand-in test file whose third test kills its own process with
SIGSEGV: the crash must become one named failure, the tests before it must be counted and the
other file must still run. The W = 4 stage runs with ``--device cpu``: the same launcher, ranks and checks
as on a GPU, with CPU tensors on both sides (and zcomm's reference backend, so that no
numba compile is timed here). The NCCL stage is planned for 1 and 4 GPUs (skipped with its
reason on one; torchrun with a rank per GPU, short timeouts and the flight recorder on
several), and its module runs under torchrun with ``--device cpu`` (gloo on both sides).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from bench.gpu_check import nccl, report, stages, test_runner, w4
from bench.harness.checkout import REPO, checkout_environment

PY = sys.executable

_CRASHY = """
import os, signal

def test_a(): pass

def test_b(): assert False

def test_c(): os.kill(os.getpid(), signal.SIGSEGV)

def test_d(): pass
"""


def test_a_crashing_test_is_a_named_failure_and_the_other_files_still_run(tmp_path):
    (tmp_path / "test_crashy.py").write_text(_CRASHY)
    (tmp_path / "test_fine.py").write_text("def test_one(tmp_path): assert tmp_path.is_dir()\n")
    out = tmp_path / "out"
    done = subprocess.run([PY, "-m", "bench.gpu_check.test_runner", "--out", str(out), "--jobs", "2",
                           "test_crashy.py", "test_fine.py"], cwd=tmp_path, env=checkout_environment(os.environ),
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    assert "test_crashy.py: crashed: test_crashy.py::test_c (signal 11)" in done.stdout
    assert "tests: 2 passed, 2 failed, 0 errors, 0 skipped" in done.stdout  # test_a and test_one; test_b and the crash
    merged = out / test_runner.MERGED
    assert stages.crashed_tests(merged) == ["test_crashy.py::test_c"]
    assert stages.junit_counts(merged) == {"tests": 4, "failures": 2, "errors": 0, "skipped": 0}
    failed = stages.failed_tests(merged)
    assert any(name.endswith("test_crashy.py::test_b") for name in failed)
    assert any(name.endswith("test_crashy.py::test_c") for name in failed)
    assert "test_d" not in merged.read_text()  # after the crash in its file: not run


def test_the_stage_names_crashes_and_failures(tmp_path):
    (tmp_path / stages.TESTS_DIR).mkdir()
    outcome = test_runner.FileOutcome("t.py", (), (test_runner.Crash("t.py", "t.py::test_b", -11, (("t.py::test_a", "FAILED"),)),))
    test_runner.merge([outcome], tmp_path / stages.TESTS_XML)
    assert stages.plan(tmp_path, gpus=1)[0].junit == stages.TESTS_XML
    assert stages._verify_junit(tmp_path / stages.TESTS_XML) == ["crashed its process: t.py::test_b", "failed: t.py::t.py::test_a"]


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
    done = subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m",
                           "bench.gpu_check.w4", "--device", "cpu",
                           "--dtypes", "bf16", "--timeout", "400", "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=500)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    names = [c["check"] for c in report["checks"]]
    assert report["passed"] and (report["world_size"], report["local_size"], report["backend"]) == (4, 2, "gloo")
    # per stage count: 1 gather, 2 reduce forms x (2 first hops x SUM/AVG/PREMUL_SUM + Hadamard); two trainings
    assert len(names) == 2 * (1 + 2 * 7) + 2 and all(c["ok"] for c in report["checks"])
    for needle in ("all_gather_q8 bf16 stages=4 async", "reduce_scatter_q4_coalesced bf16 stages=4 async first_hop=INT8",
                   "hadamard=256 SUM", "first_hop=INT4 AVG", "first_hop=INT8 PREMUL_SUM", "zero_runtime ZeRO++ (",
                   "ZeRO++ with INT4 weight differences"):
        assert any(needle in name for name in names), needle
    assert all("bytes identical" in c["detail"] for c in report["checks"][:-2])
    assert stages._verify_w4(tmp_path) == []


def test_w4_stage_starts_its_ranks_with_torchrun(tmp_path):
    stage = {s.name: s for s in stages.plan(tmp_path, gpus=1)}["w4"]
    assert stages.W4_RANKS == w4.WORLD and f"--nproc-per-node={w4.WORLD}" in stage.argv
    assert w4.main(["--device", "cpu"]) == 2  # not under torchrun


def test_w4_covers_fp16_and_every_op_through_the_requantizing_hop():
    names = [name for name, _, _ in w4._cases(tuple(w4.DTYPES))]
    for dtype in ("bf16", "fp16", "fp32"):
        for op in w4.OPS:  # the 2 x 2 topology's second hop re-quantizes with each op's divisor
            assert f"reduce_scatter_q4 {dtype} stages=4 async first_hop=INT4 {op}" in names


def test_the_nccl_stage_is_skipped_with_its_reason_on_one_gpu(tmp_path):
    stage = {s.name: s for s in stages.plan(tmp_path, gpus=1)}["nccl"]
    assert stage.skip == "this machine has 1 GPU; the NCCL stage needs 2 or more (one rank per GPU)"
    result = stages.run_stage(stage, tmp_path, deadline=float("inf"))
    assert result.status == "skipped" and not result.failed and not result.passed
    assert "skipped: this machine has 1 GPU" in result.log.read_text()
    text = report.render_check(title="t", results=[result], environment={}, gpus=1, seconds=1.0, budget_s=300.0, command="c")
    assert text.startswith("# zcomm gpu-check: PASSED (0 of 1 stages passed, 1 skipped)")
    assert "- nccl skipped: this machine has 1 GPU; the NCCL stage needs 2 or more" in text


def test_the_nccl_stage_runs_a_rank_per_gpu_with_timeouts_and_the_flight_recorder(tmp_path):
    stage = {s.name: s for s in stages.plan(tmp_path, gpus=4)}["nccl"]
    assert stage.skip is None and "--nproc-per-node=4" in stage.argv and "torch.distributed.run" in stage.argv
    args = nccl.build_parser().parse_args(list(stage.argv[stage.argv.index("bench.gpu_check.nccl") + 1:]))
    assert args.device == "cuda" and args.timeout < stage.limit_s and args.json == tmp_path / "nccl.json"
    assert stage.env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and int(stage.env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    assert stage.env["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / stages.NCCL_TRACE)
    assert stage.env["ZCOMM_CUDA_DEVICE_CHECKS"] == "1"
    assert stages.budget(4) == stages.budget(1) + stage.limit_s


def test_nccl_merges_ranks_and_adds_two_pretend_nodes():
    per_rank = [[{"check": "a", "ok": True, "detail": "x"}], [{"check": "a", "ok": False, "detail": "y"}]]
    assert w4.merge(per_rank) == [{"check": "a", "ok": False, "detail": "failed on rank(s) [1]: y"}]
    assert [label for label, _ in nccl.topologies(8, 8)] == ["detected (1 node(s) x 8)", "2 nodes x 4"]
    assert [label for label, _ in nccl.topologies(8, 4)] == ["detected (2 node(s) x 4)"]


def test_nccl_needs_torchrun(capsys):
    assert nccl.main(["--device", "cpu"]) == 2
    assert "torchrun" in capsys.readouterr().err


@pytest.mark.slow
def test_nccl_stage_runs_its_checks_on_two_cpu_ranks(tmp_path):
    out = tmp_path / "nccl.json"
    env = checkout_environment({**os.environ, "ZCOMM_BACKEND": "reference", "OMP_NUM_THREADS": "1"})
    done = subprocess.run([PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                           "bench.gpu_check.nccl", "--device", "cpu", "--dtypes", "bf16", "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    names = [c["check"] for c in result["checks"]]
    assert result["passed"] and result["world_size"] == 2 and all(c["ok"] for c in result["checks"])
    assert len(names) == 2 * 60 + 2  # w4's 30 bf16 cases, sync and async, on both topologies; ZeRO++; FSDP2
    assert any(name.endswith("2 nodes x 1") and "PREMUL_SUM" in name for name in names)
    assert any("stages=1 async" in name for name in names) and any("stages=4 first_hop" in name for name in names)
    assert names[-1].startswith("FSDP2 + zcomm.fsdp.enable_zeropp") and names[-2].startswith("zero_runtime ZeRO++")
    assert stages._verify_w4(tmp_path, "nccl") == []


def test_every_gpu_test_file_runs_in_a_stage():
    """A test file that skips without a GPU runs in gpu-check's tests stage or its driver-launcher
    stage; otherwise its GPU cases would never run anywhere."""
    gpu_marks = ("requires_gpu", "requires_nvrtc", "requires_cuda_device", "torch.cuda.is_available()")
    staged = {*stages.CUDA_TESTS, *stages.DRIVER_TESTS}
    unstaged = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        relative = path.relative_to(REPO).as_posix()
        if relative.startswith("tests/bench/") or relative == "tests/test_cuda_support.py":
            continue  # the benches' own tests and the marks' tests run their GPU parts through gpu-check itself
        if any(mark in path.read_text() for mark in gpu_marks) and relative not in staged:
            unstaged.append(relative)
    assert not unstaged, f"GPU tests that no gpu-check stage runs: {unstaged}"
