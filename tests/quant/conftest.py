"""Fixtures of the quantization tests: the backends under test, each on the device it runs on.

``target`` is every backend/device pair that must reproduce the oracle (the ``reference``
backend on CPU tensors) byte for byte: ``cpu`` on CPU tensors, ``reference`` on CUDA tensors
and ``cuda`` on CUDA tensors. ``any_target`` adds the oracle itself, for the golden payloads
written down from the wire format. Pairs that cannot run here are skipped with the reason
(failed under ``ZCOMM_GPU_CHECK=1``, see tests/cuda_support.py). The test ids name the pair
(``[cpu-on-cpu]``, ``[cuda-on-cuda]``...), so ``-k on-cuda`` selects the GPU runs.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import pytest
import torch

import host_check_server
from cuda_support import NVCC, NVRTC_UNAVAILABLE, requires_cuda_device, requires_gpu
from host_check_server import HostCheck
from nvcc_builds import Builds
from quant_cases import Target

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
ORACLE = pytest.param(Target("reference", CPU), id="reference-on-cpu")
TARGETS = (
    pytest.param(Target("cpu", CPU), id="cpu-on-cpu"),
    pytest.param(Target("reference", CUDA), id="reference-on-cuda", marks=requires_cuda_device),
    pytest.param(Target("cuda", CUDA), id="cuda-on-cuda", marks=requires_gpu),
)


@pytest.fixture(params=TARGETS)
def target(request: pytest.FixtureRequest) -> Target:
    return request.param


@pytest.fixture(params=(ORACLE, *TARGETS))
def any_target(request: pytest.FixtureRequest) -> Target:
    return request.param


# ---- nvcc's builds, started when collection ends ([Note: background builds] in nvcc_builds.py) ----
_BUILDS = pytest.StashKey[Builds]()


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    for item in session.items:
        builds_of = getattr(getattr(item, "module", None), "builds_of", None)
        if builds_of is not None:
            builds_of(item, _builds(session))


def _builds(session: pytest.Session) -> Builds:
    if _BUILDS not in session.stash:
        folder = Path(tempfile.mkdtemp(prefix="zcomm-builds-"))
        session.stash[_BUILDS] = Builds(NVCC, NVRTC_UNAVAILABLE is None, folder)
    return session.stash[_BUILDS]


def pytest_sessionfinish(session: pytest.Session) -> None:
    builds = session.stash.get(_BUILDS, None)
    if builds is not None:
        builds.close()
        shutil.rmtree(builds.folder, ignore_errors=True)


@pytest.fixture(scope="session")
def nvcc_builds(request: pytest.FixtureRequest) -> Builds:
    """The session's nvcc and NVRTC builds ([Note: background builds] in nvcc_builds.py)."""
    return _builds(request.session)


@pytest.fixture(scope="module")
def host_check(nvcc_builds: Builds, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostCheck]:
    """The host check built once per session, one process per module serving every case
    ([Note: host check server])."""
    binary = nvcc_builds.result(host_check_server.SOURCE, lambda: host_check_server.build(nvcc_builds))
    server = HostCheck(binary, tmp_path_factory.mktemp("host_check"))
    yield server
    server.close()
