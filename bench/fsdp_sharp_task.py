"""A small, sharp task: plain FSDP2 vs FSDP2 + ``enable_zeropp`` vs our runtime's ZeRO++.

Trains one model, from one seed (``--seed``), on one fixed batch, several ways in one launch,
and prints each step's training loss (the mean over the ranks' slices of the batch) and
each final loss's gap to plain FSDP2:

* ``fsdp2``: plain FSDP2 (``fully_shard`` per residual block and on the root);
* ``fsdp2-zeropp``: the same, with ``zcomm.fsdp.enable_zeropp`` (qwZ + qgZ, and FSDP2's hpZ:
  ``reshard_after_forward=<ranks per node>``), zcomm's default group sizes;
* ``zeropp``: our runtime's ZeRO++ (``zero_runtime``, stage 3 with qwZ, hpZ and qgZ).

qgZ's intra-node hop is INT8 by default in ``enable_zeropp`` and INT4 (the ZeRO++ paper's) in
the runtime, so both run both ways: ``first hop INT4`` / ``INT8`` rows compare like with like.

The model is a pre-LayerNorm MLP stack (an input Linear, ``BLOCKS`` residual blocks of
``x + fc2(gelu(fc1(LayerNorm(x))))`` at hidden size ``--hidden``, a final LayerNorm and an output
Linear), trained with AdamW at ``LR`` to classify a fixed random batch: every rank holds its
own slice of it, all steps. Small parameters with large gradients (LayerNorm weights, biases)
sit next to large Linear weights in every block, which is where a shared INT4 scale hurts.

Run with 4 ranks as 2 nodes x 2 (from the repository root)::

    ZCOMM_LOCAL_SIZE=2 PYTHONPATH=$PWD python -m torch.distributed.run --standalone \
        --nproc-per-node 4 -m bench.fsdp_sharp_task

``fsdp2-zeropp`` with an INT4 first hop runs twice more: with ``align_blocks=False`` (every unit
packed, the layout before aligned blocks) and with the default (each unit aligned where that
adds at most 1/32 of its elements; the row says how many units were). ``--hidden`` and
``--width`` change the shape (at the default 64 / 256 aligning every piece of a block would add
11%, so its small pieces are packed together; at 96 / 1024 full alignment adds 1.4%);
``--group-size N`` adds fsdp2-zeropp and the runtime with ``N`` elements per scale, and
``--hadamard-block B`` both with qgZ's Hadamard smoothing in blocks of ``B`` (each at its
default first hop and at INT8). ``--hsdp`` adds HSDP: ``hsdp`` (FSDP2 on a 2-D mesh, replicate
= nodes, shard = ranks per node) and ``hsdp-zeropp`` (sharded on the 1-D node mesh with
``enable_zeropp(replicate_group=...)``: qwZ and qgZ inside the node, ``zcomm.all_reduce_q4``
across nodes), with the gap of ``hsdp-zeropp`` to ``hsdp``.
"""

from __future__ import annotations

import argparse
import functools
import os

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


def _fsdp2(args, topology: zcomm.Topology, zeropp: bool, **settings) -> tuple[nn.Module, torch.optim.Optimizer, str]:
    """FSDP2 on ``args``' model; with ``zeropp``, enable_zeropp with ``settings`` and FSDP2's hpZ.
    Also says how many units enable_zeropp aligned."""
    mesh = init_device_mesh("cpu", (topology.world_size,))
    reshard = topology.local_size if zeropp and 1 < topology.local_size < topology.world_size else True
    model = _model(args)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    aligned = zcomm.fsdp.enable_zeropp(model, topology=topology, **settings) if zeropp else {}
    return model, torch.optim.AdamW(model.parameters(), lr=LR), f"{sum(aligned.values())}/{len(aligned)}"


