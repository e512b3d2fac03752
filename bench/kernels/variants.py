"""The GPU decides what stays: each kernel variant and launcher against the simpler path.

``python -m bench.kernels --variants [--quick] [--json PATH] [--output PATH]`` (CUDA). Every
row of :data:`ROWS` is a row of ``docs/kernel-variants.md`` (which says how a row is decided
and what a **remove** takes with it). For each of the row's target shapes both paths run once
into their own outputs, which must be byte-identical, and the kernels each launched are
recorded: a simpler path that launched the variant's kernels is a failed row, not a
measurement. The row is **keep** when the geometric mean of its shapes' ratios (simpler time
/ variant time) is at least :data:`KEEP_RATIO`, else **remove**.

The simpler path is another public call where one exists (the unfused ops; ``torch.cat``
then the flat kernel). Where the CUDA backend picks the variant by size, the bound or
predicate it reads is overridden for the simpler side's calls (:func:`_forced`); a tree
without that name reports the row as not measured, naming it.

Timing is eager, because the interleaved kernel uploads its table per call and cannot be
captured in a CUDA graph: two warm-up calls, then :data:`SAMPLES` samples of :data:`REPEATS`
back-to-back calls between two CUDA events, the median. The launchers' row times host
enqueue instead (no sync inside a round), on 1K-element calls, where the host is all there
is; its ratio is cupy's host time over the driver's.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

import zcomm.quant as q
from bench.kernels.sweep import event_seconds

BACKEND = "zcomm.quant.backends._cuda_launch"
KEEP_RATIO = 1.10
SIZES = (16 << 20, 64 << 20)
GROUP = 256
PERM = (7, 6, 5, 4, 3, 2, 1, 0)
CHUNKS = 4
PARTS = 8
SHARES = (0.5, 0.25, 0.125, 0.0625, 0.0625)  # the interleaved shapes: 5 tensors' shares of the elements
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
REPEATS, SAMPLES = 20, 5
HOST_CALLS, HOST_ROUNDS = 2000, 5
Call = Callable[[], object]


@dataclass
class Case:
    """One target shape of a row: the variant's call and the simpler path's, each into its own output."""

    shape: str
    variant: Call
    variant_out: torch.Tensor
    simpler: Call
    simpler_out: torch.Tensor
    force: dict[str, object] = field(default_factory=dict)  # backend names set for the simpler side
    variant_force: dict[str, object] = field(default_factory=dict)  # ... and for the variant side


@dataclass(frozen=True)
class Row:
    name: str  # as in docs/kernel-variants.md
    variant: str
    simpler: str
    cases: Callable[[int], list[Case]]
    host: bool = False  # time host enqueue (the launchers) instead of the GPU


def _never(*args: object, **kwargs: object) -> bool:
    return False


def _rand(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, device="cuda").to(dtype)


def _payload_rows(n: int, bits: int) -> torch.Tensor:
    return torch.stack([q.quantize(_rand(n), bits, GROUP, backend="cuda") for _ in range(CHUNKS)])


def _chunks(n: int, bits: int) -> torch.Tensor:
    return torch.empty(CHUNKS, q.payload_nbytes(n // CHUNKS, bits, GROUP), dtype=torch.uint8, device="cuda")


def _requant(p: torch.Tensor, n: int, bits: int, out_bits: int, divisor: float, out: torch.Tensor) -> Call:
    return lambda: q.dequant_reduce(p, n, bits, GROUP, requant_chunks=CHUNKS, requant_bits=out_bits,
                                    divide_by=divisor, out=out, backend="cuda")


def _narrow_requant(n: int) -> list[Case]:
    cases = []
    for bits, out_bits in ((4, 4), (8, 4)):
        p = _payload_rows(n, bits)
        for divisor, mode in ((1.0, "one"), (4.0, "pow2"), (3.0, "div")):
            a, b = _chunks(n, out_bits), _chunks(n, out_bits)
            cases.append(Case(f"INT{bits}->INT{out_bits} k={CHUNKS} /{divisor:g} ({mode})",
                              _requant(p, n, bits, out_bits, divisor, a), a,
                              _requant(p, n, bits, out_bits, divisor, b), b, force={"narrow_requant": _never}))
    return cases


def _interleaved_inputs(n: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], int]:
    """5 tensors of about ``n`` elements in all, one of a width off the runs of 8; the part size."""
    widths = [max(1, int(n * share) // PARTS // 8 * 8) for share in SHARES]
    widths[1] += 3
    part_numel = -(-(sum(widths) + 5) // GROUP) * GROUP  # a zero fill of 5 or more, parts of whole groups
    return [_rand(PARTS * w, dtype) for w in widths], part_numel


def _interleaved(xs: list[torch.Tensor], part_numel: int, bits: int, out: torch.Tensor) -> Call:
    return lambda: q.reorder_quantize(xs, PERM, CHUNKS, bits, GROUP, parts=PARTS, part_numel=part_numel, out=out,
                                      backend="cuda")


def _flat(x: torch.Tensor, bits: int, out: torch.Tensor) -> Call:
    return lambda: q.reorder_quantize(x, PERM, CHUNKS, bits, GROUP, out=out, backend="cuda")


def _interleaved_cases(n: int, simpler: Callable[..., tuple[Call, dict]]) -> list[Case]:
    cases = []
    for tag, dtype in DTYPES.items():
        xs, part_numel = _interleaved_inputs(n, dtype)
        for bits in (8, 4):
            a, b = _chunks(PARTS * part_numel, bits), _chunks(PARTS * part_numel, bits)
            call, force = simpler(xs, part_numel, bits, b)
            cases.append(Case(f"{tag} INT{bits} 5 tensors, {PARTS * part_numel} elements",
                              _interleaved(xs, part_numel, bits, a), a, call, b, force=force))
    return cases


def _catenated(xs: list[torch.Tensor], part_numel: int, bits: int, out: torch.Tensor) -> tuple[Call, dict]:
    """torch.cat of the parts and the zero fill into one preallocated tensor, then the flat kernel."""
    pieces = [x.view(PARTS, -1) for x in xs]
    fill = torch.zeros(PARTS, part_numel - sum(p.shape[1] for p in pieces), device="cuda", dtype=xs[0].dtype)
    flat = torch.empty(PARTS, part_numel, device="cuda", dtype=xs[0].dtype)
    reorder = _flat(flat.view(-1), bits, out)

    def call() -> None:
        torch.cat([*pieces, fill], dim=1, out=flat)
        reorder()

    return call, {}


def _index_width(n: int) -> list[Case]:
    cases = []
    for tag, dtype in DTYPES.items():
        x = _rand(n, dtype)
        for bits in (8, 4):
            a, b = _chunks(n, bits), _chunks(n, bits)
            cases.append(Case(f"flat {tag} INT{bits}", _flat(x, bits, a), a, _flat(x, bits, b), b,
                              force={"WIDE_NUMEL": 0}))
        xs, part_numel = _interleaved_inputs(n, dtype)
        a, b = _chunks(PARTS * part_numel, 4), _chunks(PARTS * part_numel, 4)
        cases.append(Case(f"interleaved {tag} INT4 (general kernels)", _interleaved(xs, part_numel, 4, a), a,
                          _interleaved(xs, part_numel, 4, b), b, force={"WIDE_NUMEL": 0, "in_registers": _never},
                          variant_force={"in_registers": _never}))
    return cases


def _fused_reorder(n: int) -> list[Case]:
    cases = []
    perm = torch.tensor(PERM, device="cuda")
    for tag, dtype in DTYPES.items():
        x = _rand(n, dtype)
        moved = torch.empty(PARTS, n // PARTS, device="cuda", dtype=dtype)
        for bits in (8, 4):
            a, b = _chunks(n, bits), _chunks(n, bits)

            def unfused(b=b, bits=bits, x=x, moved=moved) -> None:
                torch.index_select(x.view(PARTS, -1), 0, perm, out=moved)
                for i, piece in enumerate(moved.view(CHUNKS, -1)):
                    q.quantize(piece, bits, GROUP, out=b[i], backend="cuda")

            cases.append(Case(f"{tag} INT{bits} {len(PERM)} slices {CHUNKS} chunks", _flat(x, bits, a), a, unfused, b))
    return cases


def _fused_requant(n: int) -> list[Case]:
    cases = []
    sums = torch.empty(n, device="cuda")
    for bits in (4, 8):
        p = _payload_rows(n, bits)
        a, b = _chunks(n, 4), _chunks(n, 4)

        def unfused(p=p, bits=bits, b=b) -> None:
            q.dequant_reduce(p, n, bits, GROUP, divide_by=4.0, out=sums, backend="cuda")
            for i, piece in enumerate(sums.view(CHUNKS, -1)):
                q.quantize(piece, 4, GROUP, out=b[i], backend="cuda")

        cases.append(Case(f"INT{bits}->INT4 k={CHUNKS} /4", _requant(p, n, bits, 4, 4.0, a), a, unfused, b))
    return cases


def _tiles(n: int) -> list[Case]:
    cases, group = [], 1 << 16
    for tag, dtype in DTYPES.items():
        x = _rand(n, dtype)
        a = torch.empty(q.payload_nbytes(n, 8, group), dtype=torch.uint8, device="cuda")
        b = torch.empty_like(a)
        cases.append(Case(f"quantize {tag} INT8 group {group >> 10}K",
                          lambda a=a, x=x: q.quantize(x, 8, group, out=a, backend="cuda"), a,
                          lambda b=b, x=x: q.quantize(x, 8, group, out=b, backend="cuda"), b,
                          force={"TEAM_MAX_GROUP": 1 << 62}))  # fmt: skip
    return cases


def _launchers(n: int) -> list[Case]:
    n = 1024
    x, p = _rand(n, torch.bfloat16), _payload_rows(n, 4)
    cases = []
    for name, make in (("quantize bf16 INT8 1K", lambda o: lambda: q.quantize(x, 8, GROUP, out=o, backend="cuda")),
                       ("dequant_reduce INT4 -> INT4 1K", lambda o: _requant(p, n, 4, 4, 4.0, o))):
        a = torch.empty(q.payload_nbytes(n, 8, GROUP), dtype=torch.uint8, device="cuda") if "quantize" in name \
            else _chunks(n, 4)
        b = torch.empty_like(a)
        cases.append(Case(name, make(a), a, make(b), b, force={"launcher": "cupy"}, variant_force={"launcher": "driver"}))
    return cases


ROWS = (
    Row("narrow re-quantizing kernels", "zc_dequant_reduce_requant_regs_{one,pow2,div}_int*_int* (12)",
        "the general re-quantizing kernel zc_dequant_reduce_requant_int*_int*", _narrow_requant),
    Row("interleaved register kernel", "zc_reorder_interleaved_regs_* (6)",
        "the general interleaved kernel zc_reorder_interleaved_*", lambda n: _interleaved_cases(
            n, lambda xs, pn, bits, out: (_interleaved(xs, pn, bits, out), {"in_registers": _never}))),
    Row("interleaved reorder kernels", "zc_reorder_interleaved_* (6, with _regs and _wide: 18)",
        "torch.cat of the parts and fill, then the flat zc_reorder_quantize_*",
        lambda n: _interleaved_cases(n, _catenated)),
    Row("32-bit index kernels", "zc_reorder_quantize_*, zc_reorder_interleaved_* (12) beside their _wide forms",
        "the _wide (64-bit index) kernels for every size", _index_width),
    Row("fused reorder + quantize", "zc_reorder_quantize_* (6)",
        "index_select of the slices, then zc_quantize_* per chunk", _fused_reorder),
    Row("fused dequant_reduce + re-quantize", "zc_dequant_reduce_requant_* (4, and the narrow 12)",
        "zc_dequant_reduce_* to fp32, then zc_quantize_* per chunk", _fused_requant),
    Row("tile encoder scheme", "the two-pass tile scheme of every encoder (groups over 4096 elements)",
        "the team scheme for every group size", _tiles),
    Row("driver launcher", "zcomm_cuda/driver_launch.py (cuLaunchKernelEx through ctypes)",
        "cupy's RawKernel launch", _launchers, host=True),
)


@contextlib.contextmanager
def _forced(attrs: dict[str, object]) -> Iterator[None]:
    """The backend's names of ``attrs`` set inside the block (``launcher``: the loader's launcher). Its cache
    of resolved launches is emptied before and after, so that neither side finds a plan the other resolved."""
    from zcomm_cuda import loader

    module = importlib.import_module(BACKEND)
    attrs = dict(attrs)
    launcher = attrs.pop("launcher", None)
    missing = [name for name in attrs if not hasattr(module, name)]
    if missing:
        raise LookupError(f"{BACKEND} has no {', '.join(missing)}: this tree picks the variant another way")
    saved, saved_launcher = {name: getattr(module, name) for name in attrs}, loader.launcher()
    module.OP_PLANS.clear()
    try:
        for name, value in attrs.items():
            setattr(module, name, value)
        if launcher:
            loader.set_launcher(launcher)
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)
        loader.set_launcher(saved_launcher)
        module.OP_PLANS.clear()


@contextlib.contextmanager
def _recording(names: list[str]) -> Iterator[None]:
    """Every kernel ``zcomm_cuda.loader.launch`` launches inside the block, appended to ``names``."""
    from zcomm_cuda import loader

    launch = loader.launch

    def recorded(source, name, *args, **kwargs):
        names.append(name)
        return launch(source, name, *args, **kwargs)

    loader.launch = recorded
    try:
        yield
    finally:
        loader.launch = launch


def _gpu_us(call: Call) -> float:
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    return event_seconds(call, REPEATS, SAMPLES) * 1e6


def _host_us(call: Call) -> float:
    call()
    rounds = []
    for _ in range(HOST_ROUNDS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(HOST_CALLS):
            call()
        rounds.append((time.perf_counter() - start) / HOST_CALLS * 1e6)
    torch.cuda.synchronize()
    return statistics.median(rounds)


def measure_case(case: Case, host: bool) -> dict:
    """The case's kernels, byte check and times (or its problem)."""
    timer = _host_us if host else _gpu_us
    kernels: dict[str, list[str]] = {"variant": [], "simpler": []}
    with _forced(case.variant_force), _recording(kernels["variant"]):
        case.variant()
    with _forced(case.force), _recording(kernels["simpler"]):
        case.simpler()
    torch.cuda.synchronize()
    result = {"shape": case.shape, "variant kernels": sorted(set(kernels["variant"])),
              "simpler kernels": sorted(set(kernels["simpler"]))}
    if not torch.equal(case.variant_out, case.simpler_out):
        return {**result, "problem": "outputs differ: the two paths are not the same call"}
    if kernels["variant"] == kernels["simpler"] and not host:
        return {**result, "problem": "the simpler path launched the variant's kernels: it was not taken"}
    with _forced(case.variant_force):
        variant = timer(case.variant)
    with _forced(case.force):
        simpler = timer(case.simpler)
    return {**result, "variant us": variant, "simpler us": simpler, "ratio": simpler / variant}


