"""A small, sharp task: plain FSDP2 vs FSDP2 + ``enable_zeropp`` vs our runtime's ZeRO++.

Trains one model, from one seed (``--seed``), on one fixed batch, several ways in one launch,
and prints each step's training loss (the mean over the ranks' slices of the batch) and
each final loss's gap to plain FSDP2. ``fsdp2-zeropp`` is ``zcomm.fsdp.enable_zeropp`` (qwZ +
qgZ, and FSDP2's hpZ: ``reshard_after_forward=<ranks per node>``); ``zeropp`` is the runtime's
stage 3 with qwZ, hpZ and qgZ. qgZ's intra-node hop is INT8 by default in ``enable_zeropp`` and
INT4 (the ZeRO++ paper's) in the runtime, so both run both ways. Each ``fsdp2-zeropp`` row says
how many units ``enable_zeropp`` aligned; ``align_blocks=False`` packs every unit.

The model is a pre-LayerNorm MLP stack (an input Linear, ``BLOCKS`` residual blocks of
``x + fc2(gelu(fc1(LayerNorm(x))))`` at hidden size ``--hidden``, a final LayerNorm and an output
Linear), trained with AdamW at ``LR`` to classify a fixed random batch: every rank holds its
own slice of it, all steps. Small parameters with large gradients (LayerNorm weights, biases)
sit next to large Linear weights in every block, which is where a shared INT4 scale hurts.
``--group-size N`` and ``--hadamard-block B`` add rows with N elements per scale and with
qgZ's Hadamard smoothing; ``--hsdp`` adds ``hsdp`` (FSDP2 on a 2-D mesh, replicate = nodes,
shard = ranks per node) and ``hsdp-zeropp`` (sharded on the node's row of that mesh with
``enable_zeropp(replicate_group=...)``), and the gap of ``hsdp-zeropp`` to ``hsdp``.
Run with 4 ranks as 2 nodes x 2 (from the repository root)::

    ZCOMM_LOCAL_SIZE=2 PYTHONPATH=$PWD python -m torch.distributed.run --standalone \
        --nproc-per-node 4 -m bench.fsdp_sharp_task
"""

from __future__ import annotations

import argparse
import functools
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import zcomm
import zcomm.fsdp
import zero_runtime

BLOCKS, INPUTS, CLASSES = 4, 32, 64
BATCH_PER_RANK, LR, STEPS = 16, 3e-3, 8


