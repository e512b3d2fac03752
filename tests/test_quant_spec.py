"""QuantSpec: the one place bits and group sizes are validated, and the "tensor" policy."""

from __future__ import annotations

import pytest

from zcomm.quant import DEFAULT_GROUP_SIZE, TENSOR, QuantSpec, payload_nbytes


def test_defaults_per_width():
    assert QuantSpec(bits=8).group_size == DEFAULT_GROUP_SIZE[8] == 2048
    assert QuantSpec(bits=4).group_size == DEFAULT_GROUP_SIZE[4] == 512


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
