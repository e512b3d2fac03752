"""Which ranks of a process group share a node.

zcomm's hierarchical collectives need to know, for every rank of the group they run on,
its node and its rank inside the node. zcomm assumes the common layout of torchrun and
mpirun: ranks are *node-major* (node ``n`` holds the consecutive ranks ``[n*L, (n+1)*L)``)
and every node runs the same number ``L`` of ranks. A :class:`Topology` is therefore just
``(world_size, local_size)``; anything else is rejected with a ``ValueError`` that says
what was found.

A topology can be given explicitly (``Topology(world_size=8, local_size=4)``), built from
one node id per rank (:meth:`Topology.from_node_ids`), or detected from the environment
(:meth:`Topology.detect`).
"""

from __future__ import annotations

import socket
import weakref
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ._device_guard import object_collective_device
from .quant._env import positive_int_from_env

__all__ = ["LOCAL_SIZE_VARIABLES", "Topology"]

# Environment variables holding the local size (ranks on this node), most specific first:
# zcomm's own override (lets one machine pretend to be several nodes), torchrun,
# Open MPI, MPICH.
LOCAL_SIZE_VARIABLES = ("ZCOMM_LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")

# Host-name exchanges are collective, so their result is cached per process group object,
# weakly: a group destroyed and re-created under the same name is a new object
# ([Note: cache lifetime] in zcomm._groups).
_DETECTED_BY_HOSTNAME: weakref.WeakKeyDictionary[dist.ProcessGroup, "Topology"] = weakref.WeakKeyDictionary()


@dataclass(frozen=True, kw_only=True)
class Topology:
    """``world_size`` ranks in ``world_size // local_size`` nodes of ``local_size`` ranks, node-major."""

    world_size: int
    local_size: int

    def __post_init__(self) -> None:
        for name in ("world_size", "local_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Topology.{name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"Topology.{name} must be >= 1, got {value}")
        if self.world_size % self.local_size:
            raise ValueError(
                f"world size {self.world_size} is not divisible by the local size {self.local_size}: "
                "zcomm needs nodes with equal numbers of ranks"
            )

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_size

    def node_of(self, rank: int) -> int:
        return rank // self.local_size

    def local_rank_of(self, rank: int) -> int:
        return rank % self.local_size

    def same_node(self, rank_a: int, rank_b: int) -> bool:
        return self.node_of(rank_a) == self.node_of(rank_b)

    def node_ranks(self, node: int) -> range:
        """The group ranks of ``node``, in order."""
        return range(node * self.local_size, (node + 1) * self.local_size)

    def local_peers(self, local_rank: int) -> range:
        """The group ranks with local rank ``local_rank``, one per node, in node order."""
        return range(local_rank, self.world_size, self.local_size)

    def of_ranks(self, ranks: Sequence[int]) -> Topology:
        """The topology of the subgroup whose members are ``ranks`` of this group, in the
        subgroup's order (``ValueError`` where they do not form equal, node-major nodes)."""
        return Topology.from_node_ids([self.node_of(rank) for rank in ranks])

    @classmethod
    def from_node_ids(cls, node_ids: Sequence[Hashable]) -> Topology:
        """The topology of ranks whose node is ``node_ids[rank]`` (any hashable labels).

        Raises ``ValueError`` if a node's ranks are not consecutive or nodes differ in size.
        """
        if len(node_ids) == 0:
            raise ValueError("node_ids must name the node of at least one rank")
        runs: list[tuple[Hashable, int]] = []
        for node in node_ids:
            if runs and runs[-1][0] == node:
                runs[-1] = (node, runs[-1][1] + 1)
            elif any(seen == node for seen, _ in runs):
                raise ValueError(
                    f"ranks are not node-major: the ranks of node {node!r} are not consecutive "
                    f"(node of each rank: {list(node_ids)})"
                )
            else:
                runs.append((node, 1))
        sizes = {count for _, count in runs}
        if len(sizes) != 1:
            raise ValueError(
                f"nodes have unequal numbers of ranks: {dict(runs)} (node of each rank: {list(node_ids)})"
            )
        return cls(world_size=len(node_ids), local_size=sizes.pop())

    @classmethod
    def detect(cls, group: dist.ProcessGroup | None = None, *, device: torch.device | None = None) -> Topology:
        """The topology of ``group`` (default: the world) as this launch placed its ranks.

        The first set variable of :data:`LOCAL_SIZE_VARIABLES` gives the *world's* local size
        (ranks per node); a global rank ``g`` is then on node ``g // local_size``, and the
        members of ``group`` are mapped through that. Without any of them, the members
        exchange host names (a collective on ``group``: every member must call this in the
        same order; the result is cached per group). On an NCCL group that exchange runs on
        this rank's GPU: ``device`` (the device of the tensors it serves), else the group's
        bound device, else the current one, and raises ``RuntimeError`` naming the fix when
        two ranks of a host would share a GPU ([Note: device guards] in :mod:`zcomm._device_guard`).
        """
        group = group if group is not None else dist.group.WORLD
        global_ranks = dist.get_process_group_ranks(group)
        found = _local_size_from_env()
        if found is None:
            return _detect_by_hostname(group, device)
        variable, local_size = found
        world_size = dist.get_world_size()
        if world_size % local_size:
            raise ValueError(
                f"world size {world_size} is not divisible by the local size {local_size} read from ${variable}"
            )
        return cls.from_node_ids([g // local_size for g in global_ranks])


def _local_size_from_env() -> tuple[str, int] | None:
    """The first variable of :data:`LOCAL_SIZE_VARIABLES` that is set, and its value."""
    for variable in LOCAL_SIZE_VARIABLES:
        local_size = positive_int_from_env(variable, "ranks per node (the local size)")
        if local_size is not None:
            return variable, local_size
    return None


def _detect_by_hostname(group: dist.ProcessGroup, device: torch.device | None) -> Topology:
    if group not in _DETECTED_BY_HOSTNAME:
        hosts: list[str | None] = [None] * dist.get_world_size(group)
        with object_collective_device(group, device):
            dist.all_gather_object(hosts, socket.gethostname(), group=group)
        _DETECTED_BY_HOSTNAME[group] = Topology.from_node_ids(hosts)
    return _DETECTED_BY_HOSTNAME[group]
