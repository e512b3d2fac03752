"""The offload sections of the config: ``zero_optimization.offload_optimizer``,
``zero_optimization.offload_param``, ``sub_group_size`` and the top-level ``aio`` section, with
DeepSpeed's keys, defaults and meanings.

Parsed here and held by ``ZeroConfig`` (``config._zero_config``); unknown sub-keys are rejected with
the list of them, as everywhere in the config.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal, Mapping

from .._config_keys import unknown_keys_error

OffloadDevice = Literal["none", "cpu", "nvme"]
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000  # DeepSpeed's sub_group_size


@dataclass(frozen=True, kw_only=True)
class OffloadOptimizerConfig:
    """``zero_optimization.offload_optimizer`` (stages 1-3), DeepSpeed's meaning.

    ``device``: ``"none"`` keeps the fp32 master weights and the optimizer states on the
    training device; ``"cpu"`` keeps them in CPU memory and ``"nvme"`` in one file per rank
    under ``nvme_path`` (created at start-up, removed when the optimizer is closed, garbage
    collected or the process exits), and the optimizer step runs on the CPU
    (``zero_runtime.offload.cpu_adam``: Adam/AdamW only). ``pin_memory``: page-locked host buffers
    for the copies between the GPU and the host (a CPU run makes no such copies).
    ``buffer_count``: host buffers the NVMe step cycles through, one sub-group each (>= 3:
    one being read, one updated, one written back).

    ``zcomm_overlap_step`` (zcomm's key, default false): on an accumulation boundary, update
    each unit as soon as its reduced gradient is final, during backward, instead of all of
    them in ``step()``, so the swap traffic of the step overlaps backward's compute (see
    [Note: step during backward] in ``offload._optimizer``). The result is bit-identical; it needs
    ``gradient_clipping`` 0 and no fp16 dynamic loss scaling (both need every gradient before
    the first update), and the hyper-parameters are read when ``backward()`` starts.
    """

    device: OffloadDevice = "none"
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 4
    zcomm_overlap_step: bool = False

    def __post_init__(self) -> None:
        _check_device("offload_optimizer", self.device, self.pin_memory)
        if isinstance(self.buffer_count, bool) or not isinstance(self.buffer_count, int) or self.buffer_count < 3:
            raise ValueError(f"offload_optimizer.buffer_count must be an integer >= 3, got {self.buffer_count!r}")
        if not isinstance(self.zcomm_overlap_step, bool):
            raise TypeError(f"offload_optimizer.zcomm_overlap_step must be true or false, "
                            f"got {self.zcomm_overlap_step!r}")
        if self.zcomm_overlap_step and not self.enabled:
            raise ValueError("offload_optimizer.zcomm_overlap_step needs offload_optimizer.device 'cpu' or 'nvme'")
        object.__setattr__(self, "nvme_path", _nvme_path("offload_optimizer", self.device, self.nvme_path))

    @property
    def enabled(self) -> bool:
        return self.device != "none"


def integral_count(key: str, value: Any, minimum: int, *, unit: str = "elements") -> int:
    """``value`` as an int >= ``minimum`` (of ``unit``; ``key`` names it in the error), also
    from an integral float: DeepSpeed's JSON writes counts as ``1e8``. Used by ``config`` too."""
    integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
    if isinstance(value, bool) or not integral or value < minimum:
        raise ValueError(f"{key} must be an integer >= {minimum} ({unit}), got {value!r}")
    return int(value)


def _check_device(section: str, device: Any, pin_memory: Any) -> None:
    if device not in ("none", "cpu", "nvme"):
        raise ValueError(f"{section}.device must be 'none', 'cpu' or 'nvme', got {device!r}")
    if not isinstance(pin_memory, bool):
        raise TypeError(f"{section}.pin_memory must be true or false, got {pin_memory!r}")


def _nvme_path(section: str, device: str, nvme_path: Any) -> str | None:
    """``nvme_path`` as a str: required with ``device: nvme``, a path or None otherwise."""
    if device == "nvme":
        if not isinstance(nvme_path, (str, os.PathLike)) or not str(nvme_path):
            raise ValueError(f"{section}.device 'nvme' needs {section}.nvme_path (a directory)")
        return os.fspath(nvme_path)
    if nvme_path is not None and not isinstance(nvme_path, (str, os.PathLike)):
        raise TypeError(f"{section}.nvme_path must be a path, got {nvme_path!r}")
    return nvme_path


