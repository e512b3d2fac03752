"""Fixtures shared by the benchmark tests.

``bench`` is not installed: it runs from the checkout, so a test that starts
``python -m bench.<suite>`` in a child process gives it :func:`checkout_env`, the same
environment the demo and gpu-check give their children.
"""

from __future__ import annotations

import os

import pytest

from bench.harness.checkout import checkout_environment
from bench.simcluster import launcher


@pytest.fixture
def checkout_env() -> dict[str, str]:
    """This process's environment with the checkout first on ``PYTHONPATH``."""
    return checkout_environment(os.environ)


@pytest.fixture
def simcluster_host() -> None:
    """Skip the test unless this machine can host ``bench.simcluster`` (root and iproute2)."""
    problem = launcher.missing_prerequisite()
    if problem is not None:
        pytest.skip(problem)
