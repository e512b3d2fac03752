"""What ``make demo`` keeps: a markdown report and a plot, from ``bench.train``'s JSON.

``results.md`` states what the numbers were measured on (CPU, precision and why, measured
link, DeepSpeed version, the command), then one row per configuration with every column
explained in one line under the table, then the ratios of ZeRO++ against each other
configuration measured in the same run. ``demo.png`` draws two bar charts side by side: the
median step time and the inter-node bytes per step of each configuration that ran. Every
figure comes from the rows of the JSON; nothing is typed in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.train.report import COLUMN_LEGEND

# (ours, theirs): the ratios printed after the table, each when both rows ran.
TRAIN_CONFIGS = ("zero3", "zeropp", "fsdp2", "deepspeed-z3", "deepspeed-zeropp")
COMPARISONS = (*(("zeropp", name) for name in TRAIN_CONFIGS if name != "zeropp"), ("zero3", "deepspeed-z3"))

_MD_COLUMNS = ("config", "step ms", "tokens/s", "wire MB/step", "wire ms", "wire %", "mem MiB", "loss first",
               "loss last", "val loss")  # fmt: skip


def _ratio_line(ours: dict, other: dict) -> str:
    speedup = other["median_step_s"] / ours["median_step_s"]
    pace = f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"
    line = f"{ours['config']} vs {other['config']:6s}: step time {pace}"
    if ours["wire_tx_bytes_per_step"] is not None and other["wire_tx_bytes_per_step"]:
        line += f", inter-node wire bytes {ours['wire_tx_bytes_per_step'] / other['wire_tx_bytes_per_step']:.3f}x"
    return line


def training_summary(results: list[dict]) -> list[str]:
    """The measured step-time speedup and wire-byte ratio of each comparison whose rows both
    ran, then one line naming the configurations that did not run (their reasons are in the
    table rows, said once; an expected failure is not repeated at all)."""
    rows = {row["config"]: row for row in results if row["status"] == "ok"}
    if "zeropp" not in rows:
        return ["zeropp did not run: no comparison"]
    lines = [_ratio_line(rows[ours], rows[other]) for ours, other in COMPARISONS if ours in rows and other in rows]
    missing = [f"{row['config']} ({row['status']})" for row in results
               if row["status"] not in ("ok", "expected failure")]
    if missing:
        lines.append(f"not run: {', '.join(missing)}; the table says why")
    return lines


def _cell(value: float | None, scale: float, digits: int) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}"


def _md_row(row: dict) -> str:
    if row["status"] != "ok":
        return f"| {row['config']} | {row['status']}: {row['note']} |" + " |" * (len(_MD_COLUMNS) - 2)
    cells = [row["config"], _cell(row["median_step_s"], 1e3, 1), _cell(row["tokens_per_s"], 1, 0),
             _cell(row["wire_tx_bytes_per_step"], 1e-6, 3), _cell(row["wire_time_s"], 1e3, 1),
             _cell(row["wire_fraction"], 100, 0), _cell(row["memory_bytes"], 2**-20, 2),
             _cell(row["first_loss"], 1, 4), _cell(row["last_loss"], 1, 4), _cell(row["val_loss"], 1, 4)]  # fmt: skip
    return "| " + " | ".join(cells) + " |"


def markdown(payload: dict[str, Any], command: str) -> str:
    """``results.md``: the facts of the run, the table, one line per column, the ratios."""
    meta, results = payload["meta"], payload["results"]
    args = meta["args"]
    link = meta.get("link_bytes_per_s")
    facts = [
        f"- command: `{command}`",
        f"- cluster: {meta['num_nodes']} node(s) x {meta['local_size']} rank(s); link: "
        + ("not measured (plain loopback, no wire bytes)" if link is None else f"{link * 8e-6:.0f} Mbit/s measured"),
        f"- hardware: {meta['cpu']}, ranks on {meta['device']}; torch {meta['torch']}; "
        f"DeepSpeed {meta.get('deepspeed') or 'not installed'}",
        f"- precision: {meta['precision']} ({meta['precision_reason']})",
        f"- model: {', '.join(f'{m} {n:,} parameters' for m, n in meta['params'].items() if n)}; global batch "
        f"{args['batch']} sequences x {args['seq_len']} tokens, {args['steps']} steps of which the first "
        f"{args['warmup']} are left out of the times and bytes",
    ]
    table = ["| " + " | ".join(_MD_COLUMNS) + " |", "|" + "---|" * len(_MD_COLUMNS), *map(_md_row, results)]
    legend = [f"- {line}" for line in COLUMN_LEGEND]
    summary = [f"- {line}" for line in training_summary(results)]
    return "\n".join(["# make demo: ZeRO-3, ZeRO++, FSDP2 and DeepSpeed on one simulated cluster", "",
                      *facts, "", *table, "", *legend, "", "ZeRO++ against the others, measured in this run:", "",
                      *summary, ""])  # fmt: skip


def plot(results: list[dict], path: Path, title: str) -> Path:
    """``demo.png``: median step time and inter-node MB per step, one bar per configuration that ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [row for row in results if row["status"] == "ok"]
    names = [row["config"] for row in done]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.bar(names, [row["median_step_s"] * 1e3 for row in done], color="tab:blue")
    left.set(ylabel="median step time (ms)", title="step time (lower is better)")
    wire = [row["wire_tx_bytes_per_step"] for row in done]
    if all(value is not None for value in wire):
        right.bar(names, [value * 1e-6 for value in wire], color="tab:orange")
        right.set(ylabel="inter-node MB per step", title="inter-node bytes (lower is better)")
    else:
        right.text(0.5, 0.5, "no wire counters\n(plain loopback, not the simulated cluster)", ha="center",
                   va="center", transform=right.transAxes)
        right.set(title="inter-node bytes: not measured")
    for ax in (left, right):
        ax.tick_params(axis="x", labelrotation=25)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
