"""Every backend, on every device it runs on, produces the ``reference`` backend's bytes.

The reference on CPU tensors (plain torch, following the wire format literally) is the
oracle; each ``target`` (conftest: ``cpu`` on CPU, ``reference`` and ``cuda`` on CUDA) must
agree with it byte for byte, NaN and Inf included, for every op: over sweeps of sizes,
dtypes and group sizes (short groups, odd INT8 groups, groups larger than the CUDA team
scheme's limit, one group per tensor), arbitrary payload bytes, misaligned views, and
subnormal values and scales that flush-to-zero arithmetic would lose.
"""

from __future__ import annotations

import pytest
import torch

import zcomm.quant as q
from quant_cases import (
    DTYPES,
    KINDS,
    Target,
    assert_same_bytes,
    make_hard_input,
    make_input,
    make_payloads,
    random_payload,
)

GROUP_SIZES = {8: (7, 32, 128, 512, 2048), 4: (6, 32, 128, 512, 2048)}
SWEEP = [(bits, gs) for bits, sizes in GROUP_SIZES.items() for gs in sizes]
# sizes of the hard-case sweep: under a group, a few groups, and past a million elements
SIZES = (1, 7, 31, 33, 1000, 4096, 65_537, 999_983)


def _edge_sizes(group_size: int) -> tuple[int, ...]:
    return (1, 7, group_size - 1, group_size + 1, 3 * group_size + 5)


def _check_roundtrip(target: Target, x: torch.Tensor, bits: int, group_size: int, what: str) -> None:
    """quantize on both, then dequantize the reference payload on both, to every dtype."""
    expected = q.quantize(x, bits, group_size, backend="reference")
    assert_same_bytes(target.run(q.quantize, x, bits, group_size), expected, f"{target} quantize {what}")
    for dtype in DTYPES:
        ref = q.dequantize(expected, x.numel(), bits, group_size, dtype, backend="reference")
        got = target.run(q.dequantize, expected, x.numel(), bits, group_size, dtype)
        assert_same_bytes(got, ref, f"{target} dequantize to {dtype} {what}")


@pytest.mark.parametrize(("bits", "group_size"), SWEEP)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_dequantize_every_kind_at_group_edges(target: Target, dtype: torch.dtype, bits: int, group_size: int):
    for numel in _edge_sizes(group_size):
        for seed, kind in enumerate(KINDS):
            x = make_input(numel, dtype, kind, seed, group_size)
            _check_roundtrip(target, x, bits, group_size, f"{dtype} bits={bits} gs={group_size} n={numel} {kind}")


@pytest.mark.parametrize(("bits", "group_size"), SWEEP)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_dequantize_hard_cases_up_to_a_million(
    target: Target, dtype: torch.dtype, bits: int, group_size: int
):
    for n in SIZES:
        what = f"{dtype} bits={bits} gs={group_size} n={n}"
        x = make_hard_input(n, group_size, dtype, bits, seed=n)
        assert_same_bytes(
            target.run(q.quantize, x, bits, group_size), q.quantize(x, bits, group_size, backend="reference"), what
        )
        rows = make_payloads(n, group_size, bits, k=3, seed=n)
        for out_dtype in DTYPES:
            got = target.run(q.dequantize, rows, n, bits, group_size, out_dtype)
            want = q.dequantize(rows, n, bits, group_size, out_dtype, backend="reference")
            assert_same_bytes(got, want, f"dequantize 3 rows to {out_dtype} {what}")


