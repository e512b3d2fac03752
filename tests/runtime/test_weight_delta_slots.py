"""The INT8 values of flagged groups travel in the differences' payload ([Note: fallback slots]
in ``zero_runtime.comm._weight_delta``), on 4 gloo ranks as 2 nodes x 2.

Oracle: each rank's new values. A flagged group must arrive as its INT8 values (within
``absmax(group) / 254`` of them), every other group as the reference plus its difference
(within half the difference's step), on every rank bit for bit the same; one hierarchical
gather while no rank flags more groups than its slots, a second one otherwise.
"""

from __future__ import annotations

import pytest
import torch

from zero_harness import run

WORLD, SIZE = 4, 64


def _gather(rank: int, world: int, counts: tuple[int, ...]) -> dict:
    import torch.distributed as dist

    import zcomm
    from zcomm.quant import QuantSpec
    from zero_runtime._contract import Phase
    from zero_runtime.comm._plain import PlainAllGather
    from zero_runtime.comm._weight_delta import _GROUPS_PER_SLOT, WeightDeltaAllGather

    group, topology = dist.group.WORLD, zcomm.Topology(world_size=world, local_size=2)
    groups = 2 * _GROUPS_PER_SLOT + 3  # two slots per rank; flags of a length that is no multiple of 4
    numel = groups * SIZE
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(world * numel, generator=gen) * 0.02  # the same on every rank
    gather = WeightDeltaAllGather(group, topology, spec=QuantSpec(bits=4, group_size=SIZE),
                                  exact=PlainAllGather(group, topology))
    full = torch.empty(world * numel)
    mine = slice(rank * numel, (rank + 1) * numel)
    gather(full, start[mine].clone(), unit=0, phase=Phase.STEP).wait()  # the first gather is exact
    news = start.view(world, numel) + 1e-4 * torch.randn(world, numel, generator=gen)
    flagged = [torch.randperm(groups, generator=gen)[:count].sort().values for count in counts]
    for r, chosen in enumerate(flagged):
        news[r].view(groups, SIZE)[chosen] += 1.0  # far past an INT4 step of the old values
    zcomm.reset_comm_stats()
    gather(full, news[rank].clone(), unit=0, phase=Phase.STEP).wait()
    calls = zcomm.comm_stats()["all_gather_hierarchical"].calls
    return {"full": full, "news": news, "flagged": flagged, "calls": calls,
            "counts": (gather.delta_groups, gather.fallback_groups), "slots": numel // SIZE // _GROUPS_PER_SLOT}


@pytest.mark.parametrize("counts", [(0, 1, 2, 2), (0, 1, 2, 5)], ids=["within-slots", "past-slots"])
def test_flagged_groups_arrive_as_int8_values(counts):
    results = run(_gather, WORLD, counts, env={"ZCOMM_LOCAL_SIZE": "2"})
    first = results[0]
    assert all(torch.equal(r["full"], first["full"]) for r in results[1:])
    slots = first["slots"]
    assert first["calls"] == (1 if max(counts) <= slots else 2), (first["calls"], counts, slots)
    assert first["counts"][1] == sum(counts)
    news, full = first["news"], first["full"].view(WORLD, -1)
    for r in range(WORLD):
        got, want = full[r].view(-1, SIZE), news[r].view(-1, SIZE)
        flags = torch.zeros(got.shape[0], dtype=torch.bool)
        flags[first["flagged"][r]] = True
        int8_bound = want.abs().amax(dim=1, keepdim=True) / 254 * (1 + 1e-4)
        assert bool(((got - want).abs() <= int8_bound)[flags].all()), r
        # not flagged: within half an INT4 step of the difference, which is below INT8's step
        assert bool(((got - want).abs() <= int8_bound)[~flags].all()), r
