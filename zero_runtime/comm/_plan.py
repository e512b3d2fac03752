"""The runtime's communication seam: one ``CommPlan`` per run, built from the config.

A plan holds the communication objects the runtime moves parameters and gradients
through (contracts in ``_contract``), chosen by ``build_comm_plan``:

* ``forward_gather``: ``PlainAllGather``, or qwZ's ``QuantizedAllGather``
  (``zcomm.all_gather_q8``, one INT8 gather per unit). It also re-assembles the parameters
  kept whole (stages 1 and 2, stage 3's persistent units) after each optimizer step, so
  with qwZ persistent parameters are gathered in INT8 like every weight forward reads,
  where DeepSpeed gathers them exactly: on the 2x2 simcluster at 200 Mbit/s that took
  ZeRO++ on a 3.2M-parameter GPT from 4.48 to 3.67 MB sent per rank and step, what it
  sends with no persistent parameters at all. With ``zcomm_weight_delta_bits`` in stages 1
  and 2 it is ``WeightDeltaAllGather``: after each step, INT4 or INT8 differences against
  the weights every rank holds ([Note: weight differences] in ``comm._weight_delta``);
* ``backward_gather``: the same plain object, or hpZ's ``HpzGather`` (keeps a secondary
  shard over a block of consecutive ranks after forward and gathers from it in backward
  over the block's own group). With ``zcomm_weight_delta_bits`` in stage 3 (which needs hpZ)
  both gathers are one ``HpzDeltaGather``: node-local references refreshed by differences
  across the blocks, gathered inside the block ([Note: hpZ references] in ``comm._hpz_delta``);
* ``reduce_scatter``: ``PlainReduceScatter``, or qgZ's ``QuantizedReduceScatter``
  (``zcomm.reduce_scatter_q4`` per bucket), on the plan's gradient group. In stage 0 it is
  the all-reduce of a partition of one, ``PlainAllReduce`` or qgZ's ``QuantizedAllReduce``
  (``zcomm.all_reduce_q4`` per bucket; see [Note: stage 0] in ``comm._all_reduce``), and the
  gathers are never called for the step: every rank updates its whole copy.

It also runs the few small collectives that are not parameters or gradients (norms,
checkpoint flags and tags, the exact fp32 gather that consolidates weights). ``device`` is
where every tensor the runtime creates lives: the device of the model's trainable
parameters, which ``initialize`` checks the group's backend supports.

[Note: gradient group] Gradient buckets are reduce-scattered during backward while stage 3
gathers the parameters backward needs next. Collectives on one process group run in the
order they were issued (NCCL runs a communicator's kernels on one stream; gloo queues a
group's work for its own threads), so a gather issued after a bucket's plain reduce-scatter
on the same group would wait for it although it does not need its result. In stage 3 the
plain reduce-scatters therefore run on a group of their own over the same ranks
(``zcomm.consecutive_group(group, world_size)``, created once per group; hpZ over the whole
world would share it), and gathers queue only behind gathers. qgZ needs no such group: its
hops never run on the group it is given but on zcomm's private subgroups of the reduce kind
(and, on CPU, on that kind's own worker), which no gather uses ([Note: kinds] in
``zcomm._contract``), so it takes the plan's group. Stages 1 and 2 gather only after the
reductions and keep one group.

[Note: communicators per rank] Every process group is a communicator with its own buffers
(NCCL) or connections and threads (gloo). A stage-3 ZeRO++ rank on several nodes holds the
world, zcomm's intra- and inter-node groups of each kind (four: gathers and reductions must
not share an order, and on CPU each kind's worker thread must be the only user of its groups)
and hpZ's block; the gradient group above exists only for the plain reduce-scatter. Groups
with the same ranks as another remain where they carry a different order: the gather kind's
intra-node group and hpZ's block of a node (qwZ's chains vs. the runtime's own backward
gathers, issued from different threads on CPU), the world and a kind's group on one node.

[Note: object collectives on NCCL] ``broadcast_object_list``, ``all_gather_object`` and
``barrier`` on an NCCL group stage their bytes on ``torch.cuda.current_device()``, which is
device 0 on every rank unless the caller ran ``torch.cuda.set_device``: ranks would then
share one GPU, or hang. The plan runs them inside ``torch.cuda.device(self.device)``, so
they use the parameters' GPU whether or not the caller set the current device. zcomm's
topology detection (host names, an object all-gather) runs under the same guard.

[Note: gloo and SUM] torch 2.13's gloo backend accepts ``reduce_scatter_tensor`` and
``all_gather_into_tensor`` with async handles (checked), so the runtime needs no fallback of
its own; how gloo runs a reduce-scatter inside (possibly as an all-reduce, twice the wire
traffic) is a torch limitation, and zcomm's counters report the ring volume. The plain
reduce-scatter is a SUM divided by the world size afterwards, in the gradients' dtype:
gloo's AVG has been reported wrong, and a SUM keeps the fp32 path bit-reproducible against
single-process training. qgZ asks zcomm for AVG, which divides inside its fp32 reduction
(see [Note: quantized scale handling] in ``comm._quantized``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

import zcomm
from zcomm.quant import QuantSpec

from .._contract import AllGather, ReduceScatter
from ..config import ZeroConfig
from ._all_reduce import PlainAllReduce, QuantizedAllReduce
from ._hpz_delta import HpzDeltaGather
from ._hpz_gather import HpzGather
from ._plain import PlainAllGather, PlainReduceScatter
from ._quantized import QuantizedAllGather, QuantizedReduceScatter
from ._weight_delta import WeightDeltaAllGather


@dataclass(frozen=True, kw_only=True)
class CommPlan:
    group: dist.ProcessGroup
    forward_gather: AllGather
    backward_gather: AllGather
    reduce_scatter: ReduceScatter
    device: torch.device
    topology: zcomm.Topology

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def gathers(self) -> tuple[AllGather, ...]:
        """The distinct parameter-gather objects of this plan."""
        if self.backward_gather is self.forward_gather:
            return (self.forward_gather,)
        return (self.forward_gather, self.backward_gather)

    def weights_changed(self) -> None:
        for gather in self.gathers():
            gather.weights_changed()

    def weights_replaced(self) -> None:
        for gather in self.gathers():
            gather.weights_replaced()

    def held_bytes(self) -> int:
        """Bytes of parameter copies the gather objects keep between uses (hpZ's secondaries)."""
        return sum(gather.held_bytes() for gather in self.gathers())

    def all_reduce_sum(self, values: torch.Tensor) -> torch.Tensor:
        """SUM of a small tensor of scalars (norms, flags) on ``device``; it returns once the
        reduction is queued (on CUDA, ordered before later work on the current stream)."""
        assert values.device == self.device, (values.device, self.device)
        dist.all_reduce(values, op=dist.ReduceOp.SUM, group=self.group)
        return values

    def exact_all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """Blocking, never-quantized all-gather (fp32 masters for consolidation)."""
        zcomm.all_gather_into_tensor(full, shard, group=self.group, topology=self.topology)

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Blocking, exact broadcast of ``tensor`` from the group's rank ``src``."""
        dist.broadcast(tensor, src=dist.get_global_rank(self.group, src), group=self.group)

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

    Collective: the gradient group and hpZ's block group are created here, so every rank of
    ``group`` calls this at the same point. Raises ``ValueError`` if
    ``zero_hpz_partition_size`` does not divide the world size or its blocks do not line up
    with nodes.
    """
    # Detected once here, collectively, rather than inside a backward hook.
    if topology is None:
        with current_device(device):
            topology = zcomm.Topology.detect(group, device=device if device.type == "cuda" else None)
    forward, backward = _parameter_gathers(config, group, topology)
    gradients = group
    if config.stage == 3 and not config.quantized_gradients:  # see [Note: gradient group]
        gradients = zcomm.consecutive_group(group, dist.get_world_size(group))
    reduce: ReduceScatter = (PlainAllReduce if config.stage == 0 else PlainReduceScatter)(gradients, topology)
    if config.quantized_gradients:
        options = dict(spec=QuantSpec(bits=4, group_size=config.quant_group_size),
                       loco=config.loco and (config.loco.err_beta, config.loco.reset_T),
                       first_hop_bits=config.qgz_first_hop_bits, hadamard_block=config.qgz_hadamard_block)
        if config.stage == 0:
            reduce = QuantizedAllReduce(gradients, topology, **options,
                                        gather_spec=QuantSpec(bits=8, group_size=config.quant_group_size))
        else:
            reduce = QuantizedReduceScatter(gradients, topology, **options)
    return CommPlan(group=group, forward_gather=forward, backward_gather=backward, reduce_scatter=reduce,
                    device=device, topology=topology)


def _parameter_gathers(config: ZeroConfig, group: dist.ProcessGroup,
                       topology: zcomm.Topology) -> tuple[AllGather, AllGather]:
    """The forward and backward ``AllGather`` of ``config``: plain, qwZ, hpZ, weight differences."""
    plain = PlainAllGather(group, topology)
    bits = config.weight_delta_bits
    delta = None if bits is None else QuantSpec(bits=bits, group_size=config.quant_group_size)
    if delta is not None and config.stage == 3:  # the config requires hpZ with it
        both = HpzDeltaGather(group, topology, partition_size=config.hpz_partition_size, spec=delta)
        return both, both
    forward: AllGather = plain
    if delta is not None:
        forward = WeightDeltaAllGather(group, topology, exact=plain, spec=delta)
    elif config.quantized_weights:
        forward = QuantizedAllGather(group, topology, spec=QuantSpec(bits=8, group_size=config.quant_group_size))
    backward: AllGather = plain
    if config.hpz_partition_size > 1:
        backward = HpzGather(group, topology, partition_size=config.hpz_partition_size, primary=plain)
    return forward, backward
