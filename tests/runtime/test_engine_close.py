"""``ZeroOptimizer.close`` releases the engine: [Note: gradient hook handles].

torch keeps each parameter's post-accumulate gradient hook from C++, and the runtime's hook
holds the parameter's unit, so without ``close`` an engine nobody references would never be
collected (its flat buffers and optimizer states stay in memory). Checked in one process, at
stages 2 and 3 with and without ZeRO++, and that a closed engine refuses to train.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import zero_runtime
from zero_harness import initialize_one_rank

SECTIONS = {
    "stage 2": {"stage": 2},
    "stage 3": {"stage": 3},
    "zero++": {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True},
}


def _engine(section: dict) -> tuple[nn.Module, zero_runtime.ZeroOptimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    return initialize_one_rank(model, {"zero_optimization": section})


def _train_step(model: nn.Module, opt) -> None:
    opt.backward(model(torch.randn(4, 8)).square().mean())
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("name", list(SECTIONS))
def test_a_closed_engine_is_collected(single_process, name: str) -> None:
    model, opt = _engine(SECTIONS[name])
    _train_step(model, opt)  # the gradient hooks have run
    refs = weakref.ref(model), weakref.ref(opt)
    opt.close()
    del model, opt
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_a_closed_engine_refuses_to_train(single_process) -> None:
    model, opt = _engine(SECTIONS["stage 3"])
    opt.close()
    with pytest.raises(RuntimeError, match="backward\\(\\) on a closed engine"):
        opt.backward(model(torch.randn(4, 8)).square().mean())
