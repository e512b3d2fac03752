"""The ``cuda`` backend's kernels: the contract of :mod:`zcomm.quant._contract` on CUDA tensors.

[Note: launch plans] A launch of a kernel is resolved once for the sizes it serves, into a
*launch plan* (:class:`QuantizeLaunch`, :class:`DequantizeLaunch` (also ``dequant_reduce``'s),
:class:`ReorderLaunch`, :class:`RequantLaunch`): the kernel compiled, loaded and looked up
(:func:`resolve_kernel`), its grid sized, its size arguments made as the kernel's numpy
scalars, its device-resident tables uploaded and its host checks run
(:func:`check_narrow_requant`). A call then only reads its tensors' addresses and launches.
Resolution is the only place a kernel is compiled or loaded: it raises there, before
anything is launched, when NVRTC, cupy or a check fails.

Launch plans are held by the plans that use them, never in a cache of their own here:

* a collective's plan (:mod:`zcomm._plan`) holds one :class:`PlannedKernel` per op, made by
  :func:`plan_kernels` when the plan is made (the sources of all its ops loaded together), with the launch plan of every argument set the
  collective calls the op with: every kernel it will launch is resolved before its first hop;
* a public op (:mod:`zcomm.quant.ops` through ``torch.ops.zcomm``) finds the launch plan of
  its arguments in :data:`OP_PLANS`, the one :class:`~zcomm.quant._bounded_cache.BoundedCache`
  of op calls, resolved on the first call of those arguments.

Both reach the kernel through the same launch plan and :func:`zcomm_cuda.loader.launch`,
on torch's current stream. Arguments arrive as the contract states them (validated,
contiguous, non-empty, on one CUDA device, outputs preallocated). Nothing a call does
synchronizes the host. This module imports without cupy or a GPU (the loader imports cupy
when it first compiles), so the launch arithmetic is tested anywhere;
:mod:`zcomm.quant.backends.cuda` registers the op functions once the backend can run.

Grid sizing: the kernels walk their work grid-stride, so the grid is the work size capped
at one full wave: as many blocks as every multiprocessor holds resident at once, from the
occupancy the kernel's registers allow (:func:`resolve_kernel`; [Note: one wave]). The
encoder kernels run one of two schemes chosen from the group size
(:func:`encoder_passes`; [Note: large groups] in kernels/group_encoder.cuh).
"""

from __future__ import annotations

from typing import Any, Mapping, NamedTuple, Sequence

import numpy as np
import torch

from zcomm_cuda import loader

from .. import _capture, wire_format
from .._bounded_cache import BoundedCache
from .._contract import dequantize_use, quantize_use, reorder_use
from ._cuda_tables import HeldTable, device_perm

THREADS = 256
WARPS_PER_BLOCK = THREADS // 32
RUN = 8  # elements per vector run in the kernels (vector_io.cuh)

# Mirrors of team_walk.cuh and group_encoder.cuh (tests/quant/test_cuda_host_math.py checks that they agree).
TEAM_MAX_GROUP = 4096  # kTeamMaxGroup (team_walk.cuh): larger groups take the tile scheme
TILE_THREADS = 256  # kTileThreads: the block size of the tile passes
TILE_ELEMS = 8192  # kTileElems: elements per tile
TEAMS, TILE_ABSMAX, TILE_ENCODE = 0, 1, 2  # EncoderPass
assert TILE_THREADS == THREADS
WIDE_NUMEL = 2**31  # above this many elements the reordering kernels index with 64 bits ([Note: magic division])
REGISTER_MAX_GROUP = 32 * 8 * 4  # kRegisterMaxGroup (team_walk.cuh): 32 lanes of kRunsPerLane runs of 8
_RUN_BYTES = {8: 8, 4: 4}  # bytes of 8 codes (Codes8<BITS>::kWords words)

_DTYPE_TAG = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_MODE_TAG = {"one": "one", "reciprocal": "pow2", "division": "div"}
_MODE_OF_TAG = {tag: mode for mode, tag in _MODE_TAG.items()}

