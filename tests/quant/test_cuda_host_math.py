"""The CUDA kernels' arithmetic, run on the CPU, against the reference backend's bytes.

tests/quant/cuda_host/host_check.cu is compiled with nvcc as a host program that runs the very
__host__ __device__ code of the kernels (encoder lanes, decoder runs, sources, packing,
wire-format math) with loops in place of the GPU's parallelism. Each case writes its input
to a file, has one host_check process (serving every case: tests/quant/host_check_server.py)
run it, and compares the output bytes with ``zcomm.quant``'s
reference backend, for the aligned (vector) and misaligned (scalar) paths and for both
encoder schemes (teams for groups up to ``TEAM_MAX_GROUP`` elements, tiles above: groups of
several tiles, a short last tile, one group for the whole tensor). The program reports
which path and scheme it took, and the tests check that too, so all are known to be covered.
"""

from __future__ import annotations

import re
import struct
from typing import NamedTuple

import numpy as np
import pytest
import torch

import host_check_server
import zcomm.quant as zq
from cuda_support import REPO, requires_nvcc
from host_check_server import HostCheck
from quant_cases import DTYPE_TAG, DTYPES, STRETCH_CASES, make_hard_input, make_payloads
from zcomm.quant.backends import _cuda_launch as cuda_launch

pytestmark = requires_nvcc

KERNELS = REPO / "zcomm_cuda" / "kernels"
# the conftest starts this module's host_check build in the background ([Note: background builds])
builds_of = host_check_server.builds_of


class Ran(NamedTuple):
    out: bytes
    vec: bool  # the vector paths ran
    tiles: bool  # the encoder ran the tile scheme
    regs: bool  # the encoder's teams held their groups in registers (one read)
    teams: bool  # the decoder ran the team layout


def _run(host_check: HostCheck, args: list[object], data: torch.Tensor) -> Ran:
    """Run one op on ``data``'s bytes."""
    src, dst = host_check.scratch / "in.bin", host_check.scratch / "out.bin"
    src.write_bytes(data.contiguous().view(torch.uint8).numpy().tobytes())
    dst.unlink(missing_ok=True)  # no earlier case's output is read as this one's
    flags = dict(item.split("=") for item in host_check.run(*args, src, dst).split())
    return Ran(*(dst.read_bytes(), *(flags[key] == "1" for key in ("vec", "tiles", "regs", "teams"))))


def _tiles(extent: int) -> bool:
    """Whether the launcher runs the tile scheme for groups of ``extent`` elements."""
    return cuda_launch.encoder_passes(1, extent, 1)[0][0] != cuda_launch.TEAMS


def _team_constant(name: str) -> str:
    """A constant of team_walk.cuh, which the checks below mirror to know which path must run."""
    return re.search(rf"constexpr \w+ {name} = ([^;]+);", (KERNELS / "team_walk.cuh").read_text()).group(1)


RUNS_PER_LANE = int(_team_constant("kRunsPerLane"))
REGISTER_MAX_GROUP = 32 * 8 * RUNS_PER_LANE
assert _team_constant("kRegisterMaxGroup") == "32 * 8 * kRunsPerLane"
TEAM_MAX_GROUP = int(_team_constant("kTeamMaxGroup"))


def _regs(vec: bool, extent: int) -> bool:
    """Whether the encoder's teams hold groups of ``extent`` elements in registers."""
    return vec and extent <= REGISTER_MAX_GROUP


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _run_bytes(bits: int) -> int:
    """Bytes of 8 codes (the vector unit of vector_io.cuh)."""
    return 8 if bits == 8 else 4


def _sizes(group_size: int) -> tuple[int, ...]:
    return (1, group_size - 1, 9 * group_size + 3, 18 * group_size)


# 520: teams of 32 lanes holding the group in registers, some lanes with a run fewer;
# 1032: just past the registers (streamed teams), each lane looping over several runs.
# 4096 / 4097: the largest team group, the smallest tiled one; 20000 / 10006: three tiles,
# the last one short (10006: scalar paths, not a multiple of 8).
GROUP_SIZES = {8: (7, 8, 40, 520, 1032, 4096, 4097, 20000), 4: (2, 6, 32, 100, 4096, 10006)}
LARGE = 4096
QUANT_CASES = [
    (dtype, bits, gs, n)
    for dtype in DTYPES
    for bits in (8, 4)
    for gs in GROUP_SIZES[bits]
    for n in sorted(set(_sizes(gs) if gs < LARGE else (1, gs - 1, 2 * gs + 3, 3 * gs)))
]


