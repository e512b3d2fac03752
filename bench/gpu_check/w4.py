"""World size 4 on one machine: zcomm's hierarchical collectives and ZeRO++ on 2 nodes x 2 ranks, one device.

``torchrun --standalone --nproc-per-node=4 -m bench.gpu_check.w4 --device {cuda,cpu} --json PATH`` (what it
checks: docs/gpu-check.md). One GPU cannot host two ranks of one NCCL communicator, but gloo runs
collectives on CUDA tensors (staged through the host), so 4 ranks on ``cuda:0`` run zcomm's kernels with
W > 1. The oracle is the same calls on CPU tensors, byte for byte, on zcomm's reference backend: it
defines the wire format and compiles nothing (no numba compile in 4 ranks eats the stage's time; a GPU
machine may lack numba). The CPU side is also held against a plain fp64 collective within a loose bound,
which catches a CPU path wrong in the same way; ZeRO++'s losses agree within ``ZEROPP_RTOL``
([Note: CPU/CUDA bounds] in tests/runtime/test_zero_cuda.py). Exit status 2 when ``--device cuda`` has no GPU.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence
from unittest import mock

import torch
import torch.distributed as dist

from bench.harness.rank_exit import leave

WORLD, LOCAL = 4, 2
ZEROPP_RTOL = 1e-3
STEPS = 3
# Loose bounds on ||quantized - exact|| / ||exact|| for normal inputs: an INT8 level is
# absmax/127 (absmax ~ 4 sigma over a group), rounding error ~ level/sqrt(12) per element
# (~0.01 sigma); INT4 levels are absmax/7 (~0.17 sigma), two hops of them at most ~0.35.
GATHER_BOUND, REDUCE_BOUND = 0.05, 0.35
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OPS = ("SUM", "AVG", "PREMUL_SUM")
PREMUL_FACTOR = 0.3  # not 1 / W: the divisor 1 / 0.3 takes the re-quantizer's division mode
# torch 2.13 renamed the flat all-gather (the old name warns)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _on_reference() -> Any:
    """zcomm's reference backend inside the block: the CPU side of every comparison."""
    return mock.patch.dict(os.environ, {"ZCOMM_BACKEND": "reference"})


def _inputs(seed: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=generator) * (1 + dist.get_rank())).to(dtype)


def _wait(handle: Any) -> None:
    if handle is not None:
        handle.wait()


def _same_bytes(device_out: Sequence[torch.Tensor], cpu_out: Sequence[torch.Tensor]) -> tuple[bool, float]:
    """Whether the outputs are byte-identical, and their largest absolute difference."""
    same, diff = True, 0.0
    for a, b in zip(device_out, cpu_out, strict=True):
        a = a.cpu()
        same &= torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        diff = max(diff, float((a.double() - b.double()).abs().max()))
    return same, diff


def _group(on: torch.device, groups: tuple) -> Any:
    """The group of a call on ``on``: ``groups`` is (the device's group, the CPU's group); None is WORLD."""
    return groups[1] if on.type == "cpu" else groups[0]


def _reduce_op(name: str) -> Any:
    if name == "PREMUL_SUM":  # what FSDP2 passes after set_gradient_divide_factor
        return dist._make_nccl_premul_sum(PREMUL_FACTOR)
    return getattr(dist.ReduceOp, name)


def _gather_case(topology, dtype: torch.dtype, stages: int, async_op: bool, groups: tuple):
    import zcomm

    x = _inputs(11, 5000, dtype)
    world = dist.get_world_size()

    def run(on: torch.device) -> list[torch.Tensor]:
        out = torch.empty(world * x.numel(), dtype=dtype, device=on)
        _wait(zcomm.all_gather_q8(out, x.to(on), _group(on, groups), async_op, pipeline_stages=stages,
                                  topology=topology))
        return [out]

    exact = torch.empty(world * x.numel(), dtype=torch.float64)
    _all_gather_single(exact, x.double(), group=groups[1])
    return run, exact, GATHER_BOUND


