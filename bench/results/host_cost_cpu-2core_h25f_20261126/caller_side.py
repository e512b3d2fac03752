"""Caller-side host cost of all_gather_q8, reduce_scatter_q4 and reduce_scatter_q4_coalesced (x4).

Each collective's hand-off of its chain (``run_chain``) is replaced by a no-op after one real
call, so what is timed is only the caller's thread: the prologue cache, the plan lookup, the
key and the call's own work, where the per-group caches live. Timed in CPU time of the calling
thread (``time.thread_time``), which a loaded machine does not inflate the way it inflates
wall time: 7 rounds of 20,000 calls, the median and the minimum round printed.

    PYTHONPATH=<tree> python bench/results/host_cost_cpu-2core_h25f_20261126/caller_side.py
"""

import importlib
import statistics
import time

import torch
import torch.distributed as dist

import zcomm

gather_module = importlib.import_module("zcomm.all_gather_q8")
reduce_module = importlib.import_module("zcomm.reduce_scatter_q4")
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
x, out = torch.randn(1024), torch.empty(1024)
inputs = [torch.randn(n) for n in (100, 200, 300, 424)]
outputs = list(torch.empty(1024).split([100, 200, 300, 424]))
zcomm.all_gather_q8(out, x)
zcomm.reduce_scatter_q4(out, x)
zcomm.reduce_scatter_q4_coalesced(outputs, inputs)
gather_module.run_chain = reduce_module.run_chain = lambda *args, **kwargs: None
calls = {
    "all_gather_q8": lambda: zcomm.all_gather_q8(out, x),
    "reduce_scatter_q4": lambda: zcomm.reduce_scatter_q4(out, x),
    "reduce_scatter_q4_coalesced x4": lambda: zcomm.reduce_scatter_q4_coalesced(outputs, inputs),
}
N = 20000
for name, call in calls.items():
    rounds = []
    for _ in range(7):
        start = time.thread_time()
        for _ in range(N):
            call()
        rounds.append((time.thread_time() - start) / N * 1e6)
    print(f"{name:32s} median {statistics.median(rounds):6.2f} us  min {min(rounds):6.2f} us")
dist.destroy_process_group()
