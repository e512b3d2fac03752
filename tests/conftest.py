"""Suite-wide pytest hooks.

[Note: test groups] Every test runs in ``make test``; markers name the slow groups so that a
developer can leave them out (README, "Tests"). They are given here, at collection, from what a
test uses, so that no test file has to carry them:

* ``nvcc``: compiles CUDA with nvcc or NVRTC (a ``requires_nvcc`` / ``requires_nvrtc`` mark, or
  the ``nvcc_builds`` fixture of tests/quant/nvcc_builds.py);
* ``hostcheck``: runs the kernels' code compiled for the host (the ``host_check`` fixture), also
  ``nvcc``;
* ``multirank``: starts processes: the ranks of a process group (``spawn_harness``,
  ``zero_harness``), child Pythons or tools (``subprocess``, ``multiprocessing``). Found by
  following the names the test, its fixtures and the module's own functions they call refer to,
  until one of those is reached;
* ``slow`` (set by hand on long single-process tests) and ``root`` stay as they are.

[Note: skips under gpu-check]
``make gpu-check`` runs the CUDA tests with ``ZCOMM_GPU_CHECK=1`` on a machine that has a GPU.
There a skipped test is a test that did not run where it must, so with ``ZCOMM_GPU_CHECK=1``
every skip is reported as a failure that carries the skip's reason: a ``skip``/``skipif``
mark, ``pytest.skip`` in a test or fixture (reported as an error of its setup), and
``importorskip`` or a module-level skip at collection (a collection error). Expected
failures (``xfail``) are not skips and keep their outcome; deselected tests never ran. Any
value other than 0, 1 or unset is a usage error rather than a silent "off".
"""

from __future__ import annotations

import inspect
import multiprocessing
import os
import subprocess
import types
from collections.abc import Generator, Iterator
from typing import Any

import pytest

GPU_CHECK_ENV = "ZCOMM_GPU_CHECK"


def _gpu_check() -> bool:
    return os.environ.get(GPU_CHECK_ENV, "0") == "1"


def pytest_configure(config: pytest.Config) -> None:
    value = os.environ.get(GPU_CHECK_ENV, "0")
    if value not in ("0", "1"):
        raise pytest.UsageError(f"{GPU_CHECK_ENV} must be 0 or 1, got {value!r}")


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        path, line, reason = longrepr
        return f"{reason} ({path}:{line})"
    return str(longrepr)


def _as_failure(report: pytest.TestReport | pytest.CollectReport) -> None:
    report.longrepr = f"{GPU_CHECK_ENV}=1 makes every skip a failure: {_skip_reason(report)}"
    report.outcome = "failed"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if _gpu_check() and report.skipped and not hasattr(report, "wasxfail"):
        _as_failure(report)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Generator[None, Any, None]:
    outcome = yield
    report = outcome.get_result()
    if _gpu_check() and report.skipped:
        _as_failure(report)


# ---- the slow groups' markers ([Note: test groups]) ----
_NVCC_REASONS = ("nvcc not found", "NVRTC (cupy)")
_WAYS = (subprocess.run, subprocess.Popen, subprocess.check_output, subprocess.check_call, multiprocessing.Process)


def _starts_processes(obj: object) -> bool:
    """Whether ``obj`` is a way to start processes (a module or function of the harnesses)."""
    if isinstance(obj, types.ModuleType):
        return obj.__name__ in ("subprocess", "multiprocessing", "torch.multiprocessing", "zero_harness",
                                "spawn_harness")
    return any(obj is way for way in _WAYS) or (
        getattr(obj, "__module__", None) in ("spawn_harness", "zero_harness") and getattr(obj, "__name__", "") in
        ("run_distributed", "run"))


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _spawns(function: object, seen: set[int]) -> bool:
    """Whether ``function``, or a function of its own module it refers to, refers to a way to
    start processes (followed through the module's globals, names only: a conservative reach)."""
    function = inspect.unwrap(function) if callable(function) else function
    code = getattr(function, "__code__", None)
    if code is None or id(code) in seen:
        return False
    seen.add(id(code))
    module_globals = getattr(function, "__globals__", {})
    for inner in _codes(code):
        for name in inner.co_names:
            target = module_globals.get(name)
            if target is None:
                continue
            if _starts_processes(target):
                return True
            if isinstance(target, (types.FunctionType, type)) and _spawns(target, seen):
                return True
            if isinstance(target, type):
                if any(_spawns(member, seen) for member in vars(target).values() if isinstance(member, types.FunctionType)):
                    return True
    return False


def _group_markers(item: pytest.Item) -> list[str]:
    names = []
    skips = [mark for mark in item.iter_markers("skipif") if str(mark.kwargs.get("reason", "")).startswith(_NVCC_REASONS)]
    fixtures = getattr(item, "fixturenames", ())
    if skips or "nvcc_builds" in fixtures or "host_check" in fixtures:
        names.append("nvcc")
    if "host_check" in fixtures:
        names.append("hostcheck")
    if "nvcc" not in names:
        seen: set[int] = set()
        definitions = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        functions = [getattr(item, "function", None)] + [d.func for defs in definitions.values() for d in defs]
        if any(_spawns(function, seen) for function in functions if function is not None):
            names.append("multirank")
    return names


@pytest.hookimpl(tryfirst=True)  # before -m deselects by them
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for name in _group_markers(item):
            item.add_marker(name)
