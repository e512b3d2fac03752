"""PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) as a training engine.

Each repeated block of the model is one FSDP unit and the root module holds the rest (the
tied embedding/LM head, final norm), as torchtitan wraps a transformer. Mixed precision is
FSDP2's ``MixedPrecisionPolicy(param_dtype=bfloat16)``: fp32 sharded master weights, bf16
gathered weights and gradient reduction. Gradient clipping, when asked for, is torch's
``clip_grad_norm_`` over the sharded gradients (the global norm), as the ZeRO engines clip.
FSDP2's form of hpZ is ``reshard_after_forward`` given as an int: after forward each unit
keeps its weights sharded over that many ranks (the ranks of one node), so the backward
all-gather stays inside the node. qwZ and qgZ (``fsdp2-qwz``, ``fsdp2-qgz``, ``fsdp2-zeropp``) are
zcomm's collectives installed on every unit by ``zcomm.fsdp.enable_zeropp``.
HSDP (``hsdp``, ``hsdp-zeropp``): a 2-D mesh (replicate = nodes, shard = ranks per node);
FSDP2's own HSDP shards on all of it, zcomm's on its ``"shard"`` rows with the
``"replicate"`` group passed to ``enable_zeropp``.

Peak memory: ``torch.cuda.max_memory_allocated`` on GPU; on CPU, where torch keeps no
allocator statistics, the model-state bytes this rank holds (sharded parameters, gradients
and AdamW states) after the optimizer step, which is what memory_report() counts for ZeRO.
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import zcomm
import zcomm.fsdp

from .configs import TrainConfig
from .models import ModelSpec
from .runner import TorchOptimizerRunner


def reshard_after_forward(config: TrainConfig, *, local_size: int, world_size: int) -> bool | int:
    """FSDP2's setting for ``config``: True (plain ZeRO-3) or the hpZ group size.

    FSDP2 accepts an int only strictly between 1 and the world size; at the ends hpZ means
    keeping whole weights (1 rank per node) or the primary sharding itself (one node).
    """
    if not config.hpz or local_size == world_size:
        return True
    if local_size == 1:
        return False
    return local_size


class FSDP2Runner(TorchOptimizerRunner):
    HELD = "model states held (params+grads+AdamW, local shards)"

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
        zeropp = config.quantized_weights or config.quantized_gradients
        options: dict = {}
        if config.hsdp:
            nodes = world_size // local_size
            hybrid = init_device_mesh(device.type, (nodes, local_size), mesh_dim_names=("replicate", "shard"))
            mesh = hybrid["shard"] if zeropp else hybrid
            topology = zcomm.Topology(world_size=local_size, local_size=local_size)
            options = dict(replicate_group=hybrid.get_group("replicate"), quantized_all_reduce=config.quantized_gradients,
                           replicate_topology=zcomm.Topology(world_size=nodes, local_size=1))
        else:
            mesh = init_device_mesh(device.type, (world_size,))
            topology = zcomm.Topology(world_size=world_size, local_size=local_size)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
        reshard = reshard_after_forward(config, local_size=local_size, world_size=world_size)
        self.model = spec.build().to(device)
        for block in spec.blocks(self.model):
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(self.model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        if zeropp:
            zcomm.fsdp.enable_zeropp(
                self.model,
                quantized_weights=config.quantized_weights,
                quantized_gradients=config.quantized_gradients,
                group_size=config.quant_group_size,
                topology=topology,
                **({} if config.first_hop_bits is None else {"first_hop_bits": config.first_hop_bits}),
                **options,
            )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)

    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor) -> float:
        return self.spec.loss(self.model, tokens).item()
