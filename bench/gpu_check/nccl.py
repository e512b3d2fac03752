"""gpu-check's NCCL stage: one rank per GPU, every collective byte-identical to the same call on CPU tensors.

``torchrun --nproc-per-node=G -m bench.gpu_check.nccl --json PATH`` (two machines, the flight recorder:
docs/gpu-check.md): w4's cases and checks, over an NCCL group with a gloo group of the same ranks for
the CPU side, on the detected topology and on 2 pretend nodes (so that the second hop runs over NCCL
on one machine), under each CUDA kernel launcher; then ZeRO++ and FSDP2 with ``zcomm.fsdp.enable_zeropp``.
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Any, Sequence

import torch
import torch.distributed as dist

from bench.gpu_check import w4
from bench.harness.rank_exit import leave

LAUNCHERS = ("cupy", "driver")


def topologies(world: int, local: int) -> list[tuple[str, Any]]:
    """(label, topology) of the cases: zcomm's detected one (None), and 2 pretend nodes when they differ."""
    import zcomm

    found = [(f"detected ({world // local} node(s) x {local})", None)]
    if world % 2 == 0 and local != world // 2:
        found.append((f"2 nodes x {world // 2}", zcomm.Topology(world_size=world, local_size=world // 2)))
    return found


def train_fsdp2(device: torch.device, mesh: Any, topology: Any, cpu_group: Any) -> list[float]:
    """Per-step global losses of FSDP2 (one unit per block and the root) with zcomm's collectives."""
    from torch.distributed.fsdp import fully_shard

    import zcomm.fsdp

    model = w4.tiny_gpt(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    zcomm.fsdp.enable_zeropp(model, topology=topology)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def update(loss: torch.Tensor) -> None:
        loss.backward()
        opt.step()
        opt.zero_grad()

    return w4.global_mean(w4.train_steps(model, device, update), cpu_group)


def run_checks(device: torch.device, cpu_group: Any, dtypes: Sequence[str], local: int,
               launchers: Sequence[str | None] = LAUNCHERS) -> list[dict]:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    import zcomm

    world = dist.get_world_size()
    checks = []
    for label, topology in topologies(world, local):
        for name, make, options in w4._cases(dtypes, both_modes=True):
            case = functools.partial(w4.check_case, make, options, topology, device, (None, cpu_group), launchers)
            checks.append(w4.checked(f"{name}, {label}", case))
    nodes = zcomm.Topology(world_size=world, local_size=local)
    checks.append(w4.compare_losses(
        f"zero_runtime ZeRO++ (qwZ + hpZ {local} + qgZ), {w4.STEPS} steps, fp32",
        lambda: w4.train_zeropp(device, nodes, cpu_group=cpu_group),
        lambda: w4.train_zeropp(torch.device("cpu"), nodes, group=cpu_group, cpu_group=cpu_group)))
    checks.append(w4.compare_losses(
        f"FSDP2 + zcomm.fsdp.enable_zeropp, {w4.STEPS} steps, fp32",
        lambda: train_fsdp2(device, init_device_mesh(device.type, (world,)), nodes, cpu_group),
        lambda: train_fsdp2(torch.device("cpu"), DeviceMesh.from_group(cpu_group, "cpu"), nodes, cpu_group)))
    return checks


def build_parser() -> argparse.ArgumentParser:
    return w4.torchrun_parser("nccl", __doc__, 60.0)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def run(device: torch.device, cpu_group: Any) -> list[dict]:
        launchers = LAUNCHERS if device.type == "cuda" else (None,)
        return run_checks(device, cpu_group, args.dtypes, int(os.environ["LOCAL_WORLD_SIZE"]), launchers)

    return w4.torchrun_main("nccl", args, "nccl" if args.device == "cuda" else "gloo", run, local_device=True)


if __name__ == "__main__":
    leave(main())
