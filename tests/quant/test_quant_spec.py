"""QuantSpec: the one place bits and group sizes are validated, and the "tensor" policy, in
the spec itself and through the ops that take it."""

from __future__ import annotations

import pytest
import torch

from zcomm import quant
from zcomm.quant import DEFAULT_GROUP_SIZE, TENSOR, QuantSpec, payload_nbytes


def test_defaults_per_width():
    assert QuantSpec(bits=8).group_size == DEFAULT_GROUP_SIZE[8] == 256
    assert QuantSpec(bits=4).group_size == DEFAULT_GROUP_SIZE[4] == 256


@pytest.mark.parametrize("bits,group_size", ((8, 2), (8, 7), (4, 2), (4, 6), (4, 2**30)))
def test_valid_int_group_sizes_are_kept(bits, group_size):
    spec = QuantSpec(bits=bits, group_size=group_size)
    assert spec.group_size == group_size and not spec.per_tensor
    assert spec.group_size_for(12345) == group_size


@pytest.mark.parametrize(
    "kwargs,error,match",
    (
        ({"bits": 6}, ValueError, "bits must be one of"),
        ({"bits": True}, TypeError, "bits must be an int"),
        ({"bits": 8.0}, TypeError, "bits must be an int"),
        ({"bits": 8, "group_size": 1}, ValueError, ">= 2"),
        ({"bits": 4, "group_size": 7}, ValueError, "even for 4-bit"),
        ({"bits": 8, "group_size": True}, TypeError, "group_size must be"),
        ({"bits": 8, "group_size": 2.0}, TypeError, "group_size must be"),
        ({"bits": 8, "group_size": "block"}, TypeError, "group_size must be"),
    ),
)
def test_bad_specs_fail_with_the_argument_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        QuantSpec(**kwargs)


def test_positional_arguments_are_refused():
    with pytest.raises(TypeError):
        QuantSpec(8, 128)  # type: ignore[misc]


@pytest.mark.parametrize("numel,int8,int4", ((0, 2, 2), (1, 2, 2), (5, 5, 6), (1000, 1000, 1000), (1001, 1001, 1002)))
def test_tensor_group_covers_the_payload(numel, int8, int4):
    assert QuantSpec(bits=8, group_size=TENSOR).group_size_for(numel) == int8
    assert QuantSpec(bits=4, group_size=TENSOR).group_size_for(numel) == int4
    for bits in (8, 4):
        spec = QuantSpec(bits=bits, group_size=TENSOR)
        assert spec.per_tensor
        # one scale: values, padding to 4 bytes, then exactly one fp32 scale
        assert payload_nbytes(numel, bits, spec.group_size_for(numel)) % 4 == 0
        if numel:
            assert payload_nbytes(numel, bits, spec.group_size_for(numel)) - payload_nbytes(numel, bits, 1 << 40) == 0


@pytest.mark.parametrize("backend", ("reference", "cpu"))
@pytest.mark.parametrize("bits", (8, 4))
def test_ops_take_the_tensor_and_default_group_sizes(backend, bits):
    """The ops and payload_nbytes take what QuantSpec takes: "tensor" gives one scale per
    payload (the bytes of an int group size covering it), None the width's default."""
    x = torch.randn(1001, generator=torch.Generator().manual_seed(bits))
    n = x.numel()
    covering = QuantSpec(bits=bits, group_size=TENSOR).group_size_for(n)
    payload = quant.quantize(x, bits, TENSOR, backend=backend)
    assert torch.equal(payload, quant.quantize(x, bits, covering, backend=backend))
    assert payload.numel() == quant.payload_nbytes(n, bits, TENSOR) == quant.scales_offset(n, bits) + 4
    back = quant.dequantize(payload, n, bits, TENSOR, torch.float32, backend=backend)
    assert torch.equal(back, quant.dequantize(payload, n, bits, covering, torch.float32, backend=backend))
    default = quant.quantize(x, bits, DEFAULT_GROUP_SIZE[bits], backend=backend)
    assert torch.equal(quant.quantize(x, bits, None, backend=backend), default)
    # one scale per chunk of the reorder, and per re-quantized chunk of the sum
    rows = quant.reorder_quantize(x[:1000], (1, 0), 2, bits, TENSOR, backend=backend)
    chunks = x[:1000].view(2, 500).flip(0)
    assert torch.equal(rows, torch.stack([quant.quantize(c, bits, TENSOR, backend=backend) for c in chunks]))
    total = quant.dequant_reduce(rows, 500, bits, TENSOR, backend=backend)
    requant = quant.dequant_reduce(rows, 500, bits, TENSOR, requant_chunks=2, backend=backend)
    expected = torch.stack([quant.quantize(c, bits, TENSOR, backend=backend) for c in total.view(2, 250)])
    assert torch.equal(requant, expected)
    # INT8 rows of an odd length into one INT4 chunk: one scale each side (INT4 rounds the
    # group up to even, which changes no byte of the INT8 rows)
    rows = torch.stack([quant.quantize(c, 8, TENSOR, backend=backend) for c in x[:1001].view(7, 143)[:2]])
    requant = quant.dequant_reduce(rows, 143, 8, TENSOR, requant_chunks=1, requant_bits=4, backend=backend)
    total = quant.dequant_reduce(rows, 143, 8, TENSOR, backend=backend)
    assert torch.equal(requant[0], quant.quantize(total, 4, TENSOR, backend=backend))
