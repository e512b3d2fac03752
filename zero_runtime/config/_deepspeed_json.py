"""The DeepSpeed JSON reader: a DeepSpeed config dict to ``ZeroConfig``'s keyword arguments.

It accepts the subset of DeepSpeed's schema this runtime implements, under DeepSpeed's own
key names (the key maps below), and rejects every other key with one error that lists them
all, each with the nearest known key: a misspelt key must never silently fall back to a
default and change training. For the same reason it never runs a config differently from
how DeepSpeed would read it: Hugging Face's ``"auto"`` anywhere is an error naming its key
path, a config without ``zero_optimization.stage`` is DeepSpeed's stage 0 (plain data
parallelism), DeepSpeed's legacy ``"zero_optimization": true`` is stage 1 and ``false``
stage 0, and DeepSpeed's performance hints are accepted only where they change nothing
here (reported by name). The values themselves are validated by ``ZeroConfig``.
"""

from __future__ import annotations

from typing import Any, Mapping

from .._config_keys import describe_unknown

# DeepSpeed key -> ZeroConfig/LossScaleConfig field, per section.
_ZERO_KEYS = {
    "stage": "stage",
    "reduce_bucket_size": "reduce_bucket_size",
    "overlap_comm": "overlap_comm",
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "zero_quantized_weights": "quantized_weights",
    "zero_hpz_partition_size": "hpz_partition_size",
    "zero_quantized_gradients": "quantized_gradients",
    "zcomm_quant_group_size": "quant_group_size",
    "zcomm_stage3_fuse_numel": "fuse_numel",
    "zcomm_align_quant_blocks": "align_quant_blocks",
    "zeropp_loco_param": "loco",
    "zcomm_qgz_first_hop_bits": "qgz_first_hop_bits",
    "zcomm_qgz_hadamard_block": "qgz_hadamard_block",
    "zcomm_weight_delta_bits": "weight_delta_bits",
    # offload (see zero_runtime.offload._config)
    "offload_optimizer": "offload_optimizer",
    "offload_param": "offload_param",
    "sub_group_size": "sub_group_size",
}
_FP16_KEYS = {
    "enabled": None,
    "loss_scale": "loss_scale",
    "initial_scale_power": "initial_scale_power",
    "loss_scale_window": "loss_scale_window",
    "hysteresis": "hysteresis",
    "min_loss_scale": "min_loss_scale",
}
_TOP_KEYS = {"zero_optimization", "bf16", "fp16", "gradient_clipping", "gradient_accumulation_steps",
             "train_batch_size", "train_micro_batch_size_per_gpu", "optimizer", "scheduler", "aio",
             "activation_checkpointing"}



# [Note: DeepSpeed keys] A DeepSpeed config is taken as written: keys with a meaning here act
# as in DeepSpeed, the hints below are accepted and named in one warning, and any other key
# (a misspelling, or a DeepSpeed feature not implemented here) is an error listing them all.
# Accepted and ignored, reported once by name: DeepSpeed's logging and profiling, and choices
# of its own kernels and buffers that change nothing this runtime computes (it always
# reduce-scatters and all-gathers, into contiguous buffers, and ignores unused parameters).
_IGNORED_TOP_KEYS = frozenset({
    "steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown", "flops_profiler",
    "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
})
_IGNORED_ZERO_KEYS = frozenset({
    "contiguous_gradients", "allgather_partitions", "allgather_bucket_size", "reduce_scatter",
    "round_robin_gradients", "elastic_checkpoint", "ignore_unused_parameters", "log_trace_cache_warnings",
    "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
    "use_multi_rank_bucket_allreduce", "memory_efficient_linear",
})
# Accepted at DeepSpeed's default only (reported as ignored): any other value changes what
# DeepSpeed computes or communicates, which this runtime does not implement.
_DEFAULT_ONLY = {
    "prescale_gradients": False, "gradient_predivide_factor": 1.0, "sparse_gradients": False,
    "communication_data_type": None, "fp16.auto_cast": False, "fp16.consecutive_hysteresis": False,
    "zero_optimization.mics_shard_size": -1, "zero_optimization.zero_quantized_nontrainable_weights": False,
}


