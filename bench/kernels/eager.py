"""Kernel benchmark: GB/s of every quantization op on every backend, against a copy of the same bytes.

``python -m bench.kernels`` without a mode (:mod:`bench.kernels`). For one input of ``--numel``
elements per dtype and device, each op runs once to warm up
(numba compilation or cache load, NVRTC compilation, first-touch page faults) and is then
timed ``--repeats`` times into preallocated outputs (``out=``); the median is reported. A
sample is one call on the CPU, timed with the host clock, and the mean of
``CUDA_CALLS_PER_SAMPLE`` back-to-back calls on a GPU, timed with CUDA events on the current
stream (``bench.harness.timing.clock_for``), so no launch gap or host sync sits between the calls.
The reference, which compiles nothing, gets no warm-up and ``--reference-repeats`` samples
on the CPU, as its calls on 64M elements take seconds.

``GB/s = (bytes read + bytes written) / time`` for every row. The yardstick of a row is a
``copy_`` between two preallocated byte buffers on the same device that reads and writes
as many bytes as the op (half of its bytes each way), timed the same way: the
``vs copy`` column is the op's GB/s over that copy's GB/s. ``torch.clone`` of the input
(allocating its output) and a preallocated ``copy_`` of it are shown as rows too. The run
ends with the project's targets from this run's medians, each marked PASS or MISS: on the
CPU against ``clone``, on a GPU against the copy of the same bytes (quantize and dequantize
>= 85%, the fused ops >= 70%). These are measurements, not tests.

Rows for a backend that cannot run here (no GPU, no cupy) are skipped with the reason
printed; a device or backend named on the command line that cannot run is an error. Nothing
falls back to another backend.
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import subprocess
from dataclasses import dataclass
from typing import Callable

import torch

import zcomm.quant as q
from bench.harness.flags import parse_size
from bench.harness.timing import Clock, clock_for

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_PERM = (7, 6, 5, 4, 3, 2, 1, 0)  # reorder_quantize: 8 slices reversed, as a ring all-to-all would
_CHUNKS = 4  # reorder_quantize and requant chunk count; dequant_reduce sums 4 payloads
CUDA_CALLS_PER_SAMPLE = 10
# Ops of the GPU targets: fraction of the copy-of-the-same-bytes bandwidth each should reach.
GPU_TARGETS = {"quantize": 0.85, "dequantize": 0.85, "reorder_quantize": 0.70, "dequant_reduce": 0.70}


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
    """Median seconds per call of a function on one device, and of copies of given byte counts."""

    def __init__(self, device: torch.device, repeats: int) -> None:
        self.device = device
        self.repeats = repeats
        self.clock: Clock = clock_for(device)
        self.calls = CUDA_CALLS_PER_SAMPLE if device.type == "cuda" else 1
        self._copies: dict[int, float] = {}

    def seconds(self, fn: Callable[[], object], *, repeats: int | None = None, warm_up: bool = True) -> float:
        if warm_up:
            fn()
            self.clock.synchronize()
        samples = []
        for _ in range(self.repeats if repeats is None else repeats):
            self.clock.start()
            for _ in range(self.calls):
                fn()
            samples.append(self.clock.stop() / self.calls)
        return statistics.median(samples)

    def copy_seconds(self, nbytes: int) -> float:
        """A device-to-device ``copy_`` that reads ``nbytes // 2`` bytes and writes as many."""
        if nbytes not in self._copies:
            source = torch.empty(nbytes // 2, dtype=torch.uint8, device=self.device).fill_(1)
            target = torch.empty_like(source)
            self._copies[nbytes] = self.seconds(functools.partial(target.copy_, source))
        return self._copies[nbytes]


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


def _backends(device: torch.device, wanted: list[str] | None) -> tuple[list[str], list[str]]:
    """(backends to run on ``device``, printed reasons for those skipped).

    ``wanted`` None means every backend registered for the device, skipping those that
    cannot load here; a backend named in ``wanted`` that cannot load is an error.
    """
    status = q.available_backends()
    run, skipped = [], []
    for name, devices in q.backend_device_types().items():
        if device.type not in devices or (wanted is not None and name not in wanted):
            continue
        if status[name] == "ok":
            run.append(name)
        elif wanted is not None:
            raise ValueError(f"backend {name!r} was asked for on {device.type} but is {status[name]}")
        else:
            skipped.append(f"{name} on {device.type}: {status[name]}")
    return run, skipped


def _devices(wanted: list[str] | None) -> tuple[list[torch.device], list[str]]:
    """The devices to measure (``wanted``, or every visible one) and printed reasons for those skipped."""
    gpu = torch.cuda.is_available()
    if wanted is None:
        if gpu:
            return [torch.device("cpu"), torch.device("cuda")], []
        return [torch.device("cpu")], ["cuda rows: no GPU visible to torch (torch.cuda.is_available() is False)"]
    if "cuda" in wanted and not gpu:
        raise ValueError("--device cuda was asked for, but torch sees no GPU (torch.cuda.is_available() is False)")
    return [torch.device(name) for name in dict.fromkeys(wanted)], []


def _plan(args: argparse.Namespace) -> tuple[dict[torch.device, list[str]], list[str]]:
    """Backends to run per device, and printed reasons for what is skipped."""
    devices, skipped = _devices(args.device)
    plan = {}
    for device in devices:
        plan[device], device_skipped = _backends(device, args.backends)
        skipped += device_skipped
    for name in args.backends or ():
        if not any(name in backends for backends in plan.values()):
            raise ValueError(f"backend {name!r} runs on none of the devices measured ({', '.join(map(str, plan))})")
    return plan, skipped


def _measure(args: argparse.Namespace, device: torch.device, dtype: str, backends: list[str]) -> list[Row]:
    timer = _Timer(device, args.repeats)
    x = torch.randn(args.numel, device=device).to(_DTYPES[dtype])
    copy_bytes = 2 * x.numel() * x.element_size()

    def row(backend: str, op: str, seconds: float, nbytes: int) -> Row:
        return Row(backend, op, seconds, nbytes, timer.copy_seconds(nbytes))

    rows = [
        row("torch", "clone", timer.seconds(x.clone), copy_bytes),
        row("torch", "copy_ (preallocated)", timer.seconds(functools.partial(torch.empty_like(x).copy_, x)), copy_bytes),
    ]
    for backend in backends:
        # The reference compiles nothing and allocates its temporaries on every call anyway,
        # so on the CPU it gets no warm-up call (its 64M-element calls take seconds).
        slow = backend == "reference" and device.type == "cpu"
        repeats = args.reference_repeats if slow else None
        for op, fn, nbytes in _op_cases(x, backend, args.group_size):
            rows.append(row(backend, op, timer.seconds(fn, repeats=repeats, warm_up=not slow), nbytes))
            print(f"  timed {device.type} {dtype} {backend:9s} {op}", flush=True)
    return rows


def _check(label: str, value: str, target: str, ok: bool) -> str:
    return f"| {label} | {value} | {target} | {'PASS' if ok else 'MISS'} |"


def _target_lines(rows: list[Row], device: torch.device, dtype: str) -> list[str]:
    lines = _cpu_target_lines(rows) if device.type == "cpu" else _gpu_target_lines(rows)
    return [f"| {dtype} {line[2:]}" for line in lines]


def _cpu_target_lines(rows: list[Row]) -> list[str]:
    """The targets for the cpu backend, from this run's medians."""
    by_key = {(r.backend, r.op): r.seconds for r in rows}
    clone = by_key[("torch", "clone")]
    lines = []
    for bits in (8, 4):
        cpu = by_key.get(("cpu", f"quantize INT{bits}"))
        ref = by_key.get(("reference", f"quantize INT{bits}"))
        if cpu is not None:
            lines.append(_check(f"cpu quantize INT{bits} time / clone time", f"{cpu / clone:.2f}", "<= 1.5", cpu / clone <= 1.5))
        if cpu is not None and ref is not None:
            lines.append(_check(f"reference / cpu quantize INT{bits} time (speedup)", f"{ref / cpu:.2f}", ">= 4", ref / cpu >= 4))
    for bits in (8, 4):
        reduce = by_key.get(("cpu", f"dequant_reduce INT{bits} k={_CHUNKS} -> fp32"))
        if reduce is not None:
            label = f"cpu dequant_reduce INT{bits} of {_CHUNKS} payloads time / clone time"
            lines.append(_check(label, f"{reduce / clone:.2f}", "<= 2", reduce / clone <= 2))
    copy = by_key[("torch", "copy_ (preallocated)")]
    for op in ("quantize INT8", "quantize INT4", f"dequant_reduce INT8 k={_CHUNKS} -> fp32"):
        if ("cpu", op) in by_key:
            lines.append(f"| (info, no target) cpu {op} time / copy_ time | {by_key[('cpu', op)] / copy:.2f} | - | - |")
    return lines


def _gpu_target_lines(rows: list[Row]) -> list[str]:
    """The cuda backend's bandwidth over a copy of the same bytes, against ``GPU_TARGETS``."""
    lines = []
    for r in rows:
        if r.backend != "cuda":
            continue
        target = GPU_TARGETS[r.op.split()[0]]
        label = f"cuda {r.op} GB/s / copy GB/s (same bytes)"
        lines.append(_check(label, f"{r.vs_copy:.0%}", f">= {target:.0%}", r.vs_copy >= target))
    return lines


def _table(rows: list[Row], device: torch.device, dtype: str) -> list[str]:
    lines = ["| device | dtype | backend | op | median ms | GB/s | vs copy |", "|---|---|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {device.type} | {dtype} | {r.backend} | {r.op} | {r.seconds * 1e3:.3f} | {r.gbps:.2f} | {r.vs_copy:.0%} |"
        )
    return lines


def _numba_line() -> str:
    try:
        import numba
    except ImportError as exc:
        return f"numba not importable ({exc}): no cpu backend"
    try:
        layer = f"{numba.threading_layer()} threading layer"
    except ValueError:  # no parallel kernel has run in this process (a GPU-only run)
        layer = "no threading layer loaded"
    return f"numba {numba.__version__} ({numba.config.NUMBA_NUM_THREADS} threads, {layer})"


def _environment() -> list[str]:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next((l.split(":", 1)[1].strip() for l in lscpu.splitlines() if l.startswith("Model name")), "?")
    except (OSError, subprocess.CalledProcessError):
        model = "? (lscpu unavailable)"
    gpu = "none"
    if torch.cuda.is_available():
        gpu = f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}"
    return [
        f"- CPU: {model}, {torch.get_num_threads()} torch threads, {_numba_line()}",
        f"- GPU: {gpu}",
        f"- python {platform.python_version()}, torch {torch.__version__}",
    ]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--numel", type=parse_size, default="64M", help="elements of the input (K/M/G: powers of 1024; default 64M)")
    parser.add_argument("--dtype", nargs="+", choices=sorted(_DTYPES), default=["fp32"], help="one table per dtype")
    parser.add_argument("--device", nargs="+", choices=("cpu", "cuda"), help="default: cpu, and cuda when a GPU is visible")
    parser.add_argument("--backends", nargs="+", choices=sorted(q.backend_device_types()), help="default: every backend that can run")
    parser.add_argument("--group-size", type=int, default=None, help="default 512 (--ncu: 256)")
    parser.add_argument("--repeats", type=int, default=5, help="timed samples per op (median reported)")
    parser.add_argument("--reference-repeats", type=int, default=1, help="timed calls per reference op on the CPU")


