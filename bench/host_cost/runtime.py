"""Host cost of a ZeRO training step: what qwZ and qgZ add to stage 3's Python work per step.

``python -m bench.host_cost --runtime`` (what it prints: docs/benchmarks.md; why on a CPU:
bench/TRAINING.md, "A host-bound step"). The model is an MLP of ``--layers`` Linear layers of
``--width`` features, fp32, with ``bench.train``'s engine config plus :data:`HOST_BOUND_KEYS`:
every Linear its own stage-3 unit and gradient bucket, as the 160M GPT's are by default. Calls
per step are ``sys.setprofile``'s "call" events (Python functions only) by phase and thread;
step times the median of ``--steps`` steps per round, in ``--rounds`` rounds alternating the
configurations' order, the ratio to ``--baseline`` the median of the per-round ratios. With
``--device cuda`` the quantized chains run on the training thread, but autograd's CUDA backward
runs on a C++ thread a profile function does not reach: the backward column counts the
training thread's part only (the heading says so).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

import zero_runtime
from bench.harness.ranks import spawn
from bench.harness.table import markdown
from bench.harness.timing import per_call_seconds
from bench.train.configs import select_configs, zero_runtime_config
from bench.train.models import MLP

DEFAULT_CONFIGS = ("zero3", "zero3+qwz", "zero3+qgz", "zeropp")
HOST_BOUND_KEYS = {"zcomm_stage3_fuse_numel": 0, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 1}
PHASES = ("forward", "backward", "step", "zero_grad")
BATCH, COUNT_STEPS, TOP = 4, 2, 25  # rows per step; steps whose calls are counted; functions listed beyond the baseline


class _CallCounter:
    """Counts the Python "call" events of every thread while ``phase`` is set.

    Installed in this thread with ``sys.setprofile`` and in threads started later with
    ``threading.setprofile`` (zcomm's CPU workers start at the first collective, so the
    counter is installed before the engine is built)."""

    def __init__(self) -> None:
        self.phase: str | None = None
        self.removed = False
        self.main = threading.get_ident()
        self.counts: collections.Counter[tuple[str, str, str]] = collections.Counter()  # (phase, thread, fn)

    def __call__(self, frame, event, arg) -> None:
        if self.removed:
            sys.setprofile(None)  # a worker thread drops the counter at its next event
            return
        if event != "call" or self.phase is None:
            return
        code = frame.f_code
        thread = "main" if threading.get_ident() == self.main else "worker"
        self.counts[(self.phase, thread, f"{code.co_filename.rsplit('/', 1)[-1]}:{code.co_name}")] += 1

    def install(self) -> None:
        sys.setprofile(self)
        threading.setprofile(self)

    def remove(self) -> None:
        self.removed = True
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


@dataclass
class Engine:
    opt: Any
    phases: list[tuple[str, Callable[[], object]]]  # one training step, in :data:`PHASES`

    def step(self) -> None:
        for _, run in self.phases:
            run()


def build(name: str, args: argparse.Namespace) -> Engine:
    (config,) = select_configs([name])
    # one node of ``--world-size`` ranks: hpZ (in zeropp) over all of them
    engine_config = zero_runtime_config(config, local_size=args.world_size, bf16=False, gradient_clipping=0.0)
    engine_config["zero_optimization"].update(HOST_BOUND_KEYS)
    torch.manual_seed(0)
    # this rank's device: the CPU, or (--device cuda) the GPU of its rank
    device = torch.device("cpu") if args.device == "cpu" else torch.device("cuda", dist.get_rank())
    model = MLP(d_in=args.width, d_hidden=args.width, d_out=args.width, depth=args.layers).to(device)
    model, opt = zero_runtime.initialize(model, lambda params: torch.optim.AdamW(params, lr=1e-3), engine_config)
    generator = torch.Generator().manual_seed(1)
    batch, target = (torch.randn(BATCH, args.width, generator=generator).to(device) for _ in range(2))
    loss = {}
    return Engine(opt, [("forward", lambda: loss.update(value=torch.nn.functional.mse_loss(model(batch), target))),
                        ("backward", lambda: opt.backward(loss["value"])), ("step", opt.step), ("zero_grad", opt.zero_grad)])


@dataclass
class Result:
    name: str
    calls: dict[str, dict[str, int]] = field(default_factory=dict)  # phase -> thread -> calls per step
    functions: dict[str, float] = field(default_factory=dict)  # "thread fn" -> calls per step
    step_ms: list[float] = field(default_factory=list)  # per round: the median step


def count_calls(name: str, engine: Engine, counter: _CallCounter, steps: int) -> Result:
    """Calls per step by phase and thread, and per function, over ``steps`` steps."""
    counter.counts.clear()
    for _ in range(steps):
        for phase, run in engine.phases:
            counter.phase = phase
            run()
            counter.phase = None
        time.sleep(0.01)  # let a worker's last calls of the step land in the step's phase
    result = Result(name)
    functions: collections.Counter[str] = collections.Counter()
    for (phase, thread, fn), n in counter.counts.items():
        result.calls.setdefault(phase, {}).setdefault(thread, 0)
        result.calls[phase][thread] += n
        functions[f"{thread} {fn}"] += n
    result.calls = {phase: {t: n // steps for t, n in threads.items()} for phase, threads in result.calls.items()}
    result.functions = {fn: n / steps for fn, n in functions.items()}
    return result


def time_steps(engine: Engine, steps: int, device: str) -> float:
    """The median step in ms; on CUDA each step is timed to the end of its GPU work."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return statistics.median(per_call_seconds({"": engine.step}, rounds=steps, warmup=0, sync=sync, synced=True)[""]) * 1e3


