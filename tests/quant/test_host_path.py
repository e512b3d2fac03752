"""The host path of one op call, counted in Python function calls so a regression shows anywhere.

Timing depends on the machine; the number of Python frames one call enters does not. Each
bound is what the path costs today with a little slack, and at most a third of the path
before the ops were defined with ``Library.define`` and validated once (101 frames for one
``quantize`` on the ``cpu`` backend: spec objects built three times, the checks run twice,
``torch.library.custom_op``'s Python wrappers, ctypes pointer objects per array). A change
that adds frames to every call must raise a bound here, on purpose.
"""

from __future__ import annotations

import sys
from typing import Callable

import pytest
import torch

import zcomm.quant as q

NUMEL = 1024


def _frames(call: Callable[[], object]) -> list[str]:
    """The Python functions one ``call()`` enters (C functions are not counted)."""
    call()  # warm: numba compiled, backend loaded, caches filled
    entered: list[str] = []

    def profile(frame, event, arg) -> None:
        if event == "call":
            entered.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    assert entered[0].endswith("<lambda>"), entered
    return entered[1:]  # the frames of the call itself, without this test's lambda


@pytest.fixture(autouse=True)
def _default_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZCOMM_BACKEND", raising=False)


def test_quantize_frames() -> None:
    x = torch.randn(NUMEL)
    out = torch.empty(q.payload_nbytes(NUMEL, 8, 256), dtype=torch.uint8)
    entered = _frames(lambda: q.quantize(x, 8, 256, out=out))
    assert len(entered) <= 33, "\n".join(entered)
    # the checks run once: no QuantSpec is built and the op enters its kernel directly
    assert not [name for name in entered if "spec.py" in name or "custom_ops.py" in name], entered


def test_dequantize_frames() -> None:
    rows = q.quantize(torch.randn(NUMEL), 8, 256).view(1, -1).expand(4, -1).contiguous()
    out = torch.empty(4 * NUMEL, dtype=torch.float32)
    entered = _frames(lambda: q.dequantize(rows, NUMEL, 8, 256, torch.float32, out=out))
    assert len(entered) <= 25, "\n".join(entered)


def test_reference_backend_is_its_own_namespace() -> None:
    """``backend="reference"`` calls ``torch.ops.zcomm_reference``: the oracle, chosen explicitly."""
    x = torch.randn(NUMEL)
    entered = _frames(lambda: q.quantize(x, 8, 256, backend="reference"))
    assert "reference.py:quantize" in entered and "cpu.py:quantize" not in entered
    entered = _frames(lambda: q.quantize(x, 8, 256))
    assert "cpu.py:quantize" in entered and "reference.py:quantize" not in entered


def test_all_gather_q8_frames(tmp_path) -> None:
    """One ``all_gather_q8`` call on a world of one (gloo), on the calling thread: the prologue
    and the plan come from their caches (no topology detection, no environment read, no
    checks run again), then the chain is handed to the gather worker (whose frames run on
    its thread and are not counted here)."""
    import torch.distributed as dist

    import zcomm

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        x = torch.randn(NUMEL)
        out = torch.empty(NUMEL)
        entered = _frames(lambda: zcomm.all_gather_q8(out, x))
        assert len(entered) <= 40, "\n".join(entered)
        assert not [name for name in entered if name.endswith((":detect", ":prologue", ":_make_plan", ":get"))
                    and not name.startswith("weakref.py")], entered
    finally:
        dist.destroy_process_group()
