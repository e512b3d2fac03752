"""The prologue every public zcomm collective runs first: resolve the group, check the tensors.

:func:`prologue` checks one (output, input) pair, :func:`prologue_coalesced` the lists of a
coalesced collective (pairwise as :func:`prologue` does, and one dtype and device for all).
The quantized collectives run them when they make a call's plan, not on the calls that find
one ([Note: one plan per call] in :mod:`zcomm._plan`); :func:`coalesced_key` is the part of
a coalesced call's plan key its tensors make.

Errors name the argument and what was found: ``ValueError`` for tensors or settings a
collective cannot work with, ``TypeError`` for arguments of the wrong kind. The
quantization settings are checked by :class:`zcomm.quant.QuantSpec`, which the quantized
collectives build from their ``group_size``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ._contract import GroupInfo
from ._device_guard import check_distinct_gpus
from .quant import SUPPORTED_DTYPES
from .quant._plain import PLAIN_TENSORS
from .topology import Topology


def prologue(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None,
    topology: Topology | None,
    *,
    gather: bool,
    quantized: bool,
) -> GroupInfo:
    """This rank, the size and the ``topology`` (default: detected) of the caller's ``group``
    (default: world), once ``(output, input)`` are checked as the pair of an all-gather
    (``gather``) or reduce-scatter.

    All-gather: ``output.numel() == world_size * input.numel()``; reduce-scatter: the reverse.
    Quantized collectives also need contiguous fp32/bf16/fp16 tensors of one dtype and device.
    """
    info = resolve_group(group, topology, _device_of(input))
    _check_tensors(output, input, world_size=info.world_size, gather=gather, quantized=quantized)
    return info


def coalesced_key(
    outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], gather: bool, topology: Topology | None
) -> tuple | None:
    """The plan key of a coalesced call's tensors, or None where they are not all plain contiguous
    tensors of one dtype and device in lists or tuples of one non-zero length.

    The shape of a coalesced call is every pair's sizes, in order, with the one dtype and
    device they share: one pass over the tensors, no checks raised from it (any tensor that
    does not fit the key sends the call through the full checks, which raise for the exact
    reason)."""
    if type(outputs) not in (list, tuple) or type(inputs) not in (list, tuple):
        return None
    if not inputs or len(outputs) != len(inputs) or type(inputs[0]) not in PLAIN_TENSORS:
        return None
    dtype, device = inputs[0].dtype, inputs[0].device
    numels = []
    for tensor in (*outputs, *inputs):
        if type(tensor) not in PLAIN_TENSORS or tensor.dtype != dtype or tensor.device != device:
            return None
        if not tensor.is_contiguous():
            return None
        numels.append(tensor.numel())
    return ("coalesced", gather, topology, dtype, device, *numels)


def prologue_coalesced(
    outputs: Sequence[torch.Tensor],
    inputs: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    topology: Topology | None,
    *,
    gather: bool,
) -> GroupInfo:
    """:func:`prologue` for the lists of a quantized coalesced collective: ``outputs[i]`` and
    ``inputs[i]`` are checked as one pair, and every tensor must share ``inputs[0]``'s dtype and device."""
    info = resolve_group(group, topology, _device_of(inputs[0] if isinstance(inputs, Sequence) and inputs else None))
    for name, tensors in (("outputs", outputs), ("inputs", inputs)):
        if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
            raise TypeError(f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")
    if not inputs or len(outputs) != len(inputs):
        raise ValueError(f"outputs and inputs must be non-empty and of one length, got {len(outputs)} and {len(inputs)}")
    for index, (output, input) in enumerate(zip(outputs, inputs, strict=True)):
        try:
            _check_tensors(output, input, world_size=info.world_size, gather=gather, quantized=True)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"pair {index}: {exc}") from None
        if input.dtype != inputs[0].dtype or input.device != inputs[0].device:
            raise ValueError(
                f"pair {index} is {input.dtype} on {input.device} but pair 0 is {inputs[0].dtype} on {inputs[0].device}"
            )
    return info


def _device_of(tensor: object) -> torch.device | None:
    return tensor.device if isinstance(tensor, torch.Tensor) else None


def resolve_group(group: dist.ProcessGroup | None, topology: Topology | None,
                  device: torch.device | None = None) -> GroupInfo:
    """The caller's group resolved; on CUDA tensors (``device``) also the rank's GPU checked once per
    group, before any collective ([Note: device guards] in :mod:`zcomm._device_guard`)."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
    group = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this rank is not a member of the given group")
    world_size = dist.get_world_size(group)
    if device is not None and device.type == "cuda":
        check_distinct_gpus(group, device)
    if topology is None:
        topology = Topology.detect(group, device=device)
    elif not isinstance(topology, Topology):
        raise TypeError(f"topology must be a zcomm.Topology or None, got {type(topology).__name__}")
    if topology.world_size != world_size:
        raise ValueError(f"topology is for {topology.world_size} ranks but the group has {world_size}")
    return GroupInfo(rank, world_size, topology)


def _check_tensors(
    output: torch.Tensor, input: torch.Tensor, *, world_size: int, gather: bool, quantized: bool
) -> None:
    for name, tensor in (("output", output), ("input", input)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    big, small = ("output", "input") if gather else ("input", "output")
    big_t, small_t = (output, input) if gather else (input, output)
    if big_t.numel() != world_size * small_t.numel():
        raise ValueError(
            f"{big}.numel() must be world size ({world_size}) x {small}.numel() ({small_t.numel()}), "
            f"got {big_t.numel()}"
        )
    if not quantized:
        return
    for name, tensor in (("output", output), ("input", input)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"{name} has dtype {tensor.dtype}; supported: fp32, bf16, fp16")
    if output.dtype != input.dtype:
        raise ValueError(f"output and input dtypes differ: {output.dtype} vs {input.dtype}")
    if output.device != input.device:
        raise ValueError(f"output and input devices differ: {output.device} vs {input.device}")
