"""Run a function on ``world_size`` new processes joined in a gloo process group.

``run_distributed(fn, world_size)`` spawns the ranks, each of which initializes
torch.distributed through a TCPStore that the parent hosts on 127.0.0.1 (a free port),
calls ``fn(rank, world_size, *args)`` and reports its return value (picklable) or its
traceback. The parent returns the results in rank order, or raises
:class:`DistributedFailure` with every failing rank's traceback, or a ``TimeoutError``
after killing the ranks when ``timeout`` passes. Spawning costs seconds per process, so
tests run many sub-cases inside one ``fn``.

[Note: teardown] The ranks skip ``destroy_process_group`` and leave with ``os._exit``
after a store barrier: a test may have killed a peer on purpose, and tearing down a
broken gloo group can hang; the barrier keeps a fast rank from closing its sockets while a
peer still reads from them.

[Note: forkserver ranks] The ranks are forked from multiprocessing's fork server, started once per
test session, which has imported torch, torch.distributed and FSDP2's modules (2.3 s of CPU per
rank, most of a rank's start, that the 2-core CI machine paid for every rank of every spawn),
and Hugging Face's GPT-2 when transformers is installed (2.1 s more in each rank of the runtime
tests that train it). Nothing else is preloaded: zcomm and zero_runtime import numba, which
reads environment variables when imported (a test may set ``NUMBA_NUM_THREADS`` for its ranks),
so each rank imports them itself (0.4 s) as a spawned rank did. The fork server touches no
device and starts no thread; each rank gets the parent's environment of the moment of the call
(as a spawned process has), then ``env``.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from collections.abc import Callable, Collection, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

_DONE_KEY = "spawn_harness/done"
# Imported once, in the fork server: nothing that reads the environment a test sets ([Note: forkserver ranks]).
# A module that is not installed is left out (the fork server ignores its ImportError).
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.device_mesh",
            "torch.multiprocessing", "transformers", "transformers.models.gpt2.modeling_gpt2"]


class DistributedFailure(RuntimeError):
    """One or more ranks raised; the message holds their tracebacks."""


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    env: Mapping[str, str] | None = None,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    may_exit: Collection[int] = (),
) -> list[Any]:
    """Results of ``fn(rank, world_size, *args)`` on each rank (``None`` for ranks in ``may_exit`` that left).

    ``env`` is set in every rank before torch.distributed starts; ``pg_timeout`` seconds is
    the process group's timeout; ``may_exit`` names ranks allowed to exit without reporting.
    """
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)  # read when the server starts (the session's first call)
    results_queue = context.Queue()
    settings = (world_size, store.port, {**os.environ, **(env or {})}, pg_timeout, world_size - len(may_exit))
    procs = [
        context.Process(target=_rank_main, args=(rank, settings, fn, args, results_queue), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        reports = _collect(procs, results_queue, set(may_exit), time.monotonic() + timeout)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    errors = [f"--- rank {rank} ---\n{text}" for rank, (ok, text) in sorted(reports.items()) if not ok]
    if errors:
        raise DistributedFailure("\n".join(errors))
    return [reports[rank][1] if rank in reports else None for rank in range(world_size)]


def _collect(procs: list, results_queue: Any, may_exit: set[int], deadline: float) -> dict[int, tuple[bool, Any]]:
    """Gather (ok, result-or-traceback) per rank until all expected ranks reported or one crashed."""
    reports: dict[int, tuple[bool, Any]] = {}
    while True:
        missing = [r for r in range(len(procs)) if r not in reports and r not in may_exit]
        if not missing:
            return reports
        crashed = [r for r in missing if procs[r].exitcode is not None]
        try:
            rank, ok, payload = results_queue.get(timeout=0.2)
            reports[rank] = (ok, payload)
            continue
        except queue.Empty:
            pass
        if crashed:
            for rank in crashed:
                reports.setdefault(rank, (False, f"exited with code {procs[rank].exitcode} without a result"))
            continue
        if time.monotonic() > deadline:
            for proc in procs:
                proc.kill()
            raise TimeoutError(f"ranks {missing} did not finish in time (reported: {sorted(reports)})")


def _rank_main(rank: int, settings: tuple, fn: Callable[..., Any], args: tuple, results_queue: Any) -> None:
    world_size, port, env, pg_timeout, finishers = settings
    os.environ.clear()  # the caller's environment, not the fork server's ([Note: forkserver ranks])
    os.environ.update(env)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=pg_timeout))
    try:
        timeout = timedelta(seconds=pg_timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        report = (rank, True, fn(rank, world_size, *args))
    except BaseException:
        report = (rank, False, traceback.format_exc())
    results_queue.put(report)
    results_queue.close()
    results_queue.join_thread()
    _barrier(store, finishers, deadline=time.monotonic() + pg_timeout)
    os._exit(0)


def _barrier(store: dist.TCPStore, count: int, deadline: float) -> None:
    arrived = store.add(_DONE_KEY, 1)
    while arrived < count and time.monotonic() < deadline:
        time.sleep(0.05)
        arrived = store.add(_DONE_KEY, 0)
