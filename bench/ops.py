"""The benchmarked collectives: buffers, the call, sizes in bytes and the correctness check.

Sizes follow nccl-tests: ``size`` is the total output of an all-gather, the total input of a
reduce-scatter and the per-rank buffer of an all-to-all, rounded down to a multiple of
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
import functools
from typing import Callable

import torch
import torch.distributed as dist

from . import checking
from .dist_env import DistEnv

BASELINE_OF = {"all_gather_q8": "all_gather", "reduce_scatter_q4": "reduce_scatter"}
KIND = {
    "all_gather": "all_gather",
    "all_gather_q8": "all_gather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_q4": "reduce_scatter",
    "all_to_all": "all_to_all",
}


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
    run: Callable[[], object]
    check: Callable[[], int]


def _payload_nbytes(count: int, bits: int, group_size: int) -> int:
    from zcomm.quant import payload_nbytes

    return payload_nbytes(count, bits, group_size)


def effective_group_size(op: str, group_size: int | None) -> int:
    """``group_size``, or the default of zcomm's ``op`` when None (what users get)."""
    if group_size is not None:
        return group_size
    if op == "all_gather_q8":
        from zcomm.all_gather_q8 import DEFAULT_GROUP_SIZE
    else:
        from zcomm.reduce_scatter_q4 import DEFAULT_GROUP_SIZE
    return DEFAULT_GROUP_SIZE


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Spec:
    env: DistEnv
    device: torch.device
    dtype: torch.dtype
    count: int
    seed: int
    group_size: int | None

    @property
    def world(self) -> int:
        return self.env.world_size

    @property
    def rank(self) -> int:
        return self.env.rank

    def chunk(self, rank: int, index: int) -> torch.Tensor:
        return checking.chunk(self.seed, rank, index, self.count, self.dtype)

    def input(self, chunks: int) -> torch.Tensor:
        return checking.rank_input(self.seed, self.rank, chunks, self.count, self.dtype).to(self.device)

    def output(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=self.dtype, device=self.device)

    def gathered(self) -> list[torch.Tensor]:
        return [self.chunk(i, 0).to(torch.float64) for i in range(self.world)]

    def my_slices(self) -> list[torch.Tensor]:
        return [self.chunk(i, self.rank).to(torch.float64) for i in range(self.world)]


def _all_gather(spec: _Spec, quantized: bool) -> tuple[Callable[[], object], Callable[[], int]]:
    inp = spec.input(1)
    out = spec.output(spec.count * spec.world)
    if quantized:
        import zcomm

        run = functools.partial(zcomm.all_gather_q8, out, inp, group_size=spec.group_size)
    else:
        run = functools.partial(dist.all_gather_into_tensor, out, inp)

    def check() -> int:
        blocks = spec.gathered()
        bounds = [checking.q8_bound(b, spec.group_size, spec.dtype) if quantized else 0.0 for b in blocks]
        return sum(checking.count_wrong(o, b, bd) for o, b, bd in zip(out.split(spec.count), blocks, bounds))

    return run, check


def _reduce_scatter(
    spec: _Spec, quantized: bool, stages: int | None
) -> tuple[Callable[[], object], Callable[[], int]]:
    inp = spec.input(spec.world)
    out = spec.output(spec.count)
    if not quantized:
        run = functools.partial(dist.reduce_scatter_tensor, out, inp, op=dist.ReduceOp.SUM)
    else:
        import zcomm

        run = functools.partial(
            zcomm.reduce_scatter_q4, out, inp, dist.ReduceOp.SUM, group_size=spec.group_size, pipeline_stages=stages
        )

    def check() -> int:
        terms = spec.my_slices()
        if not quantized:
            bound = checking.sum_bound(terms, spec.dtype)
        else:
            bound = checking.q4_two_hop_bound(terms, spec.env.node_size, spec.group_size, spec.dtype)
        return checking.count_wrong(out, torch.stack(terms).sum(dim=0), bound)

    return run, check


def _all_to_all(spec: _Spec) -> tuple[Callable[[], object], Callable[[], int]]:
    inp = spec.input(spec.world)
    out = spec.output(spec.count * spec.world)

    def check() -> int:
        return sum(checking.count_wrong(o, e, 0.0) for o, e in zip(out.split(spec.count), spec.my_slices()))

    return functools.partial(dist.all_to_all_single, out, inp), check


def _label(op: str, stages: int | None) -> str:
    return f"{op}:stages={stages}" if op == "reduce_scatter_q4" and stages is not None else op


def build_case(
    op: str,
    size_bytes: int,
    *,
    env: DistEnv,
    device: torch.device,
    dtype: torch.dtype,
    seed: int,
    group_size: int | None = None,
    stages: int | None = None,
) -> Case:
    """Allocate the buffers of ``op`` at ``size_bytes`` (rounded down) on this rank's ``device``.

    ``group_size`` None means each zcomm op's own default; torch's ops ignore it.
    """
    if op not in KIND:
        raise ValueError(f"op must be one of {tuple(KIND)}, got {op!r}")
    if op in BASELINE_OF:
        group_size = effective_group_size(op, group_size)
    itemsize = dtype.itemsize
    count = max(1, size_bytes // (itemsize * env.world_size))
    spec = _Spec(env=env, device=device, dtype=dtype, count=count, seed=seed, group_size=group_size)
    payload = count * env.world_size * itemsize
    if op in ("all_gather", "all_gather_q8"):
        run, check = _all_gather(spec, quantized=op == "all_gather_q8")
        if op == "all_gather_q8":
            payload = env.world_size * _payload_nbytes(count, 8, group_size)
    elif op in ("reduce_scatter", "reduce_scatter_q4"):
        run, check = _reduce_scatter(spec, op == "reduce_scatter_q4", stages)
        if op == "reduce_scatter_q4":
            payload = env.world_size * _payload_nbytes(count, 4, group_size)
    else:
        run, check = _all_to_all(spec)
    return Case(
        op=op,
        label=_label(op, stages),
        kind=KIND[op],
        device=device,
        count=count,
        size_bytes=count * env.world_size * itemsize,
        payload_bytes=payload,
        redop="sum" if KIND[op] == "reduce_scatter" else "none",
        run=run,
        check=check,
    )
