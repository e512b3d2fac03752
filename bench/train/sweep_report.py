"""The link-rate sweep's outputs: a Markdown table, a log-log plot, and the bandwidth claim's verdict.

Input: the ``bench.train --json`` results of each link rate, one per launch
(:func:`load_runs`). Every number comes from those files: step times, wire bytes and wire share per configuration, and
each run's measured link throughput, which places the point on the plot's x axis (so
``unlimited`` sits where the unshaped link actually ran).

[Note: bandwidth claim] The ZeRO++ paper reports that ZeRO++ on a slow link matches ZeRO-3
on a link about 4x faster. For every swept rate ``r`` whose ``4 r`` was swept too, the
verdict compares ZeRO++'s step time at ``r`` with the baseline's at ``4 r``: the claim holds
for that pair when ZeRO++ is no slower than ``1 + tolerance`` times the baseline. It also
reads off the *equivalent rate*: the link rate at which the baseline's step time (linear
interpolation in log-log between measured points) equals ZeRO++'s step at ``r``; its ratio
to ``r`` is the bandwidth factor ZeRO++ is worth there (">" when the baseline is slower at
every measured rate). The baselines are our stage 3 (``zero3``) and, when it ran,
DeepSpeed's (``deepspeed-z3``, the paper's own baseline).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.simcluster.config import parse_rate

CLAIM_FACTOR = 4
DEFAULT_TOLERANCE = 0.10
ZEROPP = "zeropp"
BASELINES = ("zero3", "deepspeed-z3")


@dataclass(frozen=True)
class RateRun:
    """The launches of the sweep at one nominal rate (``200mbit``, ``unlimited``): their JSON results.

    [Note: best of launches] With several launches per rate (``--repeats``), a
    configuration's step time at that rate is the best (lowest) median of its launches:
    other jobs on a shared machine only ever add time, so the minimum is the least
    disturbed measurement. Every launch's median stays in the table of all launches.
    """

    rate: str
    results: tuple[dict[str, Any], ...]

    @property
    def nominal_bps(self) -> int | None:
        return parse_rate(self.rate)

    @property
    def link_bps(self) -> float | None:
        """The measured link throughput in bits per second (median over the launches)."""
        measured = [8 * r["meta"]["link_bytes_per_s"] for r in self.results if r["meta"].get("link_bytes_per_s")]
        return statistics.median(measured) if measured else None

    def rows(self) -> dict[str, dict[str, Any]]:
        """Each configuration's row from its best launch (a row that did not run when none did)."""
        best: dict[str, dict[str, Any]] = {}
        for result in self.results:
            for row in result["results"]:
                kept = best.get(row["config"])
                if kept is None or (row["status"] == "ok" and (kept["status"] != "ok"
                                                              or row["median_step_s"] < kept["median_step_s"])):
                    best[row["config"]] = row
        return best

    def all_steps(self, config: str) -> list[float]:
        """The median step time of ``config`` in every launch where it ran."""
        return [row["median_step_s"] for result in self.results for row in result["results"]
                if row["config"] == config and row["status"] == "ok"]  # fmt: skip


def rate_sort_key(rate: str) -> float:
    bps = parse_rate(rate)
    return math.inf if bps is None else bps


def load_runs(paths: dict[str, list[Path]]) -> list[RateRun]:
    """The runs of ``{rate: [json path of each launch]}``, slowest link first."""
    runs = [RateRun(rate, tuple(json.loads(Path(path).read_text()) for path in launches))
            for rate, launches in paths.items()]  # fmt: skip
    return sorted(runs, key=lambda run: rate_sort_key(run.rate))


def configs_of(runs: list[RateRun]) -> list[str]:
    names: list[str] = []
    for run in runs:
        names.extend(name for name in run.rows() if name not in names)
    return names


def step_s(run: RateRun, config: str) -> float | None:
    row = run.rows().get(config)
    return row["median_step_s"] if row and row["status"] == "ok" else None