def _reduce_case(topology, dtype: torch.dtype, stages: int, async_op: bool, groups: tuple, *,
                 coalesced: bool, first_hop_bits: int, hadamard: int | None, op: str = "SUM"):  # fmt: skip
    import zcomm

    world = dist.get_world_size()
    numels = (world * 4096, world * 1000, world * 256) if coalesced else (world * 8192,)
    xs = [_inputs(23 + i, n, dtype) for i, n in enumerate(numels)]
    options = dict(pipeline_stages=stages, topology=topology, first_hop_bits=first_hop_bits, hadamard_block=hadamard)

    def run(on: torch.device) -> list[torch.Tensor]:
        ins = [x.to(on) for x in xs]
        outs = [torch.empty(x.numel() // world, dtype=dtype, device=on) for x in xs]
        group = _group(on, groups)
        if coalesced:
            _wait(zcomm.reduce_scatter_q4_coalesced(outs, ins, _reduce_op(op), group, async_op, **options))
        else:
            _wait(zcomm.reduce_scatter_q4(outs[0], ins[0], _reduce_op(op), group, async_op, **options))
        return outs

    scale = {"SUM": 1.0, "AVG": 1.0 / world, "PREMUL_SUM": PREMUL_FACTOR}[op]
    exact = []
    for x in xs:
        total = x.double()
        dist.all_reduce(total, group=groups[1])  # SUM on fp64 over the CPU's group, then this rank's slice
        exact.append(total.view(world, -1)[dist.get_rank()] * scale)
    return run, torch.cat(exact), REDUCE_BOUND


def _cases(dtypes: Sequence[str], ops: Sequence[str] = OPS, *, both_modes: bool = False) -> list[tuple[str, Callable, dict]]:
    """SUM over every option; AVG and PREMUL_SUM (folded into the fp32 reduction and, on two
    hops, the re-quantizing kernel's divisor) without the Hadamard rotation, which they share.
    4 stages run async and 1 stage sync, or (``both_modes``) each both ways."""
    cases = []
    for short, stages in itertools.product(dtypes, (1, 4)):
        for async_op in (False, True) if both_modes else (stages == 4,):
            mode = f"stages={stages}{' async' if async_op else ''}"
            options = dict(dtype=DTYPES[short], stages=stages, async_op=async_op)
            cases.append((f"all_gather_q8 {short} {mode}", _gather_case, options))
            for coalesced, (bits, hadamard) in itertools.product((False, True), ((4, None), (8, None), (4, 256))):
                for op in ops if hadamard is None else ("SUM",):
                    name = (f"reduce_scatter_q4{'_coalesced' if coalesced else ''} {short} {mode} "
                            f"first_hop=INT{bits}{' hadamard=256' if hadamard else ''} {op}")  # fmt: skip
                    make = functools.partial(_reduce_case, coalesced=coalesced, first_hop_bits=bits, hadamard=hadamard, op=op)
                    cases.append((name, make, options))
    return cases


def checked(name: str, check: Callable[[], tuple[bool, str]]) -> dict:
    """One check's entry; a check that raises fails with its error's last line, and the others still run."""
    try:
        ok, detail = check()
    except Exception:
        ok, detail = False, traceback.format_exc(limit=4).strip().splitlines()[-1]
    return {"check": name, "ok": ok, "detail": detail}


def check_case(make: Callable, options: dict, topology, device: torch.device, groups: tuple,
               launchers: Sequence[str | None] = (None,)) -> tuple[bool, str]:
    """One case: its calls on ``device`` (under each CUDA kernel launcher of ``launchers``; None:
    the process's) byte-identical to the same calls on CPU tensors, within its bound of fp64."""
    run, exact, bound = make(topology, groups=groups, **options)
    with _on_reference():
        on_cpu = run(torch.device("cpu"))
    approx = torch.cat([t.reshape(-1) for t in on_cpu]).double()
    error = float((approx - exact).norm() / exact.norm().clamp_min(1e-30))
    ok, details = error <= bound, []
    for launcher in launchers:
        if launcher is not None:
            from zcomm_cuda import loader

            loader.set_launcher(launcher)
        same, diff = _same_bytes(run(device), on_cpu)
        ok &= same
        details.append(f"{launcher + ': ' if launcher else ''}bytes {'identical' if same else f'DIFFER (max |diff| {diff:.3g})'}")
    return ok, f"{'; '.join(details)}; rel. error vs fp64 {error:.4f} (bound {bound})"


def tiny_gpt(device: torch.device) -> torch.nn.Module:
    from bench.train.models import GPTConfig, TinyGPT

    torch.manual_seed(0)
    return TinyGPT(GPTConfig(vocab_size=256, seq_len=32, d_model=64, n_heads=4, n_layers=2)).to(device)


def train_steps(model: torch.nn.Module, device: torch.device, update: Callable[[torch.Tensor], None]) -> list[torch.Tensor]:
    """The losses of ``STEPS`` steps (same weights and batches on every rank), each handed to ``update``."""
    generator = torch.Generator().manual_seed(1)
    world, losses = dist.get_world_size(), []
    for _ in range(STEPS):
        tokens = torch.randint(0, 256, (2 * world, 33), generator=generator)
        loss = model.loss(tokens.view(world, 2, 33)[dist.get_rank()].to(device))
        update(loss)
        losses.append(loss.detach().double().cpu())
    return losses


def global_mean(losses: Sequence[torch.Tensor], group: Any = None) -> list[float]:
    """Each step's loss averaged over the ranks (fp64 on the CPU, over ``group``: a CPU-capable one)."""
    total = torch.stack(list(losses))
    dist.all_reduce(total, group=group)
    return (total / dist.get_world_size()).tolist()


def train_zeropp(device: torch.device, topology, group: Any = None, cpu_group: Any = None, *,
                 weight_delta_bits: int | None = None) -> list[float]:
    """Global-batch losses of ZeRO++ (qwZ + hpZ + qgZ) on the tiny GPT; with ``weight_delta_bits``,
    hpZ's copies refreshed by weight differences."""
    import zero_runtime

    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "zero_quantized_weights": True,
                                    "zero_quantized_gradients": True, "zero_hpz_partition_size": topology.local_size}}  # fmt: skip
    if weight_delta_bits is not None:
        config["zero_optimization"]["zcomm_weight_delta_bits"] = weight_delta_bits
    sgd = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)
    model, opt = zero_runtime.initialize(tiny_gpt(device), sgd, config, group=group, topology=topology)

    def update(loss: torch.Tensor) -> None:
        opt.backward(loss)
        opt.step()

    losses = train_steps(model, device, update)
    opt.close()
    return global_mean(losses, cpu_group)


