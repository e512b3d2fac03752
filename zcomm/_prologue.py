"""The prologue every public zcomm collective runs first: resolve the group, check the tensors.

Errors name the argument and what was found: ``ValueError`` for tensors or settings a
collective cannot work with, ``TypeError`` for arguments of the wrong kind. The
quantization settings are checked by :class:`zcomm.quant.QuantSpec`, which the quantized
collectives build from their ``group_size``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._api import GroupInfo
from .quant import SUPPORTED_DTYPES
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
    """The caller's ``group`` (default: world) and its ``topology`` (default: detected), once
    ``(output, input)`` are checked as the pair of an all-gather (``gather``) or reduce-scatter.

    All-gather: ``output.numel() == world_size * input.numel()``; reduce-scatter: the reverse.
    Quantized collectives also need contiguous fp32/bf16/fp16 tensors of one dtype and device.
    """
    info = _resolve_group(group, topology)
    _check_tensors(output, input, world_size=info.world_size, gather=gather, quantized=quantized)
    return info


def _resolve_group(group: dist.ProcessGroup | None, topology: Topology | None) -> GroupInfo:
    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialized: call init_process_group first")
    group = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this rank is not a member of the given group")
    world_size = dist.get_world_size(group)
    if topology is None:
        topology = Topology.detect(group)
    elif not isinstance(topology, Topology):
        raise TypeError(f"topology must be a zcomm.Topology or None, got {type(topology).__name__}")
    if topology.world_size != world_size:
        raise ValueError(f"topology is for {topology.world_size} ranks but the group has {world_size}")
    return GroupInfo(group, rank, world_size, topology)


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
