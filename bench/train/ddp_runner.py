"""PyTorch DistributedDataParallel as a training engine: plain, with torch's bf16 hook, or with zcomm's.

Every rank keeps the whole model, its gradients and AdamW states (data parallelism, ZeRO's
stage 0); DDP all-reduces the gradients in buckets during backward. ``ddp`` uses DDP's own
all-reduce (fp32 on the wire), ``ddp-bf16hook`` torch's ``bf16_compress_hook`` (the buckets
cast to bf16, 2x fewer bytes; on a CPU, where DDP refuses that hook by name, :func:`bf16_hook`,
its algorithm over gloo), ``ddp-zcomm`` zcomm's ``zcomm.ddp.quantized_allreduce_hook``
(INT4 two-hop reduce-scatter with fp32 sums, INT8 gather). Mixed precision is
``torch.autocast(bfloat16)`` around forward with fp32 weights and gradients, so every DDP row
reduces fp32 buckets. Clipping is torch's ``clip_grad_norm_`` over the (replicated) gradients.

Peak memory: ``torch.cuda.max_memory_allocated`` on GPU; on CPU the model-state bytes this rank
holds after the optimizer step (whole parameters, gradients and AdamW states).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

import zcomm
import zcomm.ddp

from .configs import TrainConfig
from .models import ModelSpec
from .runner import TorchOptimizerRunner


def bf16_hook(process_group, bucket):  # unannotated: DDP refuses annotations that are strings
    """torch's ``bf16_compress_hook`` algorithm (cast to bf16, divide by the group size, all-reduce,
    cast back into the bucket), for CPU runs: DDP refuses torch's own hook by its name there
    ("requires CUDA 11+ and NCCL 2.10+")."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(done):
        buffer.copy_(done.value()[0])
        return buffer

    return future.then(decompress)


class _WithLoss(torch.nn.Module):
    """The model with the spec's loss as its forward: DDP must run the forward it wraps (its
    reducer prepares for backward there), and the specs compute the loss from the model."""

    def __init__(self, model: torch.nn.Module, spec: ModelSpec) -> None:
        super().__init__()
        self.model, self.spec = model, spec

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.spec.loss(self.model, tokens)


class DDPRunner(TorchOptimizerRunner):
    HELD = "model states held (params+grads+AdamW, whole model)"

    def __init__(
        self,
        config: TrainConfig,
        spec: ModelSpec,
        *,
        lr: float,
        local_size: int,
        world_size: int,
        bf16: bool,
        gradient_clipping: float,
        device: torch.device,
    ) -> None:
        self.spec = spec
        self.device = device
        self.gradient_clipping = gradient_clipping
        self.bf16 = bf16
        module = _WithLoss(spec.build().to(device), spec)
        self.model = DistributedDataParallel(module, device_ids=[device] if device.type == "cuda" else None)
        if config.ddp_hook == "bf16":
            hook = default_hooks.bf16_compress_hook if device.type == "cuda" else bf16_hook
            self.model.register_comm_hook(None, hook)
        elif config.ddp_hook == "zcomm":
            state = zcomm.ddp.QuantizedAllReduceState(
                topology=zcomm.Topology(world_size=world_size, local_size=local_size),
                **({} if config.first_hop_bits is None else {"first_hop_bits": config.first_hop_bits}),
                **({} if config.gather_bits is None else {"gather_bits": config.gather_bits}))
            self.model.register_comm_hook(state, zcomm.ddp.quantized_allreduce_hook)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)

    def _autocast(self) -> contextlib.AbstractContextManager:
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            return self.model(tokens)

    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor) -> float:
        with self._autocast():
            return self.model.module(tokens).item()  # no DDP forward: nothing to reduce
