"""The kernel contract: the five ``zcomm::`` operators every backend implements, defined once.

Each operator is defined with ``torch.library.Library.define`` from the schema in
:data:`SCHEMAS` and dispatched by torch on the device type of its tensors: the ``CPU``
kernel is the ``cpu`` backend's (numba), the ``CUDA`` kernel the ``cuda`` backend's
(:mod:`zcomm_cuda`). The same five schemas are defined a second time in the
``zcomm_reference`` namespace, whose ``CPU`` and ``CUDA`` kernels are both the ``reference``
backend's (plain torch, the oracle): ``torch.ops.zcomm_reference.<name>`` is the oracle
called directly. Each op's preconditions function below is its fake (meta) implementation
(``register_fake``), so FakeTensor, ``torch.compile`` and ``torch.library.opcheck`` see every
op with the shapes it promises.

[Note: validation at the boundary] The public functions of :mod:`zcomm.quant.ops` validate
the caller's arguments once (``TypeError``/``ValueError``), allocate the outputs and call
these ops; an eager call goes straight to the backend's kernel, which does not check again.
The preconditions run when an op is traced (fake tensors, ``torch.compile``, ``opcheck``),
where they state and assert the contract. ``torch.ops.zcomm.*`` is thus an internal
interface: calling it directly with arguments that break the contract is undefined (a
kernel may write out of bounds), as for any unchecked kernel.

Every op writes its result into the preallocated ``out`` (the one argument it mutates, fully
written, payload padding included) and returns nothing. Common preconditions:

* every tensor is contiguous, on one device, and non-empty;
* ``bits`` is 8 or 4 and ``group_size`` an int >= 2, even for INT4 (a
  :class:`~zcomm.quant.spec.QuantSpec` with ``"tensor"`` already resolved to an int);
* float tensors are fp32, bf16 or fp16; payloads are ``uint8`` rows of
  ``payload_nbytes(numel, bits, group_size)`` bytes laid out as in
  :mod:`zcomm.quant.wire_format`, whose arithmetic every kernel follows to the bit.

[Note: backend dispatch] torch picks the kernel from the device type of the tensors, so
the backend name is not part of any schema. Each device type has one native backend (``cpu``
for CPU tensors, ``cuda`` for CUDA tensors) behind ``torch.ops.zcomm``; the ``reference``
backend runs on both and lives in its own namespace, ``torch.ops.zcomm_reference``. The public
functions choose the namespace (their ``backend=`` argument, then ``ZCOMM_BACKEND``, then the
device; :func:`zcomm.quant._registry.select`). The kernel registered for a dispatch key is a
trampoline that looks up the function the backend registered with :func:`implements`,
importing the backend on first use; a backend that cannot load raises
``BackendUnavailableError``, and no other backend stands in. Under ``torch.compile`` the
namespace is fixed when the graph is traced.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence, TypeVar

import torch
from torch import Tensor

from . import _registry
from .spec import SUPPORTED_BITS
from .wire_format import SUPPORTED_DTYPES, payload_nbytes

Kernel = TypeVar("Kernel", bound=Callable[..., None])

# [Note: interleaved input] reorder_quantize reads a list of tensors as the rank-major
# interleaving a coalesced reduce-scatter needs (part r of the input = every tensor's r-th
# shard, one after another), zero-filled at the end of each part so that parts split into
# equal pipeline pieces. Each backend reads the tensors where they are: the interleaved,
# padded tensor is never written, so a bucket of gradients needs no torch.cat and a size
# that needs padding no staging buffer.

NAMESPACE = "zcomm"
REFERENCE_NAMESPACE = "zcomm_reference"

# The schemas, in the order the ops are defined; ``out`` is the one argument each op mutates.
SCHEMAS: dict[str, str] = {
    "quantize": "(Tensor x, int bits, int group_size, Tensor(a!) out) -> ()",
    "dequantize": "(Tensor payloads, int numel, int bits, int group_size, Tensor(a!) out) -> ()",
    "reorder_quantize": (
        "(Tensor[] xs, int parts, int part_numel, int[] perm, int num_chunks, int bits, int group_size, "
        "Tensor(a!) out) -> ()"
    ),
    "dequant_reduce": (
        "(Tensor payloads, int numel, int bits, int group_size, float divide_by, Tensor(a!) out) -> ()"
    ),
    "dequant_reduce_requant": (
        "(Tensor payloads, int numel, int bits, int out_bits, int group_size, float divide_by, "
        "Tensor(a!) out) -> ()"
    ),
}

# the device types of the native namespace and the backend behind each
NATIVE_BACKENDS: dict[str, str] = {"cpu": "cpu", "cuda": "cuda"}
_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}

_LIBRARIES = {
    namespace: torch.library.Library(namespace, "DEF") for namespace in (NAMESPACE, REFERENCE_NAMESPACE)
}
# op name -> its overload, per namespace; filled by @_op below, in the order of SCHEMAS
OPS: dict[str, torch._ops.OpOverload] = {}
REFERENCE_OPS: dict[str, torch._ops.OpOverload] = {}
_KERNELS: dict[tuple[str, str], Callable[..., None]] = {}


def implements(op: str, backend: str) -> Callable[[Kernel], Kernel]:
    """Decorator: register ``fn`` as ``backend``'s kernel for ``op``.

    A kernel takes the op's arguments, in the schema's order.
    """
    assert op in SCHEMAS, op
    assert backend in _registry.backend_device_types(), backend

    def register(fn: Kernel) -> Kernel:
        _KERNELS[(op, backend)] = fn
        return fn

    return register


def _load_kernel(op: str, backend: str) -> Callable[..., None]:
    """``backend``'s kernel for ``op``, importing the backend (which registers it) on first use."""
    _registry.load(backend)
    kernel = _KERNELS.get((op, backend))
    if kernel is None:
        raise _registry.BackendUnavailableError(f"zcomm backend {backend!r} has no kernel for {op!r}")
    return kernel


