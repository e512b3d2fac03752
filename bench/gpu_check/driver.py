"""The GPU entry point: ``python -m bench.gpu_check`` checks, ``--bench`` measures; one report each.

See :mod:`bench.gpu_check` for what each does, ``[Note: gpu-check time budget]`` in
:mod:`bench.gpu_check.stages` and ``[Note: gpu-bench time budget]`` in
:mod:`bench.gpu_check.speed_plan` for how their minutes are shared.
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

from . import environment, report, speed_plan, speed_report, stages

EXIT_PASSED, EXIT_FAILED, EXIT_NO_GPU = 0, 1, 2
EXIT_COMPLETE = EXIT_PASSED
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


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", text).strip("-").lower()


def default_out_dir(gpu_name: str, prefix: str = "gpu-check") -> Path:
    """``bench/results/<prefix>_<machine slug>_<UTC time>``: one folder per run."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return RESULTS / f"{prefix}_{_slug(gpu_name)}_{stamp}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--bench", action="store_true", help="the speed report (make gpu-bench) instead of the check; "
                        "without a GPU its CPU part runs and the exit status is 2")
    parser.add_argument("--out", type=Path, help="result folder (default: bench/results/gpu-{check,bench}_<gpu>_<UTC time>)")
    parser.add_argument("--only", nargs="+", metavar="STAGE", help="run only these stages or parts (names as in the report)")
    return parser


def _cleared_notes() -> list[str]:
    return [f"`{key}={os.environ[key]}` was set in the caller's environment; the stages ran without it."
            for key in stages.CLEARED_ENV if key in os.environ]  # fmt: skip


def select_stages(
    parser: argparse.ArgumentParser, plan: list[stages.Stage], only: list[str] | None, noun: str
) -> list[stages.Stage]:
    """The stages of ``plan`` named by ``--only`` (all without it); a usage error names unknown ones."""
    if not only:
        return plan
    unknown = sorted(set(only) - {stage.name for stage in plan})
    if unknown:
        parser.error(f"unknown {noun}(s) {unknown}; choose from {[stage.name for stage in plan]}")
    return [stage for stage in plan if stage.name in only]


def _command(name: str, argv: list[str] | None) -> str:
    return " ".join([Path(sys.executable).name, "-m", name, *(sys.argv[1:] if argv is None else argv)])


def _run(plan: list[stages.Stage], out_dir: Path, budget_s: float, started: float, noun: str) -> list[stages.StageResult]:
    deadline = started + budget_s
    results = []
    for stage in plan:
        print(f"{noun}: {stage.name} (limit {stage.limit_s:.0f} s) ...", flush=True)
        results.append(stages.run_stage(stage, out_dir, deadline))
        print(f"{noun}: {stage.name}: {results[-1].status} in {results[-1].seconds:.0f} s", flush=True)
    return results


def main(argv: list[str] | None = None, **tools: str) -> int:
    """``tools``: module names standing in for the speed report's measuring tools (tests), see
    :func:`speed_plan.plan`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.bench:
        return _bench(parser, args, argv, tools)
    started = time.monotonic()
    problem = gpu_problem()
    if problem is not None:
        print(f"gpu-check: {problem}. Nothing was run; "
              "run `make gpu-check` on a machine with an NVIDIA GPU, a CUDA build of torch and cupy.", file=sys.stderr)  # fmt: skip
        return EXIT_NO_GPU
    import torch

    gpus = torch.cuda.device_count()
    gpu_name = torch.cuda.get_device_name(0)
    out_dir = args.out or default_out_dir(gpu_name)
    plan = stages.plan(out_dir, gpus=gpus)
    plan = select_stages(parser, plan, args.only, "stage")
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"gpu-check: {gpus} GPU(s), results in {out_dir}", flush=True)
    env = environment.collect(stages.REPO)
    (out_dir / "environment.json").write_text(json.dumps(env, indent=1) + "\n")
    budget = stages.budget(gpus)
    results = _run(plan, out_dir, budget, started, "gpu-check")
    text = report.render(
        title=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.node()}, {gpus} x {gpu_name}",
        results=results, environment=env, gpus=gpus, seconds=time.monotonic() - started,
        budget_s=budget, command=_command("bench.gpu_check", argv),
        notes=_cleared_notes(),
    )  # fmt: skip
    (out_dir / "report.md").write_text(text)
    failed = [r.stage.name for r in results if r.failed]
    print(f"gpu-check: {'FAILED: ' + ', '.join(failed) if failed else 'PASSED'}; report: {out_dir / 'report.md'}")
    return EXIT_FAILED if failed else EXIT_PASSED


def _bench(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None, tools: dict) -> int:
    started = time.monotonic()
    problem = gpu_problem()
    gpu = problem is None
    if not gpu:
        print(f"gpu-bench: {problem}; running the CPU part only (host cost with the CPU backends).", file=sys.stderr)
    import torch

    machine = torch.cuda.get_device_name(0) if gpu else "cpu"
    out_dir = args.out or default_out_dir(machine, prefix="gpu-bench")
    plan, absent = speed_plan.plan(out_dir, gpu=gpu, **tools)
    plan = select_stages(parser, plan, args.only, "part")
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"gpu-bench: results in {out_dir}", flush=True)
    for line in absent:
        print(f"gpu-bench: {line}", flush=True)
    env = environment.collect(stages.REPO) if gpu else environment.collect_cpu(stages.REPO)
    (out_dir / "environment.json").write_text(json.dumps(env, indent=1) + "\n")
    results = _run(plan, out_dir, speed_plan.TOTAL_BUDGET_S, started, "gpu-bench")
    text = speed_report.render(
        title=f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.node()}, {machine}",
        results=results, absent=absent, gpu=gpu, seconds=time.monotonic() - started, environment=env,
        command=_command("bench.gpu_check", argv),
    )  # fmt: skip
    (out_dir / "report.md").write_text(text)
    failed = [r.stage.name for r in results if r.failed]
    print(f"gpu-bench: {text.splitlines()[0][len('# zcomm gpu-bench: '):]}; report: {out_dir / 'report.md'}")
    if failed or absent:
        return EXIT_FAILED
    return EXIT_COMPLETE if gpu else EXIT_NO_GPU