def _legacy_zero_flag(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """DeepSpeed's old ``"zero_optimization": true`` (its getting-started example) is stage 1;
    false is its stage 0 (plain data parallelism)."""
    flag = config.get("zero_optimization")
    if not isinstance(flag, bool):
        return config
    return {**config, "zero_optimization": {"stage": 1 if flag else 0}}


def _deepspeed_extras(config: Mapping[str, Any]) -> set[str]:
    """The dotted names of the DeepSpeed keys in ``config`` that are accepted and ignored.
    Raises for a hint at a value other than DeepSpeed's default."""
    sections = {"": config}
    for name in ("zero_optimization", "fp16"):
        sections[f"{name}."] = _section(config, name)
    ignored = {k for k in config if k in _IGNORED_TOP_KEYS}
    ignored |= {f"zero_optimization.{k}" for k in sections["zero_optimization."] if k in _IGNORED_ZERO_KEYS}
    for key, default in _DEFAULT_ONLY.items():
        prefix, _, name = key.rpartition(".")
        section = sections[f"{prefix}." if prefix else ""]
        if name in section:
            if section[name] != default:
                raise ValueError(f"{key} = {section[name]!r} is not supported by zero_runtime (only DeepSpeed's "
                                 f"default, {default!r})")
            ignored.add(key)
    return ignored


# [Note: Hugging Face "auto"] Hugging Face's Trainer replaces every "auto" in a DeepSpeed
# config (at any depth: bf16.enabled, optimizer.params.lr, zero_optimization.*, ...) before
# DeepSpeed reads it; DeepSpeed itself has no such value. A truthy "auto" read as a value
# would silently turn options on (bf16.enabled "auto" would mean bf16), so every one is an
# error naming its key path. The only "auto" that is a value here is zcomm's own
# aio.zcomm_direct_io, which Hugging Face does not know.
_AUTO_IS_A_VALUE = frozenset({"aio.zcomm_direct_io"})


def _auto_paths(value: Any, path: str) -> list[str]:
    if isinstance(value, Mapping):
        return [p for k, v in value.items() for p in _auto_paths(v, f"{path}.{k}" if path else str(k))]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _auto_paths(v, f"{path}[{i}]")]
    return [path] if isinstance(value, str) and value == "auto" and path not in _AUTO_IS_A_VALUE else []


def _reject_hf_auto(config: Mapping[str, Any]) -> None:
    auto = _auto_paths(config, "")
    if auto:
        raise ValueError(f"'auto' is a Hugging Face Trainer placeholder, not a DeepSpeed value; give values for: "
                         f"{', '.join(sorted(auto))}")


def _reject_unknown(config: Mapping[str, Any], zero: Mapping[str, Any], bf16: Mapping[str, Any],
                    fp16: Mapping[str, Any], ignored: set[str]) -> None:
    """One error naming every unknown key of the top level, ``zero_optimization``, ``bf16``
    and ``fp16``, each with the closest key its section knows (or ignores)."""
    known = {"": _TOP_KEYS | _IGNORED_TOP_KEYS | {k for k in _DEFAULT_ONLY if "." not in k},
             "zero_optimization": set(_ZERO_KEYS) | _IGNORED_ZERO_KEYS
             | {k.partition(".")[2] for k in _DEFAULT_ONLY if k.startswith("zero_optimization.")},
             "bf16": {"enabled"},
             "fp16": set(_FP16_KEYS) | {k.partition(".")[2] for k in _DEFAULT_ONLY if k.startswith("fp16.")}}
    unknown = []
    for name, section in (("", config), ("zero_optimization", zero), ("bf16", bf16), ("fp16", fp16)):
        path = f"{name}." if name else ""
        unknown += [(f"{path}{k}", describe_unknown(name, k, known[name])) for k in section
                    if k not in known[name] and f"{path}{k}" not in ignored]
    if unknown:
        raise ValueError(f"unknown config keys: {', '.join(text for _, text in sorted(unknown))}")


def _section(config: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = config.get(name, {})
    if not isinstance(value, Mapping):
        raise TypeError(f"config section {name!r} must be a mapping, got {type(value).__name__}")
    return value


def read(config: Mapping[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """``ZeroConfig``'s keyword arguments for a DeepSpeed config (``loss_scale`` as the keyword
    arguments of ``LossScaleConfig``), and the dotted names of the keys accepted and ignored.

    Raises ValueError or TypeError for "auto", unknown keys, hints at other than their
    default, and bf16 and fp16 both on. Without ``zero_optimization.stage`` the stage is
    DeepSpeed's default, 0 (``ZeroConfig``'s default)."""
    if not isinstance(config, Mapping):
        raise TypeError(f"config must be a mapping, got {type(config).__name__}")
    _reject_hf_auto(config)
    config = _legacy_zero_flag(config)
    ignored = _deepspeed_extras(config)
    zero = _section(config, "zero_optimization")
    bf16, fp16 = _section(config, "bf16"), _section(config, "fp16")
    _reject_unknown(config, zero, bf16, fp16, ignored)
    if bf16.get("enabled") and fp16.get("enabled"):
        raise ValueError("bf16.enabled and fp16.enabled are both true; pick one")
    kwargs: dict[str, Any] = {_ZERO_KEYS[k]: v for k, v in zero.items() if k in _ZERO_KEYS}
    kwargs["precision"] = "bf16" if bf16.get("enabled") else "fp16" if fp16.get("enabled") else "fp32"
    kwargs["loss_scale"] = {_FP16_KEYS[k]: v for k, v in fp16.items() if k in _FP16_KEYS and k != "enabled"}
    for key in ("gradient_clipping", "gradient_accumulation_steps", "train_batch_size",
                "train_micro_batch_size_per_gpu", "optimizer", "scheduler", "aio", "activation_checkpointing"):
        if key in config:
            kwargs[key] = config[key]
    return kwargs, ignored
