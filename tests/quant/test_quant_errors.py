"""Bad input and backend selection: clear errors naming the argument, never a silent fallback.

The kernel table of ``zcomm.quant._contract`` is patched here (a spy, a backend that lost its
kernels) to see which backend's kernel an op runs.
"""

from __future__ import annotations

import sys

import pytest
import torch

import zcomm.quant as q
from zcomm.quant import _contract

BACKENDS = ("reference", "cpu")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("call", "error", "names"),
    [
        (lambda b: q.quantize(torch.zeros(8, dtype=torch.float64), 8, 4, backend=b), TypeError, "x must have dtype in"),
        (lambda b: q.quantize(torch.zeros(8, dtype=torch.int32), 8, 4, backend=b), TypeError, "x must have dtype in"),
        (lambda b: q.quantize(torch.zeros(16)[::2], 8, 4, backend=b), ValueError, "x must be contiguous"),
        (lambda b: q.quantize(torch.zeros(8), 2, 4, backend=b), ValueError, "bits"),
        (lambda b: q.quantize(torch.zeros(8), 8.0, 4, backend=b), TypeError, "bits"),
        (lambda b: q.quantize(torch.zeros(8), 8, 1, backend=b), ValueError, "group_size"),
        (lambda b: q.quantize(torch.zeros(8), 4, 5, backend=b), ValueError, "group_size must be even"),
        (lambda b: q.quantize(torch.zeros(8), 8, "block", backend=b), TypeError, "group_size must be an int"),
        (lambda b: q.quantize(torch.zeros(8), 8, 4, backend=b, out=torch.empty(3, dtype=torch.uint8)), ValueError, "out"),
        (
            lambda b: q.quantize(torch.zeros(8), 8, 4, backend=b, out=torch.empty(16, dtype=torch.uint8, device="meta")),
            ValueError,
            "out is on meta",
        ),
        (lambda b: q.dequantize(torch.zeros(11, dtype=torch.uint8), 8, 8, 4, torch.float32, backend=b), ValueError, "payload has 11 bytes"),
        (lambda b: q.dequantize(torch.zeros(16, dtype=torch.int8), 8, 8, 4, torch.float32, backend=b), TypeError, "payload must have dtype torch.uint8"),
        (lambda b: q.dequantize(torch.zeros(16, dtype=torch.uint8), 8, 8, 4, torch.int8, backend=b), TypeError, "dtype must have dtype in"),
        (lambda b: q.dequantize(torch.zeros(16, dtype=torch.uint8), -1, 8, 4, torch.float32, backend=b), ValueError, "numel"),
        (lambda b: q.reorder_quantize(torch.zeros(9), (1, 0), 1, 8, 4, backend=b), ValueError, "len(perm)"),
        (lambda b: q.reorder_quantize(torch.zeros(8), (1, 1), 1, 8, 4, backend=b), ValueError, "perm"),
        (lambda b: q.reorder_quantize(torch.zeros(8), (1, 0), 3, 8, 4, backend=b), ValueError, "num_chunks"),
        (lambda b: q.reorder_quantize([], (0,), 1, 8, 4, backend=b), ValueError, "non-empty sequence"),
        (lambda b: q.reorder_quantize([torch.zeros(4), torch.zeros(4).half()], (0,), 1, 8, 4, backend=b), ValueError, "is torch.float16 on cpu but"),
        (lambda b: q.reorder_quantize([torch.zeros(4), torch.zeros(3)], (0,), 1, 8, 4, parts=2, backend=b), ValueError, "numel()=3 is not divisible into parts=2"),
        (lambda b: q.reorder_quantize(torch.zeros(8), (0,), 1, 8, 4, parts=0, backend=b), ValueError, "parts must be a positive int"),
        (lambda b: q.reorder_quantize(torch.zeros(8), (0,), 1, 8, 4, parts=2, part_numel=3, backend=b), ValueError, "part_numel=3 is shorter than the 4"),
        (lambda b: q.dequant_reduce(torch.zeros(16, dtype=torch.uint8), 8, 8, 4, backend=b), ValueError, "payloads"),
        (lambda b: q.dequant_reduce(torch.zeros(2, 15, dtype=torch.uint8), 8, 8, 4, backend=b), ValueError, "payloads"),
        (lambda b: q.dequant_reduce(torch.zeros(2, 16, dtype=torch.uint8), 8, 8, 4, divide_by=0, backend=b), ValueError, "divide_by"),
        (lambda b: q.dequant_reduce(torch.zeros(2, 16, dtype=torch.uint8), 8, 8, 4, requant_chunks=3, backend=b), ValueError, "requant_chunks"),
        (lambda b: q.dequant_reduce(torch.zeros(2, 16, dtype=torch.uint8), 8, 8, 4, requant_bits=4, backend=b), ValueError, "requant_bits needs requant_chunks"),
        (lambda b: q.dequant_reduce(torch.zeros(2, 17, dtype=torch.uint8), 9, 8, 3, requant_chunks=1, requant_bits=4, backend=b), ValueError, "group_size must be even"),
        (lambda b: q.dequant_reduce(torch.zeros(2, 16, dtype=torch.uint8), 8, 8, 4, requant_chunks=1, requant_bits=2, backend=b), ValueError, "bits must be one of"),
    ],
)
def test_bad_input_names_the_argument(backend: str, call, error: type, names: str) -> None:
    with pytest.raises(error, match=names.replace("(", r"\(").replace(")", r"\)")):
        call(backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", q.SUPPORTED_DTYPES)
def test_empty_tensor_gives_empty_payload(backend: str, dtype: torch.dtype) -> None:
    payload = q.quantize(torch.empty(0, dtype=dtype), 8, 32, backend=backend)
    assert payload.dtype == torch.uint8 and payload.shape == (0,)
    assert q.dequantize(payload, 0, 8, 32, dtype, backend=backend).shape == (0,)
    assert q.reorder_quantize(torch.empty(0, dtype=dtype), (1, 0), 2, 4, 32, backend=backend).shape == (2, 0)
    reduced = q.dequant_reduce(torch.empty(3, 0, dtype=torch.uint8), 0, 4, 32, dtype=dtype, backend=backend)
    assert reduced.dtype == dtype and reduced.shape == (0,)


def test_backend_for_another_device_is_refused() -> None:
    with pytest.raises(ValueError, match="backend 'cuda' runs on .*cuda.* got a cpu tensor"):
        q.quantize(torch.zeros(8), 8, 4, backend="cuda")


@pytest.mark.parametrize("numel", (8, 0))
def test_unknown_backend_lists_the_known_ones(numel: int) -> None:
    """Also for an empty tensor, where no kernel runs."""
    with pytest.raises(ValueError, match=r"backend must be one of \['cpu', 'cuda', 'reference'\], got 'numpy'"):
        q.quantize(torch.zeros(numel), 8, 4, backend="numpy")


def test_missing_numba_makes_cpu_unavailable_not_a_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """With numba not importable, selecting ``cpu`` raises BackendUnavailableError naming it."""
    monkeypatch.setitem(sys.modules, "numba", None)
    for module in ("zcomm.quant.backends.cpu", "zcomm.quant.backends._cpu_float_bits"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    for op in _contract.OPS:
        monkeypatch.delitem(_contract._KERNELS, (op, "cpu"), raising=False)
    with pytest.raises(q.BackendUnavailableError, match="'cpu' is unavailable.*numba"):
        q.quantize(torch.zeros(8), 8, 4)
    assert q.available_backends()["cpu"].startswith("unavailable")


@pytest.mark.parametrize("name", ("reference", "cpu"))
def test_zcomm_backend_env_selects_the_kernel(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    calls = []
    real = _contract.kernel("quantize", name)

    def spy(*args):
        calls.append(name)
        real(*args)

    monkeypatch.setitem(_contract._KERNELS, ("quantize", name), spy)
    monkeypatch.setenv("ZCOMM_BACKEND", name)
    q.quantize(torch.ones(8), 8, 4)
    assert calls == [name]


def test_zcomm_backend_env_with_unknown_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZCOMM_BACKEND", "gpu")
    with pytest.raises(ValueError, match="got 'gpu'"):
        q.quantize(torch.ones(8), 8, 4)
