"""The error of the weights every rank computes with, against the owner's master, over a long run.

Stages 1 and 2 with quantized weights replace the post-step all-gather by qwZ's blocked INT8
values or by 4-bit weight differences ([Note: weight differences] in
``zero_runtime.comm._weight_delta``). Every rank then computes with the gathered *reference*
(each unit's full buffer); a plain gather would have given the owner's master in the compute
dtype. After every step each rank compares the two over the shards it owns, and the ranks
combine their sums; per window of steps the table shows:

- **worst / bound**: the largest ``|reference - master|`` over the format's bound for that
  element, ``absmax(master group) / 254 + eps/2 * |reference|``: qwZ's half step (a group of
  differences whose step would exceed it falls back to qwZ) plus the rounding of the reference
  to the compute dtype. At most 1 when the bound holds.
- **error / weights**: ``||reference - master|| / ||master||`` over the whole model (mean, max).
- **error / update**: ``||reference - master|| / ||master_t - master_(t-1)||`` (mean, max). For
  weight differences the error is one quantization of one step's difference, so this stays flat
  over a run (SDP4Bit's argument); for qwZ it quantizes the weights themselves and follows their size.
- **cos(error, update)**: near 0 when the error has no direction, near -1 when the reference
  lags the master along the way the weights move (a difference too small for its group's step
  is held back until the carried error reaches it).
- **groups fallen back**: the share of weight-difference groups sent as INT8 values instead.

Launched as ``bench.train`` is::

    ZCOMM_LOCAL_SIZE=2 torchrun --standalone --nproc-per-node 4 -m bench.train.weight_error --configs zero2-q zero2-qwd
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from bench.harness.dist_env import DistContext

from .configs import CONFIGS, EngineSetup, engine_config
from .data import ByteCorpus, rank_slice
from .models import model_spec
from .runner import ZeroRunner
from .suite import add_training_args, join, model_config

_QWZ_HALF_STEPS = 2 * 127  # qwZ's INT8 step is absmax / 127; rounding to nearest errs by half of it


@dataclass
class Window:
    """One window of steps, combined over ranks."""

    first: int
    last: int
    worst_over_bound: float = 0.0
    error_over_weights: list[float] = field(default_factory=list)
    error_over_update: list[float] = field(default_factory=list)
    error_update_cosine: list[float] = field(default_factory=list)
    groups: int = 0
    fallback_groups: int = 0

    def row(self) -> str:
        weights, update = self.error_over_weights, self.error_over_update
        fallback = f"{self.fallback_groups / self.groups:.2%}" if self.groups else "-"
        cosine = self.error_update_cosine
        return (f"| {self.first}-{self.last} | {self.worst_over_bound:.3f} | {sum(weights) / len(weights):.2e} | "
                f"{max(weights):.2e} | {sum(update) / len(update):.3f} | {max(update):.3f} | "
                f"{sum(cosine) / len(cosine):+.3f} | {fallback} |")


def _sums(runner: ZeroRunner, previous: list[torch.Tensor]) -> torch.Tensor:
    """This rank's [squared error, squared weights, squared update, error . update, worst error / bound]."""
    opt = runner.opt
    error2 = weights2 = update2 = dot = worst = 0.0
    for unit, before in zip(opt.units, previous, strict=True):
        lo, hi = unit.layout.shard_range(opt.plan.rank)
        want = unit.master.to(unit.full.dtype).float()
        got = unit.full[lo:hi].float()
        size = opt.plan.forward_gather.spec.group_size_for(want.numel())
        groups = torch.nn.functional.pad(want, (0, -want.numel() % size)).view(-1, size)
        half_step = groups.abs().amax(dim=1).repeat_interleave(size)[:want.numel()] / _QWZ_HALF_STEPS
        rounding = got.abs() * torch.finfo(unit.full.dtype).eps / 2
        error = (got - want).abs()
        worst = max(worst, (error / (half_step + rounding).clamp_min(torch.finfo(torch.float32).tiny)).max().item())
        error2 += error.square().sum().item()
        weights2 += want.square().sum().item()
        update = unit.master.float() - before
        update2 += update.square().sum().item()
        dot += ((got - want) * update).sum().item()
    return torch.tensor([error2, weights2, update2, dot, worst], dtype=torch.float64)


