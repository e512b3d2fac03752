"""Per-rank model-state memory of ZeRO stages, from the ZeRO paper's formulas.

Mixed-precision training keeps 2 bytes/parameter of fp16/bf16 weights, 2 of gradients and K
of optimizer state (K = 12 for Adam: fp32 master, momentum, variance). With Nd data-parallel
ranks (the world size; ZeRO paper, section 5 and Figure 1):

    stage 0:  (2 + 2 + K) * P
    stage 1:  (2 + 2) * P + K * P / Nd
    stage 2:  2 * P + (2 + K) * P / Nd
    stage 3:  (2 + 2 + K) * P / Nd

The ``3 + hpZ`` row is ZeRO++'s hierarchical partitioning: stage 3 plus a secondary copy of
the 2-byte weights partitioned over blocks of ``--hpz-partition-size`` ranks (default: the
``--local-size`` ranks of a node), 2 * P / hpz_partition_size: the runtime's
``zero_hpz_partition_size`` and its ``memory_report().secondary_parameters``. It is also the
row for full ZeRO++: qwZ and qgZ add only transient buffers of one unit or bucket.

The ``3 + hpZ + LoCo`` row adds qgZ's LoCo error feedback (``zeropp_loco_param``): INT8 error
buffers that are *not* partitioned, one element per parameter for the first hop plus one
per ``--local-size`` parameters for the second (with more than one node and more than one
rank per node), each with an fp32 scale per ``--loco-group-size`` elements (qgZ's group
size; the runtime's ``memory_report().error_feedback``):

    (1 + 1 / local_size) * P * (1 + 4 / group_size)

    python -m zero_runtime.estimate --params 7e9 --world-size 64 --local-size 8

The flags are named as ``zcomm.Topology`` names them (``world_size``, ``local_size``); the
old spellings ``--ranks`` and ``--ranks-per-node`` are errors that name the new ones.

``--dry-run`` runs the real runtime instead of the formulas: a few ranks of the job, one
after the other in this process, on torch's fake process group, printing each rank's
``memory_report()`` and each step's intra- and inter-node bytes (``zero_runtime._dry_run``):

    python -m zero_runtime.estimate --dry-run --world-size 384 --local-size 8 --config ds.json --model gpt
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, NamedTuple, Sequence

from . import _dry_run


class Estimate(NamedTuple):
    label: str
    parameters: float
    gradients: float
    optimizer_states: float
    secondary: float = 0.0
    error_feedback: float = 0.0

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states + self.secondary + self.error_feedback


def stage_estimate(stage: int, *, params: float, world_size: int, k: float = 12.0) -> Estimate:
    """Bytes per rank for ZeRO ``stage`` (0-3) over ``world_size`` data-parallel ranks."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage must be 0-3, got {stage}")
    if params <= 0 or world_size < 1:
        raise ValueError(f"need params > 0 and world_size >= 1, got {params}, {world_size}")
    shard = params / world_size
    return Estimate(
        label=str(stage),
        parameters=2 * (shard if stage == 3 else params),
        gradients=2 * (shard if stage >= 2 else params),
        optimizer_states=k * (shard if stage >= 1 else params),
    )


def hpz_estimate(*, params: float, world_size: int, partition_size: int, k: float = 12.0) -> Estimate:
    """Stage 3 plus hpZ's secondary weight partition over blocks of ``partition_size`` ranks."""
    base = stage_estimate(3, params=params, world_size=world_size, k=k)
    return base._replace(label="3 + hpZ", secondary=2 * params / partition_size)


def loco_estimate(*, params: float, world_size: int, local_size: int, partition_size: int, group_size: int,
                  k: float = 12.0) -> Estimate:
    """The hpZ row plus LoCo's INT8 error buffers (first hop, and second hop with two hops)."""
    base = hpz_estimate(params=params, world_size=world_size, partition_size=partition_size, k=k)
    hops = 1.0 + (1.0 / local_size if 1 < local_size < world_size else 0.0)
    return base._replace(label="3 + hpZ + LoCo", error_feedback=hops * params * (1.0 + 4.0 / group_size))


