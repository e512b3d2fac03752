"""qwZ and qgZ: the runtime's quantized communication objects (ZeRO++ sections 3.1, 3.3).

* ``QuantizedAllGather`` is qwZ's forward ``AllGather``: each rank quantizes its shard of a
  unit to blocked INT8 and one ``zcomm.all_gather_q8`` per unit (per module: a unit holds
  one module's parameters) fills the unit's full buffer, halving the bytes of stage 3's
  forward all-gather (and, being hierarchical, sending only ``N - 1`` payloads per rank
  across nodes). Backward gathers stay exact (plain, or hpZ's secondary).
* ``QuantizedReduceScatter`` is qgZ's ``ReduceScatter``: one
  ``zcomm.reduce_scatter_q4_coalesced`` per gradient bucket (hierarchical: INT4 within the
  node, the node's fp32 partial sum re-quantized to INT4 across nodes), a quarter of the
  inter-node bytes of a bf16 ring. The reordering kernel reads the units' gradient buffers
  where they are: the bucket is never copied into one buffer.

Each holds a ``zcomm.quant.QuantSpec`` of its width built from ``zcomm_quant_group_size``;
the spec turns ``"tensor"`` into the concrete group size of each payload
(``QuantSpec.group_size_for``), which is what the collectives take.

[Note: quantized scale handling] qgZ asks for ``op`` AVG: zcomm divides the fp32 sum of the
last hop by the world size before the one rounding to the gradients' dtype, so averaging
costs no extra pass and no extra bf16 rounding (the plain path divides after its SUM, see
[Note: gloo and SUM] in ``comm._plan``); it divides by the number of ranks, never the
number of nodes. Quantization scales are fp32 and travel inside each payload; with
``zcomm_quant_group_size: "tensor"`` a payload (one rank's shard for qwZ, one all-to-all row
of a bucket for qgZ) has a single scale.

[Note: shards are not padded to groups] zcomm lets a payload's last group be short, so no
shard needs padding to whole groups; the layout pads only to keep each group inside one
parameter, and only where that is cheap (see [Note: parameter-aligned blocks] in
``_flat_buffer``): padding every small module (a LayerNorm's 2 x d values) up to whole groups
per rank would send more bytes than it saves.

[Note: runtime-held plans] A unit's (or bucket's) tensors keep their sizes, dtype and device
for the whole run, so each object prepares its collective once per unit or bucket, on the
first call (``zcomm``'s prepared calls: [Note: prepared calls] in ``zcomm.reduce_scatter_q4``),
and later calls skip the collective's prologue, cache keys and option checks; each call still
checks the tensors against the prepared shapes (``ValueError`` if a unit's tensors changed,
which the runtime never does). A unit or bucket is prepared at its first call, which every rank
makes at the same point (preparing may create zcomm's private subgroups, as the first call of
the collective itself would).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist

import zcomm
from zcomm import (
    PreparedAllGatherQ8,
    PreparedReduceScatterQ4,
    prepare_all_gather_q8,
    prepare_reduce_scatter_q4_coalesced,
)
from zcomm.quant import QuantSpec

from .._contract import AllGather, Handle, Phase, ReduceScatter


class QuantizedAllGather(AllGather):
    """qwZ: INT8 blocked all-gather of a unit's shards (forward only)."""

    def __init__(self, group: dist.ProcessGroup, topology: zcomm.Topology, *, spec: QuantSpec) -> None:
        assert spec.bits == 8, spec
        self.group = group
        self.topology = topology
        self.spec = spec
        self._prepared: dict[Hashable, PreparedAllGatherQ8] = {}  # see [Note: runtime-held plans]

    def __call__(self, output: torch.Tensor, input: torch.Tensor, *, unit: Hashable, phase: Phase) -> Handle:
        # [Note: quantize early] all_gather_q8 returns as soon as its chain (quantize, inter- and
        # intra-node hop, dequantize into ``output``) is queued: on zcomm's FIFO worker thread on
        # CPU, on a side stream on CUDA. The scheduler queues prefetched units before it waits
        # for the current one, so their quantization runs while this thread computes and, on
        # CUDA, while the current unit's bytes are on the wire. ``output`` is written only by the
        # chain, and read or freed only after the handle's wait().
        prepared = self._prepared.get(unit)
        if prepared is None:
            prepared = self._prepared[unit] = prepare_all_gather_q8(
                output, input, group=self.group, topology=self.topology, group_size=self.spec.group_size_for(input.numel()))
        return prepared(output, input, async_op=True)


class QuantizedReduceScatter(ReduceScatter):
    """qgZ: one hierarchical INT4 ``reduce_scatter_q4_coalesced`` (AVG) per gradient bucket.

    ``first_hop_bits`` 8 (``zcomm_qgz_first_hop_bits``) sends the intra-node hop in INT8;
    ``hadamard_block`` (``zcomm_qgz_hadamard_block``) rotates the gradients before quantizing.
    With ``loco`` (``zeropp_loco_param``: ``(err_beta, reset_T)``) each bucket keeps its own
    ``zcomm.ErrorFeedback`` (LoCo, both hops), created by the bucket's first reduction; the
    buffers count in ``held_bytes`` and travel in ``state_dict``.
    """

    def __init__(self, group: dist.ProcessGroup, topology: zcomm.Topology, *, spec: QuantSpec,
                 loco: tuple[float, int] | None = None, first_hop_bits: int = 4,
                 hadamard_block: int | None = None) -> None:
        assert spec.bits == 4, spec
        self.group = group
        self.topology = topology
        self.spec = spec
        self.loco = loco
        self.first_hop_bits = first_hop_bits
        self.hadamard_block = hadamard_block
        self.feedback: dict[int, zcomm.ErrorFeedback] = {}
        self._prepared: dict[int, PreparedReduceScatterQ4] = {}  # see [Note: runtime-held plans]

    def error_feedback(self, bucket: int) -> zcomm.ErrorFeedback | None:
        """``bucket``'s LoCo state (made by its first reduction), or None without LoCo."""
        if self.loco is None:
            return None
        if bucket not in self.feedback:
            self.feedback[bucket] = zcomm.ErrorFeedback(*self.loco)
        return self.feedback[bucket]

    def __call__(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], *, bucket: int) -> Handle:
        feedback = self.error_feedback(bucket)
        prepared = self._prepared.get(bucket)
        if prepared is None:
            prepared = self._prepared[bucket] = prepare_reduce_scatter_q4_coalesced(
                outputs, inputs, op=dist.ReduceOp.AVG, group=self.group, topology=self.topology,
                group_size=self.spec.group_size, with_error_feedback=feedback is not None,
                first_hop_bits=self.first_hop_bits, hadamard_block=self.hadamard_block)
        return prepared(outputs, inputs, async_op=True, error_feedback=feedback)

    def held_bytes(self) -> int:
        return sum(feedback.nbytes for feedback in self.feedback.values())

    def state_dict(self) -> dict[str, Any]:
        return {bucket: feedback.state_dict() for bucket, feedback in self.feedback.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.loco is None:
            super().load_state_dict(state)
            return
        loaded = {}
        for bucket, saved in state.items():
            loaded[bucket] = zcomm.ErrorFeedback(*self.loco)
            loaded[bucket].load_state_dict(saved)
        self.feedback = loaded
