"""Peak temporary bytes of each zcomm collective call, as a multiple of its output and input, on CPU.

Run as ``python -m bench.collective_memory`` (``--help``): ``--world-size`` gloo ranks
(``--local-size`` per node) run each case once to warm up (plans, subgroups, workers, kernels),
then once measured; reported is the largest rank's peak. A temporary is a tensor storage a torch
op creates during the call, on the calling thread or zcomm's worker, until it is freed; the
call's input and output and older state (an ``ErrorFeedback``'s stored errors) are not, their
new replacements are. Buffers gloo or numba allocate outside torch are not seen. The counts are
exact bytes, so the machine's load does not change them.

[Note: counting temporaries] A ``TorchDispatchMode`` (:class:`LiveBytes`) sees every op; a
storage seen first as an op's *output* was created by the call, one seen first as an
*argument* existed before. Each created storage's bytes are added to the live total and
subtracted by a finalizer on its storage object, which torch keeps alive exactly as long as
the storage itself (the Python object is preserved with its C++ storage). A dispatch mode is
per thread, so the mode is entered on the caller's thread and around every task queued on a
``ThreadPoolExecutor`` during the call (zcomm's CPU chains run on such a FIFO worker).
"""

from __future__ import annotations

import argparse
import contextlib
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import zcomm
from bench.harness.ranks import spawn
from bench.harness.table import markdown

CASES = ("all_gather_q8", "all_gather_q8_pipelined", "reduce_scatter_q4", "reduce_scatter_q4_pipelined",
         "reduce_scatter_q4_feedback", "reduce_scatter_q4_coalesced")


class LiveBytes(TorchDispatchMode):
    """The live bytes of the storages torch ops created since :meth:`reset`, and their peak
    ([Note: counting temporaries]); shared by every thread that entered it."""

    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self._seen: dict[int, bool] = {}  # id of a live storage object -> created under the mode
        self.live = 0
        self.peak = 0

    def reset(self) -> None:
        with self._lock:
            self.peak = self.live

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._note((args, kwargs), created=False)
        result = func(*args, **(kwargs or {}))
        self._note(result, created=True)
        return result

    def _note(self, tensors, *, created: bool) -> None:
        """Every tensor's storage in ``tensors`` (a pytree) not seen before: the op's output (created) or older."""
        for storage in (leaf.untyped_storage() for leaf in tree_leaves(tensors) if isinstance(leaf, torch.Tensor)):
            key, nbytes = id(storage), storage.nbytes() if created else 0
            with self._lock:
                if key in self._seen:
                    continue
                self._seen[key] = created
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._gone, key, nbytes)

    def _gone(self, key: int, nbytes: int) -> None:
        with self._lock:
            self._seen.pop(key, None)
            self.live -= nbytes


@contextlib.contextmanager
def traced_workers(tracker: LiveBytes):
    """While open, every task queued on a ``ThreadPoolExecutor`` (zcomm's CPU chains run on one per
    group and kind) runs inside ``tracker``: a dispatch mode is per thread ([Note: counting temporaries])."""
    submit = ThreadPoolExecutor.submit

    def traced_submit(self, fn, /, *args, **kwargs):
        def traced(*args, **kwargs):
            with tracker:
                return fn(*args, **kwargs)

        return submit(self, traced, *args, **kwargs)

    ThreadPoolExecutor.submit = traced_submit
    try:
        yield
    finally:
        ThreadPoolExecutor.submit = submit


def measure(call, group: dist.ProcessGroup, tracker: LiveBytes) -> int:
    """Peak temporary bytes of ``call()`` (after one warm-up call), on this rank."""
    call()
    dist.barrier(group)
    with traced_workers(tracker), tracker:
        tracker.reset()
        base = tracker.live
        call()
        return tracker.peak - base