def kernel(op: str, backend: str) -> Callable[..., None]:
    """The function ``backend`` registered for ``op`` (loading the backend on first use)."""
    return _KERNELS.get((op, backend)) or _load_kernel(op, backend)


# [Note: planned kernels] A collective calls each op with arguments its plan fixes, so its plan
# asks the backend for each op's kernel *planned* for those calls (:func:`plan_kernels`), with
# each call's arguments named by a *use*: the tuple the backend plans by (below). A backend with
# nothing to resolve per sizes (``cpu``, ``reference``) gives its kernels themselves; the ``cuda``
# backend loads the sources all the ops need together (compiling them in parallel when its disk
# cache lacks them) and resolves every use's launch then (sizes the kernels, uploads their
# tables, runs the host checks: [Note: launch plans] in zcomm.quant.backends._cuda_launch), so
# nothing is compiled or resolved between a collective's hops and a failure raises before any
# hop is issued. A planned kernel is called with the op's arguments, in the schema's order, as
# the kernel itself is. The public ops reach the same launch plans through ``torch.ops.zcomm``.
_PLANNERS: dict[str, Callable[[torch.device, Mapping[str, Sequence[tuple]]], dict[str, Callable[..., None]]]] = {}


def plans_kernels(backend: str) -> Callable[[Callable], Callable]:
    """Decorator: register ``planner(device, uses)`` as ``backend``'s planner ([Note: planned kernels])."""
    assert backend in _registry.backend_device_types(), backend

    def register(planner: Callable) -> Callable:
        _PLANNERS[backend] = planner
        return planner

    return register


def plan_kernels(backend: str, device: torch.device, uses: Mapping[str, Sequence[tuple]]) -> dict[str, Callable[..., None]]:
    """``backend``'s kernel for each op of ``uses`` (op -> the uses of its calls), planned for those
    calls on ``device`` (loading the backend on first use; [Note: planned kernels])."""
    kernels = {op: kernel(op, backend) for op in uses}
    planner = _PLANNERS.get(backend)
    return kernels if planner is None else planner(device, uses)


def quantize_use(numel: int, bits: int, group_size: int, dtype: torch.dtype) -> tuple:
    """The use of ``quantize`` on ``numel`` elements of ``dtype``."""
    return (numel, bits, group_size, dtype)


