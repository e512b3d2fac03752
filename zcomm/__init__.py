"""zcomm: ZeRO++ quantized collectives on torch.distributed.

``zcomm.quant`` holds the block-quantization ops and the wire format.
"""

from . import quant

__all__ = ["quant"]
