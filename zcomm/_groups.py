"""zcomm's private subgroups of a caller's process group, created once per group and cached.

qgZ's and qwZ's two hops run on an intra-node group (the ranks of this rank's node) and an
inter-node group (the ranks with this rank's local rank, one per node), one pair per
:data:`~zcomm._contract.Kind` of collective ([Note: kinds]): qwZ's gathers and qgZ's reductions
never share a group, so each kind keeps its own order and neither waits for the other;
hpZ (the ZeRO runtime) gathers inside a block of consecutive ranks. zcomm creates these groups itself,
so its traffic never interleaves with the caller's collectives on the caller's group.
Each kind is a *partition* of the caller's group into blocks; this rank gets its block.
How a partition is created (split from the caller's group, or by the members of each
block) is [Note: creating zcomm's groups] in :mod:`zcomm._torch_compat`.

[Note: group creation order] Creating groups is collective: among the caller's group when
split from it, among a block's members otherwise. Every member of the caller's group calls
:func:`node_groups` (or :func:`consecutive_group`) for the same (group, topology, kind) at
the same point of its program, on the caller's thread, because the zcomm collectives that
need them are themselves collective; each rank then creates the intra-node partition
before the inter-node one, so every member of a new group arrives at its rendezvous and
no cycle of waits can form. Creating a kind's groups while the other kind's chains run on
theirs is safe: creation uses the store (or, by split, the caller's group, which zcomm's
chains never use).

[Note: group names] Blocks created by their members are named deterministically after the
parent group's name, the purpose and the member ranks: torch's own names for groups
created on a subset of the world depend on how many groups each process has created so
far, which differs between ranks as soon as some of them used zcomm on a subgroup. The
parent group's timeout is inherited, so a dead peer makes zcomm's hops fail just like the
caller's own collectives.

[Note: cache lifetime] The cache is keyed by the caller's ``ProcessGroup`` object, weakly:
after ``destroy_process_group`` and a new ``init_process_group`` in the same process the
new groups are new objects (even where torch reuses their names), so nothing made for the
old ones is found again, and the entries go away with the old group objects.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch.distributed as dist

from ._contract import Kind
from .topology import Topology
from ._torch_compat import creates_by_split, new_named_group, split_subgroups


class NodeGroups(NamedTuple):
    """This rank's hierarchical-hop subgroups; ``None`` where a hop has a single member (and is skipped)."""

    intra: dist.ProcessGroup | None
    inter: dist.ProcessGroup | None


# caller's group -> (purpose, partition) -> this rank's block of it
_GROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple, dist.ProcessGroup]] = weakref.WeakKeyDictionary()


def node_groups(group: dist.ProcessGroup, topology: Topology, kind: Kind) -> NodeGroups:
    """``kind``'s intra- and inter-node subgroups of this rank in ``group`` laid out as ``topology``."""
    assert topology.world_size == dist.get_world_size(group)
    intra = inter = None
    if topology.local_size > 1:
        intra = _subgroup(group, f"{kind}-intra", [topology.node_ranks(n) for n in range(topology.num_nodes)])
    if topology.num_nodes > 1:
        inter = _subgroup(group, f"{kind}-inter", [topology.local_peers(l) for l in range(topology.local_size)])
    return NodeGroups(intra, inter)


def consecutive_group(group: dist.ProcessGroup | None, size: int) -> dist.ProcessGroup:
    """The group of the ``size`` consecutive ranks of ``group`` (default: world) holding this rank.

    Rank ``r`` of ``group`` belongs to block ``r // size``. ``size`` must divide the group
    size. Collective over ``group`` the first time (see [Note: group creation order]).
    """
    group = group if group is not None else dist.group.WORLD
    world_size = dist.get_world_size(group)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or world_size % size:
        raise ValueError(f"size must be a positive divisor of the group size {world_size}, got {size!r}")
    return _subgroup(group, "block", [range(b * size, (b + 1) * size) for b in range(world_size // size)])


def _subgroup(parent: dist.ProcessGroup, purpose: str, partition: Sequence[range]) -> dist.ProcessGroup:
    """This rank's block of ``partition`` (group ranks of ``parent``), created on first use."""
    blocks = tuple(tuple(block) for block in partition)
    cached = _GROUPS.setdefault(parent, {})
    key = (purpose, blocks)
    if key not in cached:
        cached[key] = _create(parent, purpose, blocks)
    return cached[key]


def _create(parent: dist.ProcessGroup, purpose: str, blocks: tuple[tuple[int, ...], ...]) -> dist.ProcessGroup:
    desc = f"zcomm {purpose}"
    if creates_by_split(parent):
        return split_subgroups(parent, blocks, desc=desc)
    rank = dist.get_rank(parent)
    mine = next(block for block in blocks if rank in block)
    parent_ranks = dist.get_process_group_ranks(parent)
    global_ranks = [parent_ranks[r] for r in mine]
    name = f"zcomm/{parent.group_name}/{purpose}/{'_'.join(map(str, global_ranks))}"
    return new_named_group(name, global_ranks, like=parent, desc=desc)
