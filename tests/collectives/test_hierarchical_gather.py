"""``zcomm.all_gather_hierarchical``: byte-identical to ``torch.distributed.all_gather_into_tensor``
on 6 gloo ranks laid out as 3 nodes x 2, 2 x 3, 6 x 1 and 1 x 6, and counted with the bytes
each of its hops sends (``N - 1`` inputs across nodes per rank, ``(L - 1) N`` inside)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import zcomm
from spawn_harness import run_distributed

WORLD = 6
LAYOUTS = ((3, 2), (2, 3), (6, 1), (1, 6))  # (nodes, local size)


def _gather_everywhere(rank: int, world: int) -> dict:
    out = {}
    for nodes, local in LAYOUTS:
        topology = zcomm.Topology(world_size=world, local_size=local)
        for dtype, numel in ((torch.uint8, 37), (torch.bfloat16, 1000), (torch.float32, 1)):
            generator = torch.Generator().manual_seed(1000 * rank + numel)
            input = (torch.rand(numel, generator=generator) * 200).to(dtype)
            want = torch.empty(world * numel, dtype=dtype)
            dist.all_gather_into_tensor(want, input)
            got = torch.full_like(want, 7)
            zcomm.reset_comm_stats()
            zcomm.all_gather_hierarchical(got, input, topology=topology)
            stats = zcomm.comm_stats()["all_gather_hierarchical"]
            out[(nodes, local, str(dtype))] = (torch.equal(got, want), stats.calls, stats.intra_bytes,
                                               stats.inter_bytes, numel * input.element_size())
    return out


def test_equals_torch_all_gather_and_counts_each_hop():
    for results in run_distributed(_gather_everywhere, WORLD):
        for (nodes, local, dtype), (equal, calls, intra, inter, chunk) in results.items():
            assert equal, (nodes, local, dtype)
            assert (calls, intra, inter) == (1, (local - 1) * nodes * chunk, (nodes - 1) * chunk), (nodes, local, dtype)
