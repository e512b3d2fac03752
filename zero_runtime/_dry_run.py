"""Dry run: the real runtime for a few ranks of a world of any size, in one process, without peers.

``python -m zero_runtime.estimate --dry-run --world-size 384 --local-size 8 --config ds.json
--model gpt:layers=4,dim=1024`` runs, for each chosen rank ``r`` in turn, exactly what rank
``r`` of that job runs: ``zero_runtime.initialize`` of the named model (``_dry_run_models``)
with the config, then ``--steps`` optimizer steps of ``gradient_accumulation_steps``
micro-batches each, on torch's fake process group ([Note: fake world] in ``_torch_compat``):
the collectives are issued with the sizes, groups and subgroups of the real job and complete
at once without peers (outputs as if every rank held this rank's input), so the values
computed are no real job's, but every layout, plan and byte count is the real one. It prints, per rank, ``memory_report()`` (the model-state
bytes the rank holds) and, per step, the bytes it sent by op, intra- and inter-node, from
``zcomm.comm_stats`` (its byte model: ring all-gather and reduce-scatter, qwZ's two hops,
qgZ's two all-to-alls; see ``zcomm/comm_stats.py``).

[Note: volume per node] The ZeRO++ paper's volumes (ZeRO-3: 3M per step, ZeRO++: 0.75M
across nodes, M the model's size in 2-byte weights) are what one node sends to the others:
a ring all-gather crosses each node boundary once (only the node's last rank sends across),
while qwZ and qgZ send across from every rank, fewer bytes each. Per rank they differ by
node position, per node they compare. So the default ranks are the ``local_size`` ranks of
node 0, and the report adds up their inter-node bytes per step as node 0's volume, in units
of ``M = 2 x`` the trainable parameters (every node is alike by symmetry: the ranks are
node-major and every node holds the same number).

The first step records stage 3's trace of uses (prefetching and residency follow it from
the second step on), so steps can differ; ``--steps 2`` shows both.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

import zcomm

from ._dry_run_models import build_model
from ._initialize import initialize
from ._memory import MemoryReport
from ._torch_compat import init_fake_world
from .config import ZeroConfig, resolve_config

DEFAULT_LR = 1e-4  # the optimizer a config without an ``optimizer`` section gets: AdamW at this lr


class RankRun(NamedTuple):
    """What one rank did: bytes sent at ``initialize`` and in each step (op -> ``zcomm.OpStats``),
    its ``memory_report()`` after the last step, and how many steps fp16 loss scaling skipped."""

    rank: int
    initialize: dict[str, zcomm.OpStats]
    steps: list[dict[str, zcomm.OpStats]]
    memory: MemoryReport
    skipped_steps: int


class DryRun(NamedTuple):
    topology: zcomm.Topology
    config: ZeroConfig  # as resolved for the world size
    model: str
    parameters: int  # trainable parameters (tied ones once)
    runs: list[RankRun]

    @property
    def model_bytes(self) -> int:
        """M: the model's size in 2-byte (fp16/bf16) weights, the paper's unit."""
        return 2 * self.parameters

    def node_inter_bytes(self, node: int, step: int) -> int | None:
        """Inter-node bytes node ``node``'s ranks sent in ``step`` ([Note: volume per node]);
        None unless every rank of that node ran."""
        ranks = set(self.topology.node_ranks(node))
        mine = [run for run in self.runs if run.rank in ranks]
        if {run.rank for run in mine} != ranks:
            return None
        return sum(stats.inter_bytes for run in mine for stats in run.steps[step].values())


def dry_run(*, config: ZeroConfig | dict | str, model: str, world_size: int, local_size: int,
            ranks: Sequence[int] | None = None, steps: int = 2) -> DryRun:
    """Run ``ranks`` (default: node 0's) of a ``world_size``-rank job with ``local_size`` ranks
    per node, one after the other in this process (module docstring). The process must have no
    process group; each rank's fake world is destroyed after it."""
    topology = zcomm.Topology(world_size=world_size, local_size=local_size)
    ranks = list(topology.node_ranks(0)) if ranks is None else list(ranks)
    if not ranks or any(not 0 <= r < world_size for r in ranks) or len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks must be distinct ranks in [0, {world_size}), got {ranks}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    resolved = resolve_config(config)
    per_world = resolved.for_world_size(world_size)
    runs, parameters = [], 0
    for rank in ranks:
        run, parameters = _run_rank(rank, topology, resolved, per_world, model, steps)
        runs.append(run)
    return DryRun(topology, per_world, model, parameters, runs)


def _run_rank(rank: int, topology: zcomm.Topology, config: ZeroConfig, per_world: ZeroConfig, spec: str,
              steps: int) -> tuple[RankRun, int]:
    init_fake_world(rank, topology.world_size)
    try:
        built = build_model(spec, micro_batch=per_world.train_micro_batch_size_per_gpu)
        parameters = sum(p.numel() for p in {id(p): p for p in built.model.parameters() if p.requires_grad}.values())
        optimizer = None if config.optimizer is not None else functools.partial(torch.optim.AdamW, lr=DEFAULT_LR)
        zcomm.reset_comm_stats()
        model, opt = initialize(built.model, optimizer, config, topology=topology)
        at_init = zcomm.comm_stats()
        per_step = []
        for _ in range(steps):
            zcomm.reset_comm_stats()
            for _ in range(per_world.gradient_accumulation_steps):
                opt.backward(built.loss(model(*built.inputs)))
            opt.step()
            opt.zero_grad()
            per_step.append(zcomm.comm_stats())
        run = RankRun(rank, at_init, per_step, opt.memory_report(), opt.skipped_steps)
        opt.close()
        return run, parameters
    finally:
        dist.destroy_process_group()


def format_report(result: DryRun) -> str:
    """The dry run's printout: the job, each rank's memory and bytes per step, node 0's volume."""
    topo, config, m = result.topology, result.config, result.model_bytes
    zeropp = [name for name, on in (("qwZ", config.quantized_weights),
                                    (f"hpZ {config.hpz_partition_size}", config.hpz_partition_size > 1),
                                    ("qgZ", config.quantized_gradients),
                                    (f"INT{config.weight_delta_bits} weight differences",
                                     config.weight_delta_bits is not None)) if on]
    lines = [
        f"dry run: {topo.world_size} ranks ({topo.num_nodes} nodes x {topo.local_size}), stage {config.stage}"
        f"{' + ' + ', '.join(zeropp) if zeropp else ''}, {config.precision}, micro-batch "
        f"{config.train_micro_batch_size_per_gpu} x {config.gradient_accumulation_steps} accumulation",
        f"model {result.model}: {result.parameters:,} trainable parameters, M = {m:,} bytes (2 bytes each)",
        "bytes each rank sent (zcomm.comm_stats model), intra / inter node; x M in brackets",
    ]
    for run in result.runs:
        lines.append(f"rank {run.rank} (node {topo.node_of(run.rank)}, local rank {topo.local_rank_of(run.rank)})"
                     f"{f', {run.skipped_steps} step(s) skipped by fp16 loss scaling' if run.skipped_steps else ''}")
        lines.extend("  " + line for line in str(run.memory).splitlines())
        lines.extend(_step_lines("initialize", run.initialize, m))
        for step, stats in enumerate(run.steps, 1):
            lines.extend(_step_lines(f"step {step}", stats, m))
    for step in range(len(result.runs[0].steps)):
        total = result.node_inter_bytes(0, step)
        if total is not None:
            lines.append(f"node 0 inter-node bytes, step {step + 1}: {total:,} = {total / m:.3f} M "
                         f"(the sum over its {topo.local_size} ranks)")
    return "\n".join(lines)


def _step_lines(label: str, stats: dict[str, zcomm.OpStats], m: int) -> list[str]:
    intra = sum(s.intra_bytes for s in stats.values())
    inter = sum(s.inter_bytes for s in stats.values())
    lines = [f"  {label}: intra {intra:,} ({intra / m:.3f} M), inter {inter:,} ({inter / m:.3f} M)"]
    for op, s in sorted(stats.items()):
        lines.append(f"    {op:<24} {s.calls:>5} calls  intra {s.intra_bytes:>16,}  inter {s.inter_bytes:>16,}")
    return lines


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The dry run's flags of ``python -m zero_runtime.estimate`` (with ``--world-size`` and ``--local-size``)."""
    group = parser.add_argument_group("dry run (--dry-run)")
    group.add_argument("--dry-run", action="store_true",
                       help="run the real runtime for a few ranks on torch's fake process group and print their "
                            "memory and the bytes of each step")
    group.add_argument("--config", help="DeepSpeed JSON (or zero_runtime config) of the job")
    group.add_argument("--model", default="gpt",
                       help="gpt[:layers=4,dim=512,heads=8,vocab=32000,seq=256], mlp:params=N[,layers=8] or "
                            "package.module:callable returning (model, inputs) (default: gpt)")
    group.add_argument("--rank", type=int, action="append", dest="dry_ranks",
                       help="a rank to run (repeat; default: every rank of node 0)")
    group.add_argument("--steps", type=int, default=2, help="optimizer steps per rank (default 2)")


def run_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.config is None:
        parser.error("--dry-run needs --config (a DeepSpeed JSON)")
    if args.world_size % args.local_size:
        parser.error(f"--world-size {args.world_size} is not a multiple of --local-size {args.local_size}")
    try:
        result = dry_run(config=args.config, model=args.model, world_size=args.world_size,
                         local_size=args.local_size, ranks=args.dry_ranks, steps=args.steps)
    except ValueError as exc:
        parser.error(str(exc))
    print(format_report(result))
