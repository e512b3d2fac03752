"""Configuration of the ZeRO runtime: the typed ``ZeroConfig`` and the DeepSpeed JSON reader.

``ZeroConfig`` (``_zero_config``) is the validated, typed form, one docstring per field.
``ZeroConfig.from_dict`` / ``from_json`` read the subset of DeepSpeed's JSON schema this
runtime implements, under DeepSpeed's own key names (``_deepspeed_json``): every other key
is an error that lists them (each with the nearest known key), Hugging Face's ``"auto"``
anywhere is an error naming its key path, and a config without ``zero_optimization.stage``
runs DeepSpeed's default, stage 0 (plain data parallelism). The sections' own configs
live with their owners (offload, activation checkpointing) and are re-exported here.
"""

from .._config_keys import describe_unknown, unknown_keys_error
from ..activation_checkpointing import ActivationCheckpointingConfig
from ..offload._config import (
    DEFAULT_SUB_GROUP_SIZE,
    AioConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    aio_config,
    integral_count,
    offload_optimizer_config,
    offload_param_config,
)
from ._zero_config import (
    DEFAULT_FUSE_NUMEL,
    DEFAULT_MAX_LIVE_PARAMETERS,
    DEFAULT_MAX_REUSE_DISTANCE,
    DEFAULT_PARAM_PERSISTENCE_THRESHOLD,
    DEFAULT_PREFETCH_BUCKET_SIZE,
    DEFAULT_REDUCE_BUCKET_SIZE,
    LocoConfig,
    LossScaleConfig,
    Precision,
    QuantGroupSize,
    ZeroConfig,
    resolve_config,
)

__all__ = ["ZeroConfig", "LossScaleConfig", "LocoConfig", "OffloadOptimizerConfig", "OffloadParamConfig", "AioConfig",
           "ActivationCheckpointingConfig", "Precision", "QuantGroupSize", "resolve_config",
           "DEFAULT_FUSE_NUMEL", "DEFAULT_MAX_LIVE_PARAMETERS", "DEFAULT_MAX_REUSE_DISTANCE",
           "DEFAULT_PARAM_PERSISTENCE_THRESHOLD", "DEFAULT_PREFETCH_BUCKET_SIZE", "DEFAULT_REDUCE_BUCKET_SIZE",
           "DEFAULT_SUB_GROUP_SIZE", "aio_config", "integral_count", "offload_optimizer_config",
           "offload_param_config", "describe_unknown", "unknown_keys_error"]
