"""The stages of ``make gpu-check``, how a stage (or a speed-report part) runs, and how its outcome is judged.

A stage is one subprocess of the checking interpreter, run from the checkout with its output in
``<stage>.log``. It passes when it exits 0 within its limit, every module it needs imports,
nothing it expects is missing and its outputs pass its verification (``#wrong`` 0, every W = 4
check byte-identical to the CPU, ...). Timing figures are reported, never judged.

[Note: gpu-check time budget] A GPU machine is lent for minutes, shared with the speed report
(:mod:`.speed_plan`). Each stage has a limit inside the driver's total deadline; one that overruns
is killed with its process group and reported as timed out with its log's tail. The limits
(cuda-tests 165 s, w4 60, collectives 20, driver-launcher 55; an H200 took 135, 14 and 5 s for the
first three when w4 had a third of its checks) leave the rest of ``TOTAL_BUDGET_S`` to the
environment probe and the report; 2 or more GPUs add ``NCCL_LIMIT_S``. The CUDA tests run
``TEST_JOBS`` files at once, the long ones first (:mod:`.test_runner`): each NVRTC compile is one
core's work.

[Note: driver-launcher stage] The last stage runs the CUDA kernel tests again with
``ZCOMM_CUDA_LAUNCHER=driver`` (not yet the default: [Note: launcher choice] in zcomm_cuda/loader.py),
in one pytest process so that the kernels are compiled once, and last so that its failure or
overrun cannot cost the other stages their results.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Callable, Mapping, Sequence

from bench.harness.checkout import REPO, checkout_environment
from bench.simcluster.launcher import terminate

TOTAL_BUDGET_S = 315.0
NCCL_LIMIT_S = 150.0
W4_RANKS = 4  # bench.gpu_check.w4.WORLD (not imported: the driver runs on an interpreter without torch)
GPU_CHECK_ENV = "ZCOMM_GPU_CHECK"
DEVICE_CHECKS = {"ZCOMM_CUDA_DEVICE_CHECKS": "1"}  # every stage that runs zcomm's kernels turns their traps on
NCCL_TRACE = "nccl_trace_"  # the NCCL stage's flight recorder: each rank's last collectives, dumped on a timeout
# The CUDA test files, the long ones (the runtime's trainings, the sweeps) first; one that is
# missing fails the stage by name. The selection keeps the backend sweeps' GPU targets, whose oracle
# is the reference backend on the CPU (numba, which a GPU machine may lack, serves the CPU targets).
CUDA_TESTS = (
    "tests/runtime/test_zero_cuda.py", "tests/quant/test_cuda_compile.py", "tests/quant/test_quant_vs_reference.py",
    "tests/quant/test_cuda_host_rounding.py", "tests/quant/test_cuda_reorder_paths.py",
    "tests/collectives/test_collectives_cuda.py", "tests/quant/test_cuda_backend.py", "tests/quant/test_quant_contract.py",
    "tests/quant/test_wire_format.py", "tests/quant/test_cuda_launch_host.py", "tests/collectives/test_group_lifetime.py",
    "tests/collectives/test_all_reduce_q4_cuda.py", "tests/collectives/test_fsdp_zeropp.py",
    "tests/quant/test_cuda_kernel_cache.py",
)  # fmt: skip
CUDA_TESTS_SELECT = "not on-cpu"
TESTS_DIR = "cuda-tests"
TESTS_XML = f"{TESTS_DIR}/cuda-tests.xml"  # the test runner's merged JUnit file
TEST_JOBS = 6
# The driver-launcher stage: the cases that launch zcomm's kernels in this process (no reference
# backend, no CPU target, no bound world, which takes a process of its own, and not the comparison
# with the CPU path, whose numba compile took 10 s on the H200: test_cuda_driver_launch.py compares
# the launchers' bytes directly).
LAUNCHER_ENV = "ZCOMM_CUDA_LAUNCHER"
DRIVER_TESTS = ("tests/quant/test_cuda_driver_launch.py", "tests/quant/test_cuda_backend.py",
                "tests/quant/test_wire_format.py", "tests/collectives/test_collectives_cuda.py")  # fmt: skip
DRIVER_TESTS_SELECT = "not on-cpu and not reference and not [bound and not reinitialised and not cpu_paths"
DRIVER_TESTS_XML = "driver-launcher.xml"
# Variables that would change what the stages test; the driver-launcher stage sets its own launcher.
CLEARED_ENV = ("ZCOMM_BACKEND", "ZCOMM_LOCAL_SIZE", LAUNCHER_ENV)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage:
    """One subprocess, run from the checkout; its log is ``<name>.log``.

    ``needs``: modules the interpreter must import for it to mean anything; ``env``: variables
    added; ``missing``: problems known before it runs (absent test files), which fail it;
    ``verify``: the problems in its outputs; ``junit``: its pytest JUnit file in the result folder,
    whose crashes and failures fail it; ``skip``: why it cannot run on this machine.
    """

    name: str
    title: str
    argv: tuple[str, ...]
    limit_s: float
    needs: tuple[str, ...] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    missing: tuple[str, ...] = ()
    verify: Callable[[Path], list[str]] | None = None
    junit: str | None = None
    skip: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageResult:
    """``status``: ``passed``, ``failed``, ``timed out``, ``not run`` or ``skipped`` (not for this machine)."""

    stage: Stage
    status: str
    seconds: float
    limit_s: float
    returncode: int | None
    problems: tuple[str, ...]
    log: Path

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def failed(self) -> bool:
        return self.status not in ("passed", "skipped")


def stage_environment(base: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """``base`` with the checkout first on ``PYTHONPATH``, unbuffered output, ``CLEARED_ENV`` removed, ``extra`` added."""
    env = checkout_environment({key: value for key, value in base.items() if key not in CLEARED_ENV})
    return {**env, "PYTHONUNBUFFERED": "1", **extra}


def run_stage(stage: Stage, out_dir: Path, deadline: float, base_env: Mapping[str, str] | None = None) -> StageResult:
    """Run ``stage`` with its output in ``out_dir/<name>.log``, within its limit and ``deadline`` (``time.monotonic``)."""
    log = out_dir / f"{stage.name}.log"
    limit = min(stage.limit_s, deadline - time.monotonic())

    def result(status: str, problems: Sequence[str], seconds: float = 0.0, returncode: int | None = None) -> StageResult:
        return StageResult(stage=stage, status=status, seconds=seconds, limit_s=max(limit, 0.0),
                           returncode=returncode, problems=tuple(problems), log=log)  # fmt: skip

    def refused(status: str, problem: str) -> StageResult:
        log.write_text(problem + "\n")
        return result(status, [problem, *stage.missing])

    if stage.skip is not None:
        log.write_text(f"skipped: {stage.skip}\n")
        return result("skipped", [])
    absent = [name for name in stage.needs if importlib.util.find_spec(name) is None]
    if absent:
        return refused("failed", f"{sys.executable} cannot import {', '.join(absent)}: gpu-check installs nothing "
                       "(GPU machines have no package registry); use an interpreter that has them "
                       "(make gpu-check GPU_PYTHON=...)")  # fmt: skip
    if limit < 1.0:
        return refused("not run", f"not started: the {TOTAL_BUDGET_S:.0f} s budget of the whole check was spent")
    start = time.monotonic()
    with log.open("w") as handle:
        handle.write(f"$ {' '.join(stage.argv)}\n")
        handle.flush()
        process = subprocess.Popen(stage.argv, cwd=REPO, env=stage_environment(base_env or os.environ, stage.env),
                                   stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)  # fmt: skip
        try:
            returncode = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            terminate([process], grace_s=10)
            return result("timed out", [f"killed after its {limit:.0f} s limit", *stage.missing], time.monotonic() - start)
        except BaseException:  # Ctrl-C reaches only the driver: the stage runs in its own session and would outlive it
            terminate([process], grace_s=10)
            raise
    seconds = time.monotonic() - start
    problems = ([f"exited with status {returncode}"] if returncode else []) + list(stage.missing)
    try:  # also after a failed run: the outputs name what failed
        problems += (stage.verify(out_dir) if stage.verify else []) + (_verify_junit(out_dir / stage.junit) if stage.junit else [])
    except (OSError, ValueError, KeyError, TypeError) as exc:  # malformed output: report it, keep going
        problems.append(f"its output could not be verified: {type(exc).__name__}: {exc}")
    return result("failed" if problems else "passed", problems, seconds, returncode)


# ---- the stages' outputs


def junit_suites(path: Path) -> list[ElementTree.Element]:
    """The ``testsuite`` elements of a JUnit file (pytest's: one under ``testsuites``; the test runner's merged: several)."""
    root = ElementTree.parse(path).getroot()
    return [root] if root.tag == "testsuite" else list(root.iter("testsuite"))


def junit_counts(path: Path) -> dict[str, int]:
    """tests / failures / errors / skipped summed over the suites of a pytest ``--junitxml`` file."""
    return {key: sum(int(suite.get(key, 0)) for suite in junit_suites(path)) for key in ("tests", "failures", "errors", "skipped")}


def crashed_tests(path: Path) -> list[str]:
    """The names of the tests that crashed their pytest process, from the merged JUnit file."""
    return [case.get("name", "?") for suite in junit_suites(path) if suite.get("name") == "crashes" for case in suite.iter("testcase")]


def failed_tests(path: Path, limit: int = 30) -> list[str]:
    """``classname::name`` of the failed or erroring tests of a JUnit file (the first ``limit``, then a count)."""
    names = [f"{case.get('classname')}::{case.get('name')}" for case in ElementTree.parse(path).getroot().iter("testcase")
             if case.find("failure") is not None or case.find("error") is not None]  # fmt: skip
    return names[:limit] + ([f"... and {len(names) - limit} more"] if len(names) > limit else [])


def _verify_junit(path: Path) -> list[str]:
    """A pytest stage's problems from its JUnit file: none ran, a test crashed its process (the
    test runner's merged file only), a test failed."""
    if not path.exists():
        return [f"{path.name} was not written: pytest died before the end (see the log)"]
    crashed = crashed_tests(path)
    failed = [name for name in failed_tests(path) if name.split("::", 1)[-1] not in crashed]
    none = [] if junit_counts(path)["tests"] else ["pytest ran no test"]
    return none + [f"crashed its process: {name}" for name in crashed] + [f"failed: {name}" for name in failed]


