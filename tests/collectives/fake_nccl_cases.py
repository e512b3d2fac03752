"""zcomm's quantized collectives, their prepared calls, the DDP hook and ``zcomm.fsdp`` (FSDP2 and
HSDP) on fake CUDA tensors and a CUDA-only fake process group of 4 ranks as 2 nodes x 2 ([Note: fake CUDA] in
``tests/fake_cuda.py``); run by ``python tests/fake_cuda.py SHIM OUT
fake_nccl_cases``, checked by ``test_collectives_fake_nccl.py``.

This process is rank 3 (the second rank of the second node). Each case makes its calls twice
(a second call takes the fast path of a planned or prepared call) and returns the audit
(device-to-host copies, collectives handed host tensors) and the streams, futures and
``record_stream`` calls the code asked for ([Note: fake CUDA streams]). A host read raises on
fake tensors, failing the case where it happens. Values are meaningless and never inspected.
"""

from __future__ import annotations

import functools
from typing import Any, Callable
from unittest import mock

import torch
import torch.distributed as dist

import zcomm
import zcomm.ddp
import zcomm.fsdp
from fake_cuda import fake_cuda
from fake_cuda_streams import stand_in_for_cuda_streams

WORLD, RANK = 4, 3  # the fake world the driver starts, and this process's rank in it
TOPOLOGY = zcomm.Topology(world_size=WORLD, local_size=2)
CUDA = torch.device("cuda", 0)
CALLS = 2
NUMEL = 4 * 3000 + 40  # a shard of 3010: not a multiple of a group or of the stages


def _wait(handle: Any) -> None:
    if handle is not None:
        handle.wait()


def _audit(probe: dict[str, Any]) -> dict[str, list[str]]:
    return {key: sorted(set(probe[key])) for key in ("transfers", "host_collectives", "streams", "collectives")}


def _case(run: Callable[[], None]) -> Callable[[], dict[str, Any]]:
    def case() -> dict[str, Any]:
        with fake_cuda() as probe:
            for _ in range(CALLS):
                run()
            return _audit(probe)

    return case


def _gather(dtype: torch.dtype, async_op: bool, stages: int | None, prepared: bool = False, **options) -> None:
    shard = NUMEL // WORLD
    input = torch.randn(shard, device=CUDA).to(dtype)
    output = torch.empty(shard * WORLD, device=CUDA, dtype=dtype)
    if prepared:
        call = zcomm.prepare_all_gather_q8(output, input, pipeline_stages=stages, topology=TOPOLOGY, **options)
        _wait(call(output, input, async_op=async_op))
    else:
        _wait(zcomm.all_gather_q8(output, input, None, async_op, pipeline_stages=stages, topology=TOPOLOGY, **options))


