"""DeepSpeed ZeRO-3 (optionally with hpZ) as a peer training engine, when it is installed.

``deepspeed`` is an optional dependency (the ``peers`` extra); without it the benchmark
skips these configurations with a note. The model is built unchanged; torch's AdamW is
passed in (DeepSpeed's fused Adam needs a CUDA build), which ZeRO allows with
``zero_allow_untested_optimizer``. DeepSpeed's ZeRO-3 hooks sit on the model's own
modules, so the loss is computed by calling the wrapped module directly.
"""

from __future__ import annotations

import torch

from .configs import TrainConfig, deepspeed_config
from .models import ModelSpec
from .runner import MemoryReading, Unavailable, cuda_peak


class DeepSpeedRunner:
    def __init__(
        self,
        config: TrainConfig,
        spec: ModelSpec,
        *,
        lr: float,
        local_size: int,
        bf16: bool,
        micro_batch: int,
        device: torch.device,
    ) -> None:
        try:
            import deepspeed
        except ImportError as error:
            raise Unavailable(f"{config.name} needs deepspeed (pip install 'zcomm[peers]'): {error}") from None
        self.spec = spec
        self.device = device
        model = spec.build().to(device)
        engine_config = deepspeed_config(config, local_size=local_size, bf16=bf16, micro_batch=micro_batch)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=engine_config)

    def train_step(self, tokens: torch.Tensor) -> float:
        loss = self.spec.loss(self.engine.module, tokens)
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()

    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor) -> float:
        return self.spec.loss(self.engine.module, tokens).item()

    def memory(self) -> MemoryReading:
        if self.device.type == "cuda":
            return cuda_peak(self.device)
        # Its ZeRO-3 optimizer keeps flat partitions of its own; no torch counter sees them on CPU.
        return MemoryReading(None, "n/a on CPU")
