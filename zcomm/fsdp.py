"""ZeRO++ inside PyTorch FSDP2: :func:`enable_zeropp` installs zcomm's collectives on ``fully_shard`` modules.

FSDP2 gathers each unit's weights with one flat all-gather and reduces its gradients with
one flat reduce-scatter, through comm objects a module can replace
(``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``, per module, not
recursive). :func:`enable_zeropp` gives every ``FSDPModule`` in a tree its own pair:

* :class:`ZeroppAllGather`: qwZ, :func:`zcomm.all_gather_q8` (blocked INT8, two hops) for
  the gathers on the unit's shard group; the unquantized, counted
  :func:`zcomm.all_gather_into_tensor` for the rest (see below);
* :class:`ZeroppReduceScatter`: qgZ, :func:`zcomm.reduce_scatter_q4` (two hops, fp32
  reduction, INT4 across nodes) for ``AVG``, ``SUM`` and ``PREMUL_SUM`` (FSDP2's three ops);
  the counted :func:`zcomm.reduce_scatter_tensor` when gradients are not quantized.

qgZ's intra-node hop is INT8 by default here (``first_hop_bits=8``, SDP4Bit's two-level
scheme; ``first_hop_bits=4`` is the ZeRO++ paper's INT4): the bytes that cross nodes are the
same, only the hop on the fast links doubles, and the gradient error of the first hop shrinks
18x. On small, sharp tasks, where INT4 rounding of both hops shows in the loss, that is what
keeps FSDP2 + ZeRO++ within a few percent of plain FSDP2 (``bench/fsdp_sharp_task.py``).
zero_runtime keeps the paper's INT4 default, which its DeepSpeed-style config names.

hpZ is FSDP2's own: ``fully_shard(..., reshard_after_forward=<ranks per node>)`` keeps each
unit's weights sharded inside the node after forward, so the backward all-gather runs on a
node-local group. Those gathers copy weights that qwZ already quantized in forward, and
stay unquantized (counted as ``all_gather_into_tensor``): quantizing them again would add
a second rounding and save no inter-node traffic.

Gathers that cannot be quantized are counted and warned about once per module, never
silently swapped: FSDP2 gathers a unit whose all-gather inputs have several dtypes (float8
training, a frozen parameter of another dtype) as one ``uint8`` buffer, and the split
sizes needed to quantize its pieces are not passed to the comm; fp64 has no quantized form.

Quantization blocks follow the parameters: :func:`enable_zeropp` reads each unit's
parameter boundaries from FSDP2's own state (:func:`zcomm._fsdp_compat.shard_numels`) and,
where that adds at most 1/32 of the unit's elements (zero_runtime's rule), stages the
quantized collectives through a zero-padded copy in which every parameter starts at a
multiple of the group size, so no block holds two parameters ([Note: aligned staging] in
:mod:`zcomm._fsdp_blocks`; the all-gather and the reduce-scatter both follow it). Where that
is over the budget (FSDP2 leaves a piece of every LayerNorm and bias in every rank's row),
only the pieces of at least a group are aligned and the smaller ones are packed together
after them, so small parameters share blocks only with each other ([Note: small pieces
packed together]); beyond the budget even then, the unit stays packed. So does a
reduce-scatter whose layout FSDP2 changed (only some parameters got gradients: warned once
per module). ``align_blocks=False`` packs every unit.

Results: an ``async_op=True`` quantized gather returns a real ``torch.distributed.Work``
whose ``wait()`` completes zcomm's chain (FSDP2 waits only on ``Work`` instances), and for
an aligned unit then copies the result into FSDP2's buffer.

Host cost: each comm resolves a quantized call once per group, sizes, dtypes, devices and
(reduce-scatter) op value and keeps that prepared call for the next steps (see [Note: a
comm's prepared calls]).

HSDP (sharded inside each node, replicated across nodes) with zcomm's collectives: shard
on the 1-D shard mesh and pass the replicate group, the ranks that hold this rank's shard
index on the other replicas; the rows of a 2-D mesh give both::

    mesh = init_device_mesh("cuda", (nodes, ranks_per_node), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    zcomm.fsdp.enable_zeropp(model, replicate_group=mesh.get_group("replicate"))

Each unit then gets qwZ and qgZ inside the node as above and, through FSDP2's all-reduce
hook, its reduce-scatter output all-reduced across the replicas by :func:`zcomm.all_reduce_q4`
(``quantized_all_reduce=False``: unquantized, counted; ``replicate_gather_bits``: the width of
its gather, 8 by default), averaged so that every rank ends
with the world mean, as plain HSDP (see :mod:`zcomm._fsdp_hsdp`). ``set_requires_all_reduce(False)``
is honoured as under plain HSDP: the micro-batches' outputs are summed and all-reduced once
([Note: accumulation without the all-reduce] in :mod:`zcomm._fsdp_hsdp`). A module sharded on a
2-D mesh is rejected: there FSDP2 runs its own replicate all-reduce, which nobody can
replace, before any hook.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Hashable, Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from ._contract import Handle
from ._fsdp_blocks import BlockLayout, aligned_layout, block_align
from ._fsdp_compat import (
    AllGather,
    FSDPModule,
    ReduceScatter,
    all_reduce_hook,
    as_work,
    param_group,
    shard_numels,
    torch_problem,
)
from ._fsdp_hsdp import ReplicateAllReduce, check_replicate_group
from ._plan_cache import BoundedCache
from .all_gather_q8 import all_gather_q8, prepare_all_gather_q8
from .all_reduce_q4 import check_gather, gather_group_size_of
from .plain_collectives import all_gather_into_tensor, reduce_scatter_tensor
from .quant import SUPPORTED_DTYPES, QuantSpec
from .quant._plain import PLAIN_TENSORS
from .reduce_scatter_q4 import (
    check_first_hop_bits,
    check_hadamard_block,
    default_pipeline_stages,
    prepare_reduce_scatter_q4_coalesced,
    reduce_scatter_q4,
)
from .topology import Topology

__all__ = ["ReplicateAllReduce", "ZeroppAllGather", "ZeroppReduceScatter", "all_reduce_hooks", "enable_zeropp"]

GroupSize = int | Literal["tensor"] | None

# [Note: a comm's prepared calls] FSDP2 calls a unit's comm with the same few call shapes every
# step: its all-gather on the shard group (and, under hpZ, unquantized on the node-local
# group), its reduce-scatter on the shard group with one op, each with buffers of fixed sizes,
# new or reused. So each comm keeps a prepared call (zcomm.prepare_all_gather_q8,
# zcomm.prepare_reduce_scatter_q4_coalesced) per what can vary between its calls: the group,
# the tensors' sizes, dtype and device and, for the reduce-scatter, the op, keyed by its
# value (SUM, AVG, or PREMUL_SUM by its factor: FSDP2 may build that ReduceOp object anew per
# call, so never by its identity). Its first call of a key resolves the prologue, the op and
# the plan once; later calls only check the tensors against the prepared sizes. The comm's
# other settings (group size, topology, qgZ options, the aligned layout) are fixed at its
# construction. At most _MAX_PREPARED calls are kept per comm, in a zcomm._plan_cache.BoundedCache
# (the oldest dropped first). Each holds its group: the cache is the comm's, not zcomm's, and the
# comm lives as long as its module, which holds the group anyway through its mesh, so they go
# together.
_MAX_PREPARED = 8


class _GroupTopologies:
    """The topology of the unit's shard group, and of its subgroups (FSDP2's hpZ groups) derived from it.

    [Note: the shard group by its ranks] FSDP2 may call a unit's comms with another
    ``ProcessGroup`` object than the one its parameters' mesh holds, over the same ranks: a
    ``DeviceMesh`` sliced again (a second ``init_device_mesh(...)["shard"]`` in the process)
    gives FSDP2 new groups while the parameters' DTensor mesh keeps the first ones, and
    ``set_separate_reduce_scatter_group`` gives the reduce-scatter its own. So the shard group is
    recognised by its ranks, in order, not by identity (each group object still gets its own
    prepared calls, so every collective runs on the group FSDP2 gave). Another group (hpZ's
    post-forward group inside the node) is gathered unquantized, as documented.
    """

    def __init__(self, shard_group: dist.ProcessGroup, topology: Topology) -> None:
        self.shard_group = shard_group
        self._shard_ranks = dist.get_process_group_ranks(shard_group)
        self._found: weakref.WeakKeyDictionary[dist.ProcessGroup, Topology] = weakref.WeakKeyDictionary()
        self._found[shard_group] = topology
        self._is_shard: weakref.WeakKeyDictionary[dist.ProcessGroup, bool] = weakref.WeakKeyDictionary()

    def is_shard(self, group: dist.ProcessGroup) -> bool:
        """Whether ``group`` holds the shard group's ranks in its order ([Note: the shard group by its ranks])."""
        if group is self.shard_group:  # the usual call: no lookup on the hot path
            return True
        found = self._is_shard.get(group)
        if found is None:
            found = self._is_shard[group] = dist.get_process_group_ranks(group) == self._shard_ranks
        return found

    def of(self, group: dist.ProcessGroup) -> Topology:
        if group not in self._found:
            shard_topology = self._found[self.shard_group]
            shard_ranks = [dist.get_group_rank(self.shard_group, g) for g in dist.get_process_group_ranks(group)]
            self._found[group] = shard_topology.of_ranks(shard_ranks)
        return self._found[group]


