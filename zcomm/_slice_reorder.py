"""Tensor-slice reordering for qgZ's 2-hop all-to-all (ZeRO++ section 3.3.3, Algorithm 2).

A reduce-scatter input on each of ``W = N * L`` ranks (``N`` nodes of ``L`` ranks,
node-major) holds ``W`` equal slices; slice ``j`` must end, reduced, on rank ``j``. With
``k`` pipeline stages every slice is cut into ``k`` equal parts, so the input is ``W * k``
sub-slices; sub-slice ``j * k + s`` is part ``s`` of the slice for rank ``j``.

The 2-hop path for stage ``s``:

1. intra-node all-to-all: this rank sends to local rank ``l'`` of its node the ``N``
   parts ``s`` destined to the ranks with local rank ``l'`` (one per node ``n'``);
2. each rank sums the ``L`` rows it received (its node's contribution) and cuts the sum
   into ``N`` rows, one per node;
3. inter-node all-to-all among the ranks with the same local rank: row ``n'`` goes to
   node ``n'``, which sums the ``N`` node contributions into part ``s`` of its own slice.

For every row to be one contiguous piece, the input is reordered *stage-major, then
destination local rank, then destination node*: reordered position ``s*W + l'*N + n'``
holds input sub-slice ``(n'*L + l')*k + s``. Stage ``s`` is then positions
``[s*W, (s+1)*W)``, the row for local rank ``l'`` is its ``l'``-th block of ``N``
sub-slices, and after the intra hop the ``n'``-th sub-slice of every received row is the
one for node ``n'``: exactly the split step 2 makes. No copy is needed after the last hop:
stage ``s``'s result is part ``s`` of this rank's slice. With ``k = 1`` this is the
paper's equations (1)-(2); with ``N = 1`` or ``L = 1`` it degenerates to the identity
order of a single all-to-all.
"""

from __future__ import annotations


def reorder_permutation(num_nodes: int, local_size: int, stages: int) -> tuple[int, ...]:
    """``perm`` with ``perm[position] = input sub-slice`` for :func:`zcomm.quant.reorder_quantize`."""
    assert num_nodes >= 1 and local_size >= 1 and stages >= 1
    world_size = num_nodes * local_size
    perm = [0] * (world_size * stages)
    for stage in range(stages):
        for local_rank in range(local_size):
            for node in range(num_nodes):
                destination = node * local_size + local_rank
                perm[stage * world_size + local_rank * num_nodes + node] = destination * stages + stage
    return tuple(perm)


def first_hop_rows(num_nodes: int, local_size: int, stages: int) -> int:
    """How many rows (self-contained payloads) the reordered input is quantized into.

    ``stages * L`` rows of ``N`` sub-slices for the intra-node hop; when there is one rank
    per node that hop is skipped and the input goes straight to the inter-node hop as
    ``stages * N`` rows of one sub-slice.
    """
    return stages * (local_size if local_size > 1 else num_nodes)
