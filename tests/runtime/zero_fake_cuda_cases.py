"""The runtime on fake CUDA tensors and a CUDA-only fake process group (see [Note: fake
CUDA] in ``fake_cuda``); run by ``python tests/fake_cuda.py``, checked by
``test_zero_fake_cuda.py``.

Each case returns what it observed, as JSON: where the runtime's tensors live (device
strings), the device-to-host copies the audit saw, the host reads the runtime made through
``_host_sync.read_flag``, and counters. The rank is rank 0 of a world of 2 (the fake group
moves no data, so values are meaningless and never inspected; only placement, host reads
and control flow are).
"""

from __future__ import annotations

import functools
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist

import zcomm
import zero_runtime
from fake_cuda import FAKE_NCCL, fake_cuda
from zero_workloads import global_batch, local_slice, loss_of, make_model, make_optimizer, optimizer_state_placement

WORLD, RANK = 2, 0  # the fake world the driver starts, and this process's rank in it
CUDA = torch.device("cuda", 0)
# Every parameter of the small models partitioned, one unit per module, freed after each use
# unless the prefetch window covers the next (DeepSpeed's default threshold keeps them all whole).
PARTITIONED = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
               "zcomm_stage3_fuse_numel": 0}
ONE_NODE = zcomm.Topology(world_size=WORLD, local_size=WORLD)
SINGLE = zcomm.Topology(world_size=1, local_size=1)


def _cuda_model(kind: str) -> torch.nn.Module:
    with torch.device(CUDA):
        return make_model(kind)


def _train(kind: str, model, opt, steps: range, *, rank: int = RANK, ranks: int = WORLD,
           accumulation: int = 1) -> None:
    for step in steps:
        mine = local_slice(global_batch(kind, step), rank, ranks)
        for micro in range(accumulation):
            batch = tuple(t.to(CUDA) for t in local_slice(mine, micro, accumulation))
            opt.backward(loss_of(kind, model, batch))
            opt.step()


def _devices(tensors) -> list[str]:
    return sorted({str(t.device) for t in tensors})


def _torch_adamw_state() -> dict[str, list[str]]:
    """The oracle for optimizer state placement: plain torch AdamW, one step, on a CUDA parameter."""
    param = torch.nn.Parameter(torch.zeros(4, device=CUDA))
    param.grad = torch.ones(4, device=CUDA)
    optimizer = make_optimizer()([param])
    optimizer.step()
    return optimizer_state_placement(optimizer)


def _placement(opt) -> dict[str, Any]:
    """Where each kind of runtime tensor lives."""
    units = opt.units
    secondaries = getattr(opt.plan.backward_gather, "_secondaries", {})
    full = opt.full_state_dict()
    return {
        "masters": _devices(u.master for u in units),
        "grad_shards": _devices(u.grad_shard for u in units),
        "full": _devices(u.full for u in units),
        "shards": _devices(u.shard for u in units),
        "full_grads": _devices(u.full_grad for u in units if u.full_grad is not None),
        "parameters": _devices(opt.model.parameters()),
        "secondaries": _devices(s.buffer for s in secondaries.values()),
        "full_state_dict": _devices(full.values()),
        "optimizer": optimizer_state_placement(opt.optimizer),
        "memory_total": opt.memory_report().total,
    }


def _audit(probe: dict[str, Any]) -> dict[str, Any]:
    return {key: list(probe[key]) for key in ("transfers", "host_collectives", "host_reads")}


def _training(kind: str, zero: dict, *, steps: int = 2, precision: str = "bf16", clip: float = 1.0,
              accumulation: int = 1, flags: list[bool] | None = None) -> Callable[[], dict[str, Any]]:
    """A case: ``steps`` optimizer steps of ``kind`` under ``zero`` options on fake CUDA."""

    def case() -> dict[str, Any]:
        config = {"zero_optimization": zero, "gradient_clipping": clip,
                  "gradient_accumulation_steps": accumulation}
        if precision == "bf16":
            config["bf16"] = {"enabled": True}
        if precision == "fp16":
            config["fp16"] = {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}
        with fake_cuda(flags) as probe:
            model, opt = zero_runtime.initialize(_cuda_model(kind), make_optimizer(), config, topology=ONE_NODE)
            log = []
            for step in range(steps):
                _train(kind, model, opt, range(step, step + 1), accumulation=accumulation)
                log.append([opt.last_step_skipped, opt.loss_scale, opt.global_step])
            oracle = _torch_adamw_state()
            return {**_placement(opt), "log": log, "oracle_optimizer": oracle,
                    "prefetches": opt.scheduler.prefetches if opt.scheduler else 0,
                    "fallbacks": getattr(opt.plan.backward_gather, "primary_fallbacks", None),
                    **_audit(probe)}

    return case


