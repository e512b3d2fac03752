"""The ordering guarantees of zcomm's two kinds of collectives ([Note: kinds], [Note: worker ordering]).

* A gather (``all_gather_q8``) issued while a reduce-scatter (``reduce_scatter_q4``) is in
  flight completes without waiting for it, and the other way round.
* The calls of one kind complete in program order.

One rank is made deliberately slow: on rank 3 the first kernel of the blocked kind's chain
(``reorder_quantize`` for qgZ, ``quantize`` for qwZ, both the ``cpu`` backend's) waits on an event that the test sets
only after the other kind's call returned. Every other rank's chain of that kind then
waits for rank 3 inside its hops, so the blocked call is in flight everywhere. If the two
kinds shared one worker (or one private group), the other kind's sync call would queue
behind the blocked chain until the event's timeout released it, and the checks below that
the blocked call was not yet complete would fail. Rank 3 releases only after every rank
has looked (a barrier on a gloo group of the test's own): otherwise a rank descheduled
for a few milliseconds on a busy machine would look after the release and find the
blocked call complete.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

import zcomm
from spawn_harness import run_distributed

TOPOLOGY = zcomm.Topology(world_size=4, local_size=2)
SLOW_RANK = 3
RELEASE_TIMEOUT_S = 30.0  # only reached when a call waited for the blocked one (the test then fails)
NUMEL = 4 * 1000


class _Blocker:
    """Makes the first quantization of ``op``'s chain wait for :meth:`release` (on the slow rank).

    The collectives call the ``cpu`` backend's kernels directly: ``reorder_quantize`` (qgZ)
    runs its ``_quantize_into``, ``quantize`` (qwZ) that or, for a small payload, its
    ``_quantize_small_kernel``: both are wrapped, and only a call on the worker of ``op``'s
    kind is held.
    """

    _WRAPPED = ("_quantize_into", "_quantize_small_kernel")

    def __init__(self, op: str, rank: int) -> None:
        from zcomm.quant.backends import cpu

        self.module, self.originals = cpu, {name: getattr(cpu, name) for name in self._WRAPPED}
        self.worker = "zcomm-worker-" + ("reduce" if op == "reorder_quantize" else "gather")
        self.released = threading.Event()
        self.armed = rank == SLOW_RANK

    def __enter__(self) -> _Blocker:
        def blocking(original):  # noqa: ANN001, ANN202
            def blocked(*args):
                if self.armed and threading.current_thread().name.startswith(self.worker):
                    self.armed = False
                    self.released.wait(RELEASE_TIMEOUT_S)
                return original(*args)

            return blocked

        for name, original in self.originals.items():
            setattr(self.module, name, blocking(original))
        return self

    def release(self) -> None:
        self.released.set()

    def __exit__(self, *exc: object) -> None:
        self.released.set()
        for name, original in self.originals.items():
            setattr(self.module, name, original)


def _inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    return torch.randn(NUMEL, generator=gen), torch.randn(NUMEL // 4, generator=gen)


def _reduce(full: torch.Tensor, async_op: bool) -> tuple[torch.Tensor, zcomm.Handle | None]:
    out = torch.empty(full.numel() // 4)
    return out, zcomm.reduce_scatter_q4(out, full, async_op=async_op, topology=TOPOLOGY, pipeline_stages=2)


def _gather(shard: torch.Tensor, async_op: bool) -> tuple[torch.Tensor, zcomm.Handle | None]:
    out = torch.empty(shard.numel() * 4)
    return out, zcomm.all_gather_q8(out, shard, async_op=async_op, topology=TOPOLOGY)


def _other_kind_overtakes(rank: int, blocked_kind: str, looked: dist.ProcessGroup) -> dict:
    """The blocked kind's async call is in flight; the other kind's sync call must still return."""
    full, shard = _inputs(rank)
    expected_reduced, _ = _reduce(full, async_op=False)  # also creates both kinds' groups
    expected_gathered, _ = _gather(shard, async_op=False)
    blocked_call, other_call = (_reduce, _gather) if blocked_kind == "reduce" else (_gather, _reduce)
    blocked_input, other_input = (full, shard) if blocked_kind == "reduce" else (shard, full)
    op = "reorder_quantize" if blocked_kind == "reduce" else "quantize"
    with _Blocker(op, rank) as blocker:
        blocked_out, handle = blocked_call(blocked_input, async_op=True)
        start = time.monotonic()
        other_out, _ = other_call(other_input, async_op=False)
        other_s = time.monotonic() - start
        in_flight = not handle.is_completed()
        dist.barrier(group=looked)
        blocker.release()
        handle.wait()
    if blocked_kind == "reduce":
        results = torch.equal(blocked_out, expected_reduced) and torch.equal(other_out, expected_gathered)
    else:
        results = torch.equal(blocked_out, expected_gathered) and torch.equal(other_out, expected_reduced)
    return {"in_flight": in_flight, "same_results": results, "other_s": other_s}


def _same_kind_keeps_order(rank: int, looked: dist.ProcessGroup) -> dict:
    """Two async reduce-scatters: the second completes only after the first (blocked) one."""
    full, _ = _inputs(rank)
    expected, _ = _reduce(full, async_op=False)
    with _Blocker("reorder_quantize", rank) as blocker:
        first_out, first = _reduce(full, async_op=True)
        second_out, second = _reduce(full, async_op=True)
        time.sleep(0.5)  # time for the second to finish if it did not queue behind the first
        second_waited = not second.is_completed()
        dist.barrier(group=looked)
        blocker.release()
        second.wait()
        first_done_by_then = first.is_completed()
        first.wait()
    same = torch.equal(first_out, expected) and torch.equal(second_out, expected)
    return {"second_waited": second_waited, "first_done_by_then": first_done_by_then, "same_results": same}


def _main(rank: int, world: int) -> list[dict]:
    looked = dist.new_group(backend="gloo")  # used by the test only, never by zcomm's chains
    results = [_other_kind_overtakes(rank, kind, looked) for kind in ("reduce", "gather")]
    dist.barrier()
    results.append(_same_kind_keeps_order(rank, looked))
    return results


@pytest.mark.slow
def test_gathers_do_not_wait_for_reduce_scatters_and_each_kind_keeps_its_order():
    results = run_distributed(_main, 4, timeout=240, pg_timeout=90)
    for rank, (gather_first, reduce_first, ordered) in enumerate(results):
        assert gather_first["in_flight"] and gather_first["same_results"], (rank, gather_first)
        assert reduce_first["in_flight"] and reduce_first["same_results"], (rank, reduce_first)
        assert gather_first["other_s"] < RELEASE_TIMEOUT_S and reduce_first["other_s"] < RELEASE_TIMEOUT_S
        assert ordered == {"second_waited": True, "first_done_by_then": True, "same_results": True}, (rank, ordered)
