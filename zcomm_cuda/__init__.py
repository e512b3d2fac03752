"""CUDA kernels for zcomm's quantization ops, and their run-time loader.

A leaf package: the ``.cu`` sources in ``kernels/``, compiled at run time with NVRTC and
launched on torch's current stream (:mod:`zcomm_cuda.loader`), and whether they can run
here (:mod:`zcomm_cuda.availability`). It imports nothing from zcomm; the ``cuda`` backend
(:mod:`zcomm.quant.backends.cuda`) implements zcomm's kernel contract with it. Importing
this package needs no GPU and no cupy.
"""

from .availability import unavailable_reason

__all__ = ["unavailable_reason"]
