"""``reduce_scatter``: torch's ``reduce_scatter_tensor`` with SUM, the baseline of ``reduce_scatter_q4``.

Every rank contributes one chunk per destination; a rank's output is the sum of the
chunks destined for it, within the recursive-summation bound in the input dtype.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from bench.harness import checking
from bench.harness.collective import Buffers, Call, Check, Collective


def prepare(buffers: Buffers) -> tuple[Call, Check]:
    inp, out = buffers.input(buffers.world), buffers.output(1)

    def check() -> int:
        terms = buffers.my_slices()
        return checking.count_wrong(out, torch.stack(terms).sum(dim=0), checking.sum_bound(terms, buffers.dtype))

    return functools.partial(dist.reduce_scatter_tensor, out, inp, op=dist.ReduceOp.SUM), check


COLLECTIVE = Collective(name="reduce_scatter", kind="reduce_scatter", prepare=prepare)
