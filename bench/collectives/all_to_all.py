"""``all_to_all``: torch's ``all_to_all_single``.

Every rank sends one chunk to each rank; a rank's output is the chunks destined for it in
rank order, exact copies (bound 0).
"""

from __future__ import annotations

import functools

import torch.distributed as dist

from bench.harness import checking
from bench.harness.collective import Buffers, Call, Check, Collective


def prepare(buffers: Buffers) -> tuple[Call, Check]:
    inp, out = buffers.input(buffers.world), buffers.output(buffers.world)

    def check() -> int:
        exact = buffers.my_slices()
        return checking.count_wrong_blocks(out, exact, [0.0] * len(exact))

    return functools.partial(dist.all_to_all_single, out, inp), check


COLLECTIVE = Collective(name="all_to_all", kind="all_to_all", prepare=prepare)
