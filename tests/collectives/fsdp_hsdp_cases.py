"""What the ranks of ``test_fsdp_hsdp.py`` run: HSDP with zcomm against FSDP2's own HSDP.

The world is ``N`` nodes of ``L`` ranks, node-major. Plain HSDP shards the model on the
rows of the 2-D mesh ``(replicate=N, shard=L)``; zcomm's HSDP shards it on the same rows
(``mesh["shard"]``, 1-D) and replicates through ``enable_zeropp(replicate_group=
mesh.get_group("replicate"))``. Oracles: plain HSDP on the same model, data and settings,
the fp64 mean of what each unit's hook was given on every replica (with
``collective_oracles.all_reduce_bound``), and, for the division, constant gradients whose
world mean is known in closed form.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import zcomm
import zcomm.fsdp
from collective_oracles import UNIT_ROUNDOFF, all_reduce_volume, ring_volume
from fsdp_cases import LOSS_TRACKING, LR, STEPS, _loss, _Net, _train, _units
from zcomm import _fsdp_compat, _fsdp_hsdp
from zcomm.quant import DEFAULT_GROUP_SIZE

DIVIDE_FACTOR = 3.0


class _Meshes:
    """The 2-D mesh, its shard rows and replicate group, and the topologies of both groups."""

    def __init__(self, nodes: int, local: int) -> None:
        self.mesh = init_device_mesh("cpu", (nodes, local), mesh_dim_names=("replicate", "shard"))
        self.shard = self.mesh["shard"]
        self.replicate = self.mesh.get_group("replicate")
        self.nodes, self.local = nodes, local
        self.shard_topology = zcomm.Topology(world_size=local, local_size=local)  # one node
        self.replicate_topology = zcomm.Topology(world_size=nodes, local_size=1)  # one rank per node

    def zeropp(self, model: nn.Module, **options) -> nn.Module:
        zcomm.fsdp.enable_zeropp(model, replicate_group=self.replicate, topology=self.shard_topology,
                                 replicate_topology=self.replicate_topology, **options)  # fmt: skip
        return model


def _build(mesh, *, bf16: bool) -> nn.Module:
    torch.manual_seed(0)
    model = _Net()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def check_exact(rank: int, meshes: _Meshes) -> None:
    """Nothing quantized: training bit-identical to plain HSDP, fp32 and bf16 parameters; the
    replicate all-reduce counted once per unit and step, across nodes only."""
    for bf16 in (False, True):
        plain = _train(_build(meshes.mesh, bf16=bf16), rank)
        model = meshes.zeropp(_build(meshes.shard, bf16=bf16), quantized_weights=False, quantized_gradients=False,
                              quantized_all_reduce=False)  # fmt: skip
        zcomm.reset_comm_stats()
        ours = _train(model, rank)
        stats = zcomm.comm_stats()
        assert ours[0] == plain[0], (bf16, ours[0], plain[0])
        assert all(torch.equal(a, b) for a, b in zip(ours[1], plain[1], strict=True)), bf16
        units = len(_units(model))
        assert stats["all_reduce"].calls == units * STEPS and stats["all_reduce"].intra_bytes == 0, stats
        assert stats["reduce_scatter_tensor"].calls == units * STEPS, stats
        assert stats["reduce_scatter_tensor"].inter_bytes == 0, stats


def _record_hook_calls(calls: list) -> object:
    """Wrap ReplicateAllReduce.__call__ so that each call that all-reduces appends (hook, what it
    all-reduces, output); the real one returned. What it all-reduces is ``reduce_output``, plus
    the micro-batches accumulated before under ``set_requires_all_reduce(False)``."""
    real = _fsdp_hsdp.ReplicateAllReduce.__call__

    def recording(self, reduce_output):
        reducing = _fsdp_compat.requires_all_reduce(self._unit())
        before = reduce_output.detach().clone() if self.partial is None else reduce_output.detach() + self.partial
        real(self, reduce_output)
        if reducing:
            calls.append((self, before, reduce_output.detach().clone()))

    _fsdp_hsdp.ReplicateAllReduce.__call__ = recording
    return real


def _local_grads(unit: nn.Module) -> list[torch.Tensor]:
    """The unit's own parameters' local gradient shards, flat, in FSDP2's order."""
    params = _fsdp_compat.param_group(unit).fsdp_params
    return [p.sharded_param.grad.to_local().reshape(-1) for p in params]


