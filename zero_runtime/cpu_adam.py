"""The public path ``zero_runtime.cpu_adam``: the fused CPU Adam/AdamW step lives in
:mod:`zero_runtime.offload.cpu_adam`; this module re-exports its public names."""

from .offload.cpu_adam import SQRT_ADDRESS, SQRT_MATCHES_TORCH, AdamHyper, adam_step

__all__ = ["AdamHyper", "adam_step", "SQRT_ADDRESS", "SQRT_MATCHES_TORCH"]
