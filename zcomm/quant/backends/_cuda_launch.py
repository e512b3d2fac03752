"""The ``cuda`` backend's kernels: the contract of :mod:`zcomm.quant._contract` on CUDA tensors.

Each function picks the kernel of :mod:`zcomm_cuda` by dtype and bits, sizes the grid, and
launches it on torch's current stream (:func:`zcomm_cuda.loader.launch`). Arguments arrive
as the contract states them (validated, contiguous, non-empty, on one CUDA device, outputs
preallocated). Nothing here synchronizes the host, so every op can be captured in a CUDA
graph. This module imports without cupy or a GPU (the loader imports cupy when it first
compiles), so the launch arithmetic is tested anywhere; :mod:`zcomm.quant.backends.cuda`
registers these functions once the backend can run.

Grid sizing: the kernels walk their work grid-stride, so the grid is the work size capped
at one full wave: as many blocks as every multiprocessor holds resident at once, from the
occupancy the kernel's registers allow (:func:`_max_blocks`; [Note: one wave]). The
encoder kernels run one of two schemes chosen from the group size
(:func:`encoder_passes`; [Note: large groups] in kernels/group_encoder.cuh).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Sequence

import numpy as np
import torch

from zcomm_cuda import loader

from .. import wire_format

THREADS = 256
WARPS_PER_BLOCK = THREADS // 32
RUN = 8  # elements per vector run in the kernels (vector_io.cuh)

# Mirrors of team_walk.cuh and group_encoder.cuh (tests/quant/test_cuda_host_math.py checks that they agree).
TEAM_MAX_GROUP = 4096  # kTeamMaxGroup (team_walk.cuh): larger groups take the tile scheme
TILE_THREADS = 256  # kTileThreads: the block size of the tile passes
TILE_ELEMS = 8192  # kTileElems: elements per tile
TEAMS, TILE_ABSMAX, TILE_ENCODE = 0, 1, 2  # EncoderPass
assert TILE_THREADS == THREADS

_DTYPE_TAG = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}

# perm -> the same perm as a pinned int64 CPU tensor, never freed; see [Note: perm lifetime].
_PINNED_PERMS: dict[tuple[int, ...], torch.Tensor] = {}


class _DevicePerm:
    """A permutation's device copy: the tensor, the event after its upload, whether that has run."""

    __slots__ = ("tensor", "uploaded", "stream", "done")

    def __init__(self, tensor: torch.Tensor, uploaded: torch.cuda.Event, stream: int) -> None:
        self.tensor, self.uploaded, self.stream, self.done = tensor, uploaded, stream, False


# (perm, device index) -> its device copy, never freed; see [Note: perm lifetime].
_DEVICE_PERMS: dict[tuple[tuple[int, ...], int], _DevicePerm] = {}


# [Note: launch arguments] cupy passes numpy scalars by value at their own width, and a Python
# int as a 64-bit integer whatever the kernel declares (cupy's argument conversion makes it a
# ``numpy.int64``, which raises for 2^63 and above). So every argument is a numpy scalar of its
# parameter's type, except the tensors' addresses: they go as the Python ints ``data_ptr()``
# returns, into the kernels' 64-bit pointer parameters, where both launchers pass them exactly
# (cupy's int64 of an address below 2^63 has the address's bytes; the driver launcher packs an
# int into a 64-bit slot as unsigned, [Note: parameter layout] in zcomm_cuda.driver_launch), and
# zcomm builds no numpy scalar per address (about 0.2 us each; the driver launcher packs the int
# as it is, cupy's converts it itself). tests/quant/test_cuda_launch_abi.py
# holds every launch to this. The integer arguments that depend only on the call's sizes are
# looked up from ``_sizes`` (made once per sizes), so only the addresses are new per launch.
_PASSES = (np.int32(TEAMS), np.int32(TILE_ABSMAX), np.int32(TILE_ENCODE))