def measure(quick: bool) -> list[dict]:
    """Every row's cases at every size, with the row's decision."""
    results = []
    for row in ROWS:
        entry: dict = {"row": row.name, "variant": row.variant, "simpler": row.simpler, "cases": []}
        for n in SIZES[:1] if quick or row.host else SIZES:
            try:
                cases = row.cases(n)
            except Exception as exc:  # a row that cannot be built is reported; the other rows still run
                entry["cases"].append({"shape": f"{n >> 20}M", "problem": f"{type(exc).__name__}: {exc}"})
                continue
            for case in cases:
                try:
                    measured = measure_case(case, row.host)
                except Exception as exc:  # e.g. LookupError: this tree picks the variant another way
                    measured = {"shape": case.shape, "problem": f"{type(exc).__name__}: {exc}"}
                entry["cases"].append({**measured, "shape": f"{n >> 20}M {measured['shape']}" if not row.host
                                       else measured["shape"]})
            del cases
            torch.cuda.empty_cache()
        ratios = [c["ratio"] for c in entry["cases"] if "ratio" in c]
        failed = [c for c in entry["cases"] if "problem" in c]
        entry["geomean"] = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None
        entry["decision"] = ("not decided: " + failed[0]["problem"] if failed or not ratios
                             else "keep" if entry["geomean"] >= KEEP_RATIO else "remove")
        results.append(entry)
        print(f"  {row.name}: {entry['decision']}", flush=True)
    return results


