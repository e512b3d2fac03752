"""A small, sharp task: plain FSDP2 vs FSDP2 + ``enable_zeropp`` vs our runtime's ZeRO++ (docs/fsdp2.md).

A pre-LayerNorm residual MLP (``BLOCKS`` blocks of ``x + fc2(gelu(fc1(LayerNorm(x))))``) classifies
one fixed random batch, from one seed, trained several ways through ``bench.train``'s runners in one
launch; it prints each step's loss (the mean over the ranks' slices) and each final loss's gap to
plain FSDP2. Small parameters with large gradients (LayerNorm weights, biases) sit next to large
Linear weights in every block, which is where a shared INT4 scale hurts. qgZ's intra-node hop is
INT8 by default in ``enable_zeropp`` and INT4 in the runtime, so both run both ways. Run with 4
ranks as 2 nodes x 2::

    ZCOMM_LOCAL_SIZE=2 PYTHONPATH=$PWD python -m torch.distributed.run --standalone \
        --nproc-per-node 4 -m bench.fsdp_sharp_task
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from bench.harness.table import table
from bench.train.configs import CONFIGS, EngineSetup, engine_config
from bench.train.models import ModelSpec
from bench.train.runner import RUNNERS, Runner

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


def _spec(args: argparse.Namespace) -> ModelSpec:
    def build() -> SharpNet:
        torch.manual_seed(args.seed)
        return SharpNet(args.hidden, args.width)

    return ModelSpec(build=build, loss=lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]),
                     blocks=lambda model: list(model.blocks))  # fmt: skip


def _plan(args: argparse.Namespace) -> list[tuple[str, str, dict[str, Any]]]:
    """(row name, bench.train configuration, options) of every row, in the order printed; the options
    are ``enable_zeropp``'s arguments for FSDP2, extra ``zero_optimization`` keys for the runtime."""
    int8, int4 = {"zcomm_qgz_first_hop_bits": 8}, {"first_hop_bits": 4}
    plan = [("fsdp2", "fsdp2", {}), ("fsdp2-zeropp (default: first hop INT8)", "fsdp2-zeropp", {}),
            ("fsdp2-zeropp, first hop INT4", "fsdp2-zeropp", int4),
            ("fsdp2-zeropp, first hop INT4, align_blocks=False", "fsdp2-zeropp", {**int4, "align_blocks": False}),
            ("zeropp (our runtime; default: first hop INT4)", "zeropp", {}),
            ("zeropp (our runtime), first hop INT8", "zeropp", int8)]  # fmt: skip
    if args.group_size is not None:
        size, ours = args.group_size, {"zcomm_quant_group_size": args.group_size}
        plan += [(f"fsdp2-zeropp group_size={size}", "fsdp2-zeropp", {"group_size": size}),
                 (f"fsdp2-zeropp group_size={size}, first hop INT4", "fsdp2-zeropp", {"group_size": size, **int4}),
                 (f"zeropp (our runtime) group_size={size}", "zeropp", ours),
                 (f"zeropp (our runtime) group_size={size}, first hop INT8", "zeropp", {**ours, **int8})]  # fmt: skip
    if args.hadamard_block is not None:
        block = args.hadamard_block
        plan += [(f"fsdp2-zeropp hadamard_block={block}", "fsdp2-zeropp", {"hadamard_block": block}),
                 (f"zeropp (our runtime) hadamard_block={block}, first hop INT8", "zeropp",
                  {"zcomm_qgz_hadamard_block": block, **int8})]  # fmt: skip
    return plan + ([("hsdp", "hsdp", {}), ("hsdp-zeropp", "hsdp-zeropp", {})] if args.hsdp else [])


def _runner(config_name: str, options: dict[str, Any], spec: ModelSpec, setup: EngineSetup) -> Runner:
    """bench.train's runner of ``config_name`` (fp32, no clipping), its engine config amended by ``options``."""
    config = CONFIGS[config_name]
    settings = engine_config(config, setup)
    settings.get("enable_zeropp" if config.engine == "fsdp2" else "zero_optimization", {}).update(options)
    return RUNNERS[config.engine](config, spec, settings, setup)


def _losses(runner: Runner, batch) -> list[float]:
    """The global batch's loss (the mean of the ranks' equal slices) at each of ``STEPS`` steps."""
    losses = []
    for _ in range(STEPS):
        total = torch.tensor([runner.train_step(batch)])
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return losses


def _report(args, rows: dict[str, list[float]], setup: EngineSetup) -> None:
    nodes, world = setup.world_size // setup.local_size, setup.world_size
    print(f"sharp task: {nodes} node(s) x {setup.local_size} rank(s), torch {torch.__version__}, "
          f"{BLOCKS} pre-LN residual blocks, hidden {args.hidden}, MLP {args.width}, AdamW lr {LR}, "
          f"{STEPS} steps on one fixed batch of {world * BATCH_PER_RANK}, seed {args.seed}")
    plain = rows["fsdp2"][-1]
    print("\n".join(table(["config", *(str(s + 1) for s in range(STEPS)), "final vs fsdp2"],
                          [(name, *(f"{v:.4f}" for v in losses), f"{(losses[-1] - plain) / plain:+.2%}")
                           for name, losses in rows.items()])))  # fmt: skip
    if "hsdp" in rows:
        plain = rows["hsdp"][-1]
        print(f"hsdp-zeropp's final loss vs hsdp: {(rows['hsdp-zeropp'][-1] - plain) / plain:+.2%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=64, help="residual width (LayerNorm size)")
    parser.add_argument("--width", type=int, default=256, help="MLP inner width")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the batch")
    parser.add_argument("--hadamard-block", type=int, help="also rows with qgZ's Hadamard smoothing in blocks of this size")
    parser.add_argument("--group-size", type=int, help="also rows with this many elements per scale")
    parser.add_argument("--hsdp", action="store_true", help="also run hsdp and hsdp-zeropp (2 or more nodes)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    setup = EngineSetup(lr=LR, local_size=int(os.environ.get("ZCOMM_LOCAL_SIZE", "2")), world_size=world, bf16=False,
                        gradient_clipping=0.0, micro_batch=BATCH_PER_RANK, device=torch.device("cpu"))  # fmt: skip
    spec, batch, rows = _spec(args), _batch(args.seed, rank, world), {}
    for name, config, options in _plan(args):
        runner = _runner(config, options, spec, setup)
        if config == "fsdp2-zeropp":
            name += f" (units aligned: {sum(runner.aligned.values())}/{len(runner.aligned)})"
        rows[name] = _losses(runner, batch)
    if rank == 0:
        _report(args, rows, setup)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
