"""What the ranks of ``test_fsdp_zeropp.py`` run: FSDP2 training with and without zcomm's collectives.

Every check compares against an independent oracle: plain FSDP2 on the same model, data
and settings (torch's own collectives), the full weights of ``DTensor.full_tensor()``, or
the gradients of an unsharded copy of the model on each rank's batch, with the error
bounds derived in the docstrings below.
"""

from __future__ import annotations

import math
import threading
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

import zcomm
import zcomm.fsdp
from zcomm import _chain_runner, _fsdp_blocks, _fsdp_compat
from zcomm.quant import DEFAULT_GROUP_SIZE

STEPS = 4
LR = 0.05
DIVIDE_FACTOR = 3.0  # set_gradient_divide_factor: neither 1 nor the world size, so PREMUL_SUM(1/3) arrives
# [Note: tracking bound] qwZ moves every weight by at most absmax/254 of its block and qgZ every
# gradient by at most 29/196 of the largest local gradient (see _check_gradients); on this model
# each rank's per-step loss (on its own batch of 8) then differs from plain FSDP2's by about 1%
# for STEPS steps of SGD (measured on 2x2: worst rank 0.55% in fp32 and 1.08% in bf16 with the
# default INT8 first hop, 0.73% in bf16 with an INT4 one, 0.74% with qwZ alone); a wrong scale,
# or a gradient left unreduced, shows up as far more.
LOSS_TRACKING = 0.02


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # odd sizes: FSDP2 pads every parameter's dim 0 to a multiple of the world size
        self.lin1 = nn.Linear(12, 10)
        self.norm = nn.LayerNorm(10)  # weights near 1.0 next to small Linear weights in one flat buffer
        self.lin2 = nn.Linear(10, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.lin2(torch.tanh(self.norm(self.lin1(x))))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 12)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.out = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)


def _loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = _batch(step, rank)
    return (model(x).float() - y).pow(2).mean()


