"""The bundled ``zero_runtime`` as a training engine of ``python -m bench.train``.

The model is built unchanged and handed to ``zero_runtime.initialize`` with a factory for
AdamW and the DeepSpeed-style dict of :func:`bench.train.configs.zero_runtime_config`; the
loop then drives ``opt.backward``, ``opt.step`` and ``opt.zero_grad``. Peak memory is the
runtime's own ``memory_report()`` (parameters, gradients, optimizer states on this rank).

[Note: zero engine release] The runtime hooks every parameter with
``register_post_accumulate_grad_hook`` and keeps no handle; the hook's closure holds the
parameter's unit, which holds the parameter. torch keeps those hooks from C++, out of the
garbage collector's sight, so the cycle is never collected: every engine built in a process
stays alive with its flat buffers and optimizer states (seen with 2 rounds of 4
configurations: one more model alive per zero_runtime run). One launch of ``bench.train``
builds many engines (configurations x ``--rounds``; gpu-bench builds 16 of a 160M GPT, some
2.3 GB each), so :meth:`ZeroRunner.close` empties those hook tables after the run, which
breaks the cycle. This reads torch's private ``Tensor._post_accumulate_grad_hooks`` (the
only reference to a hook whose handle was dropped), here and nowhere else; a test checks
that a closed engine is collected.
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
        """Let the engine be collected: see [Note: zero engine release]."""
        self.opt.close()
        _drop_post_accumulate_grad_hooks(self.model)


def _drop_post_accumulate_grad_hooks(model: torch.nn.Module) -> None:
    for param in model.parameters():
        hooks = getattr(param, "_post_accumulate_grad_hooks", None)
        if hooks:
            hooks.clear()