class _WarnOnce:
    """One warning per module and reason: a collective that could not be quantized, or whose
    quantization blocks could not be aligned to the parameters."""

    def __init__(self, module_name: str) -> None:
        self._module_name = module_name
        self._seen: set[str] = set()

    def __call__(self, what: str, reason: str) -> None:
        self._once(
            reason,
            f"zcomm.fsdp: {what} of module {self._module_name!r} is not quantized ({reason}); it runs "
            "unquantized and is counted in zcomm.comm_stats() as such",
        )

    def unaligned(self, what: str, reason: str) -> None:
        self._once(
            reason,
            f"zcomm.fsdp: {what} of module {self._module_name!r} is quantized with blocks that may span "
            f"two parameters ({reason})",
        )

    def _once(self, reason: str, message: str) -> None:
        if reason not in self._seen:
            self._seen.add(reason)
            warnings.warn(message, RuntimeWarning, stacklevel=4)


class _ZeroppComm:
    """What both adapters share: their unit's groups and settings, and FSDP2's ``allocate``."""

    def __init__(
        self,
        topologies: _GroupTopologies,
        *,
        quantized: bool,
        group_size: GroupSize,
        module_name: str,
        layout: BlockLayout | None = None,
    ) -> None:
        self._topologies = topologies
        self._quantized = quantized
        self._group_size = group_size
        self._warn = _WarnOnce(module_name)
        self.layout = layout  # the unit's aligned layout, None where its blocks stay packed
        self._stages: dict[tuple[dist.ProcessGroup, torch.dtype], int] = {}  # qgZ's, fixed per group and dtype
        self._prepared = BoundedCache(_MAX_PREPARED)  # [Note: a comm's prepared calls]

    def _layout_for(self, row_numel: int, what: str) -> BlockLayout | None:
        """The aligned layout if a row of this call's buffer is the one it was derived for."""
        if self.layout is None:
            return None
        if row_numel != self.layout.numel:
            self._warn.unaligned(what, f"FSDP2's buffer holds {row_numel} elements per rank, not the "
                                 f"{self.layout.numel} of all the unit's parameters")
            return None
        return self.layout

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Buffers where FSDP2 asks for them: on the device of the data they serve."""
        return torch.empty(*size, dtype=dtype, device=device)


class ZeroppAllGather(_ZeroppComm, AllGather):
    """FSDP2's all-gather of one unit: qwZ on the shard group, unquantized (counted) elsewhere."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        if self._quantized and self._topologies.is_shard(group):
            if input_tensor.dtype in SUPPORTED_DTYPES:
                layout = self._layout_for(input_tensor.numel(), "weight all-gather")
                if layout is None:
                    return as_work(self._gather(output_tensor, input_tensor, group, async_op))
                return as_work(self._gather_aligned(layout, output_tensor, input_tensor, group, async_op))
            if input_tensor.dtype == torch.uint8:
                self._warn("weight all-gather", "parameters of several dtypes, gathered as one uint8 buffer")
            else:
                self._warn("weight all-gather", f"no quantized form: {input_tensor.dtype}")
        return all_gather_into_tensor(output_tensor, input_tensor, group, async_op, topology=self._topologies.of(group))

    def _gather(self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, async_op: bool
                ) -> Handle | None:
        """qwZ through this comm's prepared call for these tensors ([Note: a comm's prepared calls]);
        tensors a prepared call does not take (not plain contiguous tensors) go through
        :func:`zcomm.all_gather_q8`, which says what is wrong with them or gathers them."""
        if not _plain(output, input):
            return all_gather_q8(output, input, group, async_op, group_size=self._group_size,
                                 topology=self._topologies.of(group))  # fmt: skip
        key = (group, output.numel(), input.numel(), input.dtype, output.dtype, input.device, output.device)
        prepared = self._prepared.get_or_make(key, lambda: prepare_all_gather_q8(
            output, input, group, group_size=self._group_size, topology=self._topologies.of(group)))
        return prepared(output, input, async_op=async_op)

    def _gather_aligned(self, layout, output, input, group, async_op) -> Handle | None:
        """qwZ through the aligned staging copies ([Note: aligned staging]): FSDP2's in-place
        ``input`` is read into the staged input before ``output`` is written."""
        staged_in = layout.pad(input, rows=1)
        world = self._topologies.of(group).world_size
        staged_out = torch.empty(world * staged_in.numel(), dtype=output.dtype, device=output.device)
        result = self._gather(staged_out, staged_in, group, async_op)
        return _then_unpad(result, layout, staged_out, output, rows=world)


