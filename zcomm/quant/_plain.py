"""The tensor classes zcomm's fast paths and prepared calls take as plain dense tensors.

[Note: plain tensors] The fast paths (a plan found by the call's sizes, one check per
tensor) and the prepared calls take tensors of torch's own class only: a subclass (a
DTensor, a tensor wrapping other tensors) may keep its data elsewhere than its storage, so
it goes through the full checks, which raise for it or treat it exactly. ``FakeTensor``
(``torch._subclasses.fake_tensor``, torch's private class behind ``FakeTensorMode``) is the
one subclass taken as plain: it stands for a plain tensor (sizes, dtype, device, no data),
so a call on fake tensors takes the path a call on real ones takes. That is how the fake
CUDA machine of the tests (``tests/fake_cuda.py``) checks the device discipline of the
paths a GPU run uses. ``tests/collectives/test_torch_compat.py`` pins the class.
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

PLAIN_TENSORS = frozenset((torch.Tensor, FakeTensor))
