"""``reduce_scatter_q4`` (qgZ): zcomm's two-hop INT4 reduce-scatter with SUM, against ``reduce_scatter``.

The same buffers as ``reduce_scatter``; the output is within
:func:`bench.harness.checking.q4_two_hop_bound` of the exact sum. ``--stages`` sets its
``pipeline_stages`` (one table row per value).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

import zcomm
from bench.harness import checking
from bench.harness.collective import Buffers, Call, Check, Collective
from zcomm.quant import DEFAULT_GROUP_SIZE


def prepare(buffers: Buffers) -> tuple[Call, Check]:
    inp, out = buffers.input(buffers.world), buffers.output(1)
    group_size = buffers.group_size

    def check() -> int:
        terms = buffers.my_slices()
        bound = checking.q4_two_hop_bound(terms, buffers.env.local_size, group_size, buffers.dtype)
        return checking.count_wrong(out, torch.stack(terms).sum(dim=0), bound)

    run = functools.partial(zcomm.reduce_scatter_q4, out, inp, dist.ReduceOp.SUM, group_size=group_size,
                            pipeline_stages=buffers.stages)  # fmt: skip
    return run, check


COLLECTIVE = Collective(
    name="reduce_scatter_q4",
    kind="reduce_scatter",
    prepare=prepare,
    bits=4,
    default_group_size=DEFAULT_GROUP_SIZE[4],
    baseline="reduce_scatter",
    pipelined=True,
)