def _group_counts(runner: ZeroRunner) -> tuple[int, int]:
    gather = runner.opt.plan.forward_gather
    return getattr(gather, "delta_groups", 0), getattr(gather, "fallback_groups", 0)


def measure(name: str, args: argparse.Namespace, ctx: DistContext, corpus: ByteCorpus) -> list[Window]:
    """Train configuration ``name`` for ``args.steps`` steps; one :class:`Window` per ``args.window`` steps."""
    config, env = CONFIGS[name], ctx.env
    if config.engine != "zero" or config.stage == 3 or not config.quantized_weights:
        raise ValueError(f"{name} gathers no quantized weights after the step (stages 1 and 2 with qwZ only)")
    setup = EngineSetup(lr=args.lr, local_size=env.local_size, world_size=env.world_size, bf16=True,
                        gradient_clipping=0.0, micro_batch=args.batch // env.world_size, device=ctx.device)
    torch.manual_seed(args.seed)
    runner = ZeroRunner(config, model_spec("tinygpt", model_config(args)), engine_config(config, setup), setup)
    windows: list[Window] = []
    try:
        for step in range(args.steps):
            if step % args.window == 0:
                windows.append(Window(first=step + 1, last=min(step + args.window, args.steps)))
            previous = [unit.master.detach().float().clone() for unit in runner.opt.units]
            counts = _group_counts(runner)
            tokens = corpus.train_batch(step, batch=args.batch, seed=args.seed)
            runner.train_step(rank_slice(tokens, ctx.env.rank, ctx.env.world_size).to(ctx.device))
            sums = _sums(runner, previous)
            dist.all_reduce(sums[:4])
            dist.all_reduce(sums[4:], op=dist.ReduceOp.MAX)
            error2, weights2, update2, dot, worst = sums.tolist()
            window = windows[-1]
            window.worst_over_bound = max(window.worst_over_bound, worst)
            window.error_over_weights.append((error2 / weights2) ** 0.5)
            if step > 0 and update2 > 0:  # the first step's gather is exact and has no update before it
                window.error_over_update.append((error2 / update2) ** 0.5)
                window.error_update_cosine.append(dot / (error2 * update2) ** 0.5 if error2 else 0.0)
            after = _group_counts(runner)
            window.groups += after[0] - counts[0]
            window.fallback_groups += after[1] - counts[1]
    finally:
        runner.close()
    return windows


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.train.weight_error", description=__doc__.split("\n")[0])
    parser.add_argument("--configs", nargs="+", default=["zero2-q", "zero2-qwd"])
    parser.add_argument("--window", type=int, default=100, help="steps per table row")
    add_training_args(parser, steps=1000, seq_len=64, d_model=256, batch=4)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.steps < 1 or args.window < 1:
        parser.error("--steps and --window must be >= 1")
    ctx = join(parser, args.batch)
    corpus = ByteCorpus(args.seq_len)
    results = {name: measure(name, args, ctx, corpus) for name in args.configs}
    if ctx.env.rank == 0:
        for name, windows in results.items():
            print(f"\n{name}: bf16 weights, {ctx.env.num_nodes} nodes x {ctx.env.local_size} ranks, seed {args.seed}\n")
            print("| steps | worst / bound | error / weights (mean) | (max) | error / update (mean) | (max) "
                  "| cos(error, update) | groups fallen back |")
            print("|---|---:|---:|---:|---:|---:|---:|---:|")
            for window in windows:
                print(window.row())
        if args.json:
            Path(args.json).write_text(json.dumps({name: [asdict(w) for w in windows] for name, windows in results.items()}))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
