"""A process's resident memory as the memory benchmarks read it (``bench.init_memory``,
``bench.offload_oom``), and the allocator setting they run their ranks with.

[Note: glibc's mmap threshold] glibc serves an allocation above its ``mmap`` threshold with
its own mapping, returned to the system when freed; below it, from its heap, whose freed
blocks mostly stay resident. The threshold is dynamic by default: freeing a mapped block
raises it up to 32 MiB, so after a while tensors of up to 32 MiB (a transformer block's
shards) come from the heap and stay resident once freed. A peak or a cgroup limit then
measures the allocator's history more than the tensors alive. The benchmarks fix the
threshold at 128 KiB in their ranks (``MALLOC_ENV``), so freed tensors leave the resident set.
"""

from __future__ import annotations

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def status_bytes(field: str) -> int:
    """``field`` of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...) in bytes."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")