def _all_reduce_bound(inputs: torch.Tensor, dtype: torch.dtype, exact: torch.Tensor, nodes: int,
                      gather_bits: int = 8) -> torch.Tensor:
    from collective_oracles import all_reduce_bound

    size = DEFAULT_GROUP_SIZE[4]
    assert size == DEFAULT_GROUP_SIZE[8]
    return all_reduce_bound(inputs, nodes=nodes, local=1, stages=1, group_size=size, gather_group_size=size,
                            dtype=dtype, divide_by=nodes, exact=exact, gather_bits=gather_bits)  # fmt: skip


def check_gradients(rank: int, meshes: _Meshes) -> None:
    """The quantized replicate all-reduce alone (weights and reduce-scatter unquantized, so each
    unit's hook input is bit for bit plain HSDP's reduce-scatter output), fp32 and bf16 reduce
    dtype: every hook output within ``all_reduce_bound`` of the fp64 mean over the replicas
    of the hook inputs, and every parameter's ``.grad`` within that bound of plain HSDP's
    (whose gloo all-reduce adds its own rounding: at most ``R`` roundings of partial sums
    in the reduce dtype, ``R * u * sum |x|`` over the ``R`` inputs, then the division). With
    ``replicate_gather_bits=4`` (bf16) the same against the INT4 gather's bound."""
    for bf16, gather_bits in ((False, 8), (True, 8), (True, 4)):
        dtype = torch.bfloat16 if bf16 else torch.float32
        plain = _build(meshes.mesh, bf16=bf16)
        _loss(plain, 0, rank).backward()
        model = meshes.zeropp(_build(meshes.shard, bf16=bf16), quantized_weights=False, quantized_gradients=False,
                              replicate_gather_bits=gather_bits)  # fmt: skip
        hooks = {id(hook): name for name, hook in zcomm.fsdp.all_reduce_hooks(model).items()}
        calls: list = []
        real = _record_hook_calls(calls)
        try:
            _loss(model, 0, rank).backward()
        finally:
            _fsdp_hsdp.ReplicateAllReduce.__call__ = real
        _check_hook_calls(calls, hooks, model, plain, meshes, dtype, gather_bits)


def _check_hook_calls(calls: list, hooks: dict, model: nn.Module, plain: nn.Module, meshes: _Meshes,
                      dtype: torch.dtype, gather_bits: int = 8) -> None:
    """``check_gradients``' oracles on the recorded calls of one backward: one per unit, each
    output within the bound of the fp64 mean of what the replicas all-reduced, each ``.grad``
    within that bound (and plain HSDP's own rounding) of plain HSDP's."""
    nodes = meshes.nodes
    assert sorted(hooks[id(hook)] for hook, _, _ in calls) == sorted(hooks.values()), calls
    units = {name or type(unit).__name__: unit for name, unit in model.named_modules() if unit in _units(model)}
    plain_units = {name or type(unit).__name__: unit for name, unit in plain.named_modules()
                   if unit in _units(plain)}  # fmt: skip
    for hook, given, out in calls:
        assert given.dtype == dtype and out.dtype == dtype, (given.dtype, dtype)
        inputs = [torch.empty_like(given) for _ in range(nodes)]
        dist.all_gather(inputs, given, group=meshes.replicate)
        inputs = torch.stack(inputs).double()
        exact = inputs.mean(0)
        bound = _all_reduce_bound(inputs, dtype, exact, nodes, gather_bits)
        err = (out.double() - exact).abs()
        assert bool((err <= bound).all()), (dtype, (err - bound).max().item())
        assert err.max().item() > 0  # quantized, not passed through
        reference_rounding = nodes * UNIT_ROUNDOFF[dtype] * inputs.abs().sum(0) + UNIT_ROUNDOFF[dtype] * exact.abs()
        # each parameter's local shard is the start of its padded shard in the unit's flat row
        name, offset = hooks[id(hook)], 0
        pieces = zip(_local_grads(units[name]), _local_grads(plain_units[name]),
                     _fsdp_compat.shard_numels(units[name]), strict=True)  # fmt: skip
        for ours, theirs, padded in pieces:
            window = slice(offset, offset + ours.numel())
            limit = bound[window] + reference_rounding[window]
            diff = (ours.double() - theirs.double()).abs()
            assert bool((diff <= limit).all()), (dtype, name, (diff - limit).max().item())
            offset += padded


MICRO_BATCHES = 3


