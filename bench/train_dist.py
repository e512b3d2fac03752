"""Who this process is in the training job: rank, node-local rank, device.

The job is launched by torchrun, by ``python -m bench.simcluster`` (both set RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT) or by anything
else that sets those variables. ``ZCOMM_LOCAL_SIZE`` overrides the ranks per node, as in
the rest of zcomm (e.g. to pretend one machine is several nodes); nodes hold consecutive
ranks, so a rank's position in its node is ``rank % ranks_per_node``. With CUDA each rank
takes GPU ``LOCAL_RANK`` (the launcher's, i.e. physical) and NCCL; otherwise gloo.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

REQUIRED_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True, kw_only=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    ranks_per_node: int
    device: torch.device

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} outside world of {self.world_size}")
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(f"{self.ranks_per_node} ranks per node do not divide world of {self.world_size}")
        if not 0 <= self.local_rank < self.ranks_per_node:
            raise ValueError(f"local rank {self.local_rank} outside a node of {self.ranks_per_node}")

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node


def _int_env(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def init_distributed() -> DistContext:
    """Join the process group from the environment and describe this rank."""
    missing = [name for name in REQUIRED_VARIABLES if name not in os.environ]
    if missing:
        raise ValueError(
            f"missing {missing}: launch with torchrun, python -m bench.simcluster, or set the variables yourself"
        )
    rank, world_size = _int_env("RANK", 0), _int_env("WORLD_SIZE", 1)
    ranks_per_node = _int_env("ZCOMM_LOCAL_SIZE", _int_env("LOCAL_WORLD_SIZE", world_size))
    if torch.cuda.is_available():
        device = torch.device("cuda", _int_env("LOCAL_RANK", rank % torch.cuda.device_count()))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return DistContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=dist.get_rank() % ranks_per_node,
        ranks_per_node=ranks_per_node,
        device=device,
    )
