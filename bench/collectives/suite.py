"""The collectives suite's run under any launcher ``bench.harness.dist_env`` knows (mpirun, torchrun,
``bench.simcluster``; docs/benchmarks.md): per (op, size), the buffers on the rank's device, ``-w``
warm-up and ``-n`` timed calls, the node's wire counters around them (under the cluster launcher),
then the check of the last output. Rank 0 prints each row as it completes, then the comparison,
and writes the JSON.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from tqdm import tqdm

from bench.harness import dist_env
from bench.harness.bandwidth import algbw_gbps, busbw_gbps
from bench.harness.timing import reduce_over_ranks, time_collective
from bench.harness.wire import read_wire_bytes

from . import report
from .catalog import COLLECTIVES, Case, build_case
from .cli import parse_config

SEED = 0  # of every rank's inputs (bench/PERFORMANCE.md, #wrong)


def _wire_counter(env: dist_env.DistEnv) -> Callable[[], int] | None:
    if read_wire_bytes() is None:
        return None
    # Every rank of a node reads the same counters: let one of them report the node's bytes.
    return lambda: read_wire_bytes()[0] if env.first_in_node else 0


def measure(case: Case, config: argparse.Namespace, env: dist_env.DistEnv) -> report.Row:
    """Time one case, count its wire bytes and its wrong elements."""
    timing = time_collective(case.run, iters=config.iters, warmup=config.warmup, device=case.device,
                             counter=_wire_counter(env))
    (wrong,) = reduce_over_ranks([case.check()], dist.ReduceOp.SUM, device=case.device)
    return report.Row(op=case.label, size_bytes=case.size_bytes, count=case.count, dtype=config.dtype,
                      redop=case.redop, time_us=timing.seconds * 1e6, algbw_gbps=algbw_gbps(case.size_bytes, timing.seconds),
                      busbw_gbps=busbw_gbps(case.kind, case.size_bytes, timing.seconds, env.world_size),
                      wrong=int(wrong), logical_bytes=case.size_bytes, payload_bytes=case.payload_bytes,
                      wire_bytes=timing.counter_delta)


def run_sweep(config: argparse.Namespace, ctx: dist_env.DistContext) -> list[report.Row]:
    """Every (op, stages, size) of ``config``; rank 0 prints each row as it completes."""
    env = ctx.env
    jobs = [(op, stages, size) for op in config.ops for stages in (config.stages if COLLECTIVES[op].pipelined else (None,))
            for size in config.sizes]
    rows = []
    # The bar redraws with carriage returns: only on an interactive stderr, or a log that
    # shares stdout's pipe interleaves it with the table rows.
    show_bar = env.rank == 0 and sys.stderr.isatty()
    for op, stages, size in tqdm(jobs, desc="collectives", disable=not show_bar, file=sys.stderr):
        case = build_case(COLLECTIVES[op], size, env=env, device=ctx.device, dtype=config.torch_dtype, seed=SEED,
                          group_size=config.group_size, stages=stages)
        rows.append(measure(case, config, env))
        if env.rank == 0:
            tqdm.write(report.format_row(rows[-1]), file=sys.stdout)
    return rows


def _print_report(rows: Sequence[report.Row], config: argparse.Namespace, env: dist_env.DistEnv) -> None:
    sections = (
        ("speedup over torch", report.speedups(rows)),
        ("inter-node wire bytes vs a bandwidth-optimal bf16 ring", report.wire_ratios(
            rows, num_nodes=env.num_nodes, local_size=env.local_size, itemsize=config.torch_dtype.itemsize)),
        ("pipelining of reduce_scatter_q4", report.pipelining(rows)),
    )
    for title, lines in sections:
        if lines:
            print(f"\n# {title}\n" + "\n".join(lines))
    if config.json_path:
        report.write_json(rows, config.json_path)


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_config(argv)
    # torch 2.13 renamed the tensor collectives; the names benchmarked here are the ones users call.
    warnings.filterwarnings("ignore", message=r".* is deprecated\. Please use `torch\.distributed\.", category=FutureWarning)
    ctx = dist_env.join(dist_env.detect(), device=config.device, backend=config.backend)
    env = ctx.env
    try:
        if env.rank == 0:
            print(f"# zcomm collectives: {env.world_size} ranks = {env.num_nodes} node(s) x {env.local_size} "
                  f"({env.launcher}), rank 0 on {ctx.device} ({ctx.backend}), dtype {config.dtype}, "
                  f"iters {config.iters}, warmup {config.warmup}, group size {config.group_size or 'zcomm default'}, "
                  f"torch {torch.__version__}\n"
                  "# time = max over ranks of the per-call time; wire = inter-node bytes per call (all nodes)")
            print(report.header(), flush=True)
        rows = run_sweep(config, ctx)
        if env.rank == 0:
            _print_report(rows, config, env)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0
