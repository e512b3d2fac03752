"""``all_reduce_q4``: zcomm's quantized all-reduce with SUM (INT4 reduce-scatter, INT8 gather), against ``all_reduce``.

The buffers and the copy of ``all_reduce``. Chunk ``r`` of the result is within the
reduce-scatter's :func:`bench.harness.checking.q4_two_hop_bound` ``E`` of the exact sum plus the
INT8 gather's :func:`bench.harness.checking.q8_bound` of a value no larger than
``|exact| + E`` (the reduced chunk it quantizes). ``--stages`` sets the reduce-scatter's
``pipeline_stages`` and ``--group-size`` both collectives' group size. The payload column
counts the INT4 payloads only; the INT8 gather's (about twice as many bytes) is not in it.
``all_reduce_q4_g4`` is the same call with ``gather_bits=4`` (the INT4 gather, its bound with
INT4's step).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist

import zcomm
from bench.harness import checking
from bench.harness.collective import Buffers, Call, Check, Collective
from zcomm.quant import DEFAULT_GROUP_SIZE

from .all_reduce import exact_chunks


def _copy_and_reduce(buf: torch.Tensor, inp: torch.Tensor, *, group_size: int, stages: int | None,
                     gather_bits: int) -> None:
    buf.copy_(inp)
    zcomm.all_reduce_q4(buf, dist.ReduceOp.SUM, group_size=group_size, gather_bits=gather_bits,
                        gather_group_size=group_size, pipeline_stages=stages)


def prepare(buffers: Buffers, gather_bits: int = 8) -> tuple[Call, Check]:
    inp, buf = buffers.input(buffers.world), buffers.output(buffers.world)
    group_size, dtype = buffers.group_size, buffers.dtype

    def check() -> int:
        exact, bounds = [], []
        for terms in exact_chunks(buffers):
            reduced = torch.stack(terms).sum(dim=0)
            error = checking.q4_two_hop_bound(terms, buffers.env.local_size, group_size, dtype)
            exact.append(reduced)
            bounds.append(error + checking.q8_bound(reduced.abs() + error, group_size, dtype,
                                                    qmax=checking.QMAX8 if gather_bits == 8 else checking.QMAX4))
        return checking.count_wrong_blocks(buf, exact, bounds)

    call = functools.partial(_copy_and_reduce, buf, inp, group_size=group_size, stages=buffers.stages,
                             gather_bits=gather_bits)
    return call, check


COLLECTIVE = Collective(
    name="all_reduce_q4",
    kind="all_reduce",
    prepare=prepare,
    bits=4,
    default_group_size=DEFAULT_GROUP_SIZE[4],
    baseline="all_reduce",
    pipelined=True,
)
COLLECTIVE_G4 = dataclasses.replace(COLLECTIVE, name="all_reduce_q4_g4", prepare=functools.partial(prepare, gather_bits=4))
