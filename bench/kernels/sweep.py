"""Kernel-only GPU sweep: GB/s of every cuda op against a device-to-device copy of the same bytes.

``python -m bench.kernels --sweep [--quick] [--json PATH]``: for every size (16M, 64M, 256M
elements; ``--quick``: 16M), group size (256, 512) and dtype (bf16, fp32), each op of the
``cuda`` backend is timed as kernels only. ``LAUNCHES`` back-to-back calls into preallocated
outputs are captured once in a CUDA graph, replayed ``REPLAYS`` times between two CUDA
events, and the median of ``SAMPLES`` such measurements is reported (a single one of the copy
swung by 1.5x at 256M elements on an H200): a replay issues no host work per call, so launch
cost cannot hide a slow kernel. When an op's bytes would fit in L2 a few times over, the
captured calls rotate over ``ceil(4 * L2 / bytes)`` sets of buffers, so no call finds its data
in L2. The yardstick is ``copy_`` between two byte buffers of half the op's bytes each, timed
the same way. ``vs copy`` is the op's GB/s over the copy's, marked PASS or MISS against
:data:`TARGETS` (measurements, not tests).
"""

from __future__ import annotations

import json
import math
import time
from typing import Callable

import torch

import zcomm.quant as q

SIZES = (16 << 20, 64 << 20, 256 << 20)
GROUP_SIZES = (256, 512)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
PERM = (7, 6, 5, 4, 3, 2, 1, 0)
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


