"""DeepSpeed ZeRO-3 (optionally with its own ZeRO++ keys) as a peer training engine, when installed.

``deepspeed`` is an optional dependency (``make peers``, or the ``peers`` extra); without it
the benchmark shows these configurations as skipped with the import error. The model is
built unchanged; torch's AdamW is passed in (the same optimizer the other engines use;
DeepSpeed's fused Adam needs a CUDA build), which ZeRO allows with
``zero_allow_untested_optimizer``. DeepSpeed's ZeRO-3 hooks sit on the model's own
modules, so the loss is computed by calling the wrapped module directly.

Where DeepSpeed itself raises (its ZeRO++ quantizers have no CPU build: ``deepspeed.initialize``
fails on CPU as soon as ``zero_quantized_weights`` or ``zero_quantized_gradients`` is on),
the error it raised becomes the row's note (:class:`~bench.train.runner.EngineFailed`), so
the table says what DeepSpeed said and the other configurations still run.
"""

from __future__ import annotations

import contextlib
import traceback
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from .models import ModelSpec
from .runner import EngineFailed, MemoryReading, Unavailable, cuda_peak

T = TypeVar("T")
INSTALL_HINT = "make peers, or pip install 'zcomm[peers]'"


def _short(filename: str) -> str:
    parts = Path(filename).parts
    return "/".join(parts[parts.index("deepspeed"):] if "deepspeed" in parts else parts[-1:])


def describe_failure(action: str, error: BaseException) -> str:
    """``"<action> raised <Type>: <message> (at <file>:<line>, called from <file>:<line>: <code>)"``.

    Files are shortened to their path inside the ``deepspeed`` package; the calling frame
    (where DeepSpeed asked for what failed, e.g. a kernel build) is named when there is one.
    """
    message = " ".join(str(error).split()) or "(no message)"
    frames = traceback.extract_tb(error.__traceback__)
    where = ""
    if frames:
        where = f" (at {_short(frames[-1].filename)}:{frames[-1].lineno}"
        if len(frames) > 1:
            caller = frames[-2]
            where += f", called from {_short(caller.filename)}:{caller.lineno}: `{(caller.line or '').strip()}`"
        where += ")"
    return f"{action} raised {type(error).__name__}: {message}{where}"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    # DeepSpeed calls torch.distributed's old collective names, whose deprecation warning
    # torch repeats on every call: it would bury the table. Only around DeepSpeed's calls.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use", category=FutureWarning)
        yield


def _guarded(action: str, call: Callable[[], T]) -> T:
    with _quiet():
        try:
            return call()
        except Exception as error:  # noqa: BLE001 - whatever DeepSpeed raises is reported in its row
            raise EngineFailed(describe_failure(action, error)) from error


class DeepSpeedRunner:
    def __init__(
        self, name: str, spec: ModelSpec, engine_config: dict[str, Any], *, lr: float, device: torch.device
    ) -> None:
        try:
            import deepspeed
        except ImportError as error:
            raise Unavailable(f"{name} needs deepspeed ({INSTALL_HINT}): {error}") from None
        self.spec = spec
        self.device = device
        model = spec.build().to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        initialize = lambda: deepspeed.initialize(model=model, optimizer=optimizer, config=engine_config)  # noqa: E731
        self.engine, *_ = _guarded(f"deepspeed {deepspeed.__version__}: deepspeed.initialize", initialize)

    def _step(self, tokens: torch.Tensor) -> float:
        loss = self.spec.loss(self.engine.module, tokens)
        self.engine.backward(loss)
        self.engine.step()
        return loss.item()

    def train_step(self, tokens: torch.Tensor) -> float:
        return _guarded("a DeepSpeed training step", lambda: self._step(tokens))

    @torch.no_grad()
    def eval_loss(self, tokens: torch.Tensor) -> float:
        with _quiet():
            return self.spec.loss(self.engine.module, tokens).item()

    def memory(self) -> MemoryReading:
        if self.device.type == "cuda":
            return cuda_peak(self.device)
        # Its ZeRO-3 optimizer keeps flat partitions of its own; no torch counter sees them on CPU.
        return MemoryReading(None, "n/a on CPU")

    def close(self) -> None:
        """DeepSpeed's engine is left to the garbage collector (not checked for cycles through torch's hooks)."""
