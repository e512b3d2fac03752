"""Gradient partitioning: grad hooks, gradient buckets and their reduce-scatter.

Every trainable parameter gets a post-accumulate-grad hook. It adds ``param.grad`` into its
unit's flat gradient buffer and drops ``param.grad``. Units are grouped once, at start-up,
into buckets of at most ``reduce_bucket_size`` elements (DeepSpeed's meaning: a unit larger
than that is a bucket alone), in the order their gradients become final.

[Note: bucket order] Every rank must issue the same reduce-scatters in the same order, so
the buckets and their order are fixed before training, not taken from the order hooks
happen to fire in. A unit's gradients are final when those of its first parameter in model
order are (``FlatUnit.position``): backward runs the model in reverse, and a parameter used
twice (a tied embedding and LM head) gets its single AccumulateGrad after both uses. So
buckets follow the units by decreasing position. In stages 2 and 3 (with ``overlap_comm``)
bucket ``k`` is launched (async) as soon as all its units' gradients are final and buckets
``0..k-1`` are launched, so each reduce-scatter overlaps the rest of backward; should a model finish
its gradients in another order, a bucket waits for the ones before it, never the other way.
Stage 1 keeps full gradients and reduce-scatters them once per optimizer step, at the end
of the accumulation boundary's backward. Stage 0 keeps them too and all-reduces them once
per optimizer step, launching each bucket during the boundary's backward (with
``overlap_comm``) as stages 2 and 3 do in every backward (see [Note: stage 0] in
``comm._all_reduce``). ``finish`` launches what is left in the same
order, waits for all handles, and adds each rank's averaged slice (the gradient of the
global-batch mean: the ``ReduceScatter`` averages) into the units' ``grad_shard``.

A bucket of several units is one coalesced collective over the units' flat gradient
buffers: rank r's output is the concatenation of the units' r-th shards, written into one
buffer split per unit. Stage 2's units are already bucket-sized; stage 3's are per module or
fused block, and several of them share a collective.

[Note: last gradient hook of a unit] autograd runs a leaf's AccumulateGrad node once per
backward, after all uses of the parameter contributed (a tied embedding and LM head sum
first), so "all of a unit's hooks fired" means no later autograd node reads those
parameters or gradients. Stage 3 relies on this to free a unit's gathered parameters from
``on_unit_ready``.

[Note: gradient buffer lifetimes] A stage-2/3 unit's ``full_grad`` lives from its first
gradient to the launch of its bucket's reduce-scatter, which keeps the bucket's input alive
until its wait; the interleaved copy of a multi-unit bucket lives only while its collective
is in flight (the plain reduce-scatter's own staging buffer of a multi-unit bucket lives
as long). At most ``MAX_IN_FLIGHT`` buckets are in flight: launching one more first waits
for the oldest and adds its output into the units' ``grad_shard``, so a backward holds the
gradients of a few buckets at a time, never the whole model's (with every bucket in flight
until ``finish``, a 354M-parameter GPT-2 held all 1.4 GB of its fp32 gradients at the end
of backward). When the network is slower than backward this makes backward wait for it,
which it would do at ``finish`` anyway. Stages 0 and 1 keep every ``full_grad`` and zero
it after each reduction. All of them, and each bucket's output, come from the reduce-scatter's
``allocate`` (see [Note: comm buffers] in ``_contract``).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from .._contract import Handle
from .._partition import FlatUnit
from ._plan import CommPlan

MAX_IN_FLIGHT = 2  # buckets; see [Note: gradient buffer lifetimes]


class _InFlight(NamedTuple):
    units: tuple[FlatUnit, ...]
    handle: Handle
    output: torch.Tensor
    inputs: tuple[torch.Tensor, ...]  # kept alive until the collective is done
    shard_numels: list[int]  # each unit's slice of ``output``


class GradReducer:
    def __init__(self, *, units: Sequence[FlatUnit], plan: CommPlan, stage: int, bucket_numel: int,
                 overlap: bool = True, on_unit_ready: Callable[[FlatUnit], None] | None = None,
                 on_shards_final: Callable[[tuple[FlatUnit, ...]], None] | None = None) -> None:
        """``overlap`` (``overlap_comm``): stages 2 and 3 launch buckets during backward, stage 0
        during the backward of an accumulation boundary (``begin_backward``).
        ``on_unit_ready(unit)``: all of ``unit``'s parameter gradients were accumulated.
        ``on_shards_final(units)``: a bucket's reduced slices were added into its units'
        ``grad_shard`` (on a non-boundary micro-step of accumulation they are partial sums)."""
        self.units = list(units)
        self.plan = plan
        self.eager = stage >= 2 and overlap
        self._eager_at_boundary = stage == 0 and overlap
        self.keep_full_grads = stage in (0, 1)
        self.on_unit_ready = on_unit_ready
        self.on_shards_final = on_shards_final
        self.buckets = bucket_units(self.units, bucket_numel)
        # each bucket's shard sizes, resolved once: a bucket's units never change
        self._shard_numels = [[unit.layout.shard_numel for unit in bucket] for bucket in self.buckets]
        self._bucket_of = {unit.index: k for k, bucket in enumerate(self.buckets) for unit in bucket}
        self._pending = [len(bucket) for bucket in self.buckets]  # units whose gradients are not final
        self.launched = 0  # buckets 0..launched-1 were launched in this backward (also for tests)
        self._in_flight: list[_InFlight] = []
        # [Note: gradient hook handles] torch holds a post-accumulate hook from C++, where the
        # garbage collector cannot see it, and the hook's closure holds the unit, which holds
        # the parameter: without remove_hooks() an engine nobody references is never freed.
        self._hook_handles = []
        for unit in self.units:
            if self.keep_full_grads:
                unit.full_grad = self._zeroed_full_grad(unit)
            for slot_index, param in enumerate(unit.params):
                if param.requires_grad:
                    self._hook_handles.append(param.register_post_accumulate_grad_hook(self._hook(unit, slot_index)))

    def begin_backward(self, *, boundary: bool) -> None:
        """Called before each backward: ``boundary`` says whether it ends an accumulation
        window. Stage 0 launches buckets during that backward only; the backward passes before
        it only add into the full gradient buffers."""
        if self._eager_at_boundary:
            self.eager = boundary

    def remove_hooks(self) -> None:
        """Detach this reducer from the parameters: their gradients no longer reach it."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()

    def _hook(self, unit: FlatUnit, slot_index: int) -> Callable[[torch.Tensor], None]:
        slot = unit.layout.slots[slot_index]

        def accumulate(param: torch.Tensor) -> None:
            if unit.full_grad is None:
                unit.full_grad = self._zeroed_full_grad(unit)
            unit.full_grad[slot.offset : slot.offset + slot.numel].view(slot.shape).add_(param.grad)
            param.grad = None
            unit.grads_seen += 1
            if unit.grads_seen == unit.grad_params:
                if self.on_unit_ready is not None:
                    self.on_unit_ready(unit)
                if self.eager:
                    self._unit_final(unit)
        return accumulate

    def _zeroed_full_grad(self, unit: FlatUnit) -> torch.Tensor:
        return self.plan.reduce_scatter.allocate(unit.layout.numel, dtype=unit.dtype, device=self.plan.device).zero_()

    def _unit_final(self, unit: FlatUnit) -> None:
        """See [Note: bucket order]."""
        k = self._bucket_of[unit.index]
        assert k >= self.launched, "a unit's gradients were reduced twice in one backward"
        self._pending[k] -= 1
        while self.launched < len(self.buckets) and self._pending[self.launched] == 0:
            self._launch_next()

    def _launch_next(self) -> None:
        k = self.launched
        units, shard_numels = self.buckets[k], self._shard_numels[k]
        self.launched += 1
        for unit in units:
            if unit.full_grad is None:
                unit.full_grad = self._zeroed_full_grad(unit)
        inputs = tuple(unit.full_grad for unit in units)
        out = self.plan.reduce_scatter.allocate(sum(shard_numels), dtype=units[0].dtype, device=self.plan.device)
        if len(self._in_flight) >= MAX_IN_FLIGHT:
            self._complete(self._in_flight.pop(0))
        handle = self.plan.reduce_scatter(_split(out, shard_numels), inputs, bucket=k)
        self._in_flight.append(_InFlight(units, handle, out, inputs, shard_numels))
        if not self.keep_full_grads:
            for unit in units:
                unit.full_grad = None

    def _complete(self, flight: _InFlight) -> None:
        """Wait for a bucket's collective and add this rank's slices into the units' ``grad_shard``."""
        flight.handle.wait()
        shards = _split(flight.output, flight.shard_numels)
        for unit, shard in zip(flight.units, shards, strict=True):
            unit.grad_shard.add_(shard)
            if self.keep_full_grads:
                unit.full_grad.zero_()
        if self.on_shards_final is not None:
            self.on_shards_final(flight.units)

    def finish(self, *, reduce: bool) -> None:
        """End of a backward: with ``reduce``, launch every bucket not yet launched; then wait
        and accumulate. Stages 0 and 1 pass ``reduce=False`` on non-boundary micro-steps."""
        if reduce:
            while self.launched < len(self.buckets):
                self._launch_next()
        for flight in self._in_flight:
            self._complete(flight)
        self._in_flight.clear()
        self.launched = 0
        self._pending = [len(bucket) for bucket in self.buckets]
        for unit in self.units:
            unit.grads_seen = 0

    def abandon(self) -> None:
        """After a failed backward: wait for the collectives in flight and forget every
        gradient accumulated since the last update, as ``discard`` does."""
        flights, self._in_flight = self._in_flight, []
        for flight in flights:
            flight.handle.wait()
        self.launched = 0
        self._pending = [len(bucket) for bucket in self.buckets]
        self.discard()

    def discard(self) -> None:
        """Forget accumulated gradients (``zero_grad``); nothing may be in flight."""
        assert not self._in_flight and self.launched == 0
        for unit in self.units:
            unit.grad_shard.zero_()
            unit.grads_seen = 0
            if self.keep_full_grads:
                unit.full_grad.zero_()
            else:
                unit.full_grad = None


def _split(output: torch.Tensor, shard_numels: list[int]) -> tuple[torch.Tensor, ...]:
    """``output`` cut into the units' slices; a bucket of one unit (the common case in stage 3,
    where a unit of a large model fills a bucket alone) is ``output`` itself, with no split."""
    return (output,) if len(shard_numels) == 1 else output.split(shard_numels)


def bucket_units(units: Sequence[FlatUnit], bucket_numel: int) -> list[tuple[FlatUnit, ...]]:
    """``units`` by decreasing ``position`` (see [Note: bucket order]), cut into buckets of
    at most ``bucket_numel`` elements; a larger unit is a bucket alone."""
    buckets: list[list[FlatUnit]] = []
    size = 0
    for unit in sorted(units, key=lambda u: u.position, reverse=True):
        if not buckets or size + unit.layout.numel > bucket_numel:
            buckets.append([])
            size = 0
        buckets[-1].append(unit)
        size += unit.layout.numel
    return [tuple(bucket) for bucket in buckets]
