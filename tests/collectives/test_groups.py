"""zcomm on a subgroup of the world, its NCCL split path, and a second process group in one process.

One spawn of 5 gloo ranks runs three phases (each checks results against the oracles of
``collective_checks``):

1. *Subgroup of the world*: ranks 1-4 run the collectives on their group (2 nodes x 2)
   and take hpZ blocks of it, while rank 0 runs zcomm alone on a 1-rank group; then all 5
   run them on the world, after the ranks created different numbers of groups.
2. *Split path, emulated*: with a bound NCCL device torch would create zcomm's groups by
   splitting, so ``zcomm._groups`` must call ``torch.distributed.split_group`` over the
   caller's group, on every member, with the same partition. No NCCL here: the test
   stands in for ``split_group`` with a function that is collective over the parent (an
   ``all_gather_object`` of the partition, which times out if a member is missing) and
   records each call; ranks 0-3 use a 4-rank group, rank 4 stays out.
3. *Re-initialization*: ``destroy_process_group``, then ranks 0-2 join a new 3-rank world
   (new store) and use zcomm again; nothing cached for the first world (its groups, its
   detected topology, its workers) may be found again, although torch reuses group names.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from itertools import islice

import pytest
import torch
import torch.distributed as dist

import zcomm
from collective_checks import cases, check_case, check_plain_collectives
from spawn_harness import run_distributed
from zcomm import _groups as groups
from zcomm import _torch_compat as torch_compat
from zcomm.topology import LOCAL_SIZE_VARIABLES

TIMEOUT = timedelta(seconds=60)


def _subgroup_of_the_world(rank: int) -> int:
    sub = dist.new_group([1, 2, 3, 4])  # every rank creates every torch group, in one order
    alone = dist.new_group([0])
    checked = 0
    if rank == 0:
        for case in islice(cases(seed=41), 4):
            check_case(case, alone, zcomm.Topology(world_size=1, local_size=1))
            checked += 1
        assert dist.get_process_group_ranks(zcomm.consecutive_group(alone, 1)) == [0]
    else:
        for case in cases(seed=42):
            check_case(case, sub, zcomm.Topology(world_size=4, local_size=2))
            checked += 1
        block = zcomm.consecutive_group(sub, 2)
        assert dist.get_process_group_ranks(block) == ([1, 2] if rank < 3 else [3, 4])
        check_plain_collectives(block, zcomm.Topology(world_size=2, local_size=2))
    for index, case in enumerate(islice(cases(seed=43), 4)):
        # the world's topology by host-name exchange (all 5 here) on even cases
        check_case(case, dist.group.WORLD, zcomm.Topology(world_size=5, local_size=5), detect=index % 2 == 0)
        checked += 1
    assert dist.get_process_group_ranks(zcomm.consecutive_group(None, 1)) == [rank]
    return checked


def _emulated_split_path(rank: int, calls: list) -> None:
    group = dist.new_group([0, 1, 2, 3])
    if rank == 4:
        return

    def split_group(*, parent_pg, split_ranks, timeout, group_desc):
        members = dist.get_process_group_ranks(parent_pg)
        seen = [None] * len(members)
        dist.all_gather_object(seen, split_ranks, group=parent_pg)  # collective over the parent, like ncclCommSplit
        assert all(other == split_ranks for other in seen), seen
        assert timeout == torch_compat.group_timeout(parent_pg)
        calls.append((members, split_ranks, group_desc))
        mine = next(block for block in split_ranks if dist.get_rank(parent_pg) in block)
        name = f"emulated-split/{parent_pg.group_name}/{group_desc}/{mine}"
        return torch_compat.new_named_group(name, [members[r] for r in mine], like=parent_pg, desc=group_desc)

    saved = (groups.creates_by_split, getattr(dist, "split_group", None))
    groups.creates_by_split, dist.split_group = (lambda parent: True), split_group
    try:
        for case in islice(cases(seed=44), 4):
            check_case(case, group, zcomm.Topology(world_size=4, local_size=2))
        block = zcomm.consecutive_group(group, 2)
        assert dist.get_process_group_ranks(block) == ([0, 1] if rank < 2 else [2, 3])
    finally:
        groups.creates_by_split, dist.split_group = saved


def _reinitialize(rank: int) -> int:
    """Destroy the 5-rank world; ranks 0-2 form a 3-rank world on a new store and use zcomm again."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if rank == 0 else None
    port = [store.port if store is not None else None]
    dist.broadcast_object_list(port, src=0)
    if store is None:
        store = dist.TCPStore("127.0.0.1", port[0], is_master=False, timeout=TIMEOUT)
    # nobody tears the world down while a peer still reads from it
    store.add("destroyed", 1)
    _wait_count(store, "destroyed", 5)
    dist.destroy_process_group()
    if rank >= 3:
        return 0
    dist.init_process_group("gloo", store=dist.PrefixStore("second", store), rank=rank, world_size=3, timeout=TIMEOUT)
    checked = 0
    for index, case in enumerate(islice(cases(seed=45), 6)):
        local = 3 if index % 2 == 0 else 1
        check_case(case, dist.group.WORLD, zcomm.Topology(world_size=3, local_size=local), detect=local == 3)
        checked += 1
    assert dist.get_process_group_ranks(zcomm.consecutive_group(None, 1)) == [rank]
    assert dist.get_process_group_ranks(zcomm.consecutive_group(None, 3)) == [0, 1, 2]
    return checked


