"""The GPU entry point: ``python -m bench.gpu_check`` checks, ``--bench`` measures; one report each.

How their minutes are shared: [Note: gpu-check time budget] in :mod:`.stages`, [Note: gpu-bench
time budget] in :mod:`.speed_plan`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
import time
from pathlib import Path

from . import environment, report, speed_plan, stages

EXIT_PASSED, EXIT_FAILED, EXIT_NO_GPU = 0, 1, 2
RESULTS = stages.REPO / "bench" / "results"


def gpu_problem() -> str | None:
    """Why this interpreter cannot check anything on a GPU, or None when torch sees a CUDA device."""
    try:
        import torch
    except ImportError as exc:
        return f"no usable CUDA GPU: {sys.executable} cannot import torch ({exc})"
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
        return f"no CUDA GPU on this machine: torch {torch.__version__} ({build}) sees no CUDA device (torch.cuda.is_available() is False)"
    return None


def default_out_dir(gpu_name: str, prefix: str = "gpu-check") -> Path:
    """``bench/results/<prefix>_<machine slug>_<UTC time>``: one folder per run."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return RESULTS / f"{prefix}_{re.sub(r'[^A-Za-z0-9]+', '-', gpu_name).strip('-').lower()}_{stamp}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--bench", action="store_true", help="the speed report (make gpu-bench) instead of the check; "
                        "without a GPU its CPU part runs and the exit status is 2")
    parser.add_argument("--out", type=Path, help="result folder (default: bench/results/gpu-{check,bench}_<gpu>_<UTC time>)")
    parser.add_argument("--only", nargs="+", metavar="STAGE", help="run only these stages or parts (names as in the report)")
    return parser


def main(argv: list[str] | None = None, **tools: str) -> int:
    """``tools``: module names standing in for the speed report's measuring tools (tests), see :func:`speed_plan.plan`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    noun = "gpu-bench" if args.bench else "gpu-check"
    started, problem = time.monotonic(), gpu_problem()
    if problem is not None and not args.bench:
        print(f"gpu-check: {problem}. Nothing was run; "
              "run `make gpu-check` on a machine with an NVIDIA GPU, a CUDA build of torch and cupy.", file=sys.stderr)  # fmt: skip
        return EXIT_NO_GPU
    if problem is not None:
        print(f"gpu-bench: {problem}; running the CPU part only (host cost with the CPU backends).", file=sys.stderr)
    import torch

    gpu = problem is None
    gpus, machine = (torch.cuda.device_count(), torch.cuda.get_device_name(0)) if gpu else (0, "cpu")
    out_dir = args.out or default_out_dir(machine, prefix=noun)
    plan = speed_plan.plan(out_dir, gpu=gpu, **tools) if args.bench else stages.plan(out_dir, gpus=gpus)
    budget = speed_plan.TOTAL_BUDGET_S if args.bench else stages.budget(gpus)
    if unknown := sorted(set(args.only or ()) - {stage.name for stage in plan}):
        parser.error(f"unknown stage(s) or part(s) {unknown}; choose from {[stage.name for stage in plan]}")
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"{noun}: {gpus} GPU(s), results in {out_dir}", flush=True)
    env = environment.collect(stages.REPO, gpu)
    (out_dir / "environment.json").write_text(json.dumps(env, indent=1) + "\n")
    results = []
    for stage in (stage for stage in plan if not args.only or stage.name in args.only):
        print(f"{noun}: {stage.name} (limit {stage.limit_s:.0f} s) ...", flush=True)
        results.append(stages.run_stage(stage, out_dir, started + budget))
        print(f"{noun}: {stage.name}: {results[-1].status} in {results[-1].seconds:.0f} s", flush=True)
    title = f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.node()}, "
    command = " ".join([Path(sys.executable).name, "-m", "bench.gpu_check", *(sys.argv[1:] if argv is None else argv)])
    common = dict(results=results, environment=env, seconds=time.monotonic() - started, command=command)
    if args.bench:
        text = report.render_bench(title=title + machine, gpu=gpu, **common)
    else:
        notes = [f"`{key}={os.environ[key]}` was set in the caller's environment; the stages ran without it."
                 for key in stages.CLEARED_ENV if key in os.environ]  # fmt: skip
        text = report.render_check(title=f"{title}{gpus} x {machine}", gpus=gpus, budget_s=budget, notes=notes, **common)
    (out_dir / "report.md").write_text(text)
    print(f"{noun}: {text.splitlines()[0].split(': ', 1)[1]}; report: {out_dir / 'report.md'}")
    return EXIT_FAILED if any(r.failed for r in results) else EXIT_PASSED if gpu else EXIT_NO_GPU