def dequantize_use(rows: int, numel: int, bits: int, group_size: int, dtype: torch.dtype) -> tuple:
    """The use of ``dequantize`` (or ``dequant_reduce``, whose divisor is the call's) of ``rows``
    payloads of ``numel`` elements into ``dtype``."""
    return (rows, numel, bits, group_size, dtype)


def reorder_use(tensors: int, flat: bool, parts: int, part_numel: int, perm: tuple[int, ...], num_chunks: int,
                bits: int, group_size: int, dtype: torch.dtype) -> tuple:
    """The use of ``reorder_quantize`` on ``tensors`` tensors of ``dtype`` (``flat``: one tensor that
    fills its parts)."""
    return (tensors, flat, parts, part_numel, perm, num_chunks, bits, group_size, dtype)


def requant_use(rows: int, numel: int, bits: int, out_bits: int, group_size: int, divide_by: float,
                chunks: int) -> tuple:
    """The use of ``dequant_reduce_requant`` of ``rows`` payloads into ``chunks`` rows."""
    return (rows, numel, bits, out_bits, group_size, divide_by, chunks)


def _trampoline(op: str, backend: str) -> Callable[..., None]:
    """The dispatch-key kernel of ``op`` for ``backend``: its registered function, looked up per call."""
    key = (op, backend)

    def run(*args: object) -> None:
        (_KERNELS.get(key) or _load_kernel(op, backend))(*args)

    run.__name__ = f"{backend}_{op}"
    return run


def _op(preconditions: Callable[..., None]) -> Callable[..., None]:
    """Define ``zcomm::<name>`` and ``zcomm_reference::<name>`` with ``preconditions`` as their fake kernel."""
    name = preconditions.__name__
    assert name in SCHEMAS and name not in OPS, name
    for namespace, table in ((NAMESPACE, OPS), (REFERENCE_NAMESPACE, REFERENCE_OPS)):
        library = _LIBRARIES[namespace]
        library.define(name + SCHEMAS[name])
        for device_type, key in _DISPATCH_KEYS.items():
            backend = NATIVE_BACKENDS[device_type] if namespace == NAMESPACE else "reference"
            library.impl(name, _trampoline(name, backend), key)
        torch.library.register_fake(f"{namespace}::{name}", preconditions, lib=library)
        table[name] = getattr(getattr(torch.ops, namespace), name).default
    return preconditions


def _check_spec(bits: int, group_size: int) -> None:
    assert bits in SUPPORTED_BITS and group_size >= 2 and (bits == 8 or group_size % 2 == 0), (bits, group_size)


def _check_tensor(t: Tensor, name: str, shape: tuple[int, ...], device: torch.device) -> None:
    assert tuple(t.shape) == shape and t.is_contiguous() and t.device == device, (
        f"{name}: expected a contiguous {shape} tensor on {device}, got {tuple(t.shape)} on {t.device}"
    )


def _check_floats(t: Tensor, name: str, numel: int, device: torch.device) -> None:
    assert t.dtype in SUPPORTED_DTYPES, f"{name}: {t.dtype}"
    _check_tensor(t, name, (numel,), device)


def _check_payloads(
    t: Tensor, name: str, rows: int, numel: int, bits: int, group_size: int, device: torch.device
) -> None:
    """``t`` is ``rows`` uint8 payloads of ``numel`` elements, as a 2-D tensor."""
    assert t.dtype == torch.uint8, f"{name}: {t.dtype}"
    _check_tensor(t, name, (rows, payload_nbytes(numel, bits, group_size)), device)


@_op
def quantize(x: Tensor, bits: int, group_size: int, out: Tensor) -> None:
    """``out`` = the payload of the 1-D float ``x`` (``out``: 1-D uint8)."""
    _check_spec(bits, group_size)
    assert x.numel() > 0
    _check_floats(x, "x", x.numel(), x.device)
    assert out.dtype == torch.uint8, out.dtype
    _check_tensor(out, "out", (payload_nbytes(x.numel(), bits, group_size),), x.device)


