"""qwZ: all-gather with blocked INT8 quantization (ZeRO++ section 3.1).

Each rank quantizes its input into one self-contained INT8 payload (values, padding and
fp32 scales in one ``uint8`` buffer, see :mod:`zcomm.quant.wire_format`), one all-gather
of those equal-length payloads runs on the caller's group, and the ``W`` received payloads
are dequantized into ``output`` (rank ``i``'s input lands at ``output[i*n:(i+1)*n]``).
Every element is within half its group's scale (``absmax / 127 / 2``) of the original
before the final rounding to the output dtype. Any ``numel`` works: the last group of a
payload is simply short.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import quant
from .comm_stats import record, ring_bytes
from .collective_args import check_group_size, check_tensors, resolve_group
from .handle import Handle
from .topology import Topology
from .torch_compat import all_gather_single

OP_NAME = "all_gather_q8"
BITS = 8
# Elements per INT8 scale: 4 scale bytes per 2048 value bytes (0.2% overhead) keep the
# payload at ~0.5x of bf16 while one outlier only coarsens its own 2048 neighbours.
DEFAULT_GROUP_SIZE = 2048


def all_gather_q8(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
    *,
    group_size: int | None = None,
    topology: Topology | None = None,
) -> Handle | None:
    """INT8-quantized drop-in for ``torch.distributed.all_gather_into_tensor``.

    Args:
        output: contiguous, ``world * input.numel()`` elements, same dtype (fp32/bf16/fp16) and device.
        input: contiguous, any shape and numel.
        group: the process group (default: world).
        async_op: return a :class:`~zcomm.handle.Handle`; ``output`` is valid after its ``wait()``.
        group_size: elements per quantization scale (default :data:`DEFAULT_GROUP_SIZE`).
        topology: only used to split ``comm_stats`` into intra/inter-node bytes (default: detected).
    """
    info = resolve_group(group, topology)
    check_tensors(output, input, world=info.world_size, gather=True, quantized=True)
    group_size = DEFAULT_GROUP_SIZE if group_size is None else group_size
    check_group_size(group_size, BITS)
    numel = input.numel()
    payload_bytes = quant.payload_nbytes(numel, BITS, group_size)
    intra, inter = ring_bytes(payload_bytes, info.rank, info.topology)
    record(OP_NAME, intra_bytes=intra, inter_bytes=inter)
    # [Note: buffer lifetime] ``sent`` and ``received`` are referenced by the closures below
    # until the handle's wait() has dequantized; on CUDA the process group records their use
    # on its stream, so the allocator does not reuse them early.
    sent = quant.quantize(input.reshape(-1), BITS, group_size)
    received = torch.empty(info.world_size * payload_bytes, dtype=torch.uint8, device=input.device)
    work = all_gather_single(received, sent, group=info.group, async_op=True)

    def finish() -> None:
        work.wait()
        if numel:
            rows = received.view(info.world_size, payload_bytes)
            quant.dequantize(rows, numel, BITS, group_size, output.dtype, out=output.view(-1))

    handle = Handle(finish=finish, ready=work.is_completed)
    if async_op:
        return handle
    handle.wait()
    return None
