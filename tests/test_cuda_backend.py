"""The ``cuda`` backend through the public ``zcomm.quant`` ops, against ``reference``.

The GPU tests need a CUDA device, a CUDA build of torch and cupy; elsewhere they are
skipped with the reason (and fail under ZCOMM_GPU_CHECK=1, see cuda_support). They cover
byte identity over sweeps of sizes, dtypes and group sizes (both encoder schemes, subnormal
scales), misaligned views, stream ordering, host-sync freedom and CUDA-graph capture. The
tests that run everywhere: selecting ``cuda`` for a CPU tensor, or on a machine that
cannot run it, must fail loudly and say why; the encoder's scheme choice.
"""

from __future__ import annotations

import pytest
import torch

import zcomm.quant as zq
from cuda_cases import DTYPES, make_input, make_payloads
from cuda_support import GPU_UNAVAILABLE, requires_gpu
from zcomm.quant import _registry
from zcomm.quant.backends import _cuda_launch as launchers

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


def test_cuda_backend_status_says_why_it_is_unavailable():
    """Where the backend can run, it reports ``ok``; elsewhere selecting it fails and names what is
    missing. (No skip either way: under ``make gpu-check`` a skip is a failure.)"""
    if GPU_UNAVAILABLE is None:
        assert zq.available_backends()["cuda"] == "ok"
        _registry.load("cuda")
        return
    with pytest.raises(zq.BackendUnavailableError) as info:
        _registry.load("cuda")
    message = str(info.value)
    assert "'cuda'" in message and GPU_UNAVAILABLE in message
    assert any(word in message for word in ("cupy", "CUDA device", "driver", "CPU-only build", "NVRTC"))
    assert zq.available_backends()["cuda"].startswith("unavailable:")


