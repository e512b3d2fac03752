"""The cpu backend's small launches run serial builds, whatever numba's on-disk cache holds.

The serial builds are compiled from the same Python code as the parallel kernels, and numba's
cache keys builds by function name, line, signature and bytecode, not by compile flags
([Note: serial cache entries] in ``zcomm.quant.backends.cpu``). Each test runs two fresh
processes on one empty ``NUMBA_CACHE_DIR``: the first compiles (and caches) one kind of build
for the small ops' signatures, the second runs the other kind and reports what it loaded. A
parallel build starts numba's thread pool when it is loaded or first run; a serial one never
does, and carries no parallel reload hook. The two tests' pairs of processes run side by side
(each pair in order, on its own cache folder), started by one module fixture: each child spends
its seconds compiling on one core, so on the 2-core CI machine the second pair takes the
core the waiting test process leaves idle.

Two numba internals are read, in the child processes only: ``numba.np.ufunc.parallel._is_initialized``
(whether numba's pool was started) and a compile result's ``reload_init`` (the hooks a cached build
runs when loaded: a parallel build's starts the pool).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_CHILD = """
import json, sys
import torch
import numba.np.ufunc.parallel as numba_parallel
import zcomm.quant as q
from zcomm.quant.backends import cpu

if sys.argv[1] == "parallel":
    cpu._SERIAL_NUMEL = 0  # every launch through the parallel kernels, at the small sizes
x = torch.randn(1024)
q.reorder_quantize(x, (3, 2, 1, 0), 4, 4, 256)
rows = torch.stack([q.quantize(torch.randn(256), 8, 64) for _ in range(4)])
q.dequant_reduce(rows, 256, 8, 64, divide_by=4)
q.dequant_reduce(rows, 256, 8, 64, requant_chunks=2, requant_bits=4, divide_by=4)
builds = {}
for name in ("_reorder_quantize", "_reduce", "_reduce_requant"):
    for kind, suffix in (("serial", "_serial"), ("parallel", "_kernel")):
        for result in getattr(cpu, name + suffix).overloads.values():
            builds.setdefault(f"{name}:{kind}", []).append(bool(result.reload_init))
print(json.dumps({"pool_started": numba_parallel._is_initialized, "builds": builds}))
"""


def _child(kind: str, cache: Path) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", _CHILD, kind], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


ORDERS = {"serial_after_parallel": ("parallel", "serial"), "parallel_after_serial": ("serial", "parallel")}


def _pair(kinds: tuple[str, str], cache: Path) -> tuple[dict, dict]:
    """The two children, in order, on one empty cache folder."""
    return _child(kinds[0], cache), _child(kinds[1], cache)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict[str, tuple[dict, dict]]:
    """Both orders' pairs of children, run side by side (see the module docstring)."""
    with ThreadPoolExecutor(max_workers=len(ORDERS)) as pool:
        futures = {name: pool.submit(_pair, kinds, tmp_path_factory.mktemp(name)) for name, kinds in ORDERS.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.mark.slow
def test_small_launches_run_serial_builds_after_parallel_ones_were_cached(pairs):
    first, second = pairs["serial_after_parallel"]
    assert first["pool_started"]
    assert all(all(flags) for name, flags in first["builds"].items() if name.endswith(":parallel")), first
    serial = {name: flags for name, flags in second["builds"].items() if name.endswith(":serial")}
    assert len(serial) == 3, second  # every small op ran its serial build
    assert not any(any(flags) for flags in serial.values()), second
    assert not second["pool_started"], second


@pytest.mark.slow
def test_large_launches_run_parallel_builds_after_serial_ones_were_cached(pairs):
    first, second = pairs["parallel_after_serial"]
    assert not first["pool_started"]
    parallel = {name: flags for name, flags in second["builds"].items() if name.endswith(":parallel")}
    assert len(parallel) == 3, second
    assert all(all(flags) for flags in parallel.values()), second
