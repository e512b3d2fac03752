"""CPU optimizer-step benchmark: zero_runtime's fused AdamW against torch's and DeepSpeed's.

Run as ``python -m bench.cpu_adam`` (``--help``). One flat fp32 parameter of ``--numel``
elements per implementation, one shared fp32 gradient; each steps once to warm up (numba cache,
DeepSpeed's JIT build, first-touch page faults, lazy state), then ``--repeats`` times, the
implementations taking turns (:func:`bench.harness.timing.per_call_seconds`); medians are
reported. ``+ bf16 copy`` rows add the ``copy_`` of the parameters into a bf16 compute copy
(fused into zero_runtime's pass); ``DeepSpeedCPUAdam`` (``adamw_mode``) runs when it imports and
builds, else the reason is printed. Then the targets, and whether the fused step is
bit-identical to torch's single-tensor step.
"""

from __future__ import annotations

import argparse
import platform
import statistics
from typing import Callable

import torch

from bench.harness.flags import parse_size
from bench.harness.table import markdown
from bench.harness.timing import per_call_seconds
from zero_runtime.offload.cpu_adam import AdamHyper, adam_step

LR, BETAS, EPS, WEIGHT_DECAY = 1e-3, (0.9, 0.999), 1e-8, 0.01
_TORCH = {"torch AdamW foreach": dict(foreach=True), "torch AdamW fused=True": dict(fused=True),
          "torch AdamW foreach=False": dict(foreach=False)}


def _torch_step(flags: dict, param0: torch.Tensor, grad: torch.Tensor, copy: bool) -> Callable[[], None]:
    param = torch.nn.Parameter(param0.clone())
    param.grad = grad
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
    return DeepSpeedCPUAdam([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, adamw_mode=True).step


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
    args = parser.parse_args(argv)
    gen = torch.Generator().manual_seed(0)
    param0 = torch.randn(args.numel, generator=gen)
    grad = torch.randn(args.numel, generator=gen) * 1e-2
    steps: dict[str, Callable[[], None]] = {}
    for name, flags in _TORCH.items():
        steps[name] = _torch_step(flags, param0, grad, copy=False)
        steps[name + " + bf16 copy"] = _torch_step(flags, param0, grad, copy=True)
    deepspeed_note = ""
    try:
        steps["DeepSpeedCPUAdam"] = _deepspeed_step(param0, grad)
    except Exception as err:  # any import or build failure: the row is skipped with its reason
        deepspeed_note = f"DeepSpeedCPUAdam skipped: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
    steps["zero_runtime.cpu_adam"] = _fused_step(param0, grad, copy=False)
    steps["zero_runtime.cpu_adam + bf16 copy (fused)"] = _fused_step(param0, grad, copy=True)
    median = {name: statistics.median(s) for name, s in per_call_seconds(steps, rounds=args.repeats).items()}
    identical = all(torch.equal(a, b) for a, b in zip(steps["zero_runtime.cpu_adam"].state(),
                                                      steps["torch AdamW foreach=False"].state(), strict=True))
    print(f"# CPU AdamW step, {args.numel / 1e6:g}M fp32 parameters, {torch.get_num_threads()} threads, "
          f"median of {args.repeats} (interleaved)")
    print(f"host: {platform.processor() or platform.machine()}, torch {torch.__version__}\n")
    ours = median["zero_runtime.cpu_adam"]
    print("\n".join(markdown([{"implementation": name, "ms/step": f"{seconds * 1e3:.1f}",
                               "GB/s (16 B read + 12 B written per element)": f"{28 * args.numel / seconds / 1e9:.2f}",
                               "vs ours": f"{seconds / ours:.2f}x"} for name, seconds in median.items()])))  # fmt: skip
    if deepspeed_note:
        print(f"\n{deepspeed_note}")
    speedup = median["torch AdamW foreach"] / ours
    fastest = min(median[name] for name in ("torch AdamW fused=True", "DeepSpeedCPUAdam") if name in median)
    print("\n## targets")
    print(f"- fused step >= 2x torch foreach: {speedup:.2f}x: {'PASS' if speedup >= 2 else 'MISS'}")
    print(f"- no slower than the fastest of torch fused / DeepSpeedCPUAdam ({fastest * 1e3:.1f} ms): "
          f"{ours * 1e3:.1f} ms: {'PASS' if ours <= fastest else 'MISS'}")
    print(f"- bit-identical to torch AdamW foreach=False after {args.repeats + 1} steps: {identical}")


if __name__ == "__main__":
    main()
