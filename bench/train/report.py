"""The outputs of ``python -m bench.train``: the table, the JSON file and the PNGs.

Everything printed or plotted comes from the ``ConfigResult`` rows measured in the same launch;
a skipped or failed configuration is a row with its note and no numbers. Above the table,
:class:`RunFacts` says what the numbers were measured on; with ``--rounds`` a second table follows.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from bench.harness.dist_env import DistEnv
from bench.harness.precision import Precision

from .data import ByteCorpus
from .loop import ConfigResult
from .rounds import RoundPlan


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunFacts:
    """What a launch ran on and with, the same for all of its rows: the CPU model, the ranks'
    device, the compute precision and why, the measured throughput of one node's link (None
    without the simulated cluster), the installed DeepSpeed version and every engine's config."""

    cpu: str
    device: str
    precision: Precision
    link_bytes_per_s: float | None
    deepspeed: str | None
    engine_configs: dict[str, dict[str, Any]]

    def header(self) -> list[str]:
        link = ("not measured (no simulated cluster): no wire time" if self.link_bytes_per_s is None
                else f"{self.link_bytes_per_s * 8e-6:.0f} Mbit/s measured per node link and direction")  # fmt: skip
        return [f"hardware: {self.cpu}, ranks on {self.device}",
                f"precision: {self.precision.dtype} compute for every configuration ({self.precision.reason})",
                f"link: {link}", f"DeepSpeed: {self.deepspeed or 'not installed (make peers)'}"]  # fmt: skip


# The table's figures after config and model: (title, width, ConfigResult field, scale, digits).
FIGURES = (
    ("step ms", 9, "median_step_s", 1e3, 1), ("tokens/s", 10, "tokens_per_s", 1, 0),
    ("wire MB/step", 13, "wire_tx_bytes_per_step", 1e-6, 3), ("wire ms", 8, "wire_time_s", 1e3, 1),
    ("wire %", 7, "wire_fraction", 100, 0), ("mem MiB", 9, "memory_bytes", 2**-20, 2),
    ("loss first", 11, "first_loss", 1, 4), ("loss last", 10, "last_loss", 1, 4), ("val loss", 9, "val_loss", 1, 4),
)  # fmt: skip
COLUMNS = (("config", 18), ("model", 8), *((title, width) for title, width, *_ in FIGURES))
ROUND_COLUMNS = (("config", 18), ("model", 8), ("rounds", 6), ("step ms", 9), ("min", 9), ("max", 9), ("ratio", 8),
                 ("ratio range", 13), ("loss diff", 10))  # fmt: skip

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
ROUND_LEGEND = (
    "rounds: rounds the configuration finished; step ms: median over rounds of each round's median step time "
    "(the main table's step ms); min / max: the fastest and slowest round's",
    "ratio: median over rounds r of step(config, r) / step(baseline, r); ratio range: the smallest and largest "
    "of those paired ratios",
    "loss diff: largest |difference| of any train or validation loss between a round and the first (0: identical; "
    "! marks a row whose rounds disagree)",
)


def _number(value: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value * scale:.{digits}f}"


def figures(row: ConfigResult) -> list[str]:
    """The figures of an ok row, formatted as the table prints them."""
    return [_number(getattr(row, field), scale, digits) for _, _, field, scale, digits in FIGURES]


def _pad(cells: list[str], columns: tuple[tuple[str, int], ...] = COLUMNS) -> str:
    """The cells at the columns' widths: the first left-aligned, the others right-aligned."""
    return "  ".join(cell.ljust(width) if index == 0 else cell.rjust(width)
                     for index, (cell, (_, width)) in enumerate(zip(cells, columns, strict=False)))  # fmt: skip


def format_table(rows: list[ConfigResult]) -> str:
    """A fixed-width table, one line per configuration (a skipped or failed one carries its note)."""
    return "\n".join([_pad([title for title, _ in COLUMNS]), *(
        _pad([row.config, row.model, *figures(row)]) if row.status == "ok" else
        _pad([row.config, row.model]) + f"  {row.status}: {row.note}" for row in rows)])  # fmt: skip


def _round_line(row: ConfigResult) -> str:
    cells = [row.config, row.model]
    if row.status != "ok":
        return _pad(cells, ROUND_COLUMNS) + f"  {row.status}"
    ratio = "n/a" if row.ratio_to_baseline is None else f"{row.ratio_to_baseline:.3f}x"
    spread = "n/a" if row.ratio_min is None else f"{row.ratio_min:.3f}-{row.ratio_max:.3f}x"
    agree = "n/a" if row.loss_max_diff is None else ("0" if row.loss_max_diff == 0 else f"{row.loss_max_diff:.2g} !")
    cells += [str(len(row.rounds)), _number(row.median_step_s, 1e3, 1), _number(row.min_step_s, 1e3, 1),
              _number(row.max_step_s, 1e3, 1), ratio, spread, agree]  # fmt: skip
    return _pad(cells, ROUND_COLUMNS)


