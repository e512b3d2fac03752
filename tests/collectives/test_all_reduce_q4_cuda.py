"""all_reduce_q4 and the DDP hook on CUDA tensors with NCCL at world size 1 (``make gpu-check``).

One GPU hosts one NCCL rank, so these check the CUDA paths' streams and bytes, not the hops:

* ``all_reduce_q4`` sync and async (its side stream, [Note: all-reduce async]) on CUDA gives
  the bytes of the same call on CPU tensors over a gloo twin of the world;
* the DDP hook on a CUDA module (its side stream and CUDA future) leaves in ``.grad`` what
  ``all_reduce_q4`` of each recorded bucket gives on the CPU twin.

Where CUDA or NCCL is missing the tests skip; with ``ZCOMM_GPU_CHECK=1`` they fail instead.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import zcomm
import zcomm.ddp
from collective_checks import DTYPES, make_inputs

ONE_RANK = zcomm.Topology(world_size=1, local_size=1)


def _require() -> None:
    reason = None
    if not torch.cuda.is_available():
        reason = "no CUDA device (torch.cuda.is_available() is False)"
    elif not dist.is_nccl_available():
        reason = "this torch build has no NCCL"
    if reason is not None:
        if os.environ.get("ZCOMM_GPU_CHECK") == "1":
            pytest.fail(f"ZCOMM_GPU_CHECK=1 but {reason}")
        pytest.skip(reason)


@pytest.fixture
def nccl_and_twin():
    """An unbound one-rank NCCL world on the current GPU and a gloo group of the same rank."""
    _require()
    torch.cuda.set_device(torch.cuda.current_device())
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.new_group(backend="gloo")
    finally:
        dist.destroy_process_group()


def _reduce(x: torch.Tensor, group: dist.ProcessGroup, async_op: bool, **options) -> torch.Tensor:
    tensor = x.clone()
    handle = zcomm.all_reduce_q4(tensor, dist.ReduceOp.AVG, group, async_op, topology=ONE_RANK, **options)
    if async_op:
        handle.wait()
    return tensor


def test_cuda_all_reduce_gives_the_cpu_bytes(nccl_and_twin):
    for index, (dtype, numel) in enumerate(zip(DTYPES * 2, (1, 97, 4099, 3 * 2**20 + 5, 1031, 0), strict=True)):
        options = dict(group_size=32 if index % 2 else None, gather_bits=(8, 4, 8, 4, None, 8)[index],
                       pipeline_stages=1 + index % 3)
        x = make_inputs(60 + index, 1, numel, dtype)[0]
        cpu = _reduce(x, nccl_and_twin, False, **options)
        for async_op in (False, True):
            gpu = _reduce(x.cuda(), dist.group.WORLD, async_op, **options)
            torch.cuda.synchronize()
            assert torch.equal(gpu.cpu().view(torch.uint8), cpu.view(torch.uint8)), (dtype, numel, async_op)


def test_ddp_hook_on_cuda_leaves_the_all_reduce_of_each_bucket(nccl_and_twin):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 8))
    model = DDP(copy.deepcopy(reference).cuda(), device_ids=[torch.cuda.current_device()], bucket_cap_mb=0.5)
    names = {p: name for name, p in model.module.named_parameters()}
    calls: list = []

    def hook(state, bucket):  # unannotated: DDP refuses annotations that are strings
        calls.append((bucket.buffer().clone(), [names[p] for p in bucket.parameters()]))
        return zcomm.ddp.quantized_allreduce_hook(state, bucket)

    model.register_comm_hook(zcomm.ddp.QuantizedAllReduceState(topology=ONE_RANK), hook)
    for step in range(2):  # DDP rebuilds its buckets after the first step
        calls.clear()
        model.zero_grad(set_to_none=True)
        x = torch.randn(32, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        model(x).square().mean().backward()
        grads = {name: p.grad for name, p in model.module.named_parameters()}
        assert calls, step
        for buffer, bucket_names in calls:
            expected = _reduce(buffer.cpu(), nccl_and_twin, False)
            got = torch.cat([grads[name].reshape(-1) for name in bucket_names]).cpu()
            assert torch.equal(got, expected), (step, bucket_names)
