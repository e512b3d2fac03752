"""Block quantization: the wire format and the ops every zcomm collective is built from.

Ops (each takes an optional ``backend=`` keyword: ``"reference"``, ``"cpu"`` or ``"cuda"``,
else ``ZCOMM_BACKEND``, else the tensor's device): :func:`quantize`, :func:`dequantize`,
:func:`reorder_quantize`, :func:`dequant_reduce`, defined in :mod:`zcomm.quant.ops`. The
byte layout is specified in :mod:`zcomm.quant.wire_format`; :class:`QuantSpec` (bits and
elements per scale) is validated once, in :mod:`zcomm.quant.spec`, for every layer. The
kernels behind the ops are ``torch.library`` operators dispatched by device type
(``torch.ops.zcomm.*``; the reference oracle as ``torch.ops.zcomm_reference.*``) whose
contract is stated once, in ``zcomm/quant/_contract.py``.
"""

from ._registry import BackendUnavailableError, available_backends, backend_device_types
from .ops import dequant_reduce, dequantize, quantize, reorder_quantize
from .spec import DEFAULT_GROUP_SIZE, SUPPORTED_BITS, TENSOR, QuantSpec
from .wire_format import QMAX, SUPPORTED_DTYPES, num_groups, payload_nbytes, scales_offset, values_nbytes

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "QMAX",
    "QuantSpec",
    "SUPPORTED_BITS",
    "SUPPORTED_DTYPES",
    "TENSOR",
    "BackendUnavailableError",
    "available_backends",
    "backend_device_types",
    "dequant_reduce",
    "dequantize",
    "num_groups",
    "payload_nbytes",
    "quantize",
    "reorder_quantize",
    "scales_offset",
    "values_nbytes",
]