def compare_losses(name: str, on_device: Callable[[], list[float]], on_cpu: Callable[[], list[float]]) -> dict:
    """A check that the per-step losses of a training on the device equal the CPU's within ``ZEROPP_RTOL``."""

    def check() -> tuple[bool, str]:
        device_losses = on_device()
        with _on_reference():
            cpu_losses = on_cpu()
        worst = max(abs(a - b) / abs(b) for a, b in zip(device_losses, cpu_losses, strict=True))
        return (worst <= ZEROPP_RTOL and all(map(math.isfinite, device_losses)),
                f"losses {['%.5f' % v for v in device_losses]} vs CPU {['%.5f' % v for v in cpu_losses]}; "
                f"max rel. diff {worst:.2e} (bound {ZEROPP_RTOL})")  # fmt: skip

    return checked(name, check)


def _memory_check(device: torch.device) -> dict:
    """Peak temporary bytes of each collective call on ``device`` (:func:`bench.collective_memory.rank_peaks`,
    the CPU's cases with torch's CUDA memory statistics), the largest rank's, as a multiple of the
    call's output: reported beside the CPU's counts, not judged; the check fails only if measuring raised."""
    from bench.collective_memory import CASES, rank_peaks

    name = "peak temporary CUDA bytes per call, x output (reported)"
    try:
        peaks = rank_peaks(dist.get_rank(), WORLD, LOCAL, 1 << 16, torch.bfloat16, CASES, device)
        largest = torch.tensor([peaks[case][0] for case in CASES], dtype=torch.float64)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    except Exception as error:  # reported as this check's failure; the others stand
        return {"check": name, "ok": False, "detail": f"{type(error).__name__}: {error}"}
    detail = ", ".join(f"{case} {peak / peaks[case][1]:.2f}" for case, peak in zip(CASES, largest.tolist(), strict=True))
    return {"check": name, "ok": True, "detail": f"{detail} (65,536 bf16 elements per shard)"}


def merge(per_rank: Sequence[list[dict]]) -> list[dict]:
    """Rank 0's checks, each failed where any rank failed it (naming the ranks and the first one's detail)."""
    merged = []
    for index, check in enumerate(per_rank[0]):
        failed = [rank for rank, checks in enumerate(per_rank) if not checks[index]["ok"]]
        detail = check["detail"] if not failed else f"failed on rank(s) {failed}: {per_rank[failed[0]][index]['detail']}"
        merged.append({**check, "ok": not failed, "detail": detail})
    return merged


