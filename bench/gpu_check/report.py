"""The markdown report of a gpu-check: verdict, stages, coverage, environment, measurements, log tails.

Layout of ``report.md`` (the raw outputs sit beside it in the same folder):

1. verdict: PASSED only when every stage passed, with the count and the time spent;
2. stages: one row each (what it checks, result, seconds, limit, log), then each failed
   stage's problems;
3. coverage: what one machine with this many GPUs exercised and what it could not;
4. environment: GPUs, driver, CUDA, torch, NCCL, cupy, CPU, checkout;
5. the W = 4 stage's checks and the collectives' table, copied from their outputs;
6. the last ``TAIL_LINES`` lines of every stage's log.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Mapping, Sequence

from .stages import DRIVER_TESTS_XML, GPU_CHECK_ENV, StageResult, junit_counts, tests_xml

TAIL_LINES = 40


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of ``path`` (or a note that it is missing)."""
    if not path.exists():
        return f"({path.name} was not written)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def environment_table(environment: Mapping[str, str] | None) -> list[str]:
    """The machine and software as a two-column markdown table."""
    return ["| | |", "|---|---|", *[f"| {key} | {value} |" for key, value in (environment or {}).items()]]


def coverage(gpus: int) -> list[str]:
    """What a check on ``gpus`` GPUs of one machine covers, in words."""
    if gpus <= 1:
        ranks = [
            "- **Ranks: world size 1 only.** One GPU cannot host two NCCL ranks: NCCL refuses two ranks of one "
            "communicator on the same device (`ncclInvalidUsage`, \"Duplicate GPU detected\"), and gloo would not "
            "exercise NCCL. So the collectives and the runtime ran on NCCL with a single rank.",
            "- Exercised on this GPU (the stage table says what passed): the CUDA kernels against the reference over "
            "the tests' sweep and their PTX under hostile compiler flags (cuda-tests); torch's and zcomm's collectives "
            "over NCCL with every buffer on the GPU (collectives, test_collectives_cuda.py); zero_runtime stages 1-3 "
            "and ZeRO++ over NCCL against CPU/gloo (test_zero_cuda.py).",
            "- **W = 4 on this one GPU over gloo** (w4): 4 ranks as 2 nodes x 2, every tensor on cuda:0 and zcomm's "
            "CUDA kernels on them: the two-hop `reduce_scatter_q4` (and `_coalesced`) with tensor-slice reordering, "
            "pipelined stages, INT8 first hop and Hadamard, `all_gather_q8` over 2 hops, hpZ blocks and ZeRO++ "
            "training steps, byte-identical to the same on CPU tensors. It exercises zcomm's kernels, its stream "
            "ordering and its hierarchical choreography with W > 1, **not NCCL** (gloo stages CUDA tensors through "
            "the host).",
            "- **Not covered**: NCCL with W > 1 (rings, peer-to-peer, its stream semantics between ranks), stream "
            "overlap between communication and compute across GPUs, multi-node networking. These need a machine "
            "with 2 or more GPUs, where the nccl stage runs (and several machines for inter-node: docs/gpu-check.md).",
        ]
    else:
        ranks = [
            f"- **Ranks: {gpus} NCCL ranks, one per GPU, on one machine** (torchrun), besides the CUDA tests' own "
            "single-GPU runs.",
            "- Exercised (the stage table says what passed): the kernels and their tests, NCCL collectives between "
            "the GPUs of this node, zero_runtime stages 1-3 and ZeRO++ across them; the nccl stage: every zcomm "
            "collective over NCCL byte-identical to the CPU, on the node's topology and on 2 pretend nodes, and "
            "ZeRO++ and FSDP2-adapter steps equal to the CPU's.",
            "- **Not covered**: several nodes (inter-node links, a two-hop `reduce_scatter_q4` whose second hop "
            "crosses nodes); this machine is one node.",
        ]
    return ranks + [
        f"- Tests: every skip under `{GPU_CHECK_ENV}=1` counts as a failure, so no GPU test passed by not running.",
    ]


def _result_cell(result: StageResult) -> str:
    cell = result.status.upper()
    xmls = {"cuda-tests": tests_xml(result.log.parent), "driver-launcher": result.log.parent / DRIVER_TESTS_XML}
    xml = xmls.get(result.stage.name)
    if xml is not None and xml.exists():
        counts = junit_counts(xml)
        passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        cell += f" ({passed} passed, {counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped)"
    return cell


