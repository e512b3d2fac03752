"""Fill the kernel disk cache ahead of time: ``python -m zcomm_cuda.build [--arch sm_90 ...] [--cache-dir D]``.

Compiles every kernel source for every arch named (by default the archs of this machine's
GPUs) into the disk cache ([Note: kernel cache] in _disk_cache.py) that the loader reads:
the same compile, options and key as a first launch would make, so that the ranks of a job
find every module built. It needs cupy and an NVRTC library, no GPU: run it in a container
build with ``ZCOMM_CACHE_DIR`` pointing into the image (and the same
``ZCOMM_CUDA_DEVICE_CHECKS`` the jobs will run with). Sources compile in parallel threads,
one per CPU. It prints, per source and arch, whether it was compiled or found and how long
that took (on the clock, and on the CPU: the work, whatever else the machine runs), then the
total.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

from . import _disk_cache, loader
from .availability import nvrtc_problem

_ARCH = re.compile(r"(sm|compute)_(\d+)")


def _local_archs() -> list[str]:
    import torch

    if not torch.cuda.is_available():
        return []
    return sorted({loader.device_arch(index) for index in range(torch.cuda.device_count())})


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m zcomm_cuda.build", description=__doc__.split("\n\n")[1])
    parser.add_argument("--arch", nargs="+", action="extend", default=[],
                        help="targets, e.g. sm_90 (a cubin) or compute_90 (PTX); default: this machine's GPUs")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"the cache folder (default: ${_disk_cache.CACHE_DIR_ENV}, else $XDG_CACHE_HOME/zcomm "
                             "or ~/.cache/zcomm)")
    parser.add_argument("--sources", nargs="+", choices=loader.KERNEL_SOURCES, default=list(loader.KERNEL_SOURCES))
    parser.add_argument("--jobs", type=int, default=None, help="parallel compiles (default: one per CPU)")
    args = parser.parse_args(argv)
    problem = nvrtc_problem()
    if problem is not None:
        parser.error(problem)
    from cupy.cuda import nvrtc

    supported = nvrtc.getSupportedArchs()
    for arch in args.arch:
        match = _ARCH.fullmatch(arch)
        if match is None or int(match.group(2)) not in supported:
            parser.error(f"--arch {arch}: NVRTC {'.'.join(map(str, nvrtc.getVersion()))} compiles sm_N or compute_N "
                         f"for N in {', '.join(map(str, supported))}")  # fmt: skip
    if not args.arch:
        args.arch = _local_archs()
        if not args.arch:
            parser.error("this machine has no GPU: name the targets, e.g. --arch sm_90")
    if args.jobs is not None and args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    from cupy.cuda import nvrtc

    directory = args.cache_dir if args.cache_dir is not None else _disk_cache.cache_dir()
    options = loader.nvrtc_options()
    print(f"zcomm kernel cache {directory / 'kernels'}: NVRTC {'.'.join(map(str, nvrtc.getVersion()))}, "
          f"options {' '.join(options)}")  # fmt: skip
    start = time.perf_counter()
    workers = args.jobs or len(os.sched_getaffinity(0))
    done = loader.fill(args.sources, args.arch, options, directory, workers)
    total = time.perf_counter() - start
    for job in done:
        state = "compiled" if job.fetched.compiled else "found"
        print(f"  {state:8} {job.source:22} {job.arch:12} {job.seconds:7.2f} s ({job.cpu_seconds:6.2f} s CPU)  "
              f"{job.fetched.path.name}")  # fmt: skip
    compiled = sum(job.fetched.compiled for job in done)
    cpu = sum(job.cpu_seconds for job in done)
    print(f"{len(done)} modules ({compiled} compiled, {len(done) - compiled} found) in {total:.2f} s "
          f"({cpu:.2f} s CPU, {min(workers, len(done))} threads)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
