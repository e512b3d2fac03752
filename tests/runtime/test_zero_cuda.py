"""The runtime on CUDA with NCCL, against the same training on CPU with gloo.

Each rank (one per GPU, at most 4; one GPU hosts one NCCL rank, so a single-GPU machine
runs a world of 1) trains the same cases twice from the same initial weights on the same
batches: on the CPU over the gloo world group, and on ``cuda:<rank>`` over an NCCL group of
the same ranks. Stages 1-3 with gradient clipping (fp32), fp16 with dynamic loss scaling
and clipping (one injected overflow), and ZeRO++ (qwZ + qgZ, plus hpZ over pairs of ranks
when there are at least 2) must give the same global-batch losses within the bounds below,
and a checkpoint saved and loaded on CUDA must resume bit-identically with AdamW's ``step``
counters where an optimizer that never saw a checkpoint keeps them.

The comparisons use SGD with momentum, whose update is proportional to the gradient: a
GPU-only bug in scaling (loss scale, clip coefficient, averaging) or a lost or stale
gradient or parameter moves the loss by far more than rounding does. (Adam would hide any
gradient scale.) TF32 and fp16 reduced-precision reductions are turned off so that both
sides round as the precision says.

[Note: CPU/CUDA bounds] Both sides run the same operations in the same precision; they
differ in kernel summation order and in the last ulp of transcendental functions. fp32
(unit roundoff u = 2^-24): dot products here have at most 64 terms, so each layer's output
moves by at most ~64u = 4e-6 relatively; over 4 steps of SGD at lr 0.05 the losses agree to
``FP32_RTOL = 1e-4``. fp16 (u = 2^-11 = 4.9e-4): activations are rounded to fp16 after every
layer, where one side may round up and the other down, a few u per layer on the loss;
``FP16_RTOL = 1e-2`` is ~20u. ZeRO++ quantizes on both sides with the same wire format, but
an element within fp32 rounding of an INT4/INT8 rounding boundary may land on neighbouring
levels: one gradient element then moves by up to absmax/7 (INT4), which changes the loss by
~1e-4 relatively at this size; ``ZEROPP_RTOL = 1e-3``.

Skipped on a machine without CUDA or NCCL, with the reason; with ``ZCOMM_GPU_CHECK=1`` (set
by ``make gpu-check``) the same condition fails instead, since a GPU check that skips its
GPU tests would report success for nothing. ZeRO++ additionally needs zcomm's CUDA kernels
(cupy); the CPU side of it runs zcomm's ``reference`` backend, which defines the wire
format, so that no numba is needed on a GPU machine.
"""

from __future__ import annotations

import contextlib
import functools
import os

import pytest
import torch
import torch.distributed as dist

from zero_harness import run
from zero_workloads import (
    global_batch,
    local_slice,
    loss_of,
    make_model,
    make_optimizer,
    optimizer_state_placement,
    state_dicts_equal,
)

FP32_RTOL, FP16_RTOL, ZEROPP_RTOL = 1e-4, 1e-2, 1e-3
STEPS = 4
INJECT_AT = 2  # fp16: every rank's first-layer gradient is made infinite at this step
SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
GPU_CHECK = os.environ.get("ZCOMM_GPU_CHECK") == "1"


def _unavailable() -> str | None:
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        return f"no CUDA device (torch {torch.__version__}, {build})"
    if not dist.is_nccl_available():
        return f"torch {torch.__version__} was built without NCCL"
    return None


def _zeropp_unavailable() -> str | None:
    from zcomm_cuda import unavailable_reason

    return unavailable_reason()


UNAVAILABLE = _unavailable()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(UNAVAILABLE is not None and not GPU_CHECK,
                                 reason=f"needs a CUDA GPU and NCCL: {UNAVAILABLE}")]