@lru_cache(maxsize=1024)
def _sizes(*values: int) -> tuple[np.int64, ...]:
    """``values`` as the kernels' int64 arguments, made once per distinct tuple ([Note: launch arguments])."""
    return tuple(np.int64(value) for value in values)


# (source, kernel name, device index) -> the kernel's grid cap; see [Note: one wave]
_MAX_BLOCKS: dict[tuple[str, str, int], int] = {}
# (op, float dtype, bits...) -> the kernel's name, built once
_NAMES: dict[tuple, str] = {}


def _name(template: str, *key: object) -> str:
    """``template`` formatted with ``key`` (a dtype becomes its tag), made once per key."""
    name = _NAMES.get((template, *key))
    if name is None:
        name = _NAMES[(template, *key)] = template.format(*(_DTYPE_TAG.get(k, k) for k in key))
    return name


def _max_blocks(device: torch.device, source: str, name: str) -> int:
    """The grid cap of kernel ``name``: one wave of resident blocks on every multiprocessor.

    [Note: one wave] A grid-stride kernel does the same work per block, so a grid of a few
    blocks per SM more than are resident runs in waves, the last one partly empty: with 8
    blocks per SM launched and 3 resident (72 registers per thread), the third wave holds 2
    blocks per SM; with 6 resident (40 registers), the second holds 2, a third of the SM.
    Capping the grid at the resident count runs it in one full wave.
    """
    blocks = _MAX_BLOCKS.get((source, name, device.index))
    if blocks is None:
        index = loader.device_index(device)
        blocks = _resident_blocks(source, name, index) * loader.multiprocessor_count(index)
        if device.index is not None:  # "cuda" alone means whichever device is current: not cached
            _MAX_BLOCKS[(source, name, index)] = blocks
    return blocks


@lru_cache(maxsize=None)
def _resident_blocks(source: str, name: str, index: int) -> int:
    """Blocks of :data:`THREADS` threads of kernel ``name`` resident on one SM (CUDA occupancy, cached)."""
    import cupy
    from cupy_backends.cuda.api import driver

    function = loader.kernel(source, name, index)
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


_MAX_MEMO = 4096  # entries of each launch memo before it is emptied (a caller sweeping sizes)
# (kernel name, device index, jobs, group extent) -> its launches (encoder_passes), resolved once
# per sizes as the decoders' are ([Note: decoder launch memo])
_ENCODER_PASSES: dict[tuple[str, int, int, int], list[tuple[int, int]]] = {}


def _encode(source: str, name: str, device: torch.device, jobs: int, group_extent: int, args: Sequence[Any]) -> None:
    """Run encoder kernel ``name`` with ``args`` (all but its last two, group_absmax and pass).

    The tile scheme's per-group absmax lives in a zeroed temporary allocated on the current
    stream, which both passes use in stream order (see [Note: large groups]).
    """
    key = (name, device.index, jobs, group_extent)
    passes = _ENCODER_PASSES.get(key)
    if passes is None:
        passes = _remember(_ENCODER_PASSES, key, device, encoder_passes(jobs, group_extent,
                                                                        _max_blocks(device, source, name)))
    absmax = torch.zeros(jobs, dtype=torch.int32, device=device) if passes[0][0] != TEAMS else None
    absmax_ptr = 0 if absmax is None else absmax.data_ptr()
    for encoder_pass, blocks in passes:
        loader.launch(source, name, device, blocks, THREADS, (*args, absmax_ptr, _PASSES[encoder_pass]))


