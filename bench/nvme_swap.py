"""NVMe swap throughput: zero_runtime's swap file against ``dd`` with direct I/O on the same disk.

Run as ``python -m bench.nvme_swap --path DIR`` (``--help``). In one run, alternating
``--repeats`` times: ``dd`` writes then reads ``--size`` bytes in 1 MiB blocks with direct I/O
(the disk's sequential bandwidth), and the optimizer's ``SwapFile`` writes then reads as many
bytes from one aligned host buffer, as the offloaded optimizer step does for its sub-groups.
Medians are reported with the ratio against ``dd`` and the target (>= 70% of the disk's
sequential read and write bandwidth). Files are removed at the end.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
from pathlib import Path

import torch

from bench.harness.flags import parse_size
from bench.harness.table import markdown
from bench.harness.timing import per_call_seconds
from zero_runtime.config import AioConfig
from zero_runtime.offload.swap_file import SwapFile, aligned_buffer

AIO = AioConfig(zcomm_direct_io=True)  # DeepSpeed's defaults otherwise


def _dd(args: list[str]) -> float:
    """GB/s as dd reports it (bytes over its own elapsed time)."""
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
    match = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", out)
    return int(match.group(1)) / float(match.group(2)) / 1e9


def dd_rates(directory: str, mib: int) -> dict[str, float]:
    """The disk's sequential ``write`` then ``read`` bandwidth (GB/s) over ``mib`` MiB in 1 MiB blocks, direct I/O."""
    probe = Path(directory) / f"dd_probe_{os.getpid()}"
    try:
        return {"write": _dd(["if=/dev/zero", f"of={probe}", "bs=1M", f"count={mib}", "oflag=direct", "conv=fsync"]),
                "read": _dd([f"if={probe}", "of=/dev/null", "bs=1M", "iflag=direct"])}
    finally:
        probe.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--path", required=True, help="directory on the disk to measure")
    parser.add_argument("--size", type=parse_size, default=parse_size("1G"))
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    swap = SwapFile(args.path, rank=0, nbytes=args.size, aio=AIO)
    buffer = aligned_buffer(swap.nbytes)
    buffer.random_(0, 256)
    transfers = {"write": lambda: (swap.write(0, buffer).wait(), os.fsync(swap.fd)),
                 "read": lambda: swap.read(0, buffer).wait()}
    rates: dict[str, list[float]] = {"dd write": [], "dd read": [], "swap write": [], "swap read": []}
    try:
        for _ in range(args.repeats):  # dd, then the swap file, in each repeat
            for kind, rate in dd_rates(args.path, args.size // (1 << 20)).items():
                rates[f"dd {kind}"].append(rate)
            for kind, (seconds,) in per_call_seconds(transfers, rounds=1, warmup=0).items():
                rates[f"swap {kind}"].append(swap.nbytes / seconds / 1e9)
    finally:
        swap.close()
    median = {k: statistics.median(v) for k, v in rates.items()}
    print(f"# NVMe swap throughput, {args.size / 2**30:g} GiB, {args.path}, median of {args.repeats} (alternating)")
    print(f"aio: block_size {AIO.block_size}, thread_count {AIO.thread_count}, queue_depth {AIO.queue_depth}, "
          f"O_DIRECT {swap.direct}; torch {torch.__version__}\n")
    print("\n".join(markdown([{"transfer": name, "GB/s": value, "samples": ", ".join(f"{r:.2f}" for r in rates[name])}
                              for name, value in median.items()])))
    print("\n## target: swap >= 70% of the disk's sequential bandwidth")
    for kind in ("write", "read"):
        ratio = median[f"swap {kind}"] / median[f"dd {kind}"]
        print(f"- {kind}: {ratio:.0%} of dd: {'PASS' if ratio >= 0.7 else 'MISS'}")


if __name__ == "__main__":
    main()
