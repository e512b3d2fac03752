"""zcomm's collectives on CUDA tensors with NCCL, at world size 1 (``make gpu-check``).

One GPU cannot host two NCCL ranks, so this runs one rank, with the world bound to the
device (``init_process_group(device_id=...)``, under which zcomm's groups are split from
the caller's group; each bound case in a new process, [Note: one bound world per process])
and unbound. A re-initialised bound world must get zcomm's clear error, not torch's crash. It checks, on CUDA tensors, sync and async:

* ``all_gather_q8`` / ``reduce_scatter_q4`` against torch.distributed's own collectives on
  fp64 copies, within the error bounds of ``collective_oracles`` (``collective_checks``),
  with the ``cuda`` backend and with the ``reference`` backend, ``group_size="tensor"`` included;
* that the CUDA path gives the CPU path's bytes: the same collective on a gloo twin of the
  world with CPU tensors (the ``cpu`` backend, or ``reference`` on both sides);
* the counted ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, also on an hpZ block;
* that an async handle's ``is_completed()`` is False while the GPU is still busy after
  ``wait()`` (which only orders the current stream after the collective), True once done;
  this also fails if an async call (after a warm-up) blocks the host until the GPU is done.

Where CUDA, NCCL or (for the ``cuda`` backend) cupy is missing, the tests skip and say
why; with ``ZCOMM_GPU_CHECK=1`` (set by ``make gpu-check``) they fail instead.
"""

from __future__ import annotations

import os
import signal
import time
import traceback
from itertools import islice
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zcomm
from collective_checks import cases, check_case, check_plain_collectives, make_inputs, tensor_cases
from zcomm_cuda import unavailable_reason

GPU_CHECK = os.environ.get("ZCOMM_GPU_CHECK") == "1"
ONE_RANK = zcomm.Topology(world_size=1, local_size=1)
BACKENDS = ("cuda", "reference")
_TEARDOWN_GRACE_S = 30.0


def _missing(backend: str | None) -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if not dist.is_nccl_available():
        return "this torch build has no NCCL"
    if backend == "cuda":
        return unavailable_reason()
    return None


def _require(backend: str | None = None) -> None:
    """Skip (fail under ZCOMM_GPU_CHECK=1) unless CUDA, NCCL and what ``backend`` needs are here."""
    reason = _missing(backend)
    if reason is not None:
        if GPU_CHECK:
            pytest.fail(f"ZCOMM_GPU_CHECK=1 but {reason}")
        pytest.skip(reason)


def _init_nccl(bound: bool) -> torch.device:
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    bind = {"device_id": device} if bound else {}
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, **bind)
    return device


def _in_fresh_process(body: Callable[..., Any], *args: Any, timeout: float = 300.0) -> Any:
    """``body(*args)`` on a bound one-rank NCCL world in a new process ([Note: one bound world per process]).

    A crash of the child (a signal) fails the calling test by name instead of taking the
    test process down with it.
    """
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    child = context.Process(target=_fresh_main, args=(results, body, args), daemon=True)
    child.start()
    deadline = time.monotonic() + timeout
    while results.empty() and child.is_alive() and time.monotonic() < deadline:
        child.join(0.1)
    reported = not results.empty()
    child.join(_TEARDOWN_GRACE_S if reported else 0)  # a result in hand: the world's teardown may not hang the test
    if child.is_alive():
        child.kill()
        child.join()
    if not reported:
        if child.exitcode == -signal.SIGKILL:
            pytest.fail(f"{body.__name__} on a bound world did not finish in {timeout:.0f} s")
        pytest.fail(f"{body.__name__} on a bound world died with exit code {child.exitcode} (a negative code is a signal)")
    ok, value = results.get()
    if not ok:
        pytest.fail(f"{body.__name__} on a bound world raised:\n{value}", pytrace=False)
    return value


