"""Kernel-only GPU sweep: GB/s of every cuda op against a device-to-device copy of the same bytes.

``python -m bench.kernels --sweep [--quick] [--json PATH]``: every op of the ``cuda`` backend at 16M,
64M and 256M elements (``--quick``: 16M), groups of 256 and 512, bf16 and fp32. ``LAUNCHES`` calls
into preallocated outputs are captured in one CUDA graph, replayed ``REPLAYS`` times between two
CUDA events, median of ``SAMPLES`` (one sample of the copy swung by 1.5x at 256M on an H200): a
replay does no host work, so launch cost cannot hide a slow kernel; calls rotate over
``ceil(4 * L2 / bytes)`` sets of buffers, so none finds its data in L2. The yardstick is ``copy_``
of half the op's bytes, timed the same way; ``vs copy``, PASS or MISS against :data:`TARGETS`
(measurements, not tests).
"""

from __future__ import annotations

import itertools
import json
import math
import time
from functools import partial
from typing import Callable

import torch

import zcomm.quant as q

SIZES = (16 << 20, 64 << 20, 256 << 20)
GROUP_SIZES = (256, 512)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PERM = (7, 6, 5, 4, 3, 2, 1, 0)  # reorder_quantize: 8 slices reversed, as a ring all-to-all would
CHUNKS = 4  # reorder_quantize chunks, dequant_reduce rows and re-quantized chunks
LAUNCHES = 20
REPLAYS = 3
SAMPLES = 5
TARGETS = {"quantize": 0.85, "dequantize": 0.85, "reorder_quantize": 0.70, "dequant_reduce": 0.70}


