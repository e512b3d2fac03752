"""The kernel benchmark's default mode: GB/s of every quantization op on the CPU backends, against a copy.

``python -m bench.kernels [--numel 64M] [--dtype fp32 bf16] [--backends cpu reference] [--group-size 512]
[--repeats 5] [--reference-repeats 1]``: the sweep's ops (:func:`.sweep.op_specs`, the reductions with
every dtype and no division), each on fresh buffers. Each op runs once to warm up (numba's compile or cache
load, first-touch page faults), then ``--repeats`` times into preallocated outputs, host clock,
median. The reference backend compiles nothing and allocates per call anyway, and takes seconds
on 64M elements: no warm-up, ``--reference-repeats`` samples. ``vs copy``: the op's GB/s over a
``copy_`` of as many bytes. Then the CPU targets from this run's medians, PASS or MISS:
measurements, not tests.
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

import zcomm.quant as q
from bench.harness.flags import parse_size
from bench.harness.precision import cpu_model, read_cpuinfo
from bench.kernels.sweep import CHUNKS, PERM, op_specs

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Row:
    backend: str
    op: str
    seconds: float
    nbytes: int
    copy_seconds: float

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9

    @property
    def vs_copy(self) -> float:
        """This op's bandwidth over a copy of the same bytes' (= copy time / op time)."""
        return self.copy_seconds / self.seconds


class _Timer:
    """Median seconds per call of a function, and of copies of given byte counts."""

    def __init__(self, repeats: int) -> None:
        self.repeats = repeats
        self._copies: dict[int, float] = {}

    def seconds(self, fn: Callable[[], object], *, repeats: int | None = None, warm_up: bool = True) -> float:
        if warm_up:
            fn()
        samples = []
        for _ in range(self.repeats if repeats is None else repeats):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    def copy_seconds(self, nbytes: int) -> float:
        """A ``copy_`` that reads ``nbytes // 2`` bytes and writes as many."""
        if nbytes not in self._copies:
            source = torch.empty(nbytes // 2, dtype=torch.uint8).fill_(1)
            self._copies[nbytes] = self.seconds(functools.partial(torch.empty_like(source).copy_, source))
        return self._copies[nbytes]


def _backends(wanted: list[str] | None) -> tuple[list[str], list[str]]:
    """(the CPU backends to run, printed reasons for those skipped); a ``wanted`` one that cannot run raises."""
    status, devices = q.available_backends(), q.backend_device_types()
    for name in wanted or ():
        if "cpu" not in devices[name]:
            raise ValueError(f"backend {name!r} does not run on the CPU: the GPU's kernels are measured by --sweep")
        if status[name] != "ok":
            raise ValueError(f"backend {name!r} was asked for but is {status[name]}")
    cpu = [name for name, kinds in devices.items() if "cpu" in kinds and (wanted is None or name in wanted)]
    return [n for n in cpu if status[n] == "ok"], [f"{n}: {status[n]}" for n in cpu if status[n] != "ok"]


def _measure(args: argparse.Namespace, dtype: str, backends: list[str]) -> list[Row]:
    timer = _Timer(args.repeats)
    x = torch.randn(args.numel).to(_DTYPES[dtype])
    copy_bytes = 2 * x.numel() * x.element_size()

    def row(backend: str, op: str, seconds: float, nbytes: int) -> Row:
        return Row(backend, op, seconds, nbytes, timer.copy_seconds(nbytes))

    rows = [row("torch", "clone", timer.seconds(x.clone), copy_bytes),
            row("torch", "copy_ (preallocated)", timer.seconds(functools.partial(torch.empty_like(x).copy_, x)), copy_bytes)]
    for backend in backends:
        slow = backend == "reference"
        for _family, op, nbytes, factory in op_specs(args.numel, x.dtype, args.group_size, backend, divide_by=1.0,
                                                     every_dtype=True):  # fmt: skip
            rows.append(row(backend, op, timer.seconds(factory(), repeats=args.reference_repeats if slow else None,
                                                       warm_up=not slow), nbytes))  # fmt: skip
            print(f"  timed {dtype} {backend:9s} {op}", flush=True)
    return rows


def _target_lines(rows: list[Row], dtype: str) -> list[str]:
    """The cpu backend's targets, from this run's medians: (label, this time, over that time, target)."""
    t = {(r.backend, r.op): r.seconds for r in rows}
    clone, copy, checks = t["torch", "clone"], t["torch", "copy_ (preallocated)"], []
    for bits in (8, 4):
        cpu, reduce = t.get(("cpu", f"quantize INT{bits}")), t.get(("cpu", f"dequant_reduce INT{bits} k={CHUNKS} -> fp32"))
        checks += [(f"cpu quantize INT{bits} time / clone time", cpu, clone, "<= 1.5"),
                   (f"reference / cpu quantize INT{bits} time (speedup)", t.get(("reference", f"quantize INT{bits}")), cpu, ">= 4"),
                   (f"cpu dequant_reduce INT{bits} of {CHUNKS} payloads time / clone time", reduce, clone, "<= 2")]  # fmt: skip
    lines = [f"| {dtype} {label} | {a / b:.2f} | {target} | {'PASS' if _meets(a / b, target) else 'MISS'} |"
             for label, a, b, target in checks if a is not None and b is not None]  # fmt: skip
    return lines + [f"| {dtype} (info, no target) cpu {op} time / copy_ time | {t['cpu', op] / copy:.2f} | - | - |"
                    for op in ("quantize INT8", "quantize INT4", f"dequant_reduce INT8 k={CHUNKS} -> fp32") if ("cpu", op) in t]


def _meets(value: float, target: str) -> bool:
    """``target``: ``<= X`` or ``>= X``."""
    relation, bound = target.split()
    return value <= float(bound) if relation == "<=" else value >= float(bound)


def _environment() -> list[str]:
    model = cpu_model(read_cpuinfo())
    try:
        import numba

        numba_line = f"numba {numba.__version__} ({numba.config.NUMBA_NUM_THREADS} threads, {numba.threading_layer()})"
    except (ImportError, ValueError) as exc:  # no numba, or no parallel kernel ran
        numba_line = f"numba: {exc}"
    return [f"- CPU: {model}, {torch.get_num_threads()} torch threads, {numba_line}",
            f"- python {platform.python_version()}, torch {torch.__version__}"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--numel", type=parse_size, help="elements per op (K/M/G: powers of 1024; default 64M, --ncu: 16M)")
    parser.add_argument("--dtype", nargs="+", choices=sorted(_DTYPES), default=["fp32"], help="one table per dtype")
    parser.add_argument("--backends", nargs="+", choices=sorted(q.backend_device_types()),
                        help="default: every CPU backend that can run")
    parser.add_argument("--group-size", type=int, default=None, help="default 512 (--ncu: 256)")
    parser.add_argument("--repeats", type=int, default=5, help="timed samples per op (median reported)")
    parser.add_argument("--reference-repeats", type=int, default=1, help="timed calls per reference op")


def main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    args.group_size, args.numel = args.group_size or 512, args.numel or 64 << 20
    if args.numel % (len(PERM) * CHUNKS):
        parser.error(f"--numel must be a multiple of {len(PERM) * CHUNKS}")
    if args.repeats < 1 or args.reference_repeats < 1:
        parser.error("--repeats and --reference-repeats must be >= 1")
    try:
        backends, skipped = _backends(args.backends)
    except ValueError as exc:
        parser.error(str(exc))
    report = [f"# zcomm kernel benchmark: {args.numel} elements ({', '.join(args.dtype)}), group_size {args.group_size}",
              "", "GB/s = (bytes read + bytes written) / median time; each op writes into preallocated outputs.",
              "vs copy = the op's GB/s / the GB/s of a preallocated copy_ that reads and writes as many bytes.",
              f"Medians of {args.repeats} calls after one warm-up call (host clock); the reference: "
              f"{args.reference_repeats} timed calls, no warm-up. The GPU's kernels: --sweep.", ""]  # fmt: skip
    targets = ["| target (this run) | measured | target | result |", "|---|---:|---|---|"]
    for dtype in args.dtype:
        rows = _measure(args, dtype, backends)
        report += ["| device | dtype | backend | op | median ms | GB/s | vs copy |", "|---|---|---|---|---:|---:|---:|",
                   *(f"| cpu | {dtype} | {r.backend} | {r.op} | {r.seconds * 1e3:.3f} | {r.gbps:.2f} | {r.vs_copy:.0%} |"
                     for r in rows), ""]  # fmt: skip
        targets += _target_lines(rows, dtype)
    return report + [f"Skipped: {reason}" for reason in skipped] + [""] + _environment() + [""] + targets
