"""``python -m zero_runtime.estimate --dry-run``: the real runtime for node 0's ranks of a large job.

The model is the parameter-count spec ``mlp:params=40000,layers=4``: four bias-free 100 x 100
Linear layers, fused (the default ``zcomm_stage3_fuse_numel``) into one unit of 40,000
elements, padded to 40,320 at 384 ranks (105 per rank). With the unit freed after each use, a
step gathers it twice and reduces it once, so node 0's inter-node bytes ([Note: volume per
node] in ``zero_runtime._dry_run``) are, from the byte models: ZeRO-3, only rank 7's ring
crosses nodes, ``3 x 383 x (2 x 105)``; ZeRO++ with hpZ over the node, every rank sends ``47``
qwZ payloads of 105 elements and ``47`` qgZ INT4 rows of its 105-element slice, nothing else.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from scale_cases import payload_bytes
from zero_runtime import estimate
from zero_runtime._dry_run import dry_run

STAGE3 = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
          "stage3_prefetch_bucket_size": 0}
ZEROPP = {"zero_quantized_weights": True, "zero_hpz_partition_size": 8, "zero_quantized_gradients": True}
MODEL = "mlp:params=40000,layers=4"
M = 2 * 40000


def _config(**zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {**STAGE3, **zero}}


def test_dry_run_zero3_node_volume_is_three_model_sizes():
    result = dry_run(config=_config(), model=MODEL, world_size=384, local_size=8, steps=2)
    assert [run.rank for run in result.runs] == list(range(8)) and result.parameters == 40000
    shard = 105
    for step in range(2):
        assert result.node_inter_bytes(0, step) == 3 * 383 * 2 * shard
    for run in result.runs:
        assert run.memory.parameters == 2 * shard and run.memory.secondary_parameters == 0
        assert run.skipped_steps == 0 and run.initialize == {}
        inter = sum(s.inter_bytes for s in run.steps[1].values())
        assert (inter > 0) == (run.rank == 7)  # rank 7's ring neighbour is on node 1
    ratio = result.node_inter_bytes(0, 1) / result.model_bytes
    assert 3.0 < ratio < 3.02  # 3 (W-1)/W M, plus 0.8% padding of 40,000 to 40,320


def test_dry_run_zeropp_node_volume_against_the_byte_model():
    result = dry_run(config=_config(**ZEROPP), model=MODEL, world_size=384, local_size=8, ranks=range(8), steps=1)
    per_rank = 47 * payload_bytes(105, 8) + 47 * payload_bytes(105, 4)
    assert result.node_inter_bytes(0, 0) == 8 * per_rank
    assert {run.memory.secondary_parameters for run in result.runs} == {2 * 40320 // 8}
    # the paper's 0.5 M + 0 + 0.25 M, plus the scales and padding of 105-element payloads
    assert 0.75 < result.node_inter_bytes(0, 0) / M < 0.82  # 0.808: 4 scale bytes and up to 3 padding per payload


def test_node_volume_needs_the_whole_node():
    result = dry_run(config=_config(), model=MODEL, world_size=24, local_size=8, ranks=[0, 23], steps=1)
    assert result.node_inter_bytes(0, 0) is None


def _factory():
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(9, 5), nn.Linear(5, 1)), torch.randn(1, 9)


def test_cli_prints_memory_and_bytes_per_step_at_384_ranks(tmp_path, capsys):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(_config(**ZEROPP)))
    estimate.main(["--dry-run", "--world-size", "384", "--local-size", "8", "--config", str(config),
                   "--model", "test_dry_run:_factory", "--rank", "0", "--rank", "383", "--steps", "2"])
    out = capsys.readouterr().out
    assert "dry run: 384 ranks (48 nodes x 8), stage 3 + qwZ, hpZ 8, qgZ, bf16" in out
    assert "model test_dry_run:_factory: 56 trainable parameters" in out
    for rank, node, local in ((0, 0, 0), (383, 47, 7)):
        assert f"rank {rank} (node {node}, local rank {local})" in out
    assert out.count("MemoryReport") == 2 and out.count("  step 2: intra") == 2
    assert out.count("all_gather_q8") == 4 and "reduce_scatter_q4" in out
    assert "node 0 inter-node bytes" not in out  # only two ranks ran


@pytest.mark.parametrize("argv, message", [
    (["--dry-run", "--world-size", "16"], "--dry-run needs --config"),
    (["--dry-run", "--world-size", "12", "--local-size", "8", "--config", "x.json"], "not a multiple"),
    (["--world-size", "16"], "--params is required"),
    (["--dry-run", "--world-size", "16", "--config", "x.json", "--params", "1e9"], "the model (--model) and the config"),
])
def test_cli_errors(argv, message, capsys):
    with pytest.raises(SystemExit):
        estimate.main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("spec, message", [("gpt:depth=3", "not one of"), ("mlp", "needs params"),
                                           ("nosuch", "unknown model spec"), ("gpt:dim=10,heads=3", "multiple of heads"),
                                           ("test_dry_run:missing", "no callable")])
def test_bad_model_specs(spec, message, tmp_path, capsys):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps(_config()))
    with pytest.raises(SystemExit):
        estimate.main(["--dry-run", "--world-size", "8", "--config", str(config), "--model", spec, "--rank", "0"])
    assert message in capsys.readouterr().err
