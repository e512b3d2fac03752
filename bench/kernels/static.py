"""Static report of the CUDA kernels: registers, spills, stack and main-loop instructions per element.

``python -m bench.kernels --static [--before REV] [--arch sm_90] [--output PATH]``. No GPU is
needed: the kernels of this tree and of git revision ``REV`` (default: the merge base with
``main``) are compiled as the loader compiles them (its translation unit,
:func:`zcomm_cuda.loader.expand_includes`, with :data:`~zcomm_cuda.loader.NVRTC_OPTIONS`
and ``-arch``) by nvcc, whose front end and ptxas are NVRTC's of the same CUDA release
(see :func:`_compile` for why not NVRTC itself), and the cubins are read with PyPI's
``cuobjdump`` and ``nvdisasm`` (``pip install --target DIR nvidia-cuda-cuobjdump
nvidia-cuda-nvdisasm``; ``--tools DIR`` or ``$ZC_SASS_TOOLS`` says where).

Columns, per kernel:
* ``regs``, ``stack``, ``local`` (spill space): ``cuobjdump -res-usage`` of the cubin;
* ``sass``: the kernel's SASS instructions (all paths);
* ``loop/elem``: instructions per element of the kernel's vector main loop(s), per thread.
  Loops are backward branches in the SASS; each instruction's source function comes from
  ``-lineinfo`` (which must not change the code: checked on :data:`CONTROL_SOURCE`). A main
  loop holds a 128-bit global load or store and an instruction of a :data:`HOT` function: the
  register encoder's ``RegisterLane`` round loop, or else the streamed encoder's
  ``lane_absmax`` and ``encode_group_lane`` loops (their costs add); for the decoders
  ``decode_group_lane``, else ``decode_run``. Where a loop is inlined several times the
  smallest counts. Its cost is its static body size over the elements one iteration
  handles on one thread (:data:`_ELEMENTS`): a static estimate, not a measurement.
* ``round/elem``: the encoders' whole team round loop (shuffles, per-group work, loads,
  codes, stores, and branches this group size does not take) over the elements one lane
  handles per round of a 256-element group (:data:`_ROUND_ELEMENTS`): like for like
  between register and streamed encoders.
* ``div/elem``: fp32 division sequences (one ``FCHK`` each) in the main loops, per element.
* cold code: instructions of a main loop whose inlining chain (``nvdisasm -gi``) passes
  through a :data:`COLD` function, run only for rare groups behind a branch the others jump
  over; the per-element columns leave them out and ``main loops`` shows them as ``cold N``.
Where a decoder or a re-quantizing encoder has one loop per divisor kind (``DivisorMode``),
the divisor-1 loop counts.
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

REPO = Path(__file__).resolve().parents[2]
_FUNC = re.compile(r"^\s*\.text\.(\w+):")
_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRA = re.compile(r"\bBRA\b.*?`\((\.L_x_\d+)\)")
_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
CONTROL_SOURCE = "quantize.cu"  # compiled with and without -lineinfo, to check they agree
HOT = {  # source functions (by the text of their lines) whose loops are a kernel's main loops
    "encoder_registers": ("RegisterLane",),
    "encoder_streamed": ("lane_absmax", "encode_group_lane"),
    "decoder": ("decode_group_lane", "decode_run"),
}
# Source functions whose code inside a main loop runs only for rare groups (the register
# encoder's general rule for a NaN/Inf element or a subnormal scale; InterleavedSource's
# groups that straddle a stretch end, [Note: round stretch] in sources.cuh): an instruction
# is cold when any function of its inlining chain is one of these. Counted apart.
COLD = ("rewrite_as_codes", "load_straddling")


@dataclass
class Loop:
    start: int
    end: int
    instructions: int
    wide_loads: int
    wide_stores: int
    functions: frozenset[str]
    divisions: int  # fp32 division sequences (each has one FCHK range check)
    shuffles: int
    loads: int  # global loads of any width
    innermost: bool
    cold: int  # instructions of COLD functions (their branch is not taken for plain groups)


def _tool(tools: Path, name: str) -> str:
    for candidate in tools.rglob(name):
        if candidate.is_file():
            return str(candidate)
    raise SystemExit(f"{name} not found under {tools}: pip install --target {tools} nvidia-cuda-{name}")


def _compile(kernel_dir: Path, source: str, arch: str, work: Path, extra: tuple[str, ...] = ()) -> Path:
    """nvcc's cubin of ``source``'s translation unit (the loader's expand_includes) with the
    loader's NVRTC options: the cubin NVRTC returns through cupy (``getCUBIN``) is cut short
    here (its ELF program headers lie past its end), so cuobjdump and nvdisasm cannot read it."""
    unit = work / f"{source}{''.join(extra)}.cu"
    unit.write_text(loader.expand_includes(kernel_dir / source))
    cubin = unit.with_suffix(".cubin")
    subprocess.run(["nvcc", "--cubin", f"-arch={arch}", *loader.NVRTC_OPTIONS, *extra, "-o", str(cubin), str(unit)],
                   check=True, capture_output=True)
    return cubin


def _resources(cuobjdump: str, cubin: Path) -> dict[str, dict[str, int]]:
    text = subprocess.run([cuobjdump, "-res-usage", str(cubin)], check=True, capture_output=True, text=True).stdout
    found = {}
    for name, usage in re.findall(r"Function (\w+):\s*\n\s*(REG:.*)", text):
        fields = dict(item.split(":") for item in usage.split())
        found[name] = {key: int(fields[key]) for key in ("REG", "STACK", "LOCAL")}
    return found


def _function_lines(unit: Path) -> dict[tuple[str, int], str]:
    """(file name, line) -> the hot function whose body holds that line of the translation
    unit ``unit`` (by brace depth; the line info of its cubin names this file)."""
    owners = {}
    names = {name for group in HOT.values() for name in group} | set(COLD)
    for path in (unit,):
        current, depth = None, 0
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if current is None:
                for name in names:
                    if re.search(rf"\b{name}\b\s*[({{<]", line) and ("ZC_HD" in line or "struct" in line or "void" in line):
                        current, depth = name, 0
            if current is not None:
                depth += line.count("{") - line.count("}")
                owners[(path.name, number)] = current
                if depth <= 0 and "}" in line:
                    current = None
    return owners


def _sass(nvdisasm: str, cubin: Path, line_info: bool) -> dict[str, list[tuple]]:
    """Per kernel, its instructions as (offset, text, (file, line) or None, inlining chain).

    With line info (``-gi``), each instruction's location is a chain of ``//##`` lines, the
    innermost source line first, then the lines it is inlined at; ``where`` is the innermost
    (what ``-g`` alone gives) and the chain is the set of all of them."""
    args = [nvdisasm, "-c", *(["-gi"] if line_info else []), str(cubin)]
    text = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    kernels: dict[str, list] = {}
    current, where, chain, in_chain = None, None, frozenset(), False
    for line in text.splitlines():
        func = _FUNC.match(line)
        if func:
            current = func.group(1)
            kernels[current] = []
            continue
        where_match = _LINE.search(line)
        if where_match:
            location = (Path(where_match.group(1)).name, int(where_match.group(2)))
            if not in_chain:  # the first line of a chain: the innermost location
                where, chain, in_chain = location, frozenset(), True
            chain = chain | {location}
            continue
        in_chain = False
        label = _LABEL.match(line)
        if label and current:
            kernels[current].append((-1, label.group(1), None, frozenset()))
            continue
        instr = _INSTR.search(line)
        if instr and current:
            kernels[current].append((int(instr.group(1), 16), instr.group(2).strip(), where, chain))
    return kernels


def _loops(listing: list, owners: dict) -> list[Loop]:
    """Every loop: a branch back to an earlier label, its body the instructions in between."""
    label_at, spans = {}, []
    flat = []
    for offset, text, where, chain in listing:
        if offset < 0:
            label_at[text] = len(flat)
            continue
        flat.append((text, where, any(owners.get(w) in COLD for w in chain)))
    for index, (text, _, _) in enumerate(flat):
        target = _BRA.search(text)
        if target and label_at.get(target.group(1), index + 1) <= index:
            spans.append((label_at[target.group(1)], index))
    loops = []
    for start, end in spans:
        body = flat[start : end + 1]
        loops.append(Loop(
            start, end, end - start + 1,
            wide_loads=sum(1 for text, _, _ in body if re.search(r"\bLDG\.E\.(ENL2\.)?128\b", text)),
            wide_stores=sum(1 for text, _, _ in body if re.search(r"\bSTG\.E\.(ENL2\.)?128\b", text)),
            functions=frozenset(owners[w] for _, w, _ in body if w in owners and owners[w] not in COLD),
            divisions=sum(1 for text, _, cold in body if not cold and re.search(r"\bFCHK\b", text)),
            shuffles=sum(1 for text, _, _ in body if re.search(r"\bSHFL\.", text)),
            loads=sum(1 for text, _, _ in body if re.search(r"\bLDG\.", text)),
            innermost=not any(o != (start, end) and start <= o[0] and o[1] <= end for o in spans),
            cold=sum(1 for _, _, cold in body if cold),
        ))
    return loops


# Elements one iteration of a main loop handles on one thread, by the kernels' design: a run
# of 8 per iteration, except the register encoder's round loop (kRunsPerLane = 4 runs per
# lane and group, team_walk.cuh).
# Elements per lane in one round of the team encoder for 256-element groups, by the kind of
# round loop found: the streamed teams of 32 lanes (8 each), the register teams of 8 lanes
# (32 each). Keyed by the loop, not by before/after, so that two trees that both hold
# groups in registers compare like with like.
_ROUND_ELEMENTS = {"streamed": 8, "registers": 32}
_ELEMENTS = {"RegisterLane": 32, "lane_absmax": 8, "encode_group_lane": 8, "decode_group_lane": 8, "decode_run": 8}


def _pick(loops: list[Loop], name: str, innermost_only: bool) -> Loop | None:
    # the team decoder's loop runs only on the vector path, whatever width its accesses compile to
    wide = name == "decode_group_lane"
    candidates = [l for l in loops if name in l.functions and (wide or l.wide_loads or l.wide_stores)]
    if innermost_only:
        candidates = [l for l in candidates if l.innermost]
    return min(candidates, key=lambda l: l.instructions) if candidates else None


def _round_per_element(kernel: str, loops: list[Loop]) -> float | None:
    """Static instructions of the team encoder's round loop (shuffles, per-group work, loads,
    codes, stores, and any branch not taken for this group size) per element one lane
    handles in a round of a 256-element group: the whole per-round cost, for both versions."""
    decoder = kernel.startswith("zc_dequantize") or (kernel.startswith("zc_dequant_reduce_") and "requant" not in kernel)
    if decoder:
        return None
    # A round reads its group: a span with shuffles but no load is a branch from code placed
    # after the loop (the cold path) back into its tail, not the round loop.
    rounds = [l for l in loops if l.shuffles and l.loads and ("RegisterLane" in l.functions
                                                             or {"lane_absmax", "encode_group_lane"} <= l.functions)]
    if not rounds:
        return None
    registers = [l for l in rounds if "RegisterLane" in l.functions]
    loop = min(registers or rounds, key=lambda l: l.instructions)
    return (loop.instructions - loop.cold) / _ROUND_ELEMENTS["registers" if registers else "streamed"]


def _per_element(kernel: str, loops: list[Loop]) -> tuple[float | None, float | None, str]:
    """(instructions per element of the main loops, divisions per element in them, which loops)."""
    decoder = kernel.startswith("zc_dequantize") or (kernel.startswith("zc_dequant_reduce_") and "requant" not in kernel)
    chosen = {}
    for name in HOT["decoder"] if decoder else HOT["encoder_registers"]:
        loop = _pick(loops, name, innermost_only=False)
        if loop:
            chosen[name] = loop
            break
    if not chosen and not decoder:  # the streamed encoder: two loops, both over every element
        for name in HOT["encoder_streamed"]:
            loop = _pick(loops, name, innermost_only=True)
            if loop:
                chosen[name] = loop
    if not chosen:
        return None, None, "-"
    instructions = sum((loop.instructions - loop.cold) / _ELEMENTS[name] for name, loop in chosen.items())
    divisions = sum(loop.divisions / _ELEMENTS[name] for name, loop in chosen.items())
    return instructions, divisions, "+".join(
        f"{n}({l.instructions}{f', cold {l.cold}' if l.cold else ''})" for n, l in chosen.items())


def analyse(kernel_dir: Path, arch: str, tools: Path, work: Path, sources: list[str], version: str) -> dict[str, dict]:
    cuobjdump, nvdisasm = _tool(tools, "cuobjdump"), _tool(tools, "nvdisasm")
    report = {}
    for source in sources:
        lined = _compile(kernel_dir, source, arch, work, ("-lineinfo",))
        owners = _function_lines(lined.with_suffix(".cu"))
        resources = _resources(cuobjdump, lined)
        lined_sass = _sass(nvdisasm, lined, line_info=True)
        plain_sass = lined_sass
        if source == CONTROL_SOURCE:  # -lineinfo must not change the code: checked on one source
            plain = _compile(kernel_dir, source, arch, work)
            plain_sass = _sass(nvdisasm, plain, line_info=False)
            resources_plain = _resources(cuobjdump, plain)
            assert resources_plain == resources, (source, resources_plain, resources)
        for kernel, usage in sorted(resources.items()):
            count = sum(1 for offset, *_ in plain_sass[kernel] if offset >= 0)
            same = count == sum(1 for offset, *_ in lined_sass[kernel] if offset >= 0)
            loops = _loops(lined_sass[kernel], owners)
            per_element, divisions, which = _per_element(kernel, loops)
            report[kernel] = dict(usage, sass=count, same_code=same, per_element=per_element, divisions=divisions,
                                  loops=which, round=_round_per_element(kernel, loops))
    return report


def _checkout(rev: str, into: Path) -> Path:
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev, "zcomm_cuda/kernels"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "zcomm_cuda" / "kernels"


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(before: dict, after: dict, rev: str, arch: str) -> str:
    nvcc = subprocess.run(["nvcc", "--version"], check=True, capture_output=True, text=True).stdout.strip()
    lines = [
        f"# CUDA kernels, static report ({arch}, nvcc {nvcc.splitlines()[-1]}, options"
        f" {' '.join(loader.NVRTC_OPTIONS)})",
        "",
        f"Made by `python -m bench.kernels --static` on {datetime.date.today().isoformat()}; before = `{rev}`,"
        " after = this tree. Static numbers from the compiler, no GPU (see the script's docstring for how the"
        " main loop is found and counted). `loop/elem`: SASS instructions per element of the vector main"
        " loop(s) on one thread; `div/elem`: fp32 division sequences (FCHK) in them per element (in the"
        " register loop these are the group's scale and reciprocal, computed by each lane once per group);"
        " `main loops`: the source function of each loop and its instruction count.",
        "",
        "| kernel | regs before | regs after | stack/local before | stack/local after | sass before | sass after "
        "| loop/elem before | loop/elem after | ratio | round/elem before | round/elem after | ratio "
        "| div/elem before | div/elem after | main loops before | main loops after |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for kernel in sorted(after):
        b, a = before.get(kernel, {}), after[kernel]
        ratio = (b["per_element"] / a["per_element"]) if b.get("per_element") and a["per_element"] else None
        round_ratio = (b["round"] / a["round"]) if b.get("round") and a["round"] else None
        lines.append(
            f"| `{kernel}` | {b.get('REG', '-')} | {a['REG']} | {b.get('STACK', '-')}/{b.get('LOCAL', '-')} "
            f"| {a['STACK']}/{a['LOCAL']} | {b.get('sass', '-')} | {a['sass']} | {_fmt(b.get('per_element'))} "
            f"| {_fmt(a['per_element'])} | {_fmt(ratio)}x | {_fmt(b.get('round'))} | {_fmt(a['round'])} "
            f"| {_fmt(round_ratio)}x | {_fmt(b.get('divisions'), 3)} "
            f"| {_fmt(a['divisions'], 3)} | {b.get('loops', '-')} | {a['loops']} |"
        )
    changed = [k for k, v in {**before, **after}.items() if not v["same_code"]]
    lines += ["", f"Control compile of {CONTROL_SOURCE} without -lineinfo: instruction count changed for "
              f"{', '.join(changed) or 'no kernel'}."]
    return "\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--before", default=None, help="--static: git revision of the 'before' kernels "
                        "(default: merge-base with main)")
    parser.add_argument("--arch", default="sm_90", help="--static: the architecture compiled for")
    parser.add_argument("--tools", type=Path, default=Path(os.environ.get("ZC_SASS_TOOLS", "/tmp/sasstools")),
                        help="--static: where cuobjdump and nvdisasm are (pip install --target DIR)")
    parser.add_argument("--sources", nargs="+", choices=loader.KERNEL_SOURCES, default=list(loader.KERNEL_SOURCES),
                        help="--static: the kernel sources to compile")


def main(args: argparse.Namespace) -> list[str]:
    rev = args.before or subprocess.run(["git", "-C", str(REPO), "merge-base", "HEAD", "main"], check=True,
                                        capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "before").mkdir()
        (work / "after").mkdir()
        before = analyse(_checkout(rev, work / "before"), args.arch, args.tools, work / "before", args.sources, "before")
        after = analyse(loader.KERNEL_DIR, args.arch, args.tools, work / "after", args.sources, "after")
    return render(before, after, rev[:12], args.arch).splitlines()
