"""The torch.distributed entry points zcomm relies on, in one place across torch versions.

torch 2.13 renamed the flat collectives (``all_gather_into_tensor`` ->
``all_gather_single``, ``reduce_scatter_tensor`` -> ``reduce_scatter_single``, the old
names warn); zcomm calls whichever exists.

[Note: creating zcomm's groups] zcomm's private subgroups (:mod:`zcomm._groups`) are
created by the members of the caller's group only: zcomm's collectives are collective over
that group, and the rest of the world never calls them. How, depends on the parent group:

* *split*: when the world has a bound device (``init_process_group(device_id=...)``) and
  the parent's backend for that device is NCCL, torch creates every new NCCL group by
  ``ncclCommSplit`` of the *default* group, which every rank of the world must join, so a
  group created on members only would hang. :func:`split_subgroups` uses the public
  ``torch.distributed.split_group`` instead, which splits the *parent* group: collective
  over the parent, every member passing the same partition of it.
* *members only*: otherwise (gloo; NCCL without a bound device, whose communicators are
  set up through the store when first used), :func:`new_named_group` creates this rank's
  block under a name all its members agree on, through ``_new_process_group_helper``,
  torch's internal helper behind ``new_group``. No public API does this: ``new_group``
  needs every rank of the world, and with ``use_local_synchronization=True`` it names the
  group after the number of groups each process has created so far, which differ between
  ranks once they used zcomm on different subgroups; ``split_group`` needs a bound
  accelerator. The helper has had this signature since torch 2.4;
  ``tests/collectives/test_torch_compat.py`` pins what zcomm relies on.

[Note: split after a re-initialised world] ``ProcessGroupNCCL::split`` (behind
``split_group``) takes the parent's global ranks from ``groupRanks()``, which treats a
backend as the world's only when its process-wide construction counter (``uid``) is 0;
for any other backend it reads ``global_ranks_in_group``, which torch leaves empty for the
default group. After ``destroy_process_group()`` and a second ``init_process_group(...,
device_id=...)`` the new world's NCCL backend has ``uid`` >= 1, so splitting the world
indexes an empty vector and the process dies with SIGSEGV, on every rank, with nothing
in the Python traceback (seen on torch 2.11 on an H200; the same C++ is in 2.13). That
``split`` came with torch's C++ ``splitGroup`` (torch 2.9); before it, ``split_group``
computed the global ranks in Python, so :data:`SPLIT_CRASH_SINCE` is 2.9. The upstream
fix drops the ``uid == 0`` test (pytorch's "Fix ProcessGroupNCCL::split OOB when the world
PG is not the first NCCL PG"); no torch release known here carries it, so
:data:`SPLIT_AFTER_REINIT_FIXED_IN` is None: every version from 2.9 on is affected.
:func:`split_subgroups` refuses such a split with a ``RuntimeError`` naming the reason,
before any rank enters ``split_group``: every rank of a world that was re-initialised
the same way sees the same ``uid`` and raises alike. Splitting a non-default group is
unaffected (its ranks are recorded), as is a world whose NCCL backend is the process's
first.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.distributed.constants import default_pg_timeout

# The torch releases whose ProcessGroupNCCL.split crashes on a world backend that is not the
# process's first: from SPLIT_CRASH_SINCE up to, not including, SPLIT_AFTER_REINIT_FIXED_IN
# (None: no release known to carry the fix). [Note: split after a re-initialised world]
SPLIT_CRASH_SINCE: tuple[int, int] = (2, 9)
SPLIT_AFTER_REINIT_FIXED_IN: tuple[int, int] | None = None

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# tensor_use_count(t): how many C++ references hold ``t``'s TensorImpl (its Python object counts
# one), which a gloo Work holding ``t`` raises; how a chain knows gloo has let go of its hop tensors
# ([Note: hop release] in zcomm._hop_release). torch has only the private ``Tensor._use_count``;
# tests/collectives/test_torch_compat.py pins what zcomm relies on.
tensor_use_count = torch.Tensor._use_count


def group_timeout(group: dist.ProcessGroup) -> timedelta:
    """The timeout ``group``'s backend was created with (torch's default for a backend without
    options, such as the fake backend of torch's tests, which never waits)."""
    options = group._get_backend(group._device_types[0]).options
    return default_pg_timeout if options is None else options._timeout