@dataclass(frozen=True, kw_only=True)
class OffloadParamConfig:
    """``zero_optimization.offload_param`` (stage 3 only), DeepSpeed's keys and meaning.

    ``device``: ``"none"`` keeps each partitioned unit's compute-dtype shard on the training
    device; ``"cpu"`` keeps it in host memory and ``"nvme"`` in one file per rank under
    ``nvme_path`` between uses, and brings it to the device when stage 3 gathers the unit
    (see [Note: shard residency] in ``offload._params``). Stage 3's persistent parameters are
    not offloaded (they are never freed). ``pin_memory``: page-locked host memory for the
    copies to and from a GPU. With ``nvme``, ``buffer_count`` host buffers of ``buffer_size``
    elements (each at least the largest unit's shard) carry the reads and writes, so at most
    ``buffer_count`` transfers are in flight; reads are started ahead of the gathers along the
    first step's trace while at most ``max_in_cpu`` shard elements are resident or being
    read (a shard a gather needs now is always fetched).
    """

    device: OffloadDevice = "none"
    nvme_path: str | None = None
    pin_memory: bool = False
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000

    def __post_init__(self) -> None:
        _check_device("offload_param", self.device, self.pin_memory)
        object.__setattr__(self, "buffer_count",
                           integral_count("offload_param.buffer_count", self.buffer_count, 1, unit="buffers"))
        object.__setattr__(self, "buffer_size", integral_count("offload_param.buffer_size", self.buffer_size, 1))
        object.__setattr__(self, "max_in_cpu", integral_count("offload_param.max_in_cpu", self.max_in_cpu, 0))
        object.__setattr__(self, "nvme_path", _nvme_path("offload_param", self.device, self.nvme_path))

    @property
    def enabled(self) -> bool:
        return self.device != "none"


@dataclass(frozen=True, kw_only=True)
class AioConfig:
    """The ``aio`` section: how NVMe swap files are read and written.

    ``block_size`` (bytes, DeepSpeed default 1 MiB): each sub-group's transfer is split
    into requests of this size; ``thread_count`` (default 1) threads each keep up to
    ``queue_depth`` (default 8) of them in flight. ``zcomm_direct_io`` (zcomm key):
    ``"auto"`` (default) opens the swap files with ``O_DIRECT`` where the file system
    allows it and with buffered I/O where it does not (``ramfs``); ``true`` requires
    ``O_DIRECT`` (a clear error at start-up where it is not possible); ``false`` never uses it.
    """

    block_size: int = 1 << 20
    queue_depth: int = 8
    thread_count: int = 1
    zcomm_direct_io: bool | Literal["auto"] = "auto"

    def __post_init__(self) -> None:
        for name in ("block_size", "queue_depth", "thread_count"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"aio.{name} must be an integer >= 1, got {value!r}")
        if self.block_size % 4096:
            raise ValueError(f"aio.block_size must be a multiple of 4096 bytes (direct I/O), got {self.block_size}")
        if self.zcomm_direct_io not in (True, False, "auto"):
            raise ValueError(f"aio.zcomm_direct_io must be true, false or 'auto', got {self.zcomm_direct_io!r}")


def _strict(cls, section: str, value: Any):
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"config section {section!r} must be a mapping, got {type(value).__name__}")
    known = set(cls.__dataclass_fields__)
    unknown = [k for k in value if k not in known]
    if unknown:
        raise unknown_keys_error(section, unknown, known)
    return cls(**value)


def offload_optimizer_config(value: Any) -> OffloadOptimizerConfig:
    return _strict(OffloadOptimizerConfig, "zero_optimization.offload_optimizer", value)


def offload_param_config(value: Any) -> OffloadParamConfig:
    return _strict(OffloadParamConfig, "zero_optimization.offload_param", value)


def aio_config(value: Any) -> AioConfig:
    return _strict(AioConfig, "aio", value)