def _hsdp(args, topology: zcomm.Topology, zeropp: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    """HSDP on ``args``' model: FSDP2's own on a 2-D mesh, or with ``zeropp`` sharded on the node's
    row of that mesh and ``enable_zeropp`` all-reducing each unit's gradient shard across nodes."""
    nodes, local = topology.num_nodes, topology.local_size
    hybrid = init_device_mesh("cpu", (nodes, local), mesh_dim_names=("replicate", "shard"))
    mesh = hybrid["shard"] if zeropp else hybrid
    model = _model(args)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if zeropp:
        zcomm.fsdp.enable_zeropp(model, topology=zcomm.Topology(world_size=local, local_size=local),
                                 replicate_group=hybrid.get_group("replicate"),
                                 replicate_topology=zcomm.Topology(world_size=nodes, local_size=1))
    return model, torch.optim.AdamW(model.parameters(), lr=LR)


def _train(model: nn.Module, opt, batch, backward=torch.Tensor.backward) -> list[float]:
    """The global loss of each of ``STEPS`` steps on ``batch`` (``backward``: the runtime's ``opt.backward``)."""
    losses = []
    for _ in range(STEPS):
        loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
        backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(_mean(loss))
    return losses


def _train_runtime(args, topology: zcomm.Topology, batch, **settings) -> list[float]:
    """The runtime's ZeRO++; ``settings``: extra ``zero_optimization`` keys."""
    section = {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True,
               "zero_hpz_partition_size": topology.local_size, **settings}
    model, opt = zero_runtime.initialize(_model(args), functools.partial(torch.optim.AdamW, lr=LR),
                                         {"zero_optimization": section}, topology=topology)
    return _train(model, opt, batch, opt.backward)


def _mean(loss: torch.Tensor) -> float:
    """The global batch's loss: the mean of the ranks' (equal-sized) slices."""
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


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
    batch = _batch(args.seed, rank, world)
    rows = _rows(args, topology, batch)
    if rank == 0:
        _report(args, rows, topology)
    dist.barrier()
    dist.destroy_process_group()


def _rows(args, topology: zcomm.Topology, batch) -> dict[str, list[float]]:
    """Every configuration's losses per step, by row name."""
    rows = {}

    def fsdp2(name: str, zeropp: bool, **settings) -> None:
        model, opt, aligned = _fsdp2(args, topology, zeropp, **settings)
        rows[name + (f" (units aligned: {aligned})" if zeropp else "")] = _train(model, opt, batch)

    int8_hop = {"zcomm_qgz_first_hop_bits": 8}
    fsdp2("fsdp2", zeropp=False)
    fsdp2("fsdp2-zeropp (default: first hop INT8)", zeropp=True)
    fsdp2("fsdp2-zeropp, first hop INT4", zeropp=True, first_hop_bits=4)
    fsdp2("fsdp2-zeropp, first hop INT4, align_blocks=False", zeropp=True, first_hop_bits=4, align_blocks=False)
    rows["zeropp (our runtime; default: first hop INT4)"] = _train_runtime(args, topology, batch)
    rows["zeropp (our runtime), first hop INT8"] = _train_runtime(args, topology, batch, **int8_hop)
    if args.group_size is not None:
        size = {"zcomm_quant_group_size": args.group_size}
        fsdp2(f"fsdp2-zeropp group_size={args.group_size}", zeropp=True, group_size=args.group_size)
        fsdp2(f"fsdp2-zeropp group_size={args.group_size}, first hop INT4", zeropp=True,
              group_size=args.group_size, first_hop_bits=4)  # fmt: skip
        rows[f"zeropp (our runtime) group_size={args.group_size}"] = _train_runtime(args, topology, batch, **size)
        rows[f"zeropp (our runtime) group_size={args.group_size}, first hop INT8"] = _train_runtime(
            args, topology, batch, **size, **int8_hop
        )
    if args.hadamard_block is not None:
        block = args.hadamard_block
        fsdp2(f"fsdp2-zeropp hadamard_block={block}", zeropp=True, hadamard_block=block)
        rows[f"zeropp (our runtime) hadamard_block={block}, first hop INT8"] = _train_runtime(
            args, topology, batch, zcomm_qgz_hadamard_block=block, **int8_hop
        )
    if args.hsdp:
        rows["hsdp"] = _train(*_hsdp(args, topology, zeropp=False), batch)
        rows["hsdp-zeropp"] = _train(*_hsdp(args, topology, zeropp=True), batch)
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


if __name__ == "__main__":
    main()
