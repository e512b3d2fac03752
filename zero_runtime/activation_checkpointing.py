"""Activation checkpointing (ZeRO-R, ZeRO paper section 6), with DeepSpeed's ``activation_checkpointing`` options.

``checkpoint(fn, *args)`` returns ``fn(*args)`` computed without keeping its intermediate
activations: only the inputs (the *checkpoint*) are kept, and backward runs ``fn`` again
with gradients on, restoring the RNG state of the first run so dropout draws the same masks.
The semantics are ``torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=True)``'s:
gradients reach the tensor arguments and the parameters ``fn`` uses, if at least one tensor
argument requires grad (otherwise nothing inside ``fn`` gets a gradient, as in torch);
non-tensor arguments are passed through; ``fn`` must not depend on state that changes
between forward and backward.

``Checkpointer(config)`` applies the options (``ActivationCheckpointingConfig``):

* ``cpu_checkpointing``: the checkpointed inputs are moved to host memory in forward
  (pinned and copied asynchronously on a GPU) and back in backward, so the device keeps no
  activation of a checkpointed block at all between its forward and its backward;
* ``contiguous_memory_optimization`` with ``number_checkpoints``: the checkpointed inputs
  are copied into one preallocated buffer of ``number_checkpoints`` slots (the ZeRO paper's
  constant-size buffers against fragmentation), reused every iteration; a slot is taken
  in forward and released once its backward ran, and more than ``number_checkpoints``
  live checkpoints are an error, not a silent fallback.

[Note: checkpoint slots] A slot is sized by the first input stored in it and holds inputs
of at most that many bytes; a larger one is an error that names the sizes (models
checkpoint identical blocks, whose inputs have one size). Slots are released in backward;
a forward without backward (evaluation under ``torch.no_grad`` does not checkpoint at all,
see ``checkpoint``) leaves them taken until ``reset()``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from ._config_keys import unknown_keys_error


@dataclass(frozen=True, kw_only=True)
class ActivationCheckpointingConfig:
    """DeepSpeed's ``activation_checkpointing`` section (the keys implemented here)."""

    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None

    def __post_init__(self) -> None:
        for name in ("cpu_checkpointing", "contiguous_memory_optimization"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"activation_checkpointing.{name} must be true or false, got {getattr(self, name)!r}")
        n = self.number_checkpoints
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"activation_checkpointing.number_checkpoints must be an integer >= 1, got {n!r}")
        if self.contiguous_memory_optimization and n is None:
            raise ValueError("activation_checkpointing.contiguous_memory_optimization needs number_checkpoints "
                             "(the number of buffer slots)")

    @classmethod
    def from_dict(cls, section: Mapping[str, Any]) -> "ActivationCheckpointingConfig":
        if not isinstance(section, Mapping):
            raise TypeError(f"config section 'activation_checkpointing' must be a mapping, got {type(section).__name__}")
        unknown = [k for k in section if k not in cls.__dataclass_fields__]
        if unknown:
            raise unknown_keys_error("activation_checkpointing", unknown, cls.__dataclass_fields__)
        return cls(**section)


