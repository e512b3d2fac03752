"""zcomm's private subgroups of a caller's process group, created once and cached.

qgZ's and qwZ's two hops run on an intra-node group (the ranks of this rank's node) and an
inter-node group (the ranks with this rank's local rank, one per node); hpZ (the ZeRO
runtime) gathers inside a block of consecutive ranks. zcomm creates these groups itself,
so its traffic never interleaves with the caller's collectives on the caller's group.

[Note: group creation order] Creating a group is collective among its members. Every
member of the caller's group calls :func:`node_groups` (or :func:`consecutive_group`) for
the same (group, topology) at the same point of its program, because the zcomm collectives
that need them are themselves collective; each rank then creates the intra-node group of
its node before the inter-node group of its local rank, so every member of a new group
arrives at its rendezvous and no cycle of waits can form.

[Note: group names] ``torch.distributed.new_group`` either needs *every* rank of the world
to call it (a subgroup caller's non-members never do), or, with
``use_local_synchronization=True``, names the group after the ranks *and the number of
groups this process has created so far*, which differs between ranks as soon as some of
them used zcomm on a subgroup: their rendezvous would then wait on different store keys
until the timeout. zcomm therefore names its groups deterministically after the parent
group's name, the purpose and the member ranks, and creates them through the same
internal helper ``new_group`` uses. The parent group's timeout is inherited, so a dead
peer makes zcomm's hops fail just like the caller's own collectives.
"""

from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist

from .topology import Topology
from .torch_compat import new_named_group


class NodeGroups(NamedTuple):
    """This rank's hierarchical-hop subgroups; ``None`` where a hop has a single member (and is skipped)."""

    intra: dist.ProcessGroup | None
    inter: dist.ProcessGroup | None


# (parent group name, purpose, member group ranks) -> the private group
_GROUPS: dict[tuple[str, str, tuple[int, ...]], dist.ProcessGroup] = {}


def node_groups(group: dist.ProcessGroup, topology: Topology) -> NodeGroups:
    """The intra- and inter-node subgroups of this rank in ``group`` laid out as ``topology``."""
    assert topology.world_size == dist.get_world_size(group)
    rank = dist.get_rank(group)
    node, local = topology.node_of(rank), topology.local_rank_of(rank)
    intra = _subgroup(group, "intra", topology.node_ranks(node)) if topology.local_size > 1 else None
    inter = _subgroup(group, "inter", topology.local_peers(local)) if topology.num_nodes > 1 else None
    return NodeGroups(intra, inter)


def consecutive_group(group: dist.ProcessGroup | None, size: int) -> dist.ProcessGroup:
    """The group of the ``size`` consecutive ranks of ``group`` (default: world) holding this rank.

    Rank ``r`` of ``group`` belongs to block ``r // size``. ``size`` must divide the group size.
    """
    group = group if group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or world % size:
        raise ValueError(f"size must be a positive divisor of the group size {world}, got {size!r}")
    block = dist.get_rank(group) // size
    return _subgroup(group, "block", range(block * size, (block + 1) * size))


def _subgroup(parent: dist.ProcessGroup, purpose: str, group_ranks: range) -> dist.ProcessGroup:
    members = tuple(group_ranks)
    key = (parent.group_name, purpose, members)
    if key not in _GROUPS:
        parent_ranks = dist.get_process_group_ranks(parent)
        _GROUPS[key] = _create(parent, purpose, [parent_ranks[r] for r in members])
    return _GROUPS[key]


def _create(parent: dist.ProcessGroup, purpose: str, global_ranks: list[int]) -> dist.ProcessGroup:
    name = f"zcomm/{parent.group_name}/{purpose}/{'_'.join(map(str, global_ranks))}"
    return new_named_group(name, global_ranks, like=parent, desc=f"zcomm {purpose}")