def _wait_count(store: dist.TCPStore, key: str, count: int) -> None:
    deadline = time.monotonic() + TIMEOUT.total_seconds()
    while store.add(key, 0) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {store.add(key, 0)} of {count} ranks reached {key!r}")
        time.sleep(0.05)


def _main(rank: int, world: int) -> tuple[int, list, int]:
    for variable in LOCAL_SIZE_VARIABLES:  # detection must exchange host names
        os.environ.pop(variable, None)
    checked = _subgroup_of_the_world(rank)
    calls: list = []
    _emulated_split_path(rank, calls)
    return checked, calls, _reinitialize(rank)


@pytest.mark.slow
def test_subgroup_of_the_world_split_path_and_reinitialization():
    results = run_distributed(_main, 5, timeout=400)
    assert [checked for checked, _, _ in results] == [8, 16, 16, 16, 16]
    expected_calls = [
        # check_case runs reduce_scatter_q4 first: each kind creates its own pair ([Note: kinds])
        ([0, 1, 2, 3], [[0, 1], [2, 3]], "zcomm reduce-intra"),
        ([0, 1, 2, 3], [[0, 2], [1, 3]], "zcomm reduce-inter"),
        ([0, 1, 2, 3], [[0, 1], [2, 3]], "zcomm gather-intra"),
        ([0, 1, 2, 3], [[0, 2], [1, 3]], "zcomm gather-inter"),
        ([0, 1, 2, 3], [[0, 1], [2, 3]], "zcomm block"),
    ]
    assert [calls for _, calls, _ in results] == [expected_calls] * 4 + [[]]
    assert [again for _, _, again in results] == [6, 6, 6, 0, 0]


def test_creates_by_split_only_for_nccl_with_a_bound_device():
    """On gloo the members-only path is taken, bound device or not (no NCCL build here to see True)."""
    results = run_distributed(_creates_by_split_main, 2, timeout=120)
    assert results == [[False, False]] * 2


def _creates_by_split_main(rank: int, world: int) -> list[bool]:
    world_group = dist.group.WORLD
    answers = [torch_compat.creates_by_split(world_group)]
    world_group.bound_device_id = torch.device("cuda", 0)  # as init_process_group(device_id=...) would set it
    try:
        answers.append(torch_compat.creates_by_split(world_group))  # gloo for cuda too: no split
    finally:
        world_group.bound_device_id = None
    return answers
