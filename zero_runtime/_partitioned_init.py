"""``Init``: build a model with every parameter partitioned as soon as its module exists.

Under ``with zero_runtime.Init():`` each module's constructor runs unchanged on every rank
(same code, same seed, so every rank computes the same values, consuming the random stream
exactly as a plain construction does). When the outermost ``__init__`` of a module returns,
each floating parameter of it not yet partitioned keeps only this rank's 1/W slice of its
flattened values (``ceil(numel / W)`` elements, the last rank's zero-padded); the parameter's
``.data`` becomes a placeholder of the full shape holding one NaN (an ``expand`` with zero
strides, no memory), so shape and dtype queries, ``initialize``'s grouping and the memory
estimate see the real parameter while its bytes are 1/W. So the full tensors of only one
module exist at a time: peak memory while building is about the largest module plus 1/W of
the rest (``bench/init_memory.py`` measures it).

[Note: code that touches a partitioned parameter] Models often re-initialize weights after
their modules exist (Hugging Face's ``post_init`` walks every module and draws them again).
Inside the ``Init`` block a ``TorchFunctionMode`` catches every torch call that reads or
writes a partitioned parameter: it all-gathers the parameter's full value (one parameter at
a time), runs the call on it, and cuts this rank's slice back out, so an in-place
initializer draws exactly the random numbers it would draw on the full tensor. Pure
overwrites (``normal_``, ``uniform_``, ``zero_``, ``fill_``, ...) skip the gather. The
gathers are collectives: every rank runs the same construction, so they match. ``.data`` and
``detach()`` return a tracked alias that shares the parameter's slice (so
``p.data.normal_()`` works); any other view of a partitioned parameter (``p[0]``,
``p.view(...)``) is an error, since writes into it could not reach the slice. Outside the
block the placeholder reads as NaN and writes fail: hand the model to
``zero_runtime.initialize``, which gathers one unit at a time while it builds its own layout
(``materialize``), or load weights inside an ``Init`` block.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._pytree import tree_flatten

import zcomm

from .config import ZeroConfig, resolve_config

_ATTR = "_zero_init_shard"

# Calls that only read what the placeholder already has right (shape, dtype, device, flags).
_METADATA = {f"torch.Tensor.{name}" for name in (
    "shape.__get__", "size", "dim", "ndim.__get__", "ndimension", "numel", "nelement", "dtype.__get__",
    "device.__get__", "is_floating_point", "is_complex", "requires_grad.__get__", "requires_grad.__set__",
    "requires_grad_", "layout.__get__", "is_cuda.__get__", "is_cpu.__get__", "is_meta.__get__", "element_size",
    "is_leaf.__get__", "grad.__get__", "grad_fn.__get__", "_version.__get__", "data_ptr", "__hash__",
    "__len__", "names.__get__", "is_sparse.__get__", "is_quantized.__get__", "__setstate__",
    "untyped_storage", "is_contiguous", "stride")}
# In-place calls whose result does not depend on the old values: no gather needed.
_OVERWRITES = {f"torch.Tensor.{name}" for name in (
    "normal_", "uniform_", "zero_", "fill_", "exponential_", "geometric_", "log_normal_", "cauchy_",
    "random_", "bernoulli_")}
# torch.nn.init's initializers, which overwrite their argument whatever it held.
# [Note: initializers that skip] Libraries rebind ``torch.nn.init``'s attributes to wrappers
# (Hugging Face's ``guard_torch_init_functions``), which torch's own dispatch then hands to
# the mode and which may return without writing (a weight flagged as loaded). So a function
# counts as an initializer when it is, at the call, ``torch.nn.init``'s attribute of that
# name; it runs on an uninitialized full tensor, and the result is kept only if the
# parameter's version counter moved (torch's initializers write in place on the tensor
# they get); otherwise the slice stays as it was.
_INITIALIZERS = {"uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                 "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                 "sparse_"}
# Calls that return an alias of the whole parameter: tracked like the parameter itself.
_ALIASES = {"torch.Tensor.data.__get__", "torch.Tensor.detach"}


@dataclass(eq=False)
class _Shard:
    """This rank's slice of one partitioned parameter, shared by the parameter and its aliases."""

    shape: torch.Size
    shard: torch.Tensor  # ceil(numel / W) elements
    placeholder: torch.Tensor
    group: dist.ProcessGroup
    topology: zcomm.Topology | None
    world_size: int
    rank: int

    @property
    def numel(self) -> int:
        return self.shape.numel()

    def bounds(self) -> tuple[int, int]:
        chunk = self.shard.numel()
        lo = min(self.rank * chunk, self.numel)
        return lo, min(lo + chunk, self.numel)

    def gather(self) -> torch.Tensor:
        """The full value (a collective over ``group``)."""
        out = self.shard.new_empty(self.shard.numel() * self.world_size)
        zcomm.all_gather_into_tensor(out, self.shard, group=self.group, topology=self.topology)  # counted
        return out[: self.numel].view(self.shape)

    def cut(self, full: torch.Tensor) -> None:
        lo, hi = self.bounds()
        self.shard[: hi - lo].copy_(full.reshape(-1)[lo:hi])


