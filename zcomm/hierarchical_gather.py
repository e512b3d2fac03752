"""An unquantized all-gather in qwZ's two hops, counted in :mod:`zcomm.comm_stats`.

On ``W = N * L`` ranks (``N`` nodes of ``L`` ranks, node-major), each rank first gathers
the inputs of the ``N`` ranks with its local rank (zcomm's private inter-node group), then
the ``N * L`` inputs of its node (the intra-node group), and reorders them into rank
order. Only ``N - 1`` inputs leave each rank across nodes, where a flat ring in rank order
makes the node's boundary rank send ``W - 1`` (see :mod:`zcomm.all_gather_q8`). For
payloads a caller has already encoded (bytes of any dtype: weight differences, packed
flags), which qwZ would quantize again.

The hops run on the caller's thread and the call returns when the output is written. Their
subgroups are this collective's own (``"bytes"`` partitions of the caller's group, see
:mod:`zcomm._groups`), so they never interleave with qwZ's or qgZ's hops on their groups.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._groups import node_groups
from ._prologue import prologue
from ._torch_compat import all_gather_single
from .comm_stats import record
from .topology import Topology

__all__ = ["all_gather_hierarchical"]


def all_gather_hierarchical(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None, *,
    topology: Topology | None = None,
) -> None:
    """``torch.distributed.all_gather_into_tensor`` (synchronous) in two hops, inter-node first;
    recorded as ``"all_gather_hierarchical"`` with the bytes each hop sends."""
    info = prologue(output, input, group, topology, gather=True, quantized=False)
    group = group if group is not None else dist.group.WORLD
    topo = info.topology
    nodes, local = topo.num_nodes, topo.local_size
    chunk = input.numel() * input.element_size()
    hops = node_groups(group, topo, "bytes")
    gathered = input
    if hops.inter is not None:
        gathered = torch.empty(nodes * input.numel(), dtype=input.dtype, device=input.device)
        all_gather_single(gathered, input, group=hops.inter)
    if hops.intra is None:
        output.copy_(gathered)
    else:
        by_local = torch.empty(local * gathered.numel(), dtype=input.dtype, device=input.device)
        all_gather_single(by_local, gathered, group=hops.intra)
        # [local rank l][node n] -> rank n * L + l
        output.view(nodes, local, -1).copy_(by_local.view(local, nodes, -1).transpose(0, 1))
    record("all_gather_hierarchical", (local - 1) * nodes * chunk, (nodes - 1) * chunk)
