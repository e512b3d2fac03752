"""A bench.train run leaves no engine behind: [Note: gradient hook handles] in zero_runtime.comm._grad_reduce.

One launch builds an engine per configuration and round; each must be collectable after
its run, or their buffers stack up in device memory. Checked on a 1-rank gloo group in
this process, for the configurations whose engines hook every parameter (stage 3, ZeRO++).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from bench.train.configs import CONFIGS, EngineSetup, engine_config
from bench.train.models import GPTConfig, model_spec
from bench.train.runner import ZeroRunner


@pytest.fixture
def one_rank() -> Iterator[None]:
    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("name", ["zero3", "zeropp"])
def test_a_closed_zero_engine_is_collected(name: str, one_rank: None) -> None:
    spec = model_spec("tinygpt", GPTConfig(vocab_size=256, seq_len=8, d_model=16, n_heads=2, n_layers=1))
    setup = EngineSetup(lr=1e-3, local_size=1, world_size=1, bf16=False, gradient_clipping=0.0, micro_batch=2,
                        device=torch.device("cpu"))
    runner = ZeroRunner(CONFIGS[name], spec, engine_config(CONFIGS[name], setup), setup)
    tokens = torch.randint(0, 256, (2, 9))
    runner.train_step(tokens)  # the gradient hooks have run
    model, optimizer = weakref.ref(runner.model), weakref.ref(runner.opt)
    runner.close()
    del runner
    gc.collect()
    assert model() is None and optimizer() is None
