"""The markdown report of a gpu-check: verdict, stages, coverage, environment, measurements, log tails.

Layout of ``report.md`` (the raw outputs sit beside it in the same folder):

1. verdict: PASSED only when every stage passed, with the count and the time spent;
2. stages: one row each (what it checks, result, seconds, limit, log), then each failed
   stage's problems;
3. coverage: what one machine with this many GPUs exercised and what it could not;
4. environment: GPUs, driver, CUDA, torch, NCCL, cupy, CPU, checkout;
5. the kernel benchmark's report and the collectives' table, copied from their outputs;
6. the training runs (status, first and last loss, step time);
7. the last ``TAIL_LINES`` lines of every stage's log.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Mapping, Sequence

from .stages import GPU_CHECK_ENV, StageResult, junit_counts

TAIL_LINES = 40


def tail(path: Path, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of ``path`` (or a note that it is missing)."""
    if not path.exists():
        return f"({path.name} was not written)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def coverage(gpus: int) -> list[str]:
    """What a check on ``gpus`` GPUs of one machine covers, in words."""
    if gpus <= 1:
        ranks = [
            "- **Ranks: world size 1 only.** One GPU cannot host two NCCL ranks: NCCL refuses two ranks of one "
            "communicator on the same device (`ncclInvalidUsage`, \"Duplicate GPU detected\"), and gloo would not "
            "exercise NCCL. So the collectives and the runtime ran on NCCL with a single rank.",
            "- Exercised on this GPU (the stage table says what passed): the CUDA kernels against the reference over "
            "the tests' sweep and their PTX under hostile compiler flags (cuda-tests); the kernels' GB/s against a "
            "device-to-device copy (kernels); torch's and zcomm's collectives over NCCL with every buffer on the GPU "
            "and CUDA-event timing (collectives, test_collectives_cuda.py); zero_runtime stages 1-3 and ZeRO++ for a "
            "few steps over NCCL (zero-runtime, test_zero_cuda.py).",
            "- **Not covered**: data crossing between GPUs (NCCL rings, peer-to-peer), the two-hop `reduce_scatter_q4` "
            "with several ranks per node and several nodes, hpZ secondary partitions spanning ranks, stream overlap "
            "between communication and compute across ranks, multi-node networking. These need a machine with "
            "2 or more GPUs (and several machines for inter-node).",
        ]
    else:
        ranks = [
            f"- **Ranks: {gpus} NCCL ranks, one per GPU, on one machine** (torchrun), besides the CUDA tests' own "
            "single-GPU runs.",
            "- Exercised (the stage table says what passed): the kernels and their tests, NCCL collectives between "
            "the GPUs of this node, zero_runtime stages 1-3 and ZeRO++ across them.",
            "- **Not covered**: several nodes (inter-node links, a two-hop `reduce_scatter_q4` whose second hop "
            "crosses nodes); this machine is one node.",
        ]
    return ranks + [
        f"- Tests: every skip under `{GPU_CHECK_ENV}=1` counts as a failure, so no GPU test passed by not running.",
    ]


def _result_cell(result: StageResult) -> str:
    cell = result.status.upper()
    xml = result.log.parent / "cuda-tests.xml"
    if result.stage.name == "cuda-tests" and xml.exists():
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


def _training(out_dir: Path) -> list[str]:
    path = out_dir / "train.json"
    if not path.exists():
        return ["(no train.json)"]
    lines = ["| config | status | first loss | last loss | median step (s) | note |", "|---|---|---:|---:|---:|---|"]
    for row in json.loads(path.read_text())["results"]:
        values = [row.get(k) for k in ("first_loss", "last_loss", "median_step_s")]
        cells = " | ".join("-" if v is None else f"{v:.4f}" for v in values)
        lines.append(f"| {row['config']} | {row['status']} | {cells} | {row['note']} |")
    return lines


def _demoted(markdown: str) -> list[str]:
    """``markdown``'s lines with its top-level headings made third-level (they sit under a section here)."""
    return ["###" + line[1:] if line.startswith("# ") else line for line in markdown.splitlines()]


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
    verdict = "PASSED" if results and passed == len(results) else "FAILED"
    kernels = out_dir / "kernels.md"
    lines = [
        f"# zcomm gpu-check: {verdict} ({passed} of {len(results)} stages passed)",
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
        "| | |",
        "|---|---|",
        *[f"| {key} | {value} |" for key, value in environment.items()],
        "",
        "## Kernel benchmark (measured; the targets are not pass/fail criteria of the check)",
        "",
        *(_demoted(kernels.read_text()) if kernels.exists() else ["(no kernels.md)"]),
        "",
        "## Collectives",
        "",
        *_guarded(_collectives, out_dir),
        "",
        "## ZeRO runtime",
        "",
        *_guarded(_training, out_dir),
        "",
        f"## Log tails (last {TAIL_LINES} lines)",
    ]
    for r in results:
        lines += ["", f"### {r.stage.name}: {r.status}", "", "```", tail(r.log), "```"]
    return "\n".join(lines) + "\n"
