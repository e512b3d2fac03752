"""The host path of one op call, counted in Python function calls so a regression shows anywhere.

Timing depends on the machine; the number of Python frames one call enters does not. Each
bound is what the path costs today with a little slack, and at most a third of the path
before the ops were defined with ``Library.define`` and validated once (101 frames for one
``quantize`` on the ``cpu`` backend: spec objects built three times, the checks run twice,
``torch.library.custom_op``'s Python wrappers, ctypes pointer objects per array). A change
that adds frames to every call must raise a bound here, on purpose.
"""

from __future__ import annotations

from types import SimpleNamespace

import sys
from typing import Callable

import pytest
import torch

import zcomm.quant as q
from frame_count import entered_functions

NUMEL = 1024


def _frames(call: Callable[[], object]) -> list[str]:
    """The Python functions one ``call()`` enters (C functions are not counted)."""
    call()  # warm: numba compiled, backend loaded, caches filled
    entered = entered_functions(call)
    assert entered[0].endswith("<lambda>"), entered
    return entered[1:]  # the frames of the call itself, without this test's lambda


@pytest.fixture(autouse=True)
def _default_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZCOMM_BACKEND", raising=False)


def test_quantize_frames() -> None:
    x = torch.randn(NUMEL)
    out = torch.empty(q.payload_nbytes(NUMEL, 8, 256), dtype=torch.uint8)
    entered = _frames(lambda: q.quantize(x, 8, 256, out=out))
    assert len(entered) <= 16, "\n".join(entered)  # 13; 16 while the backend built numpy views per call
    # the checks run once: no QuantSpec is built and the op enters its kernel directly; a small
    # payload is quantized by address ([Note: small quantize by address]): no numpy view is built
    assert not [name for name in entered if "spec.py" in name or "custom_ops.py" in name], entered
    assert not [name for name in entered if name.endswith((":shared_array", ":_zero_padding", ":_quantize_into"))]


def test_dequantize_frames() -> None:
    rows = q.quantize(torch.randn(NUMEL), 8, 256).view(1, -1).expand(4, -1).contiguous()
    out = torch.empty(4 * NUMEL, dtype=torch.float32)
    entered = _frames(lambda: q.dequantize(rows, NUMEL, 8, 256, torch.float32, out=out))
    assert len(entered) <= 17, "\n".join(entered)  # 14; 22 while the backend built numpy views per call
    assert not [name for name in entered if name.endswith((":shared_array", ":kernel_view"))], entered


def test_reference_backend_is_its_own_namespace() -> None:
    """``backend="reference"`` calls ``torch.ops.zcomm_reference``: the oracle, chosen explicitly."""
    x = torch.randn(NUMEL)
    entered = _frames(lambda: q.quantize(x, 8, 256, backend="reference"))
    assert "reference.py:quantize" in entered and "cpu.py:quantize" not in entered
    entered = _frames(lambda: q.quantize(x, 8, 256))
    assert "cpu.py:quantize" in entered and "reference.py:quantize" not in entered


@pytest.fixture
def world_of_one(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _chain_frames(call: Callable[[], object]) -> tuple[list[str], list[str]]:
    """(the caller's frames, zcomm's frames on the reduce worker) of one sync qgZ ``call()``.

    The chain runs on the group's FIFO worker of reductions ([Note: worker ordering] in
    zcomm._chain_runner): the profile is installed on that thread by a task queued on it, and
    only frames of zcomm's own files are kept there (the executor's bookkeeping around the
    chain is not zcomm's path).
    """
    import threading

    import torch.distributed as dist

    from zcomm import _chain_runner
    from zcomm.topology import Topology

    call()  # warm: plans, kernels, the worker thread
    worker = _chain_runner._ordered_worker(dist.group.WORLD, Topology(world_size=1, local_size=1), "reduce")
    assert worker.submit(threading.get_ident).result() != threading.get_ident()
    entered: list[str] = []
    on_worker: list[str] = []

    def recorder(into: list[str], zcomm_only: bool):  # noqa: ANN202
        def profile(frame, event, arg) -> None:
            if event == "call" and (not zcomm_only or "/zcomm/" in frame.f_code.co_filename):
                into.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}")
        return profile

    worker.submit(sys.setprofile, recorder(on_worker, True)).result()
    sys.setprofile(recorder(entered, False))
    try:
        call()
    finally:
        sys.setprofile(None)
        worker.submit(sys.setprofile, None).result()
    assert entered[0].endswith("<lambda>"), entered
    return entered[1:], on_worker


def _no_public_ops(entered: list[str]) -> list[str]:
    """The frames that mean a public op, a spec or the registry ran per call, or that the plan's
    worker or stats row was looked up again ([Note: held workers], [Note: held stats rows])."""
    return [name for name in entered if name.startswith(("ops.py", "spec.py", "_registry.py", "custom_ops.py"))
            or name.endswith((":prologue", ":prologue_coalesced", ":detect", ":_make_plan", ":_ordered_worker",
                              ":stats_row", ":record"))]


