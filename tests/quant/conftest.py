"""Fixtures of the quantization tests: the backends under test, each on the device it runs on.

``target`` is every backend/device pair that must reproduce the oracle (the ``reference``
backend on CPU tensors) byte for byte: ``cpu`` on CPU tensors, ``reference`` on CUDA tensors
and ``cuda`` on CUDA tensors. ``any_target`` adds the oracle itself, for the golden payloads
written down from the wire format. Pairs that cannot run here are skipped with the reason
(failed under ``ZCOMM_GPU_CHECK=1``, see tests/cuda_support.py). The test ids name the pair
(``[cpu-on-cpu]``, ``[cuda-on-cuda]``...), so ``-k on-cuda`` selects the GPU runs.
"""

from __future__ import annotations

import pytest
import torch

from cuda_support import requires_cuda_device, requires_gpu
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
