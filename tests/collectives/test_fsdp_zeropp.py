"""zcomm.fsdp: ZeRO++ collectives inside PyTorch FSDP2, on gloo ranks laid out as 2x2 and 3x2 nodes.

The spawned checks live in ``fsdp_cases.py`` (each against plain FSDP2, ``full_tensor()`` or
an unsharded model, with bounds derived there); here also what one process can check: the
errors, the torch contract zcomm's adapter relies on (private module included) and the
``Work`` wrapper.
"""

from __future__ import annotations

import inspect
import os
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

import fsdp_cases
import zcomm
import zcomm.fsdp
import zcomm.quant as quant
import zcomm_cuda
from spawn_harness import run_distributed
from zcomm import _fsdp_blocks, _fsdp_compat
from zero_runtime import _flat_buffer

ALL_CHECKS = (
    "exact", "gradients", "weights", "async_unshard", "tracking", "uint8_fallback", "fp64_fallback", "hsdp",
    "aligned_layout", "aligned_error", "qgz_options",
)  # fmt: skip


@pytest.mark.parametrize(
    ("world", "local_size", "checks"),
    [
        (4, 2, ALL_CHECKS),  # 2 nodes x 2 ranks
        (6, 2, ("exact", "gradients", "weights", "tracking", "aligned_layout", "aligned_error")),  # 3 nodes x 2
    ],
    ids=["2x2", "3x2"],
)
def test_fsdp2_with_zcomm_collectives(world, local_size, checks):
    results = run_distributed(fsdp_cases.rank_main, world, args=(local_size, checks), timeout=900, pg_timeout=300)
    assert results == [list(checks)] * world


def test_torch_contract_the_adapter_relies_on():
    """The private FSDP2 comm API as zcomm.fsdp uses it ([its module docstring] lists what)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    assert _fsdp_compat.torch_problem() is None
    assert _fsdp_compat.AllGather.__module__ == "torch.distributed.fsdp._fully_shard._fsdp_api"
    assert list(inspect.signature(_fsdp_compat.AllGather.__call__).parameters) == [
        "self", "output_tensor", "input_tensor", "group", "async_op",
    ]
    assert list(inspect.signature(_fsdp_compat.ReduceScatter.__call__).parameters) == [
        "self", "output_tensor", "input_tensor", "group", "op", "async_op",
    ]
    assert "allocate" in _fsdp_compat.AllGather.__abstractmethods__
    # FSDP2 waits on the all-gather's result only when it is a Work
    source = inspect.getsource(_fsdp_collectives.foreach_all_gather_copy_out)
    assert "isinstance(all_gather_work, dist.distributed_c10d.Work)" in source
    assert issubclass(_fsdp_compat.HandleWork, dist.distributed_c10d.Work)
    # the flat layouts shard_numels describes: each parameter's padded shard, in fsdp_params order
    gather = inspect.getsource(_fsdp_collectives._get_param_all_gather_inputs)
    assert "fsdp_param._sharded_param_data" in gather
    assert "inp_split_sizes = [t.numel() for t in all_gather_inputs]" in inspect.getsource(
        _fsdp_collectives.foreach_all_gather
    )
    assert "foreach_reduce_scatter_copy_in(unsharded_grads, reduce_scatter_input, world_size)" in inspect.getsource(
        _fsdp_collectives.foreach_reduce
    )


def test_fsdp_state_the_layout_is_read_from(gloo_world):
    """``shard_numels`` reads FSDP2's private state (``_get_fsdp_state()._fsdp_param_group.fsdp_params``
    and each ``padded_sharded_param_size``): on one rank each shard is the whole (unpadded) parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5))
    fully_shard(model[0], mesh=init_device_mesh("cpu", (1,)))
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    assert _fsdp_compat.shard_numels(model[0]) == (30, 5)
    assert _fsdp_compat.shard_numels(model) == (5, 5)
    bare = nn.Sequential(nn.ReLU())
    fully_shard(bare, mesh=init_device_mesh("cpu", (1,)))
    assert _fsdp_compat.shard_numels(bare) == ()


