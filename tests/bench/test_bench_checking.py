"""The suite's error bounds hold for the real wire format and catch real errors.

The quantized paths are emulated with zcomm.quant's ops (the bytes every backend produces),
so these tests do not need the collectives themselves (reference backend: the spec's bytes).
"""

import pytest
import torch

from bench.harness import checking
from zcomm.quant import dequant_reduce, dequantize, quantize

GS = 32
REF = "reference"


def _q_roundtrip(x, bits):
    return dequantize(quantize(x, bits, GS, backend=REF), x.numel(), bits, GS, torch.float32, backend=REF)


def test_chunks_are_reproducible_and_rank_dependent():
    a = checking.chunk(0, 1, 2, 100, torch.bfloat16)
    assert torch.equal(a, checking.chunk(0, 1, 2, 100, torch.bfloat16))
    assert not torch.equal(a, checking.chunk(0, 2, 2, 100, torch.bfloat16))
    assert torch.equal(checking.rank_input(0, 1, 3, 100, torch.bfloat16)[200:], checking.chunk(0, 1, 2, 100, torch.bfloat16))


def test_block_absmax_neighbours_cover_any_window():
    x = torch.tensor([1.0, 0, 0, 0, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3])
    assert checking.block_absmax(x, 4, neighbours=False).tolist() == [1] * 4 + [5] * 4 + [0] * 4 + [3] * 4
    assert checking.block_absmax(x, 4, neighbours=True).tolist() == [5] * 12 + [3] * 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_q8_bound_holds_for_the_int8_round_trip(dtype):
    x = checking.chunk(3, 1, 0, 1000, dtype)
    exact = x.to(torch.float64)
    y = _q_roundtrip(x, 8).to(dtype)
    bound = checking.q8_bound(exact, GS, dtype)
    assert checking.count_wrong(y, exact, bound) == 0
    # Not vacuous: the error reaches a good part of the bound somewhere.
    assert ((y.double() - exact).abs() / bound).max() > 0.3


def _two_hop(slices, local_size, chunks):
    """qgZ on one destination slice: INT4 per rank (in `chunks` pieces), fp32 node sum, INT4 again, sum."""
    node_payloads = []
    for start in range(0, len(slices), local_size):
        pieces = []
        for part in range(chunks):
            rows = torch.stack([quantize(s.chunk(chunks)[part].contiguous(), 4, GS, backend=REF)
                                for s in slices[start : start + local_size]])
            pieces.append(dequant_reduce(rows, slices[0].numel() // chunks, 4, GS, backend=REF))
        node_payloads.append(quantize(torch.cat(pieces), 4, GS, backend=REF))
    return dequant_reduce(torch.stack(node_payloads), slices[0].numel(), 4, GS, dtype=slices[0].dtype, backend=REF)


@pytest.mark.parametrize(("world", "local_size", "chunks"), [(4, 2, 1), (4, 2, 3), (4, 1, 1), (6, 3, 2)])
def test_q4_two_hop_bound_holds(world, local_size, chunks):
    numel = 2 * 3 * 97  # not a multiple of the group size: groups of the chunks start off the grid
    slices = [checking.chunk(5, r, 0, numel, torch.bfloat16) for r in range(world)]
    terms = [s.to(torch.float64) for s in slices]
    y = _two_hop(slices, local_size, chunks)
    bound = checking.q4_two_hop_bound(terms, local_size, GS, torch.bfloat16)
    assert checking.count_wrong(y, torch.stack(terms).sum(dim=0), bound) == 0


def test_errors_beyond_the_bound_and_non_finite_values_are_counted():
    exact = torch.linspace(-4, 4, 64, dtype=torch.float64)
    bound = checking.q8_bound(exact, GS, torch.float32)
    y = exact.to(torch.float32).clone()
    y[3] += 2 * bound[3].item()
    y[10] = float("nan")
    y[20] = float("inf")
    assert checking.count_wrong(y, exact, bound) == 3


def test_sum_bound_is_gamma_times_magnitudes():
    terms = [torch.tensor([1.0, -2.0], dtype=torch.float64)] * 3
    u = 2.0**-8
    expected = 2 * u / (1 - 2 * u) * torch.tensor([3.0, 6.0], dtype=torch.float64)
    assert torch.allclose(checking.sum_bound(terms, torch.bfloat16), expected)
