"""One collective of the suite (:class:`Collective`) and the case built from it at one size (:func:`build_case`).

Sizes and counts follow nccl-tests (``bench/PERFORMANCE.md``); ``payload_bytes`` is ``size`` in
zcomm's wire format. Inputs are generated on the host from their seed, so every device gets
the same values, and copied to the rank's device once, before anything is timed; outputs are
allocated there. The check moves the last output back to the host, after the timed calls.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

import zcomm.quant

from . import checking
from .dist_env import DistEnv

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

    @property
    def world(self) -> int:
        return self.env.world_size

    def chunk(self, rank: int, index: int) -> torch.Tensor:
        return checking.chunk(self.seed, rank, index, self.count, self.dtype)

    def input(self, chunks: int) -> torch.Tensor:
        return checking.rank_input(self.seed, self.env.rank, chunks, self.count, self.dtype).to(self.device)

    def output(self, chunks: int) -> torch.Tensor:
        return torch.empty(chunks * self.count, dtype=self.dtype, device=self.device)

    def exact(self, index: int) -> list[torch.Tensor]:
        """Every rank's chunk ``index``, fp64 on the host."""
        return [self.chunk(i, index).to(torch.float64) for i in range(self.world)]


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

    @property
    def redop(self) -> str:
        return "sum" if self.kind in ("reduce_scatter", "all_reduce") else "none"

    def label(self, stages: int | None) -> str:
        return f"{self.name}:stages={stages}" if self.pipelined and stages is not None else self.name


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
    if collective.bits is not None and group_size is None:
        group_size = zcomm.quant.DEFAULT_GROUP_SIZE[collective.bits]
    count = max(1, size_bytes // (dtype.itemsize * env.world_size))
    buffers = Buffers(env=env, device=device, dtype=dtype, count=count, seed=seed, group_size=group_size,
                      stages=stages if collective.pipelined else None)
    run, check = collective.prepare(buffers)
    size = count * env.world_size * dtype.itemsize
    payload = size if collective.bits is None else env.world_size * zcomm.quant.payload_nbytes(count, collective.bits,
                                                                                                group_size)
    return Case(label=collective.label(stages), kind=collective.kind, device=device, count=count, size_bytes=size,
                payload_bytes=payload, redop=collective.redop, run=run, check=check)