def torchrun_main(stage: str, args: argparse.Namespace, backend: str, run: Callable[[torch.device, Any], list[dict]],
                  *, local_device: bool, local_size: int | None = None) -> int:
    """One rank of a stage started by torchrun: join the ``backend`` world (its collectives time out after
    ``args.timeout`` s; the CPU group is the world under gloo, else a gloo group of the same ranks), run the checks,
    gather them; rank 0 prints them and writes ``args.json``. Ranks use ``cuda:LOCAL_RANK`` when
    ``local_device``, else ``cuda:0`` (several ranks on one GPU). ``local_size``: the ranks per node the
    checks lay out (default: torchrun's)."""
    if "LOCAL_RANK" not in os.environ:
        print(f"{stage}: start it with torchrun, e.g. torchrun --standalone --nproc-per-node=N -m "
              f"bench.gpu_check.{stage}", file=sys.stderr)  # fmt: skip
        return 2
    started = time.monotonic()
    local_rank, local = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    torch.set_num_threads(max(1, (os.cpu_count() or local) // local))
    timeout = datetime.timedelta(seconds=args.timeout)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", local_rank if local_device else 0)
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # TF32 would round differently from the CPU side
    dist.init_process_group(backend, timeout=timeout, **({"device_id": device} if backend == "nccl" else {}))
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    checks = run(device, cpu_group)
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, checks, group=cpu_group)
    if dist.get_rank() != 0:
        return 0
    merged, seconds, local = merge(per_rank), time.monotonic() - started, local_size or local
    passed = bool(merged) and all(c["ok"] for c in merged)
    for check in merged:
        print(f"{'ok  ' if check['ok'] else 'FAIL'} {check['check']}: {check['detail']}")
    print(f"{stage}: {sum(c['ok'] for c in merged)} of {len(merged)} checks passed on {len(per_rank)} ranks "
          f"({local} per node), device {args.device}, {backend}, {seconds:.0f} s")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "world_size": len(per_rank), "local_size": local,
                                         "backend": backend, "seconds": seconds, "checks": merged, "problems": [],
                                         "passed": passed}, indent=1) + "\n")  # fmt: skip
    return 0 if passed else 1


def torchrun_parser(prog: str, description: str, timeout: float) -> argparse.ArgumentParser:
    """The options w4 and nccl share."""
    parser = argparse.ArgumentParser(prog=f"python -m bench.gpu_check.{prog}", description=description.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: CPU tensors on both sides, the stage's wiring without a GPU")
    parser.add_argument("--dtypes", nargs="+", choices=tuple(DTYPES), default=list(DTYPES))
    parser.add_argument("--json", type=Path, help="rank 0 writes the checks here")
    parser.add_argument("--timeout", type=float, default=timeout, help=f"seconds a collective may take (default {timeout:g})")
    return parser


def build_parser() -> argparse.ArgumentParser:
    return torchrun_parser("w4", __doc__, 200.0)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("w4: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    if os.environ.get("WORLD_SIZE", str(WORLD)) != str(WORLD):
        print(f"w4: {WORLD} ranks (torchrun --nproc-per-node={WORLD}), not {os.environ['WORLD_SIZE']}", file=sys.stderr)
        return 2

    def run(device: torch.device, cpu_group: Any) -> list[dict]:
        import zcomm

        topology, cpu = zcomm.Topology(world_size=WORLD, local_size=LOCAL), torch.device("cpu")
        checks = [checked(name, functools.partial(check_case, make, options, topology, device, (None, None)))
                  for name, make, options in _cases(args.dtypes)]
        for label, bits in (("(qwZ + hpZ 2 + qgZ)", None), ("with INT4 weight differences", 4)):
            checks.append(compare_losses(f"zero_runtime ZeRO++ {label}, {STEPS} steps, fp32",
                                         lambda bits=bits: train_zeropp(device, topology, weight_delta_bits=bits),
                                         lambda bits=bits: train_zeropp(cpu, topology, weight_delta_bits=bits)))  # fmt: skip
        return checks + ([_memory_check(device)] if device.type == "cuda" else [])

    return torchrun_main("w4", args, "gloo", run, local_device=False, local_size=LOCAL)


if __name__ == "__main__":
    leave(main())  # without tearing the groups down: gloo's teardown can abort a rank whose peer left first
