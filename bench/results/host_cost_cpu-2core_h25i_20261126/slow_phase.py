"""The ~6 ms mode of a small serial kernel call (NOTES.md, "Open"): per-call median/p90 in us.

Run as ``PYTHONPATH=<tree> python slow_phase.py`` several times, with and without ``OMP_*``
variables: the raw serial numba kernel of reorder_quantize at 1K elements, the backend
function, the public op, then the raw kernel again, 200 calls each.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

import zcomm.quant as q
from zcomm.quant.backends import cpu


def run(name: str, call: Callable[[], object], n: int = 200) -> str:
    call()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    times.sort()
    return f"{name} {times[n // 2] * 1e6:.0f}/{times[n * 9 // 10] * 1e6:.0f}"


def main() -> None:
    x = torch.randn(1024)
    perm = (3, 2, 1, 0)
    chunks = q.reorder_quantize(x, perm, 4, 4, 256)
    payloads = cpu._zero_padding(chunks, 256, 4)
    sources = np.array(((x.data_ptr(),), (1024,), (1024,)), np.int64)
    perm_array, like = np.asarray(perm, np.int64), cpu._like(x.dtype)

    def kernel() -> None:
        cpu._reorder_quantize_serial(like, sources, 1024, 1024, perm_array, 4, 256, payloads)

    print([run("serial", kernel), run("backend", lambda: cpu.reorder_quantize([x], 1, 1024, perm, 4, 4, 256, chunks)),
           run("public", lambda: q.reorder_quantize(x, perm, 4, 4, 256, out=chunks)), run("serial", kernel)])


if __name__ == "__main__":
    main()
