"""Kernel benchmark: GB/s of every quantization op on every backend, against ``torch.clone``.

Run as ``python -m bench.kernels`` (``--help`` for size, dtype, group size and repeats).
For one input of ``--numel`` elements, each op runs once to warm up (numba compilation or
cache load, first-touch page faults) and then ``--repeats`` times into preallocated outputs
(``out=``); the median time is reported (the reference, which compiles nothing, gets no
warm-up and ``--reference-repeats`` calls, as its calls on 64M elements take seconds). ``GB/s = (bytes read + bytes written) / time``,
the same definition for the ops and for the ``clone`` yardstick (which reads and writes the
input once, allocating its output as clone does; a ``copy_`` into a preallocated tensor is
shown beside it, as the stricter yardstick without page faults). The run ends with the project's targets
computed from this run's medians, each marked PASS or MISS.

Rows for a backend that cannot run here (no GPU, no cupy, no cuda module) are skipped with
the reason printed; nothing falls back to another backend.
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass
from typing import Callable

import numba
import torch

import zcomm.quant as q
from zcomm.quant import registry

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_PERM = (7, 6, 5, 4, 3, 2, 1, 0)  # reorder_quantize: 8 slices reversed, as a ring all-to-all would
_CHUNKS = 4  # reorder_quantize and requant chunk count; dequant_reduce sums 4 payloads


@dataclass
class Row:
    backend: str
    op: str
    seconds: float
    nbytes: int

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn: Callable[[], object], repeats: int, device: torch.device, warm_up: bool = True) -> float:
    if warm_up:
        fn()
        _sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _op_cases(x: torch.Tensor, backend: str, group_size: int) -> list[tuple[str, Callable[[], object], int]]:
    """(op label, call with preallocated output, bytes read + written) for every op."""
    n, elem = x.numel(), x.element_size()
    cases = []
    for bits in (8, 4):
        nbytes = q.payload_nbytes(n, bits, group_size)
        chunk_bytes = q.payload_nbytes(n // _CHUNKS, bits, group_size)
        payload = q.quantize(x, bits, group_size, backend=backend)
        rows = payload.expand(_CHUNKS, -1).contiguous()
        out_payload = torch.empty_like(payload)
        out_chunks = torch.empty(_CHUNKS, chunk_bytes, dtype=torch.uint8, device=x.device)
        out_values = torch.empty_like(x)
        out_fp32 = torch.empty(n, dtype=torch.float32, device=x.device)
        kw = dict(backend=backend)
        cases += [
            (f"quantize INT{bits}", lambda b=bits, o=out_payload: q.quantize(x, b, group_size, out=o, **kw), n * elem + nbytes),
            (
                f"dequantize INT{bits}",
                lambda b=bits, p=payload, o=out_values: q.dequantize(p, n, b, group_size, x.dtype, out=o, **kw),
                nbytes + n * elem,
            ),
            (
                f"reorder_quantize INT{bits} ({len(_PERM)} slices, {_CHUNKS} chunks)",
                lambda b=bits, o=out_chunks: q.reorder_quantize(x, _PERM, _CHUNKS, b, group_size, out=o, **kw),
                n * elem + _CHUNKS * chunk_bytes,
            ),
            (
                f"dequant_reduce INT{bits} k={_CHUNKS} -> fp32",
                lambda b=bits, p=rows, o=out_fp32: q.dequant_reduce(p, n, b, group_size, out=o, **kw),
                _CHUNKS * nbytes + 4 * n,
            ),
            (
                f"dequant_reduce INT{bits} k={_CHUNKS} -> requant m={_CHUNKS}",
                lambda b=bits, p=rows, o=out_chunks: q.dequant_reduce(p, n, b, group_size, requant_chunks=_CHUNKS, out=o, **kw),
                _CHUNKS * nbytes + _CHUNKS * chunk_bytes,
            ),
        ]
    return cases


def _backends(device: torch.device) -> tuple[list[str], list[str]]:
    """(backends to run on ``device``, printed reasons for those skipped)."""
    status = registry.available_backends()
    run, skipped = [], []
    for name, (_, devices) in registry.BACKENDS.items():
        if device.type not in devices:
            continue
        if status[name] == "ok":
            run.append(name)
        else:
            skipped.append(f"{name} on {device.type}: {status[name]}")
    return run, skipped


def _devices() -> tuple[list[torch.device], list[str]]:
    if torch.cuda.is_available():
        return [torch.device("cpu"), torch.device("cuda")], []
    return [torch.device("cpu")], ["cuda rows: no GPU visible to torch (torch.cuda.is_available() is False)"]


def _measure(args: argparse.Namespace, device: torch.device) -> tuple[list[Row], list[str]]:
    x = torch.randn(args.numel, device=device).to(_DTYPES[args.dtype])
    copy_bytes = 2 * x.numel() * x.element_size()
    rows = [
        Row("torch", "clone", _median_seconds(x.clone, args.repeats, device), copy_bytes),
        Row("torch", "copy_ (preallocated)",
            _median_seconds(functools.partial(torch.empty_like(x).copy_, x), args.repeats, device), copy_bytes),
    ]
    backends, skipped = _backends(device)
    for backend in backends:
        # The reference compiles nothing and allocates its temporaries on every call anyway,
        # so it gets no warm-up call (its 64M-element calls take seconds).
        reference = backend == "reference"
        repeats = args.reference_repeats if reference else args.repeats
        for op, fn, nbytes in _op_cases(x, backend, args.group_size):
            rows.append(Row(backend, op, _median_seconds(fn, repeats, device, warm_up=not reference), nbytes))
            print(f"  timed {device.type} {backend:9s} {op}", flush=True)
    return rows, skipped


def _target_lines(rows: list[Row]) -> list[str]:
    """The issue's targets for the cpu backend, from this run's medians."""
    by_key = {(r.backend, r.op): r.seconds for r in rows}
    clone = by_key[("torch", "clone")]
    lines = []

    def check(label: str, value: float, target: str, ok: bool) -> None:
        lines.append(f"| {label} | {value:.2f} | {target} | {'PASS' if ok else 'MISS'} |")

    for bits in (8, 4):
        cpu = by_key.get(("cpu", f"quantize INT{bits}"))
        ref = by_key.get(("reference", f"quantize INT{bits}"))
        if cpu is not None:
            check(f"cpu quantize INT{bits} time / clone time", cpu / clone, "<= 1.5", cpu / clone <= 1.5)
        if cpu is not None and ref is not None:
            check(f"reference / cpu quantize INT{bits} time (speedup)", ref / cpu, ">= 4", ref / cpu >= 4)
    for bits in (8, 4):
        reduce = by_key.get(("cpu", f"dequant_reduce INT{bits} k={_CHUNKS} -> fp32"))
        if reduce is not None:
            label = f"cpu dequant_reduce INT{bits} of {_CHUNKS} payloads time / clone time"
            check(label, reduce / clone, "<= 2", reduce / clone <= 2)
    copy = by_key[("torch", "copy_ (preallocated)")]
    for op in ("quantize INT8", "quantize INT4", f"dequant_reduce INT8 k={_CHUNKS} -> fp32"):
        if ("cpu", op) in by_key:
            lines.append(f"| (info, no target) cpu {op} time / copy_ time | {by_key[('cpu', op)] / copy:.2f} | - | - |")
    return lines


def _table(rows: list[Row], device: torch.device) -> list[str]:
    lines = ["| device | backend | op | median ms | GB/s |", "|---|---|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {device.type} | {r.backend} | {r.op} | {r.seconds * 1e3:.1f} | {r.gbps:.2f} |")
    return lines


def _environment() -> list[str]:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next((l.split(":", 1)[1].strip() for l in lscpu.splitlines() if l.startswith("Model name")), "?")
    except (OSError, subprocess.CalledProcessError):
        model = "? (lscpu unavailable)"
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    return [
        f"- CPU: {model}, {torch.get_num_threads()} torch threads, numba {numba.__version__} "
        f"({numba.config.NUMBA_NUM_THREADS} threads, {numba.threading_layer()} threading layer)",
        f"- GPU: {gpu}",
        f"- python {platform.python_version()}, torch {torch.__version__}",
    ]


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=64 << 20, help="elements of the input (default 64M)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32")
    parser.add_argument("--group-size", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per op (median reported)")
    parser.add_argument("--reference-repeats", type=int, default=1, help="timed calls per reference op")
    parser.add_argument("--output", help="also write the report (markdown) to this file")
    args = parser.parse_args(argv)
    if args.numel % (len(_PERM) * _CHUNKS):
        parser.error(f"--numel must be a multiple of {len(_PERM) * _CHUNKS}")
    report = [
        f"# zcomm kernel benchmark: {args.numel} {args.dtype} elements, group_size {args.group_size}",
        "",
        "GB/s = (bytes read + bytes written) / median time; each op writes into preallocated outputs.",
        f"Medians of {args.repeats} timed calls after one warm-up call "
        f"(reference: {args.reference_repeats} timed calls, no warm-up).",
        "",
    ]
    devices, skipped = _devices()
    targets: list[str] = []
    for device in devices:
        rows, device_skipped = _measure(args, device)
        skipped += device_skipped
        report += _table(rows, device) + [""]
        if device.type == "cpu":
            targets = _target_lines(rows)
    report += [f"Skipped: {reason}" for reason in skipped] + [""] + _environment() + [""]
    report += ["| target (this run) | measured | target | result |", "|---|---:|---|---|", *targets]
    print("\n".join(report))
    if args.output:
        with open(args.output, "w") as f:
            f.write("\n".join(report) + "\n")
    return report


if __name__ == "__main__":
    main()
