"""``python -m bench.train.convergence``: a convergence report over several ``python -m bench.train --json`` runs.

Writes ``convergence.md`` and ``val_loss_vs_step.png`` (one line per configuration: the mean over
its seeds, their range shaded) into ``--out-dir`` (bench/TRAINING.md, "Recipes"). A configuration
in several files for the same seed is an error: which run counts would be ambiguous.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from .report import figure

BASELINE = "zero3"


class Run(NamedTuple):
    config: str
    seed: int
    curve: tuple[tuple[int, float], ...]  # (step, validation loss)

    @property
    def final(self) -> float:
        return self.curve[-1][1]


def load_runs(paths: Sequence[str | Path]) -> list[Run]:
    runs: dict[tuple[str, int], Run] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        seed = int(data["meta"]["args"]["seed"])
        for row in data["results"]:
            if row["status"] != "ok":
                continue
            key = (row["config"], seed)
            if key in runs:
                raise ValueError(f"{row['config']} seed {seed} appears in more than one file ({path})")
            runs[key] = Run(row["config"], seed, tuple((int(s), float(v)) for s, v in row["val_curve"]))
    return list(runs.values())


def gap_percent(run: Run, runs: Sequence[Run]) -> float | None:
    """``run``'s final validation loss over ``zero3``'s of the same seed, in percent above it."""
    base = [r for r in runs if r.config == BASELINE and r.seed == run.seed]
    return None if not base else 100.0 * (run.final / base[0].final - 1.0)


class SeedSummary(NamedTuple):
    config: str
    seeds: tuple[int, ...]
    mean: float
    stdev: float  # sample standard deviation (0 with one seed)


def by_config(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """The runs of each configuration, in order of first appearance, by seed."""
    return {config: sorted((r for r in runs if r.config == config), key=lambda r: r.seed)
            for config in dict.fromkeys(r.config for r in runs)}  # fmt: skip


def seed_summaries(runs: Sequence[Run]) -> list[SeedSummary]:
    return [SeedSummary(config, tuple(r.seed for r in mine), statistics.fmean(r.final for r in mine),
                        statistics.stdev([r.final for r in mine]) if len(mine) > 1 else 0.0)
            for config, mine in by_config(runs).items()]  # fmt: skip


def format_markdown(runs: Sequence[Run], sources: Sequence[str]) -> str:
    steps = sorted({s for r in runs for s, _ in r.curve})
    lines = ["# Convergence: validation loss vs step", "", "Runs: " + ", ".join(f"`{s}`" for s in sources), "",
             "| config | seed | " + " | ".join(f"val @{s}" for s in steps) + f" | gap vs {BASELINE} |",
             "|---|---|" + "---|" * (len(steps) + 1)]
    for run in sorted(runs, key=lambda r: (r.seed, r.config != BASELINE)):
        values = dict(run.curve)
        gap = gap_percent(run, runs)
        cells = [f"{values[s]:.4f}" if s in values else "" for s in steps]
        lines.append(f"| {run.config} | {run.seed} | " + " | ".join(cells) +
                     f" | {'' if gap is None else f'{gap:+.2f}%'} |")
    lines += ["", "Final validation loss over seeds (mean, sample standard deviation):", "",
              "| config | seeds | mean | std |", "|---|---|---|---|"]
    for summary in seed_summaries(runs):
        lines.append(f"| {summary.config} | {', '.join(map(str, summary.seeds))} | {summary.mean:.4f} | "
                     f"{summary.stdev:.4f} |")
    return "\n".join(lines) + "\n"


def write_plot(path: Path, runs: Sequence[Run], configs: Sequence[str] | None) -> None:
    groups = by_config(runs)
    with figure(path, figsize=(8, 5)) as ax:
        for config in configs or groups:
            if config not in groups:
                raise ValueError(f"--plot-configs names {config}, which no run has")
            mine, steps = groups[config], [s for s, _ in groups[config][0].curve]
            per_step = [[dict(r.curve)[s] for r in mine] for s in steps]
            (line,) = ax.plot(steps, [statistics.fmean(v) for v in per_step], marker="o", ms=3,
                              label=f"{config} ({len(mine)} seed{'s' if len(mine) > 1 else ''})")
            if len(mine) > 1:
                ax.fill_between(steps, [min(v) for v in per_step], [max(v) for v in per_step],
                                color=line.get_color(), alpha=0.15)
        ax.set(xlabel="step", ylabel="validation loss (nats/byte)", title="Validation loss vs step (bench.train, 2x2)")
        ax.legend(fontsize="small")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.train.convergence", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="JSON files written by python -m bench.train --json")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--plot-configs", nargs="+", help="configurations to plot (default: all)")
    args = parser.parse_args(argv)
    runs = load_runs(args.runs)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "convergence.md").write_text(format_markdown(runs, [Path(p).name for p in args.runs]))
    write_plot(out / "val_loss_vs_step.png", runs, args.plot_configs)
    print(f"wrote {out / 'convergence.md'} and {out / 'val_loss_vs_step.png'}")


if __name__ == "__main__":
    main()