def _accumulate(model: nn.Module, rank: int, step: int, record: list | None = None) -> list[float]:
    """One optimizer step's gradients, left in ``.grad``: ``MICRO_BATCHES`` backwards, all-reduced
    across replicas on the last one only (``set_requires_all_reduce``); their losses. ``record``:
    where the hook calls that all-reduce are recorded (``_record_hook_calls``)."""
    real = _record_hook_calls(record) if record is not None else None
    losses = []
    try:
        for micro in range(MICRO_BATCHES):
            model.set_requires_all_reduce(micro == MICRO_BATCHES - 1)
            loss = _loss(model, step * MICRO_BATCHES + micro, rank)
            loss.backward()
            losses.append(loss.item())
    finally:
        if real is not None:
            _fsdp_hsdp.ReplicateAllReduce.__call__ = real
    return losses


def _accumulated_steps(model: nn.Module, rank: int, steps: int) -> tuple:
    """``steps`` SGD steps over accumulated gradients (``_accumulate``): the losses, every step's
    gradients (full), the final parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, grads = [], []
    for step in range(steps):
        losses += _accumulate(model, rank, step)
        grads.append([p.grad.full_tensor() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return losses, grads, [p.full_tensor() for p in model.parameters()]


def check_accumulation(rank: int, meshes: _Meshes) -> None:
    """``set_requires_all_reduce(False)`` on all micro-batches but the last, as under plain HSDP
    ([Note: accumulation without the all-reduce] in zcomm._fsdp_hsdp). Unquantized, fp32 and
    bf16 parameters: every loss, every step's gradients and the final weights bit-identical to
    plain HSDP's, with one all-reduce per unit and step (and a reduce-scatter per micro-batch),
    no partial sum left behind. The quantized all-reduce alone: one per unit and step, of the
    accumulated sum, within ``check_gradients``' bounds of the fp64 mean of the replicas' sums
    and of plain HSDP's gradients."""
    steps = 2
    for bf16 in (False, True):
        plain = _accumulated_steps(_build(meshes.mesh, bf16=bf16), rank, steps)
        model = meshes.zeropp(_build(meshes.shard, bf16=bf16), quantized_weights=False, quantized_gradients=False,
                              quantized_all_reduce=False)  # fmt: skip
        zcomm.reset_comm_stats()
        ours = _accumulated_steps(model, rank, steps)
        stats = zcomm.comm_stats()
        units = len(_units(model))
        assert stats["all_reduce"].calls == units * steps, stats
        assert stats["reduce_scatter_tensor"].calls == units * steps * MICRO_BATCHES, stats
        assert ours[0] == plain[0], (bf16, ours[0], plain[0])
        for mine, theirs in zip(ours[1], plain[1], strict=True):
            assert all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True)), bf16
        assert all(torch.equal(a, b) for a, b in zip(ours[2], plain[2], strict=True)), bf16
        assert all(hook.partial is None for hook in zcomm.fsdp.all_reduce_hooks(model).values())
    for bf16 in (False, True):
        plain = _build(meshes.mesh, bf16=bf16)
        _accumulate(plain, rank, 0)
        model = meshes.zeropp(_build(meshes.shard, bf16=bf16), quantized_weights=False, quantized_gradients=False)
        hooks = {id(hook): name for name, hook in zcomm.fsdp.all_reduce_hooks(model).items()}
        calls: list = []
        zcomm.reset_comm_stats()
        _accumulate(model, rank, 0, record=calls)
        assert zcomm.comm_stats()["reduce_scatter_q4"].calls == len(hooks), zcomm.comm_stats()
        _check_hook_calls(calls, hooks, model, plain, meshes, torch.bfloat16 if bf16 else torch.float32)


def check_tracking(rank: int, meshes: _Meshes) -> None:
    """Everything quantized (qwZ, qgZ inside the node, the replicate all-reduce across nodes):
    per-step loss within LOSS_TRACKING of plain HSDP (fsdp_cases' [Note: tracking bound]),
    fp32 and bf16; the replicas stay identical."""
    for bf16 in (False, True):
        plain, _ = _train(_build(meshes.mesh, bf16=bf16), rank)
        model = meshes.zeropp(_build(meshes.shard, bf16=bf16))
        ours, params = _train(model, rank)
        worst = max(abs(a - b) / abs(b) for a, b in zip(ours, plain, strict=True))
        assert worst <= LOSS_TRACKING, (bf16, worst, ours, plain)
        assert ours != plain
        for p in params:  # every replica holds the same weights
            peers = [torch.empty_like(p) for _ in range(meshes.nodes)]
            dist.all_gather(peers, p, group=meshes.replicate)
            assert all(torch.equal(peer, p) for peer in peers)


