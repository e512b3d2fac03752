"""Fill an empty numba cache the way any large call does first: one 64K reorder_quantize (parallel path).

A numba signature holds types, not sizes, so this compiles and caches the parallel kernel under the
very signature slow_phase.py's 1K calls use. Run as ``NUMBA_CACHE_DIR=<empty> PYTHONPATH=<tree> python prime_parallel.py``.
"""

import torch

import zcomm.quant as q

q.reorder_quantize(torch.randn(1 << 16), (3, 2, 1, 0), 4, 4, 256)
