"""The runtime's communication seam: every byte the runtime moves goes through here.

The runtime never calls a collective directly. It holds one ``CommPlan``, built from the
config, with three pluggable objects (modelled on FSDP2's all-gather / reduce-scatter
objects):

* ``forward_gather``  fills a unit's full flat parameter buffer before forward (and, for
  stages 1 and 2, after each optimizer step);
* ``backward_gather`` fills it again before backward (stage 3);
* ``reduce_scatter``  reduces a bucket of units' flat gradients into this rank's shards.

Each returns a handle with ``wait()`` and is told which unit (or bucket) and phase it
serves, so an implementation may keep per-unit state; ``held_bytes`` reports what it keeps
between uses for ``memory_report()``. The ZeRO++ options are other classes behind the same
seam, chosen by ``build_comm_plan``:

* qwZ (``quantized_comm.QuantizedAllGather``, ``forward_gather`` only): ``zcomm.all_gather_q8``;
* hpZ (``hpz_gather.HpzGather``, ``backward_gather``): keeps a secondary shard over a block
  of consecutive ranks in ``after_forward``, gathers from it in backward over the block's
  group, invalidates its copies in ``weights_changed``;
* qgZ (``quantized_comm.QuantizedReduceScatter``): ``zcomm.reduce_scatter_q4`` per bucket.

``device`` is where every tensor the runtime creates lives: the device of the model's
trainable parameters, which ``initialize`` checks the group's backend supports.

[Note: object collectives on NCCL] ``broadcast_object_list``, ``all_gather_object`` and
``barrier`` on an NCCL group stage their bytes on ``torch.cuda.current_device()``, which is
device 0 on every rank unless the caller ran ``torch.cuda.set_device``: ranks would then
share one GPU, or hang. The plan runs them inside ``torch.cuda.device(self.device)``, so
they use the parameters' GPU whether or not the caller set the current device. zcomm's
topology detection (host names, an object all-gather) runs under the same guard.

``shard_alignment`` lets an option ask for shard sizes that are multiples of some number of
elements (none does today: see [Note: shard alignment] in ``quantized_comm``).

The plain objects call zcomm's counted pass-throughs (``zcomm.all_gather_into_tensor``,
``zcomm.reduce_scatter_tensor``), so ``zcomm.comm_stats()`` sees the runtime's traffic and
plain stage 3 and ZeRO++ are measured by the same counters. ``topology`` (which ranks share
a node) is passed to every collective; hpZ, qwZ and qgZ need it.

[Note: gloo] torch 2.13's gloo backend accepts ``reduce_scatter_tensor`` and
``all_gather_into_tensor`` with async handles (checked), so the runtime needs no fallback of
its own; how gloo runs a reduce-scatter inside (possibly as an all-reduce, twice the wire
traffic) is a torch limitation, and zcomm's counters report the ring volume. The reduction
is always SUM, and callers divide by the world size themselves: gloo's AVG
has been reported wrong, and a SUM keeps the fp32 path bit-reproducible.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass
from typing import Hashable, Protocol

import torch
import torch.distributed as dist

import zcomm

from .config import ZeroConfig
from .hpz_gather import HpzGather
from .quantized_comm import QuantizedAllGather, QuantizedReduceScatter
from .stateless_gather import StatelessGather


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    STEP = "step"  # stages 1 and 2: re-assemble parameters after the optimizer step


class Handle(Protocol):
    def wait(self) -> object: ...


class ParamGather(Protocol):
    def gather(self, full: torch.Tensor, shard: torch.Tensor, *, unit: Hashable, phase: Phase) -> Handle:
        """Start filling ``full`` (all shards, flat) from this rank's ``shard``."""

    def after_forward(self, full: torch.Tensor, shard: torch.Tensor, *, unit: Hashable) -> None:
        """Called with the still-valid full buffer (gathered from ``shard``) just before it is
        freed after forward; no gather of ``unit`` is in flight then."""

    def weights_changed(self) -> None:
        """The shards changed (step, checkpoint or state-dict load): drop derived copies."""

    def held_bytes(self) -> int:
        """Bytes of parameter copies this object keeps between uses (hpZ's secondaries)."""