def is_partitioned(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, _ATTR)


def partitioned_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``model`` still held as ``Init`` slices, each once, in model order."""
    return list(dict.fromkeys(p for p in model.parameters() if is_partitioned(p)))


def materialize(params: Iterable[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Give each ``Init``-partitioned tensor of ``params`` its full value again (collective:
    every rank passes the same tensors in the same order). ``group`` must have the ranks the
    model was built over."""
    for param in params:
        record: _Shard | None = getattr(param, _ATTR, None)
        if record is None:
            continue
        if dist.get_process_group_ranks(group) != dist.get_process_group_ranks(record.group):
            raise ValueError("the model was built under zero_runtime.Init over other ranks than initialize()'s "
                             "group; build it over the same group")
        with torch.no_grad():
            param.data = record.gather()
        delattr(param, _ATTR)


def _partition(param: torch.Tensor, group: dist.ProcessGroup, topology: zcomm.Topology | None) -> None:
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    data = param.data
    chunk = -(-data.numel() // world_size)
    placeholder = torch.full((), float("nan"), dtype=data.dtype, device=data.device).expand(data.shape)
    record = _Shard(shape=data.shape, shard=data.new_zeros(chunk), placeholder=placeholder, group=group,
                    topology=topology, world_size=world_size, rank=rank)
    with torch.no_grad():
        record.cut(data)
    param.data = placeholder
    setattr(param, _ATTR, record)


class _GatherOnUse(TorchFunctionMode):
    """See [Note: code that touches a partitioned parameter]."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _name(func)
        touched = list({id(t): t for t in tree_flatten((args, kwargs))[0]
                        if isinstance(t, torch.Tensor) and is_partitioned(t)}.values())
        if not touched or name in _METADATA:
            return func(*args, **kwargs)
        if name in _ALIASES:
            alias = func(*args, **kwargs)
            setattr(alias, _ATTR, getattr(args[0], _ATTR))
            return alias
        target = args[0] if args else kwargs.get("tensor")  # torch.nn.init dispatches with tensor=...
        overwrite = _overwrites(func, name) and len(touched) == 1 and target is touched[0]
        storages, versions = set(), []
        for tensor in touched:
            record: _Shard = getattr(tensor, _ATTR)
            full = record.placeholder.new_empty(record.shape) if overwrite else record.gather()
            storages.add(full.untyped_storage().data_ptr())
            tensor.data = full
            versions.append(tensor._version)
        try:
            result = func(*args, **kwargs)
        finally:
            with torch.no_grad():
                for tensor, version in zip(touched, versions, strict=True):
                    record = getattr(tensor, _ATTR)
                    if not overwrite or tensor._version != version:  # an initializer that wrote nothing
                        record.cut(tensor.data)                      # keeps the slice it had
                    tensor.data = record.placeholder
        for out in tree_flatten(result)[0]:
            if (isinstance(out, torch.Tensor) and not any(out is t for t in touched)
                    and out.untyped_storage().data_ptr() in storages):
                raise RuntimeError(f"inside zero_runtime.Init, {name} returned a view of a partitioned parameter; "
                                   "writes to it could not reach the parameter's slice. Change the parameter "
                                   "itself with in-place calls (p.normal_(), p.copy_(...), p.data.mul_(...))")
        return result


def _overwrites(func, name: str) -> bool:
    """Whether ``func`` overwrites its first argument whatever it held, or leaves it alone
    (see [Note: initializers that skip])."""
    if name in _OVERWRITES:
        return True
    func_name = getattr(func, "__name__", None)
    return func_name in _INITIALIZERS and (getattr(func, "__module__", None) == "torch.nn.init"
                                           or getattr(torch.nn.init, func_name, None) is func)


@functools.lru_cache(maxsize=None)
def _name(func) -> str:
    return resolve_name(func) or getattr(func, "__qualname__", repr(func))


_ACTIVE: "Init | None" = None


class Init:
    """Context manager: modules constructed inside have their parameters partitioned over
    ``group`` (default: WORLD) as each module's ``__init__`` returns; see the module
    docstring. ``topology`` (default: detected by zcomm, as ``initialize`` does) only
    labels the bytes of ``Init``'s gathers in ``zcomm.comm_stats``. ``config`` (a ``ZeroConfig``, DeepSpeed dict or JSON path; optional) is
    checked to be stage 3, the only stage that keeps parameters partitioned.

    Every rank must construct the same model with the same seed. The model is then meant for
    ``zero_runtime.initialize`` (with the same group's ranks), which builds its layout from
    the slices without gathering the whole model.
    """

    def __init__(self, config: ZeroConfig | Mapping[str, Any] | str | None = None, *,
                 group: dist.ProcessGroup | None = None, topology: zcomm.Topology | None = None) -> None:
        stage = None if config is None else resolve_config(config).stage
        if stage not in (None, 3):
            raise ValueError(f"zero_runtime.Init partitions parameters for stage 3; the config has stage {stage}, "
                             "which keeps every parameter whole")
        self.group = group
        self.topology = topology
        self._depth: dict[int, int] = {}
        self._restore: list[tuple[type, Any]] = []
        self._mode = _GatherOnUse()

    def __enter__(self) -> "Init":
        global _ACTIVE
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized: zero_runtime.Init needs it; call "
                               "init_process_group first")
        if _ACTIVE is not None:
            raise RuntimeError("zero_runtime.Init blocks do not nest")
        self.group = self.group if self.group is not None else dist.group.WORLD
        _ACTIVE = self
        for cls in _subclasses(nn.Module):
            self._wrap(cls)
        self._had_hook = "__init_subclass__" in nn.Module.__dict__
        self._old_hook = nn.Module.__dict__.get("__init_subclass__")
        nn.Module.__init_subclass__ = classmethod(_on_new_subclass)
        self._mode.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        global _ACTIVE
        self._mode.__exit__(exc_type, exc, tb)
        if self._had_hook:
            nn.Module.__init_subclass__ = self._old_hook
        else:
            del nn.Module.__init_subclass__
        for cls, original in reversed(self._restore):
            cls.__init__ = original
        self._restore.clear()
        _ACTIVE = None

    def _wrap(self, cls: type) -> None:
        original = cls.__dict__.get("__init__")
        if original is None or getattr(original, "_zero_init_original", None) is not None:
            return

        @functools.wraps(original)
        def __init__(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            key = id(module)
            depth = self._depth.get(key, 0)
            self._depth[key] = depth + 1
            try:
                original(module, *args, **kwargs)
            finally:
                if depth:
                    self._depth[key] = depth
                else:
                    del self._depth[key]
            if not depth:  # the outermost __init__ of this object has returned
                self._partition_module(module)

        __init__._zero_init_original = original
        cls.__init__ = __init__
        self._restore.append((cls, original))

    def _partition_module(self, module: nn.Module) -> None:
        for param in dict.fromkeys(module.parameters()):
            if param.is_floating_point() and param.numel() and not is_partitioned(param):
                _partition(param, self.group, self.topology)


def _on_new_subclass(cls, **kwargs: Any) -> None:
    if _ACTIVE is not None:
        _ACTIVE._wrap(cls)


def _subclasses(root: type) -> list[type]:
    found, stack = {}, [root]
    while stack:
        cls = stack.pop()
        if cls not in found:
            found[cls] = None
            stack.extend(cls.__subclasses__())
    return list(found)
