"""``all_reduce``: torch's ``all_reduce`` with SUM, the baseline of ``all_reduce_q4``.

Every rank's input is ``world`` chunks; each call copies it into the buffer it reduces in
place (both rows pay the same copy, so repeated calls do not compound), and the buffer's
chunk ``r`` ends as the sum of every rank's chunk ``r``, within the recursive-summation bound
in the input dtype.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from bench.harness import checking
from bench.harness.collective import Buffers, Call, Check, Collective


def exact_chunks(buffers: Buffers) -> list[list[torch.Tensor]]:
    """Per chunk ``r`` of the buffer: every rank's chunk ``r``, fp64 on the host."""
    return [[buffers.chunk(i, r).to(torch.float64) for i in range(buffers.world)] for r in range(buffers.world)]


def _copy_and_reduce(buf: torch.Tensor, inp: torch.Tensor) -> None:
    buf.copy_(inp)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)


def prepare(buffers: Buffers) -> tuple[Call, Check]:
    inp, buf = buffers.input(buffers.world), buffers.output(buffers.world)

    def check() -> int:
        terms = exact_chunks(buffers)
        exact = [torch.stack(chunk).sum(dim=0) for chunk in terms]
        return checking.count_wrong_blocks(buf, exact, [checking.sum_bound(chunk, buffers.dtype) for chunk in terms])

    return functools.partial(_copy_and_reduce, buf, inp), check


COLLECTIVE = Collective(name="all_reduce", kind="all_reduce", prepare=prepare)
