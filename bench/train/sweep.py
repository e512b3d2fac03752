"""``python -m bench.train.sweep``: the same training at several simulated link rates, table, plot and verdict.

One ``bench.train`` launch on the simulated cluster per ``--rates`` value and ``--repeats`` round
(round robin, so a burst of load falls on different rates in different rounds). What it writes,
and how its verdict checks the ZeRO++ paper's claim that ZeRO++ on a slow link matches ZeRO-3 on
a link 4x faster: bench/TRAINING.md, "Recipes" (issue 12).

[Note: best of launches] With several launches per rate, a configuration's step time at that
rate is the best (lowest) median of its launches: other jobs on a shared machine only ever
add time, so the minimum is the least disturbed measurement. Every launch's median stays in
the table of all launches.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from bench.harness.checkout import run_from_checkout
from bench.simcluster.config import launch_argv, parse_rate
from bench.simcluster.launcher import missing_prerequisite

from .configs import select_configs
from .report import figure, meta_lines

DEFAULT_RATES = ("100mbit", "200mbit", "400mbit", "800mbit", "1600mbit", "unlimited")
DEFAULT_CONFIGS = ("zero3", "zeropp", "fsdp2", "deepspeed-z3")
NUM_NODES, LOCAL_SIZE = 2, 2
CLAIM_FACTOR, ZEROPP, BASELINES = 4, "zeropp", ("zero3", "deepspeed-z3")
PLOT, REPORT = "step_time_vs_link_rate.png", "sweep.md"
COMMAND_INDENT = "    python -m bench.train.sweep"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.train.sweep", description=__doc__.split("\n")[0])
    parser.add_argument("--rates", nargs="+", default=list(DEFAULT_RATES), help="link rates (tc units, or unlimited)")
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), metavar="NAME")
    parser.add_argument("--out-dir", required=True, type=Path, help="where the JSON, logs, sweep.md and the plot go")
    parser.add_argument("--from-json", action="store_true", help="re-render from --out-dir's rate-*.json; run nothing")
    parser.add_argument("--repeats", type=int, default=1, help="launches per rate, round robin over the rates")
    parser.add_argument("--tolerance", type=float, default=0.10, help="'matches' means ZeRO++ <= (1 + this) x baseline")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- arguments for bench.train")
    return parser


def rate_sort_key(rate: str) -> float:
    bps = parse_rate(rate)
    return math.inf if bps is None else bps


@dataclass(frozen=True)
class RateRun:
    """The launches of the sweep at one nominal rate (``200mbit``, ``unlimited``): their JSON results."""

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
        """Each configuration's row from its best launch (see [Note: best of launches])."""
        best: dict[str, dict[str, Any]] = {}
        for row in (row for result in self.results for row in result["results"]):
            kept = best.get(row["config"])
            if kept is None or row["status"] == "ok" and (kept["status"] != "ok"
                                                          or row["median_step_s"] < kept["median_step_s"]):
                best[row["config"]] = row
        return best

    def all_steps(self, config: str) -> list[float]:
        """The median step time of ``config`` in every launch where it ran."""
        return [row["median_step_s"] for result in self.results for row in result["results"]
                if row["config"] == config and row["status"] == "ok"]  # fmt: skip

    def step_s(self, config: str) -> float | None:
        row = self.rows().get(config)
        return row["median_step_s"] if row and row["status"] == "ok" else None


def load_runs(paths: dict[str, list[Path]]) -> list[RateRun]:
    """The runs of ``{rate: [json path of each launch]}``, slowest link first."""
    runs = [RateRun(rate, tuple(json.loads(Path(path).read_text()) for path in launches))
            for rate, launches in paths.items()]  # fmt: skip
    return sorted(runs, key=lambda run: rate_sort_key(run.rate))


def configs_of(runs: list[RateRun]) -> list[str]:
    return list(dict.fromkeys(name for run in runs for name in run.rows()))


def _cell(run: RateRun, config: str) -> str:
    row = run.rows().get(config)
    if row is None or row["status"] != "ok":
        return "not run" if row is None else row["status"]
    share = "" if row.get("wire_fraction") is None else f" ({100 * row['wire_fraction']:.0f}%)"
    return f"{row['median_step_s'] * 1e3:.0f}{share}"


