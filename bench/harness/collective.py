"""What one collective's spec file declares, and the case the harness builds from it.

A spec file (``bench/collectives/<op>.py``, as nccl-tests has one file per collective)
declares a :class:`Collective`: its name, the ``kind`` that fixes its sizes and bus
bandwidth formula, the zcomm payload's bits for a quantized op, and ``prepare``, which
allocates the buffers from a :class:`Buffers` and returns the call and its check.

Sizes follow nccl-tests: ``size`` is the total output of an all-gather, the total input of a
reduce-scatter, the buffer of an all-reduce and the per-rank buffer of an all-to-all, rounded down to a multiple of
``world * itemsize``; ``count`` is the per-rank element count nccl-tests prints (send count
of an all-gather, receive count of a reduce-scatter, per-peer count of an all-to-all).
``payload_bytes`` is what quantization makes of ``size``: one zcomm payload (values, padding,
fp32 scales) per rank's block, per :func:`zcomm.quant.payload_nbytes`.

Every buffer lives on ``device``, the rank's device (the group's backend sees nothing else):
inputs are generated on the host from their seed, so every device gets the same values,
and copied over once, before anything is timed; outputs are allocated on the device. The
check moves the last output back to the host, after the timed calls.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

import zcomm.quant

from . import checking
from .dist_env import DistEnv

KINDS = ("all_gather", "reduce_scatter", "all_to_all", "all_reduce")
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

    @property
    def rank(self) -> int:
        return self.env.rank

    def chunk(self, rank: int, index: int) -> torch.Tensor:
        return checking.chunk(self.seed, rank, index, self.count, self.dtype)

    def input(self, chunks: int) -> torch.Tensor:
        """This rank's input of ``chunks`` chunks, on the device."""
        return checking.rank_input(self.seed, self.rank, chunks, self.count, self.dtype).to(self.device)

    def output(self, chunks: int) -> torch.Tensor:
        """An uninitialised output of ``chunks`` chunks, on the device."""
        return torch.empty(chunks * self.count, dtype=self.dtype, device=self.device)

    def gathered(self) -> list[torch.Tensor]:
        """The exact blocks of an all-gather's output, fp64 on the host: every rank's chunk 0."""
        return [self.chunk(i, 0).to(torch.float64) for i in range(self.world)]

    def my_slices(self) -> list[torch.Tensor]:
        """Every rank's chunk destined for this rank, fp64 on the host."""
        return [self.chunk(i, self.rank).to(torch.float64) for i in range(self.world)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Collective:
    """One collective of the suite, as its spec file declares it.

    Args:
        name: the ``--ops`` name and the table's label.
        kind: ``all_gather``, ``reduce_scatter``, ``all_to_all`` or ``all_reduce``: the buffer sizes and the
            bus bandwidth formula.
        prepare: allocates the buffers from a :class:`Buffers` and returns ``(call, check)``;
            ``check`` counts the wrong elements of the last output.
        bits: the zcomm payload's bits for a quantized op, None for one that moves the data as is.
        default_group_size: the zcomm op's own group size, used when none is given (quantized ops).
        baseline: the collective a quantized op is compared against.
        pipelined: whether the op takes ``--stages`` (its pipeline stages).
    """

    name: str
    kind: str
    prepare: Callable[[Buffers], tuple[Call, Check]]
    bits: int | None = None
    default_group_size: int | None = None
    baseline: str | None = None
    pipelined: bool = False

    def __post_init__(self) -> None:
        assert self.kind in KINDS, self.kind
        assert (self.bits is None) == (self.default_group_size is None), self.name

    @property
    def redop(self) -> str:
        return "sum" if self.kind in ("reduce_scatter", "all_reduce") else "none"

    def label(self, stages: int | None) -> str:
        return f"{self.name}:stages={stages}" if self.pipelined and stages is not None else self.name


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    """One (op, size) on this rank, with its buffers allocated."""

    op: str
    label: str
    kind: str
    device: torch.device
    count: int
    size_bytes: int
    payload_bytes: int
    redop: str
    run: Call
    check: Check


def build_case(
    collective: Collective,
    size_bytes: int,
    *,
    env: DistEnv,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    group_size: int | None = None,
    stages: int | None = None,
) -> Case:
    """Allocate the buffers of ``collective`` at ``size_bytes`` (rounded down) on this rank's ``device``.

    ``group_size`` None means the zcomm op's own default; unquantized ops ignore it, as
    ops that are not pipelined ignore ``stages``.
    """
    if collective.bits is not None and group_size is None:
        group_size = collective.default_group_size
    count = max(1, size_bytes // (dtype.itemsize * env.world_size))
    buffers = Buffers(env=env, device=device, dtype=dtype, count=count, seed=seed, group_size=group_size,
                      stages=stages if collective.pipelined else None)  # fmt: skip
    run, check = collective.prepare(buffers)
    size = count * env.world_size * dtype.itemsize
    payload = size if collective.bits is None else env.world_size * zcomm.quant.payload_nbytes(count, collective.bits, group_size)
    return Case(
        op=collective.name,
        label=collective.label(stages),
        kind=collective.kind,
        device=device,
        count=count,
        size_bytes=size,
        payload_bytes=payload,
        redop=collective.redop,
        run=run,
        check=check,
    )
