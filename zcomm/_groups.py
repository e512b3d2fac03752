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
old ones is found again, and the entries go away with the old group objects. torch holds
every group it created until that group is destroyed (``destroy_process_group(sub)``, or
``destroy_process_group()`` for all of them), whoever else dropped it, and a live group
keeps its connections and, for gloo, its threads. So once the caller's group is collected
(destroyed by the caller, who then dropped it, and held by nothing of zcomm's: [Note: plan
cache lifetime] in :mod:`zcomm._plan_cache`), zcomm destroys the subgroups it created for
it, in the order they were created, skipping those torch destroyed already (all of them
when the whole world was destroyed). That runs where the group's last reference goes: on the
caller's thread at its ``del``, or inside the garbage collector where the group was part of
a reference cycle; destroying a group is local, not collective. An hpZ block from
:func:`consecutive_group` is one of these subgroups: it lives as long as its parent group
(which is why a prepared call holds its group), so a caller that keeps using a block keeps
the parent too.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import torch.distributed as dist

from ._contract import Kind
from ._torch_compat import creates_by_split, is_registered, new_named_group, split_subgroups
from .topology import Topology


class NodeGroups(NamedTuple):
    """This rank's hierarchical-hop subgroups; ``None`` where a hop has a single member (and is skipped)."""

    intra: dist.ProcessGroup | None
    inter: dist.ProcessGroup | None


# caller's group -> (purpose, partition) -> this rank's block of it ([Note: cache lifetime])
_GROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple, dist.ProcessGroup]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


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
    size. Collective over ``group`` the first time (see [Note: group creation order]). The
    block lives as long as ``group``: zcomm destroys it once ``group`` is destroyed and
    collected ([Note: cache lifetime]), so keep ``group`` while using the block.
    """
    group, world_size = _blocks_of(group, size)
    return _subgroup(group, "block", [range(b * size, (b + 1) * size) for b in range(world_size // size)])


def block_peers_group(group: dist.ProcessGroup | None, size: int) -> dist.ProcessGroup:
    """The ranks of ``group`` at this rank's position in every block of ``size`` consecutive
    ranks: ranks ``r`` with ``r % size`` equal to this rank's, in rank order.

    The complement of :func:`consecutive_group`: a block and its peers' groups cross at one
    rank, so a gather over the peers, then one over the block, reaches every rank (hpZ's
    weight-difference refresh, then its secondary gather). Created and cached like it.
    """
    group, world_size = _blocks_of(group, size)
    return _subgroup(group, "block-peers", [range(p, world_size, size) for p in range(size)])


def _blocks_of(group: dist.ProcessGroup | None, size: int) -> tuple[dist.ProcessGroup, int]:
    """``group`` (default: world) and its size, once ``size`` is checked to divide it into blocks."""
    group = group if group is not None else dist.group.WORLD
    world_size = dist.get_world_size(group)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or world_size % size:
        raise ValueError(f"size must be a positive divisor of the group size {world_size}, got {size!r}")
    return group, world_size


def _subgroup(parent: dist.ProcessGroup, purpose: str, partition: Sequence[range]) -> dist.ProcessGroup:
    """This rank's block of ``partition`` (group ranks of ``parent``), created on first use."""
    blocks = tuple(tuple(block) for block in partition)
    cached = _GROUPS.get(parent)
    if cached is None:
        cached = _subgroups_of(parent)
    key = (purpose, blocks)
    if key not in cached:
        cached[key] = _create(parent, purpose, blocks)
    return cached[key]


def _subgroups_of(parent: dist.ProcessGroup) -> dict[tuple, dist.ProcessGroup]:
    """``parent``'s entry of the cache, made with the finalizer that destroys its subgroups once
    ``parent`` is collected ([Note: cache lifetime])."""
    with _LOCK:
        cached = _GROUPS.get(parent)
        if cached is None:
            cached = _GROUPS[parent] = {}
            # not at exit: torch tears its groups down itself, and a live parent's subgroups are in use
            weakref.finalize(parent, _destroy, cached).atexit = False
        return cached


def _destroy(subgroups: dict[tuple, dist.ProcessGroup]) -> None:
    """Destroy the subgroups torch still holds, oldest first; every one is tried, the first error raised."""
    errors = []
    for subgroup in subgroups.values():
        if is_registered(subgroup):
            try:
                dist.destroy_process_group(subgroup)
            except Exception as exc:  # noqa: BLE001 - the others are still destroyed, this one raised below
                errors.append(exc)
    subgroups.clear()
    if errors:
        raise errors[0]


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
