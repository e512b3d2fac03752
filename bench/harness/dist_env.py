"""Who am I in the job, and how the ranks meet: torchrun, the cluster launcher, or MPI.

Launchers are recognised from their variables (``_LAUNCHERS``), in order: torchrun and
``bench.simcluster`` (with ``MASTER_ADDR``: rendezvous through ``env://``); MPICH or Open MPI,
where rank 0 opens the TCP store on a port the kernel picks and sends its address to the others
through mpi4py (127.0.0.1 when all ranks run on one host); else a single rank. ``local_size``,
the ranks per node as zcomm's topology sees them, is ``ZCOMM_LOCAL_SIZE`` when set (one machine
pretending to be several nodes), else the launcher's local world size. The rank's device and
backend: ``bench/PERFORMANCE.md``, "device and clock".
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
from typing import Mapping

import torch
import torch.distributed as dist

# launcher -> its variables for (rank, world size, local rank, local world size)
_LAUNCHERS = {
    "env": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    "mpich": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE"),
}
TIMEOUT = datetime.timedelta(minutes=10)
DEVICE_CHOICES = ("auto", "cpu", "cuda")
BACKEND_CHOICES = ("auto", "nccl", "gloo")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistEnv:
    """This process's place in the job; ``launcher`` is ``env``, ``mpich``, ``openmpi`` or ``single``."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    local_size: int
    launcher: str

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(f"local rank {self.local_rank} is outside local world size {self.local_world_size}")
        if self.local_size < 1 or self.world_size % self.local_size:
            raise ValueError(f"world size {self.world_size} is not a multiple of the local size {self.local_size} "
                             "(ranks per node)")

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_size

    @property
    def first_in_node(self) -> bool:
        """The first rank of a node (``local_size`` consecutive ranks) reads the node's wire counters."""
        return self.rank % self.local_size == 0


def detect(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read the launcher's variables from ``environ`` (default ``os.environ``)."""
    environ = os.environ if environ is None else environ

    def read(*keys: str) -> int:
        """The first of ``keys`` that is set, as an int."""
        key = next((key for key in keys if key in environ), keys[-1])
        try:
            return int(environ[key])
        except ValueError as exc:
            raise ValueError(f"environment variable {key}={environ[key]!r} is not an integer") from exc

    for launcher, (rank, size, local_rank, local_world) in _LAUNCHERS.items():
        if rank in environ and ("MASTER_ADDR" if launcher == "env" else size) in environ:
            return DistEnv(rank=read(rank), world_size=read(size), local_rank=read(local_rank, rank),
                           local_world_size=read(local_world, size), local_size=read("ZCOMM_LOCAL_SIZE", local_world, size),
                           launcher=launcher)
    local_size = read("ZCOMM_LOCAL_SIZE") if "ZCOMM_LOCAL_SIZE" in environ else 1
    return DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, local_size=local_size, launcher="single")


def _mpi_store(env: DistEnv) -> dist.TCPStore:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    one_host = len(set(comm.allgather(socket.gethostname()))) == 1
    if env.rank == 0:
        host = "127.0.0.1" if one_host else socket.gethostname()
        store = dist.TCPStore(host, 0, env.world_size, True, timeout=TIMEOUT, wait_for_workers=False)
        comm.bcast((host, store.port), root=0)
        return store
    host, port = comm.bcast(None, root=0)
    return dist.TCPStore(host, port, env.world_size, False, timeout=TIMEOUT)


def select_device(env: DistEnv, choice: str = "auto", *, backend: str = "auto",
                  cuda_devices: int | None = None) -> torch.device:
    """``cuda:LOCAL_RANK`` (mod ``cuda_devices``, default the GPUs torch sees) or ``cpu``; nothing falls back."""
    if choice not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {DEVICE_CHOICES}, got {choice!r}")
    count = torch.cuda.device_count() if cuda_devices is None else cuda_devices
    if choice == "cuda" and count == 0:
        raise ValueError("device 'cuda' was asked for, but torch sees no CUDA device")
    if choice == "cpu" or count == 0 or (choice == "auto" and backend == "gloo"):
        return torch.device("cpu")
    return torch.device("cuda", env.local_rank % count)


def select_backend(device: torch.device, choice: str = "auto") -> str:
    if choice not in BACKEND_CHOICES:
        raise ValueError(f"backend must be one of {BACKEND_CHOICES}, got {choice!r}")
    if choice == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if choice == "nccl" and device.type != "cuda":
        raise ValueError(f"backend 'nccl' needs a CUDA device, got {device}")
    return choice


def init_process_group(env: DistEnv, backend: str = "gloo") -> None:
    """Join the default process group as ``env`` describes.

    No ``device_id`` is bound: with a bound device torch creates every later NCCL group by
    splitting the default one, which all ranks of the world must join, while zcomm creates
    its groups on their members only. Callers on CUDA select the device with
    ``torch.cuda.set_device`` before calling this.
    """
    meet = ({"init_method": "env://"} if env.launcher == "env" else
            {"store": dist.HashStore() if env.launcher == "single" else _mpi_store(env)})
    dist.init_process_group(backend, rank=env.rank, world_size=env.world_size, timeout=TIMEOUT, **meet)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistContext:
    """This rank once it has joined the default group: its place in the job, its device, the group's backend."""

    env: DistEnv
    device: torch.device
    backend: str


def join(env: DistEnv, *, device: str = "auto", backend: str = "auto") -> DistContext:
    """Pick this rank's device and backend, make the device current, join the default group."""
    chosen = select_device(env, device, backend=backend)
    name = select_backend(chosen, backend)
    if chosen.type == "cuda":
        torch.cuda.set_device(chosen)
    init_process_group(env, name)
    return DistContext(env=env, device=chosen, backend=name)
