"""Ranks on this machine that each send one result back (:func:`spawn`), for the memory and host-cost benchmarks.

Each rank is a fresh process that joins a gloo group on localhost (NCCL: rank r on GPU r) with
one torch thread, runs ``target(rank, world, *args)`` and sends its return value (or the
exception it raised) to the parent through a queue; then it waits at a barrier for its peers
and leaves without finalizing the interpreter ([Note: leaving without finalization] in :mod:`.rank_exit`).

[Note: glibc's mmap threshold] glibc serves an allocation above its ``mmap`` threshold with
its own mapping, returned to the system when freed; below it, from its heap, whose freed
blocks mostly stay resident. The threshold is dynamic by default: freeing a mapped block
raises it up to 32 MiB, so after a while tensors of up to 32 MiB (a transformer block's
shards) come from the heap and stay resident once freed. A peak or a cgroup limit then
measures the allocator's history more than the tensors alive. The benchmarks fix the
threshold at 128 KiB in their ranks (``MALLOC_ENV``), so freed tensors leave the resident set.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from queue import Empty
from typing import Any, Callable

from .rank_exit import leave

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def status_bytes(field: str) -> int:
    """``field`` of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...) in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _rank(target: Callable, rank: int, world: int, port: int, backend: str, args: tuple, queue) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    if backend == "nccl":  # the device set, not bound: see dist_env.init_process_group
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        result = target(rank, world, *args)
    except BaseException as exc:  # noqa: BLE001 - sent to the parent, which raises it
        traceback.print_exc()
        result = exc
    queue.put((rank, result))
    # put() hands the result to a feeder thread: flushed before leave(), which would kill it
    queue.close()
    queue.join_thread()
    if not isinstance(result, BaseException):
        dist.barrier()  # no rank leaves while a peer may still be in a collective with it
    leave(0)


def _collect(queue, procs: list, timeout: float) -> list:
    """Every rank's result in rank order; raises a rank's exception, or RuntimeError when a rank
    exits without a result or ``timeout`` seconds pass."""
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(results) < len(procs):
        gone = [r for r, proc in enumerate(procs) if r not in results and proc.exitcode is not None]
        try:  # a gone rank's result, flushed before it exited, may still be on its way through the pipe
            rank, result = queue.get(timeout=5.0 if gone else 1.0)
        except Empty:
            if gone:
                codes = [procs[r].exitcode for r in gone]
                raise RuntimeError(f"rank(s) {gone} exited (codes {codes}) without a result") from None
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(procs))) - set(results))
                raise RuntimeError(f"no result from rank(s) {missing} in {timeout:.0f} s") from None
            continue
        if isinstance(result, BaseException):
            raise result
        results[rank] = result
    return [results[rank] for rank in range(len(procs))]


def spawn(target: Callable, world: int, *args: Any, backend: str = "gloo", timeout: float = 600) -> list:
    """``target(rank, world, *args)``'s return value on each of ``world`` ranks, in rank order.

    ``target`` and ``args`` must be picklable (a module-level function). On any failure the
    ranks still running are killed before the error propagates."""
    import torch.multiprocessing as mp

    with socket.socket() as probe:  # a localhost port nothing listens on now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    procs = [context.Process(target=_rank, args=(target, rank, world, port, backend, args, queue), daemon=True)
             for rank in range(world)]  # fmt: skip
    for proc in procs:
        proc.start()
    try:
        return _collect(queue, procs, timeout)
    except BaseException:
        for proc in procs:  # a failed rank's peers may wait for it in a collective until their timeout
            proc.kill()
        raise
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
