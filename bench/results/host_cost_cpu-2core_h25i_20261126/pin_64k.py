"""A 64K quantize (the parallel kernel): pin the caller and the OpenMP worker its first launch starts to one CPU
('same'), two ('split'), or not ('none'); 200 calls, then each thread's CPU ticks and context switches.
``python pin_64k.py MODE``."""
import os, sys, time
import numpy as np, torch
import zcomm.quant as q
def tids(): return {int(t) for t in os.listdir(f"/proc/{os.getpid()}/task")}
x = torch.randn(1 << 16)
before = tids()
out = q.quantize(x, 8, 256)
new = sorted(tids() - before)
mode = sys.argv[1]; main = os.getpid()
if mode == "same":
    for t in (main, *new): os.sched_setaffinity(t, {0})
elif mode == "split":
    os.sched_setaffinity(main, {0}); [os.sched_setaffinity(t, {1}) for t in new]
times = []
for _ in range(200):
    s = time.perf_counter(); q.quantize(x, 8, 256, out=out); times.append(time.perf_counter() - s)
us = np.array(times) * 1e6
print(f"{mode:5s} {os.environ.get('GOMP_SPINCOUNT', os.environ.get('OMP_WAIT_POLICY', 'default')):8s} numba pool {new}: median {np.median(us):.0f} us, blocks of 50 {[int(np.median(us[i:i+50])) for i in range(0, 200, 50)]} load {open('/proc/loadavg').read().split()[0]}")
for t in sorted(tids()):
    s = open(f"/proc/{os.getpid()}/task/{t}/stat").read(); f = s[s.rindex(")")+2:].split()
    st = dict(l.split(":\t") for l in open(f"/proc/{os.getpid()}/task/{t}/status").read().splitlines() if ":\t" in l)
    print("  tid", t, "cpu ticks", int(f[11]) + int(f[12]), "vol", st["voluntary_ctxt_switches"], "invol", st["nonvoluntary_ctxt_switches"])