class _Block(nn.Module):
    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, width)
        self.fc2 = nn.Linear(width, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class SharpNet(nn.Module):
    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.inp = nn.Linear(INPUTS, hidden)
        self.blocks = nn.ModuleList(_Block(hidden, width) for _ in range(BLOCKS))
        self.norm = nn.LayerNorm(hidden)
        self.out = nn.Linear(hidden, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(self.norm(x))


def _batch(seed: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the one fixed global batch."""
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(world * BATCH_PER_RANK, INPUTS, generator=gen)
    y = torch.randint(0, CLASSES, (world * BATCH_PER_RANK,), generator=gen)
    rows = slice(rank * BATCH_PER_RANK, (rank + 1) * BATCH_PER_RANK)
    return x[rows], y[rows]


def _model(args: argparse.Namespace) -> SharpNet:
    torch.manual_seed(args.seed)
    return SharpNet(args.hidden, args.width)


def _fsdp2(args, topology: zcomm.Topology, settings: dict[str, Any] | None, hsdp: bool = False):
    """FSDP2 (``hsdp``: on the 2-D mesh) on ``args``' model, with ``enable_zeropp(**settings)`` unless
    ``settings`` is None; returns the model, its AdamW and how many units enable_zeropp aligned.

    With zcomm, hpZ is FSDP2's ``reshard_after_forward=<ranks per node>``; its HSDP shards on the
    node's row of the mesh and all-reduces each unit's gradient shard across nodes itself."""
    nodes, local, world = topology.num_nodes, topology.local_size, topology.world_size
    zeropp = settings is not None
    options: dict[str, Any] = {"topology": topology, **(settings or {})}
    if hsdp:
        hybrid = init_device_mesh("cpu", (nodes, local), mesh_dim_names=("replicate", "shard"))
        mesh, reshard = (hybrid["shard"] if zeropp else hybrid), True
        options.update(topology=zcomm.Topology(world_size=local, local_size=local),
                       replicate_group=hybrid.get_group("replicate"),
                       replicate_topology=zcomm.Topology(world_size=nodes, local_size=1))
    else:
        mesh = init_device_mesh("cpu", (world,))
        reshard = local if zeropp and 1 < local < world else True
    model = _model(args)
    for module in [*model.blocks, model]:
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    aligned = zcomm.fsdp.enable_zeropp(model, **options) if zeropp else {}
    return model, torch.optim.AdamW(model.parameters(), lr=LR), f"{sum(aligned.values())}/{len(aligned)}"


def _train(model: nn.Module, opt, batch, backward=torch.Tensor.backward) -> list[float]:
    """The global loss of each of ``STEPS`` steps on ``batch`` (``backward``: the runtime's ``opt.backward``)."""
    losses = []
    for _ in range(STEPS):
        loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
        backward(loss)
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()  # the global batch's loss: the mean of the ranks' equal slices
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses


def _train_runtime(args, topology: zcomm.Topology, batch, settings: dict[str, Any]) -> list[float]:
    """The runtime's ZeRO++; ``settings``: extra ``zero_optimization`` keys."""
    section = {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True,
               "zero_hpz_partition_size": topology.local_size, **settings}
    model, opt = zero_runtime.initialize(_model(args), functools.partial(torch.optim.AdamW, lr=LR),
                                         {"zero_optimization": section}, topology=topology)
    return _train(model, opt, batch, opt.backward)


def _plan(args) -> list[tuple[str, str, dict[str, Any] | None]]:
    """(row name, ``fsdp2`` or ``runtime``, settings) of every row, in the order printed."""
    int8, int4 = {"zcomm_qgz_first_hop_bits": 8}, {"first_hop_bits": 4}
    plan = [("fsdp2", "fsdp2", None), ("fsdp2-zeropp (default: first hop INT8)", "fsdp2", {}),
            ("fsdp2-zeropp, first hop INT4", "fsdp2", int4),
            ("fsdp2-zeropp, first hop INT4, align_blocks=False", "fsdp2", {**int4, "align_blocks": False}),
            ("zeropp (our runtime; default: first hop INT4)", "runtime", {}),
            ("zeropp (our runtime), first hop INT8", "runtime", int8)]  # fmt: skip
    if args.group_size is not None:
        size, ours = args.group_size, {"zcomm_quant_group_size": args.group_size}
        plan += [(f"fsdp2-zeropp group_size={size}", "fsdp2", {"group_size": size}),
                 (f"fsdp2-zeropp group_size={size}, first hop INT4", "fsdp2", {"group_size": size, **int4}),
                 (f"zeropp (our runtime) group_size={size}", "runtime", ours),
                 (f"zeropp (our runtime) group_size={size}, first hop INT8", "runtime", {**ours, **int8})]  # fmt: skip
    if args.hadamard_block is not None:
        block = args.hadamard_block
        plan += [(f"fsdp2-zeropp hadamard_block={block}", "fsdp2", {"hadamard_block": block}),
                 (f"zeropp (our runtime) hadamard_block={block}, first hop INT8", "runtime",
                  {"zcomm_qgz_hadamard_block": block, **int8})]  # fmt: skip
    return plan


def _rows(args, topology: zcomm.Topology, batch) -> dict[str, list[float]]:
    """Every configuration's losses per step, by row name."""
    rows = {}
    for name, kind, settings in _plan(args):
        if kind == "runtime":
            rows[name] = _train_runtime(args, topology, batch, settings)
            continue
        model, opt, aligned = _fsdp2(args, topology, settings)
        rows[name + ("" if settings is None else f" (units aligned: {aligned})")] = _train(model, opt, batch)
    if args.hsdp:
        for name, settings in (("hsdp", None), ("hsdp-zeropp", {})):
            model, opt, _ = _fsdp2(args, topology, settings, hsdp=True)
            rows[name] = _train(model, opt, batch)
    return rows


def _report(args, rows: dict[str, list[float]], topology: zcomm.Topology) -> None:
    print(f"sharp task: {topology.num_nodes} node(s) x {topology.local_size} rank(s), torch {torch.__version__}, "
          f"{BLOCKS} pre-LN residual blocks, hidden {args.hidden}, MLP {args.width}, AdamW lr {LR}, "
          f"{STEPS} steps on one fixed batch of {topology.world_size * BATCH_PER_RANK}, seed {args.seed}")
    print("| config | " + " | ".join(str(s + 1) for s in range(STEPS)) + " | final vs fsdp2 |")
    print("|---|" + "---|" * (STEPS + 1))
    plain = rows["fsdp2"][-1]
    for name, losses in rows.items():
        gap = (losses[-1] - plain) / plain
        print(f"| {name} | " + " | ".join(f"{v:.4f}" for v in losses) + f" | {gap:+.2%} |")
    if "hsdp" in rows:
        plain = rows["hsdp"][-1]
        print(f"hsdp-zeropp's final loss vs hsdp: {(rows['hsdp-zeropp'][-1] - plain) / plain:+.2%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64, help="residual width (LayerNorm size)")
    parser.add_argument("--width", type=int, default=256, help="MLP inner width")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch")
    parser.add_argument("--hadamard-block", type=int, default=None,
                        help="also run fsdp2-zeropp and the runtime with qgZ's Hadamard smoothing in blocks of this size")
    parser.add_argument("--group-size", type=int, default=None,
                        help="also run fsdp2-zeropp and the runtime with this many elements per scale")
    parser.add_argument("--hsdp", action="store_true", help="also run hsdp and hsdp-zeropp (2 or more nodes)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    topology = zcomm.Topology(world_size=world, local_size=int(os.environ.get("ZCOMM_LOCAL_SIZE", "2")))
    rows = _rows(args, topology, _batch(args.seed, rank, world))
    if rank == 0:
        _report(args, rows, topology)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
