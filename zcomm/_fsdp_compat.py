"""What :mod:`zcomm.fsdp` needs from PyTorch FSDP2, private parts included, in one place.

FSDP2 (``torch.distributed.fsdp.fully_shard``) takes custom collectives per module through
the public ``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``, but their
argument types, the abstract classes ``AllGather`` and ``ReduceScatter``, live in the
private ``torch.distributed.fsdp._fully_shard._fsdp_api``. This module imports them (or
stand-ins, when the installed torch lacks them, so that ``import zcomm.fsdp`` still works
and :func:`check_torch` can say why it cannot be used), and wraps a :class:`zcomm.Handle` as
the ``torch.distributed.Work`` that FSDP2 waits on.

What zcomm relies on, read in the sources of torch 2.11 and 2.13 (``_fsdp_collectives.py``)
and pinned by ``tests/collectives/test_fsdp_zeropp.py``:

* the comm objects are called with keyword arguments ``output_tensor``, ``input_tensor``,
  ``group``, ``async_op`` (all-gather) and also ``op`` (reduce-scatter), and ``allocate(size,
  *, dtype, device)`` provides both the all-gather output and the reduce-scatter buffers;
* the all-gather is in place: ``input_tensor`` is ``output_tensor.narrow(0, rank * n, n)``;
* ``foreach_all_gather_copy_out`` waits on the result only if it is an instance of
  ``torch.distributed.Work`` (``isinstance(work, dist.distributed_c10d.Work)``): anything else
  is silently not waited for. :class:`HandleWork` is therefore a Python subclass of
  ``dist.Work`` (the c10d bindings allow it; torch's own tests subclass it the same way);
* the reduce-scatter is always called synchronously (no ``async_op``), its result ignored;
  ``op`` is ``ReduceOp.AVG`` / ``ReduceOp.SUM`` (a ``RedOpType``) or, after
  ``set_gradient_divide_factor(f)``, ``ReduceOp.PREMUL_SUM(1 / f)``, a ``ReduceOp`` whose
  ``.op`` is ``PREMUL_SUM`` and ``.factor`` the Python float ``1 / f``;
* the flat layouts (``foreach_all_gather``, ``foreach_reduce``): a rank's all-gather input is
  the concatenation of its padded shard of every parameter of the unit's parameter group,
  in ``FSDPParamGroup.fsdp_params`` order, each ``padded_sharded_param_size.numel()``
  elements, and row ``r`` of the reduce-scatter input (``world`` rows) is the same for rank
  ``r``'s shards of the gradients, over the parameters that have one in that backward. The
  group is ``FSDPModule._get_fsdp_state()._fsdp_param_group`` (an attribute in 2.11, a
  property over ``_fsdp_param_groups`` in 2.13, None for a unit without parameters); only
  :func:`param_group` reads it;
* HSDP (:mod:`zcomm._fsdp_hsdp`, 2.13's ``foreach_reduce``): on a 1-D mesh,
  ``set_all_reduce_hook(hook)`` makes FSDP2 call ``hook(reduce_output)`` after every
  reduce-scatter of the unit, on its all-reduce stream, before its division after the
  reduce-scatter (if any) and the copy into ``.grad``; the param group's
  ``gradient_divide_factor`` (None unless set) and ``force_sum_reduction_for_comms`` say how
  FSDP2 divides, and ``_all_reduce_hook`` holds the hook (None unless set);
* ``FSDPModule.set_requires_all_reduce(flag)`` (and ``set_requires_gradient_sync``) stores the
  flag as the param group's ``all_reduce_grads``, which torch exposes no getter for
  (:func:`requires_all_reduce` reads it). On a 1-D mesh FSDP2 ignores it: it calls the hook
  on every reduce-scatter, then divides ``reduce_output`` and accumulates it into ``.grad``.
  Its own HSDP, with the flag off, instead adds ``reduce_output`` into a partial sum kept
  across micro-batches (``partial += reduce_output``, the first one kept as it is), leaves
  ``.grad`` alone, and on the next micro-batch with the flag on adds that sum into the new
  ``reduce_output`` (``reduce_output += partial``) before its all-reduce and division.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._contract import Handle

# the first release whose FSDP2 sources were checked against the contract above
MIN_TORCH = (2, 11)
SUPPORTED_TORCH = "torch >= 2.11 (checked against the FSDP2 sources of 2.11 and 2.13)"

try:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    _IMPORT_ERROR: str | None = None
except ImportError as exc:  # an older torch: stand-ins, so that check_torch() can say so
    _IMPORT_ERROR = str(exc)

    class FSDPModule:  # type: ignore[no-redef]
        """Stand-in: nothing is an instance of it."""

    # Plain bases, not ABCs: nothing is abstract in a stand-in (check_torch() refuses this torch
    # before a comm is made), it only lets zcomm.fsdp's classes be defined.
    class AllGather:  # type: ignore[no-redef]
        """Stand-in for torch's abstract all-gather comm."""

    class ReduceScatter:  # type: ignore[no-redef]
        """Stand-in for torch's abstract reduce-scatter comm."""