@pytest.mark.parametrize("misalign", (0, 1))
@pytest.mark.parametrize("dtype,bits,group_size,numel", QUANT_CASES)
def test_quantize(host_check, dtype, bits, group_size, numel, misalign):
    x = make_hard_input(numel, group_size, dtype, bits, seed=numel + group_size)
    ran = _run(host_check, ["quantize", DTYPE_TAG[dtype], bits, group_size, misalign], x)
    assert ran.out == _bytes(zq.quantize(x, bits, group_size, backend="reference"))
    assert ran.vec == (not misalign and group_size % 8 == 0 and numel % 8 == 0)
    assert ran.tiles == _tiles(min(group_size, numel))
    assert ran.regs == _regs(ran.vec, min(group_size, numel))


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", (3 * 8192 + 16, 5 * 8192 + 2))
def test_quantize_one_group_per_tensor(host_check, dtype, bits, numel):
    """``quant_group_size="tensor"``: one group of the whole input, cut into tiles."""
    x = make_hard_input(numel, numel, dtype, bits, seed=numel)
    x[numel // 2] = torch.finfo(dtype).smallest_normal / 8  # one subnormal among many normals
    ran = _run(host_check, ["quantize", DTYPE_TAG[dtype], bits, numel, 0], x)
    assert ran.out == _bytes(zq.quantize(x, bits, numel, backend="reference"))
    assert ran.tiles and ran.vec == (numel % 8 == 0)


REORDER_CASES = [
    # (numel, perm, num_chunks, group_size): slices and chunks on and off run boundaries
    (64 * 8, (3, 1, 0, 2), 2, 32),
    (64 * 8, (7, 6, 5, 4, 3, 2, 1, 0), 4, 40),
    (4 * 36, (1, 0, 3, 2), 4, 8),
    (6 * 10, (2, 0, 1), 6, 4),
    (3 * 2 * 17, (1, 2, 0), 2, 6),
    (12 * 64, (5, 3, 1, 0, 2, 4), 3, 256),
    # tiled groups: 2.5 tiles per group, a short last group per chunk; then scalar paths
    (8 * 5000 * 3, (7, 6, 5, 4, 3, 2, 1, 0), 2, 20480),
    (6 * 3 * 3400, (5, 3, 1, 0, 2, 4), 3, 10002),
]


def _divisors(wide: bool, slice_numel: int, part_numel: int | None = None) -> str:
    """The reordering kernels' divisor arguments as the launcher computes them, for host_check."""
    values = [int(wide), *cuda_launch.magic_divisor(slice_numel, wide)]
    if part_numel is not None:
        values += cuda_launch.magic_divisor(part_numel, wide)
    return ",".join(map(str, values))


@pytest.mark.parametrize("wide", (0, 1), ids=("idx32", "idx64"))
@pytest.mark.parametrize("misalign", (0, 1))
@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel,perm,num_chunks,group_size", REORDER_CASES)
def test_reorder_quantize(host_check, dtype, bits, numel, perm, num_chunks, group_size, misalign, wide):
    x = make_hard_input(numel, group_size, dtype, bits, seed=numel)
    args = ["reorder", DTYPE_TAG[dtype], bits, group_size, misalign, num_chunks, ",".join(map(str, perm)),
            _divisors(wide, numel // len(perm))]
    ran = _run(host_check, args, x)
    assert ran.out == _bytes(zq.reorder_quantize(x, perm, num_chunks, bits, group_size, backend="reference"))
    chunk, row = numel // num_chunks, zq.payload_nbytes(numel // num_chunks, bits, group_size)
    aligned = group_size % 8 == 0 and chunk % 8 == 0 and (numel // len(perm)) % 8 == 0 and row % _run_bytes(bits) == 0
    assert ran.vec == (not misalign and aligned)
    assert ran.tiles == _tiles(min(group_size, chunk))
    assert ran.regs == _regs(ran.vec, min(group_size, chunk))


INTERLEAVE_CASES = [
    # (parts, widths, part_numel, perm, num_chunks, group_size): pieces and the zero fill on
    # and off run boundaries, an empty tensor, one tensor with a fill (reduce_scatter_q4's
    # padded slices), and a tiled group spanning several tensors
    (4, (3, 0, 10, 7), 24, (3, 2, 1, 0, 7, 6, 5, 4), 4, 6),
    (4, (64, 24, 40), 128, (1, 0, 3, 2), 2, 32),
    (2, (40, 17), 64, (3, 1, 0, 2), 2, 8),
    (4, (1001,), 1004, (0, 4, 1, 5, 2, 6, 3, 7), 4, 502),
    (3, (9000, 3001, 1), 12003, (2, 0, 1), 3, 20000),
    # groups held in registers whose lanes' runs cross pieces and the fill: aligned pieces,
    # then pieces off run boundaries (scalar runs)
    (2, (64, 128, 16), 256, (3, 1, 2, 0), 2, 128),
    (4, (300, 8, 100), 512, (1, 0, 3, 2, 5, 4, 7, 6), 2, 256),
    # register groups of 256 on vector-aligned pieces whose ends fall in a group's last run
    # only (248), on its first (512, 520) or on a group end (1024), and groups that each
    # cross a slice end (slices of 128) one run after a piece end (120): which lanes' runs
    # one stretch serves ([Note: round stretch])
    (2, (248, 264, 8, 504), 1024, (1, 0, 3, 2, 5, 4, 7, 6), 2, 256),
    (2, (120, 392), 512, (3, 1, 2, 0, 7, 5, 6, 4), 2, 256),
]


@pytest.mark.parametrize("misalign", (0, 1))
@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parts,widths,part_numel,perm,num_chunks,group_size", INTERLEAVE_CASES)
def test_reorder_quantize_interleaved(
    host_check, dtype, bits, parts, widths, part_numel, perm, num_chunks, group_size, misalign
):
    """The interleaved form ([Note: interleaved input]): tensors in separate buffers, read through the table."""
    _check_interleaved(host_check, dtype, bits, parts, widths, part_numel, perm, num_chunks, group_size,
                       misalign, wide=False)


def _check_interleaved(host_check, dtype, bits, parts, widths, part_numel, perm, num_chunks, group_size,
                       misalign, wide):
    if bits == 4 and group_size % 2:
        pytest.skip("INT4 needs an even group size")
    xs = [make_hard_input(parts * w, group_size, dtype, bits, seed=k + w) for k, w in enumerate(widths)]
    numel = parts * part_numel
    args = ["interleave", DTYPE_TAG[dtype], bits, group_size, misalign, num_chunks, ",".join(map(str, perm)), parts,
            part_numel, ",".join(map(str, widths)), _divisors(wide, numel // len(perm), part_numel)]  # fmt: skip
    ran = _run(host_check, args, torch.cat(xs))
    expected = zq.reorder_quantize(
        xs, perm, num_chunks, bits, group_size, parts=parts, part_numel=part_numel, backend="reference"
    )
    assert ran.out == _bytes(expected)
    chunk = parts * part_numel // num_chunks
    row = zq.payload_nbytes(chunk, bits, group_size)
    # misalign 2 shifts the tensors only: the output keeps the encoder's vector layout
    assert ran.vec == (misalign != 1 and group_size % 8 == 0 and chunk % 8 == 0 and row % _run_bytes(bits) == 0)
    assert ran.tiles == _tiles(min(group_size, chunk))
    assert ran.regs == _regs(ran.vec, min(group_size, chunk))
    # the launcher runs the register scheme's own kernel exactly when the encoder would take that scheme
    # ([Note: register kernel]; misalign 1 shifts the output by a byte)
    assert cuda_launch.in_registers(chunk, group_size, bits, row, out_ptr=int(misalign == 1)) == ran.regs


@pytest.mark.parametrize("wide", (0, 1), ids=("idx32", "idx64"))
@pytest.mark.parametrize("misalign", (0, 1, 2))
@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parts,widths,part_numel,perm,num_chunks,group_size", STRETCH_CASES)
def test_reorder_stretches(
    host_check, dtype, bits, parts, widths, part_numel, perm, num_chunks, group_size, misalign, wide
):
    """Byte identity of InterleavedSource's stretches at slice, part and piece ends and in the fill, with
    tensors at differing alignments (misalign 2), on the 32- and the 64-bit index path."""
    _check_interleaved(host_check, dtype, bits, parts, widths, part_numel, perm, num_chunks, group_size,
                       misalign, wide=bool(wide))


def _numerators(divisor: int, bound: int) -> list[int]:
    """Numerators below 2^bound at the edges of [Note: magic division]'s range and the divisor's multiples."""
    top = 2**bound
    near = [0, 1, divisor - 1, divisor, divisor + 1, 2 * divisor - 1, top - 1, top - 2, top - divisor,
            (top - 1) // divisor * divisor, (top - 1) // divisor * divisor - 1]  # fmt: skip
    rng = torch.Generator().manual_seed(divisor % 2**63)
    spread = [int(torch.randint(0, 2**62, (), generator=rng)) % top for _ in range(8)]
    return sorted({n for n in near + spread if 0 <= n < top})


MAGIC_DIVISORS = [1, 2, 3, 5, 7, 8, 12, 24, 88, 641, 1632, 2**16 + 1, 6700417, 2**31 - 1, 2**31]
WIDE_DIVISORS = MAGIC_DIVISORS + [2**31 + 1, 3 * 2**40 + 7, 2**62 + 1, 2**63 - 1, 2**63]


@pytest.mark.parametrize("wide", (False, True), ids=("idx32", "idx64"))
def test_magic_divisor_is_exact(host_check, wide):
    """[Note: magic division]: the launcher's multiplier and shift, applied by MagicDivisor (the kernels'
    header, compiled for the host), give Python's n // d at the ends of the range of each index path."""
    bound = 63 if wide else 31
    for divisor in WIDE_DIVISORS if wide else MAGIC_DIVISORS:
        magic, shift = cuda_launch.magic_divisor(divisor, wide)
        assert 0 < magic < 2 ** (bound + 1) and 0 <= shift <= bound, divisor
        ns = _numerators(divisor, bound)
        # the formula itself, in Python's integers: mul_high(2n, m) >> l on words of bound + 1 bits
        assert [((2 * n * magic) >> (bound + 1)) >> shift for n in ns] == [n // divisor for n in ns], divisor
        quotients = host_check.run("divide", int(wide), divisor, magic, shift, ",".join(map(str, ns)))
        assert list(map(int, quotients.split())) == [n // divisor for n in ns], divisor


def test_launcher_mirrors_the_register_limit():
    assert cuda_launch.REGISTER_MAX_GROUP == REGISTER_MAX_GROUP


# 8 / 256 / 512: the team layout (one lane per group, 16 and 32 lanes); 6: runs (scalar);
# 8192: groups beyond a team, the run layout on the vector path
DECODE_CASES = [(bits, gs, n) for bits in (8, 4) for gs in (8, 6) for n in (1, gs + 3, 10 * gs, 16 * gs + 6)] + [
    (bits, gs, n) for bits in (8, 4) for gs, n in ((256, 7 * 256 + 8), (512, 3 * 512), (8192, 2 * 8192 + 16))
]


@pytest.mark.parametrize("misalign", (0, 1))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,group_size,numel", DECODE_CASES)
def test_dequantize(host_check, dtype, bits, group_size, numel, misalign):
    payloads = make_payloads(numel, group_size, bits, k=3, seed=numel)
    args = ["dequantize", DTYPE_TAG[dtype], bits, group_size, misalign, numel, 3]
    ran = _run(host_check, args, payloads)
    assert ran.out == _bytes(zq.dequantize(payloads, numel, bits, group_size, dtype, backend="reference"))
    stride = payloads.shape[1]
    aligned = group_size % 8 == 0 and numel % 8 == 0 and stride % _run_bytes(bits) == 0
    assert ran.vec == (not misalign and aligned)
    assert ran.teams == (ran.vec and min(group_size, numel) <= TEAM_MAX_GROUP)


def _fp32_hex(value: float) -> str:
    return format(struct.unpack("<I", struct.pack("<f", value))[0], "08x")


REDUCE_CASES = [(bits, gs, n) for bits in (8, 4) for gs in (8, 6) for n in (6, 24 * gs)] + [
    (8, 256, 12 * 256), (4, 512, 6 * 512)  # teams of 16 and 32 lanes, groups held in registers
]
# groups held in registers whose chunks are not whole groups, so that an output group
# crosses an input group's end ([Note: rows outer] in sources.cuh): a power-of-two group
# size (the shift) and another (the division); then re-quantized groups beyond the
# registers (streamed teams), and in the tile scheme: whole and short tiles, vector and
# scalar paths
REQUANT_CASES = REDUCE_CASES + [
    (8, 256, 3 * 1088), (4, 96, 3840), (8, 2048, 6 * 2048), (8, 8200, 6 * 8200), (4, 9000, 6 * 9001)
]


@pytest.mark.parametrize("misalign", (0, 1))
# 4.0 and the powers of two near the ends of the range take the exact-reciprocal product
# (2**-126: sums overflowing to Inf; 2**126: sums rounded into the subnormals).
@pytest.mark.parametrize("divide_by", (1.0, 3.0, 0.1, 4.0, 2.0**-126, 2.0**126))
@pytest.mark.parametrize("k", (1, 4))
@pytest.mark.parametrize("bits,group_size,numel", REDUCE_CASES)
def test_dequant_reduce_store(host_check, bits, group_size, numel, k, divide_by, misalign):
    payloads = make_payloads(numel, group_size, bits, k=k, seed=numel + k)
    for dtype in DTYPES:
        args = ["reduce", DTYPE_TAG[dtype], bits, group_size, misalign, numel, k, _fp32_hex(divide_by), 0, bits]
        ran = _run(host_check, args, payloads)
        expected = zq.dequant_reduce(
            payloads, numel, bits, group_size, dtype=dtype, divide_by=divide_by, backend="reference"
        )
        assert ran.out == _bytes(expected), dtype


@pytest.mark.parametrize("misalign", (0, 1))
@pytest.mark.parametrize("divide_by", (1.0, 3.0, 4.0, 0.25))
@pytest.mark.parametrize("k", (1, 4))
@pytest.mark.parametrize("bits,group_size,numel", REQUANT_CASES)
def test_dequant_reduce_requantize(host_check, bits, group_size, numel, k, divide_by, misalign):
    """Re-quantized to the input's width and (INT8 in, qgZ's first hop) to the other one."""
    payloads = make_payloads(numel, group_size, bits, k=k, seed=numel + 7 * k)
    for m, out_bits in ((1, bits), (2, bits), (3, bits), (2, 12 - bits)):
        args = ["reduce", "f32", bits, group_size, misalign, numel, k, _fp32_hex(divide_by), m, out_bits]
        ran = _run(host_check, args, payloads)
        expected = zq.dequant_reduce(
            payloads, numel, bits, group_size, requant_chunks=m, requant_bits=out_bits, divide_by=divide_by,
            backend="reference",
        )
        assert ran.out == _bytes(expected), (m, out_bits)
        chunk, stride = numel // m, payloads.shape[1]
        out_row = zq.payload_nbytes(chunk, out_bits, group_size)
        aligned = (group_size % 8 == 0 and chunk % 8 == 0 and stride % _run_bytes(bits) == 0
                   and out_row % _run_bytes(out_bits) == 0)
        assert ran.vec == (not misalign and aligned), m
        assert ran.tiles == _tiles(min(group_size, chunk)), m
        assert ran.regs == _regs(ran.vec, min(group_size, chunk)), m


def test_launcher_mirrors_the_encoder_constants():
    """_cuda_launch.py sizes the encoder grids with copies of group_encoder.cuh's constants."""
    header = (KERNELS / "group_encoder.cuh").read_text()

    def constant(name: str) -> str:
        return re.search(rf"constexpr \w+ {name} = ([^;]+);", header).group(1)

    assert TEAM_MAX_GROUP == cuda_launch.TEAM_MAX_GROUP
    version = re.search(r"constexpr int kWireFormatVersion = (\d+);", (KERNELS / "wire_math.cuh").read_text())
    assert int(version.group(1)) == zq.wire_format.WIRE_FORMAT_VERSION
    assert int(constant("kTileThreads")) == cuda_launch.TILE_THREADS == cuda_launch.THREADS
    assert constant("kTileElems") == "8 * 4 * kTileThreads"
    assert 8 * 4 * cuda_launch.TILE_THREADS == cuda_launch.TILE_ELEMS
    passes = re.search(r"enum EncoderPass : int \{([^}]*)\}", header).group(1)
    assert passes.replace(" ", "") == (
        f"kTeams={cuda_launch.TEAMS},kTileAbsmax={cuda_launch.TILE_ABSMAX},kTileEncode={cuda_launch.TILE_ENCODE}"
    )


# ---- The register encoder's partitions, cursor and signs ----
# Teams that hold their groups in registers (up to REGISTER_MAX_GROUP elements) at every
# team width, groups just past them (streamed teams) and in tiles, with chunk tails that
# keep the vector path (a short last group of whole runs) and ones that leave it; inputs mix
# make_hard_input's groups (NaN, Inf, subnormal scales: the cold paths) with groups that tell
# the encoder's two maxima apart ([Note: two-sided max] in group_encoder.cuh). The public
# contract rejects group_size 1 (and odd sizes for INT4), so the smallest group here is 7.

# a NaN with the sign bit set and a payload, as the signed integer of each dtype's bits
_NEGATIVE_NAN = {torch.float32: -0x003FFEDD, torch.bfloat16: -0x3F, torch.float16: -0x1FF}
_SIGN_KINDS = 6


def _signed_input(numel: int, group_size: int, dtype: torch.dtype, bits: int, seed: int) -> torch.Tensor:
    """make_hard_input's groups, every other group replaced by one of six sign patterns: all
    negative; positives with one larger negative; negatives with one larger positive; a
    negative NaN among finite values; only -0 and negative subnormals; a -Inf among negatives."""
    x = make_hard_input(numel, group_size, dtype, bits, seed=seed).float()
    gen = torch.Generator().manual_seed(seed + 1)
    magnitude = torch.rand(numel, generator=gen).add(0.25)
    group = torch.arange(numel) // group_size
    pos = torch.arange(numel) % group_size
    kind = (group // 2) % _SIGN_KINDS
    signed = group % 2 == 1
    info = torch.finfo(dtype)
    standout = pos == (group * 7) % group_size  # one element per group, at a varying position
    patterns = [
        -magnitude,
        torch.where(standout, -2.0, magnitude),
        torch.where(standout, 2.0, -magnitude),
        -magnitude,  # the NaN is set on the bits below
        torch.where(pos % 3 == 0, -0.0, -magnitude * info.smallest_normal / 2),
        torch.where(standout, float("-inf"), -magnitude),
    ]
    for k, pattern in enumerate(patterns):
        x = torch.where(signed & (kind == k), pattern, x)
    x = x.to(dtype)
    raw = x.view(torch.int32 if dtype == torch.float32 else torch.int16)
    raw[signed & (kind == 3) & standout] = _NEGATIVE_NAN[dtype]
    return x


def _register_sizes(group_size: int) -> tuple[int, ...]:
    """Lengths with chunk tails: one element, one group, a short last group of whole runs
    (still the vector path), and a tail that is not whole runs (the scalar path)."""
    if group_size >= LARGE:
        return (group_size + 8, 2 * group_size + 3)
    return (1, group_size, 5 * group_size + 8, 3 * group_size + 5)


REGISTER_GROUP_SIZES = {8: (7, 8, 40, 96, 256, 512, 1024, 1032, 4096, 4097), 4: (8, 40, 96, 256, 512, 1024, 4098)}
REGISTER_QUANT_CASES = [
    (dtype, bits, gs, n)
    for dtype in DTYPES
    for bits in (8, 4)
    for gs in REGISTER_GROUP_SIZES[bits]
    for n in _register_sizes(gs)
]


@pytest.mark.parametrize("misalign", (0, 1))
@pytest.mark.parametrize("dtype,bits,group_size,numel", REGISTER_QUANT_CASES)
def test_quantize_register_partitions(host_check, dtype, bits, group_size, numel, misalign):
    x = _signed_input(numel, group_size, dtype, bits, seed=numel + 3 * group_size)
    ran = _run(host_check, ["quantize", DTYPE_TAG[dtype], bits, group_size, misalign], x)
    assert ran.out == _bytes(zq.quantize(x, bits, group_size, backend="reference"))
    assert ran.vec == (not misalign and group_size % 8 == 0 and numel % 8 == 0)
    assert ran.tiles == _tiles(min(group_size, numel))
    assert ran.regs == _regs(ran.vec, min(group_size, numel))


def test_register_cases_cover_every_team_width():
    """The cases above hold groups in registers at every team width, and in short last groups."""
    lanes, short_tails = set(), 0
    for _, _, gs, n in REGISTER_QUANT_CASES:
        if _regs(gs % 8 == 0 and n % 8 == 0, min(gs, n)):
            lanes.add(next(w for w in (1, 2, 4, 8, 16, 32) if 8 * RUNS_PER_LANE * w >= min(gs, n)))
            short_tails += n % gs != 0 and n > gs
    assert lanes == {1, 2, 4, 8, 16, 32}
    assert short_tails > 0


# several chunks, most with a short last group; an even number of groups per chunk keeps
# INT8 rows whole runs (the vector path). The host grid's step (3 warps of 4 teams for 256,
# 8 teams for 96) is no multiple of 8 or 10 groups per chunk, so the job cursor carries
# into the next row in live rounds ([Note: span cursor] in group_encoder.cuh).
REGISTER_REORDER_CASES = [
    # (numel, perm, num_chunks, group_size)
    (3 * (7 * 256 + 64), (2, 0, 1), 3, 256),
    (4 * (9 * 96 + 48), (1, 3, 0, 2), 4, 96),
    (3 * (512 + 8), (2, 0, 1), 3, 512),
    (6 * (5 * 96 + 24), (5, 3, 1, 0, 2, 4), 6, 96),
    (5 * 64, (4, 3, 2, 1, 0), 5, 8),
    (2 * (1024 + 16), (1, 0), 2, 1024),
]


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel,perm,num_chunks,group_size", REGISTER_REORDER_CASES)
def test_reorder_quantize_register_chunks(host_check, dtype, bits, numel, perm, num_chunks, group_size):
    x = _signed_input(numel, group_size, dtype, bits, seed=numel)
    args = ["reorder", DTYPE_TAG[dtype], bits, group_size, 0, num_chunks, ",".join(map(str, perm)),
            _divisors(False, numel // len(perm))]
    ran = _run(host_check, args, x)
    assert ran.out == _bytes(zq.reorder_quantize(x, perm, num_chunks, bits, group_size, backend="reference"))
    assert ran.vec and ran.regs and not ran.tiles


# ---- The re-quantizing kernel of the register scheme on 32-bit indices ----
# ([Note: narrow requant] in requant_rounds.cuh.) The host check runs its cursor, spans and
# source (NarrowPayloadSum: rows outer, the input group by the launcher's multiplier) for the
# divisor mode the kernel's dispatch picks, with the launcher's sizes (narrow_requant_sizes);
# the launcher's choice of the kernel (narrow_requant, divisor_mode) and its sizes are checked
# against the kernel's own conditions. Cases: teams of every width (groups of 8 to 1024: 1 to
# 32 lanes, some lanes a run short), power-of-two and other group sizes (the multiplier's
# shift and its general case), one to several chunks whose groups cross input groups (a tail
# scale), k from 1 (random bytes: NaN, Inf, subnormal scales) to several rows, every divisor
# mode, and sizes the kernel does not take (groups past the registers, a chunk off whole runs).
NARROW_CASES = [
    # (bits, out_bits, group_size, numel, chunks)
    (8, 8, 8, 5 * 64, 5),
    (8, 4, 40, 24 * 40, 3),
    (4, 4, 96, 4000, 4),
    (4, 8, 96, 3840, 1),
    (8, 8, 256, 3 * 1344, 3),
    (8, 4, 256, 3 * 1344, 3),
    (8, 4, 256, 12 * 256, 2),
    (4, 4, 512, 6 * 512, 3),
    (4, 8, 520, 4 * 520, 2),
    (8, 8, 1024, 2 * 1040, 2),
    (4, 4, 256, 7 * 1280, 7),  # 5 groups per chunk: the cursor's step of 12 jobs carries into the next row
    (8, 4, 96, 6 * 480, 6),  # 5 groups per chunk, a step of 24 jobs
    (8, 8, 1032, 2 * 1032, 2),  # past the registers: the general kernel
    (8, 4, 64, 3 * 100, 3),  # chunks of 100 elements: not whole runs
]
NARROW_MODES = {"one": 3, "reciprocal": 1, "division": 2}  # DivisorMode in sources.cuh


@pytest.mark.parametrize("divide_by", (1.0, 4.0, 0.25, 2.0**-126, 2.0**126, 3.0, 0.1))
@pytest.mark.parametrize("k", (1, 2, 5))
@pytest.mark.parametrize("bits,out_bits,group_size,numel,chunks", NARROW_CASES)
def test_requant_register_kernel(host_check, bits, out_bits, group_size, numel, chunks, k, divide_by):
    payloads = make_payloads(numel, group_size, bits, k=k, seed=numel + 11 * k)
    magic, shift = cuda_launch.magic_divisor(group_size, False)
    src, dst = host_check.scratch / "in.bin", host_check.scratch / "out.bin"
    src.write_bytes(_bytes(payloads))
    dst.unlink(missing_ok=True)
    sizes = ",".join(map(str, cuda_launch.narrow_requant_sizes(numel, chunks, group_size, bits, out_bits)))
    args = ["requant_regs", bits, group_size, numel, k, _fp32_hex(divide_by), chunks, out_bits, magic, shift, sizes,
            src, dst]
    flags = dict(item.split("=") for item in host_check.run(*args).split())
    assert flags["sizes"] == "1"  # the launcher's sizes are the kernel's ([Note: narrow sizes])
    chunk = numel // chunks
    out_row = zq.payload_nbytes(chunk, out_bits, group_size)
    narrow = cuda_launch.narrow_requant(numel, chunk, group_size, bits, out_bits, payloads.shape[1], out_row)
    assert flags["narrow"] == str(int(narrow))
    assert int(flags["mode"]) == NARROW_MODES[cuda_launch.divisor_mode(np.float32(divide_by))]
    if narrow:
        expected = zq.dequant_reduce(payloads, numel, bits, group_size, requant_chunks=chunks, requant_bits=out_bits,
                                     divide_by=divide_by, backend="reference")
        assert dst.read_bytes() == _bytes(expected)


def test_requant_register_cases_cover_the_kernel():
    """NARROW_CASES run the narrow kernel at every team width, with a tail scale, and leave it."""
    lanes, tails, narrow = set(), 0, set()
    for bits, out_bits, group_size, numel, chunks in NARROW_CASES:
        chunk = numel // chunks
        row, out_row = zq.payload_nbytes(numel, bits, group_size), zq.payload_nbytes(chunk, out_bits, group_size)
        taken = cuda_launch.narrow_requant(numel, chunk, group_size, bits, out_bits, row, out_row)
        narrow.add(taken)
        if taken:
            lanes.add(min(32, max(1, -(-min(group_size, chunk) // (8 * RUNS_PER_LANE)))))
            tails += chunk % group_size != 0 and chunks > 1
    assert {1, 2, 4, 8, 16, 32} <= {1 << (n - 1).bit_length() for n in lanes}
    assert tails > 0 and narrow == {True, False}


def test_requant_register_kernel_checks_its_sizes(host_check, tmp_path):
    """Sizes other than the kernel's own ([Note: narrow sizes]) are refused (the kernel traps)."""
    numel, chunks, group_size = 3 * 1344, 3, 256
    payloads = make_payloads(numel, group_size, 8, k=2, seed=5)
    src, dst = tmp_path / "in.bin", tmp_path / "out.bin"
    src.write_bytes(_bytes(payloads))
    magic, shift = cuda_launch.magic_divisor(group_size, False)
    good = cuda_launch.narrow_requant_sizes(numel, chunks, group_size, 8, 8)
    for wrong in range(4):
        sizes = ",".join(str(v + 4 * (i == wrong)) for i, v in enumerate(good))
        args = ["requant_regs", 8, group_size, numel, 2, _fp32_hex(1.0), chunks, 8, magic, shift, sizes, src, dst]
        assert host_check.run(*args).split() == ["narrow=1", "mode=3", "sizes=0"] and not dst.exists(), wrong
