"""What every training engine of ``python -m bench.train`` provides, and shared helpers.

A runner owns one model and its optimizer under one engine (zero_runtime, FSDP2,
DeepSpeed). The training loop only calls ``train_step`` (forward, backward, optimizer
step, zero grad; returns this rank's loss), ``eval_loss`` (forward without gradients) and
``memory`` (what this rank holds, and where that figure comes from) and, after the run,
``close`` (release what would keep the engine alive past its last reference), so the loop, the
timing and the wire-byte accounting are the same code for every configuration.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
from torch.distributed.tensor import DTensor


class Unavailable(RuntimeError):
    """An optional dependency (an engine or a model library) is missing: skip with this note."""


class EngineFailed(RuntimeError):
    """A peer engine raised while setting up or training: its row shows the error it raised.

    Only for errors every rank meets at the same point (e.g. a kernel the engine has no CPU
    build of), so that all ranks leave the configuration together and the next one starts
    on a consistent process group.
    """


class MemoryReading(NamedTuple):
    """Peak bytes on this rank (``None`` when the engine cannot tell) and how it was measured."""

    peak_bytes: int | None
    source: str


class Runner(Protocol):
    def train_step(self, tokens: torch.Tensor) -> float: ...

    def eval_loss(self, tokens: torch.Tensor) -> float: ...

    def memory(self) -> MemoryReading: ...

    def close(self) -> None: ...


def local_nbytes(tensor: torch.Tensor) -> int:
    """Bytes this rank stores for ``tensor`` (its shard when it is a DTensor)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def model_state_nbytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's parameters, gradients and optimizer states, as the optimizer sees them.

    Taken after ``step()`` and before ``zero_grad()`` this is the model-state peak of the
    ZeRO paper's accounting; it leaves out activations and temporarily gathered weights.
    """
    total = 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            total += local_nbytes(param)
            if param.grad is not None:
                total += local_nbytes(param.grad)
            total += sum(local_nbytes(v) for v in optimizer.state.get(param, {}).values() if torch.is_tensor(v))
    return total


def cuda_peak(device: torch.device) -> MemoryReading:
    return MemoryReading(torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated")


class TorchOptimizerRunner:
    """The half of a runner that is the same wherever torch's AdamW steps the wrapped model (DDP, FSDP2).

    A subclass sets ``spec``, ``model``, ``opt``, ``device`` and ``gradient_clipping``, says in
    ``HELD`` what the CPU memory figure counts, and overrides :meth:`loss` where the forward differs.
    """

    HELD = "model states held (params+grads+AdamW)"
    peak_bytes = 0

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.spec.loss(self.model, tokens)

    def train_step(self, tokens: torch.Tensor) -> float:
        loss = self.loss(tokens)
        loss.backward()
        if self.gradient_clipping > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.gradient_clipping)
        self.opt.step()
        if self.device.type == "cpu":
            self.peak_bytes = max(self.peak_bytes, model_state_nbytes(self.opt))
        self.opt.zero_grad()
        return loss.item()

    def memory(self) -> MemoryReading:
        if self.device.type == "cuda":
            return cuda_peak(self.device)
        return MemoryReading(self.peak_bytes, self.HELD)

    def close(self) -> None:
        """Nothing to release: the engine's hooks and buffers go with the model, collected with the runner."""
