"""``reduce_scatter_q4(first_hop_bits=8)``: the intra-node hop in INT8, the inter-node hop INT4.

The per-element error bound of both widths is checked over every topology, dtype and op in
``test_collectives`` (``collective_checks.cases``). Here, on 4 gloo ranks as 2 nodes x 2 and
on heavy-tailed values, against an fp64 reduction of
plain ``torch.distributed``: the INT8 first hop leaves a smaller error than the INT4 one,
sends exactly the same inter-node bytes and about twice the intra-node bytes; and the
arguments are checked.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import zcomm
from spawn_harness import run_distributed


def _input(rank: int, world: int, m: int) -> torch.Tensor:
    """Heavy-tailed (a normal times a log-normal), as gradients are: group scales vary."""
    generator = torch.Generator().manual_seed(2000 + rank)
    return torch.randn(world * m, generator=generator) * torch.exp(torch.randn(world * m, generator=generator))


def _run(rank: int, world: int) -> dict:
    topology = zcomm.Topology(world_size=world, local_size=2)
    m = 4096
    x = _input(rank, world, m)
    exact = x.double().clone()
    dist.all_reduce(exact)
    exact = exact[rank * m : (rank + 1) * m]
    out = {}
    for bits in (4, 8):
        zcomm.reset_comm_stats()
        result = torch.empty(m)
        zcomm.reduce_scatter_q4(result, x.clone(), topology=topology, first_hop_bits=bits)
        stats = zcomm.comm_stats()["reduce_scatter_q4"]
        out[bits] = {"error": ((result.double() - exact).norm() / exact.norm()).item(),
                     "intra": stats.intra_bytes, "inter": stats.inter_bytes}
    errors = {}
    for bad, kwargs in (("value", {"first_hop_bits": 6}),
                        ("feedback", {"first_hop_bits": 8, "error_feedback": zcomm.ErrorFeedback()})):
        try:
            zcomm.reduce_scatter_q4(torch.empty(m), x.clone(), topology=topology, **kwargs)
            errors[bad] = None
        except ValueError as err:
            errors[bad] = str(err)
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def results():
    return run_distributed(_run, 4, timeout=180)


def test_int8_first_hop_is_more_accurate_at_the_same_inter_node_bytes(results):
    for rank in results:
        int4, int8 = rank[4], rank[8]
        # Hop 2's INT4 error remains and is the larger term (its scales are those of node
        # sums), so the total drops by less than hop 1's share: measured 0.79-0.80x here.
        assert int8["error"] < 0.85 * int4["error"], (int8["error"], int4["error"])
        assert int8["inter"] == int4["inter"] > 0
        assert 1.8 * int4["intra"] < int8["intra"] < 2.1 * int4["intra"]


def test_bad_first_hop_bits_are_refused(results):
    for rank in results:
        assert "first_hop_bits must be 4 or 8" in rank["errors"]["value"]
        assert "cannot be combined with error_feedback" in rank["errors"]["feedback"]
