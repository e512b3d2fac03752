"""The runtime's only reads of device values on the host.

[Note: host syncs] Reading a CUDA tensor on the host (``.item()``, ``bool(t)``, ``float(t)``,
``.cpu()``) blocks the Python thread until the GPU has finished everything queued before
it, so the host can no longer run ahead and queue the next kernels and collectives. The
runtime reads a device value only where the algorithm needs a decision on the host, and
only through ``read_flag`` and ``read_counts``:

* fp16 with *dynamic* loss scaling: once per optimizer step, whether the global gradient
  norm is finite. Skipping the torch optimizer's step and changing the loss scale are
  host decisions (torch's ``GradScaler`` makes the same read for non-fused optimizers).
* ``load_checkpoint``: once per load, whether every rank validated its file.
* weight differences (``zcomm_weight_delta_bits``): once per unit and step, after the
  unit's gather, the most groups any rank sent as values instead of differences, which
  decides whether flagged groups are replaced and whether a second gather runs and how
  large it is ([Note: fallback slots] in ``comm._weight_delta``), read together with all
  ranks' total (the ``fallback_groups`` statistic).

Nothing else on a step reads device values: gradient hooks and buckets, the other gathers,
loss scaling (a Python float), clipping (a multiplication by a clamped device scalar, as in
``torch.nn.utils.clip_grad_norm_``) and ``memory_report`` (sizes only). Checkpoint saves
copy to the host inside ``torch.save``, off the step path. The fake-CUDA tests
(``tests/runtime/test_zero_fake_cuda.py``, ``test_zeropp_fake_cuda.py``) enforce this: fake
tensors have no values, so any other host read raises there, and they replace these
functions to script their answers and count their calls.
"""

from __future__ import annotations

import torch


def read_flag(flag: torch.Tensor) -> bool:
    """``flag`` (one element, on any device) as a Python bool: a host sync on CUDA."""
    assert flag.numel() == 1, flag.shape
    return bool(flag.item())


def read_counts(counts: torch.Tensor) -> list[int]:
    """``counts`` (a few integers, on any device) as Python ints, in one host sync on CUDA."""
    assert counts.dim() == 1 and not counts.is_floating_point(), (counts.shape, counts.dtype)
    return counts.tolist()
