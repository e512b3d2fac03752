"""The two ``report.md`` files of the GPU entry point, built from the stages' results and the outputs beside them.

gpu-check (:func:`render_check`): verdict, stages, coverage, environment, the W = 4 and NCCL
checks, the collectives' table, the log tails. gpu-bench (:func:`render_bench`): verdict,
parts, environment, then the tools' measurements: host cost per call (and under each kernel
launcher), kernel GB/s, training step times with the paired ratios of
``speed_plan.TRAIN_PAIRS``, and the kernel variants' decisions; the log tails of the parts
that did not pass.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from . import speed_plan
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


def _guarded(section: Callable[[Path], list[str]], out_dir: Path) -> list[str]:
    """A section built from a stage's output, or a line saying why that output could not be read."""
    try:
        return section(out_dir)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"(could not read this stage's output: {type(exc).__name__}: {exc})"]


def _stage_table(results: Sequence[StageResult], noun: str, cell: Callable[[StageResult], str]) -> list[str]:
    lines = [f"| {noun} | what it {'checks' if noun == 'stage' else 'measures'} | result | seconds | limit (s) | log |",
             "|---|---|---|---:|---:|---|"]  # fmt: skip
    lines += [f"| {r.stage.name} | {r.stage.title} | {cell(r)} | {r.seconds:.0f} | {r.limit_s:.0f} | "
              f"[{r.log.name}]({r.log.name}) |" for r in results]  # fmt: skip
    for r in results:
        if r.problems:
            lines += ["", f"**{r.stage.name}** ({r.status}):"] + [f"- {problem}" for problem in r.problems]
    return lines


def _tails(results: Sequence[StageResult]) -> list[str]:
    return [line for r in results for line in ("", f"### {r.stage.name}: {r.status}", "", "```", tail(r.log), "```")]


# ---- gpu-check


def coverage(gpus: int) -> list[str]:
    """What a check on ``gpus`` GPUs of one machine covers, in words."""
    if gpus <= 1:
        ranks = [
            "- **Ranks: world size 1 only.** One GPU cannot host two NCCL ranks: NCCL refuses two ranks of one "
            "communicator on the same device (`ncclInvalidUsage`, \"Duplicate GPU detected\"), and gloo would not "
            "exercise NCCL. So the collectives and the runtime ran on NCCL with a single rank.",
            "- **W = 4 on this one GPU over gloo** (w4): 4 ranks as 2 nodes x 2, every tensor on cuda:0, zcomm's "
            "CUDA kernels on them, byte-identical to the same on CPU tensors: zcomm's kernels, stream ordering and "
            "hierarchical choreography with W > 1, **not NCCL** (gloo stages CUDA tensors through the host).",
            "- **Not covered**: NCCL with W > 1 (rings, peer-to-peer, its stream semantics between ranks), stream "
            "overlap between communication and compute across GPUs, multi-node networking. These need a machine "
            "with 2 or more GPUs, where the nccl stage runs (and several machines for inter-node: docs/gpu-check.md).",
        ]
    else:
        ranks = [
            f"- **Ranks: {gpus} NCCL ranks, one per GPU, on one machine** (torchrun), besides the CUDA tests' own "
            "single-GPU runs; the nccl stage: every zcomm collective over NCCL byte-identical to the CPU, on the "
            "node's topology and on 2 pretend nodes, and ZeRO++ and FSDP2-adapter steps equal to the CPU's.",
            "- **Not covered**: several nodes (inter-node links, a two-hop `reduce_scatter_q4` whose second hop "
            "crosses nodes); this machine is one node.",
        ]
    return ranks + [f"- Tests: every skip under `{GPU_CHECK_ENV}=1` counts as a failure, so no GPU test passed by not running."]


def _check_cell(result: StageResult) -> str:
    cell = result.status.upper()
    xml = {"cuda-tests": tests_xml(result.log.parent),
           "driver-launcher": result.log.parent / DRIVER_TESTS_XML}.get(result.stage.name)  # fmt: skip
    if xml is not None and xml.exists():
        counts = junit_counts(xml)
        passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        cell += f" ({passed} passed, {counts['failures']} failed, {counts['errors']} errors, {counts['skipped']} skipped)"
    return cell


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


