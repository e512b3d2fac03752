"""Every launch the cuda backend makes matches its kernel's parameter list in the compiled PTX.

A kernel launched with one argument too few, or an int where the kernel takes a 64-bit
value, reads garbage with no error on the GPU. Here its kernels (``_cuda_launch``) run on CPU
tensors with ``loader.launch`` replaced by a recorder, for every op, dtype, bit width and both encoder
schemes; each recorded argument tuple is compared with the ``.param`` list of the kernel of
that name in the PTX (nvcc, the loader's translation unit and options): same count, and
each argument's width and kind (fp32 or integer) as declared. An argument is a numpy scalar
of its parameter's type or, in a 64-bit integer parameter only, a Python int in [0, 2^63):
a tensor's address, which cupy passes as a 64-bit integer, exact in that range ([Note:
launch arguments] in ``_cuda_launch``). A Python int anywhere else (a 32-bit or float
parameter) is caught as a wrong width or kind.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from cuda_fakes import fake_launch_plans
from cuda_support import requires_nvcc
from nvcc_builds import Builds, Ptx
from zcomm.quant import payload_nbytes
from zcomm.quant.backends import _cuda_launch as cuda_launch
from zcomm_cuda import loader

pytestmark = requires_nvcc

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
ENCODERS = ("zc_quantize_", "zc_reorder_quantize_", "zc_reorder_interleaved_", "zc_dequant_reduce_requant_")
PARAM_BYTES = {"u64": 8, "b64": 8, "s64": 8, "u32": 4, "b32": 4, "s32": 4, "f32": 4}


# the PTX read: the loader's translation units with its options (also read by test_cuda_compile.py)
COMPILES = [Ptx(source, True, "sm_90", loader.NVRTC_OPTIONS) for source in loader.KERNEL_SOURCES]


def builds_of(item: pytest.Item, builds: Builds) -> None:
    """Start the compiles ``item`` reads ([Note: background builds] in nvcc_builds.py)."""
    if "kernel_params" in getattr(item, "fixturenames", ()):
        for job in COMPILES:
            builds.start_ptx(job)


@pytest.fixture(scope="module")
def kernel_params(nvcc_builds: Builds) -> dict[str, list[str]]:
    """Kernel name -> its PTX parameter types (e.g. ``["u64", "f32"]``), over all sources."""
    params = {}
    for job in COMPILES:
        for name, body in re.findall(r"\.entry\s+(\w+)\(([^)]*)\)", nvcc_builds.ptx(job)):
            params[name] = re.findall(r"\.param\s+\.(\w+)\s", body)
    return params


@pytest.fixture()
def launches(monkeypatch) -> list[tuple[str, str, tuple]]:
    recorded = []
    def record(source, name, device, blocks, threads, args):
        recorded.append((source, name, tuple(args)))

    monkeypatch.setattr(loader, "launch", record)
    fake_launch_plans(monkeypatch)
    return recorded


def _kind(arg: object) -> tuple[int, bool]:
    """(bytes, is_float) of one launch argument as cupy passes it: a numpy scalar by value at its own width, a
    Python int as a 64-bit integer (an address, so below 2^63, where cupy's int64 of it is exact)."""
    if type(arg) is int:
        assert 0 <= arg < 2**63, f"{arg!r}: a Python int goes only as an address, in [0, 2^63)"
        return 8, False
    assert isinstance(arg, np.generic), f"{arg!r}: pass numpy scalars (or an address as a Python int)"
    return arg.itemsize, isinstance(arg, np.floating)


@pytest.mark.parametrize("arg, declared", [
    (7, (4, False)),  # a Python int where the kernel takes 32 bits
    (7, (4, True)),  # ... or an fp32
    (np.int32(7), (8, False)),  # a 32-bit scalar where it takes 64
    (np.int64(7), (4, False)),
    (np.float64(1.0), (4, True)),  # a double for an fp32
], ids=["int-u32", "int-f32", "int32-u64", "int64-u32", "f64-f32"])  # fmt: skip
def test_the_rule_still_catches_a_wrong_width_or_kind(arg, declared) -> None:
    assert _kind(arg) != declared


@pytest.mark.parametrize("arg", [-1, 2**63, True, 1.0])
def test_the_rule_refuses_a_python_scalar_that_is_no_address(arg) -> None:
    with pytest.raises(AssertionError):
        _kind(arg)


def _run_every_op(bits: int, dtype: torch.dtype, group_size: int) -> None:
    numel, chunks, perm = 6 * 4 * group_size, 3, (2, 0, 1, 5, 4, 3)
    x = torch.zeros(numel, dtype=dtype)
    row = payload_nbytes(numel, bits, group_size)
    cuda_launch.quantize(x, bits, group_size, torch.empty(row, dtype=torch.uint8))
    payloads = torch.zeros(2, row, dtype=torch.uint8)
    cuda_launch.dequantize(payloads, numel, bits, group_size, torch.empty(2 * numel, dtype=dtype))
    chunk_rows = torch.empty(chunks, payload_nbytes(numel // chunks, bits, group_size), dtype=torch.uint8)
    cuda_launch.reorder_quantize([x], 1, numel, perm, chunks, bits, group_size, chunk_rows)
    # the interleaved form: two tensors of 6 parts whose pieces leave a zero fill in each part
    pieces = [x[: 6 * group_size], x[6 * group_size : 6 * 3 * group_size]]
    cuda_launch.reorder_quantize(pieces, 6, 4 * group_size, perm, chunks, bits, group_size, chunk_rows)
    cuda_launch.dequant_reduce(payloads, numel, bits, group_size, 2.0, torch.empty(numel, dtype=dtype))
    for out_bits in (8, 4):
        requant_rows = torch.empty(chunks, payload_nbytes(numel // chunks, out_bits, group_size), dtype=torch.uint8)
        cuda_launch.dequant_reduce_requant(payloads, numel, bits, out_bits, group_size, 2.0, requant_rows)


@pytest.mark.parametrize("wide", (False, True), ids=("idx32", "idx64"))
@pytest.mark.parametrize("group_size", (64, 10_000), ids=("teams", "tiles"))
@pytest.mark.parametrize("bits", (8, 4))
def test_launch_arguments_match_kernel_parameters(kernel_params, launches, monkeypatch, bits, group_size, wide):
    if wide:  # the reordering kernels' 64-bit index path, which real sizes take above 2^31 elements
        monkeypatch.setattr(cuda_launch, "WIDE_NUMEL", 0)
    for dtype in DTYPES:
        _run_every_op(bits, dtype, group_size)
    encoder_launches = sum(name.startswith(ENCODERS) for _, name, _ in launches)
    assert encoder_launches == 3 * 5 * (1 if group_size <= cuda_launch.TEAM_MAX_GROUP else 2)  # 3 dtypes, 5 launches
    for source, name, args in launches:
        assert source in loader.KERNEL_SOURCES and name in kernel_params, name
        declared = [(PARAM_BYTES[t], t == "f32") for t in kernel_params[name]]
        assert [_kind(a) for a in args] == declared, name
        addresses = sum(type(a) is int for a in args)
        assert 2 <= addresses <= 5, (name, args)  # an input, an output, the encoders' group_absmax, a perm, a table
    assert sum("_wide_" in name for _, name, _ in launches) == (2 * 3 * (1 if group_size <= 4096 else 2) if wide else 0)
    # the interleaved form's register kernel ([Note: register kernel]) for groups held in registers
    registers = group_size <= 1024 and not wide
    assert sum("_interleaved_regs_" in name for _, name, _ in launches) == (3 if registers else 0)
    # and dequant_reduce's, on 32-bit indices, for the divisor 2.0 ([Note: narrow requant])
    assert sum("_requant_regs_pow2_" in name for _, name, _ in launches) == (2 * 3 if registers else 0)


def test_requant_takes_the_narrow_kernel_of_its_divisor(launches, monkeypatch):
    """dequant_reduce_requant's choice ([Note: narrow requant]): the register scheme's kernel of the
    divisor's mode when the groups are held in registers, both buffers have the vector layout and
    the input has at most WIDE_NUMEL elements; the general kernel otherwise."""
    numel, group_size, chunks = 3 * 1344, 256, 3  # chunks of 5.25 groups, whole runs
    row, out_row = payload_nbytes(numel, 8, group_size), payload_nbytes(numel // chunks, 4, group_size)
    payloads, out = torch.zeros(2, row, dtype=torch.uint8), torch.empty(chunks, out_row, dtype=torch.uint8)
    for divide_by, mode in ((1.0, "one"), (8.0, "pow2"), (0.5, "pow2"), (2.0**126, "pow2"), (3.0, "div"),
                            (2.0**127, "div"), (0.1, "div")):
        cuda_launch.dequant_reduce_requant(payloads, numel, 8, 4, group_size, divide_by, out)
        assert launches[-1][1] == f"zc_dequant_reduce_requant_regs_{mode}_int8_int4", divide_by
    general = "zc_dequant_reduce_requant_int8_int4"
    shifted = torch.zeros(2 * row + 8, dtype=torch.uint8)[4 : 4 + 2 * row].view(2, row)  # off the 8-byte runs
    cuda_launch.dequant_reduce_requant(shifted, numel, 8, 4, group_size, 1.0, out)
    assert launches[-1][1] == general
    wide_out = torch.empty(1, payload_nbytes(2 * 2048, 4, 2048), dtype=torch.uint8)  # groups past the registers
    cuda_launch.dequant_reduce_requant(torch.zeros(2, payload_nbytes(4096, 8, 2048), dtype=torch.uint8), 4096, 8, 4,
                                       2048, 1.0, wide_out)
    assert launches[-1][1] == general
    monkeypatch.setattr(cuda_launch, "WIDE_NUMEL", numel - 1)  # more elements than 32-bit indices serve
    cuda_launch.dequant_reduce_requant(payloads, numel, 8, 4, group_size, 1.0, out)
    assert launches[-1][1] == general
