"""Block-diagonal Walsh-Hadamard rotation of reduce-scatter slices (SDP4Bit's outlier smoothing).

[Note: Hadamard smoothing] A gradient block with one large element gets a coarse scale, and
every other element of its group is quantized with it. Rotating each block of ``B`` elements
by the orthonormal Hadamard matrix ``H / sqrt(B)`` spreads that element's magnitude over the
whole block before quantization (SDP4Bit, arXiv 2410.15526), and the rotation is undone after.
Because the rotation is linear and applied the same way to every rank's copy of a slice, the
reduce-scatter of the rotated inputs is the rotated sum: each rank rotates its whole input once
before step 1 and rotates its own output slice back once after step 5, and nothing in between
(rows, groups, bytes on the wire, the INT8 first hop) changes. ``H / sqrt(B)`` is symmetric and
orthogonal, so the same transform undoes itself, and the error quantization leaves in a block
keeps its 2-norm through the inverse.

Blocks start at each slice's first element; the last ``m mod B`` elements of a slice of ``m``
are left as they are. The rotation runs in fp32 (the rotated input is an fp32 copy of the
input, on its device), and the output slice is rotated back in fp32 before it is rounded to the
output's dtype.
"""

from __future__ import annotations

import math

import torch


def check_hadamard_block(block: int | None, name: str = "hadamard_block") -> None:
    """``block`` is None (no rotation) or a power of two >= 2; ``name`` names it in the error."""
    if block is None:
        return
    if isinstance(block, bool) or not isinstance(block, int) or block < 2 or block & (block - 1):
        raise ValueError(f"{name} must be a power of two >= 2 or None, got {block!r}")


def rotate_blocks_(x: torch.Tensor, block: int) -> None:
    """Rotate the rows of the fp32 matrix ``x`` (``(n, block)``, contiguous) by ``H / sqrt(block)`` in place.

    The fast Walsh-Hadamard transform: ``log2(block)`` butterfly passes of ``(a + b, a - b)``
    over halves of growing width, then one scaling.
    """
    assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == block and x.is_contiguous(), x.shape
    width = 1
    while width < block:
        pairs = x.view(x.shape[0], block // (2 * width), 2, width)
        a, b = pairs[:, :, 0, :], pairs[:, :, 1, :]
        total = a + b
        b.sub_(a).neg_()  # a - b
        a.copy_(total)
        width *= 2
    x.mul_(1.0 / math.sqrt(block))


def rotated_input(inputs: list[torch.Tensor], world_size: int, block: int) -> list[torch.Tensor]:
    """fp32 copies of ``inputs`` with every whole block of every rank's slice rotated."""
    rotated = []
    for x in inputs:
        copy = x.reshape(world_size, -1).to(torch.float32, copy=True)
        _rotate_slices_(copy, block)
        rotated.append(copy.view(-1))
    return rotated


def rotate_back_(result: torch.Tensor, sizes: list[int], block: int) -> None:
    """Undo the rotation on this rank's fp32 ``result``: the output slices of ``sizes`` elements, end to end."""
    for piece in result.split(sizes):
        _rotate_slices_(piece.view(1, -1), block)


def _rotate_slices_(slices: torch.Tensor, block: int) -> None:
    """Rotate the whole blocks at the start of each row of the fp32 ``(rows, m)`` matrix in place."""
    whole = slices.shape[1] // block * block
    if whole == 0:
        return
    head = slices[:, :whole]
    blocks = head.reshape(-1, block)
    rotate_blocks_(blocks, block)
    if not head.is_contiguous():  # several rows with tails: reshape copied
        head.copy_(blocks.view_as(head))