@_op
def dequantize(payloads: Tensor, numel: int, bits: int, group_size: int, out: Tensor) -> None:
    """``out[r * numel : (r + 1) * numel]`` = payload row ``r`` of ``payloads`` (2-D, ``k >= 1``
    rows) dequantized to ``out``'s float dtype."""
    _check_spec(bits, group_size)
    assert numel > 0 and payloads.dim() == 2 and payloads.shape[0] >= 1, (numel, payloads.shape)
    _check_payloads(payloads, "payloads", payloads.shape[0], numel, bits, group_size, payloads.device)
    _check_floats(out, "out", payloads.shape[0] * numel, payloads.device)


@_op
def reorder_quantize(
    xs: list[Tensor],
    parts: int,
    part_numel: int,
    perm: Sequence[int],
    num_chunks: int,
    bits: int,
    group_size: int,
    out: Tensor,
) -> None:
    """Row ``c`` of ``out`` (2-D uint8, ``num_chunks`` rows) = the payload of chunk ``c`` of
    the *interleaved input* ``v`` reordered.

    ``v`` is ``parts`` parts of ``part_numel`` elements: part ``r`` is the ``r``-th of
    ``parts`` equal pieces of every tensor of ``xs`` (1-D, one dtype), in list order, then
    zeros up to ``part_numel`` ([Note: interleaved input]). ``v`` is read as ``len(perm)``
    equal slices, output slice ``p`` = slice ``perm[p]`` of ``v``, and the result cut into
    ``num_chunks`` equal chunks. One tensor that fills its parts is ``v`` itself.
    """
    _check_spec(bits, group_size)
    assert len(xs) >= 1 and parts >= 1, (len(xs), parts)
    widths = [x.numel() // parts for x in xs]
    numel = parts * part_numel
    assert numel > 0 and sum(widths) <= part_numel and sorted(perm) == list(range(len(perm))), (part_numel, perm)
    assert numel % len(perm) == 0 and numel % num_chunks == 0, (numel, len(perm), num_chunks)
    for x in xs:
        assert x.dtype == xs[0].dtype and x.numel() % parts == 0, (x.dtype, x.numel(), parts)
        _check_floats(x, "x", x.numel(), out.device)
    _check_payloads(out, "out", num_chunks, numel // num_chunks, bits, group_size, out.device)


def _check_reduction(payloads: Tensor, numel: int, bits: int, group_size: int, divide_by: float) -> None:
    _check_spec(bits, group_size)
    assert numel > 0 and divide_by > 0 and payloads.dim() == 2 and payloads.shape[0] >= 1, (numel, divide_by)
    _check_payloads(payloads, "payloads", payloads.shape[0], numel, bits, group_size, payloads.device)


@_op
def dequant_reduce(
    payloads: Tensor, numel: int, bits: int, group_size: int, divide_by: float, out: Tensor
) -> None:
    """``out`` (1-D float, ``numel``) = the fp32 sum of the payload rows, in row order, divided
    by ``fp32(divide_by)`` and rounded to ``out``'s dtype."""
    _check_reduction(payloads, numel, bits, group_size, divide_by)
    _check_floats(out, "out", numel, payloads.device)


@_op
def dequant_reduce_requant(
    payloads: Tensor,
    numel: int,
    bits: int,
    out_bits: int,
    group_size: int,
    divide_by: float,
    out: Tensor,
) -> None:
    """Row ``c`` of ``out`` (2-D uint8, ``m`` rows, ``m`` dividing ``numel``) = the
    ``out_bits`` payload of chunk ``c`` of the fp32 sum that :func:`dequant_reduce` stores,
    with the input's group size (``out_bits`` may differ from the input's ``bits``: qgZ's
    INT8 first hop sums INT8 rows into INT4 rows)."""
    _check_reduction(payloads, numel, bits, group_size, divide_by)
    _check_spec(out_bits, group_size)
    assert out.dim() == 2 and out.shape[0] >= 1 and numel % out.shape[0] == 0, (numel, out.shape)
    _check_payloads(out, "out", out.shape[0], numel // out.shape[0], out_bits, group_size, payloads.device)