def _cell(run: RateRun, config: str) -> str:
    row = run.rows().get(config)
    if row is None:
        return "not run"
    if row["status"] != "ok":
        return row["status"]
    share = "" if row.get("wire_fraction") is None else f" ({100 * row['wire_fraction']:.0f}%)"
    return f"{row['median_step_s'] * 1e3:.0f}{share}"


def _rate_label(run: RateRun) -> str:
    measured = "" if run.link_bps is None else f" ({run.link_bps * 1e-6:.0f})"
    return f"{run.rate}{measured}"


def markdown_table(runs: list[RateRun]) -> str:
    """Step ms (wire share) per configuration and rate, then wire MB/step and notes of rows that did not run."""
    header = "| config | " + " | ".join(_rate_label(run) for run in runs) + " | wire MB/step |"
    lines = [header, "|---" * (len(runs) + 2) + "|"]
    notes = []
    for config in configs_of(runs):
        rows = [run.rows()[config] for run in runs if step_s(run, config) is not None]
        wire = [row["wire_tx_bytes_per_step"] for row in rows if row["wire_tx_bytes_per_step"] is not None]
        wire_cell = f"{min(wire) * 1e-6:.3g}-{max(wire) * 1e-6:.3g}" if wire else "n/a"
        lines.append(f"| `{config}` | " + " | ".join(_cell(run, config) for run in runs) + f" | {wire_cell} |")
        for run in runs:
            row = run.rows().get(config)
            if row is not None and row["status"] != "ok" and f"`{config}`: {row['note']}" not in notes:
                notes.append(f"`{config}`: {row['note']}")
    lines.append("")
    launches = max(len(run.results) for run in runs)
    best = f"best of {launches} launches' " if launches > 1 else ""
    lines.append(f"Cells: {best}median step ms (wire time as % of that step). Column heads: nominal link rate "
                 "(measured Mbit/s per node link and direction).")  # fmt: skip
    lines.extend(f"- {note}" for note in notes)
    if launches > 1:
        lines += ["", "Every launch's median step ms:", "",
                  "| config | " + " | ".join(run.rate for run in runs) + " |", "|---" * (len(runs) + 1) + "|"]
        for config in configs_of(runs):
            cells = [" / ".join(f"{step * 1e3:.0f}" for step in run.all_steps(config)) or "-" for run in runs]
            lines.append(f"| `{config}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _interpolate_rate(target_s: float, points: list[tuple[float, float]]) -> tuple[str, float | None]:
    """The rate (bits/s) at which the curve ``points`` [(rate, step s), ascending rate] reaches
    ``target_s``: ("=", rate) interpolated log-log, (">", fastest rate) when the curve stays
    slower than ``target_s``, ("<", slowest rate) when it is already faster at the slowest."""
    if target_s >= points[0][1]:
        return "<", points[0][0]
    for (r0, t0), (r1, t1) in zip(points, points[1:], strict=False):
        if t1 <= target_s <= t0 and t0 != t1:
            frac = (math.log(t0) - math.log(target_s)) / (math.log(t0) - math.log(t1))
            return "=", math.exp(math.log(r0) + frac * (math.log(r1) - math.log(r0)))
    return ">", points[-1][0]


@dataclass(frozen=True)
class ClaimPair:
    """ZeRO++ at ``slow`` against a baseline at ``fast`` (= 4x ``slow``)."""

    baseline: str
    slow: str
    fast: str
    zeropp_s: float
    baseline_s: float
    equivalent: tuple[str, float | None]
    slow_bps: float

    @property
    def ratio(self) -> float:
        return self.zeropp_s / self.baseline_s

    def holds(self, tolerance: float) -> bool:
        return self.ratio <= 1 + tolerance

    def factor_text(self) -> str:
        sign, rate = self.equivalent
        if rate is None:
            return "n/a"
        factor = rate / self.slow_bps
        return {"=": f"{factor:.1f}x", ">": f"> {factor:.1f}x", "<": f"< {factor:.1f}x"}[sign]


def claim_pairs(runs: list[RateRun], baseline: str) -> list[ClaimPair]:
    """Every (r, 4r) pair of shaped rates where both ZeRO++ and ``baseline`` ran."""
    by_rate = {run.nominal_bps: run for run in runs if run.nominal_bps is not None}
    curve = sorted((run.link_bps or run.nominal_bps, step_s(run, baseline)) for run in runs
                   if step_s(run, baseline) is not None and (run.link_bps or run.nominal_bps))  # fmt: skip
    pairs = []
    for bps, slow in sorted(by_rate.items()):
        fast = by_rate.get(CLAIM_FACTOR * bps)
        ours, theirs = step_s(slow, ZEROPP), None if fast is None else step_s(fast, baseline)
        if ours is None or theirs is None:
            continue
        slow_bps = slow.link_bps or bps
        pairs.append(ClaimPair(baseline, slow.rate, fast.rate, ours, theirs, _interpolate_rate(ours, curve), slow_bps))
    return pairs


def claim_verdict(runs: list[RateRun], tolerance: float = DEFAULT_TOLERANCE) -> str:
    """The claim checked on the measured numbers (see [Note: bandwidth claim]), as Markdown."""
    lines = [f'Claim: "ZeRO++ on a slow link matches ZeRO-3 on a ~{CLAIM_FACTOR}x faster link" '
             f"(matches: ZeRO++ step <= {1 + tolerance:.2f} x the baseline's step).", ""]  # fmt: skip
    for baseline in BASELINES:
        pairs = claim_pairs(runs, baseline)
        if not pairs:
            lines.append(f"- against `{baseline}`: no (r, {CLAIM_FACTOR}r) pair where both ran: not checked")
            continue
        held = [pair for pair in pairs if pair.holds(tolerance)]
        word = "holds" if len(held) == len(pairs) else "does not hold" if not held else "holds in part"
        lines.append(f"- against `{baseline}`: **{word}** ({len(held)} of {len(pairs)} pairs)")
        for pair in pairs:
            outcome = "holds" if pair.holds(tolerance) else "fails"
            lines.append(
                f"  - zeropp @ {pair.slow}: {pair.zeropp_s * 1e3:.0f} ms vs {baseline} @ {pair.fast}: "
                f"{pair.baseline_s * 1e3:.0f} ms -> ratio {pair.ratio:.2f} ({outcome}); "
                f"{baseline} needs {pair.factor_text()} the link rate to match zeropp @ {pair.slow}"
            )
    return "\n".join(lines)


def write_plot(path: Path, runs: list[RateRun], title: str) -> Path:
    """Step time against measured link throughput, log-log, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for config in configs_of(runs):
        points = [(run.link_bps * 1e-6, step_s(run, config)) for run in runs
                  if run.link_bps is not None and step_s(run, config) is not None]  # fmt: skip
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, "o-", label=config)
    for run in runs:
        if run.link_bps is not None:
            ax.annotate(run.rate, (run.link_bps * 1e-6, 0.02), xycoords=("data", "axes fraction"), fontsize="x-small",
                        rotation=90, va="bottom", ha="right", color="gray")  # fmt: skip
    ax.set(xscale="log", yscale="log", xlabel="measured link throughput per node (Mbit/s)",
           ylabel="median step time (s)", title=title)  # fmt: skip
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def describe(runs: list[RateRun]) -> list[str]:
    """What the runs were measured on (from the first launch's metadata; all ran on one machine)."""
    meta = runs[0].results[0]["meta"]
    params = ", ".join(f"{model} {count:,} params" for model, count in meta["params"].items() if count)
    args = meta["args"]
    return [
        f"- hardware: {meta['cpu']}, ranks on {meta['device']}; torch {meta['torch']}; "
        f"DeepSpeed {meta['deepspeed'] or 'not installed'}",
        f"- precision: {meta['precision']} compute for every configuration ({meta['precision_reason']})",
        f"- cluster: {meta['num_nodes']} nodes x {meta['local_size']} ranks; model: {params}; "
        f"batch {args['batch']} x {args['seq_len']} tokens, {args['steps']} steps ({args['warmup']} warm-up)",
    ]
