"""The two ``report.md`` files of the GPU entry point, built from the stages' results and the outputs beside them.

A section whose output is missing or malformed says so in one line: the rest of the report still stands.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from bench.harness.table import table

from . import speed_plan
from .stages import GPU_CHECK_ENV, StageResult, junit_counts

TAIL_LINES = 40


def _section(path: Path, render: Callable[[Path], list[str]], missing: str | None = None) -> list[str]:
    """``render(path)``, or a line saying that the file is missing or could not be read."""
    if not path.exists():
        return [missing or f"(no {path.name})"]
    try:
        return render(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"(could not read this stage's output {path.name}: {type(exc).__name__}: {exc})"]


def environment_table(environment: Mapping[str, str] | None) -> list[str]:
    return ["| | |", "|---|---|", *[f"| {key} | {value} |" for key, value in (environment or {}).items()]]


def _stage_table(results: Sequence[StageResult], noun: str, cell: Callable[[StageResult], str]) -> list[str]:
    lines = table([noun, f"what it {'checks' if noun == 'stage' else 'measures'}", "result", "seconds", "limit (s)", "log"],
                   [(r.stage.name, r.stage.title, cell(r), f"{r.seconds:.0f}", f"{r.limit_s:.0f}",
                     f"[{r.log.name}]({r.log.name})") for r in results], "lllrrl")  # fmt: skip
    for r in results:
        if r.problems:
            lines += ["", f"**{r.stage.name}** ({r.status}):"] + [f"- {problem}" for problem in r.problems]
    return lines


def _tails(results: Sequence[StageResult]) -> list[str]:
    """The last ``TAIL_LINES`` lines of each result's log."""
    lines = []
    for r in results:
        tail = r.log.read_text(errors="replace").splitlines()[-TAIL_LINES:] if r.log.exists() else [f"({r.log.name} was not written)"]
        lines += ["", f"### {r.stage.name}: {r.status}", "", "```", *tail, "```"]
    return lines


# ---- gpu-check


def coverage(gpus: int) -> list[str]:
    """What a check on ``gpus`` GPUs of one machine covers, in words."""
    if gpus <= 1:
        ranks = ["- **Ranks: world size 1 only.** One GPU cannot host two NCCL ranks (NCCL refuses two ranks of one "
                 "communicator on a device: `ncclInvalidUsage`, \"Duplicate GPU detected\"); w4 runs 4 ranks on it over "
                 "gloo, which stages CUDA tensors through the host: zcomm's kernels, stream ordering and hierarchical "
                 "choreography with W > 1, **not NCCL**.",
                 "- **Not covered**: NCCL with W > 1, overlap of communication and compute across GPUs, several nodes: "
                 "a machine with 2 or more GPUs runs the nccl stage (several machines: docs/gpu-check.md)."]
    else:
        ranks = [f"- **Ranks: {gpus} NCCL ranks, one per GPU, on one machine** (torchrun): every zcomm collective over "
                 "NCCL byte-identical to the CPU, on the node's topology and on 2 pretend nodes, and ZeRO++ and "
                 "FSDP2-adapter steps equal to the CPU's.",
                 "- **Not covered**: several nodes (inter-node links, a two-hop `reduce_scatter_q4` whose second hop "
                 "crosses nodes); this machine is one node."]  # fmt: skip
    return ranks + [f"- Tests: every skip under `{GPU_CHECK_ENV}=1` counts as a failure, so no GPU test passed by not running."]


def _check_cell(result: StageResult) -> str:
    xml = result.log.parent / result.stage.junit if result.stage.junit else None
    if xml is None or not xml.exists():
        return result.status.upper()
    n = junit_counts(xml)
    passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    return f"{result.status.upper()} ({passed} passed, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped)"


def _checks(path: Path) -> list[str]:
    """The checks of the w4 or nccl stage, from its JSON."""
    r = json.loads(path.read_text())
    return [f"{r['world_size']} ranks ({r['world_size'] // r['local_size']} nodes x {r['local_size']}) over "
            f"{r['backend']}, device {r['device']}, {r['seconds']:.0f} s.", "",
            *table(["check", "result", "detail"], [(c["check"], "ok" if c["ok"] else "FAILED", c["detail"]) for c in r["checks"]]),
            *[f"- {problem}" for problem in r["problems"]]]  # fmt: skip


