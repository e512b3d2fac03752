"""``python -m bench.train.sweep``: the same training at several simulated link rates, table and plot.

For every ``--rates`` value the sweep launches ``bench.train`` on the simulated cluster
(``bench.simcluster --num-nodes N --local-size L --rate R``), one launch per rate, each
writing ``rate-<R>-run<k>.json`` and its output ``rate-<R>-run<k>.log`` into ``--out-dir``;
``--repeats N`` goes over all rates N times (round robin, so a burst of load from other
jobs falls on different rates in different rounds) and the report keeps each
configuration's best launch per rate (see [Note: best of launches]). Then it writes
``sweep.md`` (the exact command, the machine, the precision, one table of step time and
wire share per configuration and rate, the bandwidth claim's verdict: see
:mod:`.sweep_report`) and ``step_time_vs_link_rate.png`` (log-log) there.
``--from-json`` re-renders the outputs from an earlier sweep's JSON files without
running anything, keeping the command its ``sweep.md`` names. Arguments after ``--`` go to ``bench.train`` unchanged::

    python -m bench.train.sweep --rates 100mbit 200mbit 400mbit 800mbit 1600mbit unlimited \\
        --configs zero3 zeropp fsdp2 deepspeed-z3 --out-dir bench/results/sweep -- --steps 10
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

from bench.harness.checkout import checkout_environment
from bench.simcluster.config import parse_rate
from bench.simcluster.launcher import missing_prerequisite

from .configs import select_configs
from .sweep_report import RateRun, claim_verdict, describe, load_runs, markdown_table, rate_sort_key, write_plot

DEFAULT_RATES = ("100mbit", "200mbit", "400mbit", "800mbit", "1600mbit", "unlimited")
DEFAULT_CONFIGS = ("zero3", "zeropp", "fsdp2", "deepspeed-z3")
PLOT = "step_time_vs_link_rate.png"
REPORT = "sweep.md"
COMMAND_INDENT = "    python -m bench.train.sweep"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.train.sweep", description=__doc__.split("\n")[0])
    parser.add_argument("--rates", nargs="+", default=list(DEFAULT_RATES), help="link rates (tc units, or unlimited)")
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS), metavar="NAME")
    parser.add_argument("--num-nodes", type=int, default=2)
    parser.add_argument("--local-size", type=int, default=2)
    parser.add_argument("--out-dir", required=True, type=Path, help="where the JSON, logs, sweep.md and the plot go")
    parser.add_argument("--from-json", action="store_true", help="re-render from --out-dir's rate-*.json; run nothing")
    parser.add_argument("--repeats", type=int, default=1, help="launches per rate, round robin over the rates")
    parser.add_argument("--tolerance", type=float, default=0.10, help="'matches' means ZeRO++ <= (1 + this) x baseline")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- arguments for bench.train")
    return parser


def json_path(out_dir: Path, rate: str, launch: int) -> Path:
    return out_dir / f"rate-{rate}-run{launch}.json"


def launch_command(rate: str, launch: int, configs: list[str], args: argparse.Namespace) -> list[str]:
    """The simulated-cluster launch of ``bench.train`` at ``rate``."""
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    return [sys.executable, "-m", "bench.simcluster", "--num-nodes", str(args.num_nodes), "--local-size",
            str(args.local_size), "--rate", rate, "--", sys.executable, "-m", "bench.train", "--configs", *configs,
            *train_args, "--json", str(json_path(args.out_dir, rate, launch))]  # fmt: skip


def run_rate(rate: str, launch: int, configs: list[str], args: argparse.Namespace) -> int:
    command = launch_command(rate, launch, configs, args)
    print("$ " + shlex.join(command), flush=True)
    log = json_path(args.out_dir, rate, launch).with_suffix(".log")
    with open(log, "w") as out:
        proc = subprocess.run(command, env=checkout_environment(os.environ), stdout=out, stderr=subprocess.STDOUT,
                              check=False)  # fmt: skip
    print(f"  -> {log} (exit {proc.returncode})", flush=True)
    return proc.returncode


def plot_title(runs: list[RateRun]) -> str:
    meta = runs[0].results[0]["meta"]
    params = sum(count for count in meta["params"].values() if count)
    return (f"Step time vs link rate: {params / 1e6:.1f}M-param GPT, {meta['num_nodes']}x{meta['local_size']} ranks,\n"
            f"{meta['precision']} compute on {meta['cpu']}")


def recorded_command(out_dir: Path) -> str:
    """The command of the sweep whose report is in ``out_dir`` (its sweep.md's command line)."""
    report = out_dir / REPORT
    lines = report.read_text().splitlines() if report.exists() else []
    return next((line.strip() for line in lines if line.startswith(COMMAND_INDENT)), "(not recorded)")


def write_outputs(args: argparse.Namespace, command_line: str) -> Path:
    """sweep.md (headed by ``command_line``) and the plot from the rate-*.json files in ``--out-dir``."""
    paths = {rate: sorted(args.out_dir.glob(f"rate-{rate}-run*.json")) for rate in args.rates}
    paths = {rate: found for rate, found in paths.items() if found}
    if not paths:
        raise SystemExit(f"no rate-*.json for {args.rates} in {args.out_dir}")
    runs = load_runs(paths)
    write_plot(args.out_dir / PLOT, runs, plot_title(runs))
    text = [
        "# Step time vs simulated link rate",
        "",
        "Command (from the repository root, as root for the simulated cluster):",
        "",
        f"    {command_line}",
        "",
        *describe(runs),
        "",
        markdown_table(runs),
        "",
        claim_verdict(runs, args.tolerance),
        "",
        f"![step time vs link rate]({PLOT})",
        "",
    ]
    report = args.out_dir / REPORT
    report.write_text("\n".join(text))
    return report


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
    status = 0
    command_line = recorded_command(args.out_dir)
    if not args.from_json:
        problem = missing_prerequisite()
        if problem:
            print(problem, file=sys.stderr)
            return 2
        command_line = shlex.join(["python", "-m", "bench.train.sweep", *(argv if argv is not None else sys.argv[1:])])
        for launch in range(1, args.repeats + 1):
            for rate in args.rates:
                status = run_rate(rate, launch, args.configs, args) or status
    print(f"wrote {write_outputs(args, command_line)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
