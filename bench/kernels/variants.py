"""The GPU decides what stays: each kernel variant and launcher against the simpler path (docs/kernel-variants.md).

``python -m bench.kernels --variants [--quick] [--json PATH] [--output PATH]`` (CUDA). The simpler path
is another public call where one exists, else the same call with the CUDA backend's bound or
predicate overridden (:func:`_forced`); a side that launched the other's kernels was not taken.
Timing is eager: the interleaved kernel uploads its table per call, so it cannot be captured in a
CUDA graph; the launchers' row times host enqueue, on 1K-element calls, where the host is all there is.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import statistics
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterator
from unittest import mock

import torch

import zcomm.quant as q
from bench.kernels.sweep import CHUNKS, DTYPES, PERM, event_seconds

BACKEND = "zcomm.quant.backends._cuda_launch"
KEEP_RATIO = 1.10
SIZES = (16 << 20, 64 << 20)
GROUP = 256
PARTS = 8
SHARES = (0.5, 0.25, 0.125, 0.0625, 0.0625)  # the interleaved shapes: 5 tensors' shares of the elements
REPEATS, SAMPLES = 20, 5
HOST_CALLS, HOST_ROUNDS = 2000, 5
CUDA = {"backend": "cuda"}


@dataclass
class Case:
    """One target shape of a row: the variant's call and the simpler path's (None: the same call, under
    ``force``), each given its output as ``out=``, and ``out``, which makes one such output."""

    shape: str
    variant: Callable[..., object]
    out: Callable[[], torch.Tensor]
    simpler: Callable[..., object] | None = None
    force: dict[str, object] = field(default_factory=dict)  # backend names set for the simpler side
    variant_force: dict[str, object] = field(default_factory=dict)  # ... and for the variant side


@dataclass(frozen=True)
class Row:
    name: str  # as in docs/kernel-variants.md
    cases: Callable[[int], list[Case]]
    host: bool = False  # time host enqueue (the launchers) instead of the GPU


def _never(*args: object, **kwargs: object) -> bool:
    return False


def _rand(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(n, device="cuda").to(dtype)


def _bytes(*shape: int) -> Callable[[], torch.Tensor]:
    return partial(torch.empty, *shape, dtype=torch.uint8, device="cuda")


def _chunks(n: int, bits: int) -> Callable[[], torch.Tensor]:
    return _bytes(CHUNKS, q.payload_nbytes(n // CHUNKS, bits, GROUP))


def _payload_rows(n: int, bits: int) -> torch.Tensor:
    return torch.stack([q.quantize(_rand(n), bits, GROUP, **CUDA) for _ in range(CHUNKS)])


def _requant(p: torch.Tensor, n: int, bits: int, out_bits: int, divisor: float) -> Callable[..., object]:
    return partial(q.dequant_reduce, p, n, bits, GROUP, requant_chunks=CHUNKS, requant_bits=out_bits, divide_by=divisor, **CUDA)


def _reorder(x: torch.Tensor | list[torch.Tensor], bits: int, **parts: int) -> Callable[..., object]:
    return partial(q.reorder_quantize, x, PERM, CHUNKS, bits, GROUP, **parts, **CUDA)


def _interleaved_inputs(n: int, dtype: torch.dtype) -> tuple[list[torch.Tensor], dict[str, int]]:
    """5 tensors of about ``n`` elements in all, one of a width off the runs of 8, and their parts' layout."""
    widths = [max(1, int(n * share) // PARTS // 8 * 8) for share in SHARES]
    widths[1] += 3
    part_numel = -(-(sum(widths) + 5) // GROUP) * GROUP  # a zero fill of 5 or more, parts of whole groups
    return [_rand(PARTS * w, dtype) for w in widths], {"parts": PARTS, "part_numel": part_numel}


def _catenated(xs: list[torch.Tensor], part_numel: int, bits: int) -> Callable[..., object]:
    """torch.cat of the parts and the zero fill into one preallocated tensor, then the flat kernel."""
    pieces = [x.view(PARTS, -1) for x in xs]
    fill = torch.zeros(PARTS, part_numel - sum(p.shape[1] for p in pieces), device="cuda", dtype=xs[0].dtype)
    flat = torch.empty(PARTS, part_numel, device="cuda", dtype=xs[0].dtype)
    reorder = _reorder(flat.view(-1), bits)

    def call(out: torch.Tensor) -> None:
        torch.cat([*pieces, fill], dim=1, out=flat)
        reorder(out=out)

    return call


def _unfused_reorder(x: torch.Tensor, moved: torch.Tensor, perm: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """index_select of the slices into ``moved``, then a quantize per chunk."""
    torch.index_select(x.view(PARTS, -1), 0, perm, out=moved)
    for i, piece in enumerate(moved.view(CHUNKS, -1)):
        q.quantize(piece, bits, GROUP, out=out[i], **CUDA)


def _unfused_requant(p: torch.Tensor, n: int, bits: int, sums: torch.Tensor, out: torch.Tensor) -> None:
    """dequant_reduce to fp32 ``sums``, then an INT4 quantize per chunk."""
    q.dequant_reduce(p, n, bits, GROUP, divide_by=4.0, out=sums, **CUDA)
    for i, piece in enumerate(sums.view(CHUNKS, -1)):
        q.quantize(piece, 4, GROUP, out=out[i], **CUDA)


def _narrow_requant(n: int) -> list[Case]:
    cases = []
    for bits, out_bits in ((4, 4), (8, 4)):
        p = _payload_rows(n, bits)
        cases += [Case(f"INT{bits}->INT{out_bits} k={CHUNKS} /{divisor:g} ({mode})", _requant(p, n, bits, out_bits, divisor),
                       _chunks(n, out_bits), force={"narrow_requant": _never})
                  for divisor, mode in ((1.0, "one"), (4.0, "pow2"), (3.0, "div"))]  # fmt: skip
    return cases


def _interleaved(n: int, catenated: bool) -> list[Case]:
    """The interleaved kernel against torch.cat and the flat kernel, or (not ``catenated``) against
    itself without the register variant."""
    cases = []
    for tag, dtype in DTYPES.items():
        xs, layout = _interleaved_inputs(n, dtype)
        total = PARTS * layout["part_numel"]
        cases += [Case(f"{tag} INT{bits} 5 tensors, {total} elements", _reorder(xs, bits, **layout), _chunks(total, bits),
                       _catenated(xs, layout["part_numel"], bits) if catenated else None,
                       force={} if catenated else {"in_registers": _never}) for bits in (8, 4)]  # fmt: skip
    return cases


def _index_width(n: int) -> list[Case]:
    cases, wide = [], {"WIDE_NUMEL": 0}
    for tag, dtype in DTYPES.items():
        x = _rand(n, dtype)
        cases += [Case(f"flat {tag} INT{bits}", _reorder(x, bits), _chunks(n, bits), force=wide) for bits in (8, 4)]
        xs, layout = _interleaved_inputs(n, dtype)
        cases.append(Case(f"interleaved {tag} INT4 (general kernels)", _reorder(xs, 4, **layout),
                          _chunks(PARTS * layout["part_numel"], 4), force={**wide, "in_registers": _never},
                          variant_force={"in_registers": _never}))  # fmt: skip
    return cases


def _fused_reorder(n: int) -> list[Case]:
    perm, cases = torch.tensor(PERM, device="cuda"), []
    for tag, dtype in DTYPES.items():
        x, moved = _rand(n, dtype), torch.empty(PARTS, n // PARTS, device="cuda", dtype=dtype)
        cases += [Case(f"{tag} INT{bits} {len(PERM)} slices {CHUNKS} chunks", _reorder(x, bits), _chunks(n, bits),
                       partial(_unfused_reorder, x, moved, perm, bits)) for bits in (8, 4)]  # fmt: skip
    return cases


def _fused_requant(n: int) -> list[Case]:
    sums, cases = torch.empty(n, device="cuda"), []
    for bits in (4, 8):
        p = _payload_rows(n, bits)
        cases.append(Case(f"INT{bits}->INT4 k={CHUNKS} /4", _requant(p, n, bits, 4, 4.0), _chunks(n, 4),
                          partial(_unfused_requant, p, n, bits, sums)))
    return cases


def _tiles(n: int) -> list[Case]:
    group = 1 << 16
    return [Case(f"quantize {tag} INT8 group {group >> 10}K", partial(q.quantize, _rand(n, dtype), 8, group, **CUDA),
                 _bytes(q.payload_nbytes(n, 8, group)), force={"TEAM_MAX_GROUP": 1 << 62})
            for tag, dtype in DTYPES.items()]  # fmt: skip


def _launchers(n: int) -> list[Case]:
    n, launchers = 1024, dict(force={"launcher": "cupy"}, variant_force={"launcher": "driver"})
    return [Case("quantize bf16 INT8 1K", partial(q.quantize, _rand(n, torch.bfloat16), 8, GROUP, **CUDA),
                 _bytes(q.payload_nbytes(n, 8, GROUP)), **launchers),
            Case("dequant_reduce INT4 -> INT4 1K", _requant(_payload_rows(n, 4), n, 4, 4, 4.0), _chunks(n, 4), **launchers)]


# The rows of docs/kernel-variants.md, by name; the table there says what each variant and simpler path is.
ROWS = (
    Row("narrow re-quantizing kernels", _narrow_requant),
    Row("interleaved register kernel", partial(_interleaved, catenated=False)),
    Row("interleaved reorder kernels", partial(_interleaved, catenated=True)),
    Row("32-bit index kernels", _index_width),
    Row("fused reorder + quantize", _fused_reorder),
    Row("fused dequant_reduce + re-quantize", _fused_requant),
    Row("tile encoder scheme", _tiles),
    Row("driver launcher", _launchers, host=True),
)


@contextlib.contextmanager
def _forced(attrs: dict[str, object]) -> Iterator[None]:
    """The backend's names of ``attrs`` set inside the block (``launcher``: the loader's launcher). Its cache
    of resolved launches is emptied before and after, so that neither side finds a plan the other resolved."""
    from zcomm_cuda import loader

    module = importlib.import_module(BACKEND)
    names = {name: value for name, value in attrs.items() if name != "launcher"}
    missing = [name for name in names if not hasattr(module, name)]
    if missing:
        raise LookupError(f"{BACKEND} has no {', '.join(missing)}: this tree picks the variant another way")
    saved_launcher = loader.launcher()
    module.OP_PLANS.clear()
    try:
        with contextlib.ExitStack() as stack:
            for name, value in names.items():
                stack.enter_context(mock.patch.object(module, name, value))
            loader.set_launcher(str(attrs.get("launcher", saved_launcher)))
            yield
    finally:
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

    with mock.patch.object(loader, "launch", recorded):
        yield


def _gpu_us(call: Callable[[], object]) -> float:
    for _ in range(2):  # warm-up
        call()
    torch.cuda.synchronize()
    return event_seconds(call, REPEATS, SAMPLES) * 1e6


def _host_us(call: Callable[[], object]) -> float:
    """Median over rounds of the host time per call of back-to-back calls (no sync inside a round)."""
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
    """The case's kernels, byte check and times (or its problem); the variant's side first."""
    outs = case.out(), case.out()
    calls = partial(case.variant, out=outs[0]), partial(case.simpler or case.variant, out=outs[1])
    sides = tuple(zip(calls, (case.variant_force, case.force), strict=True))
    kernels: tuple[list[str], list[str]] = ([], [])
    for (call, force), names in zip(sides, kernels, strict=True):
        with _forced(force), _recording(names):
            call()
    torch.cuda.synchronize()
    result = {"shape": case.shape, "variant kernels": sorted(set(kernels[0])), "simpler kernels": sorted(set(kernels[1]))}
    if not torch.equal(*outs):
        return {**result, "problem": "outputs differ: the two paths are not the same call"}
    if kernels[0] == kernels[1] and not host:
        return {**result, "problem": "the simpler path launched the variant's kernels: it was not taken"}
    times = []
    for call, force in sides:
        with _forced(force):
            times.append((_host_us if host else _gpu_us)(call))
    return {**result, "variant us": times[0], "simpler us": times[1], "ratio": times[1] / times[0]}


def _problem(shape: str, exc: Exception) -> dict:
    return {"shape": shape, "problem": f"{type(exc).__name__}: {exc}"}


def measure(quick: bool) -> list[dict]:
    """Every row's cases at every size, with the row's decision. A case or a row's shapes that cannot be
    built or measured (e.g. LookupError: this tree picks the variant another way) are reported, and the
    other rows still run."""
    results = []
    for row in ROWS:
        entry: dict = {"row": row.name, "cases": []}
        for n in SIZES[:1] if quick or row.host else SIZES:
            prefix = "" if row.host else f"{n >> 20}M "
            try:
                cases = row.cases(n)
            except Exception as exc:
                entry["cases"].append(_problem(f"{n >> 20}M", exc))
                continue
            for case in cases:
                try:
                    measured = measure_case(case, row.host)
                except Exception as exc:
                    measured = _problem(case.shape, exc)
                entry["cases"].append({**measured, "shape": prefix + measured["shape"]})
            del cases
            torch.cuda.empty_cache()
        ratios = [c["ratio"] for c in entry["cases"] if "ratio" in c]
        failed = [c for c in entry["cases"] if "problem" in c]
        entry["geomean"] = math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios else None
        entry["decision"] = ("not decided: " + failed[0]["problem"] if failed or not ratios
                             else "keep" if entry["geomean"] >= KEEP_RATIO else "remove")  # fmt: skip
        results.append(entry)
        print(f"  {row.name}: {entry['decision']}", flush=True)
    return results


def report(results: list[dict], name: str, seconds: float) -> list[str]:
    lines = [f"# Kernel variants against the simpler path on {name} (torch {torch.__version__}), {seconds:.0f} s",
             "", f"ratio = simpler path's time / the variant's, per target shape (GPU time, eager, median of "
             f"{SAMPLES} x {REPEATS} calls; the launchers: host enqueue time). A row is kept when the geometric "
             f"mean of its ratios is >= {KEEP_RATIO:.2f} (the variant beats the simpler path by 10%); rows of "
             "docs/kernel-variants.md.", "",
             "## Decisions", "", "| row | shapes | ratios (min-max) | geo. mean | decision |", "|---|---:|---|---:|---|"]
    for r in results:
        ratios = [c["ratio"] for c in r["cases"] if "ratio" in c]
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"
        mean = f"{r['geomean']:.2f}" if r["geomean"] else "-"
        lines.append(f"| {r['row']} | {len(r['cases'])} | {spread} | {mean} | **{r['decision']}** |")
    lines += ["", "## Shapes", "", "| row | shape | variant us | simpler us | ratio | kernels (variant / simpler) |",
              "|---|---|---:|---:|---:|---|"]
    for r in results:
        lines += [f"| {r['row']} | {c['shape']} | {c['variant us']:.1f} | {c['simpler us']:.1f} | {c['ratio']:.2f} | "
                  f"{', '.join(c['variant kernels'])} / {', '.join(c['simpler kernels'])} |" if "ratio" in c
                  else f"| {r['row']} | {c['shape']} | - | - | - | {c['problem']} |" for c in r["cases"]]  # fmt: skip
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
