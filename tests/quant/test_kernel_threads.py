"""The ``cpu`` backend's kernels use the rank's share of threads, on zcomm's worker threads too.

A spawned 4-rank run (2 nodes x 2 ranks, so qgZ's re-quantizing kernel runs as well) with
a numba pool of 4 threads in every rank: rank ``r`` sets ``torch.set_num_threads(1 + r % 3)``.
Every kernel launch is recorded (launching thread, numba's thread count for that launch,
and the highest numba thread id a parallel probe launched right after sees), first with
the default (torch's count), then with ``ZCOMM_NUM_THREADS=2``. Before the fix every launch
used the whole pool.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zcomm
from spawn_harness import run_distributed
from zcomm.quant._threads import NUM_THREADS_VARIABLE, kernel_threads

POOL = 4
KERNELS = ("_reorder_quantize_kernel", "_dequantize_kernel", "_reduce_kernel", "_reduce_requant_kernel")
# the serial builds, which small jobs run ([Note: small serial launches]), by parallel kernel
SERIAL = {name: name.replace("_kernel", "_serial") for name in KERNELS if name != "_dequantize_kernel"}


def _record_launches(seen: list) -> None:
    """Wrap the cpu backend's kernels so each launch appends (kernel, thread, numba threads, max thread id)."""
    import numba
    import numpy as np
    from numba import njit, prange

    from zcomm.quant.backends import cpu

    @njit(parallel=True)
    def max_thread_id(n):
        ids = np.zeros(n, np.int64)
        for i in prange(n):
            ids[i] = numba.get_thread_id()
        return ids.max()

    def recording(name, kernel):
        def launch(*args):
            import threading

            seen.append((name, threading.current_thread().name, numba.get_num_threads(), int(max_thread_id(1 << 14))))
            return kernel(*args)

        return launch

    for name in (*KERNELS, *SERIAL.values()):
        setattr(cpu, name, recording(name, getattr(cpu, name)))


def _run_collectives(world: int) -> None:
    topology = zcomm.Topology(world_size=world, local_size=2)
    rank = torch.distributed.get_rank()
    x = torch.randn(world * 4096)
    out = torch.empty(4096)
    zcomm.reduce_scatter_q4(out, x, topology=topology, pipeline_stages=2)
    handle = zcomm.all_gather_q8(torch.empty(world * 4096), out, topology=topology, async_op=True)
    handle.wait()
    assert out.abs().sum() > 0, rank


def _threads_main(rank: int, world: int) -> dict:
    import numba

    assert numba.config.NUMBA_NUM_THREADS == POOL
    seen: list = []
    _record_launches(seen)
    torch.set_num_threads(1 + rank % 3)
    _run_collectives(world)
    by_default = list(seen)
    seen.clear()
    os.environ[NUM_THREADS_VARIABLE] = "2"
    _run_collectives(world)
    zcomm.quant.quantize(torch.randn(1 << 15), 8, 32)  # a direct call, on this (main) thread, large enough to run parallel
    return {"default": by_default, "explicit": list(seen)}


@pytest.mark.slow
def test_kernels_use_the_ranks_share_of_threads_on_the_worker():
    results = run_distributed(_threads_main, 4, env={"NUMBA_NUM_THREADS": str(POOL)}, timeout=300)
    for rank, result in enumerate(results):
        share = 1 + rank % 3
        launched = {name for name, *_ in result["default"]}
        # every kernel ran, serially or in parallel (by size), and every parallel launch used the share
        assert {name.replace("_serial", "_kernel") for name in launched} == set(KERNELS), (rank, launched)
        parallel = [launch for launch in result["default"] if launch[0] in KERNELS]
        for name, thread, threads, max_id in parallel:
            assert thread.startswith("zcomm-worker"), (rank, name, thread)
            assert threads == share and max_id < share, (rank, name, threads, max_id)
        *collective, direct = result["explicit"]
        assert {name.replace("_serial", "_kernel") for name, *_ in collective} == set(KERNELS)
        explicit = [launch for launch in result["explicit"] if launch[0] in KERNELS]
        assert explicit, (rank, result)
        assert all(threads == 2 and max_id < 2 for _, _, threads, max_id in explicit), (rank, result)
        assert direct[:2] == ("_reorder_quantize_kernel", "MainThread"), direct


_FIRST_KERNEL_ON_MAIN = """
import torch, zcomm.quant as q
torch.set_num_threads(1)
torch.randn(1 << 20).sum()  # torch's own parallel work first, as in any training step
before = torch.get_num_threads()
q.quantize(torch.randn(1 << 15), 8, 32)  # parallel (a small one runs serially)
print(before, torch.get_num_threads())
"""


def test_first_kernel_leaves_torchs_thread_count_alone():
    """numba's omp layer sets its starting thread's OpenMP count to the pool size; zcomm puts torch's back."""
    env = dict(os.environ, NUMBA_NUM_THREADS=str(POOL), PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    env.pop(NUM_THREADS_VARIABLE, None)
    done = subprocess.run([sys.executable, "-c", _FIRST_KERNEL_ON_MAIN], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "1"]


def test_thread_share_follows_torch_capped_at_the_pool(monkeypatch):
    monkeypatch.delenv(NUM_THREADS_VARIABLE, raising=False)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        assert kernel_threads(8) == 3
        assert kernel_threads(2) == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("value", "message"), [("two", "not an integer"), ("0", "must be >= 1"), ("9", "exceeds")])
def test_explicit_thread_count_is_validated(monkeypatch, value, message):
    monkeypatch.setenv(NUM_THREADS_VARIABLE, value)
    with pytest.raises(ValueError, match=message):
        kernel_threads(8)
    monkeypatch.setenv(NUM_THREADS_VARIABLE, " 5 ")
    assert kernel_threads(8) == 5
