"""What one zcomm call costs the host, next to torch's call for the same data (``python -m bench.host_cost``).

A world of one rank with a process group made here (gloo on CPU, NCCL on CUDA); the input is
bf16 on CUDA, fp32 on CPU. After one warm-up call (numba cache, NVRTC compile, NCCL setup) each
row is timed two ways: ``host us``, the median over ``ROUNDS`` rounds of the mean of calls issued
back to back, read before the device is synchronized (the enqueue cost; on CPU the whole call);
``synced us``, the median of calls each followed by a synchronization (one call's latency). A
row's calls fill about ``--budget`` seconds (at least ``--min-calls``, at most ``MAX_CALLS``),
next to its yardstick timed in the same run (the rows: docs/benchmarks.md). ``--launcher
cupy,driver`` times every row under each CUDA kernel launcher, their order alternating from one
size to the next. The thin host path's targets are printed PASS or MISS (nothing asserts);
``--profile`` writes a cProfile of the collectives' host calls.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import platform
import pstats
import statistics
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

import zcomm
import zcomm.quant as q
from bench.harness.flags import parse_size
from bench.harness.table import markdown
from bench.harness.timing import per_call_seconds

GROUP_SIZE = 256
# torch 2.13 renamed the flat collectives (the old names warn); the yardstick is whichever exists
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
ROWS = 4  # payload rows of dequantize / dequant_reduce, chunks of reorder_quantize
DEFAULT_SIZES = "1M,16M"
CPU_QUANTIZE_NUMEL = 1024
CPU_QUANTIZE_TARGET_US = 25.0
# the thin host path's targets on CUDA beyond every op's 2x x.clone(): (call, yardstick) -> most host time, x the yardstick's
CUDA_HOST_TARGETS = {("all_gather_q8", f"dist.{_ALL_GATHER.__name__}"): 1.5,
                     ("reduce_scatter_q4 1 stage", f"dist.{_REDUCE_SCATTER.__name__}"): 2.0,
                     ("reduce_scatter_q4 4 stages", f"dist.{_REDUCE_SCATTER.__name__}"): 2.0,
                     ("reduce_scatter_q4 4 stages", "reduce_scatter_q4 1 stage"): 1.3}  # fmt: skip
BUCKET = 4  # tensors of the coalesced reduce-scatter's bucket
COALESCED = f"reduce_scatter_q4_coalesced x{BUCKET}"
MAX_CALLS = 200  # per row: a GPU's launch queue must not fill
ROUNDS = 5  # host time: the median of this many rounds' means (one descheduled call skews a mean)
PROFILED_CALLS = 100


@dataclass(frozen=True)
class Row:
    """One measured call and its yardstick (``base``), both timed in this run."""

    name: str
    numel: int
    host_us: float
    synced_us: float
    base: str
    base_host_us: float
    base_synced_us: float
    launcher: str = ""  # the CUDA kernel launcher the row ran with ("" on CPU)

    @property
    def host_ratio(self) -> float:
        return self.host_us / self.base_host_us

    @property
    def synced_ratio(self) -> float:
        return self.synced_us / self.base_synced_us


@dataclass(frozen=True)
class Timer:
    """Times a call both ways (module docstring) on one device."""

    device: torch.device
    budget_s: float
    min_calls: int

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def measure(self, call: Callable[[], object]) -> tuple[float, float]:
        """(host us, synced us) per call, after one warm-up call."""

        def median_us(**how) -> float:
            return statistics.median(per_call_seconds({"": call}, sync=self.sync, **how)[""]) * 1e6

        once = max(median_us(rounds=1, synced=True) / 1e6, 1e-7)
        calls = max(self.min_calls, min(MAX_CALLS, int(self.budget_s / 2 / once)))
        return (median_us(rounds=ROUNDS, repeat=max(1, calls // ROUNDS), warmup=0),
                median_us(rounds=calls, warmup=0, synced=True))


def _stages(k: int) -> str:
    return f"reduce_scatter_q4 {k} stage{'s' if k > 1 else ''}"


def _rows(timer: Timer, numel: int, calls: dict[str, Callable[[], object]], pairs: list[tuple[str, str]]) -> list[Row]:
    """Time ``calls`` in their order (each yardstick before the calls next to it), then a row per (call, yardstick)."""
    timed = {name: timer.measure(call) for name, call in calls.items()}
    return [Row(name, numel, *timed[name], base, *timed[base]) for name, base in pairs]


def _op_rows(timer: Timer, numel: int, dtype: torch.dtype) -> list[Row]:
    """Each ``zcomm.quant`` op into a preallocated output next to ``x.clone()``."""
    device = timer.device
    x = torch.randn(numel, device=device).to(dtype)
    payload = q.quantize(x, 8, GROUP_SIZE)
    rows8 = payload.view(1, -1).expand(ROWS, -1).contiguous()
    rows4 = q.quantize(x, 4, GROUP_SIZE).view(1, -1).expand(ROWS, -1).contiguous()
    perm = tuple(reversed(range(ROWS)))
    chunks = q.reorder_quantize(x, perm, ROWS, 4, GROUP_SIZE)
    dequantized = torch.empty(ROWS * numel, dtype=dtype, device=device)
    reduced = torch.empty(numel, dtype=dtype, device=device)
    requantized = q.dequant_reduce(rows4, numel, 4, GROUP_SIZE, requant_chunks=ROWS)
    calls = {
        "x.clone()": x.clone,
        "quantize int8": lambda: q.quantize(x, 8, GROUP_SIZE, out=payload),
        f"dequantize int8 x{ROWS}": lambda: q.dequantize(rows8, numel, 8, GROUP_SIZE, dtype, out=dequantized),
        f"reorder_quantize int4 {ROWS} chunks": lambda: q.reorder_quantize(x, perm, ROWS, 4, GROUP_SIZE, out=chunks),
        f"dequant_reduce int4 x{ROWS}": lambda: q.dequant_reduce(rows4, numel, 4, GROUP_SIZE, dtype=dtype,
                                                                 divide_by=float(ROWS), out=reduced),
        f"dequant_reduce requant int4 x{ROWS}": lambda: q.dequant_reduce(rows4, numel, 4, GROUP_SIZE,
                                                                         requant_chunks=ROWS, out=requantized),
    }  # fmt: skip
    return _rows(timer, numel, calls, [(name, "x.clone()") for name in list(calls)[1:]])


def _bucket(grads: torch.Tensor, out: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A bucket of :data:`BUCKET` tensors on ``grads``' elements: inputs ``grads`` cut rank-major, outputs pieces of ``out``."""
    world, numel = dist.get_world_size(), out.numel()
    sizes = [numel // BUCKET] * (BUCKET - 1) + [numel - numel // BUCKET * (BUCKET - 1)]
    return [piece.contiguous() for piece in grads.view(world, numel).split(sizes, dim=1)], list(out.split(sizes))


def _bucket_calls(grads: torch.Tensor, out: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The runtime's qgZ calls on ``grads``' elements: one coalesced call over a :func:`_bucket`, one with error feedback."""
    inputs, outputs = _bucket(grads, out)
    feedback = zcomm.ErrorFeedback()
    return {
        COALESCED: lambda: zcomm.reduce_scatter_q4_coalesced(outputs, inputs, op=dist.ReduceOp.AVG),
        "reduce_scatter_q4 error feedback": lambda: zcomm.reduce_scatter_q4(
            out, grads, op=dist.ReduceOp.AVG, pipeline_stages=1, error_feedback=feedback),
    }


def _collective_rows(timer: Timer, numel: int, dtype: torch.dtype) -> list[Row]:
    """``all_gather_q8`` and ``reduce_scatter_q4`` (1 and 4 stages) next to torch's call, 4 stages also next
    to 1; the runtime's qgZ calls next to 1 stage; the prepared calls next to the calls they prepare; and
    :mod:`zcomm.fsdp`'s comms of one unit, called as FSDP2 calls them, next to the drop-in collectives."""
    import zcomm.fsdp
    from zcomm.all_gather_q8 import prepare_all_gather_q8
    from zcomm.reduce_scatter_q4 import prepare_reduce_scatter_q4_coalesced

    device, world, group = timer.device, dist.get_world_size(), dist.group.WORLD
    shard = torch.randn(numel, device=device).to(dtype)
    full = torch.empty(world * numel, dtype=dtype, device=device)
    grads = torch.randn(world * numel, device=device).to(dtype)
    out = torch.empty(numel, dtype=dtype, device=device)
    prepared_gather = prepare_all_gather_q8(full, shard)
    inputs, outputs = _bucket(grads, out)
    prepared_reduce = prepare_reduce_scatter_q4_coalesced(outputs, inputs, op=dist.ReduceOp.AVG)
    topologies = zcomm.fsdp._GroupTopologies(group, zcomm.Topology.detect(group))
    common = dict(quantized=True, group_size=None, module_name="bench", layout=None)
    fsdp_gather = zcomm.fsdp.ZeroppAllGather(topologies, **common)
    fsdp_reduce = zcomm.fsdp.ZeroppReduceScatter(topologies, **common)  # first_hop_bits=8, as enable_zeropp's default
    premul = partial(dist._make_nccl_premul_sum, 1.0 / world)  # an op built anew per call, as FSDP2 passes it
    gather, reduce = f"dist.{_ALL_GATHER.__name__}", f"dist.{_REDUCE_SCATTER.__name__}"
    calls = {
        gather: lambda: _ALL_GATHER(full, shard),
        "all_gather_q8": lambda: zcomm.all_gather_q8(full, shard),
        reduce: lambda: _REDUCE_SCATTER(out, grads),
        **{_stages(k): partial(zcomm.reduce_scatter_q4, out, grads, pipeline_stages=k) for k in (1, 4)},
        **_bucket_calls(grads, out),
        "all_gather_q8 prepared": lambda: prepared_gather(full, shard),
        f"{COALESCED} prepared": lambda: prepared_reduce(outputs, inputs),
        "reduce_scatter_q4 premul": lambda: zcomm.reduce_scatter_q4(out, grads, premul(), group, first_hop_bits=8),
        "fsdp all-gather comm": lambda: fsdp_gather(full, shard, group),
        "fsdp reduce-scatter comm": lambda: fsdp_reduce(out, grads, group, premul()),
    }
    return _rows(timer, numel, calls, [
        ("all_gather_q8", gather), (_stages(1), reduce), (_stages(4), reduce), (_stages(4), _stages(1)),
        (COALESCED, _stages(1)), ("reduce_scatter_q4 error feedback", _stages(1)),
        ("all_gather_q8 prepared", "all_gather_q8"), (f"{COALESCED} prepared", COALESCED),
        ("fsdp all-gather comm", "all_gather_q8"), ("fsdp reduce-scatter comm", "reduce_scatter_q4 premul")])


def _all_reduce_rows(timer: Timer, numel: int, dtype: torch.dtype) -> list[Row]:
    """``all_reduce_q4`` (in place, AVG) next to ``dist.all_reduce`` of the same tensor, and its prepared
    form, the call ``zcomm.ddp``'s hook makes per bucket, next to it. At the first size only (the GPU
    report's time budget: [Note: gpu-bench time budget])."""
    tensor = torch.randn(numel, device=timer.device).to(dtype)
    prepared = zcomm.prepare_all_reduce_q4(tensor)
    calls = {"dist.all_reduce": lambda: dist.all_reduce(tensor), "all_reduce_q4": lambda: zcomm.all_reduce_q4(tensor),
             "all_reduce_q4 prepared": lambda: prepared(tensor)}
    return _rows(timer, numel, calls, [("all_reduce_q4", "dist.all_reduce"), ("all_reduce_q4 prepared", "all_reduce_q4")])


def _profile(timer: Timer, numel: int, dtype: torch.dtype, path: str) -> None:
    """Write the top own-time functions of ``PROFILED_CALLS`` host calls of each collective to ``path``."""
    device = timer.device
    shard = torch.randn(numel, device=device).to(dtype)
    full = torch.empty(dist.get_world_size() * numel, dtype=dtype, device=device)
    out = torch.empty(numel, dtype=dtype, device=device)
    calls = {"all_gather_q8": lambda: zcomm.all_gather_q8(full, shard),
             **{_stages(k): partial(zcomm.reduce_scatter_q4, out, full, pipeline_stages=k) for k in (1, 4)},
             **_bucket_calls(full, out)}
    with open(path, "w") as stream:
        for name, call in calls.items():
            call()  # warm: plans, compiled kernels
            timer.sync()
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(PROFILED_CALLS):
                call()
            profiler.disable()
            timer.sync()
            stream.write(f"## {name}, {_size(numel)} elements, {PROFILED_CALLS} calls\n")
            pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(25)


def _targets(device: torch.device, rows: list[Row]) -> list[dict]:
    """The targets this run's rows meet or miss: on CUDA :data:`CUDA_HOST_TARGETS`, on CPU quantize of 1K fp32."""
    found = []
    for row in rows:
        if device.type == "cuda":
            measured, limit = row.host_ratio, 2.0 if row.base == "x.clone()" else CUDA_HOST_TARGETS.get((row.name, row.base))
            launcher = f" [{row.launcher}]" if row.launcher else ""
            label = f"{row.name} {_size(row.numel)}{launcher}: host {measured:.2f}x {row.base} (<= {limit}x)"
        elif (row.name, row.numel) == ("quantize int8", CPU_QUANTIZE_NUMEL):
            measured, limit = row.host_us, CPU_QUANTIZE_TARGET_US
            label = f"quantize {_size(row.numel)} fp32 on cpu: {measured:.1f} us (<= {limit} us)"
        else:
            continue
        if limit is not None:
            found.append({"target": label, "measured": measured, "limit": limit, "met": measured <= limit})
    return found


def _size(numel: int) -> str:
    for suffix, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if numel % scale == 0:
            return f"{numel // scale}{suffix}"
    return str(numel)


def _use_launcher(name: str) -> None:
    if name:
        from zcomm_cuda import loader

        loader.set_launcher(name)


def _rows_per_launcher(timer: Timer, numel: int, dtype: torch.dtype, launchers: list[str], sizes: list[int]) -> list[Row]:
    """Every row of one size under each launcher in turn; the order alternates from one size to the next, so
    that a drift of the machine does not always favour the same launcher."""
    order = launchers if sizes.index(numel) % 2 == 0 else launchers[::-1]
    rows = []
    for name in order:
        _use_launcher(name)
        measured = [*_op_rows(timer, numel, dtype), *_collective_rows(timer, numel, dtype)]
        if numel == sizes[0]:
            measured += _all_reduce_rows(timer, numel, dtype)
        rows += [replace(row, launcher=name) for row in measured]
    return rows


def _launcher_rows(rows: list[Row], launchers: list[str]) -> list[dict]:
    """Per call and size, its host and synced us under each launcher and their ratios to the first launcher's."""
    if len(launchers) < 2:
        return []
    by_key = {(row.name, row.numel, row.base, row.launcher): row for row in rows}
    compared = []
    for first in (row for row in rows if row.launcher == launchers[0]):
        entry = {"name": first.name, "numel": first.numel, "base": first.base}
        for name in launchers:
            other = by_key[(first.name, first.numel, first.base, name)]
            entry |= {f"{name} host_us": other.host_us, f"{name} synced_us": other.synced_us}
            if name != launchers[0]:
                entry |= {f"{name}/{launchers[0]} host": other.host_us / first.host_us,
                          f"{name}/{launchers[0]} synced": other.synced_us / first.synced_us}
        compared.append(entry)
    return compared


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.host_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--sizes", default=None, help=f"elements per input, comma separated (default {DEFAULT_SIZES}; "
                        f"on cpu {_size(CPU_QUANTIZE_NUMEL)} is added for its target)")
    parser.add_argument("--json", default=None, help="also write the rows and targets to this file")
    parser.add_argument("--budget", type=float, default=None, help="seconds per timed row (default: cpu 0.5, cuda 0.3)")
    parser.add_argument("--min-calls", type=int, default=5)
    parser.add_argument("--profile", default=None, metavar="PATH",
                        help="also write a cProfile of the collectives' host calls (first size) to PATH")
    parser.add_argument("--launcher", default=None, metavar="NAMES",
                        help="cuda: measure every row under each of these CUDA kernel launchers, comma separated "
                             "(cupy, driver; default: the one $ZCOMM_CUDA_LAUNCHER picks), with the ratios to "
                             "the first")  # fmt: skip
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device cuda: torch {torch.__version__} sees no CUDA device")
    if args.launcher is not None:
        names = args.launcher.split(",")
        if args.device != "cuda":
            parser.error("--launcher: the launchers launch CUDA kernels; it needs --device cuda")
        allowed = ("cupy", "driver")  # zcomm_cuda.loader.LAUNCHERS (imported only on a CUDA run)
        if any(name not in allowed for name in names) or len(set(names)) != len(names):
            parser.error(f"--launcher {args.launcher!r}: a comma-separated list of distinct names from {allowed}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sizes = [parse_size(s) for s in (args.sizes or DEFAULT_SIZES).split(",")]
    if not cuda and args.sizes is None:
        sizes.insert(0, CPU_QUANTIZE_NUMEL)
    dtype = torch.bfloat16 if cuda else torch.float32
    timer = Timer(device, args.budget if args.budget is not None else (0.3 if cuda else 0.5), args.min_calls)
    started, launchers = time.perf_counter(), [""]
    if cuda:
        from zcomm_cuda import loader

        launchers = args.launcher.split(",") if args.launcher else [loader.launcher()]
    # a world of one rank: gloo on CPU, NCCL bound to the GPU
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                            **({"device_id": device} if cuda else {}))  # fmt: skip
    try:
        rows = [row for numel in sizes for row in _rows_per_launcher(timer, numel, dtype, launchers, sizes)]
        if args.profile:
            _use_launcher(launchers[0])
            _profile(timer, sizes[0], dtype, args.profile)
    finally:
        dist.destroy_process_group()
    targets, compared = _targets(device, rows), _launcher_rows(rows, launchers)
    machine = (torch.cuda.get_device_name(device) if cuda else
               f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch threads {torch.get_num_threads()}")
    print(f"# host cost, world size 1, {device} ({machine}), {dtype}, torch {torch.__version__}")
    for launcher in dict.fromkeys(row.launcher for row in rows):
        if launcher:
            print(f"## CUDA kernel launcher: {launcher}")
        print("\n".join(markdown([
            {"call": r.name, "size": _size(r.numel), "host us": r.host_us, "synced us": r.synced_us, "vs": r.base,
             "vs host us": r.base_host_us, "vs synced us": r.base_synced_us, "host x": r.host_ratio,
             "synced x": r.synced_ratio} for r in rows if r.launcher == launcher])))  # fmt: skip
    if compared:
        print(f"## launchers: host and synced us, and each launcher's over {launchers[0]}'s (this run)")
        print("\n".join(markdown(compared)))
    print("# targets (host ratios of this run)")
    print("\n".join(f"{'PASS' if t['met'] else 'MISS'}  {t['target']}" for t in targets))
    print(f"# {time.perf_counter() - started:.1f} s", flush=True)
    if args.json:
        with open(args.json, "w") as stream:
            json.dump({"device": str(device), "machine": machine, "dtype": str(dtype), "torch": torch.__version__,
                       "rows": [{**asdict(r), "host_ratio": r.host_ratio, "synced_ratio": r.synced_ratio} for r in rows],
                       "targets": targets, "launchers": compared}, stream, indent=1)  # fmt: skip
    return 0
