"""The torch.distributed entry points zcomm relies on, in one place across torch versions.

torch 2.13 renamed the flat collectives (``all_gather_into_tensor`` ->
``all_gather_single``, ``reduce_scatter_tensor`` -> ``reduce_scatter_single``, the old
names warn); zcomm calls whichever exists. Creating a subgroup with a name of zcomm's
choosing uses torch's internal helper (see [Note: group names] in :mod:`zcomm.groups`);
it has had this signature since torch 2.4.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_timeout(group: dist.ProcessGroup) -> timedelta:
    """The timeout ``group``'s backend was created with."""
    return group._get_backend(group._device_types[0]).options._timeout


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
    c10d._world.pg_group_ranks[pg] = {g: i for i, g in enumerate(global_ranks)}
    return pg