class _Slots:
    """``count`` equal slots of one flat byte buffer per device (see [Note: checkpoint slots])."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.buffers: dict[torch.device, torch.Tensor] = {}
        self.slot_bytes: dict[torch.device, int] = {}
        self.busy: dict[torch.device, list[bool]] = {}

    def store(self, tensor: torch.Tensor, device: torch.device, pin: bool) -> tuple[torch.Tensor, Callable[[], None]]:
        nbytes = tensor.numel() * tensor.element_size()
        if device not in self.buffers:
            self.slot_bytes[device] = nbytes
            self.buffers[device] = torch.empty(self.count * nbytes, dtype=torch.uint8, device=device, pin_memory=pin)
            self.busy[device] = [False] * self.count
        if nbytes > self.slot_bytes[device]:
            raise ValueError(f"a checkpointed input of {nbytes} bytes does not fit the contiguous buffer's "
                             f"{self.slot_bytes[device]}-byte slots (sized by the first checkpoint)")
        busy = self.busy[device]
        if all(busy):
            raise RuntimeError(f"more than number_checkpoints={self.count} checkpoints are live (forward without "
                               "backward?): raise number_checkpoints, or call reset() after a forward without backward")
        index = busy.index(False)
        busy[index] = True
        start = index * self.slot_bytes[device]
        view = self.buffers[device][start : start + nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor, non_blocking=pin)

        def release() -> None:
            busy[index] = False

        return view, release

    def reset(self) -> None:
        for busy in self.busy.values():
            busy[:] = [False] * len(busy)


class Checkpointer:
    """``checkpoint`` with the options of ``config`` (one per model: it owns the buffers)."""

    def __init__(self, config: ActivationCheckpointingConfig | Mapping[str, Any] | None = None) -> None:
        if config is None:
            config = ActivationCheckpointingConfig()
        elif not isinstance(config, ActivationCheckpointingConfig):
            config = ActivationCheckpointingConfig.from_dict(config)
        self.config = config
        self.slots = _Slots(config.number_checkpoints) if config.contiguous_memory_optimization else None

    def checkpoint(self, function: Callable[..., Any], *args: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing to save: as torch, just run it
            return function(*args)
        return _CheckpointFunction.apply(self, function, *args)

    def reset(self) -> None:
        """Release every contiguous-buffer slot (after a forward that had no backward)."""
        if self.slots is not None:
            self.slots.reset()

    def _stash(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """Where a checkpointed input waits for backward, and what releases its place."""
        on_gpu = tensor.device.type == "cuda"
        device = torch.device("cpu") if self.config.cpu_checkpointing else tensor.device
        pin = self.config.cpu_checkpointing and on_gpu
        if self.slots is not None:
            return self.slots.store(tensor, device, pin)
        if self.config.cpu_checkpointing:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin)
            return host.copy_(tensor, non_blocking=pin), None
        return tensor, None


_DEFAULT = Checkpointer()


@dataclass(frozen=True)
class _Stored:
    """A checkpointed tensor argument: where it waits, and how to rebuild it."""

    tensor: torch.Tensor
    device: torch.device
    requires_grad: bool


def checkpoint(function: Callable[..., Any], *args: Any, checkpointer: Checkpointer | None = None) -> Any:
    """``function(*args)``, its activations recomputed in backward (see the module docstring);
    ``checkpointer`` applies ``activation_checkpointing`` options (default: none)."""
    return (checkpointer or _DEFAULT).checkpoint(function, *args)


class _CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, checkpointer: Checkpointer, function, *args):
        ctx.function = function
        ctx.devices = sorted({a.device for a in args if isinstance(a, torch.Tensor) and a.device.type == "cuda"},
                             key=str)
        ctx.rng = torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in ctx.devices]
        with torch.no_grad():
            outputs = function(*args)
        ctx.inputs, ctx.releases = [], []
        for arg in args:
            if isinstance(arg, torch.Tensor):
                stored, release = checkpointer._stash(arg.detach())
                ctx.inputs.append(_Stored(stored, arg.device, arg.requires_grad))
                if release is not None:
                    ctx.releases.append(release)
            else:
                ctx.inputs.append(arg)
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        inputs = []
        for item in ctx.inputs:
            if isinstance(item, _Stored):
                tensor = item.tensor.to(item.device, non_blocking=True).detach()
                inputs.append(tensor.requires_grad_(item.requires_grad))
            else:
                inputs.append(item)
        with torch.random.fork_rng(devices=ctx.devices):
            torch.set_rng_state(ctx.rng[0])
            for device, state in zip(ctx.devices, ctx.rng[1], strict=True):
                torch.cuda.set_rng_state(state, device)
            with torch.enable_grad():
                outputs = ctx.function(*inputs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads, strict=True) if isinstance(o, torch.Tensor) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        for release in ctx.releases:  # the recomputation no longer needs the slots
            release()
        return (None, None, *[t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None for t in inputs])