def creates_by_split(parent: dist.ProcessGroup) -> bool:
    """Whether torch would create a new group of ``parent``'s backend by splitting the default NCCL group.

    That is: the default group is bound to a device and ``parent``'s backend for that
    device type is NCCL ([Note: creating zcomm's groups]).
    """
    device = dist.group.WORLD.bound_device_id
    if device is None:
        return False
    backends = dict(entry.split(":", 1) for entry in dist.get_backend_config(parent).split(","))
    return backends.get(device.type) == dist.Backend.NCCL


def split_subgroups(parent: dist.ProcessGroup, blocks: Sequence[Sequence[int]], *, desc: str) -> dist.ProcessGroup:
    """This rank's block of the partition ``blocks`` (group ranks of ``parent``), split from ``parent``.

    Every member of ``parent`` must call this with the same ``blocks``, and every member
    must be in one block.
    """
    split_group = getattr(dist, "split_group", None)
    if split_group is None:
        raise RuntimeError(
            f"torch {torch.__version__} has no torch.distributed.split_group, which zcomm needs to create its "
            "subgroups of an NCCL group when init_process_group was given a device_id"
        )
    reason = split_crash_reason(parent)
    if reason is not None:
        raise RuntimeError(reason)
    group = split_group(
        parent_pg=parent, split_ranks=[list(block) for block in blocks], timeout=group_timeout(parent), group_desc=desc
    )
    assert group is not None, "every rank of the parent group is in one block"
    return group


def release_of(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string such as ``2.11.0+cu130`` or ``2.13.0a0+git1234``."""
    major, minor = version.split("+", 1)[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def split_crashes_on(version: str) -> bool:
    """Whether torch ``version`` crashes splitting a re-initialised world ([Note: split after a re-initialised world])."""
    release = release_of(version)
    return release >= SPLIT_CRASH_SINCE and (SPLIT_AFTER_REINIT_FIXED_IN is None or release < SPLIT_AFTER_REINIT_FIXED_IN)


def split_crash_reason(parent: dist.ProcessGroup, version: str = torch.__version__) -> str | None:
    """Why ``split_group(parent)`` would crash this process, or None when it is safe.

    It crashes when ``parent`` is the default group and its NCCL backend for the bound
    device is not the first NCCL backend this process created ([Note: split after a
    re-initialised world]).
    """
    if parent is not c10d._get_default_group() or not split_crashes_on(version):
        return None
    device = parent.bound_device_id
    uid = getattr(parent._get_backend(device), "uid", 0) if device is not None else 0
    if not uid:
        return None
    return (
        f"zcomm cannot create its subgroups of this NCCL world: it was initialised with device_id after an earlier "
        f"world was destroyed in this process (its NCCL backend has uid {uid}, not 0), and torch {version}'s "
        "ProcessGroupNCCL.split then reads the world's ranks from an empty list and kills the process with a "
        "segmentation fault. Create the world once per process (or pass zcomm a subgroup of it, or initialise "
        "without device_id, under which zcomm creates its groups without split_group)."
    )


def is_registered(group: dist.ProcessGroup) -> bool:
    """Whether torch still holds ``group``: it does from its creation until it is destroyed
    (alone, or with the world by ``destroy_process_group()``)."""
    return group in c10d._world.pg_map


def new_named_group(name: str, global_ranks: list[int], *, like: dist.ProcessGroup, desc: str) -> dist.ProcessGroup:
    """Create the group of ``global_ranks`` (this rank among them) named ``name``, with ``like``'s backend and timeout.

    Only the members call this, and they must agree on ``name``.
    """
    pg, _ = c10d._new_process_group_helper(
        len(global_ranks),
        global_ranks.index(dist.get_rank()),
        global_ranks,
        dist.Backend(dist.get_backend(like)),
        c10d._get_default_store(),
        name,
        timeout=group_timeout(like),
        group_desc=desc,
    )
    # what new_group adds after the helper: the rank mapping get_rank(group) and friends read
    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(global_ranks)}
    return pg


def group_store(group: dist.ProcessGroup) -> dist.Store:
    """The store ``group``'s members met at (torch keeps one per group, under the group's own key
    prefix), for zcomm's once-per-group checks ([Note: device guards] in :mod:`zcomm._device_guard`)."""
    return c10d._world.pg_map[group][1]
