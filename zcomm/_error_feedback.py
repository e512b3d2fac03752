"""LoCo error feedback for ``reduce_scatter_q4`` (arXiv 2407.04480; DeepSpeed's ``zeropp_loco_param``).

INT4 rounds each element by up to half its group's scale, and a gradient that is reduced
the same way step after step is rounded the same way step after step: the bias adds up
in the optimizer. Error feedback remembers what was rounded away and adds it back before
the next quantization, so the *time average* of what the collective delivers converges
to the exact reduction.

For each hop that quantizes on this rank (hop 1: this rank's reordered input, ``W * k * q``
elements; hop 2: its node's partial sums, ``N * k * q``), the state keeps an error ``e`` of
that size. A call quantizes ``y = x + e`` instead of ``x`` and then sets
``e <- err_beta * e + (1 - err_beta) * (y - dequant(quant(y)))`` (LoCo's moving average,
DeepSpeed's update). Summed over ``T`` calls on the same ``x`` the delivered values are
``T * x + (e_0 - e_T) / (1 - err_beta)`` (the terms telescope), so their mean is off by at
most ``2 * max|e| / (T * (1 - err_beta))`` instead of a fixed rounding error. Every
``reset_T`` calls both errors restart from zero (LoCo's periodic reset; DeepSpeed counts
reductions of every tensor, this state counts the calls it takes part in).

[Note: error buffers in INT8] Between calls ``e`` is stored as blocked INT8 (the
collective's group size, fp32 scales): a quarter of fp32's memory, as LoCo and DeepSpeed
store it. Storing rounds ``e`` by half an INT8 step of its group (``absmax(e) / 254``),
which is small next to the INT4 error ``e`` compensates.

The collective stays stateless: only a caller that passes an :class:`ErrorFeedback` gets
this behaviour, and one object must follow one stream of reductions of the same shape
(for instance one gradient bucket), never two calls at once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import torch

from . import quant

_BITS = 4
_STORE_BITS = 8


class ErrorFeedback:
    """LoCo state of one stream of ``reduce_scatter_q4`` calls (see the module docstring).

    Args:
        err_beta: weight of the previous error in its moving average, in ``[0, 1)``
            (DeepSpeed's default 0.8).
        reset_T: the errors restart from zero every this many calls (>= 1, DeepSpeed's
            default 1024).

    The buffers are created by the first call, on its input's device, and bound to its
    geometry (elements, world, stages, group size): a later call of another geometry raises
    ``ValueError``. ``state_dict`` / ``load_state_dict`` carry the INT8 buffers and the call
    count, so a resumed run continues bit for bit; ``nbytes`` is what the buffers occupy.
    """

    def __init__(self, err_beta: float = 0.8, reset_T: int = 1024) -> None:
        if isinstance(err_beta, bool) or not isinstance(err_beta, (int, float)) or not 0.0 <= err_beta < 1.0:
            raise ValueError(f"err_beta must be a number in [0, 1), got {err_beta!r}")
        if isinstance(reset_T, bool) or not isinstance(reset_T, int) or reset_T < 1:
            raise ValueError(f"reset_T must be an int >= 1, got {reset_T!r}")
        self.err_beta = float(err_beta)
        self.reset_T = reset_T
        self.calls = 0
        self._geometry: tuple[int, ...] | None = None
        self._stored: dict[str, torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._stored.values())

    def state_dict(self) -> dict[str, Any]:
        return {"err_beta": self.err_beta, "reset_T": self.reset_T, "calls": self.calls,
                "geometry": self._geometry, "buffers": dict(self._stored)}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if (state["err_beta"], state["reset_T"]) != (self.err_beta, self.reset_T):
            raise ValueError(f"checkpointed error feedback has err_beta={state['err_beta']}, reset_T="
                             f"{state['reset_T']}; this one {self.err_beta}, {self.reset_T}")
        self.calls = int(state["calls"])
        self._geometry = None if state["geometry"] is None else tuple(state["geometry"])
        self._stored = {name: buffer.clone() for name, buffer in state["buffers"].items()}

    # -- used by reduce_scatter_q4's chain -------------------------------------------------
    # [Note: feedback kernels] These run inside the collective's chain, on its plan's backend
    # kernels (``kernels``: the plan's ``quantize``, ``dequantize``, ``reorder_quantize``), as the
    # chain's own steps do ([Note: qgZ direct kernels] in zcomm.reduce_scatter_q4): the plan
    # fixed the sizes and the group size, the collective's prologue checked the tensors, and
    # ``bind`` the geometry, so the public ops' checks are not run again on every call. The
    # stored buffers are the one input that did not come through those checks (a loaded
    # state): ``begin`` checks their size and device, once per call and hop.

    def bind(self, geometry: tuple[int, ...]) -> None:
        """Checked on the caller's thread when a call starts: the first call's geometry is this state's."""
        if self._geometry is None:
            self._geometry = geometry
        elif self._geometry != geometry:
            raise ValueError(f"this ErrorFeedback serves reduce_scatter_q4 calls of geometry {self._geometry} "
                             f"(elements per slice, world, nodes, stages, group size), got {geometry}: use "
                             "one ErrorFeedback per stream of same-shaped reductions")

    def begin(self, hop_numels: Sequence[int], group_size: int, device: torch.device,
              kernels: Any) -> list[torch.Tensor]:
        """The fp32 errors of this call, one per hop (zeros on the first call and after a reset)."""
        fresh = self.calls % self.reset_T == 0 or not self._stored
        self.calls += 1
        if fresh:
            return [torch.zeros(n, dtype=torch.float32, device=device) for n in hop_numels]
        errors = []
        for i, n in enumerate(hop_numels):
            stored = self._stored[f"hop{i}"]
            nbytes = _nbytes(n, _STORE_BITS, group_size)
            if stored.device != device or stored.dtype != torch.uint8 or stored.numel() != nbytes:
                raise ValueError(f"stored error hop{i} is {stored.numel()} {stored.dtype} bytes on {stored.device}; this "
                                 f"call needs {nbytes} uint8 bytes on {device} (load the state onto the collective's "
                                 "device)")
            error = torch.empty(n, dtype=torch.float32, device=device)
            kernels.dequantize(stored.view(1, nbytes), n, _STORE_BITS, group_size, error)
            errors.append(error)
        return errors

    def end(self, errors: Sequence[torch.Tensor], group_size: int, kernels: Any) -> None:
        """Store this call's updated errors in INT8 ([Note: error buffers in INT8])."""
        stored = {}
        for i, error in enumerate(errors):
            payload = torch.empty(_nbytes(error.numel(), _STORE_BITS, group_size), dtype=torch.uint8,
                                  device=error.device)
            kernels.quantize(error, _STORE_BITS, group_size, payload)
            stored[f"hop{i}"] = payload
        self._stored = stored

    def compensate_input(self, reordered: torch.Tensor, error: torch.Tensor, rows: torch.Tensor, group_size: int,
                         kernels: Any) -> None:
        """Hop 1: quantize ``x + error`` into ``rows`` (2-D uint8, every stage's rows) and update
        ``error`` (fp32, 1-D) in place, where ``x`` is ``reordered`` (:func:`reordered_view`),
        chunk by chunk ([Note: feedback in chunks])."""
        stages, per_stage = reordered.shape[:2]
        row_shape = reordered.shape[2:]
        row_numel = error.numel() // (stages * per_stage)
        chunk = _chunk_rows(stages * per_stage, per_stage)
        buffers = torch.empty((2, chunk * row_numel), dtype=torch.float32, device=error.device)
        for stage in range(stages):
            for first in range(0, per_stage, chunk):
                count = min(chunk, per_stage - first)
                row, numel = stage * per_stage + first, count * row_numel
                values = buffers[0, :numel]
                values.view(count, *row_shape).copy_(reordered[stage, first : first + count])
                self._compensate(values, error[row * row_numel : row * row_numel + numel], rows[row : row + count],
                                 buffers[1, :numel], group_size, kernels)

    def compensate_quantize(self, values: torch.Tensor, error: torch.Tensor, num_rows: int,
                            group_size: int, kernels: Any) -> torch.Tensor:
        """Hop 2: quantize ``values + error`` (fp32, 1-D; ``values`` is the caller's scratch and is
        overwritten) into ``num_rows`` INT4 payloads and update ``error`` in place, chunk by chunk."""
        numel = values.numel()
        row = numel // num_rows
        rows = torch.empty((num_rows, _nbytes(row, _BITS, group_size)), dtype=torch.uint8, device=values.device)
        chunk = _chunk_rows(num_rows, num_rows)
        restored = torch.empty(chunk * row, dtype=torch.float32, device=values.device)
        for first in range(0, num_rows, chunk):
            count = min(chunk, num_rows - first)
            lo, hi = first * row, (first + count) * row
            self._compensate(values[lo:hi], error[lo:hi], rows[first : first + count], restored[: hi - lo], group_size,
                             kernels)
        return rows

    def _compensate(self, values: torch.Tensor, error: torch.Tensor, rows: torch.Tensor, restored: torch.Tensor,
                    group_size: int, kernels: Any) -> None:
        """``rows`` (whole payloads) = ``values + error`` quantized; ``error`` updated; ``values`` and
        ``restored`` (fp32 scratch of the same size) overwritten."""
        compensated = values.add_(error)
        num_rows = rows.shape[0]
        kernels.reorder_quantize([compensated], 1, compensated.numel(), _identity(num_rows), num_rows, _BITS,
                                 group_size, rows)
        kernels.dequantize(rows, compensated.numel() // num_rows, _BITS, group_size, restored)
        error.mul_(self.err_beta).add_(compensated.sub_(restored), alpha=1.0 - self.err_beta)


# [Note: feedback in chunks] Error feedback needs, besides the fp32 error itself, the compensated
# values ``y = x + e`` and their quantized-and-restored image, both fp32. Every payload row is
# quantized and restored on its own, and every element's update reads only its own ``x``, ``e``
# and restored value, so the work is done over chunks of whole rows (about 1/_CHUNKS of them,
# within one stage), through two fp32 scratch buffers of one chunk reused for every chunk: the
# bytes and the error are those of the whole tensor at once, the temporaries a fraction of it.
# The reordered input is never built either: each chunk copies its rows from a strided view of
# the input (converting to fp32 on the way).
_CHUNKS = 4


def _chunk_rows(num_rows: int, per_stage: int) -> int:
    """Rows per chunk: about ``num_rows / _CHUNKS``, at least one, at most a stage's ``per_stage``."""
    return max(1, min(per_stage, num_rows // _CHUNKS))


def chunk_row_counts(num_rows: int, per_stage: int) -> tuple[int, ...]:
    """The row counts of the chunks a compensation of ``num_rows`` rows, ``per_stage`` to a stage,
    quantizes at once: the chunk, and a stage's last, shorter chunk if there is one (what a
    plan lists as the kernels' uses, [Note: feedback kernels])."""
    chunk = _chunk_rows(num_rows, per_stage)
    return (chunk,) if per_stage % chunk == 0 else (chunk, per_stage % chunk)


@lru_cache(maxsize=256)
def _nbytes(numel: int, bits: int, group_size: int) -> int:
    """``quant.payload_nbytes``, looked up: a stream of reductions asks for the same few sizes."""
    return quant.payload_nbytes(numel, bits, group_size)


@lru_cache(maxsize=256)
def _identity(num_rows: int) -> tuple[int, ...]:
    """The identity order of ``num_rows`` slices: rows quantized where they are."""
    return tuple(range(num_rows))


def reordered_view(inputs: Sequence[torch.Tensor], num_nodes: int, local_size: int, stages: int,
                   slice_numel: int) -> torch.Tensor:
    """The input hop 1 quantizes, as a view ``[stage][row of the stage][row's elements]`` in the
    inputs' dtype: every input's slice ``r`` end to end, zero-filled to ``slice_numel``, cut into
    ``stages`` parts and reordered as :func:`zcomm._slice_reorder.reorder_permutation` orders them
    (what the reorder kernel reads in place on the path without feedback). Its rows are step 1's
    payload rows: ``local_size`` rows of ``(num_nodes, part)`` per stage, or with one rank per
    node ``num_nodes`` rows of ``part``.

    That order, stage-major, then destination local rank, then destination node, is a transpose
    of the ``(node, local rank, stage, part)`` view of the input: no copy, no index tensor. Only
    a bucket of several inputs, or a slice not cut into equal parts, is first laid out
    (zero-filled) in one buffer of the inputs' dtype.
    """
    world_size = num_nodes * local_size
    first = inputs[0]
    if len(inputs) == 1 and first.numel() == world_size * slice_numel:
        virtual = first
    else:
        virtual = torch.zeros(world_size, slice_numel, dtype=first.dtype, device=first.device)
        offset = 0
        for tensor in inputs:
            piece = tensor.view(world_size, -1)
            virtual[:, offset : offset + piece.shape[1]] = piece
            offset += piece.shape[1]
    ordered = virtual.view(num_nodes, local_size, stages, slice_numel // stages).permute(2, 1, 0, 3)
    return ordered if local_size > 1 else ordered[:, 0]