def op_specs(n: int, dtype: torch.dtype, gs: int) -> list[tuple[str, str, int, Callable[[], Callable[[], object]]]]:
    """(op family, label, bytes moved, factory of one call on fresh buffers) per op."""
    elem = torch.tensor([], dtype=dtype).element_size()
    dev = torch.device("cuda")
    specs = []
    for bits in (8, 4):
        pbytes = q.payload_nbytes(n, bits, gs)
        cbytes = q.payload_nbytes(n // CHUNKS, bits, gs)

        def quantize(bits=bits, pbytes=pbytes):
            x, out = torch.randn(n, device=dev, dtype=dtype), torch.empty(pbytes, dtype=torch.uint8, device=dev)
            return lambda: q.quantize(x, bits, gs, out=out, backend="cuda")

        def dequantize(bits=bits):
            p = q.quantize(torch.randn(n, device=dev, dtype=dtype), bits, gs, backend="cuda")
            out = torch.empty(n, dtype=dtype, device=dev)
            return lambda: q.dequantize(p, n, bits, gs, dtype, out=out, backend="cuda")

        def reorder(bits=bits, cbytes=cbytes):
            x = torch.randn(n, device=dev, dtype=dtype)
            out = torch.empty(CHUNKS, cbytes, dtype=torch.uint8, device=dev)
            return lambda: q.reorder_quantize(x, PERM, CHUNKS, bits, gs, out=out, backend="cuda")

        def rows(bits):
            xs = torch.randn(CHUNKS, n, device=dev, dtype=torch.float32)
            return torch.stack([q.quantize(x, bits, gs, backend="cuda") for x in xs])

        def reduce(bits=bits):
            p, out = rows(bits), torch.empty(n, dtype=torch.float32, device=dev)
            return lambda: q.dequant_reduce(p, n, bits, gs, divide_by=CHUNKS, out=out, backend="cuda")

        def requant(bits=bits, cbytes=cbytes):
            p, out = rows(bits), torch.empty(CHUNKS, cbytes, dtype=torch.uint8, device=dev)
            return lambda: q.dequant_reduce(p, n, bits, gs, requant_chunks=CHUNKS, divide_by=CHUNKS, out=out,
                                            backend="cuda")

        specs += [
            ("quantize", f"quantize INT{bits}", n * elem + pbytes, quantize),
            ("dequantize", f"dequantize INT{bits}", pbytes + n * elem, dequantize),
            ("reorder_quantize", f"reorder_quantize INT{bits}", n * elem + CHUNKS * cbytes, reorder),
        ]
        if dtype == torch.float32:  # the reductions read payloads and write fp32: once per size, not per dtype
            specs += [
                ("dequant_reduce", f"dequant_reduce INT{bits} k={CHUNKS} -> fp32", CHUNKS * pbytes + 4 * n, reduce),
                ("dequant_reduce", f"dequant_reduce INT{bits} k={CHUNKS} -> requant INT{bits} m={CHUNKS}",
                 CHUNKS * pbytes + CHUNKS * cbytes, requant),
            ]
    return specs


def _copy_seconds(nbytes: int) -> float:
    half = nbytes // 2
    pairs = [(torch.empty(half, dtype=torch.uint8, device="cuda"), torch.empty(half, dtype=torch.uint8, device="cuda"))
             for _ in range(_copies(nbytes))]
    return _time_graph([lambda d=d, s=s: d.copy_(s) for s, d in pairs])


def sweep(quick: bool = False) -> list[dict]:
    """Every (size, group size, dtype, op) row of the sweep, measured on the current GPU."""
    rows = []
    for n in SIZES[:1] if quick else SIZES:
        for gs in GROUP_SIZES:
            for tag, dtype in DTYPES.items():
                for family, label, nbytes, factory in op_specs(n, dtype, gs):
                    calls = [factory() for _ in range(_copies(nbytes))]
                    seconds = _time_graph(calls)
                    del calls
                    copy = _copy_seconds(nbytes)
                    rows.append(dict(numel=n, group_size=gs, dtype=tag, family=family, op=label, bytes=nbytes,
                                     seconds=seconds, gbps=nbytes / seconds / 1e9, copy_gbps=nbytes / copy / 1e9,
                                     vs_copy=copy / seconds, target=TARGETS[family]))
                    torch.cuda.empty_cache()
    return rows


def report(rows: list[dict], elapsed: float, name: str) -> list[str]:
    lines = [
        f"# zcomm kernel sweep on {name} (torch {torch.__version__}): kernel-only, CUDA-graph replay of "
        f"{LAUNCHES} calls x {REPLAYS}, L2-rotated buffers; {elapsed:.0f} s",
        "",
        "| numel | group | dtype | op | us | GB/s | copy GB/s | vs copy | target | result |",
        "|---:|---:|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ok = "PASS" if r["vs_copy"] >= r["target"] else "MISS"
        lines.append(
            f"| {r['numel'] >> 20}M | {r['group_size']} | {r['dtype']} | {r['op']} | {r['seconds'] * 1e6:.1f} "
            f"| {r['gbps']:.0f} | {r['copy_gbps']:.0f} | {r['vs_copy']:.0%} | >= {r['target']:.0%} | {ok} |"
        )
    missed = sum(r["vs_copy"] < r["target"] for r in rows)
    lines += ["", f"{len(rows) - missed} of {len(rows)} rows meet their target; {missed} miss."]
    return lines


def main(args) -> list[str]:
    started = time.perf_counter()
    rows = sweep(args.quick)
    lines = report(rows, time.perf_counter() - started, torch.cuda.get_device_name())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, launches=LAUNCHES,
                           replays=REPLAYS, rows=rows), f, indent=1)
    return lines


def ncu(args) -> list[str]:
    """One call of every op of the sweep (bf16 and fp32, ``--ncu-numel`` elements) inside a profiler range, for Nsight
    Compute.

    The inputs and outputs are all made first (their own quantize calls stay outside the
    range) and every kernel is compiled by a first call; then ``torch.cuda.profiler`` opens
    the range around one call of each, each in an NVTX range named after it. Run under
    ``ncu --clock-control none --profile-from-start off --section SpeedOfLight --section
    Occupancy --section LaunchStats``: the bottleneck, DRAM and SM shares, registers and
    occupancy a kernel change is judged by, next to the sweep's GB/s.
    """
    calls = [(f"{tag} {label}", factory()) for tag, dtype in DTYPES.items()
             for _family, label, _nbytes, factory in op_specs(args.ncu_numel, dtype, args.group_size or 256)]
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