def report(results: list[dict], name: str, seconds: float) -> list[str]:
    lines = [f"# Kernel variants against the simpler path on {name} (torch {torch.__version__}), {seconds:.0f} s",
             "", f"ratio = simpler path's time / the variant's, per target shape (GPU time, eager, median of "
             f"{SAMPLES} x {REPEATS} calls; the launchers: host enqueue time). A row is kept when the geometric "
             f"mean of its ratios is >= {KEEP_RATIO:.2f} (the variant beats the simpler path by 10%); rows of "
             "docs/kernel-variants.md.", "",
             "## Decisions", "", "| row | variant | simpler path | shapes | ratios (min-max) | geo. mean | decision |",
             "|---|---|---|---:|---|---:|---|"]
    for r in results:
        ratios = [c["ratio"] for c in r["cases"] if "ratio" in c]
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"
        mean = f"{r['geomean']:.2f}" if r["geomean"] else "-"
        lines.append(f"| {r['row']} | {r['variant']} | {r['simpler']} | {len(r['cases'])} | {spread} | {mean} "
                     f"| **{r['decision']}** |")
    lines += ["", "## Shapes", "", "| row | shape | variant us | simpler us | ratio | kernels (variant / simpler) |",
              "|---|---|---:|---:|---:|---|"]
    for r in results:
        for c in r["cases"]:
            if "ratio" in c:
                lines.append(f"| {r['row']} | {c['shape']} | {c['variant us']:.1f} | {c['simpler us']:.1f} "
                             f"| {c['ratio']:.2f} | {', '.join(c['variant kernels'])} / {', '.join(c['simpler kernels'])} |")
            else:
                lines.append(f"| {r['row']} | {c['shape']} | - | - | - | {c['problem']} |")
    return lines


def main(args) -> list[str]:
    started = time.perf_counter()
    results = measure(args.quick)
    lines = report(results, torch.cuda.get_device_name(), time.perf_counter() - started)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, keep_ratio=KEEP_RATIO,
                           rows=results), f, indent=1)
    return lines