@pytest.mark.parametrize(
    ("numel", "dtype", "bits", "group_size", "kind"),
    [
        (999_983, torch.float32, 8, 512, "nonfinite"),
        (1_000_003, torch.bfloat16, 4, 2048, "random_bits"),
        (999_979, torch.float16, 4, 128, "normal"),
    ],
)
def test_large_prime_sizes(target: Target, numel: int, dtype: torch.dtype, bits: int, group_size: int, kind: str):
    x = make_input(numel, dtype, kind, numel, group_size)
    _check_roundtrip(target, x, bits, group_size, f"{dtype} bits={bits} gs={group_size} n={numel} {kind}")


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("perm", "num_chunks", "slice_len", "group_size"),
    [
        ((0,), 1, 100, 32),
        ((1, 0), 2, 77, 32),
        ((2, 0, 3, 1), 4, 130, 32),
        ((3, 2, 1, 0), 2, 129, 128),
        ((0, 2, 1), 3, 1000, 512),
        ((5, 1, 4, 0, 3, 2), 2, 3001, 2048),
    ],
)
def test_reorder_quantize_every_kind(
    target: Target, dtype: torch.dtype, bits: int, perm: tuple[int, ...], num_chunks: int, slice_len: int,
    group_size: int,
):
    """Slices and chunks whose boundaries fall inside groups (and on odd INT4 positions)."""
    for seed, kind in enumerate(KINDS):
        x = make_input(len(perm) * slice_len, dtype, kind, seed, group_size)
        expected = q.reorder_quantize(x, perm, num_chunks, bits, group_size, backend="reference")
        got = target.run(q.reorder_quantize, x, perm, num_chunks, bits, group_size)
        assert_same_bytes(got, expected, f"{target} reorder_quantize {dtype} bits={bits} perm={perm} {kind}")


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("parts", "widths", "part_numel", "perm", "num_chunks", "group_size"),
    [
        (4, (3, 0, 10, 7), 24, (3, 2, 1, 0, 7, 6, 5, 4), 4, 6),  # an empty tensor, a fill, groups across tensors
        (4, (64, 24, 40), 128, (1, 0, 3, 2), 2, 32),  # no fill
        (4, (1001,), 1004, (0, 4, 1, 5, 2, 6, 3, 7), 4, 512),  # one tensor with a fill (padded qgZ slices)
        (2, (5000, 3001, 1), 8003, (1, 0), 2, 2048),
    ],
)
def test_reorder_quantize_interleaved(
    target: Target, dtype: torch.dtype, bits: int, parts: int, widths: tuple[int, ...], part_numel: int,
    perm: tuple[int, ...], num_chunks: int, group_size: int,
):
    """The interleaved form reads its tensors where they are, as the interleaving they stand for:
    the reference's bytes, and those of reorder_quantize on the interleaving built with torch.cat."""
    for seed, kind in enumerate(KINDS):
        xs = [make_input(parts * w, dtype, kind, seed + k, group_size) for k, w in enumerate(widths)]
        built = torch.cat([*(x.view(parts, -1) for x in xs), torch.zeros(parts, part_numel - sum(widths), dtype=dtype)], 1)
        expected = q.reorder_quantize(built.view(-1), perm, num_chunks, bits, group_size, backend="reference")
        interleaved = dict(parts=parts, part_numel=part_numel)
        assert_same_bytes(
            q.reorder_quantize(xs, perm, num_chunks, bits, group_size, **interleaved, backend="reference"), expected,
            f"reference interleaved {dtype} bits={bits} {kind}",
        )
        on_device = [x.to(target.device) for x in xs]
        got = q.reorder_quantize(on_device, perm, num_chunks, bits, group_size, **interleaved, backend=target.backend)
        assert_same_bytes(got.cpu(), expected, f"{target} interleaved {dtype} bits={bits} {kind}")


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize(("slices", "num_chunks"), ((8, 8), (8, 2), (6, 3), (1, 1)))
def test_reorder_quantize_hard_cases(target: Target, bits: int, slices: int, num_chunks: int):
    perm = tuple(reversed(range(slices)))[::2] + tuple(reversed(range(slices)))[1::2]
    for dtype in DTYPES:
        for gs in GROUP_SIZES[bits]:
            for n in (slices * num_chunks * 2, slices * num_chunks * 4099, slices * num_chunks * 32 * 1000):
                x = make_hard_input(n, gs, dtype, bits, seed=n + gs)
                got = target.run(q.reorder_quantize, x, perm, num_chunks, bits, gs)
                want = q.reorder_quantize(x, perm, num_chunks, bits, gs, backend="reference")
                assert_same_bytes(got, want, f"{target} reorder_quantize {dtype} gs={gs} n={n}")


@pytest.mark.parametrize("bits", (8, 4))
def test_dequantize_arbitrary_payload_bytes(target: Target, bits: int):
    """Rows of arbitrary bytes decode identically, landing one after another in the output."""
    numel, group_size = 301, 32
    payloads = torch.stack([random_payload(numel, bits, group_size, seed) for seed in range(3)])
    for dtype in DTYPES:
        ref = q.dequantize(payloads, numel, bits, group_size, dtype, backend="reference")
        got = target.run(q.dequantize, payloads, numel, bits, group_size, dtype)
        assert_same_bytes(got, ref, f"{target} dequantize arbitrary bytes to {dtype}")


