"""DeepSpeed's ``optimizer`` and ``scheduler`` config sections: checked when the config is
parsed, built by ``initialize`` when it is given no optimizer.

Optimizer ``type`` (any case, as DeepSpeed lower-cases it), built the way DeepSpeed's engine
builds it on a GPU without offload:

* ``Adam`` and ``AdamW`` are DeepSpeed's FusedAdam, which is AdamW (decoupled weight decay)
  for both names unless ``params.adam_w_mode`` is false: built as ``torch.optim.AdamW``
  (``torch.optim.Adam`` when ``adam_w_mode`` is false) with FusedAdam's defaults, so
  ``weight_decay`` defaults to 0, not torch AdamW's 0.01. ``torch_adam`` is accepted (it
  picks the same torch classes). FusedAdam without ``bias_correction`` is not available.
* ``Adagrad`` is ``torch.optim.Adagrad``; any other name of a ``torch.optim`` optimizer
  class (``SGD``, ``RMSprop``, exact spelling) is that class, as in DeepSpeed.
* DeepSpeed's own optimizers (``Lamb``, ``OneBitAdam``, ``Lion``, ...) are rejected by name.

``params`` are the constructor's keyword arguments; unknown ones are an error listing them
(DeepSpeed's ``max_grad_norm`` names ``gradient_clipping``, as DeepSpeed's error does).
Scheduler ``type`` is one of ``lr_schedules.SCHEDULES``; DeepSpeed's ``OneCycle`` and
``LRRangeTest`` are rejected by name.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

import torch

from .._config_keys import did_you_mean, unknown_keys_error
from ..lr_schedules import SCHEDULES

_DEEPSPEED_ONLY_OPTIMIZERS = ("lamb", "onebitadam", "onebitlamb", "zerooneadam", "lion", "muadam", "muadamw",
                              "musgd", "muon", "adamw8bit")
_NOT_IMPLEMENTED_SCHEDULES = ("OneCycle", "LRRangeTest")
_SECTION_KEYS = {"type", "params"}


def _section(spec: Any, name: str) -> tuple[str, dict[str, Any]]:
    if not isinstance(spec, Mapping):
        raise TypeError(f"config section {name!r} must be a mapping, got {type(spec).__name__}")
    unknown = set(spec) - _SECTION_KEYS
    if unknown:
        raise unknown_keys_error(name, unknown, _SECTION_KEYS)
    kind = spec.get("type")
    if not isinstance(kind, str):
        raise ValueError(f"{name}.type must be a string naming the {name}, got {kind!r}")
    params = spec.get("params", {})
    if not isinstance(params, Mapping):
        raise TypeError(f"{name}.params must be a mapping, got {type(params).__name__}")
    return kind, dict(params)


def _optimizer_class(kind: str, params: dict[str, Any]) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The torch class DeepSpeed's ``type`` stands for, and its keyword arguments."""
    if "max_grad_norm" in params:
        raise ValueError("optimizer.params.max_grad_norm is not an optimizer parameter: use the top-level "
                         "'gradient_clipping' key, as in DeepSpeed")
    lowered = kind.lower()
    if lowered in ("adam", "adamw"):
        params.pop("torch_adam", None)
        adam_w_mode = params.pop("adam_w_mode", True)
        if params.pop("bias_correction", True) is not True:
            raise ValueError("optimizer.params.bias_correction false is not supported (FusedAdam-only option)")
        cls = torch.optim.AdamW if lowered == "adamw" or adam_w_mode else torch.optim.Adam
        return cls, {"weight_decay": 0.0, **params}
    if lowered == "adagrad":
        return torch.optim.Adagrad, params
    if lowered in _DEEPSPEED_ONLY_OPTIMIZERS:
        raise ValueError(f"optimizer.type {kind!r} is one of DeepSpeed's own optimizers, which zero_runtime does "
                         "not implement; use Adam, AdamW, Adagrad or a torch.optim class name, or pass an "
                         "optimizer to initialize()")
    cls = getattr(torch.optim, kind, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        names = {n for n, c in vars(torch.optim).items()
                 if isinstance(c, type) and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer}
        raise ValueError(f"optimizer.type {kind!r} is neither Adam, AdamW, Adagrad nor a torch.optim optimizer "
                         f"class{did_you_mean(kind, names)}")
    return cls, params


def _check_params(owner: Callable, params: Mapping[str, Any], where: str, skip: tuple[str, ...]) -> None:
    accepted = [name for name in inspect.signature(owner).parameters if name not in skip]
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        named = ", ".join(f"{k}{did_you_mean(k, accepted)}" for k in unknown)
        raise ValueError(f"unknown {where} parameters: {named} (accepted: {', '.join(accepted)})")


def check_optimizer(spec: Any) -> None:
    """Raise if ``spec`` (the ``optimizer`` section) cannot be built."""
    kind, params = _section(spec, "optimizer")
    cls, kwargs = _optimizer_class(kind, params)
    _check_params(cls, kwargs, f"optimizer.params for {kind}", ("self", "params"))


def check_scheduler(spec: Any) -> None:
    """Raise if ``spec`` (the ``scheduler`` section) cannot be built."""
    kind, params = _section(spec, "scheduler")
    if kind in _NOT_IMPLEMENTED_SCHEDULES:
        raise ValueError(f"scheduler.type {kind!r} is not implemented in zero_runtime; implemented: "
                         f"{', '.join(SCHEDULES)} (or build a torch scheduler on opt.optimizer yourself)")
    if kind not in SCHEDULES:
        raise ValueError(f"scheduler.type {kind!r} is not one of DeepSpeed's schedules {', '.join(SCHEDULES)}"
                         f"{did_you_mean(kind, SCHEDULES)}")
    _check_params(SCHEDULES[kind], params, f"scheduler.params for {kind}", ("self", "optimizer"))


def build_optimizer(spec: Mapping[str, Any], params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    kind, kwargs = _section(spec, "optimizer")
    cls, kwargs = _optimizer_class(kind, kwargs)
    if "betas" in kwargs:  # JSON gives a list; torch's Adam family documents a tuple
        kwargs["betas"] = tuple(kwargs["betas"])
    return cls(params, **kwargs)


def build_scheduler(spec: Mapping[str, Any], optimizer: torch.optim.Optimizer):
    kind, kwargs = _section(spec, "scheduler")
    return SCHEDULES[kind](optimizer, **kwargs)