def format_rounds(rows: list[ConfigResult], *, rounds: int, baseline: str, device: str) -> str:
    """The rounds table: per configuration the spread of its step time over rounds, its paired
    ratio to ``baseline`` and whether its rounds trained the same losses; a line for each row
    whose rounds disagree."""
    why = ("on a GPU, nondeterministic kernels (atomic adds in reductions) can explain a small difference"
           if device.startswith("cuda") else
           "on a CPU the same seed and data must train the same losses: something in this run is not "
           "deterministic, so its rounds did not all measure the same work")  # fmt: skip
    disagree = [f"! {row.config} ({row.model}): its rounds trained different losses (largest difference "
                f"{row.loss_max_diff:.3g}); {why}" for row in rows if row.loss_max_diff]  # fmt: skip
    header = (f"over {rounds} rounds (forward, backward, ... order; every round from the same seed), "
              f"ratios paired per round against {baseline}:")  # fmt: skip
    lines = [header, _pad([title for title, _ in ROUND_COLUMNS], ROUND_COLUMNS), *map(_round_line, rows)]
    return "\n".join([*lines, *disagree, *ROUND_LEGEND])


def format_report(rows: list[ConfigResult], facts: RunFacts, *, rounds: int = 1, baseline: str | None = None) -> str:
    """The run's facts, the table and one line explaining each column; with several rounds
    also the rounds table (:func:`format_rounds`)."""
    text = [*facts.header(), format_table(rows), *COLUMN_LEGEND]
    if rounds > 1:
        assert baseline is not None, "several rounds are compared against a baseline"
        text.append(format_rounds(rows, rounds=rounds, baseline=baseline, device=facts.device))
    return "\n".join(text)


def report(rows: list[ConfigResult], params: dict[str, int | None], corpus: ByteCorpus, env: DistEnv,
           args: argparse.Namespace, facts: RunFacts, plan: RoundPlan) -> None:  # fmt: skip
    """Rank 0's outputs: the title, the data, the report; the JSON and the plots when asked for."""
    title = (f"{env.num_nodes} node(s) x {env.local_size} rank(s), {facts.precision.dtype}, "
             f"global batch {args.batch} sequences x {args.seq_len} tokens")  # fmt: skip
    sizes = ", ".join(f"{model} {count:,} params" for model, count in params.items() if count is not None)
    print(f"bench.train: {title}; {sizes}")
    print(f"data: stdlib sources, {len(corpus.train_files)} train files ({corpus.train.size:,} bytes), "
          f"{len(corpus.val_files)} validation files ({corpus.val.size:,} bytes)")  # fmt: skip
    print(format_report(rows, facts, rounds=plan.rounds, baseline=plan.baseline))
    meta = {"world_size": env.world_size, "local_size": env.local_size, "num_nodes": env.num_nodes,
            "torch": torch.__version__, **dataclasses.asdict(facts), "precision": facts.precision.dtype,
            "precision_reason": facts.precision.reason, "params": params, "train_bytes": int(corpus.train.size),
            "val_bytes": int(corpus.val.size), "args": vars(args), "rounds": plan.rounds, "baseline": plan.baseline,
            "round_order": "forward in odd rounds, backward in even ones (bench/train/rounds.py)"}  # fmt: skip
    if args.json:
        payload = {"meta": meta, "results": [dataclasses.asdict(row) for row in rows]}
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
    if args.plot_dir:
        for path in write_plots(args.plot_dir, rows, title):
            print(f"wrote {path}")


def meta_lines(meta: dict[str, Any]) -> list[str]:
    """Markdown lines of what a launch's JSON ``meta`` says it ran on (the demo's results.md, sweep.md)."""
    args, models = meta["args"], ", ".join(f"{m} {n:,} parameters" for m, n in meta["params"].items() if n)
    return [f"- hardware: {meta['cpu']}, ranks on {meta['device']}; torch {meta['torch']}; "
            f"DeepSpeed {meta.get('deepspeed') or 'not installed'}",
            f"- precision: {meta['precision']} ({meta['precision_reason']})",
            f"- model: {models}; global batch {args['batch']} sequences x {args['seq_len']} tokens, {args['steps']} "
            f"steps of which the first {args['warmup']} are left out of the times and bytes"]  # fmt: skip


@contextlib.contextmanager
def figure(path: Path, *grid: int, figsize: tuple[float, float] = (7, 4.5)) -> Iterator[Any]:
    """The axes of a matplotlib figure (file-only Agg backend) that is saved to ``path`` when the block ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(*grid, figsize=figsize)
    yield axes
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_plots(directory: str | Path, rows: list[ConfigResult], title: str) -> list[Path]:
    """``loss_vs_step.png`` (train loss lines, validation points) and ``step_time.png`` (bars)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    done = [row for row in rows if row.status == "ok"]
    several_models = len({row.model for row in done}) > 1
    labels = [f"{row.config} ({row.model})" if several_models else row.config for row in done]
    with figure(out / "loss_vs_step.png") as ax:
        for row, label in zip(done, labels, strict=True):
            (line,) = ax.plot(range(1, len(row.train_losses) + 1), row.train_losses, label=f"{label} train", lw=1)
            ax.plot(*zip(*row.val_curve, strict=True), "o", color=line.get_color(), label=f"{label} val", ms=4)
        ax.set(xlabel="step", ylabel="loss (nats/byte)", title=f"Loss vs step: {title}")
        ax.legend(fontsize="small", ncol=2)
    with figure(out / "step_time.png") as ax:
        ax.bar(labels, [row.median_step_s * 1e3 for row in done])
        ax.set(ylabel="median step time (ms)", title=f"Step time by configuration: {title}")
        ax.tick_params(axis="x", labelrotation=30)
    return [out / "loss_vs_step.png", out / "step_time.png"]