def _mixed_payloads(numel: int, k: int, bits: int, group_size: int, seed: int) -> torch.Tensor:
    """``k`` payloads of different kinds: reference payloads (the huge ones overflow when
    summed) and arbitrary bytes."""
    rows = []
    for row in range(k):
        kind = ("normal", "random_payload", "huge", "nonfinite", "tiny", "zero_groups", "huge")[(seed + row) % 7]
        if kind == "random_payload":
            rows.append(random_payload(numel, bits, group_size, seed * 10 + row))
            continue
        x = make_input(numel, torch.float32, kind, seed * 10 + row, group_size)
        rows.append(q.quantize(x, bits, group_size, backend="reference"))
    return torch.stack(rows)


def _check_reductions(target: Target, payloads: torch.Tensor, numel: int, bits: int, gs: int, divide_by: float, what):
    """dequant_reduce to every dtype, and re-quantized into every chunk count among 1, 2, 3, 6
    (and, for the most chunks, to the other width too); the reference's one pass equals its
    two (the fp32 sum, then quantized)."""
    args = (payloads, numel, bits, gs)
    total = q.dequant_reduce(*args, divide_by=divide_by, backend="reference")
    for dtype in DTYPES:
        ref = q.dequant_reduce(*args, dtype=dtype, divide_by=divide_by, backend="reference")
        got = target.run(q.dequant_reduce, *args, dtype=dtype, divide_by=divide_by)
        assert_same_bytes(got, ref, f"{target} dequant_reduce to {dtype} {what}")
    counts = [m for m in (1, 2, 3, 6) if numel % m == 0]
    other = [(counts[-1], 12 - bits)] if bits == 4 or gs % 2 == 0 else []
    for chunks, out_bits in [(m, bits) for m in counts] + other:
        kwargs = dict(requant_chunks=chunks, requant_bits=out_bits, divide_by=divide_by)
        ref = q.dequant_reduce(*args, **kwargs, backend="reference")
        two_pass = q.reorder_quantize(total, tuple(range(chunks)), chunks, out_bits, gs, backend="reference")
        assert_same_bytes(ref, two_pass, f"reference requant_chunks={chunks} to INT{out_bits} {what}")
        got = target.run(q.dequant_reduce, *args, **kwargs)
        assert_same_bytes(got, ref, f"{target} dequant_reduce requant_chunks={chunks} to INT{out_bits} {what}")


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("k", (1, 2, 3, 4))
@pytest.mark.parametrize(("numel", "group_size"), [(1, 32), (390, 32), (6 * 129, 128), (4100, 512)])
def test_dequant_reduce_every_kind(target: Target, bits: int, k: int, numel: int, group_size: int):
    """Sums to every dtype and re-quantized into m chunks (chunks that cut through input
    groups, odd-length INT4 chunks), with and without a divisor."""
    for seed in range(3):
        payloads = _mixed_payloads(numel, k, bits, group_size, seed)
        for divide_by in (1.0, 3.0, 0.1):
            what = f"bits={bits} k={k} n={numel} gs={group_size} divide_by={divide_by} seed={seed}"
            _check_reductions(target, payloads, numel, bits, group_size, divide_by, what)


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("k", (1, 4))
@pytest.mark.parametrize("divide_by", (1.0, 4.0, 0.3))
def test_dequant_reduce_hard_cases(target: Target, bits: int, k: int, divide_by: float):
    for gs in GROUP_SIZES[bits]:
        for n in (6, 6 * 1001, 6 * 65_536):
            rows = make_payloads(n, gs, bits, k=k, seed=n + k)
            _check_reductions(target, rows, n, bits, gs, divide_by, f"bits={bits} k={k} gs={gs} n={n}")


