"""The ``cuda`` backend through the public ``zcomm.quant`` ops, against ``reference``.

The sweep tests need a CUDA device, a CUDA build of torch and cupy; elsewhere they are
skipped with the reason. The error tests run everywhere: selecting ``cuda`` for a CPU
tensor, or on a machine that cannot run it, must fail loudly and say why.
"""

from __future__ import annotations

import pytest
import torch

import zcomm.quant as zq
from cuda_cases import DTYPES, make_input, make_payloads
from cuda_support import GPU_UNAVAILABLE, requires_gpu
from zcomm.quant import registry

CUDA = torch.device("cuda")
SIZES = (1, 7, 31, 33, 1000, 4096, 65_537, 999_983)
GROUP_SIZES = {8: (32, 7, 128, 2048), 4: (32, 6, 512, 2048)}


def test_cuda_backend_rejects_cpu_tensors():
    with pytest.raises(ValueError, match="backend 'cuda' runs on .*cuda.* got a cpu tensor"):
        zq.quantize(torch.ones(8), 8, 4, backend="cuda")


def test_cuda_backend_from_env_rejects_cpu_tensors(monkeypatch):
    monkeypatch.setenv("ZCOMM_BACKEND", "cuda")
    with pytest.raises(ValueError, match="got a cpu tensor"):
        zq.dequantize(torch.zeros(8, dtype=torch.uint8), 2, 8, 2, torch.float32)


@pytest.mark.skipif(GPU_UNAVAILABLE is None, reason="the cuda backend is available on this machine")
def test_unavailable_cuda_backend_names_what_is_missing():
    with pytest.raises(zq.BackendUnavailableError) as info:
        registry.lookup("quantize", "cuda", CUDA)
    message = str(info.value)
    assert "'cuda'" in message and GPU_UNAVAILABLE in message
    assert any(word in message for word in ("cupy", "CUDA device", "driver", "CPU-only build"))
    assert zq.available_backends()["cuda"].startswith("unavailable:")


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8))


def _sweep(bits: int) -> list[tuple[torch.dtype, int, int]]:
    return [(dtype, gs, n) for dtype in DTYPES for gs in GROUP_SIZES[bits] for n in SIZES]


@requires_gpu
@pytest.mark.parametrize("bits", (8, 4))
def test_quantize_and_dequantize_match_reference(bits):
    for dtype, gs, n in _sweep(bits):
        x = make_input(n, gs, dtype, bits, seed=n)
        payload = zq.quantize(x.to(CUDA), bits, gs, backend="cuda")
        _same_bytes(payload, zq.quantize(x, bits, gs, backend="reference"))
        rows = make_payloads(n, gs, bits, k=3, seed=n)
        for out_dtype in DTYPES:
            got = zq.dequantize(rows.to(CUDA), n, bits, gs, out_dtype, backend="cuda")
            _same_bytes(got, zq.dequantize(rows, n, bits, gs, out_dtype, backend="reference"))


@requires_gpu
@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("slices,num_chunks", ((8, 8), (8, 2), (6, 3), (1, 1)))
def test_reorder_quantize_matches_reference(bits, slices, num_chunks):
    perm = tuple(reversed(range(slices)))[::2] + tuple(reversed(range(slices)))[1::2]
    for dtype in DTYPES:
        for gs in GROUP_SIZES[bits]:
            for n in (slices * num_chunks * 2, slices * num_chunks * 4099, slices * num_chunks * 32 * 1000):
                x = make_input(n, gs, dtype, bits, seed=n + gs)
                got = zq.reorder_quantize(x.to(CUDA), perm, num_chunks, bits, gs, backend="cuda")
                _same_bytes(got, zq.reorder_quantize(x, perm, num_chunks, bits, gs, backend="reference"))


@requires_gpu
@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("k", (1, 4))
@pytest.mark.parametrize("divide_by", (1.0, 4.0, 0.3))
def test_dequant_reduce_matches_reference(bits, k, divide_by):
    for gs in GROUP_SIZES[bits]:
        for n in (6, 6 * 1001, 6 * 65_536):
            rows = make_payloads(n, gs, bits, k=k, seed=n + k)
            for dtype in DTYPES:
                got = zq.dequant_reduce(rows.to(CUDA), n, bits, gs, dtype=dtype, divide_by=divide_by, backend="cuda")
                want = zq.dequant_reduce(rows, n, bits, gs, dtype=dtype, divide_by=divide_by, backend="reference")
                _same_bytes(got, want)
            for m in (1, 2, 3):
                got = zq.dequant_reduce(rows.to(CUDA), n, bits, gs, requant_chunks=m, divide_by=divide_by, backend="cuda")
                want = zq.dequant_reduce(rows, n, bits, gs, requant_chunks=m, divide_by=divide_by, backend="reference")
                _same_bytes(got, want)


@requires_gpu
@pytest.mark.parametrize("bits", (8, 4))
def test_misaligned_views_take_the_scalar_paths_correctly(bits):
    """Inputs and payloads at offsets that rule out vector (and word) access."""
    n, gs = 4096, 32
    x = make_input(n + 1, gs, torch.float32, bits, seed=3)
    shifted = x.to(CUDA)[1:]
    _same_bytes(zq.quantize(shifted, bits, gs, backend="cuda"), zq.quantize(x[1:], bits, gs, backend="reference"))
    rows = make_payloads(n, gs, bits, k=2, seed=5)
    buffer = torch.zeros(rows.numel() + 1, dtype=torch.uint8, device=CUDA)
    odd = buffer[1:].view(rows.shape)
    odd.copy_(rows.to(CUDA))
    got = zq.dequant_reduce(odd, n, bits, gs, requant_chunks=2, backend="cuda")
    _same_bytes(got, zq.dequant_reduce(rows, n, bits, gs, requant_chunks=2, backend="reference"))
    out = torch.empty(zq.payload_nbytes(n, bits, gs) + 1, dtype=torch.uint8, device=CUDA)[1:]
    zq.quantize(x[:n].to(CUDA), bits, gs, backend="cuda", out=out)
    _same_bytes(out, zq.quantize(x[:n], bits, gs, backend="reference"))


@requires_gpu
def test_kernels_run_on_torchs_current_stream():
    """Input produced and payload consumed on a side stream, with no synchronization between."""
    x = make_input(1 << 20, 128, torch.float32, 8, seed=11)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        on_device = torch.empty_like(x, device=CUDA)
        torch.cuda._sleep(50_000_000)  # delay the producer, so a wrong stream would read garbage
        on_device.copy_(x, non_blocking=True)
        payload = zq.quantize(on_device, 8, 128, backend="cuda")
        back = zq.dequantize(payload, x.numel(), 8, 128, torch.float32, backend="cuda")
    side.synchronize()
    _same_bytes(payload, zq.quantize(x, 8, 128, backend="reference"))
    _same_bytes(back, zq.dequantize(payload.cpu(), x.numel(), 8, 128, torch.float32, backend="reference"))
