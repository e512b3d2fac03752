"""The outputs of ``python -m bench.train``: the table, the JSON file and the PNGs.

Everything printed or plotted comes from the ``ConfigResult`` rows measured in the same
launch; a skipped or failed configuration appears as a row with its note and no numbers.
Above the table, :class:`RunFacts` says what the numbers were measured on: the CPU model,
the device, the compute precision and why, the measured link throughput that turns wire
bytes into wire time, and the DeepSpeed version (or that it is missing). With
``--rounds`` above 1 a second table follows the first (:func:`format_rounds`): each
configuration's step time over rounds, its ratio to the baseline paired per round, and
whether its rounds trained the same losses.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from bench.harness.precision import Precision

from .loop import ConfigResult


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunFacts:
    """What a launch ran on and with, the same for all of its rows.

    Args:
        cpu: the CPU's model name (``/proc/cpuinfo``).
        device: the ranks' device type and index (``cpu``, ``cuda:0``).
        precision: the compute precision of every configuration and why it was chosen.
        link_bytes_per_s: measured throughput of one node's link, or None (no simulated cluster).
        deepspeed: the installed DeepSpeed version, or None.
        engine_configs: each configuration's engine config, as its engine got it.
    """

    cpu: str
    device: str
    precision: Precision
    link_bytes_per_s: float | None
    deepspeed: str | None
    engine_configs: dict[str, dict[str, Any]]

    def header(self) -> list[str]:
        link = (
            "not measured (no simulated cluster): no wire time"
            if self.link_bytes_per_s is None
            else f"{self.link_bytes_per_s * 8e-6:.0f} Mbit/s measured per node link and direction"
        )
        return [
            f"hardware: {self.cpu}, ranks on {self.device}",
            f"precision: {self.precision.dtype} compute for every configuration ({self.precision.reason})",
            f"link: {link}",
            f"DeepSpeed: {self.deepspeed or 'not installed (make peers)'}",
        ]

    def as_meta(self) -> dict[str, Any]:
        return {
            "cpu": self.cpu,
            "device": self.device,
            "precision": self.precision.dtype,
            "precision_reason": self.precision.reason,
            "link_bytes_per_s": self.link_bytes_per_s,
            "deepspeed": self.deepspeed,
            "engine_configs": self.engine_configs,
        }


COLUMNS = (
    ("config", 18),
    ("model", 8),
    ("step ms", 9),
    ("tokens/s", 10),
    ("wire MB/step", 13),
    ("wire ms", 8),
    ("wire %", 7),
    ("mem MiB", 9),
    ("loss first", 11),
    ("loss last", 10),
    ("val loss", 9),
)


def _number(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}"


def _pad(cells: list[str], columns: tuple[tuple[str, int], ...] = COLUMNS) -> str:
    return "  ".join(
        cell.ljust(width) if index == 0 else cell.rjust(width)
        for index, (cell, (_, width)) in enumerate(zip(cells, columns, strict=False))
    )


def _line(row: ConfigResult) -> str:
    if row.status != "ok":
        return _pad([row.config, row.model]) + f"  {row.status}: {row.note}"
    return _pad(
        [
            row.config,
            row.model,
            _number(row.median_step_s, 1e3, 1),
            _number(row.tokens_per_s, digits=0),
            _number(row.wire_tx_bytes_per_step, 1e-6, 3),
            _number(row.wire_time_s, 1e3, 1),
            _number(row.wire_fraction, 100, 0),
            _number(row.memory_bytes, 2**-20, 2),
            _number(row.first_loss, digits=4),
            _number(row.last_loss, digits=4),
            _number(row.val_loss, digits=4),
        ]
    )


# One line per column, printed under the table and written under the demo's markdown table.
COLUMN_LEGEND = (
    "config: the configuration (bench/TRAINING.md); model: the model trained",
    "step ms: median over the measured steps (after the warm-up) of the slowest rank's step time "
    "(over several rounds: the median of the rounds' medians)",
    "tokens/s: global (all ranks together): global batch x sequence length / median step time",
    "wire MB/step: inter-node bytes sent per measured step, summed over the nodes (10^6 bytes)",
    "wire ms: the busiest node's inter-node bytes per step (larger direction) / the measured link throughput",
    "wire %: wire ms / step ms (near 100: communication-bound, near 0: compute-bound)",
    "mem MiB: the largest rank's peak model-state bytes (parameters, gradients, optimizer states) as its "
    "engine reports them (FSDP2 and DeepSpeed on a GPU: torch's peak allocation); n/a: DeepSpeed on a CPU",
    "loss first / loss last: train loss (nats per byte, mean over ranks) of the first and last step; "
    "val loss: on the held-out files after the last step",
)


def format_table(rows: list[ConfigResult]) -> str:
    """A fixed-width table, one line per configuration (a skipped or failed one carries its note)."""
    return "\n".join([_pad([title for title, _ in COLUMNS]), *(_line(row) for row in rows)])


ROUND_COLUMNS = (
    ("config", 18),
    ("model", 8),
    ("rounds", 6),
    ("step ms", 9),
    ("min", 9),
    ("max", 9),
    ("ratio", 8),
    ("ratio range", 13),
    ("loss diff", 10),
)


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}x"


def _round_line(row: ConfigResult) -> str:
    cells = [row.config, row.model]
    if row.status != "ok":
        return _pad(cells, ROUND_COLUMNS) + f"  {row.status}"
    spread = "n/a" if row.ratio_min is None else f"{row.ratio_min:.3f}-{row.ratio_max:.3f}x"
    agree = "n/a" if row.loss_max_diff is None else ("0" if row.loss_max_diff == 0 else f"{row.loss_max_diff:.2g} !")
    cells += [str(len(row.rounds)), _number(row.median_step_s, 1e3, 1), _number(row.min_step_s, 1e3, 1),
              _number(row.max_step_s, 1e3, 1), _ratio(row.ratio_to_baseline), spread, agree]  # fmt: skip
    return _pad(cells, ROUND_COLUMNS)


def _disagreements(rows: list[ConfigResult], device: str) -> list[str]:
    why = ("on a GPU, nondeterministic kernels (atomic adds in reductions) can explain a small difference"
           if device.startswith("cuda") else
           "on a CPU the same seed and data must train the same losses: something in this run is not "
           "deterministic, so its rounds did not all measure the same work")  # fmt: skip
    return [f"! {row.config} ({row.model}): its rounds trained different losses (largest difference "
            f"{row.loss_max_diff:.3g}); {why}" for row in rows if row.loss_max_diff]  # fmt: skip


def format_rounds(rows: list[ConfigResult], *, rounds: int, baseline: str, device: str) -> str:
    """The rounds table: per configuration the spread of its step time over rounds, its paired
    ratio to ``baseline`` and whether its rounds trained the same losses; a line for each row
    whose rounds disagree."""
    header = (f"over {rounds} rounds (forward, backward, ... order; every round from the same seed), "
              f"ratios paired per round against {baseline}:")  # fmt: skip
    lines = [header, _pad([title for title, _ in ROUND_COLUMNS], ROUND_COLUMNS), *(_round_line(r) for r in rows)]
    return "\n".join([*lines, *_disagreements(rows, device), *ROUND_LEGEND])


ROUND_LEGEND = (
    "rounds: rounds the configuration finished; step ms: median over rounds of each round's median step time "
    "(the main table's step ms); min / max: the fastest and slowest round's",
    "ratio: median over rounds r of step(config, r) / step(baseline, r); ratio range: the smallest and largest "
    "of those paired ratios",
    "loss diff: largest |difference| of any train or validation loss between a round and the first (0: identical; "
    "! marks a row whose rounds disagree)",
)


def format_report(rows: list[ConfigResult], facts: RunFacts, *, rounds: int = 1, baseline: str | None = None) -> str:
    """The run's facts, the table and one line explaining each column; with several rounds
    also the rounds table (:func:`format_rounds`)."""
    text = [*facts.header(), format_table(rows), *COLUMN_LEGEND]
    if rounds > 1:
        assert baseline is not None, "several rounds are compared against a baseline"
        text.append(format_rounds(rows, rounds=rounds, baseline=baseline, device=facts.device))
    return "\n".join(text)


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
    for row, label in zip(done, labels, strict=True):
        (line,) = ax.plot(range(1, len(row.train_losses) + 1), row.train_losses, label=f"{label} train", lw=1)
        steps, losses = zip(*row.val_curve, strict=True)
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