@pytest.mark.parametrize("bits", (8, 4))
def test_misaligned_views(target: Target, bits: int):
    """Inputs, payloads and outputs at odd byte offsets inside larger buffers (unaligned
    scales; on CUDA, no vector or word access)."""
    n, gs = 4096, 32
    x = make_hard_input(n + 1, gs, torch.float32, bits, seed=3).to(target.device)
    want = q.quantize(x[1:].cpu(), bits, gs, backend="reference")
    assert_same_bytes(q.quantize(x[1:], bits, gs, backend=target.backend), want, f"{target} quantize of x[1:]")
    buffer = torch.zeros(want.numel() + 1, dtype=torch.uint8, device=target.device)
    q.quantize(x[:n], bits, gs, backend=target.backend, out=buffer[1:])
    assert_same_bytes(buffer[1:], q.quantize(x[:n].cpu(), bits, gs, backend="reference"), "quantize into buffer[1:]")
    rows = make_payloads(n, gs, bits, k=2, seed=5)
    odd = torch.zeros(rows.numel() + 1, dtype=torch.uint8, device=target.device)[1:].view(rows.shape)
    odd.copy_(rows)
    got = q.dequant_reduce(odd, n, bits, gs, requant_chunks=2, backend=target.backend)
    assert_same_bytes(got, q.dequant_reduce(rows, n, bits, gs, requant_chunks=2, backend="reference"), "requant")
    got = q.dequantize(odd, n, bits, gs, torch.float32, backend=target.backend)
    assert_same_bytes(got, q.dequantize(rows, n, bits, gs, torch.float32, backend="reference"), "dequantize")


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("dtype", DTYPES)
def test_large_groups_and_one_group_per_tensor(target: Target, bits: int, dtype: torch.dtype):
    """Groups above the CUDA team scheme's limit (several tiles per group, short last groups
    and tiles, scalar paths), through all three encoders; and ``group_size="tensor"``."""
    for n, gs in ((1 << 22, 1 << 22), (3 * 8192 + 6, 3 * 8192 + 6), (200_002, 10_002), (262_144, 40_960)):
        x = make_hard_input(n, gs, dtype, bits, seed=n + gs)
        want = q.quantize(x, bits, gs, backend="reference")
        assert_same_bytes(target.run(q.quantize, x, bits, gs), want, f"{target} quantize n={n} gs={gs}")
        if n == gs:
            assert_same_bytes(target.run(q.quantize, x, bits, q.TENSOR), want, f"{target} quantize tensor n={n}")
    x = make_hard_input(8 * 9000 * 2, 20_000, dtype, bits, seed=3)
    perm = (7, 5, 3, 1, 0, 2, 4, 6)
    got = target.run(q.reorder_quantize, x, perm, 2, bits, 20_000)
    assert_same_bytes(got, q.reorder_quantize(x, perm, 2, bits, 20_000, backend="reference"), "reorder_quantize")
    rows = make_payloads(6 * 9000, 18_000, bits, k=3, seed=4)
    for m in (1, 3):
        got = target.run(q.dequant_reduce, rows, 6 * 9000, bits, 18_000, requant_chunks=m, divide_by=3.0)
        want = q.dequant_reduce(rows, 6 * 9000, bits, 18_000, requant_chunks=m, divide_by=3.0, backend="reference")
        assert_same_bytes(got, want, f"dequant_reduce requant_chunks={m}")


@pytest.mark.parametrize("bits", (8, 4))
def test_subnormal_inputs_scales_and_products_are_not_flushed(target: Target, bits: int):
    """fp32 groups whose values, scales and dequantized products are subnormal ([Note:
    explicit rounding] in wire_math.cuh): flush-to-zero arithmetic would give zero scales
    and values."""
    gen = torch.Generator().manual_seed(9)
    tiny = torch.finfo(torch.float32).smallest_normal
    x = torch.randn(64 * 1024, generator=gen) * tiny * torch.rand(64 * 1024, generator=gen)
    payload = q.quantize(x, bits, 64, backend="reference")
    scales = payload[-4 * 1024 :].view(torch.float32)
    assert bool(((scales > 0) & (scales < tiny)).all())  # the case under test
    assert_same_bytes(target.run(q.quantize, x, bits, 64), payload, f"{target} quantize")
    got = target.run(q.dequantize, payload, x.numel(), bits, 64, torch.float32)
    want = q.dequantize(payload, x.numel(), bits, 64, torch.float32, backend="reference")
    assert bool((want != 0).any())
    assert_same_bytes(got, want, f"{target} dequantize")


def test_input_requiring_grad(target: Target):
    """Parameters (requires_grad) are quantized without a copy or an autograd error."""
    x = make_input(1000, torch.float32, "normal", 0).to(target.device).requires_grad_()
    with torch.no_grad():
        expected = q.quantize(x.cpu(), 8, 128, backend="reference")
    assert_same_bytes(q.quantize(x, 8, 128, backend=target.backend), expected, "quantize of a leaf requiring grad")
