"""The gpu-bench command: run what this machine can measure, write the report.

See :mod:`bench.gpu_bench` for what it measures and [Note: gpu-bench time budget] in
:mod:`bench.gpu_bench.plan` for how its minutes are shared.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
from pathlib import Path

from bench.gpu_check import environment
from bench.gpu_check.driver import default_out_dir, gpu_problem, select_stages
from bench.gpu_check.stages import REPO, run_stage

from . import plan, report

EXIT_COMPLETE, EXIT_FAILED, EXIT_NO_GPU = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_bench", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="result folder (default: bench/results/gpu-bench_<gpu or cpu>_<UTC time>)")
    parser.add_argument("--only", nargs="+", metavar="PART", help="run only these parts (names as in the report)")
    return parser


def _environment(gpu: bool) -> dict[str, str]:
    if gpu:
        return environment.collect(REPO)
    import torch

    return {"torch": torch.__version__, "python": platform.python_version(), "CPU": environment._probe(environment._cpu),
            "checkout": environment._probe(lambda: environment._checkout(REPO))}  # fmt: skip


def main(argv: list[str] | None = None, **tools: str) -> int:
    """``tools``: module names standing in for the measuring tools (tests), see :func:`plan.plan`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    started = time.monotonic()
    problem = gpu_problem()
    gpu = problem is None
    if not gpu:
        print(f"gpu-bench: {problem}; running the CPU part only (host cost with the CPU backends).", file=sys.stderr)
    import torch

    machine = torch.cuda.get_device_name(0) if gpu else "cpu"
    out_dir = args.out or default_out_dir(machine, prefix="gpu-bench")
    stages, absent = plan.plan(out_dir, gpu=gpu, **tools)
    stages = select_stages(parser, stages, args.only, "part")
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"gpu-bench: results in {out_dir}", flush=True)
    for line in absent:
        print(f"gpu-bench: {line}", flush=True)
    env = _environment(gpu)
    (out_dir / "environment.json").write_text(json.dumps(env, indent=1) + "\n")
    deadline = started + plan.TOTAL_BUDGET_S
    results = []
    for stage in stages:
        print(f"gpu-bench: {stage.name} (limit {stage.limit_s:.0f} s) ...", flush=True)
        results.append(run_stage(stage, out_dir, deadline))
        print(f"gpu-bench: {stage.name}: {results[-1].status} in {results[-1].seconds:.0f} s", flush=True)
    text = report.render(
        title=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.node()}, {machine}",
        results=results, absent=absent, gpu=gpu, seconds=time.monotonic() - started, environment=env,
        command=" ".join([Path(sys.executable).name, "-m", "bench.gpu_bench", *(sys.argv[1:] if argv is None else argv)]),
    )  # fmt: skip
    (out_dir / "report.md").write_text(text)
    failed = [r.stage.name for r in results if not r.passed]
    print(f"gpu-bench: {text.splitlines()[0][len('# zcomm gpu-bench: '):]}; report: {out_dir / 'report.md'}")
    if failed or absent:
        return EXIT_FAILED
    return EXIT_COMPLETE if gpu else EXIT_NO_GPU
