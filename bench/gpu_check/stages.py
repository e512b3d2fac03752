"""The stages of ``make gpu-check``: what each runs, its time limit, and how its outcome is judged.

A stage is one subprocess of the checking interpreter, run from the checkout with its output
in ``<stage>.log``. It passes when the process exits 0 within its limit, every module it
needs imports, nothing it expects is missing, and its outputs pass the stage's own
verification (``#wrong`` 0, every training run finished with finite losses, ...). Timing
figures are reported, never judged.

[Note: gpu-check time budget]
The whole check must finish in under 10 minutes on a GPU machine. Each stage has its own
limit and the driver also holds a total deadline: a stage gets the smaller of its limit and
the time left, and one that overruns is killed with its whole process group (torchrun and
pytest children included) and reported as timed out with its log's tail. The stages' limits
add up to 550 s, which leaves the rest of ``TOTAL_BUDGET_S`` to the environment probe and
the report (a test holds the sum below the budget).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Callable, Mapping, Sequence

from bench.harness.checkout import REPO, checkout_environment

TOTAL_BUDGET_S = 570.0
GPU_CHECK_ENV = "ZCOMM_GPU_CHECK"
# The CUDA test files gpu-check runs; any that is missing fails the stage by name. The
# backend sweeps are parametrized by target (``[cpu-on-cpu]``, ``[cuda-on-cuda]``...):
# CUDA_TESTS_SELECT keeps their GPU targets, whose oracle is the reference backend on the
# CPU (numba, which a GPU machine may lack, serves only the CPU targets).
CUDA_TESTS = (
    "tests/quant/test_cuda_backend.py",
    "tests/quant/test_cuda_compile.py",
    "tests/quant/test_cuda_host_math.py",
    "tests/quant/test_quant_vs_reference.py",
    "tests/quant/test_wire_format.py",
    "tests/quant/test_quant_contract.py",
    "tests/collectives/test_collectives_cuda.py",
    "tests/runtime/test_zero_cuda.py",
)
CUDA_TESTS_SELECT = "not on-cpu"
TRAIN_CONFIGS = ("zero1", "zero2", "zero3", "zeropp")
# Variables that would change what the stages test (a forced backend, a pretend node size).
CLEARED_ENV = ("ZCOMM_BACKEND", "ZCOMM_LOCAL_SIZE")
_KILL_GRACE_S = 10.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Stage:
    """One subprocess of the check.

    Args:
        name: short name; also the log's file name (``<name>.log``).
        title: what the stage checks, one line for the report.
        argv: the command, run from the checkout.
        limit_s: wall-clock limit in seconds.
        needs: modules the interpreter must import for the stage to mean anything.
        env: variables added to the stage's environment.
        missing: problems known before running (absent test files); they fail the stage.
        verify: reads the stage's outputs in the result folder and returns problems.
    """

    name: str
    title: str
    argv: tuple[str, ...]
    limit_s: float
    needs: tuple[str, ...] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    missing: tuple[str, ...] = ()
    verify: Callable[[Path], list[str]] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageResult:
    """``status`` is ``passed``, ``failed``, ``timed out`` or ``not run``."""

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


def stage_environment(base: Mapping[str, str], extra: Mapping[str, str]) -> dict[str, str]:
    """``base`` with the checkout first on ``PYTHONPATH``, unbuffered output, ``CLEARED_ENV`` removed, ``extra`` added."""
    env = checkout_environment({key: value for key, value in base.items() if key not in CLEARED_ENV})
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


def missing_modules(names: Sequence[str]) -> list[str]:
    """The modules of ``names`` this interpreter cannot find."""
    return [name for name in names if importlib.util.find_spec(name) is None]


def _kill(process: subprocess.Popen) -> None:
    """SIGTERM the stage's process group, SIGKILL it if it lingers."""
    for sig, grace in ((signal.SIGTERM, _KILL_GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue
    process.wait()


def run_stage(stage: Stage, out_dir: Path, deadline: float, base_env: Mapping[str, str] | None = None) -> StageResult:
    """Run ``stage`` with its output in ``out_dir/<name>.log``, within its limit and ``deadline`` (``time.monotonic``)."""
    log = out_dir / f"{stage.name}.log"
    limit = min(stage.limit_s, deadline - time.monotonic())

    def result(status: str, seconds: float, returncode: int | None, problems: Sequence[str]) -> StageResult:
        return StageResult(stage=stage, status=status, seconds=seconds, limit_s=max(limit, 0.0),
                           returncode=returncode, problems=tuple(problems), log=log)  # fmt: skip

    absent = missing_modules(stage.needs)
    if absent:
        problem = (
            f"{sys.executable} cannot import {', '.join(absent)}: gpu-check installs nothing (GPU machines have "
            "no package registry); use an interpreter that has them (make gpu-check GPU_PYTHON=...)"
        )
        log.write_text(problem + "\n")
        return result("failed", 0.0, None, [problem, *stage.missing])
    if limit < 1.0:
        problem = f"not started: the {TOTAL_BUDGET_S:.0f} s budget of the whole check was spent"
        log.write_text(problem + "\n")
        return result("not run", 0.0, None, [problem, *stage.missing])
    env = stage_environment(os.environ if base_env is None else base_env, stage.env)
    start = time.monotonic()
    with log.open("w") as handle:
        handle.write(f"$ {' '.join(stage.argv)}\n")
        handle.flush()
        process = subprocess.Popen(stage.argv, cwd=REPO, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        try:
            returncode = process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            _kill(process)
            seconds = time.monotonic() - start
            return result("timed out", seconds, None, [f"killed after its {limit:.0f} s limit", *stage.missing])
        except BaseException:
            # Ctrl-C reaches only the driver: the stage runs in its own session and would outlive it.
            _kill(process)
            raise
    seconds = time.monotonic() - start
    problems = list(stage.missing)
    if returncode != 0:
        problems.insert(0, f"exited with status {returncode}")
    elif stage.verify is not None:
        try:
            problems += stage.verify(out_dir)
        except (OSError, ValueError, KeyError, TypeError) as exc:  # malformed output: report it, keep going
            problems.append(f"its output could not be verified: {type(exc).__name__}: {exc}")
    return result("failed" if problems else "passed", seconds, returncode, problems)


def junit_counts(path: Path) -> dict[str, int]:
    """tests / failures / errors / skipped summed over the suites of a pytest ``--junitxml`` file."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    keys = ("tests", "failures", "errors", "skipped")
    return {key: sum(int(suite.get(key, 0)) for suite in suites) for key in keys}


def _verify_tests(out_dir: Path) -> list[str]:
    path = out_dir / "cuda-tests.xml"
    if not path.exists():
        return ["pytest wrote no cuda-tests.xml"]
    counts = junit_counts(path)
    return [] if counts["tests"] else ["pytest ran no test"]


def _verify_collectives(out_dir: Path) -> list[str]:
    path = out_dir / "collectives.json"
    if not path.exists():
        return ["bench.collectives wrote no collectives.json"]
    # Imported here: the driver must be able to say "no GPU" on an interpreter without torch.
    from bench.collectives.catalog import ALL_OPS

    rows = json.loads(path.read_text())
    problems = [f"{row['op']} at {row['size_bytes']} B: #wrong = {row['wrong']}" for row in rows if row["wrong"]]
    ran = {row["op"].split(":")[0] for row in rows}
    problems += [f"{op}: no row" for op in ALL_OPS if op not in ran]
    return problems


def _verify_training(out_dir: Path) -> list[str]:
    path = out_dir / "train.json"
    if not path.exists():
        return ["bench.train wrote no train.json"]
    results = {row["config"]: row for row in json.loads(path.read_text())["results"]}
    problems = []
    for name in TRAIN_CONFIGS:
        row = results.get(name)
        if row is None:
            problems.append(f"{name}: no result")
        elif row["status"] != "ok":
            problems.append(f"{name}: {row['status']} ({row['note']})")
        elif not all(math.isfinite(loss) for loss in row["train_losses"]):
            problems.append(f"{name}: non-finite training loss {row['train_losses']}")
    return problems


def _launcher(python: str, gpus: int) -> list[str]:
    """One process for one GPU (``bench.harness.dist_env``'s single-rank launcher), else torchrun with a rank per GPU."""
    if gpus <= 1:
        return [python, "-m"]
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}", "-m"]


def plan(out_dir: Path, *, gpus: int, python: str = sys.executable) -> list[Stage]:
    """The stages, in order, writing their outputs into ``out_dir``; ``gpus`` ranks for the distributed ones."""
    present = [name for name in CUDA_TESTS if (REPO / name).exists()]
    missing = tuple(f"{name} is missing from this checkout: its tests did not run" for name in CUDA_TESTS if name not in present)
    launch = _launcher(python, gpus)
    return [
        Stage(
            name="cuda-tests",
            title=f"CUDA tests with {GPU_CHECK_ENV}=1 (a skip is a failure): {', '.join(Path(n).name for n in CUDA_TESTS)}",
            argv=(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors",
                  "--durations=15", f"--junitxml={out_dir / 'cuda-tests.xml'}", "-k", CUDA_TESTS_SELECT, *present),  # fmt: skip
            limit_s=250,
            needs=("pytest", "cupy"),
            env={GPU_CHECK_ENV: "1"},
            missing=missing,
            verify=_verify_tests,
        ),
        Stage(
            name="kernels",
            title="bench.kernels: cuda backend GB/s vs a device-to-device copy of the same bytes, 64M fp32 and bf16",
            argv=(python, "-m", "bench.kernels", "--device", "cuda", "--backends", "cuda", "--dtype", "fp32", "bf16",
                  "--numel", str(64 << 20), "--output", str(out_dir / "kernels.md")),  # fmt: skip
            limit_s=90,
            needs=("cupy",),
        ),
        Stage(
            name="collectives",
            title=f"bench.collectives on {gpus} GPU rank(s) over NCCL: torch's and zcomm's collectives, bf16, 1M-16M, #wrong = 0",
            argv=(*launch, "bench.collectives", "-b", "1M", "-e", "16M", "-f", "4", "-n", "20", "-w", "5",
                  "-d", "bfloat16", "--stages", "1,4", "--device", "cuda", "--backend", "nccl",
                  "--json", str(out_dir / "collectives.json")),  # fmt: skip
            limit_s=90,
            needs=("cupy", "tqdm"),
            verify=_verify_collectives,
        ),
        Stage(
            name="zero-runtime",
            title=f"bench.train on {gpus} GPU rank(s) over NCCL: zero_runtime stages 1-3 and ZeRO++ (qwZ+hpZ+qgZ), 6 steps each",
            argv=(*launch, "bench.train", "--configs", *TRAIN_CONFIGS, "--steps", "6", "--warmup", "2",
                  "--batch", str(4 * max(gpus, 1)), "--seq-len", "64", "--eval-batches", "1",
                  "--json", str(out_dir / "train.json")),  # fmt: skip
            limit_s=120,
            needs=("cupy", "numpy"),
            verify=_verify_training,
        ),
    ]