def _time_graph(calls: list[Callable[[], object]]) -> float:
    """Median seconds per call of ``calls`` (cycled up to LAUNCHES), captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # warm-up outside the capture (compilation, pinned perm copies)
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(LAUNCHES):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    return event_seconds(graph.replay, REPLAYS) / LAUNCHES


def event_seconds(call: Callable[[], object], repeats: int, samples: int = SAMPLES) -> float:
    """Median over ``samples`` of the seconds per call of ``repeats`` back-to-back calls between two CUDA events."""
    found = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            call()
        end.record()
        end.synchronize()
        found.append(start.elapsed_time(end) / 1e3 / repeats)
    return sorted(found)[samples // 2]


def _copies(nbytes: int) -> int:
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    return max(1, min(LAUNCHES, math.ceil(4 * l2 / nbytes)))


def op_specs(n: int, dtype: torch.dtype, gs: int, backend: str = "cuda", *, divide_by: float = CHUNKS,
             every_dtype: bool = False) -> list[tuple[str, str, int, Callable[[], Callable[[], object]]]]:
    """(op family, label, bytes moved, factory of one call on fresh buffers) per op of ``backend``, on its device.
    The reductions read payloads and write fp32 or payloads: with the fp32 rows only (once per size) unless
    ``every_dtype``. Their ``CHUNKS`` rows repeat one payload: the data does not change the work."""
    kw, device = {"backend": backend}, "cuda" if backend == "cuda" else "cpu"
    elem = torch.tensor([], dtype=dtype).element_size()
    randn = partial(torch.randn, n, device=device)
    empty = partial(torch.empty, device=device, dtype=torch.uint8)

    def rows(bits: int) -> torch.Tensor:
        return q.quantize(randn(), bits, gs, **kw).expand(CHUNKS, -1).contiguous()

    specs = []
    for b in (8, 4):
        p, c = q.payload_nbytes(n, b, gs), q.payload_nbytes(n // CHUNKS, b, gs)
        specs += [
            ("quantize", f"quantize INT{b}", n * elem + p,
             lambda b=b, p=p: partial(q.quantize, randn(dtype=dtype), b, gs, out=empty(p), **kw)),
            ("dequantize", f"dequantize INT{b}", p + n * elem,
             lambda b=b: partial(q.dequantize, q.quantize(randn(dtype=dtype), b, gs, **kw), n, b, gs, dtype,
                                 out=empty(n, dtype=dtype), **kw)),
            ("reorder_quantize", f"reorder_quantize INT{b}", n * elem + CHUNKS * c,
             lambda b=b, c=c: partial(q.reorder_quantize, randn(dtype=dtype), PERM, CHUNKS, b, gs, out=empty(CHUNKS, c), **kw)),
        ] + ([
            ("dequant_reduce", f"dequant_reduce INT{b} k={CHUNKS} -> fp32", CHUNKS * p + 4 * n,
             lambda b=b: partial(q.dequant_reduce, rows(b), n, b, gs, divide_by=divide_by, out=empty(n, dtype=torch.float32),
                                 **kw)),
            ("dequant_reduce", f"dequant_reduce INT{b} k={CHUNKS} -> requant INT{b} m={CHUNKS}", CHUNKS * p + CHUNKS * c,
             lambda b=b, c=c: partial(q.dequant_reduce, rows(b), n, b, gs, requant_chunks=CHUNKS, divide_by=divide_by,
                                      out=empty(CHUNKS, c), **kw)),
        ] if every_dtype or dtype == torch.float32 else [])  # fmt: skip
    return specs


def sweep(quick: bool = False) -> list[dict]:
    """Every (size, group size, dtype, op) row of the sweep, measured on the current GPU."""
    rows = []
    for n, gs, (tag, dtype) in itertools.product(SIZES[:1] if quick else SIZES, GROUP_SIZES, DTYPES.items()):
        for family, label, nbytes, factory in op_specs(n, dtype, gs):
            seconds = _time_graph([factory() for _ in range(_copies(nbytes))])  # its buffers go before the copy's
            halves = [torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda") for _ in range(2 * _copies(nbytes))]
            copy = _time_graph([partial(d.copy_, s) for s, d in zip(halves[::2], halves[1::2], strict=True)])
            rows.append(dict(numel=n, group_size=gs, dtype=tag, family=family, op=label, bytes=nbytes, seconds=seconds,
                             gbps=nbytes / seconds / 1e9, copy_gbps=nbytes / copy / 1e9, vs_copy=copy / seconds,
                             target=TARGETS[family]))  # fmt: skip
            torch.cuda.empty_cache()
    return rows


def report(rows: list[dict], elapsed: float, name: str) -> list[str]:
    lines = [f"# zcomm kernel sweep on {name} (torch {torch.__version__}): kernel-only, CUDA-graph replay of "
             f"{LAUNCHES} calls x {REPLAYS}, L2-rotated buffers; {elapsed:.0f} s", "",
             "| numel | group | dtype | op | us | GB/s | copy GB/s | vs copy | target | result |",
             "|---:|---:|---|---|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    lines += [f"| {r['numel'] >> 20}M | {r['group_size']} | {r['dtype']} | {r['op']} | {r['seconds'] * 1e6:.1f} "
              f"| {r['gbps']:.0f} | {r['copy_gbps']:.0f} | {r['vs_copy']:.0%} | >= {r['target']:.0%} "
              f"| {'PASS' if r['vs_copy'] >= r['target'] else 'MISS'} |" for r in rows]  # fmt: skip
    missed = sum(r["vs_copy"] < r["target"] for r in rows)
    return lines + ["", f"{len(rows) - missed} of {len(rows)} rows meet their target; {missed} miss."]


def main(args) -> list[str]:
    started, name = time.perf_counter(), torch.cuda.get_device_name()
    rows = sweep(args.quick)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, torch=torch.__version__, launches=LAUNCHES, replays=REPLAYS, rows=rows), f, indent=1)
    return report(rows, time.perf_counter() - started, name)


def ncu(args) -> list[str]:
    """One call of every op of the sweep (bf16 and fp32, ``--numel`` elements), each in an NVTX range, inside
    a profiler range opened once inputs, outputs and kernels are made. Run under ``ncu --clock-control none
    --profile-from-start off --section SpeedOfLight --section Occupancy --section LaunchStats``: the
    bottleneck, DRAM and SM shares, registers and occupancy a kernel change is judged by."""
    calls = [(f"{tag} {label}", factory()) for tag, dtype in DTYPES.items()
             for _family, label, _nbytes, factory in op_specs(args.numel or 16 << 20, dtype, args.group_size or 256)]  # fmt: skip
    for _label, call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for label, call in calls:
        torch.cuda.nvtx.range_push(label)
        call()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return ["profiled, in order: " + "; ".join(label for label, _ in calls)]