def _collectives(log: Path) -> list[str]:
    """The table rows bench.collectives printed (lines of its log that start with its header or a row)."""
    rows = [line for line in log.read_text(errors="replace").splitlines() if line.startswith(("# ", "  "))]
    return ["```", *rows, "```"] if rows else ["(bench.collectives printed no table)"]


def render_check(*, title: str, results: Sequence[StageResult], environment: Mapping[str, str], gpus: int,
                 seconds: float, budget_s: float, command: str, notes: Sequence[str] = ()) -> str:  # fmt: skip
    """gpu-check's ``report.md``."""
    out_dir = results[0].log.parent if results else Path(".")
    skipped = [r for r in results if r.status == "skipped"]
    verdict = "PASSED" if results and not any(r.failed for r in results) else "FAILED"
    nccl = (_section(out_dir / "nccl.json", _checks) if gpus >= 2
            else ["(skipped: one GPU; the NCCL stage needs 2 or more, see the stage table)"])  # fmt: skip
    lines = [
        f"# zcomm gpu-check: {verdict} ({sum(r.passed for r in results)} of {len(results)} stages passed"
        f"{f', {len(skipped)} skipped' if skipped else ''})",
        *[f"\n- {r.stage.name} skipped: {r.stage.skip}" for r in skipped],
        "", f"{title}. Command: `{command}`; {seconds:.0f} s of the {budget_s:.0f} s budget.",
        *[line for note in notes for line in ("", note)],
        "", "## Stages", "", *_stage_table(results, "stage", _check_cell),
        "", "## Coverage", "", *coverage(gpus),
        "", "## Environment", "", *environment_table(environment),
        "", "## W = 4 on one GPU (gloo; zcomm's kernels and choreography, not NCCL)", "",
        *_section(out_dir / "w4.json", _checks),
        "", "## NCCL, one rank per GPU", "", *nccl,
        "", "## Collectives", "", *_section(out_dir / "collectives.log", _collectives),
        "", "Speed (host cost, kernel GB/s, training step times) is measured by `make gpu-bench`, not here.",
        "", f"## Log tails (last {TAIL_LINES} lines)", *_tails(results),
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


# ---- gpu-bench


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return "-" if value is None else str(value)


def rows_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """A markdown table of ``rows`` with the union of their keys as columns, in first-seen order."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    return table(columns, [[_cell(row.get(c)) for c in columns] for row in rows]) if columns else ["(no rows)"]


def _host_cost(out_dir: Path, devices: Sequence[str]) -> list[str]:
    """bench.host_cost's rows per device, then its side-by-side table of the kernel launchers when it has one."""

    def render(path: Path) -> list[str]:
        data = json.loads(path.read_text())
        compared = ["", "#### the same calls under each kernel launcher (ratios to the first, this run)", "",
                    *rows_table(data["launchers"])] if data.get("launchers") else []  # fmt: skip
        return rows_table(data["rows"]) + compared

    return [line for device in devices for line in (f"### {device}", "", *_section(out_dir / f"host_cost_{device}.json", render), "")]


def _round_steps(row: Mapping[str, Any]) -> dict[int, float]:
    """The row's median step time per round; a JSON written before rounds is one round."""
    if row.get("rounds"):
        return {r["round"]: r["median_step_s"] for r in row["rounds"]}
    return {1: row["median_step_s"]} if row.get("median_step_s") else {}


def _ratios(rows: Mapping[str, Mapping[str, Any]], config: str, base: str) -> list[float]:
    """``config``'s step time over ``base``'s, paired per round (none where either has no result)."""
    from bench.train.rounds import paired_ratios

    ok = all(rows.get(name, {}).get("status") == "ok" for name in (config, base))
    return paired_ratios(_round_steps(rows[config]), _round_steps(rows[base])) if ok else []


def _paired(rows: Mapping[str, Mapping[str, Any]], config: str, base: str) -> str:
    """``config`` over ``base``: the median of the per-round ratios, their range and the rounds' values."""
    ratios = _ratios(rows, config, base)
    if not ratios:
        missing = [name for name in (config, base) if rows.get(name, {}).get("status") != "ok"]
        why = f"{' and '.join(missing)}: no result" if missing else "no round measured both"
        return f"| {config} / {base} | - | - | 0 | {why} |"
    return (f"| {config} / {base} | {statistics.median(ratios):.3f}x | {min(ratios):.3f}-{max(ratios):.3f}x | {len(ratios)} "
            f"| {', '.join(f'{r:.3f}' for r in ratios)} |")  # fmt: skip


def _training(path: Path) -> list[str]:
    """Per configuration: rounds, median step and the rounds' range, the ratio to zero3's paired per round,
    the loss difference between rounds, validation and last training loss; then the paired ratios."""
    rows = json.loads(path.read_text())["results"]
    by_name = {row["config"]: row for row in rows}
    lines = ["| config | status | rounds | median step (ms) | rounds' min-max (ms) | vs zero3 (paired) | loss diff "
             "between rounds | val loss | last train loss | note |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        steps = _round_steps(row) if row["status"] == "ok" else {}
        ratios = _ratios(by_name, row["config"], "zero3")
        spread = f"{min(steps.values()) * 1e3:.4g}-{max(steps.values()) * 1e3:.4g}" if steps else "-"
        step = row.get("median_step_s")
        lines.append(f"| {row['config']} | {row['status']} | {len(steps) or '-'} | {_cell(step * 1e3 if step else None)} | "
                     f"{spread} | {f'{statistics.median(ratios):.3f}x' if ratios else '-'} | {_cell(row.get('loss_max_diff'))} | "
                     f"{_cell(row.get('val_loss'))} | {_cell((row.get('train_losses') or [None])[-1])} | {row.get('note', '')} |")
    return lines + ["", "Paired step-time ratios: each round's ratio of the two configurations' median steps, both "
                    "measured in that round (rounds alternate forward and backward order); median, range and every "
                    "round's value:", "", "| ratio | median | range | rounds | per round |", "|---|---:|---:|---:|---|",
                    *(_paired(by_name, config, other) for config, other in speed_plan.TRAIN_PAIRS)]  # fmt: skip


def _tool_report(out_dir: Path, part: str, name: str) -> list[str]:
    """A part's own markdown report ``name`` without its title line, its headings one level down."""
    return _section(out_dir / name, lambda path: ["#" + line if line.startswith("#") else line
                                                  for line in path.read_text().splitlines()[1:]],
                    f"(the {part} part wrote no {name})")  # fmt: skip


def render_bench(*, title: str, results: Sequence[StageResult], gpu: bool, seconds: float, command: str,
                 environment: Mapping[str, str] | None = None) -> str:  # fmt: skip
    """gpu-bench's ``report.md``: COMPLETE only when every part ran and passed."""
    out_dir = results[0].log.parent if results else Path(".")
    passed = sum(r.passed for r in results)
    verdict = ("COMPLETE" if passed == len(results) else "INCOMPLETE") + ("" if gpu else ", CPU part only (no GPU)")
    failed = [r for r in results if r.failed]

    def measured(section: Callable[[], list[str]]) -> list[str]:
        return section() if gpu else ["(no GPU: not measured)"]

    lines = [
        f"# zcomm gpu-bench: {verdict} ({passed} of {len(results)} parts passed)",
        "", f"{title}. Command: `{command}`; {seconds:.0f} s of the {speed_plan.TOTAL_BUDGET_S:.0f} s budget. "
        "Every number below was measured in this run; ratios compare numbers of this run only.",
        "", "## Parts", "", *_stage_table(results, "part", lambda r: r.status.upper()),
        "", "## Environment", "", *environment_table(environment),
        "", "## Host cost per call (world size 1)", "", *_host_cost(out_dir, ["cuda"] if gpu else ["cpu"]),
        "## Kernel GB/s against a device copy of the same bytes", "",
        *measured(lambda: _tool_report(out_dir, "kernels", "kernels.md")),
        "", f"## Training a ~160M-parameter GPT on one GPU (bf16, {speed_plan.TRAIN_ROUNDS} interleaved rounds)", "",
        *measured(lambda: _section(out_dir / "train.json", _training)),
        "", "## Kernel variants against their simpler paths (the decisions of docs/kernel-variants.md)", "",
        *measured(lambda: _tool_report(out_dir, "variants", "variants.md")),
        *(["", "## Log tails of the parts that did not pass", *_tails(failed)] if failed else []),
    ]  # fmt: skip
    return "\n".join(lines) + "\n"
