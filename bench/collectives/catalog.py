"""The collectives of the suite, in table order (torch's ops and zcomm's), and the case each makes at one size.

Sizes, counts, payload bytes and bounds: ``bench/PERFORMANCE.md`` (``all_reduce_q4``'s payload
is its INT4 payloads only, not its gather's). Inputs are generated on the host from their seed,
so every device gets the same values, and copied to the rank's device once, before anything is
timed; the check moves the last output back to the host after the timed calls. The all-reduces
copy their input into the buffer they reduce in place on every call (torch's and zcomm's
alike), so repeated calls do not compound.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

import zcomm
from bench.harness import checking
from bench.harness.dist_env import DistEnv

Call = Callable[[], object]
Check = Callable[[], int]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Buffers:
    """One (op, size) on this rank: where its buffers go and the seeded data they hold."""

    env: DistEnv
    device: torch.device
    dtype: torch.dtype
    count: int
    seed: int
    group_size: int | None
    stages: int | None

    def input(self, chunks: int) -> torch.Tensor:
        return checking.rank_input(self.seed, self.env.rank, chunks, self.count, self.dtype).to(self.device)

    def output(self, chunks: int) -> torch.Tensor:
        return torch.empty(chunks * self.count, dtype=self.dtype, device=self.device)

    def exact(self, index: int) -> list[torch.Tensor]:
        """Every rank's chunk ``index``, fp64 on the host."""
        return [checking.chunk(self.seed, i, index, self.count, self.dtype).to(torch.float64)
                for i in range(self.env.world_size)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Collective:
    """``prepare`` allocates a :class:`Buffers`' tensors and returns ``(call, check)``, ``check`` counting the
    wrong elements of the last output; ``kind`` fixes the sizes and the bus factor; ``bits`` is the zcomm
    payload's (None: moved as is); ``pipelined`` ops take ``--stages``."""

    name: str
    kind: str
    prepare: Callable[[Buffers], tuple[Call, Check]]
    bits: int | None = None
    baseline: str | None = None
    pipelined: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One (op, size) on this rank, with its buffers allocated."""

    label: str
    kind: str
    device: torch.device
    count: int
    size_bytes: int
    payload_bytes: int
    redop: str
    run: Call
    check: Check


def build_case(collective: Collective, size_bytes: int, *, env: DistEnv, device: torch.device, dtype: torch.dtype,
               seed: int, group_size: int | None = None, stages: int | None = None) -> Case:
    """``collective`` at ``size_bytes`` (rounded down) on ``device``; ``group_size`` None is the zcomm op's default."""
    bits, world = collective.bits, env.world_size
    if bits is not None and group_size is None:
        group_size = zcomm.quant.DEFAULT_GROUP_SIZE[bits]
    stages = stages if collective.pipelined else None
    count = max(1, size_bytes // (dtype.itemsize * world))
    run, check = collective.prepare(Buffers(env=env, device=device, dtype=dtype, count=count, seed=seed,
                                            group_size=group_size, stages=stages))
    size = count * world * dtype.itemsize
    return Case(label=collective.name if stages is None else f"{collective.name}:stages={stages}", kind=collective.kind,
                device=device, count=count, size_bytes=size, run=run, check=check,
                payload_bytes=size if bits is None else world * zcomm.quant.payload_nbytes(count, bits, group_size),
                redop="sum" if collective.kind in ("reduce_scatter", "all_reduce") else "none")


SUM = dist.ReduceOp.SUM


def _all_gather(b: Buffers, *, quantized: bool) -> tuple[Call, Check]:
    inp, out = b.input(1), b.output(b.env.world_size)

    def check() -> int:
        exact = b.exact(0)
        bounds = [checking.q8_bound(x, b.group_size, b.dtype) if quantized else 0.0 for x in exact]
        return checking.count_wrong_blocks(out, exact, bounds)

    if quantized:
        return partial(zcomm.all_gather_q8, out, inp, group_size=b.group_size), check
    return partial(dist.all_gather_into_tensor, out, inp), check


def _reduce_scatter(b: Buffers, *, quantized: bool) -> tuple[Call, Check]:
    inp, out = b.input(b.env.world_size), b.output(1)

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
    inp, out = b.input(b.env.world_size), b.output(b.env.world_size)

    def check() -> int:
        return checking.count_wrong_blocks(out, b.exact(b.env.rank), [0.0] * b.env.world_size)

    return partial(dist.all_to_all_single, out, inp), check


def _copy_and_reduce(buf: torch.Tensor, inp: torch.Tensor, reduce: Call) -> None:
    buf.copy_(inp)
    reduce(buf)


def _all_reduce(b: Buffers, *, gather_bits: int | None) -> tuple[Call, Check]:
    """torch's all-reduce for ``gather_bits`` None, else zcomm's with that gather."""
    inp, buf = b.input(b.env.world_size), b.output(b.env.world_size)

    def check() -> int:
        exact, bounds = [], []
        for r in range(b.env.world_size):
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