def _verify_w4(out_dir: Path, name: str = "w4") -> list[str]:
    """The failed checks of the w4 or nccl stage's JSON, and its problems."""
    path = out_dir / f"{name}.json"
    if not path.exists():
        return [f"bench.gpu_check.{name} wrote no {name}.json"]
    report = json.loads(path.read_text())
    problems = [f"{c['check']}: {c['detail']}" for c in report["checks"] if not c["ok"]] + list(report["problems"])
    return problems if report["checks"] else ["no check ran", *problems]


def _verify_collectives(out_dir: Path) -> list[str]:
    path = out_dir / "collectives.json"
    if not path.exists():
        return ["bench.collectives wrote no collectives.json"]
    from bench.collectives.catalog import ALL_OPS  # here: the driver must say "no GPU" on an interpreter without torch

    rows = json.loads(path.read_text())
    ran = {row["op"].split(":")[0] for row in rows}
    return ([f"{row['op']} at {row['size_bytes']} B: #wrong = {row['wrong']}" for row in rows if row["wrong"]]
            + [f"{op}: no row" for op in ALL_OPS if op not in ran])  # fmt: skip


# ---- the plan


def budget(gpus: int) -> float:
    """The whole check's seconds on a machine with ``gpus`` GPUs ([Note: gpu-check time budget])."""
    return TOTAL_BUDGET_S + (NCCL_LIMIT_S if gpus >= 2 else 0.0)


