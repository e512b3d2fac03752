"""Shared pieces of the scale tests: one rank of a large world on torch's fake process group.

Each test plays one rank ``r`` of a ``W``-rank world in this process
(``zero_runtime._torch_compat.init_fake_world``; [Note: fake world] there): the real zcomm and
zero_runtime code runs with the groups, plans and byte counts of that rank of a real job,
and the fake backend completes every collective at once, filling outputs as if every rank
held this rank's input. The expected values below are computed independently of zcomm, from
the wire format's layout and the byte models written in ``zcomm/comm_stats.py``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch.distributed as dist

import zcomm
from zero_runtime._torch_compat import init_fake_world

WORLD_SIZES = (6, 12, 24, 384, 2048, 4096)
LOCAL_SIZES = (1, 2, 8)
# (world, local) of the sizes, plus odd node counts at scale (DeepSpeed #5054)
LAYOUTS = tuple((w, l) for w in WORLD_SIZES for l in LOCAL_SIZES if w % l == 0) + ((2040, 8), (120, 8))
GROUP = 256  # zcomm's default quantization group size for INT8 and INT4


def ranks_to_check(world_size: int) -> tuple[int, ...]:
    """The first rank, a middle one that is not on a node boundary for 8 ranks per node, the last."""
    return tuple(sorted({0, world_size // 2 + 3 if world_size > 8 else world_size // 2, world_size - 1}))


def cases(layouts=LAYOUTS) -> list[tuple[int, int, int]]:
    """(world, local, rank) for every layout and each of its checked ranks."""
    return [(w, l, r) for w, l in layouts for r in ranks_to_check(w)]


def case_id(case: tuple) -> str:
    return "w{}-l{}-r{}".format(*case[:3]) + "".join(f"-{x}" for x in case[3:])


@contextlib.contextmanager
def fake_rank(rank: int, world_size: int) -> Iterator[None]:
    """Rank ``rank`` of a fake ``world_size``-rank world for the block, with fresh comm counters."""
    init_fake_world(rank, world_size)
    zcomm.reset_comm_stats()
    try:
        yield
    finally:
        dist.destroy_process_group()


def payload_bytes(numel: int, bits: int, group: int = GROUP) -> int:
    """The wire format's payload: values (INT4: two per byte), zero padding to 4 bytes, one fp32 scale per group."""
    if numel == 0:
        return 0
    values = numel if bits == 8 else -(-numel // 2)
    return -(-values // 4) * 4 + 4 * math.ceil(numel / group)


def ring_bytes(chunk_bytes: int, rank: int, world_size: int, local_size: int) -> tuple[int, int]:
    """(intra, inter) a ring all-gather / reduce-scatter rank sends: ``W - 1`` chunks to rank ``r + 1``."""
    sent = (world_size - 1) * chunk_bytes
    same = rank // local_size == (rank + 1) % world_size // local_size
    return (sent, 0) if same else (0, sent)


def op_bytes(op: str) -> tuple[int, int, int]:
    """(calls, intra, inter) of ``op`` in ``zcomm.comm_stats()`` (zeros when it never ran)."""
    stats = zcomm.comm_stats().get(op, zcomm.OpStats())
    return stats.calls, stats.intra_bytes, stats.inter_bytes
