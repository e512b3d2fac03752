"""Loss scaling for fp16 (DeepSpeed's dynamic scaler semantics).

[Note: loss-scale handling] ``backward`` multiplies the loss by ``scale``; ``step`` divides
the reduced gradients by it. Overflow is decided from the *global* squared gradient norm,
which is one all-reduce over every rank's partition: an inf or nan anywhere makes it
non-finite on every rank, so all ranks skip the same step and update the scale identically
without a separate vote. A skipped step counts against ``hysteresis``: the scale is halved
once that many consecutive overflows were seen; ``window`` clean steps in a row double it.
bf16 and fp32 use ``StaticScale(1.0)``, which never skips.
"""

from __future__ import annotations

from typing import Any

from .config import LossScaleConfig


class StaticScale:
    def __init__(self, scale: float = 1.0) -> None:
        self.scale = float(scale)

    @property
    def dynamic(self) -> bool:
        return False

    def update(self, *, overflow: bool) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])


class DynamicLossScaler:
    def __init__(self, config: LossScaleConfig) -> None:
        self.scale = float(2 ** config.initial_scale_power)
        self.window = config.loss_scale_window
        self.hysteresis = config.hysteresis
        self.min_scale = config.min_loss_scale
        self.overflows_left = self.hysteresis
        self.clean_steps = 0

    @property
    def dynamic(self) -> bool:
        return True

    def update(self, *, overflow: bool) -> None:
        if overflow:
            self.clean_steps = 0
            self.overflows_left -= 1
            if self.overflows_left == 0:
                self.scale = max(self.scale / 2, self.min_scale)
                self.overflows_left = self.hysteresis
            return
        self.clean_steps += 1
        if self.clean_steps == self.window:
            self.scale *= 2
            self.clean_steps = 0
            self.overflows_left = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "overflows_left": self.overflows_left, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale = float(state["scale"])
        self.overflows_left = int(state["overflows_left"])
        self.clean_steps = int(state["clean_steps"])


LossScaler = StaticScale | DynamicLossScaler


def make_scaler(precision: str, config: LossScaleConfig) -> LossScaler:
    if precision != "fp16":
        return StaticScale(1.0)
    if config.loss_scale > 0:
        return StaticScale(config.loss_scale)
    return DynamicLossScaler(config)
