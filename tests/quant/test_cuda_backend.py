"""What the ``cuda`` backend promises beyond its bytes (those are checked against the
reference for every backend in test_quant_vs_reference.py and test_wire_format.py).

The GPU tests need a CUDA device, a CUDA build of torch and cupy; elsewhere they are
skipped with the reason (and fail under ZCOMM_GPU_CHECK=1, see cuda_support). They cover
stream ordering, host-sync freedom and CUDA-graph capture. The tests that run everywhere:
selecting ``cuda`` where it cannot run must fail loudly and say why; the encoder's scheme
choice.
"""

from __future__ import annotations

import pytest
import torch

import zcomm.quant as zq
from cuda_support import GPU_UNAVAILABLE, requires_gpu
from quant_cases import assert_same_bytes, make_hard_input
from zcomm.quant import _registry
from zcomm.quant.backends import _cuda_launch as cuda_launch

CUDA = torch.device("cuda")


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
    team = cuda_launch.encoder_passes(jobs=1000, group_extent=cuda_launch.TEAM_MAX_GROUP, max_blocks=1056)
    assert team == [(cuda_launch.TEAMS, 125)]
    assert cuda_launch.encoder_passes(jobs=10**6, group_extent=64, max_blocks=1056) == [(cuda_launch.TEAMS, 1056)]
    for extent in (cuda_launch.TEAM_MAX_GROUP + 1, 2**31 - 256, 2**31 - 1, 2**31, 2**40):
        tiles = -(-extent // cuda_launch.TILE_ELEMS)
        passes = cuda_launch.encoder_passes(jobs=3, group_extent=extent, max_blocks=10**9)
        assert passes == [(cuda_launch.TILE_ABSMAX, 3 * tiles), (cuda_launch.TILE_ENCODE, 3 * tiles)], extent
        assert cuda_launch.encoder_passes(jobs=3, group_extent=extent, max_blocks=1056)[0][1] == min(3 * tiles, 1056)


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
    x = make_hard_input(n, gs, torch.float32, 8, seed=11)
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
    assert_same_bytes(payload, want, "payload")
    assert_same_bytes(back, zq.dequantize(want, n, 8, gs, torch.float32, backend="reference"), "dequantized")


@requires_gpu
def test_first_use_of_a_perm_does_not_synchronize():
    """A perm no other test uses, first seen under torch's sync debug mode set to raise."""
    perm = (4, 0, 3, 1, 2)
    x = make_hard_input(5 * 2 * 4096, 256, torch.bfloat16, 4, seed=21)
    x_dev = x.to(CUDA)
    zq.reorder_quantize(x_dev, (0, 1, 2, 3, 4), 2, 4, 256, backend="cuda")  # compile and load the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = zq.reorder_quantize(x_dev, perm, 2, 4, 256, backend="cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_same_bytes(got, zq.reorder_quantize(x, perm, 2, 4, 256, backend="reference"), "rows")


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
        x = make_hard_input(n, gs, torch.float32, 8, seed=seed)
        static_x.copy_(x.to(CUDA))
        graph.replay()
        torch.cuda.synchronize()
        assert_same_bytes(rows, zq.reorder_quantize(x, perm, 3, 8, gs, backend="reference"), "rows")
        want = zq.quantize(x, 8, big, backend="reference")
        assert_same_bytes(tensor_payload, want, "one-group payload")
        assert_same_bytes(back, zq.dequantize(want, n, 8, big, torch.float32, backend="reference"), "dequantized")