def _cases(world: int, zeropp: bool) -> dict[str, tuple[str, dict, float]]:
    """name -> (model, config, rtol)."""
    clip = {"gradient_clipping": 0.5}
    # Every parameter of these small models partitioned (DeepSpeed's default threshold would
    # keep them all whole) and freed after use unless the prefetch window covers the next.
    partitioned = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                   "zcomm_stage3_fuse_numel": 0}
    cases = {
        "s1-fp32-clip": ("mlp", {"zero_optimization": {"stage": 1}, **clip}, FP32_RTOL),
        "s2-fp32-clip": ("mlp", {"zero_optimization": {"stage": 2, "reduce_bucket_size": 300}, **clip}, FP32_RTOL),
        "s3-fp32-clip": ("gpt", {"zero_optimization": {**partitioned, "reduce_bucket_size": 3000,
                                                       "stage3_prefetch_bucket_size": 3000}, **clip}, FP32_RTOL),
        # DeepSpeed's residency defaults with norms and biases persistent: units kept from
        # forward to backward, gradient buckets reduced during backward on their own group.
        "s3-defaults-fp32": ("gpt", {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 512,
                                                           "zcomm_stage3_fuse_numel": 13_000,
                                                           "reduce_bucket_size": 3000}}, FP32_RTOL),
        "s2-fp16-clip": ("mlp", {"zero_optimization": {"stage": 2}, **clip,
                                 "fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1}}, FP16_RTOL),
    }
    if zeropp:
        options = {"zero_quantized_weights": True, "zero_quantized_gradients": True}
        if world >= 2:
            options["zero_hpz_partition_size"] = 2
        cases["zeropp-fp32"] = ("mlp", {"zero_optimization": {**partitioned, **options}}, ZEROPP_RTOL)
        # weight differences after stage 2's step, and refreshing hpZ's copies in stage 3
        delta = {"zero_quantized_weights": True, "zero_quantized_gradients": True, "zcomm_weight_delta_bits": 4}
        cases["zeropp-s2-delta-fp32"] = ("mlp", {"zero_optimization": {"stage": 2, **delta}}, ZEROPP_RTOL)
        if world >= 2:
            cases["zeropp-s3-delta-fp32"] = ("mlp", {"zero_optimization": {**partitioned, **options, **delta}},
                                             ZEROPP_RTOL)
    return cases


@contextlib.contextmanager
def _quant_backend(name: str | None):
    """zcomm's quantization backend for the block (None: by device)."""
    saved = os.environ.get("ZCOMM_BACKEND")
    if name is not None:
        os.environ["ZCOMM_BACKEND"] = name
    try:
        yield
    finally:
        os.environ.pop("ZCOMM_BACKEND", None)
        if saved is not None:
            os.environ["ZCOMM_BACKEND"] = saved


def _train(kind: str, config: dict, rank: int, world: int, device: torch.device,
           group: dist.ProcessGroup) -> dict:
    """Global-batch losses on one fixed batch (read on the host once, at the end), skipped
    steps and the final loss scale."""
    import zero_runtime

    model = make_model(kind).to(device)
    model, opt = zero_runtime.initialize(model, SGD, config, group=group)
    losses, skipped = [], []
    for step in range(STEPS):
        batch = tuple(t.to(device) for t in local_slice(global_batch(kind, 0), rank, world))
        hook = None
        if "fp16" in config and step == INJECT_AT:
            hook = model.layers[0].weight.register_hook(lambda grad: grad * float("inf"))
        loss = loss_of(kind, model, batch)
        opt.backward(loss)
        opt.step()
        if hook is not None:
            hook.remove()
        losses.append(loss.detach().double())
        skipped.append(opt.last_step_skipped)
    total = torch.stack(losses)
    dist.all_reduce(total, group=group)
    return {"losses": (total / world).tolist(), "skipped": skipped, "scale": opt.loss_scale}


def _checkpoint(rank: int, world: int, device: torch.device, group: dist.ProcessGroup, root: str) -> dict:
    """fp16 stage 2 with AdamW on CUDA: save after 2 steps, go on 2 steps; a fresh run loads
    the checkpoint and does the same 2 steps."""
    import zero_runtime

    config = {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5,
              "fp16": {"enabled": True, "initial_scale_power": 8}}

    def start():
        return zero_runtime.initialize(make_model("mlp").to(device), make_optimizer(), config, group=group)

    def steps(model, opt, span: range) -> list[torch.Tensor]:
        out = []
        for step in span:
            loss = loss_of("mlp", model, tuple(t.to(device) for t in local_slice(global_batch("mlp", step),
                                                                                  rank, world)))
            opt.backward(loss)
            opt.step()
            out.append(loss.detach())
        return out

    model, opt = start()
    steps(model, opt, range(2))
    opt.save_checkpoint(root)
    continued = steps(model, opt, range(2, 4))
    masters = [u.master.detach().clone() for u in opt.units]
    model, resumed_opt = start()
    resumed_opt.load_checkpoint(root)
    loaded = optimizer_state_placement(resumed_opt.optimizer)
    resumed = steps(model, resumed_opt, range(2, 4))
    return {"continued": torch.stack(continued).cpu(), "resumed": torch.stack(resumed).cpu(),
            "same_masters": all(torch.equal(a, u.master) for a, u in zip(masters, resumed_opt.units, strict=True)),
            "never_loaded": optimizer_state_placement(opt.optimizer), "loaded": loaded,
            "resumed_step_tensors": optimizer_state_placement(resumed_opt.optimizer)}


def _offload(rank: int, world: int, device: torch.device, group: dist.ProcessGroup, root: str) -> dict:
    """AdamW (offload needs Adam) with ``offload_optimizer`` and ``offload_param`` on ``device``
    over ``group``: global-batch losses of each config. On CUDA the gradient shards go to pinned
    host buffers and the updated parameters come back, and offloaded parameter shards come to
    the GPU for their gathers; on the CPU only the NVMe files see traffic."""
    import zero_runtime

    partitioned = {"stage": 3, "stage3_param_persistence_threshold": 0, "zcomm_stage3_fuse_numel": 0}
    configs = {
        "cpu-pinned": {"zero_optimization": {**partitioned, "offload_optimizer": {"device": "cpu", "pin_memory": True}}},
        "nvme": {"zero_optimization": {"stage": 2, "sub_group_size": 100,
                                       "offload_optimizer": {"device": "nvme", "nvme_path": root}}},
        "param-cpu-pinned": {"zero_optimization": {**partitioned,
                                                   "offload_param": {"device": "cpu", "pin_memory": True}}},
        "param-nvme-optimizer-cpu": {"zero_optimization": {**partitioned, "offload_optimizer": {"device": "cpu"},
                                                           "offload_param": {"device": "nvme", "nvme_path": root}}},
        # the update during backward, fed by asynchronous copies to pinned buffers
        "cpu-pinned-overlap": {"zero_optimization": {**partitioned, "offload_optimizer": {
            "device": "cpu", "pin_memory": True, "zcomm_overlap_step": True}}},
        "nvme-pinned-overlap": {"zero_optimization": {"stage": 2, "sub_group_size": 100, "offload_optimizer": {
            "device": "nvme", "nvme_path": root, "pin_memory": True, "zcomm_overlap_step": True}}},
    }
    out = {}
    for name, config in configs.items():
        model, opt = zero_runtime.initialize(make_model("mlp").to(device), make_optimizer(), config, group=group)
        losses = []
        for step in range(STEPS):
            batch = tuple(t.to(device) for t in local_slice(global_batch("mlp", step), rank, world))
            loss = loss_of("mlp", model, batch)
            opt.backward(loss)
            opt.step()
            losses.append(loss.detach().double())
        total = torch.stack(losses)
        dist.all_reduce(total, group=group)
        out[name] = (total / world).tolist()
        opt.close()
    return out


def _init_on(rank: int, device: torch.device, group: dist.ProcessGroup) -> dict:
    """A model built under ``zero_runtime.Init`` on ``device`` and one built plainly there, each
    handed to stage 3: their consolidated weights must be bit-identical."""
    import zero_runtime

    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    with torch.device(device):
        plain = make_model("gpt")
        with zero_runtime.Init(config, group=group):
            partitioned = make_model("gpt")
    weights = [zero_runtime.initialize(model, make_optimizer(), config, group=group)[1].full_state_dict()
               for model in (plain, partitioned)]
    return {"same": state_dicts_equal(*weights),
            "devices": sorted({str(t.device) for t in weights[1].values()})}


def _everywhere(rank: int, world: int, zeropp: bool, root: str) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    device = torch.device("cuda", rank)  # no torch.cuda.set_device: the runtime must not need it
    nccl = dist.new_group(backend="nccl")
    out = {}
    for name, (kind, config, _) in _cases(world, zeropp).items():
        with _quant_backend("reference" if name.startswith("zeropp") else None):
            cpu = _train(kind, config, rank, world, torch.device("cpu"), dist.group.WORLD)
        out[name] = {"cpu": cpu, "cuda": _train(kind, config, rank, world, device, nccl)}
    out["checkpoint"] = _checkpoint(rank, world, device, nccl, root)
    out["offload"] = {"cpu": _offload(rank, world, torch.device("cpu"), dist.group.WORLD, root),
                      "cuda": _offload(rank, world, device, nccl, root)}
    out["init"] = _init_on(rank, device, nccl)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[int, bool, list[dict]]:
    if UNAVAILABLE is not None:
        pytest.fail(f"ZCOMM_GPU_CHECK=1, but the runtime's CUDA tests cannot run here: {UNAVAILABLE}")
    world = min(torch.cuda.device_count(), 4)
    zeropp = _zeropp_unavailable() is None
    root = tmp_path_factory.mktemp("cuda_ckpt")
    return world, zeropp, run(_everywhere, world, zeropp, str(root))


@pytest.mark.parametrize("name", ["s1-fp32-clip", "s2-fp32-clip", "s3-fp32-clip", "s3-defaults-fp32", "s2-fp16-clip"])
def test_cuda_nccl_losses_match_cpu_gloo(runs, name):
    world, zeropp, results = runs
    _, _, rtol = _cases(world, zeropp)[name]
    for rank_results in results:
        cpu, cuda = rank_results[name]["cpu"], rank_results[name]["cuda"]
        assert cuda["skipped"] == cpu["skipped"] and cuda["scale"] == cpu["scale"], (cpu, cuda)
        torch.testing.assert_close(torch.tensor(cuda["losses"]), torch.tensor(cpu["losses"]), rtol=rtol, atol=0)
        assert cpu["losses"][-1] < cpu["losses"][0], cpu  # it trains, so the comparison means something


def test_fp16_overflow_is_skipped_on_cuda(runs):
    for rank_results in runs[2]:
        cuda = rank_results["s2-fp16-clip"]["cuda"]
        assert cuda["skipped"] == [step == INJECT_AT for step in range(STEPS)]
        assert cuda["scale"] == 128.0  # 2 ** 8 halved once (hysteresis 1)


def test_zeropp_on_cuda_matches_cpu(runs):
    world, zeropp, results = runs
    if not zeropp:
        reason = f"zcomm's CUDA kernels cannot run here: {_zeropp_unavailable()}"
        if GPU_CHECK:
            pytest.fail(f"ZCOMM_GPU_CHECK=1: {reason}")
        pytest.skip(reason)
    names = [name for name in _cases(world, zeropp) if name.startswith("zeropp")]
    assert "zeropp-s2-delta-fp32" in names
    for rank_results in results:
        for name in names:
            cpu, cuda = rank_results[name]["cpu"], rank_results[name]["cuda"]
            torch.testing.assert_close(torch.tensor(cuda["losses"]), torch.tensor(cpu["losses"]), rtol=ZEROPP_RTOL,
                                       atol=0, msg=name)


def test_checkpoint_resumes_bit_identically_on_cuda(runs):
    for rank, rank_results in enumerate(runs[2]):
        ckpt = rank_results["checkpoint"]
        assert torch.equal(ckpt["resumed"], ckpt["continued"]), ckpt
        assert ckpt["same_masters"]
        # AdamW's state where an optimizer that never saw a checkpoint keeps it: ``step`` on
        # the CPU in fp32 (torch's non-fused Adam reads it on the host every step), moments on the GPU.
        assert ckpt["loaded"] == ckpt["never_loaded"] == ckpt["resumed_step_tensors"]
        assert ckpt["never_loaded"]["step"] == ["cpu/torch.float32"]
        assert ckpt["never_loaded"]["exp_avg"] == [f"cuda:{rank}/torch.float32"]


def test_offloaded_optimizer_on_cuda_matches_cpu(runs):
    """The same CPU Adam step on both sides, fed with gradients that differ by fp32 rounding
    (see [Note: CPU/CUDA bounds]); AdamW moves an element by about ``lr`` whatever its
    gradient's size, so an element whose gradient is within rounding of zero may move either
    way: over 4 steps that changes the loss by far less than ``ZEROPP_RTOL``."""
    for rank_results in runs[2]:
        cpu, cuda = rank_results["offload"]["cpu"], rank_results["offload"]["cuda"]
        for name in ("cpu-pinned", "nvme", "param-cpu-pinned", "param-nvme-optimizer-cpu", "cpu-pinned-overlap",
                     "nvme-pinned-overlap"):
            torch.testing.assert_close(torch.tensor(cuda[name]), torch.tensor(cpu[name]), rtol=ZEROPP_RTOL, atol=0)
            assert cpu[name][-1] < cpu[name][0], (name, cpu[name])


def test_partitioned_init_on_cuda_builds_what_plain_construction_builds(runs):
    for rank, rank_results in enumerate(runs[2]):
        assert rank_results["init"]["same"]
        assert rank_results["init"]["devices"] == [f"cuda:{rank}"]