# [Note: launch arguments] cupy passes numpy scalars by value at their own width, and a Python
# int as a 64-bit integer whatever the kernel declares (cupy's argument conversion makes it a
# ``numpy.int64``, which raises for 2^63 and above). So every argument is a numpy scalar of its
# parameter's type, except the tensors' addresses: they go as the Python ints ``data_ptr()``
# returns, into the kernels' 64-bit pointer parameters, where both launchers pass them exactly
# (cupy's int64 of an address below 2^63 has the address's bytes; the driver launcher packs an
# int into a 64-bit slot as unsigned, [Note: parameter layout] in zcomm_cuda.driver_launch), and
# zcomm builds no numpy scalar per address (about 0.2 us each). tests/quant/test_cuda_launch_abi.py
# holds every launch to this. The integer arguments that depend only on the call's sizes are
# made once, in the launch plan ([Note: launch plans]), so only the addresses are new per launch.
_PASSES = (np.int32(TEAMS), np.int32(TILE_ABSMAX), np.int32(TILE_ENCODE))


class LaunchCheckError(RuntimeError):
    """A kernel's own invariant does not hold for the arguments a launch plan resolved: raised when
    the launch is resolved, before anything runs, instead of a device trap that poisons the rank."""


def _sizes(*values: int) -> tuple[np.int64, ...]:
    """``values`` as the kernels' int64 arguments ([Note: launch arguments])."""
    return tuple(np.int64(value) for value in values)


def _name(template: str, *key: object) -> str:
    """``template`` formatted with ``key`` (a dtype becomes its tag)."""
    return template.format(*(_DTYPE_TAG.get(k, k) for k in key))


# (source, kernel name, device index) -> the kernel's grid cap; see [Note: one wave]. Keyed by the
# kernel and the device, never by a call's sizes: it is the compiled module's property.
_MAX_BLOCKS: dict[tuple[str, str, int], int] = {}


def resolve_kernel(source: str, name: str, index: int) -> int:
    """Compile (on first use), load and look up kernel ``name`` on device ``index``; its grid cap.

    [Note: one wave] A grid-stride kernel does the same work per block, so a grid of a few
    blocks per SM more than are resident runs in waves, the last one partly empty: with 8
    blocks per SM launched and 3 resident (72 registers per thread), the third wave holds 2
    blocks per SM; with 6 resident (40 registers), the second holds 2, a third of the SM.
    Capping the grid at the resident count runs it in one full wave.
    """
    blocks = _MAX_BLOCKS.get((source, name, index))
    if blocks is None:
        function = loader.kernel(source, name, index)
        blocks = _MAX_BLOCKS[(source, name, index)] = _occupancy(function, name, index) * loader.multiprocessor_count(index)
    return blocks


def _occupancy(function: Any, name: str, index: int) -> int:
    """Blocks of :data:`THREADS` threads of ``function`` resident on one SM (CUDA occupancy)."""
    import cupy
    from cupy_backends.cuda.api import driver

    with cupy.cuda.Device(index):
        blocks = driver.occupancyMaxActiveBlocksPerMultiprocessor(function.ptr, THREADS, 0)
    if blocks < 1:
        raise RuntimeError(f"{name} cannot run {THREADS} threads per block on device {index}")
    return blocks


def _cap(work_blocks: int, max_blocks: int) -> int:
    return max(1, min(work_blocks, max_blocks))