def harness_has_teeth() -> dict[str, Any]:
    """The fake machine must reject what a GPU run would: otherwise the other cases prove nothing."""
    caught: dict[str, Any] = {}
    attempts = {
        "mix": lambda: torch.zeros(2) + torch.ones(2, device=CUDA),
        "item": lambda: torch.ones(1, device=CUDA).item(),
        "bool": lambda: bool(torch.ones(1, device=CUDA) > 0),
    }
    with fake_cuda() as probe:
        for name, attempt in attempts.items():
            try:
                attempt()
                caught[name] = None
            except Exception as err:  # the kind differs per layer; the test checks each was caught
                caught[name] = type(err).__name__
        dist.all_reduce(torch.zeros(1))
        dist.all_reduce(torch.zeros(1, device=CUDA))
        torch.ones(2, device=CUDA).cpu()
        return {**caught, **_audit(probe)}


def missing_checkpoint() -> dict[str, Any]:
    """A load that fails validation agrees over the group (a CUDA flag on an NCCL group) and
    raises ``CheckpointError``; this rank's own failure needs no host read."""
    with fake_cuda(flags=[]) as probe:
        model, opt = zero_runtime.initialize(_cuda_model("mlp"), make_optimizer(), {"zero_optimization": {"stage": 2}},
                                             topology=ONE_NODE)
        try:
            opt.load_checkpoint(tempfile.mkdtemp() + "/absent")
            raised = None
        except zero_runtime.CheckpointError as err:
            raised = str(err)
        return {"raised": raised, **_audit(probe)}


def checkpoint_roundtrip() -> dict[str, Any]:
    """Save on CPU/gloo, load into the same model on fake CUDA (a world of 1 on both sides):
    optimizer state must land where torch's own optimizer keeps it (``step`` on the CPU for
    non-fused AdamW), masters on the GPU; a second load that another rank rejected raises.

    No step follows the load here: a loaded ``step`` counter is a fake CPU tensor without a
    value, which torch's AdamW reads on the host (cheaply: it is on the CPU). Training on
    after a load is checked on CPU (``test_zero_runtime``) and on a GPU (``test_zero_cuda``)."""
    cpu_group = dist.new_group([RANK], backend="gloo")
    gpu_group = dist.new_group([RANK], backend=FAKE_NCCL)
    config = {"zero_optimization": {"stage": 2}}
    root = tempfile.mkdtemp()
    model, opt = zero_runtime.initialize(make_model("mlp"), make_optimizer(), config, group=cpu_group,
                                         topology=SINGLE)
    for step in range(2):
        opt.backward(loss_of("mlp", model, global_batch("mlp", step)))
        opt.step()
    opt.save_checkpoint(root)
    with fake_cuda(flags=[False, True]) as probe:
        model, opt = zero_runtime.initialize(_cuda_model("mlp"), make_optimizer(), config, group=gpu_group,
                                             topology=SINGLE)
        _train("mlp", model, opt, range(1), ranks=1)
        fresh = optimizer_state_placement(opt.optimizer)
        opt.load_checkpoint(root)
        loaded = {**_placement(opt), "global_step": opt.global_step}
        try:
            opt.load_checkpoint(root)
            rejected = None
        except zero_runtime.CheckpointError as err:
            rejected = str(err)
        return {"fresh": fresh, "loaded": loaded, "oracle_optimizer": _torch_adamw_state(), "rejected": rejected,
                **_audit(probe)}


def offload_cpu(overlap: bool = False, zero: dict | None = None, topology: zcomm.Topology = ONE_NODE,
                rank: int = RANK, world: int = WORLD) -> dict[str, Any]:
    """``offload_optimizer: cpu`` on a CUDA run: masters and moments on the host, the step on
    the CPU, fed by one device-to-host copy of each unit's gradient shard per step, and the
    updated compute-dtype shards copied back to the GPU. The fused CPU kernel reads its
    tensors' data, which fake tensors do not have, so a stand-in with its signature records
    the devices it is given and writes ``out`` (``test_offload`` checks the kernel's numbers).
    ``overlap``: with ``zcomm_overlap_step``, the copies and updates happen during backward;
    ``zero``: more ``zero_optimization`` options (ZeRO++), for this process as ``rank`` of ``world``
    ranks laid out by ``topology``."""
    from zero_runtime.offload import _optimizer as _offload

    calls = []

    def stand_in(param, grad, exp_avg, exp_avg_sq, *, hyper, step, out=None) -> None:
        calls.append(_devices([param, grad, exp_avg, exp_avg_sq, out]))
        out.copy_(param)

    config = {"zero_optimization": {**PARTITIONED, "stage3_prefetch_bucket_size": 3000, **(zero or {}),
                                    "offload_optimizer": {"device": "cpu", "zcomm_overlap_step": overlap}},
              "bf16": {"enabled": True}}
    kernel, _offload.adam_step = _offload.adam_step, stand_in
    try:
        with fake_cuda() as probe:
            model, opt = zero_runtime.initialize(_cuda_model("gpt"), make_optimizer(), config, topology=topology)
            at_start = list(probe["transfers"])
            _train("gpt", model, opt, range(2), rank=rank, ranks=world)
            report = opt.memory_report()
            return {"units": len(opt.units), "at_start": at_start, "kernel_calls": len(calls),
                    "kernel_devices": sorted({d for call in calls for d in call}),
                    "host_states": _devices(t for state in opt.offload.host for t in state.values()),
                    "compute_copies": _devices(opt.offload.compute_copy),
                    "shards": _devices(u.shard for u in opt.units),
                    "masters": _devices(u.master for u in opt.units),
                    "parameters": _devices(model.parameters()),
                    "full_state_dict": _devices(opt.full_state_dict().values()),
                    "optimizer_states": report.optimizer_states, "offloaded": report.offloaded_optimizer_states,
                    **_audit(probe)}
    finally:
        _offload.adam_step = kernel