def _stages(results: Sequence[StageResult]) -> list[str]:
    lines = ["| stage | what it checks | result | seconds | limit (s) | log |", "|---|---|---|---:|---:|---|"]
    for r in results:
        lines.append(f"| {r.stage.name} | {r.stage.title} | {_result_cell(r)} | {r.seconds:.0f} | {r.limit_s:.0f} | "
                     f"[{r.log.name}]({r.log.name}) |")  # fmt: skip
    for r in results:
        if r.problems:
            lines += ["", f"**{r.stage.name}** ({r.status}):"] + [f"- {problem}" for problem in r.problems]
    return lines


def _checks(out_dir: Path, name: str = "w4") -> list[str]:
    """The checks of the w4 or nccl stage, from its JSON."""
    path = out_dir / f"{name}.json"
    if not path.exists():
        return [f"(no {name}.json)"]
    report = json.loads(path.read_text())
    lines = [f"{report['world_size']} ranks ({report['world_size'] // report['local_size']} nodes x "
             f"{report['local_size']}) over {report['backend']}, device {report['device']}, {report['seconds']:.0f} s.",
             "", "| check | result | detail |", "|---|---|---|"]  # fmt: skip
    lines += [f"| {c['check']} | {'ok' if c['ok'] else 'FAILED'} | {c['detail']} |" for c in report["checks"]]
    return lines + [f"- {problem}" for problem in report["problems"]]


def _collectives(out_dir: Path) -> list[str]:
    """The table rows bench.collectives printed (lines of its log that start with its header or a row)."""
    log = out_dir / "collectives.log"
    if not log.exists():
        return ["(no collectives.log)"]
    rows = [line for line in log.read_text(errors="replace").splitlines() if line.startswith(("# ", "  "))]
    return ["```", *rows, "```"] if rows else ["(bench.collectives printed no table)"]


def _guarded(section: Callable[[Path], list[str]], out_dir: Path) -> list[str]:
    """A section built from a stage's output, or a line saying why that output could not be read."""
    try:
        return section(out_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"(could not read this stage's output: {type(exc).__name__}: {exc})"]


def render(
    *, title: str, results: Sequence[StageResult], environment: Mapping[str, str], gpus: int, seconds: float,
    budget_s: float, command: str, notes: Sequence[str] = (),
) -> str:  # fmt: skip
    """The whole ``report.md``."""
    out_dir = results[0].log.parent if results else Path(".")
    passed = sum(r.passed for r in results)
    skipped = [r for r in results if r.status == "skipped"]
    verdict = "PASSED" if results and not any(r.failed for r in results) else "FAILED"
    lines = [
        f"# zcomm gpu-check: {verdict} ({passed} of {len(results)} stages passed"
        f"{f', {len(skipped)} skipped' if skipped else ''})",
        *[f"\n- {r.stage.name} skipped: {r.stage.skip}" for r in skipped],
        "",
        f"{title}. Command: `{command}`; {seconds:.0f} s of the {budget_s:.0f} s budget.",
        *[line for note in notes for line in ("", note)],
        "",
        "## Stages",
        "",
        *_stages(results),
        "",
        "## Coverage",
        "",
        *coverage(gpus),
        "",
        "## Environment",
        "",
        *environment_table(environment),
        "",
        "## W = 4 on one GPU (gloo; zcomm's kernels and choreography, not NCCL)",
        "",
        *_guarded(_checks, out_dir),
        "",
        "## NCCL, one rank per GPU",
        "",
        *(_guarded(lambda out: _checks(out, "nccl"), out_dir) if gpus >= 2
          else ["(skipped: one GPU; the NCCL stage needs 2 or more, see the stage table)"]),
        "",
        "## Collectives",
        "",
        *_guarded(_collectives, out_dir),
        "",
        "Speed (host cost, kernel GB/s, training step times) is measured by `make gpu-bench`, not here.",
        "",
        f"## Log tails (last {TAIL_LINES} lines)",
    ]
    for r in results:
        lines += ["", f"### {r.stage.name}: {r.status}", "", "```", tail(r.log), "```"]
    return "\n".join(lines) + "\n"
