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

import numpy as np
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
    """The frames that mean a public op, a spec or the op registry ran per call."""
    return [name for name in entered if name.startswith(("ops.py", "spec.py", "_registry.py", "custom_ops.py"))]


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


def test_cuda_launch_resolves_per_kernel_and_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cuda backend's grid cap is resolved once per (kernel, device index) and its size
    arguments once per sizes; ``cuda`` without an index (whichever device is current) is never cached."""
    from zcomm.quant.backends import _cuda_launch as cuda_launch
    from zcomm_cuda import loader

    resolved = []
    monkeypatch.setattr(cuda_launch, "_MAX_BLOCKS", {})
    monkeypatch.setattr(cuda_launch, "_resident_blocks", lambda source, name, index: resolved.append(index) or 3)
    monkeypatch.setattr(loader, "multiprocessor_count", lambda index: 132)
    monkeypatch.setattr(loader, "device_index", lambda device: 1 if device.index is None else device.index)
    for _ in range(3):
        assert cuda_launch._max_blocks(torch.device("cuda", 0), "dequantize.cu", "k") == 396
    assert resolved == [0]
    cuda_launch._max_blocks(torch.device("cuda", 1), "dequantize.cu", "k")
    cuda_launch._max_blocks(torch.device("cuda"), "dequantize.cu", "k")
    cuda_launch._max_blocks(torch.device("cuda"), "dequantize.cu", "k")
    assert resolved == [0, 1, 1, 1]
    sizes = cuda_launch._sizes(1024, 256, 4)
    assert sizes is cuda_launch._sizes(1024, 256, 4) and [type(v) for v in sizes] == [np.int64] * 3
    assert cuda_launch._name("zc_dequantize_{}_int{}", torch.bfloat16, 4) == "zc_dequantize_bf16_int4"


def test_cuda_launch_memos_resolve_once_per_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """An encoder's launches and a decoder's name, grid and size arguments are resolved once per
    sizes and device index, then looked up; the memos never remember ``cuda`` without an index."""
    from zcomm.quant.backends import _cuda_launch as cuda_launch
    from zcomm_cuda import loader

    planned, launched = [], []
    monkeypatch.setattr(cuda_launch, "_ENCODER_PASSES", {})
    monkeypatch.setattr(cuda_launch, "_DECODER_MEMO", {})
    monkeypatch.setattr(cuda_launch, "encoder_passes", lambda jobs, extent, cap: planned.append(jobs) or [(0, 4)])
    monkeypatch.setattr(cuda_launch, "_max_blocks", lambda device, source, name: 10)
    monkeypatch.setattr(loader, "launch", lambda *args: launched.append(args))
    for device in (torch.device("cuda", 0),) * 3 + (torch.device("cuda"),) * 2:
        cuda_launch._encode("quantize.cu", "k", device, 8, 256, (1,))
    assert planned == [8, 8, 8] and len(launched) == 5
    assert launched[0][5][-1] is cuda_launch._PASSES[0] and launched[0][5][-2] == 0  # no group_absmax buffer
    resolved = []
    monkeypatch.setattr(cuda_launch, "_resolve_dequantize", lambda *args: resolved.append(args) or ("name", 1, ()))
    for device in (torch.device("cuda", 0),) * 3 + (torch.device("cuda"),) * 2:
        payloads = SimpleNamespace(shape=(4, 1040), device=device, data_ptr=lambda: 16)
        out = SimpleNamespace(dtype=torch.float32, data_ptr=lambda: 32)
        cuda_launch.dequantize(payloads, 1024, 8, 256, out)
    assert len(resolved) == 3 and len(cuda_launch._DECODER_MEMO) == 1 and len(launched) == 10
