"""``make demo``: the project's main job on a simulated 2-node x 2-rank cluster at 200 Mbit/s (docs/benchmarks.md).

``python -m bench.demo`` (or ``training``) trains the same TinyGPT under ZeRO-3, ZeRO++, FSDP2
and DeepSpeed (with and without its own ZeRO++ keys) in one ``bench.train`` launch and keeps
``train.json``, ``results.md`` (the facts, the table with every column explained, ZeRO++'s ratios
to the others), ``demo.png`` and bench.train's plots in ``--out DIR`` (default
``demo-results/<UTC time>/``). ``python -m bench.demo collectives`` runs the collectives suite
instead (printed, not kept). Without root or iproute2 either job warns and runs under mpirun on
plain loopback, with ``ZCOMM_LOCAL_SIZE=2`` so zcomm still sees two nodes (no link limited or counted).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from .harness.checkout import run_from_checkout
from .simcluster.config import launch_argv
from .simcluster.launcher import missing_prerequisite
from .train.loop import ConfigResult
from .train.report import COLUMN_LEGEND, FIGURES, figure, figures, meta_lines

NUM_NODES, LOCAL_SIZE, RATE = 2, 2, "200mbit"
TRAIN_CONFIGS = ("zero3", "zeropp", "fsdp2", "deepspeed-z3", "deepspeed-zeropp")
# (ours, theirs): the ratios printed after the table, each when both rows ran.
COMPARISONS = (*(("zeropp", name) for name in TRAIN_CONFIGS if name != "zeropp"), ("zero3", "deepspeed-z3"))
COLLECTIVES = ("-m", "bench.collectives", "-b", "1M", "-e", "64M", "-f", "2", "-n", "2", "-w", "1",
               "-d", "bfloat16", "--stages", "1,4")  # fmt: skip
TRAINING = ("-m", "bench.train", "--configs", *TRAIN_CONFIGS, "--d-model", "256", "--n-layers", "4",
            "--batch", "4", "--seq-len", "64", "--steps", "20", "--warmup", "3")  # fmt: skip
KEPT = ("train.json", "results.md", "demo.png", "loss_vs_step.png", "step_time.png")


def command(job: tuple[str, ...], simulated: bool) -> list[str]:
    ranks = [sys.executable, *job]
    if simulated:
        return launch_argv(NUM_NODES, LOCAL_SIZE, RATE, ranks)
    mpirun = Path(sys.executable).parent / "mpirun"
    return [str(mpirun) if mpirun.exists() else "mpirun", "-n", str(NUM_NODES * LOCAL_SIZE), *ranks]


def _run(argv: list[str]) -> int:
    print("$ " + " ".join(argv), flush=True)
    return run_from_checkout(argv, ZCOMM_LOCAL_SIZE=str(LOCAL_SIZE))


def default_out_dir(now: float | None = None) -> Path:
    """``demo-results/<UTC time>`` under the current directory (a new folder per run)."""
    return Path("demo-results") / time.strftime("%Y%m%d-%H%M%SZ", time.gmtime(now))


def _ratio_line(ours: ConfigResult, other: ConfigResult) -> str:
    speedup = other.median_step_s / ours.median_step_s
    pace = f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"
    line = f"{ours.config} vs {other.config:6s}: step time {pace}"
    if ours.wire_tx_bytes_per_step is not None and other.wire_tx_bytes_per_step:
        line += f", inter-node wire bytes {ours.wire_tx_bytes_per_step / other.wire_tx_bytes_per_step:.3f}x"
    return line


def training_summary(results: list[dict[str, Any]]) -> list[str]:
    """The measured step-time speedup and wire-byte ratio of each comparison whose rows both
    ran, then one line naming the configurations that did not run (their reasons are in the
    table rows, said once; an expected failure is not repeated at all)."""
    rows = {row["config"]: ConfigResult(**row) for row in results if row["status"] == "ok"}
    if "zeropp" not in rows:
        return ["zeropp did not run: no comparison"]
    lines = [_ratio_line(rows[ours], rows[other]) for ours, other in COMPARISONS if ours in rows and other in rows]
    missing = [f"{row['config']} ({row['status']})" for row in results
               if row["status"] not in ("ok", "expected failure")]
    if missing:
        lines.append(f"not run: {', '.join(missing)}; the table says why")
    return lines


def _md_row(row: ConfigResult) -> str:
    if row.status != "ok":
        return f"| {row.config} | {row.status}: {row.note} |" + " |" * (len(FIGURES) - 1)
    return "| " + " | ".join([row.config, *figures(row)]) + " |"


def markdown(payload: dict[str, Any], command: str) -> str:
    """``results.md``: the facts of the run, the table, one line per column, the ratios."""
    meta, results, link = payload["meta"], payload["results"], payload["meta"].get("link_bytes_per_s")
    link = "not measured (plain loopback, no wire bytes)" if link is None else f"{link * 8e-6:.0f} Mbit/s measured"
    facts = [f"- command: `{command}`", f"- cluster: {meta['num_nodes']} node(s) x {meta['local_size']} rank(s); "
             f"link: {link}", *meta_lines(meta)]  # fmt: skip
    columns = ["config", *(title for title, *_ in FIGURES)]
    table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
             *(_md_row(ConfigResult(**row)) for row in results)]  # fmt: skip
    return "\n".join(["# make demo: ZeRO-3, ZeRO++, FSDP2 and DeepSpeed on one simulated cluster", "", *facts, "",
                      *table, "", *(f"- {line}" for line in COLUMN_LEGEND), "",
                      "ZeRO++ against the others, measured in this run:", "",
                      *(f"- {line}" for line in training_summary(results)), ""])  # fmt: skip


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    """``demo.png``: median step time and inter-node MB per step, one bar per configuration that ran."""
    done = [row for row in results if row["status"] == "ok"]
    names, wire = [row["config"] for row in done], [row["wire_tx_bytes_per_step"] for row in done]
    with figure(path, 1, 2, figsize=(11, 4.2)) as (left, right):
        left.bar(names, [row["median_step_s"] * 1e3 for row in done], color="tab:blue")
        left.set(ylabel="median step time (ms)", title="step time (lower is better)")
        if all(value is not None for value in wire):
            right.bar(names, [value * 1e-6 for value in wire], color="tab:orange")
            right.set(ylabel="inter-node MB per step", title="inter-node bytes (lower is better)")
        else:
            right.text(0.5, 0.5, "no wire counters\n(plain loopback, not the simulated cluster)", ha="center",
                       va="center", transform=right.transAxes)
            right.set(title="inter-node bytes: not measured")
        for ax in (left, right):
            ax.tick_params(axis="x", labelrotation=25)
        left.figure.suptitle(title)


def keep_results(out: Path, shown_command: str) -> list[str]:
    """Write ``results.md`` and ``demo.png`` next to the run's ``train.json``; return the summary lines."""
    payload = json.loads((out / "train.json").read_text())
    (out / "results.md").write_text(markdown(payload, shown_command))
    meta = payload["meta"]
    title = f"make demo: {meta['num_nodes']} nodes x {meta['local_size']} ranks, {meta['precision']}, {meta['cpu']}"
    plot(payload["results"], out / "demo.png", title)
    return training_summary(payload["results"])


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.demo", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("job", nargs="?", choices=("training", "collectives"), default="training")
    parser.add_argument("--out", type=Path, help="folder for the training job's results (default: "
                        "demo-results/<UTC time>/)")  # fmt: skip
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    problem = missing_prerequisite()
    if problem:
        print(f"WARNING: {problem}\nWARNING: running on plain loopback: no 200 Mbit/s link, no wire bytes.", file=sys.stderr)
    if args.job == "collectives":
        return _run(command(COLLECTIVES, simulated=problem is None))
    out = (args.out or default_out_dir()).resolve()
    out.mkdir(parents=True, exist_ok=True)
    job = (*TRAINING, "--json", str(out / "train.json"), "--plot-dir", str(out))
    argv = command(job, simulated=problem is None)
    print(f"# {len(TRAIN_CONFIGS)} configurations, one after another; results go to {out}", flush=True)
    code = _run(argv)
    if code != 0 or not (out / "train.json").exists():
        print(f"# the training run failed (status {code}); nothing kept in {out}", file=sys.stderr)
        return code or 1
    summary = keep_results(out, "make demo  # " + " ".join(argv))
    print("\n# ZeRO++ against the others, measured in this run")
    print("\n".join(summary))
    print(f"\n# results kept in {out}/: {', '.join(name for name in KEPT if (out / name).exists())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