def test_reduce_scatter_q4_coalesced_frames(world_of_one) -> None:
    """A coalesced call of a bucket of 4 tensors: the prologue comes from its cache (one pass
    over the tensors to build the key, no checks), the plan from its cache, and the chain
    calls the backend's kernels directly."""
    import zcomm

    inputs = [torch.randn(n) for n in (100, 200, 300, 424)]
    flat = torch.empty(NUMEL)
    outputs = list(flat.split([100, 200, 300, 424]))
    entered, chain = _chain_frames(lambda: zcomm.reduce_scatter_q4_coalesced(outputs, inputs))
    assert len(entered) <= 35, "\n".join(entered)  # 31 at the last count; the full prologue per call is ~100
    assert not _no_public_ops(entered + chain), entered + chain
    assert len(chain) <= 25, "\n".join(chain)


def test_reduce_scatter_q4_error_feedback_frames(world_of_one) -> None:
    """With error feedback the chain still calls the plan's kernels directly: restoring the
    stored errors, compensating, quantizing and storing them run no public op, spec or check."""
    import zcomm

    x, out = torch.randn(NUMEL), torch.empty(NUMEL)
    feedback = zcomm.ErrorFeedback()
    entered, chain = _chain_frames(lambda: zcomm.reduce_scatter_q4(out, x, error_feedback=feedback))
    assert feedback.calls == 2
    assert len(entered) <= 36, "\n".join(entered)  # 32 at the last count
    assert not _no_public_ops(entered + chain), entered + chain
    assert "cpu.py:reorder_quantize" in chain and "cpu.py:dequantize" in chain and "cpu.py:quantize" in chain, chain
    # 34 zcomm frames (47 with numpy views of the small dequantize's tensors); 87 through the public ops
    assert len(chain) <= 40, "\n".join(chain)


def test_all_gather_q8_frames(tmp_path) -> None:
    """One ``all_gather_q8`` call on a world of one (gloo), on the calling thread: the prologue
    and the plan come from their caches (no topology detection, no environment read, no
    checks run again), then the chain is handed to the gather worker (whose frames run on
    its thread and are not counted here)."""
    import torch.distributed as dist

    import zcomm

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        x = torch.randn(NUMEL)
        out = torch.empty(NUMEL)
        entered = _frames(lambda: zcomm.all_gather_q8(out, x))
        assert len(entered) <= 29, "\n".join(entered)  # 25 at the last count; ~31 with the worker and stats looked up per call
        assert not [name for name in entered if name.endswith((":detect", ":prologue", ":_make_plan", ":get",
                                                               ":_ordered_worker", ":stats_row", ":record"))
                    and not name.startswith("weakref.py")], entered
    finally:
        dist.destroy_process_group()


def test_cuda_kernels_resolve_once_per_kernel_and_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cuda backend compiles, loads and sizes a kernel once per (kernel, device index)
    (``resolve_kernel``): later launch plans of any sizes look its grid cap up."""
    from zcomm.quant.backends import _cuda_launch as cuda_launch
    from zcomm_cuda import loader

    loaded = []
    monkeypatch.setattr(cuda_launch, "_MAX_BLOCKS", {})
    monkeypatch.setattr(loader, "kernel", lambda source, name, index: loaded.append((name, index)) or object())
    monkeypatch.setattr(cuda_launch, "_occupancy", lambda function, name, index: 3)
    monkeypatch.setattr(loader, "multiprocessor_count", lambda index: 132)
    for _ in range(3):
        assert cuda_launch.resolve_kernel("dequantize.cu", "k", 0) == 396
    assert loaded == [("k", 0)]
    cuda_launch.resolve_kernel("dequantize.cu", "k", 1)
    cuda_launch.resolve_kernel("dequantize.cu", "other", 1)
    assert loaded == [("k", 0), ("k", 1), ("other", 1)]


def test_cuda_op_launch_plans_resolve_once_per_arguments(monkeypatch: pytest.MonkeyPatch) -> None:
    """A public op's launch plan (name, grid, size arguments) is resolved once per arguments and
    device index and kept in the op plans' BoundedCache; ``cuda`` without an index is never kept."""
    from zcomm.quant.backends import _cuda_launch as cuda_launch
    from zcomm_cuda import loader

    launched, resolved = [], []
    monkeypatch.setattr(cuda_launch, "OP_PLANS", cuda_launch.BoundedCache(8))
    monkeypatch.setattr(loader, "launch", lambda *args: launched.append(args))
    monkeypatch.setattr(loader, "device_index", lambda device: 1 if device.index is None else device.index)
    launch = cuda_launch.DequantizeLaunch("dequantize.cu", "name", torch.device("cuda", 0), 1, ())
    monkeypatch.setattr(cuda_launch, "_resolve_dequantize", lambda *args: resolved.append(args) or launch)
    for device in (torch.device("cuda", 0),) * 3 + (torch.device("cuda"),) * 2:
        payloads = SimpleNamespace(shape=(4, 1040), device=device, data_ptr=lambda: 16)
        out = SimpleNamespace(dtype=torch.float32, data_ptr=lambda: 32)
        cuda_launch.dequantize(payloads, 1024, 8, 256, out)
    assert len(resolved) == 3 and len(cuda_launch.OP_PLANS) == 1 and len(launched) == 5
    assert launched[0][5] == (16, 32)