def main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    args.group_size = args.group_size or 512
    if args.numel % (len(_PERM) * _CHUNKS):
        parser.error(f"--numel must be a multiple of {len(_PERM) * _CHUNKS}")
    if args.repeats < 1 or args.reference_repeats < 1:
        parser.error("--repeats and --reference-repeats must be >= 1")
    report = [
        f"# zcomm kernel benchmark: {args.numel} elements ({', '.join(args.dtype)}), group_size {args.group_size}",
        "",
        "GB/s = (bytes read + bytes written) / median time; each op writes into preallocated outputs.",
        "vs copy = the op's GB/s / the GB/s of a preallocated copy_ on the same device that reads and writes as many bytes.",
        f"Medians of {args.repeats} samples after one warm-up call; a sample is 1 call on the CPU (host clock), "
        f"the mean of {CUDA_CALLS_PER_SAMPLE} back-to-back calls on a GPU (CUDA events). "
        f"Reference on the CPU: {args.reference_repeats} timed calls, no warm-up.",
        "",
    ]
    try:
        plan, skipped = _plan(args)
    except ValueError as exc:
        parser.error(str(exc))
    targets = ["| target (this run) | measured | target | result |", "|---|---:|---|---|"]
    for dtype in args.dtype:
        for device, backends in plan.items():
            rows = _measure(args, device, dtype, backends)
            report += _table(rows, device, dtype) + [""]
            targets += _target_lines(rows, device, dtype)
    report += [f"Skipped: {reason}" for reason in dict.fromkeys(skipped)] + [""] + _environment() + [""]
    report += targets
    print("\n".join(report))
    if args.output:
        with open(args.output, "w") as f:
            f.write("\n".join(report) + "\n")
    return report