class _Const(nn.Module):
    """Loss ``scale * sum(weight)``: every gradient element is ``scale``."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(7, 70))  # 7 rows on 2 ranks: FSDP2 pads one

    def forward(self, scale: float) -> torch.Tensor:
        return self.weight.sum() * scale


def check_division(rank: int, meshes: _Meshes) -> None:
    """The world mean, not the node's or the replicas': rank ``g``'s gradients are all ``g + 1``,
    so the mean is ``(W + 1) / 2`` (a node's mean differs on every node), and after
    ``set_gradient_divide_factor(f)`` it is ``W (W + 1) / 2 / f``, as under plain HSDP. A group
    of equal values quantizes to its extreme code, so the quantized collectives deliver these
    to within fp32 rounding of the scale; then one rounding to the reduce dtype. Every path FSDP2
    divides by: AVG (fp32, bf16), a split division around SUM (fp16), SUM with a division
    after it (sum-only comms), PREMUL_SUM(1/f); quantized and unquantized all-reduce."""
    world = meshes.nodes * meshes.local
    cases = [(torch.float32, "avg", True), (torch.bfloat16, "avg", True), (torch.float16, "avg", True),
             (torch.float32, "sum", True), (torch.float32, "sum", False), (torch.float32, "premul", True),
             (torch.bfloat16, "premul", True)]  # fmt: skip
    for dtype, op, quantized in cases:
        model = _Const()
        policy = MixedPrecisionPolicy(param_dtype=dtype) if dtype != torch.float32 else MixedPrecisionPolicy()
        fully_shard(model, mesh=meshes.shard, mp_policy=policy)
        if op == "sum":
            model.set_force_sum_reduction_for_comms(True)
        if op == "premul":
            model.set_gradient_divide_factor(DIVIDE_FACTOR)
        meshes.zeropp(model, quantized_weights=quantized, quantized_gradients=quantized, quantized_all_reduce=quantized)
        model(float(rank + 1)).backward()
        total = world * (world + 1) / 2
        expected = total / (DIVIDE_FACTOR if op == "premul" else world)
        grad = model.weight.grad.to_local()
        tolerance = expected * (2 * UNIT_ROUNDOFF[dtype] + 2.0**-20)  # reduce-scatter and all-reduce round once each
        assert bool(((grad - expected).abs() <= tolerance).all()), (dtype, op, quantized, grad.flatten()[:4], expected)


def check_stats(rank: int, meshes: _Meshes) -> None:
    """comm_stats shows the replicate all-reduce across nodes: per unit and step one
    ``reduce_scatter_q4`` and one ``all_gather_q8`` on the replicate group with the bytes of
    ``all_reduce_volume`` (one rank per node: all inter-node), and unquantized one ``all_reduce``
    of the ring's ``2 (R-1)`` chunks; the reduce-scatter inside the node stays intra-node."""
    size = DEFAULT_GROUP_SIZE[4]
    for quantized, gather_bits in ((True, 8), (True, 4), (False, 8)):
        model = meshes.zeropp(_build(meshes.shard, bf16=False), quantized_weights=False, quantized_gradients=False,
                              quantized_all_reduce=quantized, replicate_gather_bits=gather_bits)  # fmt: skip
        numels = [sum(_fsdp_compat.shard_numels(unit)) for unit in _units(model)]
        zcomm.reset_comm_stats()
        _loss(model, 0, rank).backward()
        stats = zcomm.comm_stats()
        assert stats["reduce_scatter_tensor"].calls == len(numels), stats
        assert stats["reduce_scatter_tensor"].inter_bytes == 0, stats
        if quantized:
            gather = "all_gather_q8" if gather_bits == 8 else "all_gather_hierarchical"
            expected = {"reduce_scatter_q4": [0, 0], gather: [0, 0]}
            for numel in numels:
                volume = all_reduce_volume(numel, meshes.nodes, 1, 1, size, size, gather_bits=gather_bits)
                for op, (intra, inter) in volume.items():
                    expected[op][0] += intra
                    expected[op][1] += inter
            for op, (intra, inter) in expected.items():
                row = stats[op]
                assert (row.calls, row.intra_bytes, row.inter_bytes) == (len(numels), intra, inter), (op, row)
            assert expected["reduce_scatter_q4"][1] > 0 and "all_reduce" not in stats
        else:
            r = dist.get_rank(meshes.replicate)
            inter = sum(2 * ring_volume(-(-n // meshes.nodes) * 4, r, meshes.nodes, 1)[1] for n in numels)
            row = stats["all_reduce"]
            assert (row.calls, row.intra_bytes, row.inter_bytes) == (len(numels), 0, inter), row
            assert "reduce_scatter_q4" not in stats


def check_fresh_mesh(rank: int, meshes: _Meshes) -> None:
    """A second 2-D mesh in the process gives FSDP2 new shard groups while the parameters'
    DTensor mesh keeps the first mesh's ([Note: the shard group by its ranks] in zcomm.fsdp): a
    model sharded on its rows still gathers its weights with qwZ, bit for bit as on the first."""
    losses = []
    for current in (meshes, _Meshes(meshes.nodes, meshes.local)):
        model = current.zeropp(_build(current.shard, bf16=False), quantized_gradients=False)
        zcomm.reset_comm_stats()
        with torch.no_grad():
            losses.append(_loss(model, 0, rank))
        stats = zcomm.comm_stats()
        assert stats["all_gather_q8"].calls > 0 and "all_gather_into_tensor" not in stats, stats
    assert torch.equal(losses[0], losses[1])


def check_error_feedback(rank: int, meshes: _Meshes) -> None:
    """``error_feedback=True``: one ErrorFeedback per unit, each advanced once per step, and the
    training still tracks plain HSDP; calling enable_zeropp again without ``replicate_group``
    removes zcomm's hooks."""
    plain, _ = _train(_build(meshes.mesh, bf16=False), rank, steps=2)
    model = meshes.zeropp(_build(meshes.shard, bf16=False), error_feedback=True)
    ours, _ = _train(model, rank, steps=2)
    assert max(abs(a - b) / abs(b) for a, b in zip(ours, plain, strict=True)) <= LOSS_TRACKING, (ours, plain)
    hooks = zcomm.fsdp.all_reduce_hooks(model)
    assert len(hooks) == len(_units(model)), hooks
    feedback = [f for hook in hooks.values() for f in hook.feedback.values()]
    assert len(feedback) == len(hooks) and len({id(f) for f in feedback}) == len(hooks)
    assert all(f.calls == 2 and f.nbytes > 0 for f in feedback), [(f.calls, f.nbytes) for f in feedback]
    zcomm.fsdp.enable_zeropp(model, topology=meshes.shard_topology)
    assert zcomm.fsdp.all_reduce_hooks(model) == {}


def _raises(fn, error: type[Exception], text: str) -> None:
    try:
        fn()
    except error as exc:
        assert text in str(exc), exc
    else:
        raise AssertionError(f"no {error.__name__} ({text})")


def check_errors(rank: int, meshes: _Meshes) -> None:
    """Bad input is named: a 2-D mesh, a replicate group that holds shard peers (the shard
    group, the world) or pairs different shard indices, a hook that is not zcomm's."""
    model = _build(meshes.mesh, bf16=False)
    _raises(lambda: meshes.zeropp(model), ValueError, "replicate_group=mesh.get_group('replicate')")
    model = _build(meshes.shard, bf16=False)
    for wrong in (meshes.shard.get_group(), dist.group.WORLD):
        _raises(lambda wrong=wrong: zcomm.fsdp.enable_zeropp(model, replicate_group=wrong), ValueError,
                "of the shard group of module")  # fmt: skip
    # pairs across nodes that hold different shard indices: node 0's local rank l with node 1's 1 - l
    assert meshes.nodes == 2 and meshes.local == 2
    crossed = [dist.new_group([0, 3]), dist.new_group([1, 2])]
    mine = crossed[0] if rank in (0, 3) else crossed[1]
    _raises(lambda: zcomm.fsdp.enable_zeropp(model, replicate_group=mine), ValueError,
            "shards the model otherwise than rank")  # fmt: skip
    model.blocks[0].set_all_reduce_hook(lambda output: None)
    _raises(lambda: meshes.zeropp(model), ValueError, "already has an all-reduce hook")


def rank_main(rank: int, world: int, local_size: int, checks: tuple[str, ...]) -> list[str]:
    torch.set_num_threads(1)
    meshes = _Meshes(world // local_size, local_size)
    done = []
    for name in checks:
        globals()[f"check_{name}"](rank, meshes)
        done.append(name)
    return done
