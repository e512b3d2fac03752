"""The collectives of the suite, in table order: torch's ops and zcomm's, each with its buffers, call and check.

A quantized op shares its torch baseline's buffers and oracle; the checks' bounds are in
``bench/PERFORMANCE.md`` (#wrong). ``all_reduce_q4``'s payload column counts its INT4 payloads
only, not its gather's. The all-reduces copy their input into the buffer they reduce in place
on every call (torch's and zcomm's alike), so repeated calls do not compound.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

import zcomm
from bench.harness import checking
from bench.harness.collective import Buffers, Call, Check, Collective

SUM = dist.ReduceOp.SUM


def _all_gather(b: Buffers, *, quantized: bool) -> tuple[Call, Check]:
    inp, out = b.input(1), b.output(b.world)

    def check() -> int:
        exact = b.exact(0)
        bounds = [checking.q8_bound(x, b.group_size, b.dtype) if quantized else 0.0 for x in exact]
        return checking.count_wrong_blocks(out, exact, bounds)

    if quantized:
        return partial(zcomm.all_gather_q8, out, inp, group_size=b.group_size), check
    return partial(dist.all_gather_into_tensor, out, inp), check


def _reduce_scatter(b: Buffers, *, quantized: bool) -> tuple[Call, Check]:
    inp, out = b.input(b.world), b.output(1)

    def check() -> int:
        terms = b.exact(b.env.rank)
        if quantized:
            bound = checking.q4_two_hop_bound(terms, b.env.local_size, b.group_size, b.dtype)
        else:
            bound = checking.sum_bound(terms, b.dtype)
        return checking.count_wrong(out, torch.stack(terms).sum(dim=0), bound)

    if quantized:
        return partial(zcomm.reduce_scatter_q4, out, inp, SUM, group_size=b.group_size, pipeline_stages=b.stages), check
    return partial(dist.reduce_scatter_tensor, out, inp, op=SUM), check


def _all_to_all(b: Buffers) -> tuple[Call, Check]:
    inp, out = b.input(b.world), b.output(b.world)

    def check() -> int:
        return checking.count_wrong_blocks(out, b.exact(b.env.rank), [0.0] * b.world)

    return partial(dist.all_to_all_single, out, inp), check


def _copy_and_reduce(buf: torch.Tensor, inp: torch.Tensor, reduce: Call) -> None:
    buf.copy_(inp)
    reduce(buf)


def _all_reduce(b: Buffers, *, gather_bits: int | None) -> tuple[Call, Check]:
    """torch's all-reduce for ``gather_bits`` None, else zcomm's with that gather."""
    inp, buf = b.input(b.world), b.output(b.world)

    def check() -> int:
        exact, bounds = [], []
        for r in range(b.world):
            terms = b.exact(r)
            exact.append(torch.stack(terms).sum(dim=0))
            if gather_bits is None:
                bounds.append(checking.sum_bound(terms, b.dtype))
                continue
            error = checking.q4_two_hop_bound(terms, b.env.local_size, b.group_size, b.dtype)
            qmax = checking.QMAX8 if gather_bits == 8 else checking.QMAX4
            bounds.append(error + checking.q8_bound(exact[-1].abs() + error, b.group_size, b.dtype, qmax=qmax))
        return checking.count_wrong_blocks(buf, exact, bounds)

    if gather_bits is None:
        reduce = partial(dist.all_reduce, op=SUM)
    else:
        reduce = partial(zcomm.all_reduce_q4, op=SUM, group_size=b.group_size, gather_bits=gather_bits,
                         gather_group_size=b.group_size, pipeline_stages=b.stages)
    return partial(_copy_and_reduce, buf, inp, reduce), check


COLLECTIVES: dict[str, Collective] = {c.name: c for c in (
    Collective(name="all_gather", kind="all_gather", prepare=partial(_all_gather, quantized=False)),
    Collective(name="reduce_scatter", kind="reduce_scatter", prepare=partial(_reduce_scatter, quantized=False)),
    Collective(name="all_to_all", kind="all_to_all", prepare=_all_to_all),
    Collective(name="all_reduce", kind="all_reduce", prepare=partial(_all_reduce, gather_bits=None)),
    Collective(name="all_gather_q8", kind="all_gather", prepare=partial(_all_gather, quantized=True), bits=8,
               baseline="all_gather"),
    Collective(name="reduce_scatter_q4", kind="reduce_scatter", prepare=partial(_reduce_scatter, quantized=True),
               bits=4, baseline="reduce_scatter", pipelined=True),
    Collective(name="all_reduce_q4", kind="all_reduce", prepare=partial(_all_reduce, gather_bits=8), bits=4,
               baseline="all_reduce", pipelined=True),
    Collective(name="all_reduce_q4_g4", kind="all_reduce", prepare=partial(_all_reduce, gather_bits=4), bits=4,
               baseline="all_reduce", pipelined=True),
)}  # fmt: skip
ALL_OPS = tuple(COLLECTIVES)
