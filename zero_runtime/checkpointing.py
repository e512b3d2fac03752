"""The former path of activation checkpointing, still importable: the module is
:mod:`zero_runtime.activation_checkpointing` (named so that it is not taken for the sharded
checkpoints of :mod:`zero_runtime.checkpoint`); this module re-exports its public names."""

from .activation_checkpointing import ActivationCheckpointingConfig, Checkpointer, checkpoint, unknown_keys_error

__all__ = ["ActivationCheckpointingConfig", "Checkpointer", "checkpoint", "unknown_keys_error"]