def markdown_table(runs: list[RateRun]) -> str:
    """Step ms (wire share) per configuration and rate, then wire MB/step and notes of rows that did not run."""
    heads = [run.rate if run.link_bps is None else f"{run.rate} ({run.link_bps * 1e-6:.0f})" for run in runs]
    lines = ["| config | " + " | ".join(heads) + " | wire MB/step |", "|---" * (len(runs) + 2) + "|"]
    notes = dict.fromkeys(f"`{config}`: {row['note']}" for config in configs_of(runs) for run in runs
                          if (row := run.rows().get(config)) and row["status"] != "ok")  # fmt: skip
    for config in configs_of(runs):
        wire = [run.rows()[config]["wire_tx_bytes_per_step"] for run in runs if run.step_s(config) is not None]
        wire = [value * 1e-6 for value in wire if value is not None]
        wire_cell = f"{min(wire):.3g}-{max(wire):.3g}" if wire else "n/a"
        lines.append(f"| `{config}` | " + " | ".join(_cell(run, config) for run in runs) + f" | {wire_cell} |")
    launches = max(len(run.results) for run in runs)
    best = f"best of {launches} launches' " if launches > 1 else ""
    lines += ["", f"Cells: {best}median step ms (wire time as % of that step). Column heads: nominal link rate "
              "(measured Mbit/s per node link and direction).", *(f"- {note}" for note in notes)]  # fmt: skip
    if launches > 1:
        lines += ["", "Every launch's median step ms:", "",
                  "| config | " + " | ".join(run.rate for run in runs) + " |", "|---" * (len(runs) + 1) + "|"]
        for config in configs_of(runs):
            cells = [" / ".join(f"{step * 1e3:.0f}" for step in run.all_steps(config)) or "-" for run in runs]
            lines.append(f"| `{config}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _interpolate_rate(target_s: float, points: list[tuple[float, float]]) -> tuple[str, float]:
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


class ClaimPair(NamedTuple):
    """ZeRO++ at ``slow`` against a baseline at ``fast`` (= 4x ``slow``), and the baseline's equivalent rate."""

    slow: str
    fast: str
    zeropp_s: float
    baseline_s: float
    equivalent: tuple[str, float]
    slow_bps: float

    @property
    def ratio(self) -> float:
        return self.zeropp_s / self.baseline_s


def claim_pairs(runs: list[RateRun], baseline: str) -> list[ClaimPair]:
    """Every (r, 4r) pair of shaped rates where both ZeRO++ and ``baseline`` ran."""
    by_rate = {run.nominal_bps: run for run in runs if run.nominal_bps is not None}
    curve = sorted((run.link_bps or run.nominal_bps, run.step_s(baseline)) for run in runs
                   if run.step_s(baseline) is not None and (run.link_bps or run.nominal_bps))  # fmt: skip
    pairs = []
    for bps, slow in sorted(by_rate.items()):
        fast = by_rate.get(CLAIM_FACTOR * bps)
        ours, theirs = slow.step_s(ZEROPP), None if fast is None else fast.step_s(baseline)
        if ours is not None and theirs is not None:
            pairs.append(ClaimPair(slow.rate, fast.rate, ours, theirs, _interpolate_rate(ours, curve),
                                   slow.link_bps or bps))  # fmt: skip
    return pairs


def claim_verdict(runs: list[RateRun], tolerance: float = 0.10) -> str:
    """The claim checked on the measured numbers, as Markdown: for every rate r whose 4r was swept too, ZeRO++ at r
    against each baseline at 4r, and the rate at which the baseline's step time equals ZeRO++'s at r."""
    lines = [f'Claim: "ZeRO++ on a slow link matches ZeRO-3 on a ~{CLAIM_FACTOR}x faster link" '
             f"(matches: ZeRO++ step <= {1 + tolerance:.2f} x the baseline's step).", ""]  # fmt: skip
    for baseline in BASELINES:
        pairs = claim_pairs(runs, baseline)
        if not pairs:
            lines.append(f"- against `{baseline}`: no (r, {CLAIM_FACTOR}r) pair where both ran: not checked")
            continue
        held = [pair.ratio <= 1 + tolerance for pair in pairs]
        word = "holds" if all(held) else "does not hold" if not any(held) else "holds in part"
        lines.append(f"- against `{baseline}`: **{word}** ({sum(held)} of {len(pairs)} pairs)")
        for pair, holds in zip(pairs, held, strict=True):
            sign, rate = pair.equivalent
            lines.append(f"  - zeropp @ {pair.slow}: {pair.zeropp_s * 1e3:.0f} ms vs {baseline} @ {pair.fast}: "
                         f"{pair.baseline_s * 1e3:.0f} ms -> ratio {pair.ratio:.2f} ({'holds' if holds else 'fails'}); "
                         f"{baseline} needs {'' if sign == '=' else sign + ' '}{rate / pair.slow_bps:.1f}x the link "
                         f"rate to match zeropp @ {pair.slow}")  # fmt: skip
    return "\n".join(lines)


def write_plot(path: Path, runs: list[RateRun]) -> None:
    """Step time against measured link throughput, log-log, one line per configuration."""
    meta = runs[0].results[0]["meta"]
    params = sum(count for count in meta["params"].values() if count)
    with figure(path) as ax:
        for config in configs_of(runs):
            points = [(run.link_bps * 1e-6, run.step_s(config)) for run in runs
                      if run.link_bps is not None and run.step_s(config) is not None]  # fmt: skip
            if points:
                ax.plot(*zip(*points, strict=True), "o-", label=config)
        for run in (run for run in runs if run.link_bps is not None):
            ax.annotate(run.rate, (run.link_bps * 1e-6, 0.02), xycoords=("data", "axes fraction"), fontsize="x-small",
                        rotation=90, va="bottom", ha="right", color="gray")  # fmt: skip
        ax.set(xscale="log", yscale="log", xlabel="measured link throughput per node (Mbit/s)",
               ylabel="median step time (s)", title=f"Step time vs link rate: {params / 1e6:.1f}M-param GPT, "
               f"{meta['num_nodes']}x{meta['local_size']} ranks,\n{meta['precision']} compute on {meta['cpu']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")


def json_path(out_dir: Path, rate: str, launch: int) -> Path:
    return out_dir / f"rate-{rate}-run{launch}.json"


def launch_command(rate: str, launch: int, configs: list[str], args: argparse.Namespace) -> list[str]:
    """The simulated-cluster launch of ``bench.train`` at ``rate``."""
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    return launch_argv(NUM_NODES, LOCAL_SIZE, rate, [sys.executable, "-m", "bench.train", "--configs", *configs,
                                                    *train_args, "--json", str(json_path(args.out_dir, rate, launch))])  # fmt: skip


def run_rate(rate: str, launch: int, args: argparse.Namespace) -> int:
    command = launch_command(rate, launch, args.configs, args)
    print("$ " + shlex.join(command), flush=True)
    log = json_path(args.out_dir, rate, launch).with_suffix(".log")
    with open(log, "w") as out:
        code = run_from_checkout(command, out)
    print(f"  -> {log} (exit {code})", flush=True)
    return code


def write_outputs(args: argparse.Namespace, command_line: str) -> Path:
    """sweep.md (headed by ``command_line``) and the plot from the rate-*.json files in ``--out-dir``."""
    paths = {rate: found for rate in args.rates if (found := sorted(args.out_dir.glob(f"rate-{rate}-run*.json")))}
    if not paths:
        raise SystemExit(f"no rate-*.json for {args.rates} in {args.out_dir}")
    runs = load_runs(paths)
    meta = runs[0].results[0]["meta"]
    write_plot(args.out_dir / PLOT, runs)
    text = ["# Step time vs simulated link rate", "", "Command (from the repository root, as root for the simulated "
            "cluster):", "", f"    {command_line}", "", f"- cluster: {meta['num_nodes']} nodes x {meta['local_size']} "
            "ranks", *meta_lines(meta), "", markdown_table(runs), "", claim_verdict(runs, args.tolerance), "",
            f"![step time vs link rate]({PLOT})", ""]  # fmt: skip
    (args.out_dir / REPORT).write_text("\n".join(text))
    return args.out_dir / REPORT


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        for rate in args.rates:
            parse_rate(rate)
        select_configs(args.configs)
    except ValueError as error:
        parser.error(str(error))
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    args.rates = sorted(set(args.rates), key=rate_sort_key)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report = args.out_dir / REPORT
    lines = report.read_text().splitlines() if report.exists() else []
    # Re-rendered, the report keeps the command of the sweep that measured it.
    command_line = next((line.strip() for line in lines if line.startswith(COMMAND_INDENT)), "(not recorded)")
    status = 0
    if not args.from_json:
        problem = missing_prerequisite()
        if problem:
            print(problem, file=sys.stderr)
            return 2
        command_line = shlex.join(["python", "-m", "bench.train.sweep", *(argv if argv is not None else sys.argv[1:])])
        for launch in range(1, args.repeats + 1):
            for rate in args.rates:
                status = run_rate(rate, launch, args) or status
    print(f"wrote {write_outputs(args, command_line)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
