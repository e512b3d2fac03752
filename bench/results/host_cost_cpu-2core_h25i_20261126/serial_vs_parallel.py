"""The reorder_quantize kernel (INT8, groups of 256, 4 chunks, identity order) serial and parallel, by size.

Best case for the parallel build: the caller and the OpenMP worker pinned to two different CPUs
(``split``) or not pinned (``none``); median us of 200 calls per size. ``python serial_vs_parallel.py MODE``.
"""

import os
import sys
import time

import numpy as np
import torch

import zcomm.quant as q
from zcomm.quant.backends import cpu


def tids() -> set[int]:
    return {int(t) for t in os.listdir(f"/proc/{os.getpid()}/task")}


def median_us(call, n: int = 200) -> float:
    call()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e6)


def main() -> None:
    before = tids()
    cpu._use_thread_share()  # starts the OpenMP worker the parallel build uses
    q.quantize(torch.randn(1 << 15), 8, 256)
    workers = sorted(tids() - before)
    if sys.argv[1] == "split":
        os.sched_setaffinity(os.getpid(), {0})
        for t in workers:
            os.sched_setaffinity(t, {1})
    rows = []
    for numel in (1 << 12, 1 << 14, 1 << 16, 1 << 18):
        x = torch.randn(numel)
        out = q.reorder_quantize(x, (0, 1, 2, 3), 4, 8, 256)
        payloads = cpu._zero_padding(out, numel // 4, 8)
        sources = np.array(((x.data_ptr(),), (numel,), (numel,)), np.int64)
        args = (cpu._like(x.dtype), sources, numel, numel, np.arange(4, dtype=np.int64), 8, 256, payloads)
        serial = median_us(lambda: cpu._reorder_quantize_serial(*args))
        parallel = median_us(lambda: cpu._reorder_quantize_kernel(*args))
        rows.append(f"{numel // 1024}K serial {serial:.0f} parallel {parallel:.0f}")
    print(sys.argv[1], "workers", workers, "|", "; ".join(rows), "| load", open("/proc/loadavg").read().split()[0])


if __name__ == "__main__":
    main()
