"""The tensors of zcomm's gloo hops, kept until gloo has let go of them, and waited for at exit.

[Note: hop release] A gloo hop's ``Work`` holds the hop's tensors, and gloo's worker thread
drops its own reference to the ``Work`` only after running it: often after the chain's
``wait()`` has returned and the chain has dropped its reference. The ``Work``'s destructor then
runs on gloo's thread, and releasing a tensor that has a Python object there takes the GIL
(torch keeps a tensor's Python object alive while C++ holds the tensor). If the interpreter
has begun finalizing by then (the chain was the program's last collective, and the main
thread reached its end before gloo's thread got the GIL), CPython ends the thread that asks
for the GIL with ``pthread_exit``, whose forced unwind through the destructor
(``noexcept``) calls ``std::terminate``: the process aborts with "terminate called without
an active exception" after finishing its work. torch's ``destroy_process_group()`` does not
prevent it: gloo's threads run until the group objects are freed, and the plans and
prepared calls the caller holds keep zcomm's subgroups.

So a CPU chain hands its tensors to gloo through :func:`start_hop`, which notes each with
its C++ use count from before the hop. When the chain has run, :func:`settle` drops those
gloo has let go of (the count back down) and keeps the others, with any still kept from
earlier chains, until a later chain's end finds them let go. Nothing waits there: a chain's
handle completes as soon as its work is done, and what is kept is what gloo holds anyway.
At exit, :func:`_wait_for_gloo` (an ``atexit`` handler: it runs after the chains' workers
have been joined and before the interpreter finalizes, so gloo's threads can still take the
GIL) waits, with the GIL released, until gloo has let go of every kept tensor: the last
release of each then happens while the interpreter is whole.
"""

from __future__ import annotations

import atexit
import sys
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from ._torch_compat import tensor_use_count

# hop tensors gloo still held when their chain ended, with their use counts from before the hop
_KEPT: list[tuple[torch.Tensor, int]] = []
_KEPT_LOCK = threading.Lock()
_POLL_S = 1e-4
_EXIT_WAIT_S = 30.0  # gloo releases a finished Work within milliseconds; this bounds a wait that never ends


class _ChainHops(threading.local):
    """The hop tensors (with their use counts before the hop) of the chain running on this thread."""

    def __init__(self) -> None:
        self.hops: list[tuple[torch.Tensor, int]] = []


_CHAIN = _ChainHops()


def start_hop(
    collective: Callable[..., dist.Work], received: torch.Tensor, send: torch.Tensor, group: dist.ProcessGroup
) -> dist.Work:
    """``collective(received, send, group=group, async_op=True)``; on CPU, the two tensors are noted for
    :func:`settle` ([Note: hop release])."""
    if not received.is_cuda:
        # [Note: hop tensors go with their hop] the earlier hops' tensors gloo has let go of are
        # dropped here, not at the chain's end: what the chain still uses it holds itself, and a
        # chain of many hops (a pipelined collective) never holds every hop's buffers at once
        hops = _CHAIN.hops
        if hops:
            hops[:] = [(tensor, before) for tensor, before in hops if tensor_use_count(tensor) > before]
        hops += ((received, tensor_use_count(received)), (send, tensor_use_count(send)))
    return collective(received, send, group=group, async_op=True)


def settle() -> None:
    """After a chain on this thread: keep its hop tensors gloo still holds, drop the rest, and drop the
    tensors kept from earlier chains that gloo has let go of since."""
    hops = _CHAIN.hops
    if hops or _KEPT:
        with _KEPT_LOCK:
            _KEPT[:] = [(tensor, before) for tensor, before in (*_KEPT, *hops) if tensor_use_count(tensor) > before]
        hops.clear()


@atexit.register
def _wait_for_gloo() -> None:
    """Wait (GIL released) until gloo has let go of every kept hop tensor, then drop them ([Note: hop release])."""
    deadline = time.monotonic() + _EXIT_WAIT_S
    with _KEPT_LOCK:
        kept = list(_KEPT)
        _KEPT.clear()
    held = [(tensor, before) for tensor, before in kept if not _let_go(tensor, before, deadline)]
    if held:
        print(f"zcomm: gloo still held {len(held)} hop tensors {_EXIT_WAIT_S:.0f} s into the exit; the interpreter "
              f"may abort when its threads release them", file=sys.stderr)  # fmt: skip


def _let_go(tensor: torch.Tensor, before: int, deadline: float) -> bool:
    while tensor_use_count(tensor) > before:
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)  # with the GIL released: gloo's thread needs it to release the tensor
    return True
