"""The markdown report of a gpu-bench: verdict, parts, then the three tables of measurements.

Layout of ``report.md`` (the tools' JSON and logs sit beside it):

1. verdict: COMPLETE only when every part ran and passed, with the time spent; the tools
   this checkout lacks, each on its own line;
2. parts: one row each (what it measures, result, seconds, limit, log), then the machine
   and software (GPU, driver, torch, NCCL, cupy, CPU, checkout);
3. host cost per call: the rows of ``bench.host_cost``'s JSON as they come (its columns
   are its own), one table per device;
4. kernel GB/s: the rows of ``bench.kernels --sweep``'s JSON (its markdown when there is no JSON);
   then ``bench.kernels --variants``' decision per row of docs/kernel-variants.md and its shapes;
5. training: per configuration, the rounds it ran, median step time over rounds and the
   rounds' range, its ratio to zero3's paired per round (median), the largest loss
   difference between its rounds, validation loss, last training loss; then the paired
   ratios of ``plan.TRAIN_PAIRS`` (median, range, each round's);
6. the tails of the logs of parts that did not pass.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any, Mapping, Sequence

from bench.gpu_check.report import environment_table, tail
from bench.gpu_check.stages import StageResult
from bench.train.rounds import paired_ratios

from . import speed_plan as plan


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return "-" if value is None else str(value)


def rows_table(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """A markdown table of ``rows`` with the union of their keys as columns, in first-seen order."""
    columns: list[str] = []
    for row in rows:
        columns += [key for key in row if key not in columns]
    if not columns:
        return ["(no rows)"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]


def json_rows(path: Path) -> list[Mapping[str, Any]]:
    """The rows of a tool's JSON: a list of objects, or the list under ``rows``/``results`` of an object."""
    data = json.loads(path.read_text())
    if isinstance(data, dict):
        data = next((data[key] for key in ("rows", "results") if isinstance(data.get(key), list)), [data])
    if not isinstance(data, list) or not all(isinstance(row, dict) for row in data):
        raise ValueError(f"{path.name}: expected a list of objects")
    return data


def _guarded_rows(path: Path) -> list[str]:
    if not path.exists():
        return [f"({path.name} was not written)"]
    try:
        return rows_table(json_rows(path))
    except (OSError, ValueError) as exc:
        return [f"(could not read {path.name}: {exc})"]


def _host_cost(out_dir: Path, devices: Sequence[str]) -> list[str]:
    lines: list[str] = []
    for device in devices:
        path = out_dir / f"host_cost_{device}.json"
        lines += [f"### {device}", "", *_guarded_rows(path), "", *_launchers(path)]
    return lines


def _launchers(path: Path) -> list[str]:
    """bench.host_cost's side-by-side table of the CUDA kernel launchers, when it measured more than one."""
    try:
        compared = json.loads(path.read_text()).get("launchers") if path.exists() else None
    except (OSError, ValueError, AttributeError):
        return []  # _guarded_rows has said what is wrong with the file
    if not compared:
        return []
    return ["#### the same calls under each kernel launcher (ratios to the first, this run)", "",
            *rows_table(compared), ""]  # fmt: skip


def _kernels(out_dir: Path) -> list[str]:
    json_path, md_path = out_dir / "kernels.json", out_dir / "kernels.md"
    if json_path.exists():
        return [*_guarded_rows(json_path), ""]
    if md_path.exists():
        return ["####" + l[1:] if l.startswith("# ") else l for l in md_path.read_text().splitlines()] + [""]
    return ["(the kernel sweep wrote no report)", ""]


def _round_steps(row: Mapping[str, Any]) -> dict[int, float]:
    """The row's median step time per round; a JSON written before rounds is one round."""
    if row.get("rounds"):
        return {r["round"]: r["median_step_s"] for r in row["rounds"]}
    return {1: row["median_step_s"]} if row.get("median_step_s") else {}


def _paired(rows: Mapping[str, Mapping[str, Any]], config: str, base: str) -> str:
    """``config`` over ``base``: the median of the per-round ratios, their range and the rounds' values."""
    missing = [name for name in (config, base) if rows.get(name, {}).get("status") != "ok"]
    ratios = [] if missing else paired_ratios(_round_steps(rows[config]), _round_steps(rows[base]))
    if not ratios:
        why = f"{' and '.join(missing)}: no result" if missing else "no round measured both"
        return f"| {config} / {base} | - | - | 0 | {why} |"
    spread = f"{min(ratios):.3f}-{max(ratios):.3f}x"
    each = ", ".join(f"{r:.3f}" for r in ratios)
    return f"| {config} / {base} | {statistics.median(ratios):.3f}x | {spread} | {len(ratios)} | {each} |"


def _training(out_dir: Path) -> list[str]:
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
              *(_paired(by_name, config, other) for config, other in plan.TRAIN_PAIRS)]  # fmt: skip
    return lines


def _variants(out_dir: Path) -> list[str]:
    """bench.kernels --variants' report (its decision table first), its headings one level down."""
    path = out_dir / "variants.md"
    if not path.exists():
        return ["(the variants part wrote no variants.md)"]
    return ["#" + line if line.startswith("#") else line for line in path.read_text().splitlines()[1:]]


def render(*, title: str, results: Sequence[StageResult], absent: Sequence[str], gpu: bool, seconds: float,
           command: str, environment: Mapping[str, str] | None = None) -> str:  # fmt: skip
    """The whole ``report.md``."""
    out_dir = results[0].log.parent if results else Path(".")
    passed = sum(r.passed for r in results)
    complete = not absent and passed == len(results)
    verdict = ("COMPLETE" if complete else "INCOMPLETE") + ("" if gpu else ", CPU part only (no GPU)")
    lines = [
        f"# zcomm gpu-bench: {verdict} ({passed} of {len(results)} parts passed)",
        "",
        f"{title}. Command: `{command}`; {seconds:.0f} s of the {plan.TOTAL_BUDGET_S:.0f} s budget. "
        "Every number below was measured in this run; ratios compare numbers of this run only.",
        *[f"\n- {line}" for line in absent],
        "",
        "## Parts",
        "",
        "| part | what it measures | result | seconds | limit (s) | log |",
        "|---|---|---|---:|---:|---|",
        *[f"| {r.stage.name} | {r.stage.title} | {r.status.upper()} | {r.seconds:.0f} | {r.limit_s:.0f} | "
          f"[{r.log.name}]({r.log.name}) |" for r in results],  # fmt: skip
        *[f"- **{r.stage.name}**: {problem}" for r in results for problem in r.problems],
        "",
        "## Environment",
        "",
        *environment_table(environment),
        "",
        "## Host cost per call (world size 1)",
        "",
        *_host_cost(out_dir, ["cuda"] if gpu else ["cpu"]),
        "## Kernel GB/s against a device copy of the same bytes",
        "",
        *(_kernels(out_dir) if gpu else ["(no GPU: not measured)", ""]),
        f"## Training a ~160M-parameter GPT on one GPU (bf16, {plan.TRAIN_ROUNDS} interleaved rounds)",
        "",
        *(_training(out_dir) if gpu else ["(no GPU: not measured)"]),
        "",
        "## Kernel variants against their simpler paths (the decisions of docs/kernel-variants.md)",
        "",
        *(_variants(out_dir) if gpu else ["(no GPU: not measured)"]),
    ]
    failed = [r for r in results if r.failed]
    if failed:
        lines += ["", "## Log tails of the parts that did not pass"]
        for r in failed:
            lines += ["", f"### {r.stage.name}: {r.status}", "", "```", tail(r.log), "```"]
    return "\n".join(lines) + "\n"
