"""``all_gather_q8`` (qwZ): zcomm's blocked INT8 all-gather, against ``all_gather``.

The same buffers as ``all_gather``; each rank's block is within
:func:`bench.harness.checking.q8_bound` of its exact input.
"""

from __future__ import annotations

import functools

import zcomm
from bench.harness import checking
from bench.harness.collective import Buffers, Call, Check, Collective
from zcomm.quant import DEFAULT_GROUP_SIZE


def prepare(buffers: Buffers) -> tuple[Call, Check]:
    inp, out = buffers.input(1), buffers.output(buffers.world)
    group_size = buffers.group_size

    def check() -> int:
        exact = buffers.gathered()
        bounds = [checking.q8_bound(block, group_size, buffers.dtype) for block in exact]
        return checking.count_wrong_blocks(out, exact, bounds)

    return functools.partial(zcomm.all_gather_q8, out, inp, group_size=group_size), check


COLLECTIVE = Collective(
    name="all_gather_q8",
    kind="all_gather",
    prepare=prepare,
    bits=8,
    default_group_size=DEFAULT_GROUP_SIZE[8],
    baseline="all_gather",
)