def _fresh_main(results: Any, body: Callable[..., Any], args: tuple) -> None:
    try:
        _init_nccl(bound=True)
        try:
            results.put((True, body(*args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # reported to the test, which fails with the traceback
        results.put((False, traceback.format_exc()))


@pytest.fixture(params=["bound", "unbound"])
def on_world(request) -> Callable[..., Any]:
    """Runs a test's body on a one-rank NCCL world, bound to the GPU or not.

    [Note: one bound world per process] torch's ``split_group`` crashes the process when
    the world it splits was initialised with ``device_id`` after an earlier world was
    destroyed in the same process (zcomm refuses that case with a RuntimeError, see
    ``zcomm._torch_compat``). zcomm's groups of a bound world are split from it, so every
    bound case runs in a new process with the only bound world that process ever has;
    unbound cases create no split and share this process.
    """
    _require()
    if request.param == "bound":
        return _in_fresh_process

    def unbound(body: Callable[..., Any], *args: Any) -> Any:
        _init_nccl(bound=False)
        try:
            return body(*args)
        finally:
            dist.destroy_process_group()

    return unbound


def _use_backend(monkeypatch, backend: str) -> None:
    _require(backend)
    if backend == "reference":
        monkeypatch.setenv("ZCOMM_BACKEND", "reference")
    else:
        monkeypatch.delenv("ZCOMM_BACKEND", raising=False)  # the device's default: cuda


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantized_collectives_against_torch(on_world, monkeypatch, backend):
    _use_backend(monkeypatch, backend)
    on_world(_quantized_collectives_against_torch)


def _quantized_collectives_against_torch() -> None:
    for index, case in enumerate((*cases(seed=51), *tensor_cases(seed=51))):
        check_case(case, dist.group.WORLD, ONE_RANK, detect=index % 2 == 0, device="cuda")


@pytest.mark.parametrize("async_op", [False, True])
def test_counted_collectives_and_an_hpz_block(on_world, async_op):
    on_world(_counted_collectives_and_an_hpz_block, async_op)


def _counted_collectives_and_an_hpz_block(async_op: bool) -> None:
    check_plain_collectives(dist.group.WORLD, ONE_RANK, device="cuda", async_op=async_op)
    block = zcomm.consecutive_group(None, 1)  # split from the world when it is bound
    assert dist.get_process_group_ranks(block) == [0]
    check_plain_collectives(block, ONE_RANK, device="cuda", async_op=async_op)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_path_gives_the_cpu_paths_bytes(monkeypatch, backend):
    _require(backend)
    _init_nccl(bound=False)
    try:
        twin = dist.new_group(backend="gloo")
        if backend == "reference":
            monkeypatch.setenv("ZCOMM_BACKEND", "reference")  # on both sides
        else:
            monkeypatch.delenv("ZCOMM_BACKEND", raising=False)  # cuda here, cpu on the twin
        for index, case in enumerate(islice(cases(seed=52), 6)):
            hadamard = 64 if index % 2 else None  # torch's elementwise IEEE ops: the same bits on both
            on_gpu = _both_collectives(case, dist.group.WORLD, "cuda", hadamard)
            on_cpu = _both_collectives(case, twin, "cpu", hadamard)
            for name, gpu, cpu in zip(("reduce_scatter_q4", "all_gather_q8"), on_gpu, on_cpu, strict=True):
                assert torch.equal(gpu.cpu().view(torch.uint8), cpu.view(torch.uint8)), (name, case)
    finally:
        dist.destroy_process_group()


def _both_collectives(case: dict, group: dist.ProcessGroup, device: str,
                      hadamard: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    m, dtype = max(case["slice_numel"], 1) * 37, case["dtype"]
    x = make_inputs(case["seed"], 1, m, dtype)[0].to(device)
    reduced, gathered = torch.empty_like(x), torch.empty_like(x)
    handles = [
        zcomm.reduce_scatter_q4(
            reduced, x, case["op"], group, case["async_op"], group_size=case["group_size"],
            pipeline_stages=case["stages"], topology=ONE_RANK, hadamard_block=hadamard,
        ),
        zcomm.all_gather_q8(gathered, x, group, case["async_op"], group_size=case["group_size"], topology=ONE_RANK),
    ]
    for handle in handles:
        if handle is not None:
            handle.wait()
    return reduced, gathered


def test_a_reinitialised_bound_world_gets_a_clear_error_not_a_crash():
    """The sequence that segfaults inside torch's split_group, in a process of its own."""
    _require()
    assert "segmentation fault" in _in_fresh_process(_split_after_reinit)


def _split_after_reinit() -> str:
    zcomm.consecutive_group(None, 1)  # the process's first bound world splits fine
    dist.destroy_process_group()
    _init_nccl(bound=True)
    try:
        zcomm.consecutive_group(None, 1)
    except RuntimeError as exc:
        return str(exc)
    raise AssertionError("zcomm split a re-initialised bound world without a word")


@pytest.mark.parametrize("backend", BACKENDS)
def test_is_completed_follows_the_gpu_not_wait(on_world, monkeypatch, backend):
    _use_backend(monkeypatch, backend)
    on_world(_is_completed_follows_the_gpu_not_wait)


def _is_completed_follows_the_gpu_not_wait() -> None:
    x = torch.randn(1 << 20, device="cuda")
    out = torch.empty_like(x)
    for collective in (zcomm.all_gather_q8, zcomm.reduce_scatter_q4):
        collective(out, x, topology=ONE_RANK)  # first use compiles kernels and fills caches
        torch.cuda.synchronize()
        torch.cuda._sleep(1 << 30)  # keeps the current stream, which the collective's stream waits for, busy
        handle = collective(out, x, async_op=True, topology=ONE_RANK)
        handle.wait()
        assert not handle.is_completed(), f"{collective.__name__}: completed while the GPU is still sleeping"
        torch.cuda.synchronize()
        assert handle.is_completed(), collective.__name__
