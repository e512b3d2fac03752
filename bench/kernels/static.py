"""Static counts of this tree's CUDA kernels: registers, spills, stack and main-loop instructions per element.

``python -m bench.kernels --static [--arch sm_90] [--sources ...] [--output PATH]``, no GPU. Each
source's translation unit (the loader's :func:`~zcomm_cuda.loader.expand_includes`) is compiled
with the loader's NVRTC options by nvcc, whose front end and ptxas are NVRTC's (the cubin NVRTC
returns through cupy is cut short: its ELF program headers lie past its end), and read with PyPI's
``cuobjdump`` and ``nvdisasm`` (``pip install --target DIR nvidia-cuda-cuobjdump
nvidia-cuda-nvdisasm``, DIR ``$ZC_SASS_TOOLS``, by default :data:`TOOLS`).

Columns: ``regs``, ``stack/local`` (``cuobjdump -res-usage``); ``sass``, the kernel's instructions;
``loop/elem``, the static size of its vector main loop(s) over the elements one iteration handles
on one thread (:data:`ELEMENTS`). A loop is a backward branch; a main loop holds a 128-bit global
access and a line of a :data:`HOT` function (``-lineinfo``, checked not to change the code on
:data:`CONTROL_SOURCE`): the register encoder's ``RegisterLane`` loop, else the streamed
encoder's two loops (their costs add); for decoders ``decode_group_lane``, else ``decode_run``;
the smallest where it is inlined several times, the divisor-1 loop where there is one per
``DivisorMode``. ``round/elem``: the encoders' whole team round loop over the elements one lane
handles per round of a 256-element group (:data:`ROUND_ELEMENTS`), like for like between register
and streamed encoders. ``div/elem``: fp32 divisions (one ``FCHK`` each) in the main loops. Code
whose inlining chain (``nvdisasm -gi``) passes through a :data:`COLD` function runs only for rare
groups: the per-element columns leave it out and ``main loops`` shows it as ``cold N``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from zcomm_cuda import loader

_FUNC = re.compile(r"^\s*\.text\.(\w+):")
_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRA = re.compile(r"\bBRA\b.*?`\((\.L_x_\d+)\)")
_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
TOOLS = Path(os.environ.get("ZC_SASS_TOOLS", "/tmp/sasstools"))
CONTROL_SOURCE = "quantize.cu"  # compiled with and without -lineinfo, to check they agree
HOT = {"registers": ("RegisterLane",), "streamed": ("lane_absmax", "encode_group_lane"),
       "decoder": ("decode_group_lane", "decode_run")}  # fmt: skip
# Functions whose code in a main loop runs only for rare groups: the register encoder's general
# rule (a NaN/Inf element, a subnormal scale) and InterleavedSource's groups that straddle a
# stretch end ([Note: round stretch] in sources.cuh).
COLD = ("rewrite_as_codes", "load_straddling")
# Elements one main-loop iteration handles on one thread: a run of 8, except the register
# encoder's round (kRunsPerLane = 4 runs per lane and group, team_walk.cuh); per lane and round
# of a 256-element group, the streamed teams of 32 lanes take 8 each, the register teams of 8 lanes 32.
ELEMENTS = {"RegisterLane": 32, "lane_absmax": 8, "encode_group_lane": 8, "decode_group_lane": 8, "decode_run": 8}
ROUND_ELEMENTS = {"streamed": 8, "registers": 32}


@dataclass
class Loop:
    instructions: int
    wide: bool  # holds a 128-bit global load or store
    functions: frozenset[str]  # the HOT functions of its lines
    divisions: int  # FCHKs outside cold code
    shuffles: int
    loads: int  # global loads of any width
    innermost: bool
    cold: int  # instructions of COLD functions


def _run(*argv: str) -> str:
    return subprocess.run(argv, check=True, capture_output=True, text=True).stdout


def _tool(name: str) -> str:
    found = next((p for p in TOOLS.rglob(name) if p.is_file()), None)
    if found is None:
        raise SystemExit(f"{name} not found under {TOOLS} ($ZC_SASS_TOOLS): pip install --target {TOOLS} nvidia-cuda-{name}")
    return str(found)


def _compile(source: str, arch: str, work: Path, *extra: str) -> Path:
    unit = work / f"{source}{''.join(extra)}.cu"
    unit.write_text(loader.expand_includes(loader.KERNEL_DIR / source))
    _run("nvcc", "--cubin", f"-arch={arch}", *loader.NVRTC_OPTIONS, *extra, "-o", str(unit.with_suffix(".cubin")), str(unit))
    return unit.with_suffix(".cubin")


def _resources(cuobjdump: str, cubin: Path) -> dict[str, dict[str, int]]:
    found = {}
    for name, usage in re.findall(r"Function (\w+):\s*\n\s*(REG:.*)", _run(cuobjdump, "-res-usage", str(cubin))):
        fields = dict(item.split(":") for item in usage.split())
        found[name] = {key: int(fields[key]) for key in ("REG", "STACK", "LOCAL")}
    return found


def _function_lines(unit: Path) -> dict[tuple[str, int], str]:
    """(file name, line) -> the HOT or COLD function whose body holds that line of ``unit`` (by brace depth)."""
    owners, current, depth = {}, None, 0
    names = {name for group in HOT.values() for name in group} | set(COLD)
    for number, line in enumerate(unit.read_text().splitlines(), 1):
        if current is None:
            for name in names:
                if re.search(rf"\b{name}\b\s*[({{<]", line) and ("ZC_HD" in line or "struct" in line or "void" in line):
                    current, depth = name, 0
        if current is not None:
            depth += line.count("{") - line.count("}")
            owners[(unit.name, number)] = current
            if depth <= 0 and "}" in line:
                current = None
    return owners


def _sass(nvdisasm: str, cubin: Path, line_info: bool) -> dict[str, list[tuple]]:
    """Per kernel, (offset or -1 for a label, text, innermost (file, line), inlining chain) of each line.

    With ``-gi`` an instruction's location is a chain of ``//##`` lines, the innermost first."""
    kernels: dict[str, list] = {}
    current, where, chain, in_chain = None, None, frozenset(), False
    for line in _run(nvdisasm, "-c", *(["-gi"] if line_info else []), str(cubin)).splitlines():
        if func := _FUNC.match(line):
            current = kernels.setdefault(func.group(1), [])
        elif found := _LINE.search(line):
            location = (Path(found.group(1)).name, int(found.group(2)))
            if not in_chain:
                where, chain, in_chain = location, frozenset(), True
            chain |= {location}
        else:
            in_chain = False
            if current is not None and (label := _LABEL.match(line)):
                current.append((-1, label.group(1), None, frozenset()))
            elif current is not None and (instr := _INSTR.search(line)):
                current.append((int(instr.group(1), 16), instr.group(2).strip(), where, chain))
    return kernels


