"""How many CPU threads zcomm's kernels may use: the rank's share of the machine.

Several ranks usually share one machine, and each already owns a share of its cores:
torchrun sets ``OMP_NUM_THREADS`` (1 by default with several ranks per node), and torch's
``torch.get_num_threads()`` follows it (or ``torch.set_num_threads``). A CPU kernel that
spread over all the machine's cores in every rank would oversubscribe them, and ranks that
spin against each other slow every collective down several times. So zcomm's parallel CPU
kernels use the rank's share:

* ``ZCOMM_NUM_THREADS``, when set, is an explicit count (a positive integer);
* otherwise ``torch.get_num_threads()``, read at every kernel call, so a later
  ``torch.set_num_threads`` is followed too.
"""

from __future__ import annotations

import threading

import torch

from ._env import positive_int_from_env

NUM_THREADS_VARIABLE = "ZCOMM_NUM_THREADS"
# the numba thread count use_thread_share last set, per Python thread
_THREAD_STATE = threading.local()
_NUMBA = None  # the numba module, once a kernel has been launched


def kernel_threads(pool_size: int) -> int:
    """Threads for one kernel launch from a backend whose thread pool holds ``pool_size`` threads.

    ``$ZCOMM_NUM_THREADS`` if set (``ValueError`` unless a positive integer no larger than
    the pool), else ``torch.get_num_threads()`` capped at the pool.
    """
    count = positive_int_from_env(NUM_THREADS_VARIABLE, "threads")
    if count is None:
        return max(1, min(torch.get_num_threads(), pool_size))
    if count > pool_size:
        raise ValueError(
            f"${NUM_THREADS_VARIABLE}={count} exceeds the kernels' thread pool of {pool_size} threads "
            "(numba's NUMBA_NUM_THREADS, by default the machine's cores): lower it or raise NUMBA_NUM_THREADS"
        )
    return count


def use_thread_share() -> None:
    """Set numba's thread count, on the calling thread, to the rank's share (``kernel_threads``).

    See [Note: kernel threads] in ``zcomm.quant.backends.cpu``: numba's count is per Python
    thread, so call this right before every parallel numba launch; starting numba's pool may
    change torch's count on this thread, which is put back. numba's setter costs a few
    microseconds (a lock and checks), so it runs only when the count differs from the one
    this function last set on this thread (``numba.set_num_threads`` called elsewhere on the
    same thread is not seen: zcomm's kernels own numba's count on the threads that launch them).
    """
    numba = _NUMBA or _import_numba()
    count = kernel_threads(numba.config.NUMBA_NUM_THREADS)
    if getattr(_THREAD_STATE, "count", None) == count:
        return
    torch_threads = torch.get_num_threads()
    numba.set_num_threads(count)  # starts numba's pool on first use
    _THREAD_STATE.count = count
    if torch.get_num_threads() != torch_threads:
        torch.set_num_threads(torch_threads)


def _import_numba():  # noqa: ANN202 (the module)
    """numba, imported on the first launch: importing zcomm must not start numba (it reads NUMBA_* at import)."""
    global _NUMBA
    import numba

    _NUMBA = numba
    return numba