def _ranks(python: str, gpus: int) -> tuple[str, ...]:
    """One process for one rank (``bench.harness.dist_env``'s single-rank launcher), else torchrun with ``gpus`` ranks."""
    return (python, "-m") if gpus <= 1 else (python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}", "-m")


def _test_files(files: Sequence[str], where: str = "") -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the files this checkout has, a problem for each it lacks)."""
    return (tuple(name for name in files if (REPO / name).exists()),
            tuple(f"{name} is missing from this checkout: its tests did not run{where}" for name in files
                  if not (REPO / name).exists()))  # fmt: skip


def plan(out_dir: Path, *, gpus: int, python: str = sys.executable) -> list[Stage]:
    """The stages, in order, writing their outputs into ``out_dir``; ``gpus`` ranks for the distributed ones."""
    tests, tests_missing = _test_files(CUDA_TESTS)
    driver_tests, driver_missing = _test_files(DRIVER_TESTS, " under the driver launcher")
    return [
        Stage(name="cuda-tests", limit_s=165, needs=("pytest", "cupy"), env={GPU_CHECK_ENV: "1", **DEVICE_CHECKS},
              title=f"CUDA tests with {GPU_CHECK_ENV}=1 (a skip is a failure, a crash a named failure), one pytest "
                    f"per file, {TEST_JOBS} at once: {', '.join(Path(n).name for n in CUDA_TESTS)}",
              argv=(python, "-m", "bench.gpu_check.test_runner", "--out", str(out_dir / TESTS_DIR),
                    "--jobs", str(TEST_JOBS), "-k", CUDA_TESTS_SELECT, *tests),
              missing=tests_missing, junit=TESTS_XML),
        Stage(name="w4", limit_s=60, needs=("cupy",), env=DEVICE_CHECKS, verify=_verify_w4,
              title="W = 4 on one GPU over gloo (2 nodes x 2, tensors on cuda:0): collectives and ZeRO++ equal to the CPU's",
              argv=(*_ranks(python, W4_RANKS), "bench.gpu_check.w4", "--device", "cuda", "--timeout", "52",
                    "--json", str(out_dir / "w4.json"))),
        Stage(name="collectives", limit_s=20, needs=("cupy", "tqdm"), env=DEVICE_CHECKS, verify=_verify_collectives,
              title=f"bench.collectives on {gpus} GPU rank(s) over NCCL: torch's and zcomm's collectives, bf16, 1M-16M, #wrong = 0",
              argv=(*_ranks(python, gpus), "bench.collectives", "-b", "1M", "-e", "16M", "-f", "4", "-n", "10", "-w", "3",
                    "-d", "bfloat16", "--stages", "1,4", "--device", "cuda", "--backend", "nccl",
                    "--json", str(out_dir / "collectives.json"))),
        Stage(name="nccl", limit_s=NCCL_LIMIT_S, needs=("cupy",), verify=lambda out: _verify_w4(out, "nccl"),
              title=f"NCCL, one rank per GPU ({gpus}): every collective under both launchers byte-identical to the CPU's, "
                    "ZeRO++ and FSDP2-adapter steps equal to the CPU's; 60 s timeout, flight recorder",
              argv=(*_ranks(python, max(gpus, 2)), "bench.gpu_check.nccl", "--timeout", "60", "--json", str(out_dir / "nccl.json")),
              env={**DEVICE_CHECKS, "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_FR_DUMP_TEMP_FILE": str(out_dir / NCCL_TRACE)},
              skip=None if gpus >= 2 else f"this machine has {gpus} GPU; the NCCL stage needs 2 or more (one rank per GPU)"),
        Stage(name="driver-launcher", limit_s=55, needs=("pytest", "cupy"),
              env={GPU_CHECK_ENV: "1", LAUNCHER_ENV: "driver", **DEVICE_CHECKS},
              title=f"{LAUNCHER_ENV}=driver (cuLaunchKernelEx through ctypes): the CUDA kernel tests in one pytest, "
                    f"{GPU_CHECK_ENV}=1, -k '{DRIVER_TESTS_SELECT}': {', '.join(Path(n).name for n in DRIVER_TESTS)}",
              argv=(python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE", "-k", DRIVER_TESTS_SELECT,
                    f"--junitxml={out_dir / DRIVER_TESTS_XML}", *driver_tests),
              missing=driver_missing, junit=DRIVER_TESTS_XML),
    ]  # fmt: skip