def _decoder_blocks(device: torch.device, source: str, name: str, runs: int) -> int:
    return _cap(-(-runs // THREADS), _max_blocks(device, source, name))


def _pinned_perm(key: tuple[int, ...]) -> torch.Tensor:
    host = _PINNED_PERMS.get(key)
    if host is None:
        host = _PINNED_PERMS[key] = torch.tensor(key, dtype=torch.int64).pin_memory()
    return host


def _device_perm(perm: Sequence[int], device: torch.device) -> torch.Tensor:
    """``perm`` as an int64 tensor on ``device``: uploaded once per (perm, device), then looked up.

    [Note: perm lifetime] The kernel reads the permutation from device memory. The first
    eager call for a (perm, device) copies it on the current stream from a pinned host copy
    (``non_blocking``: a cudaMemcpyAsync, no host synchronization), records an event after
    the copy, and keeps the device tensor and the pinned source for the life of the process:
    neither is written again nor freed, so torch's caching allocator never hands their memory
    to anyone else. A later call on the upload's stream is ordered after the copy by the
    stream; a call on another stream makes that stream wait for the event until the event
    has been seen complete (``query``, which does not block), after which the copy is simply
    there. Under CUDA-graph capture a copy whose completion has not been seen is not used
    (waiting on an event recorded outside the capture is not capturable): the call uploads a
    stream-ordered temporary from the pinned copy instead, which becomes a copy node of the
    graph, reading pinned memory that stays valid for every replay, and the temporary belongs
    to the graph's memory pool. A copy seen complete is read by the captured kernels directly.
    """
    index = device.index if device.index is not None else loader.device_index(device)
    key = perm if type(perm) is tuple else tuple(perm)
    cached = _DEVICE_PERMS.get((key, index))
    if cached is not None and cached.done:  # the common case: uploaded, and seen complete
        return cached.tensor
    capturing = torch.cuda.is_current_stream_capturing()
    if cached is None:
        if capturing:
            return _pinned_perm(key).to(device, non_blocking=True)
        stream = torch.cuda.current_stream(index)
        tensor = _pinned_perm(key).to(device, non_blocking=True)
        uploaded = torch.cuda.Event()
        uploaded.record(stream)
        _DEVICE_PERMS[(key, index)] = _DevicePerm(tensor, uploaded, stream.cuda_stream)
        return tensor
    if not cached.done:
        if capturing:
            return _pinned_perm(key).to(device, non_blocking=True)
        cached.done = cached.uploaded.query()
        if not cached.done and loader.current_raw_stream(index) != cached.stream:
            torch.cuda.current_stream(index).wait_event(cached.uploaded)
    return cached.tensor


def quantize(x: torch.Tensor, bits: int, group_size: int, out: torch.Tensor) -> None:
    numel = x.numel()
    _encode(
        "quantize.cu",
        _name("zc_quantize_{}_int{}", x.dtype, bits),
        x.device,
        -(-numel // group_size),  # num_groups
        min(group_size, numel),
        (x.data_ptr(), *_sizes(numel, group_size), out.data_ptr()),
    )


# [Note: decoder launch memo] The decoders run once per pipeline stage or chunk with the same
# sizes every call, so what their launch needs besides the two addresses (kernel name, grid,
# size arguments, fp32 divisor) is resolved once per (op, sizes, dtype, bits, device index) and
# looked up after: one dictionary lookup instead of the name, grid and argument helpers per
# launch. Only devices with an index are remembered (``cuda`` alone follows the current device),
# and the memo is emptied when it reaches _MAX_MEMO entries (a caller sweeping sizes).
_DECODER_MEMO: dict[tuple, tuple[str, int, tuple]] = {}


def _remember(memo: dict[tuple, Any], key: tuple, device: torch.device, value: Any) -> Any:
    """Keep ``value`` for ``key`` in the launch memo ``memo`` and return it ([Note: decoder launch
    memo]): only for a device with an index, and the memo is emptied first when full."""
    if device.index is not None:
        if len(memo) >= _MAX_MEMO:
            memo.clear()
        memo[key] = value
    return value


def dequantize(payloads: torch.Tensor, numel: int, bits: int, group_size: int, out: torch.Tensor) -> None:
    rows, row_nbytes = payloads.shape
    device = payloads.device
    key = ("dequantize", device.index, out.dtype, bits, rows, row_nbytes, numel, group_size)
    resolved = _DECODER_MEMO.get(key)
    if resolved is None:
        resolved = _remember(_DECODER_MEMO, key, device,
                             _resolve_dequantize(device, rows, row_nbytes, numel, bits, group_size, out.dtype))
    name, blocks, sizes = resolved
    loader.launch("dequantize.cu", name, device, blocks, THREADS, (payloads.data_ptr(), *sizes, out.data_ptr()))


def _resolve_dequantize(device: torch.device, rows: int, row_nbytes: int, numel: int, bits: int, group_size: int,
                        dtype: torch.dtype) -> tuple[str, int, tuple]:
    name = _name("zc_dequantize_{}_int{}", dtype, bits)
    blocks = _decoder_blocks(device, "dequantize.cu", name, rows * -(-numel // RUN))
    return name, blocks, _sizes(row_nbytes, numel, group_size, rows)


def reorder_quantize(
    xs: list[torch.Tensor],
    parts: int,
    part_numel: int,
    perm: Sequence[int],
    num_chunks: int,
    bits: int,
    group_size: int,
    out: torch.Tensor,
) -> None:
    """One tensor that fills its parts is read through the permutation alone; otherwise
    the interleaved kernel reads the tensors through a table ([Note: interleaved table]), or,
    when the encoder holds its groups in registers, that scheme's own kernel ([Note: register
    kernel] in kernels/reorder_quantize.cu). Inputs of more than :data:`WIDE_NUMEL` elements
    take the kernels' 64-bit index path. Everything but the addresses and the output's
    alignment is resolved once per sizes (:func:`_resolve_reorder`)."""
    x = xs[0]
    flat = len(xs) == 1 and x.numel() == parts * part_numel
    key = (x.dtype, bits, x.device.index, flat, len(xs), parts, part_numel, len(perm), num_chunks, group_size,
           out.shape[1])
    resolved = _REORDER_MEMO.get(key)
    if resolved is None:
        resolved = _remember(_REORDER_MEMO, key, x.device, _resolve_reorder(key))
    name, registers_name, jobs, extent, slice_args, part_args, layout = resolved
    device_perm = _device_perm(perm, x.device)
    if flat:
        source = (x.data_ptr(), device_perm.data_ptr(), *slice_args)
    else:
        source = (_device_table(xs, parts).data_ptr(), *part_args, device_perm.data_ptr(), *slice_args)
        if registers_name is not None and out.data_ptr() % _RUN_BYTES[bits] == 0:  # [Note: register kernel]
            name = registers_name
    _encode("reorder_quantize.cu", name, x.device, jobs, extent, (*source, *layout, out.data_ptr()))


# (dtype, bits, device index, flat, tensors, parts, part_numel, len(perm), num_chunks, group_size,
# row bytes) -> reorder_quantize's kernel name, jobs, group extent and size arguments
_REORDER_MEMO: dict[tuple, tuple] = {}
WIDE_NUMEL = 2**31  # above this many elements the reordering kernels index with 64 bits ([Note: magic division])


def _resolve_reorder(key: tuple) -> tuple:
    dtype, bits, _, flat, tensors, parts, part_numel, slices, num_chunks, group_size, row_nbytes = key
    numel = parts * part_numel
    chunk = numel // num_chunks
    wide = numel > WIDE_NUMEL
    kind = ("quantize" if flat else "interleaved") + ("_wide" if wide else "")
    name = _name("zc_reorder_{}_{}_int{}", kind, dtype, bits)
    registers_name = None
    if not flat and not wide and in_registers(chunk, group_size, bits, row_nbytes, out_ptr=0):
        registers_name = _name("zc_reorder_interleaved_regs_{}_int{}", dtype, bits)
    slice_args = (np.int64(numel // slices), *_magic_args(numel // slices, wide))
    part_args = (np.int64(tensors), np.int64(part_numel), *_magic_args(part_numel, wide))
    layout = _sizes(chunk, num_chunks, group_size, row_nbytes)
    jobs = -(-chunk // group_size) * num_chunks
    return name, registers_name, jobs, min(group_size, chunk), slice_args, part_args, layout


REGISTER_MAX_GROUP = 32 * 8 * 4  # kRegisterMaxGroup (team_walk.cuh): 32 lanes of kRunsPerLane runs of 8
_RUN_BYTES = {8: 8, 4: 4}  # bytes of 8 codes (Codes8<BITS>::kWords words)


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


def interleaved_table(xs: Sequence[torch.Tensor], parts: int) -> list[int]:
    """InterleavedSource's table (sources.cuh): per tensor its address, its piece of a part, where that
    piece ends; then zeros, which hold the fill's 16-byte-aligned run of 8 (32 bytes) when the table
    starts on a 16-byte boundary, as device allocations do."""
    table, end = [], 0
    for x in xs:
        width = x.numel() // parts
        end += width
        table += [x.data_ptr(), width, end]
    return table + [0] * 5


def _device_table(xs: Sequence[torch.Tensor], parts: int) -> torch.Tensor:
    """The interleaved kernel's table on the tensors' device, uploaded on the current stream.

    [Note: interleaved table] The table holds the tensors' addresses, so it is made per call:
    a pinned host tensor from torch's caching host allocator, copied with
    ``non_blocking=True`` (no host synchronization). The allocator records the copy on the
    stream and does not hand the pinned block out again before the copy has run, so
    dropping the host tensor here is safe. Unlike the permutation's pinned copy, which is
    kept ([Note: perm lifetime]), a per-call host buffer cannot be replayed by a CUDA graph: the
    interleaved form is not graph-capturable; one tensor that fills its parts never needs it.
    The device copy is a fresh allocation of the caching allocator, so it starts on a 16-byte
    boundary (the zero run after the entries relies on that, see InterleavedSource).
    """
    host = torch.tensor(interleaved_table(xs, parts), dtype=torch.int64).pin_memory()
    return host.to(xs[0].device, non_blocking=True)


@lru_cache(maxsize=256)
def _fp32(divide_by: float) -> np.float32:
    """``divide_by`` as the kernels' fp32 argument, made once per value ([Note: launch arguments]).

    The divisor is rounded to fp32 here (round to nearest even, as the wire format says:
    ``acc / float32(divide_by)``); a Python float would reach the kernel as a double.
    """
    return np.float32(divide_by)


def dequant_reduce(
    payloads: torch.Tensor, numel: int, bits: int, group_size: int, divide_by: float, out: torch.Tensor
) -> None:
    """Sum (and divide) ``k`` payload rows and store the floats, in one kernel."""
    rows, row_nbytes = payloads.shape
    device = payloads.device
    key = ("dequant_reduce", device.index, out.dtype, bits, rows, row_nbytes, numel, group_size, divide_by)
    resolved = _DECODER_MEMO.get(key)
    if resolved is None:
        resolved = _remember(_DECODER_MEMO, key, device, _resolve_dequant_reduce(
            device, rows, row_nbytes, numel, bits, group_size, divide_by, out.dtype))
    name, blocks, sizes = resolved
    loader.launch("dequant_reduce.cu", name, device, blocks, THREADS, (payloads.data_ptr(), *sizes, out.data_ptr()))


def _resolve_dequant_reduce(device: torch.device, rows: int, row_nbytes: int, numel: int, bits: int,
                            group_size: int, divide_by: float, dtype: torch.dtype) -> tuple[str, int, tuple]:
    """``dequant_reduce``'s kernel name, grid and the arguments between its two addresses."""
    name = _name("zc_dequant_reduce_{}_int{}", dtype, bits)
    blocks = _decoder_blocks(device, "dequant_reduce.cu", name, -(-numel // RUN))
    return name, blocks, (*_sizes(row_nbytes, numel, group_size, rows), _fp32(divide_by))


def dequant_reduce_requant(
    payloads: torch.Tensor, numel: int, bits: int, out_bits: int, group_size: int, divide_by: float, out: torch.Tensor
) -> None:
    """Sum (and divide) ``k`` payload rows and re-quantize the sum into ``out``'s rows, in one pass.

    When the encoder holds its groups in registers and the sizes fit 32-bit indices, the
    register scheme's own kernel for the divisor's mode runs ([Note: narrow requant] in
    kernels/requant_rounds.cuh); otherwise the general kernel (kernels/dequant_reduce_requant.cu,
    a module of its own). Everything but the addresses
    and their alignment is resolved once per sizes (:func:`_resolve_requant`)."""
    rows, row_nbytes = payloads.shape
    chunks, chunk_nbytes = out.shape
    key = (payloads.device.index, rows, row_nbytes, numel, bits, out_bits, group_size, divide_by, chunks, chunk_nbytes)
    resolved = _REQUANT_MEMO.get(key)
    if resolved is None:
        resolved = _remember(_REQUANT_MEMO, key, payloads.device, _resolve_requant(key, payloads.device))
    name, narrow_name, narrow_blocks, jobs, extent, sizes, narrow_sizes, narrow_tail = resolved
    src, dst = payloads.data_ptr(), out.data_ptr()
    if narrow_name is not None and src % _RUN_BYTES[bits] == 0 and dst % _RUN_BYTES[out_bits] == 0:
        loader.launch("dequant_reduce.cu", narrow_name, payloads.device, narrow_blocks, THREADS,
                      (src, *narrow_sizes, dst, *narrow_tail))
        return
    _encode("dequant_reduce_requant.cu", name, payloads.device, jobs, extent, (src, *sizes, dst))


# (device index, rows, row bytes, numel, bits, out_bits, group_size, divide_by, chunks, chunk bytes)
# -> dequant_reduce_requant's kernel names, the narrow kernel's grid, jobs, group extent and size
# arguments
_REQUANT_MEMO: dict[tuple, tuple] = {}
_MODE_TAG = {"one": "one", "reciprocal": "pow2", "division": "div"}


def _resolve_requant(key: tuple, device: torch.device) -> tuple:
    _, rows, row_nbytes, numel, bits, out_bits, group_size, divide_by, chunks, chunk_nbytes = key
    chunk = numel // chunks
    jobs = -(-chunk // group_size) * chunks
    name = _name("zc_dequant_reduce_requant_int{}_int{}", bits, out_bits)
    divisor = _fp32(divide_by)
    sizes = (*_sizes(row_nbytes, numel, group_size, rows), divisor, *_sizes(chunks, chunk_nbytes))
    narrow_name, narrow_blocks, narrow_sizes, narrow_tail = None, 0, (), ()
    if narrow_requant(numel, chunk, group_size, bits, out_bits, row_nbytes, chunk_nbytes):
        narrow_name = _name("zc_dequant_reduce_requant_regs_{}_int{}_int{}", _MODE_TAG[divisor_mode(divisor)], bits,
                            out_bits)
        narrow_sizes = (*_sizes(row_nbytes, numel, group_size), *_magic_args(group_size, False), np.int64(rows),
                        divisor, *_sizes(chunks, chunk_nbytes))
        narrow_tail = _sizes(*narrow_requant_sizes(numel, chunks, group_size, bits, out_bits))
        narrow_blocks = _cap(-(-jobs // WARPS_PER_BLOCK), _max_blocks(device, "dequant_reduce.cu", narrow_name))
    return (name, narrow_name, narrow_blocks, jobs, min(group_size, chunk), sizes, narrow_sizes, narrow_tail)


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
