"""Who this process is in the training job: rank, node layout, device.

``bench.dist_env`` recognises the launcher (torchrun, ``python -m bench.simcluster``,
mpirun with MPICH or Open MPI, or none: a single rank) and joins the process group. A node
is ``node_size`` consecutive ranks (``ZCOMM_LOCAL_SIZE`` when set, so one machine can
pretend to be several nodes, else the launcher's local world size), so a rank's position
in its node, which decides who reads the node's wire counters, is ``rank % node_size``.
With CUDA each rank takes the GPU of its launcher-given local rank and NCCL; otherwise gloo.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bench import dist_env


@dataclass(frozen=True, kw_only=True)
class DistContext:
    rank: int
    world_size: int
    ranks_per_node: int
    device: torch.device

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of {self.world_size}")
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(f"{self.ranks_per_node} ranks per node do not divide world of {self.world_size}")

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def node_rank(self) -> int:
        """This rank's position inside its node."""
        return self.rank % self.ranks_per_node


def init_distributed() -> DistContext:
    """Join the process group the launcher describes and say who this rank is."""
    env = dist_env.detect()
    device, _ = dist_env.join(env)
    return DistContext(rank=env.rank, world_size=env.world_size, ranks_per_node=env.node_size, device=device)
