"""``make demo``: the project's main job on a simulated 2-node x 2-rank cluster at 200 Mbit/s.

``python -m bench.demo`` (or ``training``) trains the same TinyGPT on the same real text
under ZeRO-3, ZeRO++ (qwZ + hpZ + qgZ), torch FSDP2 and DeepSpeed ZeRO-3, one after another
in one launch, and also hands DeepSpeed its own ZeRO++ keys to show what it does with them
(on a CPU it raises; the row shows DeepSpeed's error). It prints ``bench.train``'s table,
which states the CPU, the precision (bf16 only where the hardware computes in it, else
fp32 for every configuration) and each row's wire share, and then the measured speedup
and inter-node byte ratio of ZeRO++ over each other configuration and of our ZeRO-3 over
DeepSpeed's. DeepSpeed is optional (``make peers``): without it its rows say so and the
rest runs. Every engine gets the same optimizer, precision, batch and gradient clipping.
The model shape (3.3M parameters, 64 tokens per rank and step) is the regime ZeRO++ is
for: a small per-GPU batch on a slow inter-node link, where communication dominates the
step. It takes a few minutes on 2 cores.

``python -m bench.demo collectives`` runs the collectives suite instead: bf16, 1 MiB to
64 MiB, torch's collectives against zcomm's, ``reduce_scatter_q4`` with one and with four
pipeline stages (a few minutes).

Without root or iproute2 either job warns and runs under mpirun on plain loopback, with
``ZCOMM_LOCAL_SIZE=2`` so zcomm still sees two nodes (but no link is limited or counted).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .harness.checkout import checkout_environment
from .simcluster.launcher import missing_prerequisite

NUM_NODES, LOCAL_SIZE, RATE = 2, 2, "200mbit"
COLLECTIVES = ("-m", "bench.collectives", "-b", "1M", "-e", "64M", "-f", "2", "-n", "2", "-w", "1",
               "-d", "bfloat16", "--stages", "1,4")  # fmt: skip
TRAIN_CONFIGS = ("zero3", "zeropp", "fsdp2", "deepspeed-z3", "deepspeed-zeropp")
# (ours, theirs): the ratios printed after the table, each when both rows ran.
COMPARISONS = (*(("zeropp", name) for name in TRAIN_CONFIGS if name != "zeropp"), ("zero3", "deepspeed-z3"))
TRAINING = ("-m", "bench.train", "--configs", *TRAIN_CONFIGS, "--d-model", "256", "--n-layers", "4",
            "--batch", "4", "--seq-len", "64", "--steps", "20", "--warmup", "3")  # fmt: skip


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


def _ratio_line(ours: dict, other: dict) -> str:
    speedup = other["median_step_s"] / ours["median_step_s"]
    pace = f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"
    line = f"{ours['config']} vs {other['config']:6s}: step time {pace}"
    if ours["wire_tx_bytes_per_step"] is not None and other["wire_tx_bytes_per_step"]:
        line += f", inter-node wire bytes {ours['wire_tx_bytes_per_step'] / other['wire_tx_bytes_per_step']:.3f}x"
    return line


def training_summary(results: list[dict]) -> list[str]:
    """The measured step-time speedup and wire-byte ratio of each comparison whose rows both ran,
    then why any configuration did not run."""
    rows = {row["config"]: row for row in results if row["status"] == "ok"}
    if "zeropp" not in rows:
        return ["zeropp did not run: no comparison"]
    lines = [_ratio_line(rows[ours], rows[other]) for ours, other in COMPARISONS if ours in rows and other in rows]
    lines += [f"{row['config']} {row['status']}: {row['note']}" for row in results if row["status"] != "ok"]
    return lines


def main(argv: list[str] | None = None) -> int:
    job = (argv if argv is not None else sys.argv[1:]) or ["training"]
    if job in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if job not in (["training"], ["collectives"]):
        print("usage: python -m bench.demo [training|collectives]", file=sys.stderr)
        return 2
    problem = missing_prerequisite()
    if problem:
        print(f"WARNING: {problem}\nWARNING: running on plain loopback: no 200 Mbit/s link, no wire bytes.", file=sys.stderr)
    if job == ["collectives"]:
        return _run(command(COLLECTIVES, simulated=problem is None))
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "train.json"
        code = _run(command((*TRAINING, "--json", str(out)), simulated=problem is None))
        if code == 0:
            print("\n# ZeRO++ against the others, measured in this run")
            print("\n".join(training_summary(json.loads(out.read_text())["results"])))
    return code


if __name__ == "__main__":
    sys.exit(main())
