"""``all_gather``: torch's ``all_gather_into_tensor``, the baseline of ``all_gather_q8``.

Every rank contributes one chunk; the output is every rank's chunk in rank order, exact
copies (bound 0).
"""

from __future__ import annotations

import functools

import torch.distributed as dist

from bench.harness import checking
from bench.harness.collective import Buffers, Call, Check, Collective


def prepare(buffers: Buffers) -> tuple[Call, Check]:
    inp, out = buffers.input(1), buffers.output(buffers.world)

    def check() -> int:
        exact = buffers.gathered()
        return checking.count_wrong_blocks(out, exact, [0.0] * len(exact))

    return functools.partial(dist.all_gather_into_tensor, out, inp), check


COLLECTIVE = Collective(name="all_gather", kind="all_gather", prepare=prepare)
