"""Suite-wide pytest hooks.

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

import os
from collections.abc import Generator
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
