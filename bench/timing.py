"""Barrier-synchronised timing of a collective, as nccl-tests does it.

Warm up, barrier, run ``iters`` back-to-back calls, stop the clock; the per-iteration time is
the elapsed time over ``iters`` and the reported value is its maximum over the ranks
(nccl-tests' ``-a 3``): a collective is only done when its slowest rank is done. The timed
region only calls ``fn``: buffers are allocated by the caller beforehand.

An optional ``counter`` (e.g. the node's wire bytes) is read between two barriers before the
timed loop and after a barrier that follows it; its per-iteration increase is summed over the ranks, so a
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


def _reduce(value: float, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=op, group=group)
    return float(tensor.item())


def time_collective(
    fn: Callable[[], object],
    *,
    iters: int,
    warmup: int,
    counter: Callable[[], int] | None = None,
    group: dist.ProcessGroup | None = None,
) -> Timing:
    """Max-over-ranks seconds per call of ``fn``, and the summed per-call counter increase."""
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0, got {iters} and {warmup}")
    for _ in range(warmup):
        fn()
    dist.barrier(group=group)
    before = 0
    if counter is not None:
        before = counter()
        # Peers on the same node must not start sending before this rank has read the counter.
        dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    elapsed = (time.perf_counter() - start) / iters
    dist.barrier(group=group)
    delta = (counter() - before) / iters if counter is not None else 0.0
    seconds = _reduce(elapsed, dist.ReduceOp.MAX, group)
    summed = _reduce(delta, dist.ReduceOp.SUM, group)
    return Timing(seconds=seconds, counter_delta=summed if counter is not None else None)
