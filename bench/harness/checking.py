"""Correctness in the same run: seeded inputs, an fp64 oracle and analytic error bounds.

The inputs' seeding and the bounds' derivation: ``bench/PERFORMANCE.md`` (#wrong). ``u`` is the
output dtype's unit roundoff; quantized bounds add ``2^-20 * n * (sum |a_i| + E)`` for the fp32
arithmetic inside.
"""

from __future__ import annotations

from typing import Sequence

import torch

UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
QMAX8, QMAX4 = 127, 7
_FP32_SLACK = 2.0**-20


def chunk(seed: int, rank: int, index: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Chunk ``index`` of rank ``rank``'s input: ``numel`` seeded values of ``dtype``."""
    generator = torch.Generator().manual_seed(hash((seed, rank, index, numel)) & (2**63 - 1))
    values = torch.randn(numel, generator=generator, dtype=torch.float32) * (1 + rank)
    return values.to(dtype)


def rank_input(seed: int, rank: int, chunks: int, chunk_numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The whole input of ``rank``: ``chunks`` consecutive chunks."""
    return torch.cat([chunk(seed, rank, j, chunk_numel, dtype) for j in range(chunks)])


def block_absmax(x: torch.Tensor, group_size: int, *, neighbours: bool) -> torch.Tensor:
    """Per element: absmax of its aligned block of ``group_size`` (and of the two next to it)."""
    n = x.numel()
    blocks = -(-n // group_size)
    padded = torch.zeros(blocks * group_size, dtype=x.dtype)
    padded[:n] = x.abs()
    maxima = padded.view(blocks, group_size).amax(dim=1)
    if neighbours:
        wide = torch.nn.functional.pad(maxima, (1, 1))
        maxima = torch.stack([wide[:-2], wide[1:-1], wide[2:]]).amax(dim=0)
    return maxima.repeat_interleave(group_size)[:n]


def count_wrong(output: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor | float) -> int:
    """Elements of ``output`` (on any device) farther than ``bound`` from the host's ``exact``; non-finite counts as wrong."""
    got = output.to(device=exact.device, dtype=torch.float64)
    error = (got - exact).abs()
    bad = ~torch.isfinite(got) | (error > bound)
    return int(bad.sum().item())


def count_wrong_blocks(output: torch.Tensor, exact: Sequence[torch.Tensor], bounds: Sequence[torch.Tensor | float]) -> int:
    """``#wrong`` over an output made of one block per entry of ``exact``, each with its bound."""
    blocks = output.split(exact[0].numel())
    return sum(count_wrong(o, e, b) for o, e, b in zip(blocks, exact, bounds, strict=True))


def sum_bound(terms: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``gamma_{n-1} * sum |a_i|``: recursive summation of ``n`` terms in ``dtype``."""
    k = len(terms) - 1
    gamma = k * UNIT_ROUNDOFF[dtype] / (1 - k * UNIT_ROUNDOFF[dtype])
    return gamma * torch.stack(terms).abs().sum(dim=0)


def q8_bound(exact: torch.Tensor, group_size: int, dtype: torch.dtype, *, qmax: int = QMAX8) -> torch.Tensor:
    """Bound for one rank's block of an INT8 all-gather (``exact`` = that rank's input, fp64); with
    ``qmax=QMAX4`` of an INT4 one."""
    half_step = block_absmax(exact, group_size, neighbours=False) / qmax / 2
    u = UNIT_ROUNDOFF[dtype]
    return half_step + u * (exact.abs() + half_step) + _FP32_SLACK * (exact.abs() + half_step)


def q4_two_hop_bound(terms: list[torch.Tensor], local_size: int, group_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Bound for a two-hop INT4 reduce-scatter of ``terms`` (one fp64 slice per rank, node-major)."""
    error = torch.zeros_like(terms[0])
    for start in range(0, len(terms), local_size):
        node = terms[start : start + local_size]
        hop1 = sum(block_absmax(t, group_size, neighbours=True) / QMAX4 / 2 for t in node)
        partial = torch.stack(node).sum(dim=0)
        scale2 = (block_absmax(partial, group_size, neighbours=True) + block_absmax(hop1, group_size, neighbours=True)) / QMAX4
        error += hop1 + scale2 / 2
    exact = torch.stack(terms).sum(dim=0)
    magnitude = torch.stack(terms).abs().sum(dim=0)
    return error + UNIT_ROUNDOFF[dtype] * (exact.abs() + error) + _FP32_SLACK * len(terms) * (magnitude + error)
