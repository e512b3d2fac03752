"""What the numba ``cpu`` backend promises beyond its bytes: concurrent calls, resizable storage.

Kernels release the GIL, so a communication thread runs them beside the training thread;
and they leave the caller's tensors resizable. ZeRO-3 and FSDP free a parameter buffer
between uses by resizing its storage to zero and hand that same buffer to ``all_gather_q8``
as ``output``; ``Tensor.numpy()`` would mark the storage non-resizable for good (see [Note:
resizable storage] in ``_cpu_float_bits``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from quant_cases import assert_same_bytes, make_input
from zcomm import quant


def test_concurrent_calls_from_threads() -> None:
    """Each of several simultaneous calls still produces its own exact bytes."""
    inputs = [make_input(200_003, torch.float32, "normal", seed) for seed in range(4)]
    expected = [quant.quantize(x, 4, 128, backend="reference") for x in inputs]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda x: quant.quantize(x, 4, 128, backend="cpu"), inputs * 3))
    for i, got in enumerate(results):
        assert_same_bytes(got, expected[i % len(inputs)], f"threaded quantize #{i}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ops_leave_inputs_and_outputs_resizable(dtype):
    x = torch.linspace(-3, 3, 40).to(dtype)
    payload = quant.quantize(x, 8, 16, backend="cpu")
    out = torch.empty(40, dtype=dtype)
    quant.dequantize(payload.view(1, -1), 40, 8, 16, dtype, out=out, backend="cpu")
    reduced = torch.empty(20, dtype=dtype)
    rows = torch.stack([quant.quantize(half, 4, 20, backend="cpu") for half in x.view(2, 20)])
    quant.dequant_reduce(rows, 20, 4, 20, dtype=dtype, out=reduced, backend="cpu")
    # the ops really wrote through their views (half an INT8 / two INT4 scales of absmax 3)
    torch.testing.assert_close(out.float(), x.float(), atol=0.02, rtol=0)
    torch.testing.assert_close(reduced.float(), x.float().view(2, 20).sum(0), atol=0.5, rtol=0)
    for tensor in (x, payload, out, reduced, rows):
        nbytes = tensor.untyped_storage().nbytes()
        tensor.untyped_storage().resize_(0)
        tensor.untyped_storage().resize_(nbytes)
