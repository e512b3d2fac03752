"""Peak host memory per rank while building a model, plainly and under ``zero_runtime.Init``.

Run as ``python -m bench.init_memory`` (``--help``). Each mode runs in fresh ``--world-size``
gloo ranks: a rank imports everything, joins the group, resets its peak resident set
(``/proc/self/clear_refs``), builds a Hugging Face GPT-2 (fp32, same seed everywhere) and reads
its peak (``VmHWM``) and final resident set; reported is each mode's worst rank. The target for
``Init``: peak <= the largest module's own parameters + 1/W of the rest + a fixed overhead, the
peak of building on the ``meta`` device (the Python objects, no parameter bytes). The ranks run
with glibc's ``mmap`` threshold fixed ([Note: glibc's mmap threshold] in ``bench.harness.ranks``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist

import zero_runtime
from bench.harness.ranks import MALLOC_ENV, spawn, status_bytes

SHAPE = dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024)  # GPT-2 small
# mode -> what the model is built under; meta: every Python object of the model, no parameter bytes (the fixed overhead)
MODES = {"meta": lambda: torch.device("meta"), "plain": contextlib.nullcontext, "init": zero_runtime.Init}


def _build(mode: str):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    with MODES[mode]():
        return GPT2LMHeadModel(GPT2Config(**SHAPE))


def _rank(rank: int, world_size: int, mode: str) -> tuple[int, int, float]:
    """(peak, kept growth of the resident set in bytes, seconds) of building the model on this rank."""
    from transformers import GPT2Config, GPT2LMHeadModel  # noqa: F401  (loaded before the baseline)

    dist.barrier()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # resets VmHWM to the current resident set
    base = status_bytes("VmRSS")
    start = time.perf_counter()
    model = _build(mode)
    seconds = time.perf_counter() - start
    peak, kept = status_bytes("VmHWM") - base, status_bytes("VmRSS") - base
    dist.barrier()
    del model
    return peak, kept, seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    args = parser.parse_args(argv)
    os.environ.update(MALLOC_ENV)  # inherited by the spawned ranks
    model = _build("meta")  # the parameter counts
    total = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    mib, size = 2**20, 4  # fp32
    print(f"# Building an HF GPT-2 ({total / 1e6:.1f}M parameters, fp32) on {args.world_size} gloo ranks\n")
    print(f"shape: {SHAPE}; largest module: {largest / 1e6:.1f}M parameters ({largest * size / mib:.0f} MiB); "
          f"torch {torch.__version__}; one thread per rank\n")
    rows = {mode: spawn(_rank, args.world_size, mode, timeout=1800) for mode in MODES}
    # per mode, the max over the ranks of (peak, kept, seconds)
    worst = {mode: [max(column) for column in zip(*results, strict=True)] for mode, results in rows.items()}
    print("| mode | peak MiB (max rank) | kept MiB (max rank) | build s (max rank) |")
    print("|---|---|---|---|")
    for mode, (peak, kept, seconds) in worst.items():
        print(f"| {mode} | {peak / mib:.0f} | {kept / mib:.0f} | {seconds:.1f} |")
    overhead, peak, plain = worst["meta"][0], worst["init"][0], worst["plain"][0]
    budget = (largest + (total - largest) / args.world_size) * size
    verdict = "PASS" if peak <= budget + overhead else "MISS"
    print(f"\ntarget: Init peak <= largest module + 1/{args.world_size} of the rest + overhead = "
          f"{budget / mib:.0f} + {overhead / mib:.0f} MiB; measured {peak / mib:.0f} MiB: {verdict} "
          f"(plain construction: {plain / mib:.0f} MiB, {plain / peak:.2f}x Init's peak)")


if __name__ == "__main__":
    main()
