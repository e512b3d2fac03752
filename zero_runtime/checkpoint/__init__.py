"""Sharded checkpoints (not activation checkpointing, which is
:mod:`zero_runtime.activation_checkpointing`).

``_sharded`` (save and load of every rank's shard, the consolidated ``state_dict``),
``checkpoint._reshard`` (loading at another world size, stage or bucket layout), ``_error``
(``CheckpointError``) and ``export`` (public: offline consolidation to safetensors).
Nothing is imported here.
"""
