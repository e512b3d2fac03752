"""Host cost benchmark: what one zcomm call costs the host, next to torch's call for the same data.

``python -m bench.host_cost --device {cpu,cuda} [--sizes 1M,16M] [--launcher cupy,driver] [--json PATH]``. The
process is a world of one rank with a process group it creates itself (gloo on CPU, NCCL on
CUDA) and the collectives' input is bf16 on CUDA, fp32 on CPU. Each row is timed two ways,
after one warm-up call (numba cache load, NVRTC compile, NCCL setup):

* ``host us``: the mean wall time per call of calls issued back to back, read before the
  device is synchronized, in 5 rounds of ``n / 5`` calls, the median round: the host's
  enqueue cost (on CPU, where nothing is queued, the whole call);
* ``synced us``: the median wall time of ``n`` calls each followed by a device
  synchronization: the latency of one call, host and device together.

``n`` is chosen per row so the row takes about ``--budget`` seconds (at least
``--min-calls``, at most ``--max-calls``, which also keeps a GPU's launch queue from
filling). Each row stands next to its yardstick measured in the same run: each
``zcomm.quant`` op into a preallocated output next to ``x.clone()``; ``all_gather_q8`` and
``reduce_scatter_q4`` (1 and 4 stages) next to torch's call, 4 stages also next to 1; the
runtime's qgZ calls (``reduce_scatter_q4_coalesced`` of a :data:`BUCKET`-tensor bucket, error
feedback) next to the 1-stage row; the prepared calls next to the calls they prepare; and
:mod:`zcomm.fsdp`'s comms of one unit, called as FSDP2 calls them, next to the drop-in
collectives; at the first size, ``all_reduce_q4`` next to ``dist.all_reduce``, and its
prepared form (the DDP hook's call) next to it. ``--launcher cupy,driver`` (CUDA) measures every row under each CUDA kernel
launcher in turn, the order alternating from one size to the next, and prints them side by
side (docs/benchmarks.md).

The run ends with the targets of the thin host path, each marked PASS or MISS from the host
ratios of this run (on CUDA: every op <= 2x clone, all_gather_q8 <= 1.5x and
reduce_scatter_q4 <= 2x torch's call, 4 stages <= 1.3x one stage; on CPU: quantize of 1K
fp32 elements <= 25 us). These are measurements: nothing here asserts.

``--profile PATH`` then profiles the host side of the collectives (``cProfile``, 100 calls
each of ``all_gather_q8``, ``reduce_scatter_q4`` with 1 and 4 stages, the coalesced form and
the form with error feedback, on the first size)
and writes the functions that cost the most own time to PATH: where the next microseconds
of host time are.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import platform
import pstats
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable

import torch
import torch.distributed as dist

import zcomm
import zcomm.quant as q
from bench.harness.flags import parse_size

GROUP_SIZE = 256
# torch 2.13 renamed the flat collectives (the old names warn); the yardstick is whichever exists
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
ROWS = 4  # payload rows of dequantize / dequant_reduce, chunks of reorder_quantize
DEFAULT_SIZES = "1M,16M"
CPU_QUANTIZE_NUMEL = 1024
CPU_QUANTIZE_TARGET_US = 25.0
BUCKET = 4  # tensors of the coalesced reduce-scatter's bucket
ROUNDS = 5  # host time: the median of this many rounds' means (one descheduled call skews a mean)


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
    max_calls: int

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _calls(self, call: Callable[[], object]) -> int:
        self._sync()
        start = time.perf_counter()
        call()
        self._sync()
        once = max(time.perf_counter() - start, 1e-7)
        return max(self.min_calls, min(self.max_calls, int(self.budget_s / 2 / once)))

    def measure(self, call: Callable[[], object]) -> tuple[float, float]:
        """(host us, synced us) per call, after one warm-up call."""
        call()
        calls = self._calls(call)
        per_round = max(1, calls // ROUNDS)
        host = []
        for _ in range(ROUNDS):
            self._sync()
            start = time.perf_counter()
            for _ in range(per_round):
                call()
            host.append((time.perf_counter() - start) / per_round)
        self._sync()
        synced = []
        for _ in range(calls):
            begin = time.perf_counter()
            call()
            self._sync()
            synced.append(time.perf_counter() - begin)
        return statistics.median(host) * 1e6, statistics.median(synced) * 1e6


def _op_rows(timer: Timer, numel: int, dtype: torch.dtype) -> list[Row]:
    device = timer.device
    x = torch.randn(numel, device=device).to(dtype)
    base = ("x.clone()", *timer.measure(x.clone))
    payload = q.quantize(x, 8, GROUP_SIZE)
    rows8 = payload.view(1, -1).expand(ROWS, -1).contiguous()
    rows4 = q.quantize(x, 4, GROUP_SIZE).view(1, -1).expand(ROWS, -1).contiguous()
    chunks = q.reorder_quantize(x, tuple(reversed(range(ROWS))), ROWS, 4, GROUP_SIZE)
    dequantized = torch.empty(ROWS * numel, dtype=dtype, device=device)
    reduced = torch.empty(numel, dtype=dtype, device=device)
    requantized = q.dequant_reduce(rows4, numel, 4, GROUP_SIZE, requant_chunks=ROWS)
    perm = tuple(reversed(range(ROWS)))
    calls: dict[str, Callable[[], object]] = {
        "quantize int8": lambda: q.quantize(x, 8, GROUP_SIZE, out=payload),
        f"dequantize int8 x{ROWS}": lambda: q.dequantize(rows8, numel, 8, GROUP_SIZE, dtype, out=dequantized),
        f"reorder_quantize int4 {ROWS} chunks": lambda: q.reorder_quantize(x, perm, ROWS, 4, GROUP_SIZE, out=chunks),
        f"dequant_reduce int4 x{ROWS}": lambda: q.dequant_reduce(
            rows4, numel, 4, GROUP_SIZE, dtype=dtype, divide_by=float(ROWS), out=reduced
        ),
        f"dequant_reduce requant int4 x{ROWS}": lambda: q.dequant_reduce(
            rows4, numel, 4, GROUP_SIZE, requant_chunks=ROWS, out=requantized
        ),
    }
    return [Row(name, numel, *timer.measure(call), *base) for name, call in calls.items()]


def _collective_rows(timer: Timer, numel: int, dtype: torch.dtype) -> list[Row]:
    device, world = timer.device, dist.get_world_size()
    shard = torch.randn(numel, device=device).to(dtype)
    full = torch.empty(world * numel, dtype=dtype, device=device)
    gathered = (f"dist.{_ALL_GATHER.__name__}", *timer.measure(lambda: _ALL_GATHER(full, shard)))
    rows = [Row("all_gather_q8", numel, *timer.measure(lambda: zcomm.all_gather_q8(full, shard)), *gathered)]
    grads = torch.randn(world * numel, device=device).to(dtype)
    out = torch.empty(numel, dtype=dtype, device=device)
    reduced = (f"dist.{_REDUCE_SCATTER.__name__}", *timer.measure(lambda: _REDUCE_SCATTER(out, grads)))
    stages = {}
    for k in (1, 4):
        stages[k] = timer.measure(lambda k=k: zcomm.reduce_scatter_q4(out, grads, pipeline_stages=k))
        rows.append(Row(f"reduce_scatter_q4 {k} stage{'s' if k > 1 else ''}", numel, *stages[k], *reduced))
    rows.append(Row("reduce_scatter_q4 4 stages", numel, *stages[4], "reduce_scatter_q4 1 stage", *stages[1]))
    bucket = {}
    for name, call in _bucket_calls(grads, out).items():
        bucket[name] = timer.measure(call)
        rows.append(Row(name, numel, *bucket[name], "reduce_scatter_q4 1 stage", *stages[1]))
    rows += _prepared_rows(timer, numel, full, shard, grads, out, rows[0], bucket[f"reduce_scatter_q4_coalesced x{BUCKET}"])
    rows += _fsdp_rows(timer, numel, full, shard, grads, out, rows[0])
    return rows


def _all_reduce_rows(timer: Timer, numel: int, dtype: torch.dtype) -> list[Row]:
    """``all_reduce_q4`` (in place, AVG) next to ``dist.all_reduce`` of the same tensor, and its
    prepared form, which is the call ``zcomm.ddp``'s hook makes per bucket, next to it. Measured
    at the first size only (the GPU report's time budget: [Note: gpu-bench time budget])."""
    tensor = torch.randn(numel, device=timer.device).to(dtype)
    torch_call = ("dist.all_reduce", *timer.measure(lambda: dist.all_reduce(tensor)))
    quantized = timer.measure(lambda: zcomm.all_reduce_q4(tensor))
    prepared = zcomm.prepare_all_reduce_q4(tensor)
    return [Row("all_reduce_q4", tensor.numel(), *quantized, *torch_call),
            Row("all_reduce_q4 prepared", tensor.numel(), *timer.measure(lambda: prepared(tensor)),
                "all_reduce_q4", *quantized)]


def _fsdp_rows(timer: Timer, numel: int, full: torch.Tensor, shard: torch.Tensor, grads: torch.Tensor,
               out: torch.Tensor, gather_row: Row) -> list[Row]:
    """zcomm.fsdp's comms of one packed unit, called as FSDP2 calls them (the reduce-scatter with a
    ``PREMUL_SUM`` op built anew per call), next to the drop-in collectives with the same options."""
    import zcomm.fsdp

    group = dist.group.WORLD
    topologies = zcomm.fsdp._GroupTopologies(group, zcomm.Topology.detect(group))
    common = dict(quantized=True, group_size=None, module_name="bench", layout=None)
    gather = zcomm.fsdp.ZeroppAllGather(topologies, **common)
    reduce = zcomm.fsdp.ZeroppReduceScatter(topologies, **common)  # first_hop_bits=8, as enable_zeropp's default
    factor = 1.0 / dist.get_world_size()
    drop_in = timer.measure(lambda: zcomm.reduce_scatter_q4(out, grads, dist._make_nccl_premul_sum(factor), group,
                                                            first_hop_bits=8))
    return [
        Row("fsdp all-gather comm", numel, *timer.measure(lambda: gather(full, shard, group)), "all_gather_q8",
            gather_row.host_us, gather_row.synced_us),
        Row("fsdp reduce-scatter comm", numel,
            *timer.measure(lambda: reduce(out, grads, group, dist._make_nccl_premul_sum(factor))),
            "reduce_scatter_q4 premul", *drop_in),
    ]


def _prepared_rows(timer: Timer, numel: int, full: torch.Tensor, shard: torch.Tensor, grads: torch.Tensor,
                   out: torch.Tensor, gather_row: Row, coalesced: tuple[float, float]) -> list[Row]:
    """The prepared calls next to the collective calls they prepare (measured above in this run)."""
    from zcomm.all_gather_q8 import prepare_all_gather_q8
    from zcomm.reduce_scatter_q4 import prepare_reduce_scatter_q4_coalesced

    gather = prepare_all_gather_q8(full, shard)
    inputs, outputs = _bucket(grads, out)
    reduce = prepare_reduce_scatter_q4_coalesced(outputs, inputs, op=dist.ReduceOp.AVG)
    return [
        Row("all_gather_q8 prepared", numel, *timer.measure(lambda: gather(full, shard)), "all_gather_q8",
            gather_row.host_us, gather_row.synced_us),
        Row(f"reduce_scatter_q4_coalesced x{BUCKET} prepared", numel, *timer.measure(lambda: reduce(outputs, inputs)),
            f"reduce_scatter_q4_coalesced x{BUCKET}", *coalesced),
    ]


def _bucket(grads: torch.Tensor, out: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A bucket of :data:`BUCKET` tensors on ``grads``' elements: inputs ``grads`` cut rank-major, outputs pieces of ``out``."""
    world, numel = dist.get_world_size(), out.numel()
    sizes = [numel // BUCKET] * (BUCKET - 1) + [numel - numel // BUCKET * (BUCKET - 1)]
    return [piece.contiguous() for piece in grads.view(world, numel).split(sizes, dim=1)], list(out.split(sizes))


def _bucket_calls(grads: torch.Tensor, out: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The runtime's qgZ calls on ``grads``' elements: one coalesced call over a :func:`_bucket`, and one call
    with error feedback."""
    inputs, outputs = _bucket(grads, out)
    feedback = zcomm.ErrorFeedback()
    return {
        f"reduce_scatter_q4_coalesced x{BUCKET}": lambda: zcomm.reduce_scatter_q4_coalesced(
            outputs, inputs, op=dist.ReduceOp.AVG),
        "reduce_scatter_q4 error feedback": lambda: zcomm.reduce_scatter_q4(
            out, grads, op=dist.ReduceOp.AVG, pipeline_stages=1, error_feedback=feedback),
    }


PROFILED_CALLS = 100


def _profile(device: torch.device, numel: int, dtype: torch.dtype, path: str) -> None:
    """Write the top own-time functions of ``PROFILED_CALLS`` host calls of each collective to ``path``."""
    shard = torch.randn(numel, device=device).to(dtype)
    full = torch.empty(dist.get_world_size() * numel, dtype=dtype, device=device)
    out = torch.empty(numel, dtype=dtype, device=device)
    calls = {
        "all_gather_q8": lambda: zcomm.all_gather_q8(full, shard),
        "reduce_scatter_q4 1 stage": lambda: zcomm.reduce_scatter_q4(out, full, pipeline_stages=1),
        "reduce_scatter_q4 4 stages": lambda: zcomm.reduce_scatter_q4(out, full, pipeline_stages=4),
        **_bucket_calls(full, out),
    }
    text = io.StringIO()
    for name, call in calls.items():
        call()  # warm: plans, compiled kernels
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(PROFILED_CALLS):
            call()
        profiler.disable()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        text.write(f"## {name}, {_size(numel)} elements, {PROFILED_CALLS} calls\n")
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    with open(path, "w") as stream:
        stream.write(text.getvalue())


def _targets(device: torch.device, rows: list[Row]) -> list[tuple[str, float, float, bool]]:
    """(target, measured, limit, met) from this run's rows."""
    found = []
    for row in rows:
        if device.type == "cuda":
            limit = 2.0 if row.base == "x.clone()" else 1.5 if row.name == "all_gather_q8" else None
            if row.name in ("reduce_scatter_q4 1 stage", "reduce_scatter_q4 4 stages"):  # bucket rows: no target
                limit = 1.3 if row.base == "reduce_scatter_q4 1 stage" else 2.0
            if limit is not None:
                launcher = f" [{row.launcher}]" if row.launcher else ""
                label = f"{row.name} {_size(row.numel)}{launcher}: host {row.host_ratio:.2f}x {row.base} (<= {limit}x)"
                found.append((label, row.host_ratio, limit, row.host_ratio <= limit))
        elif row.name == "quantize int8" and row.numel == CPU_QUANTIZE_NUMEL:
            label = f"quantize {_size(row.numel)} fp32 on cpu: {row.host_us:.1f} us (<= {CPU_QUANTIZE_TARGET_US} us)"
            found.append((label, row.host_us, CPU_QUANTIZE_TARGET_US, row.host_us <= CPU_QUANTIZE_TARGET_US))
    return found


def _size(numel: int) -> str:
    for suffix, scale in (("M", 1 << 20), ("K", 1 << 10)):
        if numel % scale == 0:
            return f"{numel // scale}{suffix}"
    return str(numel)


def _init_group(device: torch.device, store_dir: str) -> None:
    """A world of one rank: gloo on CPU, NCCL bound to the device on CUDA."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    store = dist.FileStore(os.path.join(store_dir, "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1, **kwargs)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.host_cost", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--sizes", default=None, help=f"elements per input, comma separated (default {DEFAULT_SIZES}; "
                        f"on cpu {_size(CPU_QUANTIZE_NUMEL)} is added for its target)")
    parser.add_argument("--json", default=None, help="also write the rows and targets to this file")
    parser.add_argument("--budget", type=float, default=None, help="seconds per timed row (default: cpu 0.5, cuda 0.3)")
    parser.add_argument("--min-calls", type=int, default=5)
    parser.add_argument("--max-calls", type=int, default=200)
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
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    sizes = [parse_size(s) for s in (args.sizes or DEFAULT_SIZES).split(",")]
    if args.device == "cpu" and args.sizes is None:
        sizes.insert(0, CPU_QUANTIZE_NUMEL)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    budget = args.budget if args.budget is not None else (0.3 if device.type == "cuda" else 0.5)
    timer = Timer(device, budget, args.min_calls, args.max_calls)
    started = time.perf_counter()
    launchers = _launchers(args.launcher) if device.type == "cuda" else [""]
    with tempfile.TemporaryDirectory() as store_dir:
        _init_group(device, store_dir)
        try:
            rows = [row for numel in sizes for row in _rows_per_launcher(timer, numel, dtype, launchers, sizes)]
            if args.profile:
                _use_launcher(launchers[0])
                _profile(device, sizes[0], dtype, args.profile)
        finally:
            dist.destroy_process_group()
    targets = _targets(device, rows)
    compared = _launcher_rows(rows, launchers)
    _print(device, dtype, rows, targets, time.perf_counter() - started, compared)
    if args.json:
        with open(args.json, "w") as stream:
            json.dump(_report(device, dtype, rows, targets, compared), stream, indent=1)
    return 0


def _launchers(option: str | None) -> list[str]:
    """The launchers to measure, in order: ``--launcher``'s list, else the one this process would use."""
    from zcomm_cuda import loader

    return option.split(",") if option else [loader.launcher()]


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
    for row in rows:
        if row.launcher != launchers[0]:
            continue
        entry = {"name": row.name, "numel": row.numel, "base": row.base}
        for name in launchers:
            other = by_key[(row.name, row.numel, row.base, name)]
            entry[f"{name} host_us"], entry[f"{name} synced_us"] = other.host_us, other.synced_us
            if name != launchers[0]:
                entry[f"{name}/{launchers[0]} host"] = other.host_us / row.host_us
                entry[f"{name}/{launchers[0]} synced"] = other.synced_us / row.synced_us
        compared.append(entry)
    return compared


def _machine(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch threads {torch.get_num_threads()}"


def _print(device: torch.device, dtype: torch.dtype, rows: list[Row], targets: list, seconds: float,
           compared: list[dict]) -> None:  # fmt: skip
    print(f"# host cost, world size 1, {device} ({_machine(device)}), {dtype}, torch {torch.__version__}")
    header = f"{'call':36s} {'size':>5s} {'host us':>9s} {'synced us':>10s}   {'vs':28s} {'host us':>9s} " \
             f"{'synced us':>10s} {'host x':>7s} {'synced x':>8s}"
    for launcher in dict.fromkeys(row.launcher for row in rows):
        if launcher:
            print(f"## CUDA kernel launcher: {launcher}")
        print(header)
        for r in rows:
            if r.launcher == launcher:
                print(f"{r.name:36s} {_size(r.numel):>5s} {r.host_us:9.1f} {r.synced_us:10.1f}   {r.base:28s} "
                      f"{r.base_host_us:9.1f} {r.base_synced_us:10.1f} {r.host_ratio:7.2f} {r.synced_ratio:8.2f}")
    if compared:
        _print_launchers(compared)
    print("# targets (host ratios of this run)")
    for label, _, _, met in targets:
        print(f"{'PASS' if met else 'MISS'}  {label}")
    print(f"# {seconds:.1f} s")
    sys.stdout.flush()


def _print_launchers(compared: list[dict]) -> None:
    """The same calls under each launcher, side by side, with the ratios to the first (this run's numbers)."""
    launchers = [key[: -len(" host_us")] for key in compared[0] if key.endswith(" host_us")]
    first = launchers[0]
    print(f"# launchers (host us, then each launcher's host and synced time over {first}'s, this run)")
    print(f"{'call':36s} {'size':>5s} {'(its yardstick)':28s} " + " ".join(f"{name + ' us':>10s}" for name in launchers)
          + "".join(f" {name + '/' + first:>14s} {'synced':>7s}" for name in launchers[1:]))  # fmt: skip
    for entry in compared:
        print(f"{entry['name']:36s} {_size(entry['numel']):>5s} {entry['base']:28s} "
              + " ".join(f"{entry[name + ' host_us']:10.1f}" for name in launchers)
              + "".join(f" {entry[f'{name}/{first} host']:14.2f} {entry[f'{name}/{first} synced']:7.2f}"
                        for name in launchers[1:]))  # fmt: skip


def _report(device: torch.device, dtype: torch.dtype, rows: list[Row], targets: list, compared: list[dict]) -> dict:
    return {
        "device": str(device), "machine": _machine(device), "dtype": str(dtype), "torch": torch.__version__,
        "rows": [{**asdict(r), "host_ratio": r.host_ratio, "synced_ratio": r.synced_ratio} for r in rows],
        "targets": [{"target": label, "measured": value, "limit": limit, "met": met}
                    for label, value, limit, met in targets],
        "launchers": compared,
    }

