"""CUDA kernels for zcomm's quantization ops.

The ``.cu`` sources in ``kernels/`` are compiled at run time through cupy/NVRTC
(:mod:`zcomm_cuda.loader`) and launched on torch's current stream
(:mod:`zcomm_cuda.launchers`); :mod:`zcomm.quant.backends.cuda` registers them as the
``cuda`` backend. Importing this package needs no GPU and no cupy.
"""

from .availability import unavailable_reason

__all__ = ["unavailable_reason"]
