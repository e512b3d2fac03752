"""Block quantization: the wire format and the ops every zcomm collective is built from.

Ops (each takes an optional ``backend=`` keyword, see :mod:`zcomm.quant.registry`):
:func:`quantize`, :func:`dequantize`, :func:`reorder_quantize`, :func:`dequant_reduce`.
The byte layout is specified in :mod:`zcomm.quant.wire_format`; :class:`QuantSpec` (bits and
elements per scale) is validated once, in :mod:`zcomm.quant.spec`, for every layer.
"""

from .ops import dequant_reduce, dequantize, quantize, reorder_quantize
from .registry import BackendUnavailableError, available_backends
from .spec import DEFAULT_GROUP_SIZE, TENSOR, QuantSpec
from .wire_format import QMAX, SUPPORTED_DTYPES, num_groups, payload_nbytes, scales_offset, values_nbytes

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "QMAX",
    "QuantSpec",
    "SUPPORTED_DTYPES",
    "TENSOR",
    "BackendUnavailableError",
    "available_backends",
    "dequant_reduce",
    "dequantize",
    "num_groups",
    "payload_nbytes",
    "quantize",
    "reorder_quantize",
    "scales_offset",
    "values_nbytes",
]
