"""The parallel build of reorder_quantize at 1K (the cache mix-up, so run it on the tree before the fix with a
cache primed by prime_parallel.py): pin the caller and the OpenMP worker the build starts to one CPU ('same'),
two CPUs ('split'), or not ('none'), then time 300 calls. ``python pin_1k.py MODE``."""
import os, sys, time
import numpy as np, torch
import zcomm.quant as q
from zcomm.quant.backends import cpu
def tids(): return {int(t) for t in os.listdir(f"/proc/{os.getpid()}/task")}
def cpu_of(tid):
    s = open(f"/proc/{os.getpid()}/task/{tid}/stat").read(); return int(s[s.rindex(")")+2:].split()[36])
before = tids()
x = torch.randn(1024); perm = (3, 2, 1, 0)
chunks = q.reorder_quantize(x, perm, 4, 4, 256)
payloads = cpu._zero_padding(chunks, 256, 4)
sources = np.array(((x.data_ptr(),), (1024,), (1024,)), np.int64)
perm_array, like = np.asarray(perm, np.int64), cpu._like(x.dtype)
def kernel(): cpu._reorder_quantize_serial(like, sources, 1024, 1024, perm_array, 4, 256, payloads)
kernel()
new = sorted(tids() - before)  # numba's pool, started by the (parallel) build
main = os.getpid()
mode = sys.argv[1]
if mode == "same":
    for t in (main, *new): os.sched_setaffinity(t, {0})
elif mode == "split":
    os.sched_setaffinity(main, {0}); [os.sched_setaffinity(t, {1}) for t in new]
times, same = [], 0
for i in range(300):
    s = time.perf_counter(); kernel(); times.append(time.perf_counter() - s)
    if new and i % 10 == 0: same += cpu_of(main) == cpu_of(new[0])
us = np.array(times) * 1e6
print(f"{mode}: pool threads {new}, median {np.median(us):.0f} us, blocks of 50 {[int(np.median(us[i:i+50])) for i in range(0, 300, 50)]}, sampled same-cpu {same}/30, load {open('/proc/loadavg').read().split()[0]}")
