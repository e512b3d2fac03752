"""bench.train.weight_error on one in-process rank: the windows it reports, the format's bound holding,
and weight differences leaving the weights closer to the masters than qwZ's INT8 values do."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from bench.harness.dist_env import DistContext, DistEnv
from bench.train import weight_error
from bench.train.data import ByteCorpus


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DistContext(env=DistEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, local_size=1,
                                      launcher="single"), device=torch.device("cpu"), backend="gloo")
    finally:
        dist.destroy_process_group()


def test_windows_hold_the_bound_and_differences_beat_int8_values(one_rank):
    args = weight_error._parser().parse_args(["--steps", "6", "--window", "4", "--d-model", "32", "--n-layers", "1",
                                              "--n-heads", "2", "--batch", "2", "--seq-len", "16"])
    corpus = ByteCorpus(16)
    results = {name: weight_error.measure(name, args, one_rank, corpus) for name in ("zero2-q", "zero2-qwd")}
    for windows in results.values():
        assert [(w.first, w.last) for w in windows] == [(1, 4), (5, 6)]
        assert all(0 < w.worst_over_bound <= 1 for w in windows), windows
        assert all(len(w.error_over_weights) == w.last - w.first + 1 for w in windows)
        assert all(-1 <= c <= 1 for w in windows for c in w.error_update_cosine)
    int8, delta = (sum(w.error_over_weights[-1] for w in results[name]) for name in ("zero2-q", "zero2-qwd"))
    assert delta < int8, (delta, int8)
    assert sum(w.groups for w in results["zero2-qwd"]) > 0  # steps 2-6 sent differences
    assert all(w.groups == 0 for w in results["zero2-q"])
    with pytest.raises(ValueError, match="gathers no quantized weights"):
        weight_error.measure("zero2", args, one_rank, corpus)