# One rank's row of a unit's flat buffer, LayerNorm next to Linear layers, in FSDP2's order:
# Linear(100, 1000) weight and bias, LayerNorm(1000) weight and bias, Linear(1000, 100) weight and
# bias on 4 ranks (250 and 25 rows of the weights): aligning it to 256 adds 0.8%.
ROW = [250 * 100, 250, 250, 250, 25 * 1000, 25]
ROW_MAGNITUDES = [0.02, 0.01, 1.0, 0.05, 0.02, 0.01]


def _owners(layout: _fsdp_blocks.BlockLayout, stages: int = 1) -> torch.Tensor:
    """Per element of an aligned row, the index of the parameter it holds, -1 for padding."""
    owner = torch.full((layout.row_numel(stages),), -1)
    for index, (offset, n) in enumerate(zip(layout.aligned_offsets, layout.numels, strict=True)):
        owner[offset : offset + n] = index
    return owner


@pytest.mark.parametrize("group_size", [256, 64, 96])
@pytest.mark.parametrize("stages", [1, 3])
def test_aligned_row_never_mixes_parameters(group_size, stages):
    """Every group of ``group_size`` from the start of each of the ``stages`` parts of an aligned
    row holds one parameter (or padding); the staging copies are exact both ways."""
    layout = _fsdp_blocks.BlockLayout(ROW, align=group_size)
    owner = _owners(layout, stages)
    part = owner.numel() // stages
    assert part % group_size == 0
    for start in range(0, owner.numel(), group_size):
        assert len(set(owner[start : start + group_size].tolist()) - {-1}) <= 1, start
    rows = 3
    flat = torch.randn(rows * layout.numel)
    staged = layout.pad(flat, rows=rows, stages=stages)
    assert staged.numel() == rows * layout.row_numel(stages)
    assert torch.equal(staged.view(rows, -1)[:, owner < 0], torch.zeros(rows, int((owner < 0).sum())))
    back = torch.empty_like(flat)
    layout.unpad(staged, back, rows=rows)
    assert torch.equal(back, flat)


def test_packed_row_mixes_parameters():
    """The check above can fail: FSDP2's own (packed) row puts two parameters in one group."""
    owner = torch.cat([torch.full((n,), i) for i, n in enumerate(ROW)])
    assert any(len(set(owner[s : s + 256].tolist())) > 1 for s in range(0, owner.numel(), 256))


def test_a_unit_is_aligned_only_when_it_is_cheap():
    """zero_runtime's rule and budget: aligned when it adds at most 1/32 of the packed elements."""
    assert _fsdp_blocks.ALIGN_BUDGET == _flat_buffer.ALIGN_BUDGET
    layout = _fsdp_blocks.aligned_layout(ROW, align=256)
    assert layout is not None and layout.row_numel() - sum(ROW) <= sum(ROW) / 32
    assert layout.pack_below == 0  # every piece aligned
    assert _fsdp_blocks.aligned_layout([16, 16], align=256) is None  # small pieces only: +700% either way
    assert _fsdp_blocks.aligned_layout(ROW, align=1) is None and _fsdp_blocks.aligned_layout([], align=256) is None


# A pre-LN MLP block of hidden size 64 (MLP 256) on 4 ranks: LayerNorm weight and bias, Linear
# weight and bias, Linear weight and bias. Aligning every piece adds 11%; aligning only the two
# weights and packing the small pieces after them adds nothing.
SMALL_ROW = [16, 16, 4096, 64, 4096, 16]
SMALL_MAGNITUDES = [1.0, 0.05, 0.02, 0.01, 0.02, 0.01]


