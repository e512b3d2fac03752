"""``make demo``: the project's main job on a simulated 2-node x 2-rank cluster at 200 Mbit/s.

``python -m bench.demo`` (or ``training``) trains the same TinyGPT under ZeRO-3, ZeRO++, FSDP2
and DeepSpeed (with and without its own ZeRO++ keys) in one ``bench.train`` launch and keeps
its results in ``--out DIR`` (default ``demo-results/<UTC time>/``): what it runs, what the
folder holds and what DeepSpeed's rows say is docs/benchmarks.md ("make demo").
``python -m bench.demo collectives`` runs the collectives suite instead (printed, not kept).

Without root or iproute2 either job warns and runs under mpirun on plain loopback, with
``ZCOMM_LOCAL_SIZE=2`` so zcomm still sees two nodes (but no link is limited or counted).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .demo_report import TRAIN_CONFIGS, markdown, plot, training_summary
from .harness.checkout import checkout_environment
from .simcluster.launcher import missing_prerequisite

NUM_NODES, LOCAL_SIZE, RATE = 2, 2, "200mbit"
COLLECTIVES = ("-m", "bench.collectives", "-b", "1M", "-e", "64M", "-f", "2", "-n", "2", "-w", "1",
               "-d", "bfloat16", "--stages", "1,4")  # fmt: skip
TRAINING = ("-m", "bench.train", "--configs", *TRAIN_CONFIGS, "--d-model", "256", "--n-layers", "4",
            "--batch", "4", "--seq-len", "64", "--steps", "20", "--warmup", "3")  # fmt: skip
KEPT = ("train.json", "results.md", "demo.png", "loss_vs_step.png", "step_time.png")

def command(job: tuple[str, ...], simulated: bool) -> list[str]:
    ranks = [sys.executable, *job]
    if simulated:
        launcher = [sys.executable, "-m", "bench.simcluster", "--num-nodes", str(NUM_NODES), "--local-size", str(LOCAL_SIZE),
                    "--rate", RATE]  # fmt: skip
        return [*launcher, "--", *ranks]
    mpirun = Path(sys.executable).parent / "mpirun"
    return [str(mpirun) if mpirun.exists() else "mpirun", "-n", str(NUM_NODES * LOCAL_SIZE), *ranks]


def _run(argv: list[str]) -> int:
    print("$ " + " ".join(argv), flush=True)
    env = dict(checkout_environment(os.environ), ZCOMM_LOCAL_SIZE=str(LOCAL_SIZE))
    return subprocess.run(argv, env=env, check=False).returncode


def default_out_dir(now: float | None = None) -> Path:
    """``demo-results/<UTC time>`` under the current directory (a new folder per run)."""
    return Path("demo-results") / time.strftime("%Y%m%d-%H%M%SZ", time.gmtime(now))


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
