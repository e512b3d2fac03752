"""Argument checking and group/topology resolution shared by the zcomm collectives.

Errors name the argument and what was found: ``ValueError`` for tensors or settings a
collective cannot work with, ``TypeError`` for arguments of the wrong kind.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._api import GroupInfo
from .quant import SUPPORTED_DTYPES
from .topology import Topology


def resolve_group(group: dist.ProcessGroup | None, topology: Topology | None) -> GroupInfo:
    """The group (default: world), this rank in it and its topology (default: detected)."""
    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialized: call init_process_group first")
    group = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("this rank is not a member of the given group")
    world = dist.get_world_size(group)
    if topology is None:
        topology = Topology.detect(group)
    elif not isinstance(topology, Topology):
        raise TypeError(f"topology must be a zcomm.Topology or None, got {type(topology).__name__}")
    if topology.world_size != world:
        raise ValueError(f"topology is for {topology.world_size} ranks but the group has {world}")
    return GroupInfo(group, rank, world, topology)


def check_tensors(output: torch.Tensor, input: torch.Tensor, *, world: int, gather: bool, quantized: bool) -> None:
    """Check a (output, input) pair of an all-gather (``gather``) or reduce-scatter.

    All-gather: ``output.numel() == world * input.numel()``; reduce-scatter: the reverse.
    Quantized collectives also need contiguous fp32/bf16/fp16 tensors of one dtype and device.
    """
    for name, tensor in (("output", output), ("input", input)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    big, small = ("output", "input") if gather else ("input", "output")
    big_t, small_t = (output, input) if gather else (input, output)
    if big_t.numel() != world * small_t.numel():
        raise ValueError(
            f"{big}.numel() must be world size ({world}) x {small}.numel() ({small_t.numel()}), got {big_t.numel()}"
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


def check_group_size(group_size: int, bits: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int or None, got {group_size!r}")
    if group_size < 2 or (bits == 4 and group_size % 2):
        kind = "an even int >= 2" if bits == 4 else "an int >= 2"
        raise ValueError(f"group_size must be {kind} for INT{bits}, got {group_size}")
