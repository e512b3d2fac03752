"""The cuda backend's per-launch host objects: made once, looked up after.

* ``loader.launch`` builds one cupy ``ExternalStream`` per raw stream handle and device, not
  one per launch (checked on CPU with a stand-in cupy);
* ``loader.current_raw_stream`` (torch's private ``_cuda_getCurrentRawStream``) gives the
  handle of the public ``torch.cuda.current_stream`` (GPU);
* a launch plan's permutation and interleaved table are device-resident; a capture reads a
  table only once its upload was seen complete, else raises (GPU);
* resolving a launch picks the kernels and index path by size and runs the host checks that
  stand in for the kernels' device checks, raising ``LaunchCheckError`` (CPU, stand-in plans).
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
import torch

import zcomm.quant as zq
from cuda_support import requires_gpu
from zcomm.quant.backends import _cuda_launch as cuda_launch
from zcomm_cuda import loader


def test_one_stream_object_per_raw_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    made, launched = [], []

    class ExternalStream:
        def __init__(self, handle: int, index: int) -> None:
            made.append((handle, index))

    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(ExternalStream=ExternalStream))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(loader, "_STREAMS", {})
    monkeypatch.setattr(loader, "_use_driver", False)  # the cupy launcher, whatever $ZCOMM_CUDA_LAUNCHER says
    handles = iter([11, 11, 22, 11])
    monkeypatch.setattr(loader, "current_raw_stream", lambda index: next(handles))
    monkeypatch.setattr(loader, "_current_device", lambda: 0)
    monkeypatch.setattr(loader, "kernel", lambda source, name, index: lambda *args: launched.append(args))
    for _ in range(4):
        loader.launch("quantize.cu", "k", torch.device("cuda", 0), 2, 256, [1, 2])
    assert made == [(11, 0), (22, 0)]
    assert [args[:3] for args in launched] == [((2,), (256,), (1, 2))] * 4
    streams = [args[4] for args in launched]
    assert streams[0] is streams[1] is streams[3] is not streams[2]


@requires_gpu
def test_raw_stream_is_torchs_current_stream() -> None:
    index = torch.cuda.current_device()
    assert loader.current_raw_stream(index) == torch.cuda.current_stream(index).cuda_stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert loader.current_raw_stream(index) == side.cuda_stream


@requires_gpu
def test_device_tables_outside_and_inside_a_capture() -> None:
    """A launch plan's permutation is on the device when the plan is made (readable from any
    stream); made inside a capture, it is the graph's. The interleaved table is reused for the
    same addresses and stream, and a capture reads it only once its upload was seen complete
    (else CaptureError), keeping it for replays ([Note: device tables])."""
    from zcomm.quant._capture import CaptureError
    from zcomm.quant.backends._cuda_tables import HeldTable, device_perm, interleaved_table

    device = torch.device("cuda", torch.cuda.current_device())
    perm = device_perm((2, 0, 1), device)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert perm.device == device and perm.tolist() == [2, 0, 1]
    xs = [torch.zeros(8, device=device), torch.zeros(16, device=device)]
    held = HeldTable()
    first = held.for_tensors(xs, 2)
    assert held.for_tensors(xs, 2) is first
    torch.cuda.synchronize()
    assert held.for_tensors(xs, 2) is first and held.done
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = device_perm((1, 0), device)
        assert held.for_tensors(xs, 2) is first
        with pytest.raises(CaptureError, match="outside the capture"):
            held.for_tensors(xs[::-1], 2)
    assert held.captured == [first]
    graph.replay()
    torch.cuda.synchronize()
    assert captured.tolist() == [1, 0]
    assert first.tolist()[:6] == interleaved_table(xs, 2)[:6]


def test_magic_divisor_rejects_divisors_past_its_range():
    with pytest.raises(AssertionError):
        cuda_launch.magic_divisor(2**31 + 1, wide=False)
    with pytest.raises(AssertionError):
        cuda_launch.magic_divisor(0, wide=True)


@pytest.mark.parametrize("flat", (True, False), ids=("perm", "interleaved"))
def test_reorder_index_path_is_chosen_by_size(flat, monkeypatch):
    """Inputs of up to 2^31 elements take the 32-bit kernels, larger ones the 64-bit (``_wide``) ones,
    with the multipliers of their path ([Note: magic division]); sizes only, nothing allocated."""
    from cuda_fakes import fake_launch_plans

    fake_launch_plans(monkeypatch)
    for parts, part_numel, wide in ((2, 2**30, False), (4, 2**30, True), (3, 2**31 + 8, True), (1, 96, False)):
        slices, chunks, group = 2, 2, 256
        launch = cuda_launch._resolve_reorder(torch.device("cuda", 0), 1 if flat else 3, flat, parts, part_numel,
                                              (1, 0), chunks, 8, group, torch.bfloat16)
        kind = "quantize" if flat else "interleaved"
        assert launch.encoder.name == f"zc_reorder_{kind}{'_wide' if wide else ''}_bf16_int8", (parts, part_numel)
        # the register scheme's own kernel: interleaved, 32-bit indices, rows of whole runs
        numel = parts * part_numel
        row_nbytes = zq.payload_nbytes(numel // chunks, 8, group)
        held = not flat and not wide and cuda_launch.in_registers(numel // chunks, group, 8, row_nbytes, 0)
        registers = None if launch.registers is None else launch.registers.name
        assert registers == ("zc_reorder_interleaved_regs_bf16_int8" if held else None)
        assert held or flat or wide or parts == 1
        assert [int(a) for a in launch.slice_args] == [numel // slices,
                                                       *cuda_launch.magic_divisor(numel // slices, wide)]
        assert [int(a) for a in launch.part_args] == [3 if not flat else 1, part_numel,
                                                      *cuda_launch.magic_divisor(part_numel, wide)]  # fmt: skip
        assert launch.encoder.jobs == -(-numel // chunks // group) * chunks


def test_requant_launch_checks_name_the_kernels_invariants():
    """The narrow kernel's device check (``divisor_mode(divisor) != MODE || !sizes.describe(...)``
    in requant_rounds.cuh) is made on the host when its launch is resolved
    (``check_narrow_requant``): a LaunchCheckError naming the invariant, never a trap."""
    numel, chunks, group_size = 3 * 1344, 3, 256
    good = cuda_launch.narrow_requant_sizes(numel, chunks, group_size, 8, 4)
    for divide_by, tag in ((1.0, "one"), (2.0, "pow2"), (0.25, "pow2"), (3.0, "div"), (2.0**127, "div")):
        cuda_launch.check_narrow_requant(tag, np.float32(divide_by), good, numel, chunks, group_size, 8, 4)
        for other in {"one", "pow2", "div"} - {tag}:
            with pytest.raises(cuda_launch.LaunchCheckError, match=r"divisor_mode\(divisor\) == MODE"):
                cuda_launch.check_narrow_requant(other, np.float32(divide_by), good, numel, chunks, group_size, 8, 4)
    for wrong in range(4):
        sizes = tuple(v + 4 * (i == wrong) for i, v in enumerate(good))
        with pytest.raises(cuda_launch.LaunchCheckError, match=r"sizes\.describe\(rows, layout\)"):
            cuda_launch.check_narrow_requant("one", np.float32(1.0), sizes, numel, chunks, group_size, 8, 4)
    with pytest.raises(cuda_launch.LaunchCheckError, match=r"sizes\.describe"):  # chunks that do not divide numel
        cuda_launch.check_narrow_requant("one", np.float32(1.0), good, numel + 1, chunks, group_size, 8, 4)


def test_requant_launch_plan_runs_the_checks(monkeypatch):
    """Resolving dequant_reduce_requant's launch plan runs the checks with the sizes it will pass."""
    from cuda_fakes import fake_launch_plans

    fake_launch_plans(monkeypatch)
    device = torch.device("cuda", 0)
    launch = cuda_launch.resolve("dequant_reduce_requant", device, (2, 3 * 1344, 8, 4, 256, 2.0, 3))
    assert launch.narrow_name == "zc_dequant_reduce_requant_regs_pow2_int8_int4"
    monkeypatch.setattr(cuda_launch, "narrow_requant_sizes", lambda *args: (1344, 6, 0, 0))
    with pytest.raises(cuda_launch.LaunchCheckError, match=r"sizes\.describe"):
        cuda_launch.resolve("dequant_reduce_requant", device, (2, 3 * 1344, 8, 4, 256, 2.0, 3))