def offload_param_cpu() -> dict[str, Any]:
    """``offload_param: cpu`` on a CUDA run: each partitioned unit's shard has its home in host
    memory and no GPU storage between uses; a gather fetches it (host-to-device) and the step's
    new values go home (one device-to-host copy per unit per step); gathers, parameters and the
    optimizer stay on the GPU."""
    config = {"zero_optimization": {**PARTITIONED, "stage3_prefetch_bucket_size": 3000,
                                    "offload_param": {"device": "cpu"}}, "bf16": {"enabled": True}}
    with fake_cuda() as probe:
        model, opt = zero_runtime.initialize(_cuda_model("gpt"), make_optimizer(), config, topology=ONE_NODE)
        at_start = list(probe["transfers"])
        _train("gpt", model, opt, range(2))
        offload = opt.param_offload
        units = [u for u in opt.units if u.partitioned]
        report = opt.memory_report()
        return {"units": len(units), "at_start": at_start,
                "homes": _devices(offload.homes[id(u)].host for u in units),
                "resident_between_steps": sum(offload.is_resident(u) for u in units),
                **_placement(opt), "offloaded_parameters": report.offloaded_parameters, **_audit(probe)}


def partitioned_init() -> dict[str, Any]:
    """A CUDA model built under ``zero_runtime.Init`` (stage 3): its slices, placeholders and
    the gathers of in-place initialization stay on the GPU, and ``initialize`` builds the
    units from them there; then one training step."""
    config = {"zero_optimization": {**PARTITIONED}, "bf16": {"enabled": True}}
    with fake_cuda() as probe:
        with zero_runtime.Init(config, topology=ONE_NODE):
            model = _cuda_model("gpt")
            slices = _devices(p.data for p in model.parameters())
            for param in model.parameters():  # a gathered in-place call, as HF's _init_weights makes
                param.data.mul_(1.0)
        model, opt = zero_runtime.initialize(model, make_optimizer(), config, topology=ONE_NODE)
        _train("gpt", model, opt, range(1))
        return {"slices": slices, **_placement(opt), **_audit(probe)}


def wrong_devices() -> dict[str, Any]:
    """``initialize`` refuses parameters its group cannot reduce, and parameters on two devices."""
    messages = {}
    with fake_cuda():
        mixed = _cuda_model("mlp")
        mixed.layers[0] = torch.nn.Linear(12, 20)
        for name, model in (("cpu_on_nccl", make_model("mlp")), ("mixed", mixed)):
            try:
                zero_runtime.initialize(model, make_optimizer(), {"zero_optimization": {"stage": 2}}, topology=ONE_NODE)
                messages[name] = None
            except ValueError as err:
                messages[name] = str(err)
    return messages


CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "harness_has_teeth": harness_has_teeth,
    "s1-accum-clip": _training("mlp", {"stage": 1, "reduce_bucket_size": 300}, accumulation=2),
    "s2-clip": _training("mlp", {"stage": 2, "reduce_bucket_size": 300}),
    "s2-noclip": _training("mlp", {"stage": 2}, clip=0.0),
    "s3-clip": _training("gpt", {**PARTITIONED, "reduce_bucket_size": 3000, "stage3_prefetch_bucket_size": 3000}),
    "s3-fused-accum": _training("gpt", {"stage": 3, "stage3_param_persistence_threshold": 0,
                                        "zcomm_stage3_fuse_numel": 13_000}, clip=0.0, accumulation=2),
    "s3-hpz-fp32-clip": _training("gpt", {**PARTITIONED, "zero_hpz_partition_size": 2,
                                          "stage3_prefetch_bucket_size": 3000}, precision="fp32"),
    # DeepSpeed's residency defaults, norms and biases persistent (gathered after the step).
    "s3-persistent": _training("gpt", {"stage": 3, "stage3_param_persistence_threshold": 512,
                                       "zcomm_stage3_fuse_numel": 13_000, "reduce_bucket_size": 3000}),
    "s2-fp16-dynamic": _training("mlp", {"stage": 2}, steps=3, precision="fp16", flags=[True, False, True]),
    "s3-fp16-dynamic": _training("gpt", {"stage": 3}, steps=2, precision="fp16", clip=0.0, flags=[True, True]),
    "missing_checkpoint": missing_checkpoint,
    "checkpoint_roundtrip": checkpoint_roundtrip,
    "wrong_devices": wrong_devices,
    "offload_cpu": offload_cpu,
    "offload_cpu_overlap": functools.partial(offload_cpu, overlap=True),
    "offload_param_cpu": offload_param_cpu,
    "partitioned_init": partitioned_init,
}