def encoder_passes(jobs: int, group_extent: int, max_blocks: int) -> list[tuple[int, int]]:
    """``(pass, blocks)`` for each launch of an encoder kernel over ``jobs`` groups.

    ``group_extent`` is the longest group, ``min(group_size, elements per payload)``. Groups
    of at most :data:`TEAM_MAX_GROUP` elements: one launch of the team scheme, at most one
    warp per group (teams of fewer lanes share a warp). Larger groups: the tile scheme's two
    passes, one block per tile of :data:`TILE_ELEMS` elements.
    """
    if group_extent <= TEAM_MAX_GROUP:
        return [(TEAMS, _cap(-(-jobs // WARPS_PER_BLOCK), max_blocks))]
    blocks = _cap(jobs * -(-group_extent // TILE_ELEMS), max_blocks)
    return [(TILE_ABSMAX, blocks), (TILE_ENCODE, blocks)]


class Encoder(NamedTuple):
    """An encoder kernel's launches, resolved ([Note: launch plans])."""

    source: str
    name: str
    device: torch.device
    passes: tuple[tuple[int, np.int32], ...]  # (blocks, pass argument) per launch
    jobs: int  # groups: the tile scheme's absmax temporary has one int32 per group
    tiles: bool


def _encoder(source: str, name: str, device: torch.device, jobs: int, group_extent: int) -> Encoder:
    passes = encoder_passes(jobs, group_extent, resolve_kernel(source, name, device.index))
    return Encoder(source, name, device, tuple((blocks, _PASSES[p]) for p, blocks in passes), jobs, passes[0][0] != TEAMS)


def _encode(encoder: Encoder, args: tuple) -> None:
    """Run ``encoder`` with ``args`` (all but its last two, group_absmax and pass).

    The tile scheme's per-group absmax lives in a zeroed temporary allocated on the current
    stream, which both passes use in stream order (see [Note: large groups]).
    """
    absmax = torch.zeros(encoder.jobs, dtype=torch.int32, device=encoder.device) if encoder.tiles else None
    absmax_ptr = 0 if absmax is None else absmax.data_ptr()
    for blocks, encoder_pass in encoder.passes:
        loader.launch(encoder.source, encoder.name, encoder.device, blocks, THREADS, (*args, absmax_ptr, encoder_pass))


class QuantizeLaunch(NamedTuple):
    encoder: Encoder
    sizes: tuple  # numel, group_size


def _resolve_quantize(device: torch.device, numel: int, bits: int, group_size: int, dtype: torch.dtype) -> QuantizeLaunch:
    name = _name("zc_quantize_{}_int{}", dtype, bits)
    encoder = _encoder("quantize.cu", name, device, -(-numel // group_size), min(group_size, numel))
    return QuantizeLaunch(encoder, _sizes(numel, group_size))


class DequantizeLaunch(NamedTuple):
    source: str
    name: str
    device: torch.device
    blocks: int
    sizes: tuple  # the arguments between the two addresses


def _decoder(source: str, name: str, device: torch.device, runs: int, sizes: tuple) -> DequantizeLaunch:
    return DequantizeLaunch(source, name, device, _cap(-(-runs // THREADS), resolve_kernel(source, name, device.index)),
                            sizes)


def _resolve_dequantize(device: torch.device, rows: int, numel: int, bits: int, group_size: int,
                        dtype: torch.dtype) -> DequantizeLaunch:
    name = _name("zc_dequantize_{}_int{}", dtype, bits)
    row_nbytes = wire_format.payload_nbytes(numel, bits, group_size)
    return _decoder("dequantize.cu", name, device, rows * -(-numel // RUN), _sizes(row_nbytes, numel, group_size, rows))


def _resolve_dequant_reduce(device: torch.device, rows: int, numel: int, bits: int, group_size: int,
                            dtype: torch.dtype) -> DequantizeLaunch:
    """``dequant_reduce``'s kernel, grid and the arguments between its input address and its divisor
    (the divisor is the call's float, made the kernels' fp32 per call)."""
    name = _name("zc_dequant_reduce_{}_int{}", dtype, bits)
    row_nbytes = wire_format.payload_nbytes(numel, bits, group_size)
    return _decoder("dequant_reduce.cu", name, device, -(-numel // RUN), _sizes(row_nbytes, numel, group_size, rows))


class ReorderLaunch(NamedTuple):
    """``reorder_quantize``'s launches: the flat or interleaved kernel, and the interleaved form's
    register kernel where the sizes allow it (taken per call when the output is aligned)."""

    flat: bool
    encoder: Encoder
    registers: Encoder | None
    perm: torch.Tensor  # the permutation, device-resident ([Note: device tables] in _cuda_tables)
    slice_args: tuple
    part_args: tuple
    layout: tuple
    run_bytes: int
    table: HeldTable | None  # the interleaved form's table of addresses


def _resolve_reorder(device: torch.device, tensors: int, flat: bool, parts: int, part_numel: int,
                     perm: tuple[int, ...], num_chunks: int, bits: int, group_size: int,
                     dtype: torch.dtype) -> ReorderLaunch:
    numel = parts * part_numel
    chunk = numel // num_chunks
    wide = numel > WIDE_NUMEL
    row_nbytes = wire_format.payload_nbytes(chunk, bits, group_size)
    kind = ("quantize" if flat else "interleaved") + ("_wide" if wide else "")
    jobs, extent = -(-chunk // group_size) * num_chunks, min(group_size, chunk)
    encoder = _encoder("reorder_quantize.cu", _name("zc_reorder_{}_{}_int{}", kind, dtype, bits), device, jobs, extent)
    registers = None
    if not flat and not wide and in_registers(chunk, group_size, bits, row_nbytes, out_ptr=0):
        registers = _encoder("reorder_quantize.cu", _name("zc_reorder_interleaved_regs_{}_int{}", dtype, bits), device,
                             jobs, extent)
    slices = len(perm)
    slice_args = (np.int64(numel // slices), *_magic_args(numel // slices, wide))
    part_args = (np.int64(tensors), np.int64(part_numel), *_magic_args(part_numel, wide))
    return ReorderLaunch(flat, encoder, registers, device_perm(perm, device), slice_args, part_args,
                         _sizes(chunk, num_chunks, group_size, row_nbytes), _RUN_BYTES[bits],
                         None if flat else HeldTable())


def _reorder(launch: ReorderLaunch, xs: list[torch.Tensor], parts: int, out: torch.Tensor) -> None:
    """Run ``launch`` on ``xs`` into ``out``: one tensor that fills its parts is read through the
    permutation alone; otherwise the interleaved kernel reads the tensors through a table
    ([Note: interleaved table]), or, when the encoder holds its groups in registers and ``out``
    is aligned, that scheme's own kernel ([Note: register kernel] in kernels/reorder_quantize.cu)."""
    if launch.flat:
        _encode(launch.encoder, (xs[0].data_ptr(), launch.perm.data_ptr(), *launch.slice_args, *launch.layout,
                                 out.data_ptr()))
        return
    table = launch.table.for_tensors(xs, parts)
    encoder = launch.encoder
    if launch.registers is not None and out.data_ptr() % launch.run_bytes == 0:  # [Note: register kernel]
        encoder = launch.registers
    _encode(encoder, (table.data_ptr(), *launch.part_args, launch.perm.data_ptr(), *launch.slice_args, *launch.layout,
                      out.data_ptr()))


class RequantLaunch(NamedTuple):
    """``dequant_reduce_requant``'s launches: the general encoder and, where the sizes allow, the
    register scheme's kernel for the divisor's mode ([Note: narrow requant]), taken per call when
    both buffers are aligned to their runs."""

    encoder: Encoder
    sizes: tuple
    narrow_source: str
    narrow_name: str | None
    narrow_blocks: int
    narrow_sizes: tuple
    narrow_tail: tuple
    in_run: int
    out_run: int


def _resolve_requant(device: torch.device, rows: int, numel: int, bits: int, out_bits: int, group_size: int,
                     divide_by: float, chunks: int) -> RequantLaunch:
    chunk = numel // chunks
    jobs = -(-chunk // group_size) * chunks
    row_nbytes = wire_format.payload_nbytes(numel, bits, group_size)
    chunk_nbytes = wire_format.payload_nbytes(chunk, out_bits, group_size)
    # the general kernel is a translation unit of its own; the narrow ones sit with dequant_reduce's
    encoder = _encoder("dequant_reduce_requant.cu", _name("zc_dequant_reduce_requant_int{}_int{}", bits, out_bits),
                       device, jobs, min(group_size, chunk))
    source = "dequant_reduce.cu"
    divisor = np.float32(divide_by)
    sizes = (*_sizes(row_nbytes, numel, group_size, rows), divisor, *_sizes(chunks, chunk_nbytes))
    narrow_name, narrow_blocks, narrow_sizes, narrow_tail = None, 0, (), ()
    if narrow_requant(numel, chunk, group_size, bits, out_bits, row_nbytes, chunk_nbytes):
        mode_tag = _MODE_TAG[divisor_mode(divisor)]
        narrow_name = _name("zc_dequant_reduce_requant_regs_{}_int{}_int{}", mode_tag, bits, out_bits)
        narrow_tail = narrow_requant_sizes(numel, chunks, group_size, bits, out_bits)
        check_narrow_requant(mode_tag, divisor, narrow_tail, numel, chunks, group_size, bits, out_bits)
        narrow_sizes = (*_sizes(row_nbytes, numel, group_size), *_magic_args(group_size, False), np.int64(rows),
                        divisor, *_sizes(chunks, chunk_nbytes))
        narrow_blocks = _cap(-(-jobs // WARPS_PER_BLOCK), resolve_kernel(source, narrow_name, device.index))
        narrow_tail = _sizes(*narrow_tail)
    return RequantLaunch(encoder, sizes, source, narrow_name, narrow_blocks, narrow_sizes, narrow_tail, _RUN_BYTES[bits],
                         _RUN_BYTES[out_bits])


def _requant(launch: RequantLaunch, payloads: torch.Tensor, out: torch.Tensor) -> None:
    src, dst = payloads.data_ptr(), out.data_ptr()
    if launch.narrow_name is not None and src % launch.in_run == 0 and dst % launch.out_run == 0:
        loader.launch(launch.narrow_source, launch.narrow_name, launch.encoder.device, launch.narrow_blocks, THREADS,
                      (src, *launch.narrow_sizes, dst, *launch.narrow_tail))
        return
    _encode(launch.encoder, (src, *launch.sizes, dst))


def check_narrow_requant(mode_tag: str, divisor: np.float32, sizes: Sequence[int], numel: int, chunks: int,
                         group_size: int, bits: int, out_bits: int) -> None:
    """The invariants the narrow re-quantizing kernel checks on the device ([Note: narrow sizes] in
    kernels/requant_rounds.cuh), checked on the host when its launch is resolved:
    ``divisor_mode(divisor) == MODE`` (the kernel of a mode divides only as that mode says) and
    ``sizes.describe(rows, layout)`` (its size arguments are those the kernel would compute from
    its other arguments). Raises :class:`LaunchCheckError` naming the invariant that fails."""
    mode = divisor_mode(divisor)
    if _MODE_TAG[mode] != mode_tag:
        raise LaunchCheckError(f"narrow re-quantizing kernel: invariant divisor_mode(divisor) == MODE fails: divisor "
                               f"{float(divisor)!r} has mode {mode!r}, the kernel's is {_MODE_OF_TAG.get(mode_tag)!r}")
    chunk = numel // chunks
    expected = (chunk, -(-chunk // group_size), wire_format.scales_offset(numel, bits),
                wire_format.scales_offset(chunk, out_bits))
    if numel % chunks or tuple(int(v) for v in sizes) != expected:
        raise LaunchCheckError(
            f"narrow re-quantizing kernel: invariant sizes.describe(rows, layout) fails: the launch's sizes (chunk "
            f"elements, groups per chunk, input and output scales offsets) are {tuple(int(v) for v in sizes)}, the "
            f"kernel computes {expected} for numel={numel}, chunks={chunks}, group_size={group_size}, bits={bits}, "
            f"out_bits={out_bits}")


def narrow_requant_sizes(numel: int, chunks: int, group_size: int, bits: int, out_bits: int) -> tuple[int, ...]:
    """The narrow kernel's sizes ([Note: narrow sizes] in kernels/requant_rounds.cuh): a chunk's
    elements and groups, and the scales' offsets in an input row and in an output row."""
    chunk = numel // chunks
    return (chunk, wire_format.num_groups(chunk, group_size), wire_format.scales_offset(numel, bits),
            wire_format.scales_offset(chunk, out_bits))


def narrow_requant(numel: int, chunk: int, group_size: int, bits: int, out_bits: int, row_nbytes: int,
                   chunk_nbytes: int) -> bool:
    """Whether the re-quantizing kernel of the register scheme on 32-bit indices serves these sizes
    ([Note: narrow requant]), given that both buffers are aligned to their runs (checked per call):
    the encoder holds its groups in registers (:func:`in_registers`), the input rows have whole runs
    (PayloadRows::can_vectorize), and every element index is below :data:`WIDE_NUMEL`."""
    return (numel <= WIDE_NUMEL and in_registers(chunk, group_size, out_bits, chunk_nbytes, out_ptr=0)
            and row_nbytes % _RUN_BYTES[bits] == 0)


def divisor_mode(divisor: np.float32) -> str:
    """sources.cuh's divisor_mode of an fp32 divisor: ``"one"`` for 1, ``"reciprocal"`` for a power
    of two whose reciprocal is a normal float ([Note: exact reciprocal] in wire_math.cuh), else
    ``"division"``."""
    word = int(np.float32(divisor).view(np.uint32))
    if word == 0x3F800000:
        return "one"
    exponent = (word >> 23) & 0xFF
    return "reciprocal" if word & 0x7FFFFF == 0 and 0 < exponent <= 253 else "division"


def in_registers(chunk: int, group_size: int, bits: int, row_nbytes: int, out_ptr: int) -> bool:
    """Whether the encoder's teams hold a source's groups in registers (group_encoder.cuh's
    in_registers for a source whose can_vectorize() holds, as InterleavedSource's always does):
    the output's vector layout (ChunkLayout::can_vectorize) and groups of at most
    :data:`REGISTER_MAX_GROUP` elements."""
    run_bytes = _RUN_BYTES[bits]
    vec = group_size % RUN == 0 and chunk % RUN == 0 and out_ptr % run_bytes == 0 and row_nbytes % run_bytes == 0
    return vec and min(group_size, chunk) <= REGISTER_MAX_GROUP


def magic_divisor(divisor: int, wide: bool) -> tuple[int, int]:
    """``(m, l)`` that divide by ``divisor`` as ``mul_high(2n, m) >> l`` for every ``0 <= n < 2^N``.

    N = 63 on the 64-bit path (``wide``), else 31; ``l = ceil(log2(divisor))`` and
    ``m = ceil(2^(N + l) / divisor)``, below ``2^(N + 1)``: [Note: magic division] in
    kernels/magic_divide.cuh proves the quotient exact.
    """
    bound = 63 if wide else 31
    assert 1 <= divisor <= 2**bound, (divisor, wide)
    shift = (divisor - 1).bit_length()
    magic = -(-(1 << (bound + shift)) // divisor)
    assert magic < 2 ** (bound + 1), (divisor, wide)
    return magic, shift


def _magic_args(divisor: int, wide: bool) -> tuple[np.uint64, np.int32]:
    magic, shift = magic_divisor(divisor, wide)
    return np.uint64(magic), np.int32(shift)


# ---- a call's use ([Note: planned kernels] in zcomm.quant._contract) -> its launch plan ----

def _reorder_use(xs: Sequence[torch.Tensor], parts: int, part_numel: int, perm: Sequence[int], num_chunks: int,
                 bits: int, group_size: int) -> tuple:
    x = xs[0]
    flat = len(xs) == 1 and x.numel() == parts * part_numel
    return reorder_use(len(xs), flat, parts, part_numel, perm if type(perm) is tuple else tuple(perm), num_chunks,
                       bits, group_size, x.dtype)


# op -> the name of its resolver here (looked up when called, so that a test may replace one)
_RESOLVE = {"quantize": "_resolve_quantize", "dequantize": "_resolve_dequantize", "reorder_quantize": "_resolve_reorder",
            "dequant_reduce": "_resolve_dequant_reduce", "dequant_reduce_requant": "_resolve_requant"}


def resolve(op: str, device: torch.device, use: tuple) -> Any:
    """The launch plan of ``op`` for the call named by ``use`` on ``device`` ([Note: launch plans])."""
    if device.index is None:  # "cuda" alone: the current device, resolved now
        device = torch.device(device.type, loader.device_index(device))
    return globals()[_RESOLVE[op]](device, *use)


# ---- the public ops' route: one BoundedCache of launch plans ----
# (op, device index, use) -> the launch plan; the public ops' calls are planned once per arguments
# and kept here (at most MAX_OP_PLANS, the oldest dropped first). ``cuda`` without an index
# (whichever device is current) and launch plans resolved under CUDA-graph capture (whose
# permutation belongs to the graph, [Note: device tables]) are not kept.
MAX_OP_PLANS = 1024
OP_PLANS = BoundedCache(MAX_OP_PLANS)


def _op_plan(op: str, device: torch.device, use: tuple) -> Any:
    key = (op, device.index, use)
    launch = OP_PLANS.get(key)
    if launch is None:
        launch = resolve(op, device, use)
        if device.index is not None and not _capture.capturing():
            OP_PLANS.remember(key, launch)
    return launch


def quantize(x: torch.Tensor, bits: int, group_size: int, out: torch.Tensor) -> None:
    launch = _op_plan("quantize", x.device, (x.numel(), bits, group_size, x.dtype))
    _encode(launch.encoder, (x.data_ptr(), *launch.sizes, out.data_ptr()))


def dequantize(payloads: torch.Tensor, numel: int, bits: int, group_size: int, out: torch.Tensor) -> None:
    launch = _op_plan("dequantize", payloads.device, (payloads.shape[0], numel, bits, group_size, out.dtype))
    loader.launch(launch.source, launch.name, launch.device, launch.blocks, THREADS,
                  (payloads.data_ptr(), *launch.sizes, out.data_ptr()))


def reorder_quantize(xs: list[torch.Tensor], parts: int, part_numel: int, perm: Sequence[int], num_chunks: int,
                     bits: int, group_size: int, out: torch.Tensor) -> None:
    launch = _op_plan("reorder_quantize", xs[0].device,
                      _reorder_use(xs, parts, part_numel, perm, num_chunks, bits, group_size))
    _reorder(launch, xs, parts, out)


def dequant_reduce(payloads: torch.Tensor, numel: int, bits: int, group_size: int, divide_by: float,
                   out: torch.Tensor) -> None:
    """Sum (and divide) ``k`` payload rows and store the floats, in one kernel. The divisor goes
    as the kernels' fp32 (round to nearest even, as the wire format says: ``acc / float32(divide_by)``)."""
    launch = _op_plan("dequant_reduce", payloads.device, (payloads.shape[0], numel, bits, group_size, out.dtype))
    loader.launch(launch.source, launch.name, launch.device, launch.blocks, THREADS,
                  (payloads.data_ptr(), *launch.sizes, np.float32(divide_by), out.data_ptr()))


def dequant_reduce_requant(payloads: torch.Tensor, numel: int, bits: int, out_bits: int, group_size: int,
                           divide_by: float, out: torch.Tensor) -> None:
    """Sum (and divide) ``k`` payload rows and re-quantize the sum into ``out``'s rows, in one pass
    ([Note: narrow requant] in kernels/requant_rounds.cuh picks the kernel)."""
    launch = _op_plan("dequant_reduce_requant", payloads.device,
                      (payloads.shape[0], numel, bits, out_bits, group_size, divide_by, out.shape[0]))
    _requant(launch, payloads, out)


# ---- a collective plan's route: planned kernels ----

class PlannedKernel:
    """One op's kernel, planned for the argument sets a collective calls it with.

    Called with the op's arguments (the contract's, in the schema's order), it finds the
    launch plan of those arguments among those resolved when the collective's plan was made
    and launches it. Arguments no launch plan was made for are resolved then and kept here
    (the plan's uses are finite): that can compile between a collective's hops, so a
    collective lists every use it makes (tests/collectives/test_plan_kernels.py checks that
    none is missed).
    """

    __slots__ = ("op", "device", "launches")

    def __init__(self, op: str, device: torch.device, uses: Sequence[tuple]) -> None:
        self.op, self.device = op, device
        self.launches = {use: resolve(op, device, use) for use in uses}

    def _launch(self, use: tuple) -> Any:
        launch = self.launches.get(use)
        if launch is None:
            launch = self.launches[use] = resolve(self.op, self.device, use)
        return launch


class _PlannedQuantize(PlannedKernel):
    __slots__ = ()

    def __call__(self, x: torch.Tensor, bits: int, group_size: int, out: torch.Tensor) -> None:
        launch = self.launches.get((x.numel(), bits, group_size, x.dtype)) or self._launch(
            quantize_use(x.numel(), bits, group_size, x.dtype))
        _encode(launch.encoder, (x.data_ptr(), *launch.sizes, out.data_ptr()))


class _PlannedDequantize(PlannedKernel):
    __slots__ = ()

    def __call__(self, payloads: torch.Tensor, numel: int, bits: int, group_size: int, out: torch.Tensor) -> None:
        launch = self.launches.get((payloads.shape[0], numel, bits, group_size, out.dtype)) or self._launch(
            dequantize_use(payloads.shape[0], numel, bits, group_size, out.dtype))
        loader.launch(launch.source, launch.name, launch.device, launch.blocks, THREADS,
                      (payloads.data_ptr(), *launch.sizes, out.data_ptr()))


class _PlannedReorder(PlannedKernel):
    __slots__ = ()

    def __call__(self, xs: list[torch.Tensor], parts: int, part_numel: int, perm: Sequence[int], num_chunks: int,
                 bits: int, group_size: int, out: torch.Tensor) -> None:
        use = _reorder_use(xs, parts, part_numel, perm, num_chunks, bits, group_size)
        _reorder(self.launches.get(use) or self._launch(use), xs, parts, out)


class _PlannedReduce(PlannedKernel):
    __slots__ = ()

    def __call__(self, payloads: torch.Tensor, numel: int, bits: int, group_size: int, divide_by: float,
                 out: torch.Tensor) -> None:
        launch = self.launches.get((payloads.shape[0], numel, bits, group_size, out.dtype)) or self._launch(
            dequantize_use(payloads.shape[0], numel, bits, group_size, out.dtype))
        loader.launch(launch.source, launch.name, launch.device, launch.blocks, THREADS,
                      (payloads.data_ptr(), *launch.sizes, np.float32(divide_by), out.data_ptr()))


class _PlannedRequant(PlannedKernel):
    __slots__ = ()

    def __call__(self, payloads: torch.Tensor, numel: int, bits: int, out_bits: int, group_size: int,
                 divide_by: float, out: torch.Tensor) -> None:
        use = (payloads.shape[0], numel, bits, out_bits, group_size, divide_by, out.shape[0])
        _requant(self.launches.get(use) or self._launch(use), payloads, out)


_PLANNED = {"quantize": _PlannedQuantize, "dequantize": _PlannedDequantize, "reorder_quantize": _PlannedReorder,
            "dequant_reduce": _PlannedReduce, "dequant_reduce_requant": _PlannedRequant}


# op -> the sources its launch plans may launch from (dequant_reduce_requant: the narrow kernels, or
# the general one when a call's addresses are not aligned for them)
OP_SOURCES = {"quantize": ("quantize.cu",), "dequantize": ("dequantize.cu",),
              "reorder_quantize": ("reorder_quantize.cu",), "dequant_reduce": ("dequant_reduce.cu",),
              "dequant_reduce_requant": ("dequant_reduce.cu", "dequant_reduce_requant.cu")}


def load_sources(sources: Sequence[str], device: torch.device) -> None:
    """Compile or load ``sources`` for ``device`` in parallel ([Note: one plan per call] in zcomm._plan)."""
    loader.load_modules(sources, loader.device_index(device) if device.index is None else device.index)


def plan_kernels(device: torch.device, uses: Mapping[str, Sequence[tuple]]) -> dict[str, PlannedKernel]:
    """Each op's kernel planned for its ``uses`` on ``device``: the sources all of them need loaded
    first, together (a cold compile of a step's sources runs in parallel, not one op after another),
    then every launch resolved ([Note: launch plans])."""
    load_sources(list(dict.fromkeys(source for op in uses for source in OP_SOURCES[op])), device)
    return {op: _PLANNED[op](op, device, op_uses) for op, op_uses in uses.items()}

