"""The reordering kernels on a GPU, both index paths, against the reference backend's bytes.

The kernels index with 32 bits up to 2^31 elements and with 64 bits above ([Note: magic
division] in zcomm_cuda/kernels/magic_divide.cuh); no test can allocate the sizes that take
the 64-bit path for real, so here the launcher's threshold is lowered to 0 to run the
``_wide`` kernels on small inputs (every index is as valid on either path). The cases cross
slice, part and piece ends and the zero fill, with tensors at differing alignments
([Note: stretches] in sources.cuh). The host check (test_cuda_host_math.py) proves the same
arithmetic on the CPU; this runs what only the device runs (``__umulhi``, ``__umul64hi``, the
vector loads of the stretches and of the fill's zero run, the register scheme's own kernel).
"""

from __future__ import annotations

import pytest
import torch

import zcomm.quant as q
from cuda_support import requires_gpu
from quant_cases import DTYPES, STRETCH_CASES, assert_same_bytes, make_hard_input
from zcomm.quant.backends import _cuda_launch as cuda_launch

pytestmark = requires_gpu


@pytest.fixture(params=(False, True), ids=("idx32", "idx64"))
def wide(request, monkeypatch) -> bool:
    """Which index path the launcher picks; records the kernel names it launches."""
    if request.param:
        monkeypatch.setattr(cuda_launch, "WIDE_NUMEL", 0)
    monkeypatch.setattr(cuda_launch, "OP_PLANS", cuda_launch.BoundedCache(cuda_launch.MAX_OP_PLANS))
    return request.param


def _names(monkeypatch) -> list[str]:
    names: list[str] = []
    encode = cuda_launch._encode

    def spy(encoder, args):
        names.append(encoder.name)
        return encode(encoder, args)

    monkeypatch.setattr(cuda_launch, "_encode", spy)
    return names


@pytest.mark.parametrize("shift", (0, 1, 3), ids=("aligned", "shift1", "shift3"))
@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parts,widths,part_numel,perm,num_chunks,group_size", STRETCH_CASES)
def test_interleaved_on_both_index_paths(
    wide, monkeypatch, dtype, bits, parts, widths, part_numel, perm, num_chunks, group_size, shift
):
    names = _names(monkeypatch)
    xs = [make_hard_input(parts * w, group_size, dtype, bits, seed=k + w) for k, w in enumerate(widths)]
    expected = q.reorder_quantize(xs, perm, num_chunks, bits, group_size, parts=parts, part_numel=part_numel,
                                  backend="reference")  # fmt: skip
    # tensor k starts k * shift elements into its own allocation: differing alignments
    on_device = []
    for k, x in enumerate(xs):
        storage = torch.empty(x.numel() + k * shift, dtype=dtype, device="cuda")
        on_device.append(storage[k * shift :])
        on_device[-1].copy_(x)
    got = q.reorder_quantize(on_device, perm, num_chunks, bits, group_size, parts=parts, part_numel=part_numel,
                             backend="cuda")  # fmt: skip
    assert_same_bytes(got.cpu(), expected, f"interleaved {dtype} INT{bits} wide={wide}")
    assert names and all(("_wide_" in name) == wide for name in names), names
    # the register scheme's own kernel ([Note: register kernel]) where the encoder holds groups in registers
    chunk = parts * part_numel // num_chunks
    registers = not wide and cuda_launch.in_registers(chunk, group_size, bits, got.shape[1], got.data_ptr())
    assert all(("_regs_" in name) == registers for name in names), names


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "numel,perm,num_chunks,group_size",
    [(12 * 64, (5, 3, 1, 0, 2, 4), 3, 256), (6 * 10, (2, 0, 1), 6, 4), (8 * 5000 * 3, (7, 6, 5, 4, 3, 2, 1, 0), 2, 20480)],
)
def test_permuted_on_both_index_paths(wide, monkeypatch, dtype, bits, numel, perm, num_chunks, group_size):
    names = _names(monkeypatch)
    x = make_hard_input(numel, group_size, dtype, bits, seed=numel)
    expected = q.reorder_quantize(x, perm, num_chunks, bits, group_size, backend="reference")
    got = q.reorder_quantize(x.cuda(), perm, num_chunks, bits, group_size, backend="cuda")
    assert_same_bytes(got.cpu(), expected, f"permuted {dtype} INT{bits} wide={wide}")
    assert names and all(("_wide_" in name) == wide for name in names), names
