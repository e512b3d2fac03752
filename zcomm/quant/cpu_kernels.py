"""Building blocks for numba CPU kernels outside ``zcomm.quant`` (e.g. ``zero_runtime.offload.cpu_adam``).

* :func:`use_thread_share`: call right before a parallel numba launch so it uses the rank's
  share of threads (see [Note: kernel threads] in ``zcomm.quant.backends.cpu``);
* :func:`shared_array` / :func:`kernel_view`: numpy views of CPU tensors for the kernels,
  16-bit floats as their bit patterns (see ``zcomm.quant.backends._cpu_float_bits``);
* :func:`load_f32` / :func:`store_f32` (numba only): read/write such a view as fp32, with
  torch's conversions (round to nearest even, canonical NaN).
"""

from ._threads import use_thread_share
from .backends._cpu_float_bits import kernel_view, load_f32, shared_array, store_f32

__all__ = ["use_thread_share", "shared_array", "kernel_view", "load_f32", "store_f32"]
