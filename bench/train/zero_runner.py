"""The bundled ``zero_runtime`` as a training engine of ``python -m bench.train``.

The model is built unchanged and handed to ``zero_runtime.initialize`` with a factory for
AdamW and the DeepSpeed-style dict of :func:`bench.train.configs.zero_runtime_config`; the
loop then drives ``opt.backward``, ``opt.step`` and ``opt.zero_grad``. Peak memory is the
runtime's own ``memory_report()`` (parameters, gradients, optimizer states on this rank).

``close()`` releases the engine (``ZeroOptimizer.close``, which also removes its gradient
hooks), so the many engines one launch builds (configurations x ``--rounds``) do not stack
up in memory.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

import zero_runtime

from .models import ModelSpec
from .runner import MemoryReading


class ZeroRunner:
    def __init__(self, spec: ModelSpec, engine_config: dict[str, Any], *, lr: float, device: torch.device) -> None:
        self.spec = spec
        optimizer_factory = functools.partial(torch.optim.AdamW, lr=lr)
        self.model, self.opt = zero_runtime.initialize(spec.build().to(device), optimizer_factory, engine_config)
        self.peak_bytes = 0

    def train_step(self, tokens: torch.Tensor) -> float:
        loss = self.spec.loss(self.model, tokens)
        self.opt.backward(loss)
        self.opt.step()
        # After step, before zero_grad: gradients and updated states are both still held.
        self.peak_bytes = max(self.peak_bytes, self.opt.memory_report().total)
        self.opt.zero_grad()
        return loss.item()

    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor) -> float:
        return self.spec.loss(self.model, tokens).item()

    def memory(self) -> MemoryReading:
        return MemoryReading(self.peak_bytes, "zero_runtime memory_report()")

    def close(self) -> None:
        """Let the engine be collected (its gradient hooks go with ``close``)."""
        self.opt.close()