def measure_cuda(call, group: dist.ProcessGroup, device: torch.device) -> int:
    """Peak temporary bytes of ``call()`` (after one warm-up call) on ``device``, by torch's CUDA
    memory statistics: the peak of allocated bytes during the call above what was allocated
    before it (the caching allocator's blocks, in its 512-byte units; every stream of the
    device is synchronized before and after)."""
    call()
    torch.cuda.synchronize(device)
    dist.barrier(group)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    call()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def _cases(rank: int, world: int, topology: zcomm.Topology, numel: int, dtype: torch.dtype,
           device: torch.device | None = None):
    """name -> (call, output bytes, input bytes) on this rank, tensors on ``device`` (default: CPU)."""
    torch.manual_seed(rank)
    on = dict(dtype=dtype, device=device)
    shard, gathered = torch.randn(numel, **on), torch.empty(world * numel, **on)
    full, part = torch.randn(world * numel, **on), torch.empty(numel, **on)
    pieces = [numel // 4, numel // 4, numel - numel // 2]
    ins = [torch.randn(world * n, **on) for n in pieces]
    outs = list(torch.empty(numel, **on).split(pieces))
    avg = dist.ReduceOp.AVG
    gather = partial(zcomm.all_gather_q8, gathered, shard, topology=topology)
    scatter = partial(zcomm.reduce_scatter_q4, part, full, avg, topology=topology)
    cases = {
        "all_gather_q8": (partial(gather, pipeline_stages=1), [gathered], [shard]),
        "all_gather_q8_pipelined": (partial(gather, pipeline_stages=4), [gathered], [shard]),
        "reduce_scatter_q4": (partial(scatter, pipeline_stages=1), [part], [full]),
        "reduce_scatter_q4_pipelined": (partial(scatter, pipeline_stages=4), [part], [full]),
        "reduce_scatter_q4_feedback": (partial(scatter, pipeline_stages=4, error_feedback=zcomm.ErrorFeedback()),
                                       [part], [full]),
        "reduce_scatter_q4_coalesced": (partial(zcomm.reduce_scatter_q4_coalesced, outs, ins, avg, pipeline_stages=4,
                                                topology=topology), outs, ins),
    }
    return {name: (call, sum(t.nbytes for t in out), sum(t.nbytes for t in inp)) for name, (call, out, inp) in cases.items()}


def rank_peaks(rank: int, world: int, local_size: int, numel: int, dtype: torch.dtype, names,
               device: torch.device | None = None) -> dict:
    """{case: (peak temporary bytes, output bytes, input bytes)} of this rank: counted by
    :class:`LiveBytes` on CPU tensors, or by :func:`measure_cuda` on ``device``'s (a CUDA
    device: gpu-check's w4 stage)."""
    cases = _cases(rank, world, zcomm.Topology(world_size=world, local_size=local_size), numel, dtype, device)
    cuda = device is not None and device.type == "cuda"
    peak = partial(measure_cuda, device=device) if cuda else partial(measure, tracker=LiveBytes())
    return {name: (peak(cases[name][0], dist.group.WORLD), *cases[name][1:]) for name in names}


def run(*, world: int, local_size: int, numel: int, dtype: torch.dtype, names=CASES, timeout: float = 600) -> dict:
    """{case: (peak temporary bytes, output bytes, input bytes)}, the largest rank's peak per case."""
    names = tuple(names)
    per_rank = spawn(rank_peaks, world, local_size, numel, dtype, names, timeout=timeout)
    return {name: max((found[name] for found in per_rank), key=lambda row: row[0]) for name in names}


def table(results: dict) -> str:
    return "\n".join(markdown([{"call": name, "peak temporary bytes": f"{peak:,}", "x output": peak / out_bytes,
                                "x input": peak / in_bytes} for name, (peak, out_bytes, in_bytes) in results.items()]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--local-size", type=int, default=2)
    parser.add_argument("--numel", type=int, default=1 << 18, help="elements of each rank's shard (gather input, "
                        "reduce-scatter output)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    args = parser.parse_args(argv)
    results = run(world=args.world_size, local_size=args.local_size, numel=args.numel,
                  dtype=getattr(torch, args.dtype))
    print(f"world {args.world_size} ({args.world_size // args.local_size} nodes x {args.local_size}), "
          f"{args.numel} {args.dtype} elements per shard")
    print(table(results))


if __name__ == "__main__":
    main()
