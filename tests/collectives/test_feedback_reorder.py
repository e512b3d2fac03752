"""Error feedback's explicit reordering equals the slice permutation the reorder kernels read by.

``zcomm._error_feedback.reordered_view`` gives hop 1's input as a strided view (a transpose of
the ``(node, local rank, stage, part)`` view), read row by row; the oracle here is the permutation
of ``zcomm._slice_reorder`` applied with ``index_select`` to the zero-filled interleaving.
"""

from __future__ import annotations

import pytest
import torch

from zcomm._error_feedback import reordered_view
from zcomm._slice_reorder import reorder_permutation


def _oracle(inputs: list[torch.Tensor], perm: tuple[int, ...], world: int, slice_numel: int) -> torch.Tensor:
    virtual = torch.zeros(world, slice_numel, dtype=torch.float64)
    offset = 0
    for tensor in inputs:
        piece = tensor.view(world, -1)
        virtual[:, offset : offset + piece.shape[1]] = piece.double()
        offset += piece.shape[1]
    return virtual.view(len(perm), -1).index_select(0, torch.tensor(perm)).view(-1)


@pytest.mark.parametrize("nodes,local,stages", [(1, 1, 1), (1, 4, 3), (4, 1, 2), (2, 2, 1), (2, 3, 4), (3, 2, 2)])
@pytest.mark.parametrize("sizes", ([24], [5, 14], [3, 4, 5]), ids=("one", "two", "three"))
def test_reordered_view_is_the_permutation(nodes: int, local: int, stages: int, sizes: list[int]) -> None:
    world = nodes * local
    gen = torch.Generator().manual_seed(world * 10 + stages)
    inputs = [torch.randn(world * size, generator=gen).to(torch.bfloat16) for size in sizes]
    part = -(-sum(sizes) // stages)
    view = reordered_view(inputs, nodes, local, stages, stages * part)
    assert view.dtype == torch.bfloat16 and view.shape[:2] == (stages, local if local > 1 else nodes)
    got = torch.cat([view[s, r].reshape(-1) for s in range(view.shape[0]) for r in range(view.shape[1])])
    assert torch.equal(got.double(), _oracle(inputs, reorder_permutation(nodes, local, stages), world, stages * part))
