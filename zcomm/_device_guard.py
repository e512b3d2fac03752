"""Which GPU this rank's NCCL work runs on: found from the tensors or the group, checked once per group.

[Note: device guards] NCCL needs every rank of a communicator on its own GPU. torch's object
collectives and ``barrier`` on an NCCL group stage their bytes on
``torch.cuda.current_device()``, which is ``cuda:0`` on every rank unless the program called
``torch.cuda.set_device``; launchers such as ``srun`` or ``mpirun`` set none of torchrun's
variables, so nothing else does it either, and then every rank of a node joins NCCL on one
GPU: NCCL fails with a duplicate-GPU error or hangs. zcomm therefore

* runs its object collective (the host-name exchange of :meth:`zcomm.Topology.detect`) inside
  ``torch.cuda.device(d)`` for the rank's device ``d``: the collective's tensors' device
  where there are tensors, else the group's bound device (``init_process_group(device_id=)``),
  else the current device (:func:`object_collective_device`);
* before that, once per group, checks through the group's store that no two ranks of one
  host use the same GPU index (:func:`check_distinct_gpus`), and raises a ``RuntimeError``
  naming the fix on every rank of the group alike. The check costs a few store operations
  per rank once per group, never anything per call (the result is cached weakly per group
  object); it runs only where NCCL would run the group's CUDA work.

A GPU index means the same GPU to two ranks of a host only if both see the same devices; a
launcher that gives each rank its own ``CUDA_VISIBLE_DEVICES`` makes every rank's GPU
``cuda:0``, so the store key also holds the GPU's UUID where torch reports one.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import weakref

import torch
import torch.distributed as dist

from ._torch_compat import group_store

# group -> the device its first CUDA collective ran on, once checked ([Note: device guards])
_CHECKED: weakref.WeakKeyDictionary[dist.ProcessGroup, torch.device] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()
_PREFIX = "zcomm/gpu"


def _backends(group: dist.ProcessGroup) -> dict[str, str]:
    """Device type -> the backend that runs its work on ``group`` (``"nccl"`` alone: every device)."""
    parts = [part.split(":") for part in str(dist.get_backend(group)).lower().split(",")]
    return {part[0]: part[-1] for part in parts} if all(len(part) == 2 for part in parts) else {"*": parts[0][-1]}


def _cuda_on_nccl(backends: dict[str, str]) -> bool:
    return backends.get("cuda", backends.get("*")) == "nccl"


def uses_nccl(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` runs its CUDA work on NCCL (torch's ``nccl`` backend by that name; another
    backend, a test's fake one included, is not NCCL)."""
    return _cuda_on_nccl(_backends(group))


def _object_collective_device_needed(group: dist.ProcessGroup) -> bool:
    """Whether torch's object collectives on ``group`` stage their bytes on a GPU (an NCCL-only group)."""
    backends = _backends(group)
    return _cuda_on_nccl(backends) and "cpu" not in backends


def rank_device(group: dist.ProcessGroup, device: torch.device | None = None) -> torch.device:
    """This rank's GPU for ``group``'s work: ``device`` (the tensors'), else the group's bound
    device, else the current device."""
    if device is not None and device.type == "cuda" and device.index is not None:
        return device
    bound = getattr(group, "bound_device_id", None)
    if bound is not None and bound.type == "cuda" and bound.index is not None:
        return bound
    return torch.device("cuda", torch.cuda.current_device())


def check_distinct_gpus(group: dist.ProcessGroup, device: torch.device) -> None:
    """Raise on every rank if two ranks of one host would run ``group``'s NCCL work on one GPU
    (once per group; see [Note: device guards]). Collective over ``group`` the first time."""
    if group in _CHECKED or device.type != "cuda":
        return
    with _LOCK:
        if group in _CHECKED:
            return
        sharing = count_sharing(group_store(group), dist.get_world_size(group), _gpu_key(device)) if uses_nccl(
            group) else 1
        if sharing > 1:
            raise RuntimeError(
                f"zcomm: {sharing} ranks of host {socket.gethostname()} would run NCCL on the same GPU "
                f"({device}, which this rank's tensors or current device name): call "
                "torch.cuda.set_device(local_rank) on every rank before the first collective (or pass "
                "init_process_group(..., device_id=torch.device('cuda', local_rank))), and put each rank's "
                "tensors on its own GPU"
            )
        _CHECKED[group] = device


def count_sharing(store: dist.Store, world_size: int, key: str) -> int:
    """How many of the ``world_size`` ranks meeting at ``store`` registered ``key`` (this rank included).

    Every rank adds itself under its key, then to an arrival count; the last to arrive opens
    the gate every rank waits on, after which the counts are final. A group re-created under
    the same name meets at the same store keys again: each meeting counts under its own
    generation (every ``world_size`` arrivals make one), so earlier meetings are not counted."""
    generation = (store.add(f"{_PREFIX}/arrivals", 1) - 1) // world_size
    base = f"{_PREFIX}/{generation}"
    store.add(f"{base}/{key}", 1)
    if store.add(f"{base}/arrived", 1) == world_size:
        store.set(f"{base}/all", b"1")
    store.wait([f"{base}/all"])
    return store.add(f"{base}/{key}", 0)


def _gpu_key(device: torch.device) -> str:
    """The host and the GPU: its UUID where torch reports one, else its index."""
    # no CUDA runtime here (fake CUDA tensors in the CPU tests): the index alone
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None) if torch.cuda.is_available() else None
    return f"{socket.gethostname()}/{uuid if uuid is not None else device.index}"


def object_collective_device(group: dist.ProcessGroup,
                             device: torch.device | None = None) -> contextlib.AbstractContextManager:
    """A context in which torch's object collectives on ``group`` use this rank's GPU (checked
    once per group); a no-op where they run on the CPU ([Note: device guards])."""
    if not _object_collective_device_needed(group):
        return contextlib.nullcontext()
    mine = rank_device(group, device)
    check_distinct_gpus(group, mine)
    return torch.cuda.device(mine)