def _loops(listing: list, owners: dict) -> list[Loop]:
    """Every loop: a branch back to an earlier label, its body the instructions in between."""
    label_at, flat, spans = {}, [], []
    for offset, text, where, chain in listing:
        if offset < 0:
            label_at[text] = len(flat)
        else:
            flat.append((text, where, any(owners.get(w) in COLD for w in chain)))
    for index, (text, _, _) in enumerate(flat):
        target = _BRA.search(text)
        if target and label_at.get(target.group(1), index + 1) <= index:
            spans.append((label_at[target.group(1)], index))

    def count(body: list, pattern: str, warm: bool = False) -> int:
        return sum(1 for text, _, cold in body if re.search(pattern, text) and not (warm and cold))

    loops = []
    for start, end in spans:
        body = flat[start : end + 1]
        loops.append(Loop(
            instructions=len(body), wide=count(body, r"\b(LDG|STG)\.E\.(ENL2\.)?128\b") > 0,
            functions=frozenset(owners[w] for _, w, _ in body if w in owners and owners[w] not in COLD),
            divisions=count(body, r"\bFCHK\b", warm=True), shuffles=count(body, r"\bSHFL\."), loads=count(body, r"\bLDG\."),
            innermost=not any(o != (start, end) and start <= o[0] and o[1] <= end for o in spans),
            cold=sum(1 for _, _, cold in body if cold)))  # fmt: skip
    return loops


def _is_decoder(kernel: str) -> bool:
    return kernel.startswith("zc_dequantize") or (kernel.startswith("zc_dequant_reduce_") and "requant" not in kernel)


def _pick(loops: list[Loop], name: str, innermost_only: bool) -> Loop | None:
    # the team decoder's loop runs only on the vector path, whatever width its accesses compile to
    found = [l for l in loops if name in l.functions and (l.wide or name == "decode_group_lane")
             and (l.innermost or not innermost_only)]  # fmt: skip
    return min(found, key=lambda l: l.instructions, default=None)