Row = Callable[[argparse.Namespace], Estimate]
ROWS: Sequence[Row] = (
    *(lambda a, s=s: stage_estimate(s, params=a.params, world_size=a.world_size, k=a.k) for s in range(4)),
    lambda a: hpz_estimate(params=a.params, world_size=a.world_size, partition_size=a.hpz_partition_size, k=a.k),
    lambda a: loco_estimate(params=a.params, world_size=a.world_size, local_size=a.local_size,
                            partition_size=a.hpz_partition_size, group_size=a.loco_group_size, k=a.k),
)


def format_table(rows: Sequence[Estimate]) -> str:
    gib = float(1 << 30)
    header = (f"{'stage':<14} {'params GiB':>11} {'grads GiB':>10} {'optim GiB':>10} "
              f"{'hpZ 2nd GiB':>12} {'LoCo GiB':>9} {'total GiB':>10}")
    lines = [header]
    for row in rows:
        lines.append(f"{row.label:<14} {row.parameters / gib:>11.2f} {row.gradients / gib:>10.2f} "
                     f"{row.optimizer_states / gib:>10.2f} {row.secondary / gib:>12.2f} "
                     f"{row.error_feedback / gib:>9.2f} {row.total / gib:>10.2f}")
    return "\n".join(lines)


class _Renamed(argparse.Action):
    """An old spelling of a flag: using it is an error that names the new one."""

    def __init__(self, option_strings: Sequence[str], dest: str, *, new: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string} is now {self.new} (named as in zcomm.Topology)")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m zero_runtime.estimate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=float, help="number of model parameters, e.g. 7e9 (not with --dry-run)")
    parser.add_argument("--world-size", type=int, required=True, help="data-parallel ranks (Nd)")
    parser.add_argument("--local-size", type=int, default=8, help="ranks per node (default hpZ partition size)")
    parser.add_argument("--hpz-partition-size", type=int, default=None,
                        help="ranks per hpZ secondary partition (default: --local-size)")
    parser.add_argument("--loco-group-size", type=int, default=512,
                        help="elements per scale of LoCo's INT8 error buffers: qgZ's group size (default 512)")
    parser.add_argument("--k", type=float, default=12.0, help="optimizer bytes per parameter (Adam: 12)")
    parser.add_argument("--ranks", action=_Renamed, new="--world-size")
    parser.add_argument("--ranks-per-node", action=_Renamed, new="--local-size")
    _dry_run.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.dry_run:
        if args.local_size < 1 or args.world_size < 1:
            parser.error("--world-size and --local-size must be >= 1")
        if args.params is not None or args.hpz_partition_size is not None:
            parser.error("--params and --hpz-partition-size are the formulas' inputs: with --dry-run the model "
                         "(--model) and the config (zero_hpz_partition_size) decide them")
        _dry_run.run_from_args(args, parser)
        return
    if args.params is None:
        parser.error("--params is required (or --dry-run with --config)")
    if args.hpz_partition_size is None:
        args.hpz_partition_size = args.local_size
    if args.world_size < 1 or args.local_size < 1 or args.hpz_partition_size < 1 or args.params <= 0:
        parser.error("--params must be > 0 and --world-size/--local-size/--hpz-partition-size >= 1")
    if args.loco_group_size < 2:
        parser.error("--loco-group-size must be >= 2")
    for flag, value in (("--local-size", args.local_size), ("--hpz-partition-size", args.hpz_partition_size)):
        if args.world_size % value:
            parser.error(f"--world-size {args.world_size} is not a multiple of {flag} {value}")
    print(f"model-state memory per rank: {args.params:.3g} parameters, world size {args.world_size} "
          f"({args.local_size} per node, hpZ blocks of {args.hpz_partition_size}), K = {args.k:g}")
    print(format_table([row(args) for row in ROWS]))


if __name__ == "__main__":
    main()