def _units(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _build(mesh, *, bf16: bool, reshard: bool | int, op: str = "avg") -> nn.Module:
    torch.manual_seed(0)
    model = _Net()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for unit in _units(model):
        if op == "sum":  # SUM with a division after the reduce-scatter
            unit.set_force_sum_reduction_for_comms(True)
        elif op == "premul":
            unit.set_gradient_divide_factor(DIVIDE_FACTOR)
    return model


def _train(model: nn.Module, rank: int, steps: int = STEPS) -> tuple[list[float], list[torch.Tensor]]:
    """Losses of ``steps`` SGD steps and the final full parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        loss = _loss(model, step, rank)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, [p.full_tensor() for p in model.parameters()]


def check_exact(rank: int, mesh, topology: zcomm.Topology, cases) -> None:
    """Unquantized zcomm collectives plugged in: training bit-identical to plain FSDP2, traffic counted."""
    for bf16, reshard, op in cases:
        plain = _train(_build(mesh, bf16=bf16, reshard=reshard, op=op), rank)
        model = _build(mesh, bf16=bf16, reshard=reshard, op=op)
        # a second call replaces the first's collectives (here: quantized by unquantized)
        zcomm.fsdp.enable_zeropp(model, topology=topology)
        zcomm.fsdp.enable_zeropp(model, quantized_weights=False, quantized_gradients=False, topology=topology)
        zcomm.reset_comm_stats()
        ours = _train(model, rank)
        stats = zcomm.comm_stats()
        case = (bf16, reshard, op)
        assert ours[0] == plain[0], (case, ours[0], plain[0])
        assert all(torch.equal(a, b) for a, b in zip(ours[1], plain[1], strict=True)), case
        assert stats["all_gather_into_tensor"].calls > 0 and stats["reduce_scatter_tensor"].calls == 3 * STEPS, stats
        assert "all_gather_q8" not in stats and "reduce_scatter_q4" not in stats, stats


def _reference_grad_absmax(rank: int) -> float:
    """Oracle for the gradients' size: the largest local gradient element of any rank, from an
    unsharded copy of the model (same initial weights) on that rank's first batch."""
    torch.manual_seed(0)
    ref = _Net()
    _loss(ref, 0, rank).backward()
    local = torch.tensor([max(p.grad.abs().max().item() for p in ref.parameters())])
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return local.item()


def check_gradients(rank: int, mesh, topology: zcomm.Topology) -> None:
    """qgZ inside FSDP2, fp32, every op FSDP2 uses: reduced gradients within the derived bound of plain FSDP2's.

    Bound: with ``G`` the largest local gradient element of any rank, each of the ``W``
    inputs' INT4 rounding moves the sum by at most half a scale, ``G / 7 / 2``; a node's
    partial sum of ``L`` dequantized inputs is at most ``L * G * 15/14``, and its INT4
    rounding moves it by at most ``L * G * 15/196``; over ``N`` nodes the sum is thus off
    by at most ``W * G * (1/14 + 15/196) = W * G * 29/196``, then scaled as the op says
    (AVG, and SUM with FSDP2's division after it: 1/W; PREMUL_SUM(1/f): 1/f). fp32
    rounding of plain and quantized sums adds ``~W * 2**-23 * G``, covered by 1e-5 * G.
    gloo has no PREMUL_SUM (plain FSDP2 fails there after ``set_gradient_divide_factor``),
    so the reference for it is plain FSDP2's AVG times ``W / f``.
    """
    world = topology.world_size
    bound_g = _reference_grad_absmax(rank) * world * 29 / 196
    for op, scale in (("avg", 1 / world), ("sum", 1 / world), ("premul", 1 / DIVIDE_FACTOR)):
        grads = []
        for quantized in (False, True):
            # gloo has no PREMUL_SUM: the plain reference is AVG, rescaled to the op's scale
            model = _build(mesh, bf16=False, reshard=True, op=op if quantized else "avg")
            if quantized:
                zcomm.fsdp.enable_zeropp(model, quantized_weights=False, topology=topology)
            zcomm.reset_comm_stats()
            _loss(model, 0, rank).backward()
            rescale = 1.0 if quantized else scale * world
            grads.append([p.grad.full_tensor() * rescale for p in model.parameters()])
        assert zcomm.comm_stats()["reduce_scatter_q4"].calls == 3, zcomm.comm_stats()
        bound = bound_g * scale + 1e-5 * bound_g
        err = max((q - p).abs().max().item() for p, q in zip(*grads, strict=True))
        assert err <= bound, (op, err, bound)
        assert err > 0, op  # the gradients did go through INT4


def _weight_bound(full: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Per element: ``absmax / 254`` of the unit's flat buffer (every INT8 block's half-scale is at most
    that), plus for bf16 half a bf16 ulp of the result."""
    absmax = max(w.to(dtype).abs().max().item() for w in full)
    slack = 0.0 if dtype == torch.float32 else 2.0**-8
    return [absmax / 254 + slack * (w.abs() + absmax / 254) for w in full]


def _check_unsharded(unit: nn.Module, params: list[nn.Parameter], full: list[torch.Tensor], dtype) -> None:
    names = [n for n, _ in unit.named_parameters()]
    for (name, expected), bound in zip(zip(names, full, strict=True), _weight_bound(full, dtype), strict=True):
        got = unit.get_parameter(name).detach()
        assert got.dtype == dtype, (name, got.dtype)
        err = (got.float() - expected.to(dtype).float()).abs()
        assert bool((err <= bound).all()), (name, err.max().item())


def check_weights(rank: int, mesh, topology: zcomm.Topology) -> None:
    """qwZ inside FSDP2: unsharded weights within half an INT8 scale of the true ones (fp32, bf16);
    with hpZ (``reshard_after_forward=local size``) the backward gathers stay unquantized."""
    for bf16 in (False, True):
        dtype = torch.bfloat16 if bf16 else torch.float32
        model = _build(mesh, bf16=bf16, reshard=topology.local_size)
        zcomm.fsdp.enable_zeropp(model, quantized_gradients=False, topology=topology)
        block = model.blocks[0]
        own = list(block.parameters())
        full = [p.full_tensor() for p in own]
        zcomm.reset_comm_stats()
        block.unshard()
        _check_unsharded(block, own, full, dtype)
        block.reshard()
        assert zcomm.comm_stats()["all_gather_q8"].calls == 1
        zcomm.reset_comm_stats()
        _loss(model, 0, rank).backward()
        stats = zcomm.comm_stats()
        # forward: root and both blocks through qwZ; backward: the blocks again from their node-local copy
        assert stats["all_gather_q8"].calls == 3 and stats["all_gather_into_tensor"].calls == 2, stats


def check_async_unshard(rank: int, mesh, topology: zcomm.Topology) -> None:
    """``unshard(async_op=True)`` returns before the gather ran; its ``wait()`` must complete zcomm's
    chain. The gather worker is held (for 0.5 s by a timer, as the real ``wait()`` blocks this
    thread), so a ``wait()`` that does not wait leaves the output unwritten; the same check with
    HandleWork.wait as a no-op must fail, which shows it can. In that case the worker is released
    only after the check, so no delay of this rank can let the chain finish first."""
    model = _build(mesh, bf16=False, reshard=True)
    zcomm.fsdp.enable_zeropp(model, topology=topology)
    _train(model, rank, steps=1)
    block = model.blocks[1]
    group = next(iter(block.parameters())).device_mesh.get_group()
    for no_op_wait in (False, True):
        with torch.no_grad():  # the stale contents of any earlier buffer are now wrong by ~1
            for p in block.parameters():
                p.to_local().add_(1.0)
        full = [p.full_tensor() for p in block.parameters()]
        release = threading.Event()
        worker = _chain_runner._ordered_worker(group, topology, "gather")
        worker.submit(release.wait)
        if not no_op_wait:
            threading.Timer(0.5, release.set).start()
        real_wait = _fsdp_compat.HandleWork.wait
        if no_op_wait:
            _fsdp_compat.HandleWork.wait = lambda self, timeout=None: True
        try:
            block.unshard(async_op=True).wait()
            try:
                _check_unsharded(block, list(block.parameters()), full, torch.float32)
                waited = True
            except AssertionError:
                waited = False
        finally:
            _fsdp_compat.HandleWork.wait = real_wait
        release.set()
        worker.submit(lambda: None).result()  # the worker runs in order: the abandoned chain is done
        assert waited != no_op_wait, no_op_wait
        block.reshard()


def check_tracking(rank: int, mesh, topology: zcomm.Topology) -> None:
    """Full ZeRO++ (qwZ + hpZ + qgZ) tracks plain FSDP2 within LOSS_TRACKING per step, fp32 and bf16."""
    for bf16 in (False, True):
        plain, _ = _train(_build(mesh, bf16=bf16, reshard=topology.local_size), rank)
        model = _build(mesh, bf16=bf16, reshard=topology.local_size)
        zcomm.fsdp.enable_zeropp(model, topology=topology)
        ours, _ = _train(model, rank)
        worst = max(abs(a - b) / abs(b) for a, b in zip(ours, plain, strict=True))
        assert worst <= LOSS_TRACKING, (bf16, worst, ours, plain)
        assert ours != plain  # quantized, not passed through


class _Mixed(nn.Module):
    """A unit whose all-gather inputs have two dtypes: FSDP2 gathers them as one uint8 buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.frozen = nn.Parameter(torch.linspace(-1, 1, 6, dtype=torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x + self.frozen.float())


def _sharded(model: nn.Module, mesh, topology: zcomm.Topology, zeropp: bool) -> nn.Module:
    """``model`` under fully_shard, with zcomm's comms installed when ``zeropp``, counters reset."""
    fully_shard(model, mesh=mesh)
    if zeropp:
        zcomm.fsdp.enable_zeropp(model, topology=topology)
    zcomm.reset_comm_stats()
    return model


def check_uint8_fallback(rank: int, mesh, topology: zcomm.Topology) -> None:
    """The mixed-dtype gather runs unquantized (exact), counted, with one warning for the module."""
    results = []
    for zeropp in (False, True):
        torch.manual_seed(0)
        model = _sharded(_Mixed(), mesh, topology, zeropp)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            outputs = []
            for step in range(2):  # forward and backward: the root reshards after backward, gathers again
                outputs.append(model(_batch(step, rank)[0]))
                outputs[-1].sum().backward()
        results.append([out.detach() for out in outputs])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    fallback = [w for w in caught if "uint8" in str(w.message)]
    assert len(fallback) == 1 and issubclass(fallback[0].category, RuntimeWarning), [str(w.message) for w in caught]
    stats = zcomm.comm_stats()
    assert stats["all_gather_into_tensor"].calls == 2 and "all_gather_q8" not in stats, stats


def check_fp64_fallback(rank: int, mesh, topology: zcomm.Topology) -> None:
    """fp64 has no quantized form: both collectives run unquantized (exact), counted, warned once each."""
    results = []
    for zeropp in (False, True):
        torch.manual_seed(0)
        model = _sharded(nn.Linear(6, 3).double(), mesh, topology, zeropp)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(2):
                model(_batch(step, rank)[0].double()).sum().backward()
        results.append([p.grad.full_tensor() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    fallback = sorted(str(w.message).split(" of module")[0] for w in caught if "torch.float64" in str(w.message))
    assert fallback == ["zcomm.fsdp: gradient reduce-scatter", "zcomm.fsdp: weight all-gather"], fallback
    stats = zcomm.comm_stats()
    assert stats["all_gather_into_tensor"].calls == 2 and stats["reduce_scatter_tensor"].calls == 2, stats
    assert "all_gather_q8" not in stats and "reduce_scatter_q4" not in stats, stats


class _Wide(nn.Module):
    """One FSDP2 unit whose row aligns cheaply on 4 and on 6 ranks (multiples of 256 but for
    the biases and the LayerNorm, which FSDP2 packs between the Linear weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(64, 960)
        self.norm = nn.LayerNorm(960)
        self.lin2 = nn.Linear(960, 96)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(nn.functional.gelu(self.norm(self.lin1(x))))


# FSDP2's order of _Wide's parameters, and the magnitudes of check_aligned_error's gradients:
# Linear weights near 0.02, biases near 0.01, the LayerNorm's weight near 1.0.
_WIDE_MAGNITUDES = (0.02, 0.01, 1.0, 0.05, 0.02, 0.01)


def _expected_row(world: int) -> tuple[list[int], list[int], int]:
    """Oracle for the aligned row of _Wide (from the shapes, not from FSDP2's state): each
    parameter's padded shard (dim 0 rounded up to the world size), the offsets of the pieces
    at multiples of the group size, and the row's length."""
    group_size = math.lcm(DEFAULT_GROUP_SIZE[8], DEFAULT_GROUP_SIZE[4])
    numels = [-(-p.shape[0] // world) * math.prod(p.shape[1:]) for p in _Wide().parameters()]
    offsets, end = [], 0
    for n in numels:
        end = -(-end // group_size) * group_size
        offsets.append(end)
        end += n
    return numels, offsets, -(-end // group_size) * group_size


def _train_wide(model: nn.Module, rank: int, steps: int = 2) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 64, generator=gen), torch.randn(8, 96, generator=gen)
    losses = []
    for _ in range(steps):
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _wide_unit(mesh) -> nn.Module:
    torch.manual_seed(0)
    model = _Wide()
    fully_shard(model, mesh=mesh)
    return model


def check_aligned_layout(rank: int, mesh, topology: zcomm.Topology) -> None:
    """Inside FSDP2 (forward, backward, optimizer step), qwZ and qgZ of an aligned unit get rows
    in which every parameter starts at a multiple of the group size, zero-padded: no group of
    the collectives holds two parameters; the staged all-gather input is this rank's shards;
    the result tracks plain FSDP2, with no warning. With a frozen parameter the reduce-scatter
    buffer is not the one the layout was derived for: it runs quantized, packed, warned once."""
    world, group_size = topology.world_size, DEFAULT_GROUP_SIZE[4]
    numels, offsets, row = _expected_row(world)
    assert (row - sum(numels)) <= sum(numels) / 32, "the test's unit must be cheap to align"
    owner = torch.full((row,), -1)
    for index, (offset, n) in enumerate(zip(offsets, numels, strict=True)):
        owner[offset : offset + n] = index
    assert all(len(set(owner[s : s + group_size].tolist()) - {-1}) <= 1 for s in range(0, row, group_size))
    seen: dict[str, list[torch.Tensor]] = {"gather": [], "reduce": []}
    real_gather, real_reduce = zcomm.fsdp.prepare_all_gather_q8, zcomm.fsdp.prepare_reduce_scatter_q4_coalesced

    def gather(*args, **kwargs):  # the comm's prepared calls, recording what each call reads
        prepared = real_gather(*args, **kwargs)

        def call(output, input, **call_kwargs):
            seen["gather"].append(input.detach().clone())
            return prepared(output, input, **call_kwargs)

        return call

    def reduce(*args, **kwargs):
        prepared = real_reduce(*args, **kwargs)

        def call(outputs, inputs, **call_kwargs):
            seen["reduce"].append(inputs[0].detach().clone())
            return prepared(outputs, inputs, **call_kwargs)

        return call

    losses = []
    for zeropp in (False, True):
        model = _wide_unit(mesh)
        shards = [p.to_local().detach().reshape(-1).clone() for p in model.parameters()]
        if zeropp:
            zcomm.fsdp.enable_zeropp(model, topology=topology)
            zcomm.fsdp.prepare_all_gather_q8, zcomm.fsdp.prepare_reduce_scatter_q4_coalesced = gather, reduce
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                losses.append(_train_wide(model, rank))
        finally:
            zcomm.fsdp.prepare_all_gather_q8, zcomm.fsdp.prepare_reduce_scatter_q4_coalesced = real_gather, real_reduce
    assert not [w for w in caught if "zcomm" in str(w.message)], [str(w.message) for w in caught]
    assert len(seen["gather"]) == 2 and len(seen["reduce"]) == 2, {k: len(v) for k, v in seen.items()}
    staged = seen["gather"][0]
    assert staged.numel() == row, (staged.numel(), row)
    for offset, shard in zip(offsets, shards, strict=True):
        assert torch.equal(staged[offset : offset + shard.numel()], shard)
    for rows in (staged.view(1, row), seen["reduce"][0].view(world, row)):
        assert bool((rows[:, owner < 0] == 0).all())
    assert all(abs(a - b) <= LOSS_TRACKING * abs(b) for a, b in zip(losses[1], losses[0], strict=True)), losses
    # a frozen parameter leaves FSDP2's reduce-scatter buffer: that one runs packed, and says so once
    model = _wide_unit(mesh)
    model.lin2.bias.requires_grad_(False)
    zcomm.fsdp.enable_zeropp(model, topology=topology)
    zcomm.reset_comm_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train_wide(model, rank)
    unaligned = [str(w.message) for w in caught if "may span two parameters" in str(w.message)]
    assert len(unaligned) == 1 and "gradient reduce-scatter" in unaligned[0], unaligned
    assert zcomm.comm_stats()["reduce_scatter_q4"].calls == 2, zcomm.comm_stats()


def check_aligned_error(rank: int, mesh, topology: zcomm.Topology) -> None:
    """qgZ's per-parameter INT4 error on a LayerNorm-next-to-Linear unit, through enable_zeropp's
    reduce-scatter comm with the layout of a real FSDP2 unit (which enable_zeropp aligns):
    aligned, every parameter's reduced gradient is within the bound of its own size; packed, the
    Linear bias that shares a block with the LayerNorm weight breaks it.

    Oracle: every rank builds every rank's reduce-scatter input (per-parameter magnitudes
    _WIDE_MAGNITUDES, seeded by rank) and averages them in fp64. Bound per parameter (AVG), as
    in check_gradients but with ``G_p`` the largest element of parameter ``p`` in any input:
    ``G_p * 29/196``, plus fp32 rounding (1e-5 * G_p).
    """
    world = topology.world_size
    numels = list(_fsdp_compat.shard_numels(_wide_unit(mesh)))
    assert numels == _expected_row(world)[0], numels

    def rank_input(source: int) -> list[torch.Tensor]:  # per parameter: (world rows, numel) of one rank
        gen = torch.Generator().manual_seed(100 + source)
        return [torch.randn(world, n, generator=gen) * m for n, m in zip(numels, _WIDE_MAGNITUDES, strict=True)]

    inputs = [rank_input(source) for source in range(world)]
    expected = [sum(inp[p][rank].double() for inp in inputs) / world for p in range(len(numels))]
    bounds = [max(inp[p].abs().max().item() for inp in inputs) * (29 / 196 + 1e-5) for p in range(len(numels))]
    own = torch.cat(inputs[rank], dim=1).reshape(-1)
    errors = {}
    unit = _wide_unit(mesh)
    assert list(zcomm.fsdp.enable_zeropp(unit, quantized_weights=False, topology=topology).values()) == [True]
    topologies = zcomm.fsdp._GroupTopologies(mesh.get_group(), topology)
    for align in (True, False):
        layout = _fsdp_blocks.aligned_layout(numels, align=DEFAULT_GROUP_SIZE[4]) if align else None
        comm = zcomm.fsdp.ZeroppReduceScatter(topologies, quantized=True, group_size=None, module_name="_Wide",
                                              layout=layout)  # fmt: skip
        out = torch.empty(sum(numels))
        comm(output_tensor=out, input_tensor=own.clone(), group=mesh.get_group(), op=dist.ReduceOp.AVG)
        errors[align] = [(got.double() - exp).abs().max().item()
                         for got, exp in zip(out.split(numels), expected, strict=True)]
    assert all(e <= b for e, b in zip(errors[True], bounds, strict=True)), (errors[True], bounds)
    assert errors[False][1] > bounds[1], (errors[False], bounds)  # the Linear bias beside the LayerNorm weight


def check_qgz_options(rank: int, mesh, topology: zcomm.Topology) -> None:
    """``enable_zeropp``'s qgZ options reach every unit's reduce-scatter in a real backward:
    ``first_hop_bits`` (8 unless given) and ``hadamard_block``, given to the comm's prepared
    call and recorded on every call FSDP2 makes through it (the real collective runs), on the
    packed and the aligned path."""
    real, seen = zcomm.fsdp.prepare_reduce_scatter_q4_coalesced, []

    def recording(*args, **kwargs):
        prepared, options = real(*args, **kwargs), (kwargs["first_hop_bits"], kwargs["hadamard_block"])

        def call(*call_args, **call_kwargs):
            seen.append(options)
            return prepared(*call_args, **call_kwargs)

        return call

    zcomm.fsdp.prepare_reduce_scatter_q4_coalesced = recording
    try:
        for options, expected in (({}, (8, None)), ({"first_hop_bits": 4}, (4, None)),
                                  ({"hadamard_block": 16, "align_blocks": False}, (8, 16))):  # fmt: skip
            model = _build(mesh, bf16=False, reshard=True)
            zcomm.fsdp.enable_zeropp(model, quantized_weights=False, topology=topology, **options)
            seen.clear()
            _loss(model, 0, rank).backward()
            assert seen == [expected] * len(_units(model)), (options, seen)
    finally:
        zcomm.fsdp.prepare_reduce_scatter_q4_coalesced = real


def check_hsdp_rejected(rank: int, topology: zcomm.Topology) -> None:
    mesh = init_device_mesh("cpu", (topology.num_nodes, topology.local_size), mesh_dim_names=("replicate", "shard"))
    model = nn.Linear(4, 4)
    fully_shard(model, mesh=mesh)
    try:
        zcomm.fsdp.enable_zeropp(model, topology=topology)
    except ValueError as exc:
        assert "HSDP" in str(exc), exc
    else:
        raise AssertionError("enable_zeropp accepted an HSDP module")


def rank_main(rank: int, world: int, local_size: int, checks: tuple[str, ...]) -> list[str]:
    torch.set_num_threads(1)
    topology = zcomm.Topology(world_size=world, local_size=local_size)
    mesh = init_device_mesh("cpu", (world,))
    done = []
    for name in checks:
        if name == "exact":
            cases = [(False, True, "avg"), (True, local_size, "avg"), (False, local_size, "sum"), (True, True, "sum")]
            check_exact(rank, mesh, topology, cases)
        elif name == "hsdp":
            check_hsdp_rejected(rank, topology)
        else:
            globals()[f"check_{name}"](rank, mesh, topology)
        done.append(name)
    return done