class ZeroppReduceScatter(_ZeroppComm, ReduceScatter):
    """FSDP2's gradient reduce-scatter of one unit: qgZ, or the unquantized (counted) collective.

    ``first_hop_bits`` and ``hadamard_block`` are :func:`zcomm.reduce_scatter_q4`'s, checked by
    :func:`enable_zeropp`; the other arguments are the shared comm's.
    """

    def __init__(
        self, topologies: _GroupTopologies, *, first_hop_bits: int = 8, hadamard_block: int | None = None, **common
    ) -> None:
        super().__init__(topologies, **common)
        self._qgz = dict(first_hop_bits=first_hop_bits, hadamard_block=hadamard_block)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        if self._quantized:
            if input_tensor.dtype in SUPPORTED_DTYPES:
                layout = self._layout_for(output_tensor.numel(), "gradient reduce-scatter")
                if layout is None:
                    return as_work(self._reduce(output_tensor, input_tensor, op, group, async_op, None))
                return as_work(self._reduce_aligned(layout, output_tensor, input_tensor, op, group, async_op))
            self._warn("gradient reduce-scatter", f"no quantized form: {input_tensor.dtype}")
        return reduce_scatter_tensor(output_tensor, input_tensor, op, group, async_op,
                                     topology=self._topologies.of(group))  # fmt: skip

    def _reduce(self, output: torch.Tensor, input: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup,
                async_op: bool, stages: int | None) -> Handle | None:
        """qgZ through this comm's prepared call for these tensors and op ([Note: a comm's prepared
        calls]); an op or tensors a prepared call cannot be keyed by go through
        :func:`zcomm.reduce_scatter_q4`, which says what is wrong with them or reduces them."""
        op_key = _op_key(op)
        if op_key is None or not _plain(output, input):
            return reduce_scatter_q4(output, input, op, group, async_op, group_size=self._group_size,
                                     pipeline_stages=stages, topology=self._topologies.of(group), **self._qgz)
        key = (group, output.numel(), input.numel(), input.dtype, output.dtype, input.device, output.device, op_key,
               stages)
        prepared = self._prepared.get_or_make(key, lambda: prepare_reduce_scatter_q4_coalesced(
            [output], [input], op, group, group_size=self._group_size, pipeline_stages=stages,
            topology=self._topologies.of(group), **self._qgz))
        return prepared([output], [input], async_op=async_op)

    def _reduce_aligned(self, layout, output, input, op, group, async_op) -> Handle | None:
        """qgZ through the aligned staging copies, with the pipeline stage count fixed before the
        rows are padded, so that every stage's part starts at a multiple of the alignment."""
        topology = self._topologies.of(group)
        world = topology.world_size
        stages = self._stages.get((group, input.dtype))
        if stages is None:
            nbytes = world * layout.row_numel() * input.element_size()
            stages = default_pipeline_stages(nbytes, layout.row_numel(), topology)
            self._stages[(group, input.dtype)] = stages
        staged_in = layout.pad(input, rows=world, stages=stages)
        staged_out = torch.empty(staged_in.numel() // world, dtype=output.dtype, device=output.device)
        result = self._reduce(staged_out, staged_in, op, group, async_op, stages)
        return _then_unpad(result, layout, staged_out, output, rows=1)


def _plain(output: torch.Tensor, input: torch.Tensor) -> bool:
    """Whether both are plain contiguous tensors, as a prepared call takes them."""
    return (type(output) in PLAIN_TENSORS and type(input) in PLAIN_TENSORS and output.is_contiguous()
            and input.is_contiguous())  # fmt: skip


def _op_key(op: dist.ReduceOp) -> Hashable | None:
    """What a reduce-scatter's result depends on in ``op``: SUM or AVG (the enum value, whether
    passed as such or wrapped in a ``ReduceOp``) or PREMUL_SUM with its Python float factor;
    None for anything else (an op the collective rejects, a tensor factor)."""
    inner = getattr(op, "op", op)
    if inner == dist.ReduceOp.PREMUL_SUM:
        factor = getattr(op, "factor", None)
        return (dist.ReduceOp.PREMUL_SUM, factor) if type(factor) is float else None
    if inner == dist.ReduceOp.SUM or inner == dist.ReduceOp.AVG:
        return inner
    return None


def _then_unpad(
    result: Handle | None, layout: BlockLayout, staged: torch.Tensor, out: torch.Tensor, *, rows: int
) -> Handle | None:
    """Copy the staged result into FSDP2's ``out``: now for a synchronous call, else in the
    returned handle's ``wait()``.

    [Note: staged buffer lifetime] The collective keeps both staged buffers alive for its own
    work ([Note: side-stream buffers by events] in :mod:`zcomm._chain_runner`). The copy out
    reads ``staged`` after the collective: at once on the calling stream for a synchronous
    call; for an asynchronous one in ``wait()``, which holds ``staged`` until then and enqueues
    the collective's tail and the copy on the waiting stream, in that order. That stream may
    not be the one ``staged`` was allocated on (FSDP2 waits on its compute stream for a gather
    issued on its all-gather stream). Then, as FSDP2 does with its own all-gather buffers, an
    event recorded after the copy is waited for by the allocating stream before ``staged`` can
    be freed (its reference goes with this handle), so no later allocation on that stream
    reuses the block before the copy has read it; ``record_stream`` would instead keep the
    block until all work queued on the waiting stream at the free had finished.
    """
    if result is None:
        layout.unpad(staged, out, rows=rows)
        return None
    allocated_on = torch.cuda.current_stream(staged.device) if staged.is_cuda else None

    def finish() -> None:
        result.wait()
        layout.unpad(staged, out, rows=rows)
        if allocated_on is not None:
            consumer = torch.cuda.current_stream(staged.device)
            if consumer != allocated_on:
                copied = torch.cuda.Event()
                copied.record(consumer)
                allocated_on.wait_event(copied)

    return Handle(finish=finish, ready=result.is_completed)


def enable_zeropp(
    module: nn.Module,
    *,
    quantized_weights: bool = True,
    quantized_gradients: bool = True,
    group_size: GroupSize = None,
    topology: Topology | None = None,
    align_blocks: bool = True,
    first_hop_bits: int = 8,
    hadamard_block: int | None = None,
    replicate_group: dist.ProcessGroup | None = None,
    replicate_topology: Topology | None = None,
    quantized_all_reduce: bool = True,
    replicate_gather_bits: int | None = 8,
    error_feedback: bool = False,
) -> dict[str, bool]:
    """Install zcomm's collectives on ``module`` and every ``FSDPModule`` below it (after ``fully_shard``).

    Collective: every rank of the shard groups calls it, in the same order. Calling it again
    replaces the collectives with ones of the new settings; with both ``quantized_*`` False,
    FSDP2 trains bit for bit as without it, with its traffic counted in :func:`zcomm.comm_stats`.

    Args:
        module: a module that is, or contains, an ``FSDPModule`` (from ``fully_shard``).
        quantized_weights: qwZ, INT8 all-gather of the weights on each unit's shard group.
        quantized_gradients: qgZ, INT4 two-hop reduce-scatter of the gradients.
        group_size: elements per quantization scale for both (see :func:`zcomm.all_gather_q8`
            and :func:`zcomm.reduce_scatter_q4`; None: zcomm's defaults).
        topology: which ranks of the shard group share a node (default:
            :meth:`zcomm.Topology.detect` on that group).
        align_blocks: keep quantization blocks inside one parameter (or, failing that, keep
            small parameters out of large ones' blocks) where that adds at most 1/32 of a
            unit's elements (see the module docstring); False packs them.
        first_hop_bits, hadamard_block: qgZ's (:func:`zcomm.reduce_scatter_q4`), for the
            reduce-scatter and the replicate all-reduce.
        replicate_group: HSDP: the ranks holding this rank's shard index in every replica
            (one per node, typically ``mesh.get_group("replicate")`` of a 2-D mesh whose
            ``"shard"`` rows the modules are sharded on); each unit's reduced gradient shard
            is then all-reduced over it (see the module docstring). None: no replication.
        replicate_topology: which ranks of ``replicate_group`` share a node (default:
            :meth:`zcomm.Topology.detect` on that group).
        quantized_all_reduce: the replicate all-reduce by :func:`zcomm.all_reduce_q4`
            (INT4 reduction, INT8 gather); False: unquantized, counted as ``all_reduce``.
        replicate_gather_bits: the width in which that all-reduce gathers its averaged slices
            across the replicas (``gather_bits`` of :func:`zcomm.all_reduce_q4`): 8, 4 (a
            third fewer inter-node bytes than 8, an error bound 18x INT8's), or None (the
            gradients' dtype).
        error_feedback: LoCo error feedback (:class:`zcomm.ErrorFeedback`) for the INT4
            reduction of the replicate all-reduce, one state per unit
            (:func:`all_reduce_hooks` reaches them). Not with ``hadamard_block``, nor with
            ``first_hop_bits=8`` where replicas share a node.

    Returns:
        for every unit with parameters of its own (by module name; the root by its class
        name), whether its quantization blocks are aligned to its parameters (fully or with
        its small parameters packed together).

    Raises:
        ValueError: ``first_hop_bits`` is not 4 or 8; ``hadamard_block`` is not None or a power
            of two, or is given without ``quantized_gradients``; the installed torch has no
            supported FSDP2 comm API; ``module`` holds no ``FSDPModule``; a module is sharded on
            a 2-D mesh (HSDP), whose replicate all-reduce FSDP2 does not let anyone replace;
            ``replicate_group`` does not pair this rank with the ranks holding its shards
            (:func:`zcomm._fsdp_hsdp.check_replicate_group`); a unit already has an all-reduce
            hook that is not zcomm's; ``replicate_topology``, ``quantized_all_reduce=False``,
            ``replicate_gather_bits`` or ``error_feedback`` without ``replicate_group``;
            ``replicate_gather_bits`` not 4, 8 or None, or not 8 unquantized; ``error_feedback``
            with what it cannot model.
        TypeError: an argument of the wrong type (``replicate_group`` not a ``ProcessGroup``).
    """
    problem = torch_problem()
    if problem is not None:
        raise ValueError(problem)
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    flags = (("quantized_weights", quantized_weights), ("quantized_gradients", quantized_gradients),
             ("align_blocks", align_blocks), ("quantized_all_reduce", quantized_all_reduce),
             ("error_feedback", error_feedback))  # fmt: skip
    for name, flag in flags:
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    check_first_hop_bits(first_hop_bits)
    check_hadamard_block(hadamard_block)
    if hadamard_block is not None and not quantized_gradients:
        raise ValueError("hadamard_block rotates qgZ's gradients: it needs quantized_gradients=True")
    units = [(name, sub) for name, sub in module.named_modules() if isinstance(sub, FSDPModule)]
    if not units:
        raise ValueError(f"{type(module).__name__} holds no FSDPModule: apply fully_shard before enable_zeropp")
    groups = [(name, sub, *_shard_group(name, sub)) for name, sub in units]
    replicate = _replicate_setup(groups, replicate_group, replicate_topology, quantized_all_reduce, error_feedback,
                                 first_hop_bits, hadamard_block, replicate_gather_bits, group_size)
    align = _block_align(quantized_weights, quantized_gradients, group_size, hadamard_block) if align_blocks else 1
    topologies: dict[dist.ProcessGroup, _GroupTopologies] = {}
    aligned: dict[str, bool] = {}
    for name, sub, group, device in groups:
        if group is None:  # a unit with no parameters of its own communicates nothing
            continue
        if group not in topologies:  # detected on the parameters' GPU ([Note: device guards] in zcomm._device_guard)
            found = topology if topology is not None else Topology.detect(group, device=device)
            topologies[group] = _GroupTopologies(group, found)
        label = name or type(sub).__name__
        layout = aligned_layout(shard_numels(sub), align=align)
        aligned[label] = layout is not None
        common = dict(group_size=group_size, module_name=label, layout=layout)
        sub.set_custom_all_gather(ZeroppAllGather(topologies[group], quantized=quantized_weights, **common))
        sub.set_custom_reduce_scatter(ZeroppReduceScatter(topologies[group], quantized=quantized_gradients,
                                                          first_hop_bits=first_hop_bits, hadamard_block=hadamard_block,
                                                          **common))  # fmt: skip
        if replicate is not None:
            replicas, replica_topology, first_bits = replicate
            # no stream: FSDP2 runs the hook on its own all-reduce stream ([Note: reduce output on two streams])
            sub.set_all_reduce_hook(ReplicateAllReduce(
                sub, replicas, replica_topology, quantized=quantized_all_reduce, group_size=group_size,
                first_hop_bits=first_bits, hadamard_block=hadamard_block, gather_bits=replicate_gather_bits,
                error_feedback=error_feedback, warn=_WarnOnce(label)))
        elif isinstance(all_reduce_hook(sub), ReplicateAllReduce):  # an earlier call's: this one replicates nothing
            param_group(sub)._all_reduce_hook = None
    return aligned


def all_reduce_hooks(module: nn.Module) -> dict[str, ReplicateAllReduce]:
    """The replicate all-reduce hooks :func:`enable_zeropp` installed in ``module``'s units, by
    unit name (the root by its class name), e.g. to checkpoint their ``feedback``."""
    return {name or type(sub).__name__: hook for name, sub in module.named_modules()
            if isinstance(sub, FSDPModule) and isinstance(hook := all_reduce_hook(sub), ReplicateAllReduce)}


def _replicate_setup(
    groups: list[tuple[str, nn.Module, dist.ProcessGroup | None, torch.device | None]],
    replicate_group: dist.ProcessGroup | None,
    replicate_topology: Topology | None,
    quantized_all_reduce: bool,
    error_feedback: bool,
    first_hop_bits: int,
    hadamard_block: int | None,
    gather_bits: int | None,
    group_size: GroupSize,
) -> tuple[dist.ProcessGroup, Topology, int] | None:
    """The replicate group, its topology and its all-reduce's first hop width, once checked
    against the units' shard groups (None without HSDP)."""
    if replicate_group is None:
        for name, value in (("replicate_topology", replicate_topology is not None),
                            ("quantized_all_reduce=False", not quantized_all_reduce),
                            ("replicate_gather_bits", gather_bits != 8),
                            ("error_feedback", error_feedback)):  # fmt: skip
            if value:
                raise ValueError(f"{name} applies to the replicate all-reduce: it needs replicate_group")
        return None
    check_gather(gather_bits, gather_group_size_of(gather_bits, group_size))
    if gather_bits != 8 and not quantized_all_reduce:
        raise ValueError("replicate_gather_bits is the quantized all-reduce's gather width: it needs "
                         "quantized_all_reduce=True")
    if not hasattr(FSDPModule, "set_all_reduce_hook"):
        raise ValueError(f"torch {torch.__version__}'s FSDPModule has no set_all_reduce_hook: HSDP with zcomm "
                         "needs it")
    if replicate_topology is not None and not isinstance(replicate_topology, Topology):
        raise TypeError(f"replicate_topology must be a zcomm.Topology or None, got {type(replicate_topology).__name__}")
    if error_feedback and not quantized_all_reduce:
        raise ValueError("error_feedback corrects the quantized all-reduce: it needs quantized_all_reduce=True")
    sharded = [(name or type(sub).__name__, sub, group) for name, sub, group, _ in groups if group is not None]
    device = next((device for *_, group, device in groups if group is not None), None)
    check_replicate_group(sharded, replicate_group, device)
    for label, sub, _ in sharded:
        hook = all_reduce_hook(sub)
        if hook is not None and not isinstance(hook, ReplicateAllReduce):
            raise ValueError(f"module {label!r} already has an all-reduce hook ({hook!r}); zcomm's replicate "
                             "all-reduce would replace it: install one or the other")
    topology = (replicate_topology if replicate_topology is not None
                else Topology.detect(replicate_group, device=device))  # on the parameters' GPU
    if topology.world_size != replicate_group.size():
        raise ValueError(f"replicate_topology is for {topology.world_size} ranks but replicate_group has "
                         f"{replicate_group.size()}")
    # with one replica per node the reduction has no intra-node hop and first_hop_bits means nothing to it
    first_bits = first_hop_bits if topology.local_size > 1 else 4
    if error_feedback and (first_bits == 8 or hadamard_block is not None):
        raise ValueError("error_feedback cannot be combined with hadamard_block, nor with first_hop_bits=8 where "
                         "replicas share a node (the error feedback models INT4 hops of unrotated values)")
    return replicate_group, topology, first_bits


def _block_align(
    quantized_weights: bool, quantized_gradients: bool, group_size: GroupSize, hadamard_block: int | None
) -> int:
    """The alignment that keeps the quantized collectives' blocks (quantization groups and
    Hadamard blocks) inside parameters (1: none quantized, or one scale per payload, which no
    padding could confine to a parameter)."""
    if group_size == "tensor":
        return 1
    widths = [bits for bits, on in ((8, quantized_weights), (4, quantized_gradients)) if on]
    sizes = [QuantSpec(bits=bits, group_size=group_size).group_size for bits in widths]
    return block_align(sizes + ([hadamard_block] if hadamard_block is not None else []))


def _shard_group(name: str, unit: nn.Module) -> tuple[dist.ProcessGroup | None, torch.device | None]:
    """The process group ``unit``'s own parameters are sharded on and their device ((None, None) if
    it has none); ValueError for HSDP."""
    inner = [sub for sub in unit.modules() if sub is not unit and isinstance(sub, FSDPModule)]
    nested = {id(p) for sub in inner for p in sub.parameters()}
    own = [p for p in unit.parameters() if id(p) not in nested]
    if not own:
        return None, None
    mesh = own[0].device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"module {name or type(unit).__name__!r} is sharded on a {mesh.ndim}-D mesh (HSDP): FSDP2's replicate "
            "all-reduce cannot be replaced, so zcomm.fsdp takes 1-D meshes only; for HSDP shard on the 1-D shard "
            "mesh (mesh['shard']) and pass enable_zeropp(..., replicate_group=mesh.get_group('replicate'))"
        )
    return mesh.get_group(), own[0].device