def _total(result: Result, thread: str | None = None) -> int:
    return sum(n for threads in result.calls.values() for t, n in threads.items() if thread in (None, t))


def report(results: dict[str, Result], baseline: str, args: argparse.Namespace) -> str:
    machine = f"CPU {platform.processor() or platform.machine()}"
    machine = f"{torch.cuda.get_device_name(0)}, {machine}" if args.device == "cuda" else machine
    lines = [f"# zero_runtime host cost per step: MLP of {args.layers} Linear({args.width}, {args.width}), batch "
             f"{BATCH}, fp32, world size {args.world_size} (rank 0's figures), {machine}, "
             f"1 torch thread per rank, load average {os.getloadavg()[0]:.2f}",
             f"# engine: bench.train's config + {HOST_BOUND_KEYS}",
             "# backward counts: the training thread only (autograd's CUDA device thread is not profiled)"
             if args.device == "cuda" else "# backward counts: complete (a CPU backward runs on the training thread)", ""]
    base, rows = results[baseline], []
    for name, result in results.items():
        ratios = [a / b for a, b in zip(result.step_ms, base.step_ms, strict=True)]
        rows.append({"config": name, "calls/step main": _total(result, "main"), "calls/step worker": _total(result, "worker"),
                     **{f"{p} main/worker": "/".join(str(result.calls.get(p, {}).get(t, 0)) for t in ("main", "worker"))
                        for p in PHASES},
                     "step ms (median of rounds)": statistics.median(result.step_ms), "min": min(result.step_ms),
                     "max": max(result.step_ms), f"ratio to {baseline}": f"{statistics.median(ratios):.3f}"})  # fmt: skip
    lines += markdown(rows)
    for name, result in results.items():
        if name == baseline:
            continue
        extra = sorted(((n - base.functions.get(fn, 0.0), fn) for fn, n in result.functions.items()
                        if n - base.functions.get(fn, 0.0) >= 1), reverse=True)
        lines += ["", f"## {name}: functions entered per step beyond {baseline} "
                  f"({sum(d for d, _ in extra):.0f} calls; top {TOP})"]
        lines += [f"    {d:8.1f}  {fn}" for d, fn in extra[:TOP]]
    return "\n".join(lines)


def _rank(rank: int, world: int, args: argparse.Namespace) -> dict[str, Result]:
    """Every configuration's calls per step and its step times on this rank of ``world``."""
    counter = _CallCounter()
    counter.install()
    engines = {name: build(name, args) for name in args.configs}
    results = {}
    for name, engine in engines.items():
        for _ in range(args.warmup):
            engine.step()
        results[name] = count_calls(name, engine, counter, COUNT_STEPS)
    counter.remove()
    for r in range(args.rounds):
        for name in reversed(engines) if r % 2 else engines:
            results[name].step_ms.append(time_steps(engines[name], args.steps, args.device))
    for engine in engines.values():
        engine.opt.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.host_cost --runtime", description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS))
    parser.add_argument("--baseline", default=None, help="default: the first configuration")
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--world-size", type=int, default=1, help="ranks on this machine (rank 0's figures)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: NCCL, each rank on its GPU, steps timed to the end of their GPU work")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    baseline = args.baseline or args.configs[0]
    if baseline not in args.configs:
        parser.error(f"--baseline {baseline} is not in --configs")
    # one path for every world size, 1 too: ranks of their own (with NCCL, rank r on GPU r)
    results = spawn(_rank, args.world_size, args, backend="nccl" if args.device == "cuda" else "gloo", timeout=3600)[0]
    print(report(results, baseline, args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "host_bound_keys": HOST_BOUND_KEYS, "load_average": os.getloadavg(),
                       "results": {n: vars(r) for n, r in results.items()}}, f, indent=1)
    return 0