def test_small_pieces_are_packed_together_when_full_alignment_is_too_dear():
    """[Note: small pieces packed together]: every group holds part of one large piece, or small
    pieces only; large pieces keep FSDP2's order, small ones follow; the staging is exact."""
    assert _fsdp_blocks.BlockLayout(SMALL_ROW, align=256).row_numel() - sum(SMALL_ROW) > sum(SMALL_ROW) / 32
    layout = _fsdp_blocks.aligned_layout(SMALL_ROW, align=256)
    assert layout is not None and layout.pack_below == 256
    assert layout.row_numel() == -(-sum(SMALL_ROW) // 256) * 256
    large = {i for i, n in enumerate(SMALL_ROW) if n >= 256}
    for stages in (1, 2):
        owner = _owners(layout, stages)
        for start in range(0, owner.numel(), 256):
            held = set(owner[start : start + 256].tolist()) - {-1}
            assert len(held) <= 1 or not held & large, (stages, start, held)
    assert [layout.aligned_offsets[i] for i in sorted(large)] == [0, 4096]
    flat = torch.randn(2 * layout.numel)
    back = torch.empty_like(flat)
    layout.unpad(layout.pad(flat, rows=2, stages=2), back, rows=2)
    assert torch.equal(back, flat)


def test_large_parameters_keep_their_own_int4_scale_when_small_ones_are_packed():
    """The real INT4 quantizer on SMALL_ROW: packed as FSDP2 lays it out, the head of the Linear
    weight after the LayerNorm shares the LayerNorm's scale (an error up to 0.07 beside weights
    of about 0.02: 83% of the weight's absmax here); staged, each Linear weight is within half
    a scale of its own absmax (1/14 of it)."""
    torch.manual_seed(0)
    params = [torch.randn(n) * m for n, m in zip(SMALL_ROW, SMALL_MAGNITUDES, strict=True)]

    def roundtrip(row: torch.Tensor) -> torch.Tensor:
        return quant.dequantize(quant.quantize(row, 4, 256, backend="reference"), row.numel(), 4, 256,
                                torch.float32, backend="reference")  # fmt: skip

    def relative(restored: list[torch.Tensor], index: int) -> float:
        return ((restored[index] - params[index]).abs().max() / params[index].abs().max()).item()

    layout = _fsdp_blocks.aligned_layout(SMALL_ROW, align=256)
    restored = torch.empty(layout.numel)
    layout.unpad(roundtrip(layout.pad(torch.cat(params), rows=1)), restored, rows=1)
    staged, packed = restored.split(SMALL_ROW), roundtrip(torch.cat(params)).split(SMALL_ROW)
    for weight in (2, 4):
        assert relative(staged, weight) <= 1 / 14 * (1 + 1e-5), weight
    assert relative(packed, 2) > 0.5  # the first Linear weight's head shares the LayerNorm's scale
    assert _fsdp_blocks.block_align([256, 96]) == 768 and _fsdp_blocks.block_align([]) == 1


@pytest.mark.parametrize("bits", [4, 8])
def test_per_parameter_error_drops_with_aligned_blocks(bits):
    """The real quantizer on a LayerNorm-next-to-Linear row: aligned, every element is within half
    the scale of its own parameter's absmax (``absmax / qmax / 2``), as zero_runtime's aligned
    layout guarantees; packed as FSDP2 lays it out, the small Linear bias next to the LayerNorm
    weight loses most of its precision (worst parameter: error / own absmax)."""
    torch.manual_seed(0)
    params = [torch.randn(n) * m for n, m in zip(ROW, ROW_MAGNITUDES, strict=True)]
    qmax, group_size = quant.QMAX[bits], 256

    def roundtrip(row: torch.Tensor) -> torch.Tensor:
        payload = quant.quantize(row, bits, group_size, backend="reference")
        return quant.dequantize(payload, row.numel(), bits, group_size, torch.float32, backend="reference")

    def worst_relative_error(restored: list[torch.Tensor]) -> float:
        return max(((r - p).abs().max() / p.abs().max()).item() for r, p in zip(restored, params, strict=True))

    packed = roundtrip(torch.cat(params)).split(ROW)
    layout = _fsdp_blocks.BlockLayout(ROW, align=group_size)
    restored = torch.empty(layout.numel)
    layout.unpad(roundtrip(layout.pad(torch.cat(params), rows=1)), restored, rows=1)
    aligned = restored.split(ROW)
    assert worst_relative_error(aligned) <= 1 / qmax / 2 * (1 + 1e-5)
    assert worst_relative_error(packed) > (0.5 if bits == 4 else 1 / qmax)


@pytest.mark.parametrize(
    ("version", "import_error", "match"),
    [
        ("2.10.1+cu128", None, r"torch 2.10.1\+cu128 is not supported by zcomm.fsdp; supported: torch >= 2.11"),
        ("2.12.0", "cannot import name 'AllGather'", "no FSDP2 custom-collective API.*AllGather"),
    ],
)
def test_unsupported_torch_is_named(monkeypatch, gloo_world, version, import_error, match):
    problem = _fsdp_compat.torch_problem(version, import_error)
    assert problem is not None
    monkeypatch.setattr(zcomm.fsdp, "torch_problem", lambda: problem)
    with pytest.raises(ValueError, match=match):
        zcomm.fsdp.enable_zeropp(nn.Linear(2, 2))


def test_supported_torch_versions_pass():
    for version in ("2.11.0+cu130", "2.13.0", "3.0.0"):
        assert _fsdp_compat.torch_problem(version, "") is None


def test_bad_arguments(gloo_world):
    with pytest.raises(ValueError, match="holds no FSDPModule: apply fully_shard before enable_zeropp"):
        zcomm.fsdp.enable_zeropp(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(TypeError, match="module must be a torch.nn.Module"):
        zcomm.fsdp.enable_zeropp(object())
    with pytest.raises(TypeError, match="quantized_weights must be a bool"):
        zcomm.fsdp.enable_zeropp(nn.Linear(2, 2), quantized_weights=1)
    with pytest.raises(ValueError, match="first_hop_bits must be 4 or 8, got 2"):
        zcomm.fsdp.enable_zeropp(nn.Linear(2, 2), first_hop_bits=2)
    with pytest.raises(ValueError, match="hadamard_block must be a power of two >= 2 or None, got 96"):
        zcomm.fsdp.enable_zeropp(nn.Linear(2, 2), hadamard_block=96)
    with pytest.raises(ValueError, match="hadamard_block rotates qgZ's gradients: it needs quantized_gradients"):
        zcomm.fsdp.enable_zeropp(nn.Linear(2, 2), quantized_gradients=False, hadamard_block=64)


def test_hadamard_blocks_join_the_alignment():
    """A Hadamard block larger than the quantization groups sets the alignment, so where alignment
    is chosen no rotation mixes two parameters; without qgZ there is nothing to rotate."""
    assert zcomm.fsdp._block_align(True, True, None, None) == 256
    assert zcomm.fsdp._block_align(True, True, 64, 512) == 512
    assert zcomm.fsdp._block_align(False, True, 128, 64) == 128
    assert zcomm.fsdp._block_align(True, True, "tensor", 512) == 1


def test_handle_work_waits_for_the_chain_once():
    """The Work wraps a zcomm Handle: wait() blocks until the chain's tail ran, exactly once."""
    gate, calls = threading.Event(), []

    def finish():
        gate.wait()
        calls.append(1)

    work = _fsdp_compat.as_work(zcomm.Handle(finish=finish, ready=gate.is_set))
    assert isinstance(work, dist.Work) and not work.is_completed()
    threading.Timer(0.2, gate.set).start()
    assert work.wait() is True
    assert calls == [1] and work.is_completed()
    work.wait()
    assert calls == [1]
    plain = object()
    assert _fsdp_compat.as_work(None) is None and _fsdp_compat.as_work(plain) is plain


def test_premul_sum_is_the_fp32_division_by_its_inverse(gloo_world):
    """reduce_scatter_q4 with PREMUL_SUM(1/3) on one rank: ``fl32(S / fl32(3))``, AVG's bits over 3
    ([Note: PREMUL_SUM as a division]); and PREMUL_SUM(0.3) matches ``S * 0.3`` within 2**-22."""
    x = torch.randn(64, generator=torch.Generator().manual_seed(3))
    for factor in (1 / 3, 0.3):
        out = torch.empty(64)
        zcomm.reduce_scatter_q4(out, x, dist._make_nccl_premul_sum(factor), group_size=2)
        summed = torch.empty(64)
        zcomm.reduce_scatter_q4(summed, x, dist.ReduceOp.SUM, group_size=2)
        if factor == 1 / 3:
            assert torch.equal(out, summed / torch.tensor(3.0))
        else:
            torch.testing.assert_close(out, summed * factor, rtol=2.0**-22, atol=0)


def _require_cuda(backend: str) -> None:
    """Skip (fail under ZCOMM_GPU_CHECK=1) without a CUDA device, NCCL or, for ``cuda``, its backend."""
    reason = None
    if not torch.cuda.is_available():
        reason = "no CUDA device (torch.cuda.is_available() is False)"
    elif not dist.is_nccl_available():
        reason = "this torch build has no NCCL"
    elif backend == "cuda":
        reason = zcomm_cuda.unavailable_reason()
    if reason is not None:
        if os.environ.get("ZCOMM_GPU_CHECK") == "1":
            pytest.fail(f"ZCOMM_GPU_CHECK=1 but {reason}")
        pytest.skip(reason)


@pytest.mark.parametrize("backend", ["cuda", "reference"])
def test_aligned_staging_on_cuda(monkeypatch, backend):
    """enable_zeropp's comms on CUDA tensors (one NCCL rank: FSDP2 itself skips its collectives at
    world size 1, so the comms are called as FSDP2 calls them): issued on a side stream as FSDP2's
    all-gather stream, the in-place gather waited for on the current stream (async: the handle's
    copy out runs there, [Note: staged buffer lifetime]; sync: an event). Aligned, every parameter
    is within its own INT8 (gather) / INT4 (reduce-scatter) half-scale; packed, not."""
    _require_cuda(backend)
    if backend == "reference":
        monkeypatch.setenv("ZCOMM_BACKEND", "reference")
    else:
        monkeypatch.delenv("ZCOMM_BACKEND", raising=False)
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.group.WORLD
        topologies = zcomm.fsdp._GroupTopologies(group, zcomm.Topology(world_size=1, local_size=1))
        gen = torch.Generator().manual_seed(0)
        params = [(torch.randn(n, generator=gen) * m).to(device) for n, m in zip(ROW, ROW_MAGNITUDES, strict=True)]
        flat = torch.cat(params)
        layout = _fsdp_blocks.aligned_layout(ROW, align=256)
        assert layout is not None
        current, side = torch.cuda.current_stream(device), torch.cuda.Stream(device)
        for align, async_op in ((True, False), (True, True), (False, True)):
            kwargs = dict(quantized=True, group_size=None, module_name="row", layout=layout if align else None)
            gathered = torch.full_like(flat, float("nan"))
            reduced = torch.full_like(flat, float("nan"))
            side.wait_stream(current)
            with torch.cuda.stream(side):
                gathered.copy_(flat)  # FSDP2's all-gather is in place: the input is the output's slice
                work = zcomm.fsdp.ZeroppAllGather(topologies, **kwargs)(
                    output_tensor=gathered, input_tensor=gathered.narrow(0, 0, flat.numel()), group=group,
                    async_op=async_op,
                )
                zcomm.fsdp.ZeroppReduceScatter(topologies, **kwargs)(
                    output_tensor=reduced, input_tensor=flat.clone(), group=group, op=dist.ReduceOp.AVG
                )
                done = side.record_event()
            if async_op:
                assert isinstance(work, dist.Work)
                current.wait_event(done)
                work.wait()
            else:
                assert work is None
                current.wait_event(done)
            for result, bits in ((gathered, 8), (reduced, 4)):
                relative = [
                    ((got - p).abs().max() / p.abs().max()).item()
                    for got, p in zip(result.split(ROW), params, strict=True)
                ]
                within = max(relative) <= 1 / quant.QMAX[bits] / 2 * (1 + 1e-4)  # + rounding of a fused kernel
                assert within == align, (align, async_op, bits, relative)
    finally:
        dist.destroy_process_group()