def torch_problem(version: str = torch.__version__, import_error: str | None = None) -> str | None:
    """Why the installed torch (``version``; ``import_error`` from importing FSDP2's comm API)
    cannot host zcomm's FSDP2 collectives, or None when it can."""
    import_error = _IMPORT_ERROR if import_error is None else import_error
    release = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    if release < MIN_TORCH:
        return f"torch {version} is not supported by zcomm.fsdp; supported: {SUPPORTED_TORCH}"
    if import_error:
        return (
            f"torch {version} has no FSDP2 custom-collective API (FSDPModule, _fsdp_api.AllGather / "
            f"ReduceScatter: {import_error}); supported: {SUPPORTED_TORCH}"
        )
    if not all(hasattr(FSDPModule, name) for name in ("set_custom_all_gather", "set_custom_reduce_scatter")):
        return f"torch {version}'s FSDPModule has no set_custom_all_gather / set_custom_reduce_scatter"
    return None


def param_group(unit: FSDPModule):
    """FSDP2's ``FSDPParamGroup`` of ``unit`` (None for a unit without parameters of its own)."""
    return unit._get_fsdp_state()._fsdp_param_group


def requires_all_reduce(unit: FSDPModule) -> bool:
    """Whether ``unit``'s gradients are to be all-reduced across replicas on this backward:
    False after ``set_requires_all_reduce(False)`` (FSDP2's HSDP accumulation without it)."""
    return param_group(unit).all_reduce_grads


def all_reduce_hook(unit: FSDPModule):
    """The all-reduce hook installed on ``unit`` (None if none, or if it has no parameters)."""
    group = param_group(unit)
    return None if group is None else group._all_reduce_hook


def shard_numels(unit: FSDPModule) -> tuple[int, ...]:
    """Elements of each parameter's padded shard in ``unit``'s flat FSDP2 buffers, in their
    order there (empty for a unit without parameters of its own)."""
    group = param_group(unit)
    if group is None:
        return ()
    return tuple(param.padded_sharded_param_size.numel() for param in group.fsdp_params)


class HandleWork(dist.Work):
    """A :class:`zcomm.Handle` as a ``torch.distributed.Work``: ``wait()`` runs the handle's tail
    (on CUDA: enqueues it on the current stream, as NCCL's ``Work.wait()`` does)."""

    def __init__(self, handle: Handle) -> None:
        super().__init__()
        self._handle = handle

    def wait(self, timeout: object = None) -> bool:
        return self._handle.wait()

    def is_completed(self) -> bool:
        return self._handle.is_completed()


def as_work(result: Handle | dist.Work | None) -> dist.Work | None:
    """What FSDP2 can wait on for a collective's result: torch's own ``Work``, or a zcomm handle wrapped."""
    return HandleWork(result) if isinstance(result, Handle) else result
