"""LoCo error feedback in the runtime (``zero_optimization.zeropp_loco_param``).

Config parsing is single-process. On 4 gloo ranks as 2 nodes x 2 (one spawn for every case):

* the error buffers are INT8 and counted: ``memory_report().error_feedback`` equals, to the
  byte, hop 1's ``W * m`` plus hop 2's ``N * m`` one-byte elements plus a 4-byte scale per
  group of every bucket (``m``: the bucket's slice), and is 0 without LoCo;
* checkpoints carry them: a run resumed from a checkpoint continues bit for bit as the run
  that wrote it (losses and weights), and one resumed with the buffers zeroed does not,
  so the buffers demonstrably matter to the continuation;
* LoCo changes training (the first step equals stateless qgZ: every error starts at zero;
  later steps differ) and keeps it close to plain stage 3.
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

import pytest
import torch

from zcomm.quant import DEFAULT_GROUP_SIZE
from zero_harness import run
from zero_runtime import ZeroConfig
from zero_runtime.config import LocoConfig
from zero_workloads import make_model, make_optimizer, zero_steps

WORLD = 4
LOCO = {"err_beta": 0.8, "reset_T": 1024}
BASE = {"stage": 3, "zero_quantized_gradients": True, "reduce_bucket_size": 3000,
        "stage3_param_persistence_threshold": 0, "zcomm_stage3_fuse_numel": 0}


def _initialize(**extra):
    import zero_runtime

    config = {"zero_optimization": {**BASE, **extra}}
    return zero_runtime.initialize(make_model("gpt"), make_optimizer(), config)


def _expected_bytes(opt) -> int:
    """INT8 bytes of both hops of every bucket, with one fp32 scale per group of qgZ's
    (default) group size, which the buffers reuse."""
    total = 0
    nodes = 2
    for bucket in opt.reducer.buckets:
        m = sum(unit.layout.shard_numel for unit in bucket)
        for numel in (WORLD * m, nodes * m):
            total += numel + 4 * math.ceil(numel / DEFAULT_GROUP_SIZE[4])
    return total


def _cases(rank: int, world: int, root: str) -> dict:
    out = {}
    model, opt = _initialize(zeropp_loco_param=LOCO)
    assert opt.memory_report().error_feedback == 0  # created by each bucket's first reduction
    loco_losses = zero_steps("gpt", model, opt, rank, WORLD, range(3))
    out["bytes"] = (opt.memory_report().error_feedback, _expected_bytes(opt))
    opt.save_checkpoint(Path(root) / "loco")
    out["continued"] = zero_steps("gpt", model, opt, rank, WORLD, range(3, 6))
    out["weights"] = opt.full_state_dict()

    resumed_model, resumed_opt = _initialize(zeropp_loco_param=LOCO)
    resumed_opt.load_checkpoint(Path(root) / "loco")
    out["resumed"] = zero_steps("gpt", resumed_model, resumed_opt, rank, WORLD, range(3, 6))
    out["resumed_weights"] = resumed_opt.full_state_dict()

    zeroed_model, zeroed_opt = _initialize(zeropp_loco_param=LOCO)
    zeroed_opt.load_checkpoint(Path(root) / "loco")
    for feedback in zeroed_opt.plan.reduce_scatter.feedback.values():
        feedback.calls = 0  # the next call restarts from zero error, as a checkpoint without buffers would
    out["zeroed"] = zero_steps("gpt", zeroed_model, zeroed_opt, rank, WORLD, range(3, 6))

    plain_model, plain_opt = _initialize()
    out["stateless"] = zero_steps("gpt", plain_model, plain_opt, rank, WORLD, range(3))
    out["stateless_bytes"] = plain_opt.memory_report().error_feedback
    with pytest.raises(ValueError, match="keeps no state"):
        plain_opt.load_checkpoint(Path(root) / "loco")
    out["loco"] = loco_losses
    return out


def test_loco_buffers_are_counted_checkpointed_and_used():
    with tempfile.TemporaryDirectory() as root:
        results = run(_cases, WORLD, root, env={"ZCOMM_LOCAL_SIZE": "2"})
    for rank, r in enumerate(results):
        measured, expected = r["bytes"]
        assert measured == expected, (rank, measured, expected)
        assert r["stateless_bytes"] == 0
        assert r["resumed"] == r["continued"], rank
        for name, tensor in r["weights"].items():
            assert torch.equal(tensor, r["resumed_weights"][name]), (rank, name)
        assert r["zeroed"] != r["continued"], rank
        assert r["loco"][0] == r["stateless"][0], rank  # every error starts at zero
        assert r["loco"][1:] != r["stateless"][1:], rank
        for ours, theirs in zip(r["loco"], r["stateless"], strict=True):
            assert abs(ours - theirs) < 0.05 * theirs


def test_loco_key_is_validated():
    def parse(value, **zero):
        return ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True,
                                                           "zeropp_loco_param": value, **zero}})

    assert parse({"err_beta": 0.5, "reset_T": 7}).loco == LocoConfig(err_beta=0.5, reset_T=7)
    assert parse({}).loco == LocoConfig(err_beta=0.8, reset_T=1024)  # DeepSpeed's documented defaults
    assert ZeroConfig(stage=3, quantized_gradients=True).loco is None
    with pytest.raises(ValueError, match="unknown config keys: zero_optimization.zeropp_loco_param.reset_t"):
        parse({"err_beta": 0.8, "reset_t": 1024})
    with pytest.raises(ValueError, match="err_beta must be a number in"):
        parse({"err_beta": 1.0})
    with pytest.raises(ValueError, match="reset_T must be an int >= 1"):
        parse({"reset_T": 0.5})
    with pytest.raises(TypeError, match="zeropp_loco_param must be a dict"):
        parse(True)
    with pytest.raises(ValueError, match="needs zero_quantized_gradients"):
        ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "zeropp_loco_param": LOCO}})