def render_check(*, title: str, results: Sequence[StageResult], environment: Mapping[str, str], gpus: int,
                 seconds: float, budget_s: float, command: str, notes: Sequence[str] = ()) -> str:  # fmt: skip
    """gpu-check's ``report.md``."""
    out_dir = results[0].log.parent if results else Path(".")
    skipped = [r for r in results if r.status == "skipped"]
    verdict = "PASSED" if results and not any(r.failed for r in results) else "FAILED"
    nccl = (_guarded(lambda out: _checks(out, "nccl"), out_dir) if gpus >= 2
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
        "", "## W = 4 on one GPU (gloo; zcomm's kernels and choreography, not NCCL)", "", *_guarded(_checks, out_dir),
        "", "## NCCL, one rank per GPU", "", *nccl,
        "", "## Collectives", "", *_guarded(_collectives, out_dir),
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
    if not columns:
        return ["(no rows)"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]


def _json_rows(path: Path) -> list[str]:
    """A tool's JSON rows (a list of objects, or the list under ``rows``/``results``) as a table, or why not."""
    if not path.exists():
        return [f"({path.name} was not written)"]
    try:
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            data = next((data[key] for key in ("rows", "results") if isinstance(data.get(key), list)), [data])
        if not isinstance(data, list) or not all(isinstance(row, dict) for row in data):
            raise ValueError(f"{path.name}: expected a list of objects")
    except (OSError, ValueError) as exc:
        return [f"(could not read {path.name}: {exc})"]
    return rows_table(data)


def _host_cost(out_dir: Path, devices: Sequence[str]) -> list[str]:
    """bench.host_cost's rows per device, then its side-by-side table of the kernel launchers when it has one."""
    lines: list[str] = []
    for device in devices:
        path = out_dir / f"host_cost_{device}.json"
        lines += [f"### {device}", "", *_json_rows(path), ""]
        try:
            compared = json.loads(path.read_text()).get("launchers") if path.exists() else None
        except (OSError, ValueError, AttributeError):
            compared = None  # _json_rows has said what is wrong with the file
        if compared:
            lines += ["#### the same calls under each kernel launcher (ratios to the first, this run)", "",
                      *rows_table(compared), ""]  # fmt: skip
    return lines


def _kernels(out_dir: Path) -> list[str]:
    json_path, md_path = out_dir / "kernels.json", out_dir / "kernels.md"
    if json_path.exists():
        return [*_json_rows(json_path), ""]
    if md_path.exists():
        return ["####" + line[1:] if line.startswith("# ") else line for line in md_path.read_text().splitlines()] + [""]
    return ["(the kernel sweep wrote no report)", ""]


def _round_steps(row: Mapping[str, Any]) -> dict[int, float]:
    """The row's median step time per round; a JSON written before rounds is one round."""
    if row.get("rounds"):
        return {r["round"]: r["median_step_s"] for r in row["rounds"]}
    return {1: row["median_step_s"]} if row.get("median_step_s") else {}


def _paired(rows: Mapping[str, Mapping[str, Any]], config: str, base: str) -> str:
    """``config`` over ``base``: the median of the per-round ratios, their range and the rounds' values."""
    from bench.train.rounds import paired_ratios

    missing = [name for name in (config, base) if rows.get(name, {}).get("status") != "ok"]
    ratios = [] if missing else paired_ratios(_round_steps(rows[config]), _round_steps(rows[base]))
    if not ratios:
        why = f"{' and '.join(missing)}: no result" if missing else "no round measured both"
        return f"| {config} / {base} | - | - | 0 | {why} |"
    spread = f"{min(ratios):.3f}-{max(ratios):.3f}x"
    each = ", ".join(f"{r:.3f}" for r in ratios)
    return f"| {config} / {base} | {statistics.median(ratios):.3f}x | {spread} | {len(ratios)} | {each} |"


def _training(out_dir: Path) -> list[str]:
    """Per configuration: rounds, median step and the rounds' range, the ratio to zero3's paired per round,
    the loss difference between rounds, validation and last training loss; then the paired ratios."""
    from bench.train.rounds import paired_ratios

    path = out_dir / "train.json"
    if not path.exists():
        return ["(no train.json)"]
    try:
        rows = json.loads(path.read_text())["results"]
    except (OSError, ValueError, KeyError) as exc:
        return [f"(could not read train.json: {type(exc).__name__}: {exc})"]
    by_name = {row["config"]: row for row in rows}
    base = by_name.get("zero3", {})
    lines = ["| config | status | rounds | median step (ms) | rounds' min-max (ms) | vs zero3 (paired) | loss diff "
             "between rounds | val loss | last train loss | note |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for row in rows:
        steps = _round_steps(row) if row["status"] == "ok" else {}
        ratios = paired_ratios(steps, _round_steps(base)) if base.get("status") == "ok" else []
        spread = f"{min(steps.values()) * 1e3:.4g}-{max(steps.values()) * 1e3:.4g}" if steps else "-"
        ratio = f"{statistics.median(ratios):.3f}x" if ratios else "-"
        step = row.get("median_step_s")
        losses = row.get("train_losses") or [None]
        lines.append(f"| {row['config']} | {row['status']} | {len(steps) or '-'} | {_cell(step * 1e3 if step else None)} | "
                     f"{spread} | {ratio} | {_cell(row.get('loss_max_diff'))} | {_cell(row.get('val_loss'))} | "
                     f"{_cell(losses[-1])} | {row.get('note', '')} |")  # fmt: skip
    lines += ["", "Paired step-time ratios: each round's ratio of the two configurations' median steps, both "
              "measured in that round (rounds alternate forward and backward order); median, range and every "
              "round's value:", "", "| ratio | median | range | rounds | per round |", "|---|---:|---:|---:|---|",
              *(_paired(by_name, config, other) for config, other in speed_plan.TRAIN_PAIRS)]  # fmt: skip
    return lines


def _variants(out_dir: Path) -> list[str]:
    """bench.kernels --variants' report (its decision table first), its headings one level down."""
    path = out_dir / "variants.md"
    if not path.exists():
        return ["(the variants part wrote no variants.md)"]
    return ["#" + line if line.startswith("#") else line for line in path.read_text().splitlines()[1:]]


def render_bench(*, title: str, results: Sequence[StageResult], absent: Sequence[str], gpu: bool, seconds: float,
                 command: str, environment: Mapping[str, str] | None = None) -> str:  # fmt: skip
    """gpu-bench's ``report.md``: COMPLETE only when every part ran and passed."""
    out_dir = results[0].log.parent if results else Path(".")
    passed = sum(r.passed for r in results)
    verdict = "COMPLETE" if not absent and passed == len(results) else "INCOMPLETE"
    verdict += "" if gpu else ", CPU part only (no GPU)"
    no_gpu = ["(no GPU: not measured)"]
    failed = [r for r in results if r.failed]
    lines = [
        f"# zcomm gpu-bench: {verdict} ({passed} of {len(results)} parts passed)",
        "", f"{title}. Command: `{command}`; {seconds:.0f} s of the {speed_plan.TOTAL_BUDGET_S:.0f} s budget. "
        "Every number below was measured in this run; ratios compare numbers of this run only.",
        *[f"\n- {line}" for line in absent],
        "", "## Parts", "", *_stage_table(results, "part", lambda r: r.status.upper()),
        "", "## Environment", "", *environment_table(environment),
        "", "## Host cost per call (world size 1)", "", *_host_cost(out_dir, ["cuda"] if gpu else ["cpu"]),
        "## Kernel GB/s against a device copy of the same bytes", "", *(_kernels(out_dir) if gpu else [*no_gpu, ""]),
        f"## Training a ~160M-parameter GPT on one GPU (bf16, {speed_plan.TRAIN_ROUNDS} interleaved rounds)", "",
        *(_training(out_dir) if gpu else no_gpu),
        "", "## Kernel variants against their simpler paths (the decisions of docs/kernel-variants.md)", "",
        *(_variants(out_dir) if gpu else no_gpu),
        *(["", "## Log tails of the parts that did not pass", *_tails(failed)] if failed else []),
    ]  # fmt: skip
    return "\n".join(lines) + "\n"
