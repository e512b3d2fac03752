"""DeepSpeed's runner without DeepSpeed: its missing-package row and how its errors become row notes."""

from __future__ import annotations

import sys

import pytest
import torch

from bench.train.configs import CONFIGS, EngineSetup
from bench.train.models import GPTConfig, model_spec
from bench.train.runner import DeepSpeedRunner, EngineFailed, Unavailable, _guarded, describe_failure


def _builder() -> None:
    raise ValueError("This op had not been\n  implemented on CPU backend.")


def _engine() -> None:
    _builder()


def test_failure_names_the_error_the_raising_frame_and_its_caller() -> None:
    with pytest.raises(ValueError) as info:
        _engine()
    text = describe_failure("deepspeed.initialize", info.value)
    assert text.startswith("deepspeed.initialize raised ValueError: This op had not been implemented on CPU backend.")
    raise_line = _builder.__code__.co_firstlineno + 1
    call_line = _engine.__code__.co_firstlineno + 1
    here = "test_deepspeed_runner.py"
    assert f"(at {here}:{raise_line}, called from {here}:{call_line}: `_builder()`)" in text


def test_errors_inside_the_engine_become_engine_failed_with_the_cause() -> None:
    with pytest.raises(EngineFailed, match="a step raised ValueError: This op") as info:
        _guarded("a step", _engine)
    assert isinstance(info.value.__cause__, ValueError)
    assert _guarded("a step", lambda: 3) == 3


def test_without_deepspeed_the_row_is_unavailable_with_the_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # import deepspeed raises ImportError
    spec = model_spec("tinygpt", GPTConfig(seq_len=8, d_model=16, n_heads=2, n_layers=1))
    with pytest.raises(Unavailable, match=r"deepspeed-z3 needs deepspeed \(make peers"):
        setup = EngineSetup(lr=1e-3, local_size=1, world_size=1, bf16=False, gradient_clipping=0.0, micro_batch=1,
                            device=torch.device("cpu"))
        DeepSpeedRunner(CONFIGS["deepspeed-z3"], spec, {}, setup)
