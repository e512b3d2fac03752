"""The public path ``zero_runtime.swap_file``: one rank's NVMe swap file lives in
:mod:`zero_runtime.offload.swap_file`; this module re-exports its public names."""

from .offload.swap_file import ALIGNMENT, AioConfig, SwapFile, Transfer, aligned_buffer, round_up

__all__ = ["ALIGNMENT", "AioConfig", "SwapFile", "Transfer", "aligned_buffer", "round_up"]
