"""The ``cpu`` backend produces the ``reference`` backend's bytes, for every op and input.

The reference (plain torch, following the wire format literally) is the oracle: payloads
and dequantized tensors must agree byte for byte, NaN and Inf included.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import zcomm.quant as q
from quant_cpu_cases import DTYPES, KINDS, assert_same_bytes, make_input

GROUP_SIZES = (32, 128, 512, 2048)
BITS = (8, 4)


def _sizes(group_size: int) -> tuple[int, ...]:
    return (1, 7, group_size - 1, group_size + 1, 3 * group_size + 5)


def _check_roundtrip(x: torch.Tensor, bits: int, group_size: int, what: str) -> None:
    """quantize on both backends, then dequantize the payload on both to every dtype."""
    expected = q.quantize(x, bits, group_size, backend="reference")
    assert_same_bytes(q.quantize(x, bits, group_size, backend="cpu"), expected, f"quantize {what}")
    for dtype in DTYPES:
        ref = q.dequantize(expected, x.numel(), bits, group_size, dtype, backend="reference")
        got = q.dequantize(expected, x.numel(), bits, group_size, dtype, backend="cpu")
        assert_same_bytes(got, ref, f"dequantize to {dtype} {what}")


@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_dequantize_sweep(dtype: torch.dtype, bits: int, group_size: int) -> None:
    for numel in _sizes(group_size):
        for seed, kind in enumerate(KINDS):
            x = make_input(numel, dtype, kind, seed, group_size)
            _check_roundtrip(x, bits, group_size, f"{dtype} bits={bits} gs={group_size} n={numel} {kind}")


@pytest.mark.parametrize(
    ("numel", "dtype", "bits", "group_size", "kind"),
    [
        (999_983, torch.float32, 8, 512, "nonfinite"),
        (1_000_003, torch.bfloat16, 4, 2048, "random_bits"),
        (999_979, torch.float16, 4, 128, "normal"),
    ],
)
def test_large_prime_sizes(numel: int, dtype: torch.dtype, bits: int, group_size: int, kind: str) -> None:
    x = make_input(numel, dtype, kind, numel, group_size)
    _check_roundtrip(x, bits, group_size, f"{dtype} bits={bits} gs={group_size} n={numel} {kind}")


@pytest.mark.parametrize("bits", BITS)
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
def test_reorder_quantize(
    dtype: torch.dtype, bits: int, perm: tuple[int, ...], num_chunks: int, slice_len: int, group_size: int
) -> None:
    """Slices and chunks whose boundaries fall inside groups (and on odd INT4 positions)."""
    for seed, kind in enumerate(KINDS):
        x = make_input(len(perm) * slice_len, dtype, kind, seed, group_size)
        expected = q.reorder_quantize(x, perm, num_chunks, bits, group_size, backend="reference")
        got = q.reorder_quantize(x, perm, num_chunks, bits, group_size, backend="cpu")
        assert_same_bytes(got, expected, f"reorder_quantize {dtype} bits={bits} perm={perm} chunks={num_chunks} {kind}")


def _random_payload(numel: int, bits: int, group_size: int, seed: int) -> torch.Tensor:
    """Any bytes a peer could send: every code (INT4 -8 included), garbage padding, and scales
    that are negative (so -0 products), subnormal, huge or NaN with a payload."""
    gen = torch.Generator().manual_seed(seed)
    payload = torch.randint(0, 256, (q.payload_nbytes(numel, bits, group_size),), generator=gen, dtype=torch.uint8)
    scales = payload[q.scales_offset(numel, bits) :].view(torch.float32)
    specials = torch.tensor([-0.5, 0.0, -0.0, 1e-45, 3e38, float("inf"), -2.5, float("-inf")])
    scales.copy_(specials[torch.randint(0, specials.numel(), scales.shape, generator=gen)])
    payload[q.scales_offset(numel, bits) :].view(torch.int32)[-1] = 0x7F800001  # a signalling NaN
    return payload


def _payloads(numel: int, k: int, bits: int, group_size: int, seed: int) -> torch.Tensor:
    """``k`` payloads of different kinds: reference payloads (the huge ones overflow when
    summed) and arbitrary bytes."""
    rows = []
    for row in range(k):
        kind = ("normal", "random_payload", "huge", "nonfinite", "tiny", "zero_groups", "huge")[(seed + row) % 7]
        if kind == "random_payload":
            rows.append(_random_payload(numel, bits, group_size, seed * 10 + row))
            continue
        x = make_input(numel, torch.float32, kind, seed * 10 + row, group_size)
        rows.append(q.quantize(x, bits, group_size, backend="reference"))
    return torch.stack(rows)


@pytest.mark.parametrize("bits", BITS)
def test_dequantize_arbitrary_payload_bytes(bits: int) -> None:
    """Rows of arbitrary bytes decode identically, landing one after another in the output."""
    numel, group_size = 301, 32
    payloads = torch.stack([_random_payload(numel, bits, group_size, seed) for seed in range(3)])
    for dtype in DTYPES:
        ref = q.dequantize(payloads, numel, bits, group_size, dtype, backend="reference")
        got = q.dequantize(payloads, numel, bits, group_size, dtype, backend="cpu")
        assert_same_bytes(got, ref, f"dequantize arbitrary bytes to {dtype}")


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("k", (1, 2, 3, 4))
@pytest.mark.parametrize(("numel", "group_size"), [(1, 32), (390, 32), (6 * 129, 128), (4100, 512)])
def test_dequant_reduce(bits: int, k: int, numel: int, group_size: int) -> None:
    """Sums to every dtype and re-quantized into m chunks (chunks that cut through input
    groups, odd-length INT4 chunks), with and without a divisor."""
    for seed in range(3):
        payloads = _payloads(numel, k, bits, group_size, seed)
        for divide_by in (1.0, 3.0, 0.1):
            what = f"bits={bits} k={k} n={numel} gs={group_size} divide_by={divide_by} seed={seed}"
            args = (payloads, numel, bits, group_size)
            for dtype in DTYPES:
                ref = q.dequant_reduce(*args, dtype=dtype, divide_by=divide_by, backend="reference")
                got = q.dequant_reduce(*args, dtype=dtype, divide_by=divide_by, backend="cpu")
                assert_same_bytes(got, ref, f"dequant_reduce to {dtype} {what}")
            for chunks in (m for m in (1, 2, 3, 6) if numel % m == 0):
                ref = q.dequant_reduce(*args, requant_chunks=chunks, divide_by=divide_by, backend="reference")
                got = q.dequant_reduce(*args, requant_chunks=chunks, divide_by=divide_by, backend="cpu")
                assert_same_bytes(got, ref, f"dequant_reduce requant_chunks={chunks} {what}")


def test_input_requiring_grad() -> None:
    """Parameters (requires_grad) are quantized without a copy or an autograd error."""
    x = make_input(1000, torch.float32, "normal", 0).requires_grad_()
    with torch.no_grad():
        expected = q.quantize(x, 8, 128, backend="reference")
    assert_same_bytes(q.quantize(x, 8, 128, backend="cpu"), expected, "quantize of a leaf requiring grad")


def test_concurrent_calls_from_threads() -> None:
    """Kernels release the GIL and may run from several threads at once (a communication
    thread beside the training thread): each call still produces its own exact bytes."""
    inputs = [make_input(200_003, torch.float32, "normal", seed) for seed in range(4)]
    expected = [q.quantize(x, 4, 128, backend="reference") for x in inputs]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda x: q.quantize(x, 4, 128, backend="cpu"), inputs * 3))
    for i, got in enumerate(results):
        assert_same_bytes(got, expected[i % len(inputs)], f"threaded quantize #{i}")


def test_payloads_at_odd_byte_offsets() -> None:
    """Payloads living inside a larger byte buffer (unaligned scales) read and write correctly."""
    x = make_input(1000, torch.float32, "nonfinite", 3)
    expected = q.quantize(x, 8, 128, backend="reference")
    buffer = torch.zeros(expected.numel() + 1, dtype=torch.uint8)
    got = q.quantize(x, 8, 128, backend="cpu", out=buffer[1:])
    assert_same_bytes(got, expected, "quantize into an odd offset")
    ref = q.dequantize(expected, 1000, 8, 128, torch.float32, backend="reference")
    assert_same_bytes(q.dequantize(buffer[1:], 1000, 8, 128, torch.float32, backend="cpu"), ref, "dequantize")
