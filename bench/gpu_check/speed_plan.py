"""The parts of the speed report (``make gpu-bench``, ``python -m bench.gpu_check --bench``): commands and limits.

Each part is a subprocess run as a gpu-check stage; what each measures: docs/gpu-check.md. Without
a GPU only the CPU host cost runs.

[Note: gpu-bench time budget] The speed report shares a lease with gpu-check: its limits add up to
230 s of ``TOTAL_BUDGET_S`` = 240 s, in order of value: host cost (40 s), training (100 s: six
configurations in 4 interleaved rounds of 9 steps, 3 of them warm-up, as the second step after a
build can still run slow; a run took 2-3 s on an H200), the kernel sweep (50 s; 8 s on an H200)
and the variants (40 s, by estimate). One pass per configuration could not resolve a 10% target
(the same command read fsdp2/zero3 0.98x and 1.35x); four rounds (even, so that the alternating
order of ``bench.train.rounds`` cancels a linear drift) give every ratio four paired samples.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Callable

from bench.gpu_check.stages import Stage

TOTAL_BUDGET_S = 240.0
HOST_COST_SIZES = {"cuda": "1M,16M", "cpu": "1M"}
# Both CUDA kernel launchers, every row under each in one process: the A/B that decides the
# default ([Note: launcher choice] in zcomm_cuda/loader.py); it doubles the part's rows.
HOST_COST_LAUNCHERS = "cupy,driver"
TRAIN_CONFIGS = ("zero3", "zeropp", "zero3+qwz", "zero3+qgz", "fsdp2", "fsdp2-zeropp")
GPT_160M = ("--d-model", "1024", "--n-layers", "12", "--n-heads", "16", "--seq-len", "512", "--batch", "8")
TRAIN_STEPS, TRAIN_WARMUP, TRAIN_ROUNDS = 9, 3, 4
# The paired step-time ratios the training table prints: (configuration, the one it is compared with).
TRAIN_PAIRS = (("zero3+qwz", "zero3"), ("zeropp", "zero3"), ("fsdp2-zeropp", "fsdp2"), ("fsdp2", "zero3"))


def _wrote(name: str, module: str) -> Callable[[Path], list[str]]:
    return lambda out: [] if (out / name).exists() else [f"{module} wrote no {name}"]


def _verify_train(out_dir: Path) -> list[str]:
    if not (out_dir / "train.json").exists():
        return ["bench.train wrote no train.json"]
    rows = {row["config"]: row for row in json.loads((out_dir / "train.json").read_text())["results"]}
    return [f"{name}: {rows[name]['status']} ({rows[name]['note']})" if name in rows else f"{name}: no result"
            for name in TRAIN_CONFIGS if name not in rows or rows[name]["status"] != "ok"]  # fmt: skip


def plan(out_dir: Path, *, gpu: bool, python: str = sys.executable, host_cost: str = "bench.host_cost",
         kernels: str = "bench.kernels", train: str = "bench.train") -> list[Stage]:  # fmt: skip
    """The parts to run, in order; without a GPU only the CPU host cost. The module names are parameters
    so that a test can stand in small fakes (a tool that is missing fails its part: the log names it)."""
    device = "cuda" if gpu else "cpu"
    launchers = ("--launcher", HOST_COST_LAUNCHERS) if gpu else ()
    parts = [Stage(
        name=f"host-cost-{device}", limit_s=40, verify=_wrote(f"host_cost_{device}.json", host_cost),
        title=f"{host_cost} on {device}, world size 1, {HOST_COST_SIZES[device]} elements: host time per call next to "
              f"torch's{f', under each kernel launcher ({HOST_COST_LAUNCHERS})' if gpu else ''}",
        argv=(python, "-m", host_cost, "--device", device, "--sizes", HOST_COST_SIZES[device],
              "--json", str(out_dir / f"host_cost_{device}.json"), *launchers))]
    if gpu:
        parts += [
            Stage(
                name="train", limit_s=100, needs=("cupy", "numpy"), verify=_verify_train,
                title=f"{train}: GPT ~160M, bf16, {TRAIN_ROUNDS} interleaved rounds of {TRAIN_STEPS} steps ({TRAIN_WARMUP} "
                      f"warm-up): {', '.join(TRAIN_CONFIGS)}",
                argv=(python, "-m", train, "--configs", *TRAIN_CONFIGS, *GPT_160M, "--dtype", "bf16",
                      "--steps", str(TRAIN_STEPS), "--warmup", str(TRAIN_WARMUP), "--rounds", str(TRAIN_ROUNDS),
                      "--baseline", "zero3", "--eval-batches", "2", "--json", str(out_dir / "train.json"))),
            Stage(
                name="kernels", limit_s=50, needs=("cupy",), verify=_wrote("kernels.md", f"{kernels} --sweep"),
                title=f"{kernels} --sweep: cuda kernels' GB/s vs a device copy of the same bytes, 16M/64M/256M elements, "
                      "group 256 and 512, bf16 and fp32 (CUDA-graph replay)",
                argv=(python, "-m", kernels, "--sweep", "--json", str(out_dir / "kernels.json"),
                      "--output", str(out_dir / "kernels.md"))),
            Stage(
                name="kernel-variants", limit_s=40, needs=("cupy",), verify=_wrote("variants.md", f"{kernels} --variants"),
                title=f"{kernels} --variants: the rows of docs/kernel-variants.md, keep when >= 10% faster than the simpler path",
                argv=(python, "-m", kernels, "--variants", "--json", str(out_dir / "variants.json"),
                      "--output", str(out_dir / "variants.md"))),
        ]  # fmt: skip
    return parts
