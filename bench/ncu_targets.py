"""One call of every cuda op inside a profiler range, for Nsight Compute to read its counters.

``ncu --clock-control none --profile-from-start off --section SpeedOfLight --section
Occupancy --section LaunchStats python -m bench.ncu_targets [--numel 16M] [--group-size 256]``
profiles each op of :mod:`bench.kernels_sweep` (quantize, dequantize, reorder_quantize,
dequant_reduce to fp32 and re-quantizing; INT8 and INT4; bf16 and fp32 inputs) exactly once:
the inputs and outputs are all made first (their own quantize calls stay outside the range),
then ``torch.cuda.profiler`` opens the range around one call of each. Which kernel is the
bottleneck, its DRAM and SM shares, registers and occupancy: the numbers a kernel change
is judged by, next to the sweep's GB/s.
"""

from __future__ import annotations

import argparse

import torch

from bench import kernels_sweep
from bench.harness.flags import parse_size


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.ncu_targets", description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=parse_size, default="16M")
    parser.add_argument("--group-size", type=int, default=256)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error(f"torch {torch.__version__} sees no CUDA device")
    calls = []
    for tag, dtype in kernels_sweep.DTYPES.items():
        for _family, label, _nbytes, factory in kernels_sweep.op_specs(args.numel, dtype, args.group_size):
            calls.append((f"{tag} {label}", factory()))
    for _label, call in calls:  # compile every kernel outside the range
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for label, call in calls:
        torch.cuda.nvtx.range_push(label)
        call()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    print("profiled, in order:", "; ".join(label for label, _ in calls))


if __name__ == "__main__":
    main()
