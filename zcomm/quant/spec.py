"""``QuantSpec``: how a tensor is block-quantized, validated once for every layer.

A spec is the pair the wire format needs (:mod:`zcomm.quant.wire_format`): ``bits`` per
value (one of :data:`SUPPORTED_BITS`) and ``group_size``, the number of consecutive elements
that share one fp32 scale. ``group_size`` is either an int (>= 2, even for INT4, so that a
group never ends in the middle of a byte), ``None`` for zcomm's default of that width, or
``"tensor"``: one group per payload, the ZeRO++ paper's non-blocked ablation, whose concrete
size is only known once the payload's element count is (:meth:`QuantSpec.group_size_for`).

The ops (:mod:`zcomm.quant.ops`, :func:`~zcomm.quant.wire_format.payload_nbytes`), the
collectives and the runtime all build a ``QuantSpec`` from what their callers pass, so a bad
setting fails in one place with one message, whichever entry point it came through. This
module imports nothing from the rest of zcomm: it is the bottom of the quantization layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

# The widths the wire format defines (its qmax is 2**(bits - 1) - 1: 127 and 7).
SUPPORTED_BITS: tuple[int, ...] = (4, 8)

TENSOR: Literal["tensor"] = "tensor"

# Elements per scale when the caller does not say: qwZ's INT8 weights and qgZ's INT4
# gradients. 256 for both (bench/results/convergence_zeropp_ablation_cpu-2x2_202611): with
# zero_runtime's parameter-aligned blocks it trained as close to stage 3 as any setting
# measured, and one group size for both widths lets a unit align to 256 elements (+0.5% at
# bench.train's default shape, where 2048 would add 7.9%). The scales cost 4 / 256 bytes per
# element: +1.4% over 2048 for INT8, +1.5% over 512 for INT4.
DEFAULT_GROUP_SIZE: dict[int, int] = {8: 256, 4: 256}

GroupSize = Union[int, Literal["tensor"], None]


@dataclass(frozen=True, kw_only=True)
class QuantSpec:
    """Bits per value and elements per scale; ``group_size=None`` becomes the width's default."""

    bits: int
    group_size: GroupSize = None

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, int):
            raise TypeError(f"bits must be an int in {SUPPORTED_BITS}, got {self.bits!r}")
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {self.bits}")
        if self.group_size is None:
            object.__setattr__(self, "group_size", DEFAULT_GROUP_SIZE[self.bits])
        elif self.group_size != TENSOR:
            _check_int_group_size(self.group_size, self.bits)

    @property
    def per_tensor(self) -> bool:
        """One scale per payload (``group_size="tensor"``)."""
        return self.group_size == TENSOR

    def group_size_for(self, numel: int) -> int:
        """The concrete group size for a payload of ``numel`` elements.

        ``"tensor"`` covers the whole payload with one group: ``numel`` elements, at least 2
        and rounded up to even for INT4 (the extra element is padding the wire format
        already zero-fills).
        """
        if not self.per_tensor:
            return self.group_size
        size = max(2, numel)
        return size + size % 2 if self.bits == 4 else size


def _check_int_group_size(group_size: object, bits: int) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int >= 2, \"tensor\" or None, got {group_size!r}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2, got {group_size}")
    if bits == 4 and group_size % 2:
        raise ValueError(f"group_size must be even for 4-bit quantization, got {group_size}")