def _reduce(dtype: torch.dtype, async_op: bool, stages: int | None, op: str = "AVG", coalesced: bool = False,
            prepared: bool = False, feedback: bool = False, **options) -> None:
    numels = (NUMEL, WORLD * 100) if coalesced or prepared else (NUMEL,)
    inputs = [torch.randn(n, device=CUDA).to(dtype) for n in numels]
    outputs = [torch.empty(n // WORLD, device=CUDA, dtype=dtype) for n in numels]
    reduce_op = dist._make_nccl_premul_sum(0.3) if op == "PREMUL_SUM" else getattr(dist.ReduceOp, op)
    options = dict(pipeline_stages=stages, topology=TOPOLOGY, **options)
    error_feedback = _FEEDBACK.setdefault((dtype, coalesced, prepared, stages), zcomm.ErrorFeedback()) if feedback else None
    if prepared:
        call = zcomm.prepare_reduce_scatter_q4_coalesced(outputs, inputs, reduce_op, with_error_feedback=feedback,
                                                         **options)
        _wait(call(outputs, inputs, async_op=async_op, error_feedback=error_feedback))
    elif coalesced:
        _wait(zcomm.reduce_scatter_q4_coalesced(outputs, inputs, reduce_op, None, async_op,
                                                error_feedback=error_feedback, **options))
    else:
        _wait(zcomm.reduce_scatter_q4(outputs[0], inputs[0], reduce_op, None, async_op,
                                      error_feedback=error_feedback, **options))


def _all_reduce(dtype: torch.dtype, async_op: bool, prepared: bool = False, feedback: bool = False, **options) -> None:
    tensor = torch.randn(NUMEL + 3, device=CUDA).to(dtype)
    error_feedback = _FEEDBACK.setdefault((dtype, "all_reduce", prepared), zcomm.ErrorFeedback()) if feedback else None
    if prepared:
        call = zcomm.prepare_all_reduce_q4(tensor, dist.ReduceOp.AVG, topology=TOPOLOGY,
                                           with_error_feedback=feedback, **options)
        _wait(call(tensor, async_op=async_op, error_feedback=error_feedback))
    else:
        _wait(zcomm.all_reduce_q4(tensor, dist.ReduceOp.AVG, None, async_op, topology=TOPOLOGY,
                                  error_feedback=error_feedback, **options))


def _hierarchical(dtype: torch.dtype) -> None:
    input = torch.randn(1000, device=CUDA).to(dtype)
    output = torch.empty(WORLD * 1000, device=CUDA, dtype=dtype)
    zcomm.all_gather_hierarchical(output, input, topology=TOPOLOGY)


class _Bucket:
    """What ``quantized_allreduce_hook`` reads of DDP's ``GradBucket``: its index and flat buffer."""

    def __init__(self, index: int, numel: int) -> None:
        self._index, self._buffer = index, torch.randn(numel, device=CUDA)

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer


def _ddp_hook(state: zcomm.ddp.QuantizedAllReduceState) -> None:
    """One step's two buckets through the hook, as DDP calls it, and DDP's wait on each future."""
    for index, numel in enumerate((NUMEL, 777)):
        future = zcomm.ddp.quantized_allreduce_hook(state, _Bucket(index, numel))
        assert future.wait().device == CUDA


def _fsdp_case(hsdp: bool, **options) -> Callable[[], dict[str, Any]]:
    """Two training steps of a small MLP under ``fully_shard`` with :func:`zcomm.fsdp.enable_zeropp`:
    on the node's shard group (2 ranks), and with ``hsdp`` replicated across the 2 nodes, its
    gradients all-reduced by the adapter's hook. Returns the audit and the calls of each zcomm op."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def case() -> dict[str, Any]:
        with stand_in_for_cuda_streams([]):  # the mesh's metadata and groups are made on the host
            mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("replicate", "shard"))
        zcomm.reset_comm_stats()
        with fake_cuda() as probe:
            with torch.device(CUDA):
                model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 8))
            for layer in (model[0], model[2], model):
                fully_shard(layer, mesh=mesh["shard"], reshard_after_forward=True)
            # one rank per node: given, as detecting it exchanges host names (Python objects)
            replicas = dict(replicate_group=mesh.get_group("replicate"),
                            replicate_topology=zcomm.Topology(world_size=2, local_size=1)) if hsdp else {}
            # its check that the replicas shard alike exchanges Python objects with the peers, which
            # a fake group cannot; the ranks' real groups are checked on the CPU (test_fsdp_hsdp.py)
            with mock.patch.object(zcomm.fsdp, "check_replicate_group", lambda *args: None):
                zcomm.fsdp.enable_zeropp(model, topology=zcomm.Topology(world_size=2, local_size=2), **replicas,
                                         **options)
            for _ in range(2):
                model(torch.randn(4, 64, device=CUDA)).sum().backward()
            return {**_audit(probe), "calls": {op: stats.calls for op, stats in zcomm.comm_stats().items()}}

    return case


# the error feedback of each stream of calls, kept across its calls as a training run keeps it
_FEEDBACK: dict[tuple, zcomm.ErrorFeedback] = {}
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
_p = functools.partial

CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "all_gather_q8 bf16 sync": _case(_p(_gather, BF16, False, 1)),
    "all_gather_q8 fp16 async 4 stages": _case(_p(_gather, FP16, True, 4)),
    "all_gather_q8 fp32 tensor groups": _case(_p(_gather, FP32, False, None, group_size="tensor")),
    "all_gather_q8 bf16 prepared async": _case(_p(_gather, BF16, True, 2, prepared=True)),
    "reduce_scatter_q4 bf16 sync": _case(_p(_reduce, BF16, False, 1)),
    "reduce_scatter_q4 fp32 async 4 stages SUM": _case(_p(_reduce, FP32, True, 4, op="SUM")),
    "reduce_scatter_q4 fp16 PREMUL_SUM int8 hop": _case(_p(_reduce, FP16, False, 2, op="PREMUL_SUM", first_hop_bits=8)),
    "reduce_scatter_q4 bf16 hadamard": _case(_p(_reduce, BF16, True, None, hadamard_block=256)),
    "reduce_scatter_q4 bf16 error feedback": _case(_p(_reduce, BF16, False, 2, feedback=True)),
    "reduce_scatter_q4_coalesced bf16 async": _case(_p(_reduce, BF16, True, 2, coalesced=True)),
    "reduce_scatter_q4_coalesced fp32 prepared feedback": _case(_p(_reduce, FP32, True, 2, prepared=True,
                                                                   feedback=True)),
    "all_reduce_q4 bf16 sync": _case(_p(_all_reduce, BF16, False)),
    "all_reduce_q4 fp16 async int4 gather": _case(_p(_all_reduce, FP16, True, gather_bits=4)),
    "all_reduce_q4 fp32 prepared feedback": _case(_p(_all_reduce, FP32, True, prepared=True, feedback=True)),
    "all_reduce_q4 bf16 prepared hadamard": _case(_p(_all_reduce, BF16, False, prepared=True, hadamard_block=256)),
    "all_gather_hierarchical bf16": _case(_p(_hierarchical, BF16)),
    "ddp hook": _case(_p(_ddp_hook, zcomm.ddp.QuantizedAllReduceState(topology=TOPOLOGY))),
    "fsdp2 zeropp": _fsdp_case(False),
    "hsdp zeropp": _fsdp_case(True, replicate_gather_bits=4),
    "hsdp exact in the node": _fsdp_case(True, quantized_weights=False, quantized_gradients=False),
    "ddp hook int4 gather feedback": _case(_p(_ddp_hook, zcomm.ddp.QuantizedAllReduceState(
        topology=TOPOLOGY, gather_bits=4, error_feedback=True))),
}
