"""The runtime's communication contracts: the objects every parameter and gradient byte goes through.

The runtime never calls a collective directly. It holds one ``CommPlan`` (``comm._plan``)
with three objects that implement the contracts below, modelled on FSDP2's ``AllGather``
and ``ReduceScatter`` (``torch/distributed/fsdp/_fully_shard/_fsdp_api.py``): ``allocate``
makes the buffers the runtime hands an object per call, and calling the object starts the
collective and returns a ``Handle``. Unlike FSDP2's, an object owns its process group and
node layout (hpZ gathers over a block group of its own), always runs asynchronously, and
is told which unit and phase a gather serves, so that it may keep per-unit state.

* an ``AllGather`` fills a unit's full flat parameter buffer from this rank's shard: before
  forward, before backward (stage 3), and after each optimizer step (stages 1 and 2);
* a ``ReduceScatter`` averages a bucket's flat gradients over the ranks into this rank's
  shards, taking the bucket as the list of its units' gradient buffers (coalesced, as
  ``torch.distributed.reduce_scatter_tensor_coalesced``), so an implementation that can read
  them where they are (qgZ's reordering kernel) never builds the bucket.

This module imports nothing of the runtime: the implementations (``comm._plain``,
``comm._quantized``, ``comm._hpz_gather``) and their users (``_stage3``, ``comm._grad_reduce``,
``optimizer``) import it, never the other way.

[Note: comm buffers] Buffers made per call go through the object's ``allocate``: the
reduce-scatter's input and output for each bucket, the compute-dtype shard stages 1 and 2
gather from after a step, hpZ's secondary shards. A unit's full parameter buffer does not:
stage 3 frees and refills its *storage* in place, because autograd holds views of it
(``weight.t()`` saved by a linear) that must see the next gather's values (see
[Note: freeing stage-3 parameters] in ``_partition``). FSDP2 instead gathers into a buffer
from ``allocate`` and copies out into the parameters' storage, a copy per gather that the
runtime does not make.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Hashable, Sequence
from typing import Any, Protocol

import torch


class Phase(enum.Enum):
    """Why a unit's parameters are gathered."""

    FORWARD = "forward"
    BACKWARD = "backward"
    STEP = "step"  # stages 1 and 2: re-assemble parameters after the optimizer step


class Handle(Protocol):
    """An asynchronous collective in flight (``torch.distributed.Work`` is one)."""

    def wait(self) -> object: ...


class Comm:
    """What every communication object does: place the buffers it is handed."""

    def allocate(self, numel: int, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialized flat buffer for one call (see [Note: comm buffers]). An
        implementation whose collective prefers some memory (a registered pool) overrides it."""
        return torch.empty(numel, dtype=dtype, device=device)


class AllGather(Comm, abc.ABC):
    """Fills a unit's full flat parameter buffer from the shards of all ranks.

    Only ``__call__`` is required; the other methods are hooks for an implementation that
    keeps parameter copies between uses (hpZ), and do nothing by default.
    """

    @abc.abstractmethod
    def __call__(self, output: torch.Tensor, input: torch.Tensor, *, unit: Hashable, phase: Phase) -> Handle:
        """Start filling ``output`` (every rank's shard in rank order, flat) from this rank's
        ``input``; ``unit`` names the unit, stable across steps."""

    def after_forward(self, full: torch.Tensor, shard: torch.Tensor, *, unit: Hashable) -> None:
        """Called with the still-valid full buffer (gathered from ``shard``) just before it is
        freed after forward; no gather of ``unit`` is in flight then."""

    def weights_changed(self) -> None:
        """The shards changed (step, checkpoint or state-dict load): drop derived copies."""

    def weights_replaced(self) -> None:
        """The weights were replaced other than by a step (a checkpoint or state-dict load, a
        ``GatheredParameters`` block): a gather that sends what changed against values the
        ranks hold must next send the values themselves."""

    def held_bytes(self) -> int:
        """Bytes of parameter copies this object keeps between uses."""
        return 0


class ReduceScatter(Comm, abc.ABC):
    """Averages flat gradients over the ranks into each rank's equal slice of each.

    Only ``__call__`` is required; the other methods are hooks for an implementation that
    keeps state between calls (LoCo's error feedback), and hold nothing by default.
    """

    @abc.abstractmethod
    def __call__(self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], *, bucket: int) -> Handle:
        """Start averaging each of ``inputs`` over the ranks into ``outputs[i]``, this rank's
        ``1 / world_size`` slice of ``inputs[i]`` (in stage 0, a partition of one, the whole of
        it: an all-reduce). After the handle's ``wait()`` the outputs
        hold the mean over the ranks (the gradient of the global-batch mean); how and in which
        precision it divides is the implementation's (see [Note: gloo and SUM] in ``comm._plan``).
        ``inputs`` stay alive and unmodified until then. ``bucket`` names the gradient bucket,
        stable across steps."""

    def held_bytes(self) -> int:
        """Bytes of state this object keeps between calls."""
        return 0

    def state_dict(self) -> dict[str, Any]:
        """The state a checkpoint must carry for a resumed run to continue bit for bit."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, but the checkpoint holds some "
                             f"({', '.join(map(str, state))}): was it written with zeropp_loco_param?")