def _round_per_element(kernel: str, loops: list[Loop]) -> float | None:
    """The encoder's team round loop (shuffles, per-group work, loads, codes, stores, branches this
    group size does not take) per element one lane handles in a round of a 256-element group."""
    # A round reads its group: a span with shuffles but no load is a branch from cold code after the loop into its tail.
    rounds = [l for l in loops if l.shuffles and l.loads and ("RegisterLane" in l.functions
                                                             or set(HOT["streamed"]) <= l.functions)]  # fmt: skip
    if _is_decoder(kernel) or not rounds:
        return None
    registers = [l for l in rounds if "RegisterLane" in l.functions]
    loop = min(registers or rounds, key=lambda l: l.instructions)
    return (loop.instructions - loop.cold) / ROUND_ELEMENTS["registers" if registers else "streamed"]


def _per_element(kernel: str, loops: list[Loop]) -> tuple[float | None, float | None, str]:
    """(instructions per element of the main loops, divisions per element in them, which loops)."""
    first = HOT["decoder"] if _is_decoder(kernel) else HOT["registers"]
    chosen = next(({name: loop} for name in first if (loop := _pick(loops, name, False))), {})
    if not chosen and not _is_decoder(kernel):  # the streamed encoder: two loops, both over every element
        chosen = {name: loop for name in HOT["streamed"] if (loop := _pick(loops, name, True))}
    if not chosen:
        return None, None, "-"
    return (sum((loop.instructions - loop.cold) / ELEMENTS[name] for name, loop in chosen.items()),
            sum(loop.divisions / ELEMENTS[name] for name, loop in chosen.items()),
            "+".join(f"{n}({l.instructions}{f', cold {l.cold}' if l.cold else ''})" for n, l in chosen.items()))


def analyse(arch: str, work: Path, sources: list[str]) -> tuple[dict[str, dict], list[str]]:
    """Per kernel its columns, and the kernels whose instruction count -lineinfo changed (the control compile)."""
    cuobjdump, nvdisasm = _tool("cuobjdump"), _tool("nvdisasm")
    report, changed = {}, []
    for source in sources:
        lined = _compile(source, arch, work, "-lineinfo")
        owners, resources = _function_lines(lined.with_suffix(".cu")), _resources(cuobjdump, lined)
        lined_sass = plain_sass = _sass(nvdisasm, lined, line_info=True)
        if source == CONTROL_SOURCE:
            plain = _compile(source, arch, work)
            plain_sass = _sass(nvdisasm, plain, line_info=False)
            assert _resources(cuobjdump, plain) == resources, source
        for kernel, usage in sorted(resources.items()):
            count = sum(1 for offset, *_ in plain_sass[kernel] if offset >= 0)
            if count != sum(1 for offset, *_ in lined_sass[kernel] if offset >= 0):
                changed.append(kernel)
            loops = _loops(lined_sass[kernel], owners)
            per_element, divisions, which = _per_element(kernel, loops)
            report[kernel] = dict(usage, sass=count, per_element=per_element, divisions=divisions, loops=which,
                                  round=_round_per_element(kernel, loops))  # fmt: skip
    return report, changed


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(report: dict[str, dict], changed: list[str], arch: str) -> list[str]:
    nvcc = _run("nvcc", "--version").strip().splitlines()[-1]
    lines = [f"# CUDA kernels, static report ({arch}, nvcc {nvcc}, options {' '.join(loader.NVRTC_OPTIONS)})", "",
             f"Made by `python -m bench.kernels --static` on {datetime.date.today().isoformat()}: static numbers from "
             "the compiler, no GPU (bench/kernels/static.py says how the main loop is found and counted). In the "
             "register loop `div/elem` is the group's scale and reciprocal, computed by each lane once per group.", "",
             "| kernel | regs | stack/local | sass | loop/elem | round/elem | div/elem | main loops |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for kernel, k in sorted(report.items()):
        lines.append(f"| `{kernel}` | {k['REG']} | {k['STACK']}/{k['LOCAL']} | {k['sass']} | {_fmt(k['per_element'])} "
                     f"| {_fmt(k['round'])} | {_fmt(k['divisions'], 3)} | {k['loops']} |")
    return lines + ["", f"Control compile of {CONTROL_SOURCE} without -lineinfo: instruction count changed for "
                    f"{', '.join(changed) or 'no kernel'}."]  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", default="sm_90", help="--static: the architecture compiled for")
    parser.add_argument("--sources", nargs="+", choices=loader.KERNEL_SOURCES, default=list(loader.KERNEL_SOURCES),
                        help="--static: the kernel sources to compile")


def main(args: argparse.Namespace) -> list[str]:
    with tempfile.TemporaryDirectory() as work:
        return render(*analyse(args.arch, Path(work), args.sources), args.arch)
