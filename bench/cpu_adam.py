"""CPU optimizer-step benchmark: zero_runtime's fused AdamW against torch's and DeepSpeed's.

Run as ``python -m bench.cpu_adam`` (``--help`` for size, repeats). One flat fp32 parameter
of ``--numel`` elements per implementation, one shared fp32 gradient; each implementation
steps once to warm up (numba cache load, DeepSpeed's JIT build, first-touch page faults,
lazily allocated state) and is then timed ``--repeats`` times, the implementations
interleaved within each repeat so that load from other processes hits them alike; the
median is reported. Rows:

* ``torch AdamW foreach`` / ``fused=True`` / ``foreach=False`` (single-tensor), each also
  followed by the ``copy_`` of the parameters into their bf16 compute copy (what a mixed-
  precision optimizer step must do; ``+ bf16 copy`` rows);
* ``DeepSpeedCPUAdam`` (``adamw_mode=True``) when ``deepspeed`` imports and its CPU op
  builds (the reason is printed otherwise);
* ``zero_runtime.cpu_adam`` without and with the bf16 copy fused into its pass.

Every implementation uses the rank's thread share, ``torch.get_num_threads()`` (``--threads``
sets it). The run ends with the targets from this run's medians (fused step >=
2x torch foreach, and no slower than the fastest of torch fused and DeepSpeedCPUAdam),
PASS or MISS, and whether the fused step is bit-identical to torch's single-tensor step on
this data. These are measurements, not tests.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Callable

import torch

from bench.harness.flags import parse_size
from zero_runtime.offload.cpu_adam import AdamHyper, adam_step

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01


def _torch_step(kind: str, param0: torch.Tensor, grad: torch.Tensor, copy: bool) -> Callable[[], None]:
    param = torch.nn.Parameter(param0.clone())
    param.grad = grad
    flags = {"foreach": dict(foreach=True), "fused": dict(fused=True), "single": dict(foreach=False)}[kind]
    opt = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, **flags)
    out = torch.empty_like(param0, dtype=torch.bfloat16) if copy else None

    def step() -> None:
        opt.step()
        if out is not None:
            with torch.no_grad():
                out.copy_(param)

    step.state = lambda: (param.detach(), opt.state[param]["exp_avg"], opt.state[param]["exp_avg_sq"])
    return step


def _deepspeed_step(param0: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    from deepspeed.ops.adam import DeepSpeedCPUAdam  # optional: imported only for this row

    param = torch.nn.Parameter(param0.clone())
    param.grad = grad
    opt = DeepSpeedCPUAdam([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, adamw_mode=True)
    return opt.step


def _fused_step(param0: torch.Tensor, grad: torch.Tensor, copy: bool) -> Callable[[], None]:
    param, exp_avg, exp_avg_sq = param0.clone(), torch.zeros_like(param0), torch.zeros_like(param0)
    out = torch.empty_like(param0, dtype=torch.bfloat16) if copy else None
    hyper = AdamHyper(lr=LR, beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY, decoupled=True)
    count = [0]

    def step() -> None:
        count[0] += 1
        adam_step(param, grad, exp_avg, exp_avg_sq, hyper=hyper, step=float(count[0]), out=out)

    step.state = lambda: (param, exp_avg, exp_avg_sq)
    return step


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=parse_size, default=parse_size("100M"), help="parameters (default 100M)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: unchanged)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    param0 = torch.randn(args.numel, generator=gen)
    grad = torch.randn(args.numel, generator=gen) * 1e-2
    rows: dict[str, Callable[[], None]] = {}
    for kind, name in (("foreach", "torch AdamW foreach"), ("fused", "torch AdamW fused=True"),
                       ("single", "torch AdamW foreach=False")):
        rows[name] = _torch_step(kind, param0, grad, copy=False)
        rows[name + " + bf16 copy"] = _torch_step(kind, param0, grad, copy=True)
    deepspeed_note = ""
    try:
        rows["DeepSpeedCPUAdam"] = _deepspeed_step(param0, grad)
    except Exception as err:  # any import or build failure: the row is skipped with its reason
        deepspeed_note = f"DeepSpeedCPUAdam skipped: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    rows["zero_runtime.cpu_adam"] = _fused_step(param0, grad, copy=False)
    rows["zero_runtime.cpu_adam + bf16 copy (fused)"] = _fused_step(param0, grad, copy=True)
    for step in rows.values():
        step()
    samples: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(args.repeats):
        for name, step in rows.items():
            start = time.perf_counter()
            step()
            samples[name].append(time.perf_counter() - start)
    identical = all(torch.equal(a, b) for a, b in zip(rows["zero_runtime.cpu_adam"].state(),
                                                      rows["torch AdamW foreach=False"].state(), strict=True))
    _report(args, samples, deepspeed_note, identical)


def _report(args, samples: dict[str, list[float]], deepspeed_note: str, identical: bool) -> None:
    median = {name: statistics.median(s) for name, s in samples.items()}
    print(f"# CPU AdamW step, {args.numel / 1e6:g}M fp32 parameters, {torch.get_num_threads()} threads, "
          f"median of {args.repeats} (interleaved)")
    print(f"host: {platform.processor() or platform.machine()}, torch {torch.__version__}\n")
    print("| implementation | ms/step | GB/s (16 B read + 12 B written per element) | vs ours |")
    print("|---|---:|---:|---:|")
    ours = median["zero_runtime.cpu_adam"]
    for name, seconds in median.items():
        print(f"| {name} | {seconds * 1e3:.1f} | {28 * args.numel / seconds / 1e9:.2f} | {seconds / ours:.2f}x |")
    if deepspeed_note:
        print(f"\n{deepspeed_note}")
    competitors = [median["torch AdamW fused=True"]] + ([median["DeepSpeedCPUAdam"]] if "DeepSpeedCPUAdam" in median else [])
    print("\n## targets")
    speedup = median["torch AdamW foreach"] / ours
    print(f"- fused step >= 2x torch foreach: {speedup:.2f}x: {'PASS' if speedup >= 2 else 'MISS'}")
    fastest = min(competitors)
    print(f"- no slower than the fastest of torch fused / DeepSpeedCPUAdam ({fastest * 1e3:.1f} ms): "
          f"{ours * 1e3:.1f} ms: {'PASS' if ours <= fastest else 'MISS'}")
    print(f"- bit-identical to torch AdamW foreach=False after {args.repeats + 1} steps: {identical}")


if __name__ == "__main__":
    main()
