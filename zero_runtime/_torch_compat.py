"""The private torch APIs zero_runtime relies on, in one place.

[Note: fake world] The dry run (``zero_runtime._dry_run``) runs the real runtime for one rank
of a world of any size in one process, on torch's *fake* process group: a backend that
completes every collective at once without peers, filling outputs as if every rank held this
rank's input (so values stay finite, but are no real job's), and whose subgroups and rank
arithmetic are those of a real world. torch registers the
``"fake"`` backend when ``torch.testing._internal.distributed.fake_pg`` is imported and offers
no public way to reach it; its ``FakeStore`` is the store it is initialised with (torchtitan's
dry runs do the same). ``tests/runtime/test_zero_torch_compat.py`` pins what the dry run relies on:
the import, the backend name, subgroups and the collectives zcomm issues.

"""

from __future__ import annotations

import torch.distributed as dist

FAKE_BACKEND = "fake"


def init_fake_world(rank: int, world_size: int) -> None:
    """``init_process_group`` on torch's fake backend as rank ``rank`` of ``world_size`` ([Note: fake world]).

    Raises ``RuntimeError`` if a process group is already initialised (the dry run owns the
    process's world while it runs) and ``ValueError`` for a rank outside the world.
    """
    if dist.is_initialized():
        raise RuntimeError("a process group is already initialised in this process: the dry run needs its own "
                           "(run it in a fresh process, or destroy_process_group() first)")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the backend

    dist.init_process_group(FAKE_BACKEND, store=FakeStore(), rank=rank, world_size=world_size)
