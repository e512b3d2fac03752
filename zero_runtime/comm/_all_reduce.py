"""Stage 0: plain data parallelism, and its gradient all-reduce (plain or qgZ's ``all_reduce_q4``).

[Note: stage 0] DeepSpeed's default stage partitions nothing: every rank keeps the whole
model in the compute dtype, the whole fp32 master and optimizer states, and the whole
averaged gradient. The runtime runs it as the stage-1/2 machinery over a partition of one:

* each flat unit is laid out with one shard, the whole buffer (``FlatUnit(world_size=1)``),
  so ``shard``, ``master`` and ``grad_shard`` cover every parameter on every rank; the
  layout is still padded to split into one equal slice per rank (``FlatLayout.slices``), the
  slices ``all_reduce_q4``'s reduce-scatter cuts, so that with qgZ no quantization group
  holds two parameters ([Note: parameter-aligned blocks] in ``_flat_buffer``);
* the gradient buckets of ``comm._grad_reduce`` are all-reduced by the objects below, the
  ``ReduceScatter`` of a partition of one (each rank's "slice" is the whole bucket). As in
  stage 1 the micro-steps of an accumulation window add into the units' full gradient
  buffers locally, and only the boundary's backward reduces them, launching each bucket as
  soon as its gradients are final (``overlap_comm``; DDP's ``no_sync`` then a synchronized
  backward);
* every rank then holds the same averaged gradient (``dist.all_reduce`` and
  ``all_reduce_q4`` leave the same bits on every rank), so the gradient norm for clipping
  and for the fp16 overflow check is computed locally, with no collective, and every rank
  takes the same decision; a non-finite gradient on any rank reaches every rank through
  the sum;
* each rank steps its own whole masters and writes them into its parameters: no all-gather
  after the step.

Checkpoints hold each rank's copy of the whole state (every rank writes its file, so a
load at the same world size reads its own); resharding and the offline export read rank
0's alone (``meta.json``'s ``shards`` is 1; see [Note: resharding a checkpoint]).

``PlainAllReduce`` is a SUM followed by a division by the world size in the gradients'
dtype, as the plain reduce-scatter does (see [Note: gloo and SUM] in ``comm._plan``).
``QuantizedAllReduce`` is qgZ's: one prepared ``zcomm.all_reduce_q4`` (AVG) per bucket, the
INT4 hierarchical reduce-scatter with fp32 sums (its first-hop width, Hadamard rotation and
LoCo error feedback as configured), then the averaged slices gathered as blocked INT8;
``zcomm.comm_stats`` counts it as one ``reduce_scatter_q4`` and one ``all_gather_q8`` call.

Both reduce out of place, as the contract asks: a bucket of one unit is copied into its
output and reduced there; a bucket of several is copied into one staging buffer from
``allocate``, reduced, and split into the outputs by ``wait()``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

import zcomm
from zcomm import PreparedAllReduceQ4, prepare_all_reduce_q4
from zcomm.quant import QuantSpec

from .._contract import Handle, ReduceScatter
from ._quantized import QuantizedReduceScatter


class PlainAllReduce(ReduceScatter):
    """Stage 0's unquantized gradient reduction: ``dist.all_reduce`` SUM of each bucket (through
    ``zcomm.all_reduce``, which counts a ring's bytes in ``comm_stats``), then a division by the
    world size (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup, topology: zcomm.Topology) -> None:
        self.group = group
        self.topology = topology

    def __call__(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], *, bucket: int) -> Handle:
        staged = _stage(self, outputs, inputs)
        work = zcomm.all_reduce(staged, op=dist.ReduceOp.SUM, group=self.group, async_op=True, topology=self.topology)
        return _AllReduced(work, staged, outputs, divide_by=dist.get_world_size(self.group))


class QuantizedAllReduce(QuantizedReduceScatter):
    """Stage 0's qgZ: one prepared ``zcomm.all_reduce_q4`` (AVG) per gradient bucket, gathering
    in INT8 with ``gather_spec``'s groups; the reduce-scatter's options and LoCo state are
    ``QuantizedReduceScatter``'s."""

    def __init__(self, group: dist.ProcessGroup, topology: zcomm.Topology, *, spec: QuantSpec,
                 gather_spec: QuantSpec, loco: tuple[float, int] | None = None, first_hop_bits: int = 4,
                 hadamard_block: int | None = None) -> None:
        super().__init__(group, topology, spec=spec, loco=loco, first_hop_bits=first_hop_bits,
                         hadamard_block=hadamard_block)
        assert gather_spec.bits == 8, gather_spec
        self.gather_spec = gather_spec
        self._prepared_all_reduce: dict[int, PreparedAllReduceQ4] = {}  # see [Note: runtime-held plans]

    def __call__(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], *, bucket: int) -> Handle:
        feedback = self.error_feedback(bucket)
        staged = _stage(self, outputs, inputs)
        prepared = self._prepared_all_reduce.get(bucket)
        if prepared is None:
            prepared = self._prepared_all_reduce[bucket] = prepare_all_reduce_q4(
                staged, dist.ReduceOp.AVG, self.group, group_size=self.spec.group_size, gather_bits=8,
                gather_group_size=self.gather_spec.group_size, topology=self.topology,
                with_error_feedback=feedback is not None, first_hop_bits=self.first_hop_bits,
                hadamard_block=self.hadamard_block)
        handle = prepared(staged, async_op=True, error_feedback=feedback)
        return _AllReduced(handle, staged, outputs, divide_by=1)


def _stage(owner: ReduceScatter, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """The buffer the all-reduce runs in, holding ``inputs`` end to end: the one output itself
    for a bucket of one unit, else a staging buffer from ``owner.allocate``."""
    assert [o.numel() for o in outputs] == [i.numel() for i in inputs], "stage 0 reduces whole buffers"
    if len(inputs) == 1:
        return outputs[0].copy_(inputs[0])
    staged = owner.allocate(sum(x.numel() for x in inputs), dtype=inputs[0].dtype, device=inputs[0].device)
    torch.cat(list(inputs), out=staged)
    return staged


class _AllReduced:
    """A bucket's all-reduce in flight: ``wait()`` divides by ``divide_by`` (the plain SUM's
    world size; 1 when the collective averaged) and, for a staging buffer, copies its parts
    into the outputs."""

    def __init__(self, work: Handle, staged: torch.Tensor, outputs: Sequence[torch.Tensor], *, divide_by: int) -> None:
        self._work, self._staged, self._outputs, self._divide_by = work, staged, list(outputs), divide_by

    def wait(self) -> None:
        if self._work is None:
            return
        self._work.wait()
        if self._divide_by != 1:
            self._staged.div_(self._divide_by)
        if len(self._outputs) > 1:
            for output, part in zip(self._outputs, self._staged.split([o.numel() for o in self._outputs]), strict=True):
                output.copy_(part)
        self._work = self._staged = None
