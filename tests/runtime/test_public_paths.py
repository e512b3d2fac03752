"""Every public import path of ``zero_runtime`` and the public names it offers.

Each public module and its public names (classes, functions and constants of the runtime,
re-exports included): a move that drops one fails here, not in a user's code.
"""

from __future__ import annotations

import importlib

import pytest

PUBLIC = {
    "zero_runtime": ["CheckpointError", "GatheredParameters", "Init", "LossScaleConfig", "MemoryReport", "TiledLinear",
                     "ZeroConfig", "ZeroOptimizer", "initialize"],
    "zero_runtime.activation_checkpointing": ["ActivationCheckpointingConfig", "Checkpointer", "checkpoint",
                                              "unknown_keys_error"],
    "zero_runtime.checkpoint.export": ["CheckpointError", "DTYPES", "consolidate", "export", "main"],
    "zero_runtime.config": ["ActivationCheckpointingConfig", "AioConfig", "DEFAULT_FUSE_NUMEL",
                            "DEFAULT_MAX_LIVE_PARAMETERS", "DEFAULT_MAX_REUSE_DISTANCE",
                            "DEFAULT_PARAM_PERSISTENCE_THRESHOLD", "DEFAULT_PREFETCH_BUCKET_SIZE",
                            "DEFAULT_REDUCE_BUCKET_SIZE", "DEFAULT_SUB_GROUP_SIZE", "LocoConfig", "LossScaleConfig",
                            "OffloadOptimizerConfig", "OffloadParamConfig", "ZeroConfig", "aio_config",
                            "describe_unknown", "integral_count", "offload_optimizer_config", "offload_param_config",
                            "resolve_config", "unknown_keys_error"],
    "zero_runtime.estimate": ["Estimate", "ROWS", "format_table", "hpz_estimate", "loco_estimate", "main",
                              "stage_estimate"],
    "zero_runtime.lr_schedules": ["SCHEDULES", "WARMUP_TYPES", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"],
    "zero_runtime.optimizer": ["Checkpointer", "CommPlan", "FlatUnit", "GradReducer", "MemoryReport", "ModuleHooks",
                               "OptimizerOffload", "ParamOffload", "ParamScheduler", "Phase", "TrainingState",
                               "ZeroConfig", "ZeroOptimizer", "clip_by_norm_", "global_grad_norm", "make_scaler",
                               "measure", "resident"],
    "zero_runtime.offload.cpu_adam": ["AdamHyper", "SQRT_ADDRESS", "SQRT_MATCHES_TORCH", "adam_step"],
    "zero_runtime.offload.swap_file": ["ALIGNMENT", "AioConfig", "SwapFile", "Transfer", "aligned_buffer", "round_up"],
    "zero_runtime.tiled_linear": ["TiledLinear"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_module_still_imports_with_its_names(module):
    imported = importlib.import_module(module)
    missing = [name for name in PUBLIC[module] if not hasattr(imported, name)]
    assert missing == [], f"{module} lost {missing}"


def test_a_name_reached_by_two_paths_is_one_object():
    """A re-export is the object itself, not a copy: isinstance and identity checks hold."""
    import zero_runtime
    import zero_runtime.checkpoint.export
    import zero_runtime.config
    import zero_runtime.offload.swap_file

    assert zero_runtime.ZeroConfig is zero_runtime.config.ZeroConfig
    assert zero_runtime.CheckpointError is zero_runtime.checkpoint.export.CheckpointError
    assert zero_runtime.offload.swap_file.AioConfig is zero_runtime.config.AioConfig