def test_encoder_scheme_for_every_group_size():
    """Groups up to TEAM_MAX_GROUP elements: one team launch, at most a warp per group. Larger
    ones, up to and past 2**31 elements (where the old 32-bit lane indices overflowed from
    2**31 - 256 on), take the two tile passes with one block per tile of TILE_ELEMS."""
    team = launchers.encoder_passes(jobs=1000, group_extent=launchers.TEAM_MAX_GROUP, max_blocks=1056)
    assert team == [(launchers.TEAMS, 125)]
    assert launchers.encoder_passes(jobs=10**6, group_extent=64, max_blocks=1056) == [(launchers.TEAMS, 1056)]
    for extent in (launchers.TEAM_MAX_GROUP + 1, 2**31 - 256, 2**31 - 1, 2**31, 2**40):
        tiles = -(-extent // launchers.TILE_ELEMS)
        passes = launchers.encoder_passes(jobs=3, group_extent=extent, max_blocks=10**9)
        assert passes == [(launchers.TILE_ABSMAX, 3 * tiles), (launchers.TILE_ENCODE, 3 * tiles)], extent
        assert launchers.encoder_passes(jobs=3, group_extent=extent, max_blocks=1056)[0][1] == min(3 * tiles, 1056)


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
@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("dtype", DTYPES)
def test_large_groups_take_the_tile_scheme_and_match_reference(bits, dtype):
    """Groups above launchers.TEAM_MAX_GROUP: one group per tensor, several tiles per group,
    short last groups and tiles, scalar paths; through all three encoder kernels."""
    for n, gs in ((1 << 22, 1 << 22), (3 * 8192 + 6, 3 * 8192 + 6), (200_002, 10_002), (262_144, 40_960)):
        x = make_input(n, gs, dtype, bits, seed=n + gs)
        _same_bytes(zq.quantize(x.to(CUDA), bits, gs, backend="cuda"), zq.quantize(x, bits, gs, backend="reference"))
    x = make_input(8 * 9000 * 2, 20_000, dtype, bits, seed=3)
    perm = (7, 5, 3, 1, 0, 2, 4, 6)
    got = zq.reorder_quantize(x.to(CUDA), perm, 2, bits, 20_000, backend="cuda")
    _same_bytes(got, zq.reorder_quantize(x, perm, 2, bits, 20_000, backend="reference"))
    rows = make_payloads(6 * 9000, 18_000, bits, k=3, seed=4)
    for m in (1, 3):
        got = zq.dequant_reduce(rows.to(CUDA), 6 * 9000, bits, 18_000, requant_chunks=m, divide_by=3.0, backend="cuda")
        want = zq.dequant_reduce(rows, 6 * 9000, bits, 18_000, requant_chunks=m, divide_by=3.0, backend="reference")
        _same_bytes(got, want)


@requires_gpu
@pytest.mark.parametrize("bits", (8, 4))
def test_subnormal_inputs_scales_and_products_are_not_flushed(bits):
    """fp32 groups whose values, scales and dequantized products are subnormal ([Note:
    explicit rounding]): flush-to-zero arithmetic would give zero scales and values."""
    gen = torch.Generator().manual_seed(9)
    tiny = torch.finfo(torch.float32).smallest_normal
    x = torch.randn(64 * 1024, generator=gen) * tiny * torch.rand(64 * 1024, generator=gen)
    payload = zq.quantize(x, bits, 64, backend="reference")
    scales = payload[-4 * 1024 :].view(torch.float32)
    assert bool(((scales > 0) & (scales < tiny)).all())  # the case under test
    _same_bytes(zq.quantize(x.to(CUDA), bits, 64, backend="cuda"), payload)
    got = zq.dequantize(payload.to(CUDA), x.numel(), bits, 64, torch.float32, backend="cuda")
    want = zq.dequantize(payload, x.numel(), bits, 64, torch.float32, backend="reference")
    assert bool((want != 0).any())
    _same_bytes(got, want)


@requires_gpu
def test_kernels_run_on_torchs_current_stream():
    """Input produced and payload consumed on a side stream, with no synchronization between.

    The kernels are compiled and run once beforehand: a first launch compiles for seconds,
    long enough for a delayed producer to finish before a kernel on the wrong stream would
    start. The producer is a device-to-device copy queued behind a long sleep on the side
    stream, and the side stream must still be busy right after the launches, so a kernel on
    any other stream would have read the stale (zero) input or the unwritten payload.
    """
    n, gs = 1 << 20, 128
    x = make_input(n, gs, torch.float32, 8, seed=11)
    source = x.to(CUDA)
    zq.dequantize(zq.quantize(source, 8, gs, backend="cuda"), n, 8, gs, torch.float32, backend="cuda")
    on_device = torch.zeros_like(source)
    payload = torch.zeros(zq.payload_nbytes(n, 8, gs), dtype=torch.uint8, device=CUDA)
    back = torch.zeros(n, dtype=torch.float32, device=CUDA)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # about 0.1 s of GPU clock cycles
        on_device.copy_(source)
        zq.quantize(on_device, 8, gs, backend="cuda", out=payload)
        zq.dequantize(payload, n, 8, gs, torch.float32, backend="cuda", out=back)
    assert not side.query(), "the side stream finished before the check: the race window was closed"
    side.synchronize()
    want = zq.quantize(x, 8, gs, backend="reference")
    _same_bytes(payload, want)
    _same_bytes(back, zq.dequantize(want, n, 8, gs, torch.float32, backend="reference"))


@requires_gpu
def test_first_use_of_a_perm_does_not_synchronize():
    """A perm no other test uses, first seen under torch's sync debug mode set to raise."""
    perm = (4, 0, 3, 1, 2)
    x = make_input(5 * 2 * 4096, 256, torch.bfloat16, 4, seed=21)
    x_dev = x.to(CUDA)
    zq.reorder_quantize(x_dev, (0, 1, 2, 3, 4), 2, 4, 256, backend="cuda")  # compile and load the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = zq.reorder_quantize(x_dev, perm, 2, 4, 256, backend="cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _same_bytes(got, zq.reorder_quantize(x, perm, 2, 4, 256, backend="reference"))


@requires_gpu
def test_ops_replay_from_a_cuda_graph():
    """The encoders (teams and tiles) and decoders captured in a CUDA graph, with a perm and
    tile temporaries first created inside the capture, replay on new inputs to the
    reference bytes. The kernels are loaded before (module loading is no stream work)."""
    n, perm, gs, big = 6 * 16384, (2, 5, 0, 4, 1, 3), 512, 6 * 16384
    warm = torch.randn(n, device=CUDA)
    zq.reorder_quantize(warm, tuple(range(6)), 3, 8, gs, backend="cuda")
    zq.quantize(warm, 8, 2048, backend="cuda")
    zq.dequantize(zq.quantize(warm, 8, gs, backend="cuda"), n, 8, gs, torch.float32, backend="cuda")
    static_x = torch.zeros(n, device=CUDA)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rows = zq.reorder_quantize(static_x, perm, 3, 8, gs, backend="cuda")
        tensor_payload = zq.quantize(static_x, 8, big, backend="cuda")
        back = zq.dequantize(tensor_payload, n, 8, big, torch.float32, backend="cuda")
    for seed in (1, 2):
        x = make_input(n, gs, torch.float32, 8, seed=seed)
        static_x.copy_(x.to(CUDA))
        graph.replay()
        torch.cuda.synchronize()
        _same_bytes(rows, zq.reorder_quantize(x, perm, 3, 8, gs, backend="reference"))
        want = zq.quantize(x, 8, big, backend="reference")
        _same_bytes(tensor_payload, want)
        _same_bytes(back, zq.dequantize(want, n, 8, big, torch.float32, backend="reference"))
