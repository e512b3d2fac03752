"""all_gather_q8 dequantizes all W payloads of a chunk with one op call (one kernel launch on CUDA).

The rows arrive ordered [local rank][node] while the output is in rank order [node][local
rank]; the single call must still put every rank's payload in its place. Unpipelined that
is one call per collective; pipelined in ``k`` chunks ([Note: qwZ pipeline]) one call per
chunk (``k``, not one per rank and chunk), so a chunk is dequantized while the next one is
on the wire. Runs on 4 gloo
ranks (CPU: the call count is the same on every backend) with the topologies 1x4, 2x2 and
4x1, counting the ``cpu`` backend's dequantize kernel launches (small or parallel) and comparing the output, bit for bit, with
the payloads gathered by torch in rank order and dequantized by the reference backend.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import zcomm
from spawn_harness import run_distributed

WORLD = 4


def _count_dequantize_calls(rank: int, world: int) -> list[int]:
    from zcomm.quant.backends import cpu

    calls = []
    original = zcomm.quant.dequantize
    def counting(kernel):  # noqa: ANN001, ANN202
        def launch(*args):
            calls.append(1)
            return kernel(*args)

        return launch

    # the collective calls the backend directly, which runs a small dequantize by address, a large one parallel
    cpu._dequantize_kernel = counting(cpu._dequantize_kernel)
    cpu._dequantize_small_kernel = counting(cpu._dequantize_small_kernel)
    per_call = []
    for local_size in (4, 2, 1):
        topology = zcomm.Topology(world_size=world, local_size=local_size)
        gen = torch.Generator().manual_seed(local_size)
        inputs = (torch.randn(world, 1000, generator=gen) * 10).to(torch.bfloat16)
        output = torch.empty(world * 1000, dtype=torch.bfloat16)
        calls.clear()
        zcomm.all_gather_q8(output, inputs[rank].clone(), group_size=64, topology=topology)
        per_call.append(len(calls))
        pipelined = torch.empty_like(output)
        calls.clear()
        zcomm.all_gather_q8(pipelined, inputs[rank].clone(), group_size=64, pipeline_stages=3, topology=topology)
        per_call.append(len(calls))
        assert torch.equal(pipelined, output), local_size
        payload = zcomm.quant.quantize(inputs[rank], 8, 64, backend="reference")
        rows = torch.empty(world, payload.numel(), dtype=torch.uint8)
        dist.all_gather(list(rows.unbind(0)), payload)
        expected = original(rows, 1000, 8, 64, torch.bfloat16, backend="reference")
        assert torch.equal(output, expected), local_size
    return per_call


def test_all_gather_q8_dequantizes_once_per_call_or_once_per_chunk():
    assert run_distributed(_count_dequantize_calls, WORLD) == [[1, 3] * 3] * WORLD
