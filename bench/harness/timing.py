"""Timing: of one process's calls side by side (:func:`per_call_seconds`), and of a collective over
its ranks, barrier-synchronised as nccl-tests does it (:func:`time_collective`, ``bench/PERFORMANCE.md``).

A collective's clock follows the device (:func:`clock_for`); the max and sum over the ranks are
all-reduced in a tensor on ``device``, the group's device (NCCL moves CUDA memory only). An
optional ``counter`` (e.g. the node's wire bytes) is read between two barriers before the timed
loop and after a barrier that follows it; its per-call increase is summed over the ranks, so a
counter shared by the ranks of a node should be read by one of them only (others return 0).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class Timing:
    seconds: float
    counter_delta: float | None


class HostClock:
    """``time.perf_counter``: on the CPU, gloo's calls return when they are done."""

    def synchronize(self) -> None:
        pass

    def start(self) -> None:
        self._start = time.perf_counter()

    def stop(self) -> float:
        return time.perf_counter() - self._start


class CudaEventClock:
    """A pair of CUDA events on ``device``'s current stream.

    [Note: CUDA event timing]
    A CUDA call returns once its kernels are enqueued, so a host clock would time the
    launches, not the work. The start event is recorded on the current stream before the
    first call and the end event after the last; ``stop`` waits for the end event only, so
    nothing synchronizes between the timed calls. The end event covers the collectives'
    work because a synchronous torch.distributed call makes the current stream wait for
    the communication stream before returning, and zcomm's synchronous calls enqueue their
    whole chain on the current stream. The events are created on ``start``, not in
    ``__init__``, so choosing this clock needs no CUDA.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        self._events[0].record(torch.cuda.current_stream(self.device))

    def stop(self) -> float:
        """Seconds since ``start``, once the work enqueued since then has finished."""
        begin, end = self._events
        end.record(torch.cuda.current_stream(self.device))
        end.synchronize()
        return begin.elapsed_time(end) / 1e3


def clock_for(device: torch.device) -> HostClock | CudaEventClock:
    if device.type == "cuda":
        return CudaEventClock(device)
    if device.type == "cpu":
        return HostClock()
    raise ValueError(f"no clock for device type {device.type!r} (cpu or cuda)")


def per_call_seconds(calls: dict[str, Callable[[], object]], *, rounds: int, repeat: int = 1, warmup: int = 1,
                     sync: Callable[[], object] = lambda: None, synced: bool = False) -> dict[str, list[float]]:
    """Per call and round, the mean seconds of ``repeat`` back-to-back calls, after ``warmup`` calls each.

    The calls take turns within each round, so a drift of the machine's speed hits them alike.
    ``sync`` (a device synchronization) runs before each timed stretch and, with ``synced``,
    inside it after the last call: without it an asynchronous call is timed to its enqueue only.
    """
    for call in calls.values():
        for _ in range(warmup):
            call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            sync()
            start = time.perf_counter()
            for _ in range(repeat):
                call()
            if synced:
                sync()
            samples[name].append((time.perf_counter() - start) / repeat)
    return samples


def reduce_over_ranks(values: list[float], op: dist.ReduceOp, *, device: torch.device) -> list[float]:
    """``values`` reduced element-wise over the ranks, through a float64 tensor on ``device``."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def time_collective(fn: Callable[[], object], *, iters: int, warmup: int, device: torch.device,
                    counter: Callable[[], int] | None = None) -> Timing:
    """Max-over-ranks seconds per call of ``fn`` on ``device``, and the summed per-call counter increase."""
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got {iters} and {warmup}")
    clock = clock_for(device)
    for _ in range(warmup):
        fn()
    clock.synchronize()
    dist.barrier()
    before = 0
    if counter is not None:
        before = counter()
        dist.barrier()  # peers on the same node must not send before this rank has read the counter
    clock.start()
    for _ in range(iters):
        fn()
    elapsed = clock.stop() / iters
    dist.barrier()
    delta = (counter() - before) / iters if counter is not None else 0.0
    (seconds,) = reduce_over_ranks([elapsed], dist.ReduceOp.MAX, device=device)
    (summed,) = reduce_over_ranks([delta], dist.ReduceOp.SUM, device=device)
    return Timing(seconds=seconds, counter_delta=summed if counter is not None else None)
