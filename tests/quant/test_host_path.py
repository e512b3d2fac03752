"""The host path of one op or collective call, counted in Python function calls so a regression shows anywhere.

Timing depends on the machine; the number of Python frames one call enters does not. The bounds
leave the structure free (which functions, files or caches a call runs through) and catch a
call that does more:

* an op call (``quantize``, ``dequantize``) enters at most its count today plus a margin of a
  few frames, and runs no spec object or ``custom_op`` wrapper (the ops are defined with
  ``Library.define`` and validated once);
* a collective's call on the caller's thread enters at most ``COLLECTIVE_RATIO`` times the frames
  of torch's own ``all_reduce`` on the same group (torch's Python wrappers: what any
  collective call pays); on the worker that runs its chain, at most a margin over today's
  count of zcomm's frames; and a repeated call (same sizes) at most a third of the frames of
  the first call of new sizes, which resolves the call's plan: what is resolved once per sizes
  is not resolved again, wherever it is kept.

A change that adds frames to every call must raise a bound here, on purpose.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Callable

import pytest
import torch

import zcomm.quant as q
from frame_count import entered_functions

NUMEL = 1024
# an op call: today's count plus this many frames (a numpy view built per call costs 3)
OP_MARGIN = 2
# a collective's call on the caller's thread: at most this many times the frames of torch's all_reduce
# (today all_gather_q8 enters 26, reduce_scatter_q4_coalesced 32 and reduce_scatter_q4 with error
# feedback 32 where all_reduce enters 11, with torch 2.13)
COLLECTIVE_RATIO = 3.5


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
    assert len(entered) <= 13 + OP_MARGIN, "\n".join(entered)
    # the checks run once: no QuantSpec is built and the op enters its kernel directly
    assert not [name for name in entered if "spec.py" in name or "custom_ops.py" in name], entered


def test_dequantize_frames() -> None:
    rows = q.quantize(torch.randn(NUMEL), 8, 256).view(1, -1).expand(4, -1).contiguous()
    out = torch.empty(4 * NUMEL, dtype=torch.float32)
    entered = _frames(lambda: q.dequantize(rows, NUMEL, 8, 256, torch.float32, out=out))
    assert len(entered) <= 14 + OP_MARGIN, "\n".join(entered)
    assert not [name for name in entered if "spec.py" in name or "custom_ops.py" in name], entered


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


def _torch_frames() -> int:
    """The frames of torch's own ``all_reduce`` on the default group: what any collective call
    pays in torch's Python wrappers, the stable measure of the collectives' bounds."""
    import torch.distributed as dist

    x = torch.zeros(8)
    return len(_frames(lambda: dist.all_reduce(x)))


def _resolved_once(call_of_sizes: Callable[[int], Callable[[], object]]) -> None:
    """A repeated call of sizes seen before enters at most a third of the frames of the first call
    of new sizes (``call_of_sizes(numel)`` makes a call of ``numel`` elements)."""
    call_of_sizes(NUMEL)()  # kernels built, workers started
    first = len(entered_functions(call_of_sizes(3 * NUMEL + 64)))  # sizes no test has used
    again = len(entered_functions(call_of_sizes(3 * NUMEL + 64)))
    assert again <= first / 3, (again, first)


def _coalesced(numel: int) -> Callable[[], object]:
    import zcomm

    sizes = [numel // 8, numel // 4, numel // 4, numel - numel // 8 - 2 * (numel // 4)]
    inputs, outputs = [torch.randn(n) for n in sizes], list(torch.empty(numel).split(sizes))
    return lambda: zcomm.reduce_scatter_q4_coalesced(outputs, inputs)


def test_reduce_scatter_q4_coalesced_frames(world_of_one) -> None:
    """A coalesced call of a bucket of 4 tensors: what the call resolves (checks, plan) is not
    resolved again, and the chain calls the backend's kernels directly."""
    entered, chain = _chain_frames(_coalesced(NUMEL))
    assert len(entered) <= COLLECTIVE_RATIO * _torch_frames(), "\n".join(entered)
    assert not _no_public_ops(entered + chain), entered + chain
    assert len(chain) <= 25, "\n".join(chain)  # zcomm's frames on the worker: 20 today
    _resolved_once(_coalesced)


def test_reduce_scatter_q4_error_feedback_frames(world_of_one) -> None:
    """With error feedback the chain still calls the plan's kernels directly: restoring the
    stored errors, compensating, quantizing and storing them run no public op, spec or check."""
    import zcomm

    x, out = torch.randn(NUMEL), torch.empty(NUMEL)
    feedback = zcomm.ErrorFeedback()
    entered, chain = _chain_frames(lambda: zcomm.reduce_scatter_q4(out, x, error_feedback=feedback))
    assert feedback.calls == 2
    assert len(entered) <= COLLECTIVE_RATIO * _torch_frames(), "\n".join(entered)
    assert not _no_public_ops(entered + chain), entered + chain
    assert len(chain) <= 44, "\n".join(chain)  # zcomm's frames on the worker: 35 today, 87 through the public ops


def test_all_gather_q8_frames(tmp_path) -> None:
    """One ``all_gather_q8`` call on a world of one (gloo), on the calling thread: what the call
    resolves (topology, environment, checks, plan) is not resolved again, then the chain is
    handed to the gather worker (whose frames run on its thread and are not counted here)."""
    import torch.distributed as dist

    import zcomm

    def gather(numel: int) -> Callable[[], object]:
        x, out = torch.randn(numel), torch.empty(numel)
        return lambda: zcomm.all_gather_q8(out, x)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        entered = _frames(gather(NUMEL))
        assert len(entered) <= COLLECTIVE_RATIO * _torch_frames(), "\n".join(entered)
        assert not _no_public_ops(entered), entered
        _resolved_once(gather)
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