class GradReduceScatter(Protocol):
    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, *, key: Hashable) -> Handle:
        """Start summing ``full`` across ranks into this rank's ``shard``; ``key`` names the
        bucket (the tuple of its unit indices), stable across steps."""


class PlainAllGather(StatelessGather):
    """Unquantized all-gather over one process group (stage 3's default in both phases)."""

    def __init__(self, group: dist.ProcessGroup, topology: zcomm.Topology | None = None) -> None:
        self.group = group
        self.topology = topology

    def gather(self, full: torch.Tensor, shard: torch.Tensor, *, unit: Hashable, phase: Phase) -> Handle:
        return zcomm.all_gather_into_tensor(full, shard, group=self.group, async_op=True, topology=self.topology)


class PlainReduceScatter:
    """Unquantized SUM reduce-scatter over one process group."""

    def __init__(self, group: dist.ProcessGroup, topology: zcomm.Topology | None = None) -> None:
        self.group = group
        self.topology = topology

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, *, key: Hashable) -> Handle:
        return zcomm.reduce_scatter_tensor(shard, full, op=dist.ReduceOp.SUM, group=self.group, async_op=True,
                                           topology=self.topology)


@dataclass(frozen=True, kw_only=True)
class CommPlan:
    group: dist.ProcessGroup
    forward_gather: ParamGather
    backward_gather: ParamGather
    reduce_scatter: GradReduceScatter
    device: torch.device
    topology: zcomm.Topology | None = None
    shard_alignment: int = 1

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def gathers(self) -> tuple[ParamGather, ...]:
        """The distinct parameter-gather objects of this plan."""
        if self.backward_gather is self.forward_gather:
            return (self.forward_gather,)
        return (self.forward_gather, self.backward_gather)

    def weights_changed(self) -> None:
        for gather in self.gathers():
            gather.weights_changed()

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """SUM of a small tensor of scalars (norms, flags) on ``device``; it returns once the
        reduction is queued (on CUDA, ordered before later work on the current stream)."""
        assert values.device == self.device, (values.device, self.device)
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.group)
        return values

    def exact_all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """Blocking, never-quantized all-gather (fp32 masters for consolidation)."""
        zcomm.all_gather_into_tensor(full, shard, group=self.group, topology=self.topology)

    def barrier(self) -> None:
        with current_device(self.device):
            dist.barrier(group=self.group)

    def broadcast_from_first(self, value: object) -> object:
        """Rank 0's ``value`` on every rank (small Python objects: checkpoint tags)."""
        box = [value]
        with current_device(self.device):
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def all_gather_objects(self, value: object) -> list[object]:
        out: list[object] = [None] * self.world_size
        with current_device(self.device):
            dist.all_gather_object(out, value, group=self.group)
        return out


def current_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` torch's current CUDA device for the block (a no-op off CUDA); see
    [Note: object collectives on NCCL]."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def build_comm_plan(config: ZeroConfig, group: dist.ProcessGroup, topology: zcomm.Topology | None = None, *,
                    device: torch.device) -> CommPlan:
    """The communication objects ``config`` asks for on ``group`` (``topology``: which of
    its ranks share a node; None detects it from the environment or host names), for
    tensors on ``device``.

    Collective: hpZ creates its block group here, so every rank of ``group`` calls this at
    the same point. Raises ``ValueError`` if ``zero_hpz_partition_size`` does not divide the
    world size or its blocks do not line up with nodes.
    """
    # Detected once here, collectively, rather than inside a backward hook.
    if topology is None:
        with current_device(device):
            topology = zcomm.Topology.detect(group)
    plain = PlainAllGather(group, topology)
    forward: ParamGather = plain
    if config.quantized_weights:
        forward = QuantizedAllGather(group, topology, group_size=config.quant_group_size)
    backward: ParamGather = plain
    if config.hpz_partition_size > 1:
        backward = HpzGather(group, topology, partition_size=config.hpz_partition_size, primary=plain)
    reduce: GradReduceScatter = PlainReduceScatter(group, topology)
    if config.quantized_gradients:
        reduce = QuantizedReduceScatter(group, topology, group_size=config.quant_group_size)
    return CommPlan(group=group, forward_gather=forward, backward_gather=backward, reduce_scatter=reduce,
                    device=device, topology=topology)
