"""gpu-check's NCCL stage: one rank per GPU, every collective byte-identical to the same call on CPU tensors.

``torchrun --nproc-per-node=G -m bench.gpu_check.nccl --json PATH`` (on two machines
``torchrun --nnodes 2 ...``; what it covers and its flight recorder: docs/gpu-check.md). Each
rank binds its GPU (``LOCAL_RANK``), joins an NCCL group whose collectives time out after
``--timeout`` seconds, and a gloo group of the same ranks for the CPU side. Every case of
:func:`bench.gpu_check.w4._cases`, on zcomm's detected topology and on 2 pretend nodes (so
the second hop runs over NCCL on one machine), under each CUDA kernel launcher, is checked
as w4 checks it (:func:`bench.gpu_check.w4.check_case`, the CPU side on the reference
backend); then ZeRO++ and FSDP2 with ``zcomm.fsdp.enable_zeropp`` against the CPU's losses.
"""

from __future__ import annotations

import argparse
import os
import traceback
from pathlib import Path
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
    from bench.train.models import GPTConfig, TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_heads=4, n_layers=2)).to(device)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    zcomm.fsdp.enable_zeropp(model, topology=topology)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    generator = torch.Generator().manual_seed(1)
    world, losses = dist.get_world_size(), []
    for _ in range(w4.STEPS):
        tokens = torch.randint(0, 256, (2 * world, 33), generator=generator)
        loss = model.loss(tokens.view(world, 2, 33)[dist.get_rank()].to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().double().cpu())
    return w4.global_mean(losses, cpu_group)


def run_checks(device: torch.device, cpu_group: Any, dtypes: Sequence[str], local: int,
               launchers: Sequence[str | None] = LAUNCHERS) -> list[dict]:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    import zcomm

    world = dist.get_world_size()
    checks = []
    for label, topology in topologies(world, local):
        for name, make, options in w4._cases(dtypes, both_modes=True):
            try:
                ok, detail = w4.check_case(make, options, topology, device, "reference", (None, cpu_group), launchers)
            except Exception:  # a failing case is reported by name; the others still run
                ok, detail = False, traceback.format_exc(limit=4).strip().splitlines()[-1]
            checks.append({"check": f"{name}, {label}", "ok": ok, "detail": detail})
    nodes = zcomm.Topology(world_size=world, local_size=local)
    checks.append(w4.compare_losses(
        f"zero_runtime ZeRO++ (qwZ + hpZ {local} + qgZ), {w4.STEPS} steps, fp32",
        lambda: w4.train_zeropp(device, nodes, cpu_group=cpu_group),
        lambda: w4.train_zeropp(torch.device("cpu"), nodes, group=cpu_group, cpu_group=cpu_group), "reference"))
    checks.append(w4.compare_losses(
        f"FSDP2 + zcomm.fsdp.enable_zeropp, {w4.STEPS} steps, fp32",
        lambda: train_fsdp2(device, init_device_mesh(device.type, (world,)), nodes, cpu_group),
        lambda: train_fsdp2(torch.device("cpu"), DeviceMesh.from_group(cpu_group, "cpu"), nodes, cpu_group),
        "reference"))
    return checks


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check.nccl", description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="rank 0 writes the checks here")
    parser.add_argument("--dtypes", nargs="+", choices=tuple(w4.DTYPES), default=list(w4.DTYPES))
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a collective may take (default 60)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: gloo and CPU tensors on both sides, the stage's wiring without a GPU")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def run(device: torch.device, cpu_group: Any) -> list[dict]:
        launchers = LAUNCHERS if device.type == "cuda" else (None,)
        return run_checks(device, cpu_group, args.dtypes, int(os.environ["LOCAL_WORLD_SIZE"]), launchers)

    return w4.torchrun_main("nccl", args, "nccl" if args.device == "cuda" else "gloo", run, local_device=True)


if __name__ == "__main__":
    leave(main())
