"""The outputs of ``python -m bench.train``: the table, the JSON file and the PNGs.

Everything printed or plotted comes from the ``ConfigResult`` rows measured in the same
launch; a skipped configuration appears as a row with its note and no numbers.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from .loop import ConfigResult

COLUMNS = (
    ("config", 18),
    ("model", 8),
    ("step ms", 9),
    ("tokens/s", 10),
    ("wire MB/step", 13),
    ("mem MiB", 9),
    ("loss first", 11),
    ("loss last", 10),
    ("val loss", 9),
)


def _number(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}"


def _pad(cells: list[str]) -> str:
    return "  ".join(
        cell.ljust(width) if index == 0 else cell.rjust(width)
        for index, (cell, (_, width)) in enumerate(zip(cells, COLUMNS))
    )


def _line(row: ConfigResult) -> str:
    if row.status != "ok":
        return _pad([row.config, row.model]) + f"  skipped: {row.note}"
    return _pad(
        [
            row.config,
            row.model,
            _number(row.median_step_s, 1e3, 1),
            _number(row.tokens_per_s, digits=0),
            _number(row.wire_tx_bytes_per_step, 1e-6, 3),
            _number(row.memory_bytes, 2**-20, 2),
            _number(row.first_loss, digits=4),
            _number(row.last_loss, digits=4),
            _number(row.val_loss, digits=4),
        ]
    )


def format_table(rows: list[ConfigResult]) -> str:
    """A fixed-width table, one line per configuration (a skipped one carries its note)."""
    return "\n".join([_pad([title for title, _ in COLUMNS]), *(_line(row) for row in rows)])


def write_json(path: str | Path, rows: list[ConfigResult], meta: dict[str, Any]) -> None:
    payload = {"meta": meta, "results": [dataclasses.asdict(row) for row in rows]}
    Path(path).write_text(json.dumps(payload, indent=2) + "\n")


def write_plots(directory: str | Path, rows: list[ConfigResult], title: str) -> list[Path]:
    """``loss_vs_step.png`` (train loss lines, validation points) and ``step_time.png`` (bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    done = [row for row in rows if row.status == "ok"]
    several_models = len({row.model for row in done}) > 1
    labels = [f"{row.config} ({row.model})" if several_models else row.config for row in done]

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row, label in zip(done, labels):
        (line,) = ax.plot(range(1, len(row.train_losses) + 1), row.train_losses, label=f"{label} train", lw=1)
        steps, losses = zip(*row.val_curve)
        ax.plot(steps, losses, "o", color=line.get_color(), label=f"{label} val", ms=4)
    ax.set(xlabel="step", ylabel="loss (nats/byte)", title=f"Loss vs step: {title}")
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    loss_path = out / "loss_vs_step.png"
    fig.savefig(loss_path, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.bar(labels, [row.median_step_s * 1e3 for row in done])
    ax.set(ylabel="median step time (ms)", title=f"Step time by configuration: {title}")
    ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    time_path = out / "step_time.png"
    fig.savefig(time_path, dpi=120)
    plt.close(fig)
    return [loss_path, time_path]
