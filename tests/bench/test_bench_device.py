"""The benchmarks' device awareness, checked on a CPU machine.

Each rank's device and backend come from ``bench.harness.dist_env`` (CUDA + NCCL when a GPU
is visible); ``bench.collectives.catalog`` allocates every buffer a collective's ``prepare`` sees on
that device (checked with ``meta``, a device that is neither the CPU nor needs one);
``bench.harness.timing`` picks CUDA
events for a CUDA device and reduces over the ranks in a tensor on the group's device
(checked by intercepting ``all_reduce``).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from bench.collectives.catalog import COLLECTIVES, build_case
from bench.harness import dist_env, timing
from bench.harness.dist_env import DistEnv

META = torch.device("meta")


def _env(rank: int = 0, world: int = 2, local_rank: int | None = None) -> DistEnv:
    return DistEnv(rank=rank, world_size=world, local_rank=rank if local_rank is None else local_rank,
                   local_world_size=world, local_size=world, launcher="env")  # fmt: skip


@pytest.mark.parametrize(
    ("choice", "gpus", "local_rank", "expected"),
    [("auto", 0, 1, "cpu"), ("auto", 4, 1, "cuda:1"), ("auto", 2, 3, "cuda:1"), ("cuda", 8, 5, "cuda:5"), ("cpu", 8, 1, "cpu")],
)
def test_select_device_takes_the_local_ranks_gpu(choice, gpus, local_rank, expected):
    env = _env(rank=local_rank, world=8)
    assert dist_env.select_device(env, choice, cuda_devices=gpus) == torch.device(expected)


def test_asking_for_gloo_keeps_an_automatic_device_on_the_cpu():
    assert dist_env.select_device(_env(), "auto", backend="gloo", cuda_devices=4) == torch.device("cpu")
    assert dist_env.select_device(_env(), "cuda", backend="gloo", cuda_devices=4) == torch.device("cuda", 0)
    assert dist_env.select_device(_env(), "auto", backend="nccl", cuda_devices=4) == torch.device("cuda", 0)


def test_select_device_refuses_cuda_without_a_gpu_and_unknown_choices():
    with pytest.raises(ValueError, match="no CUDA device"):
        dist_env.select_device(_env(), "cuda", cuda_devices=0)
    with pytest.raises(ValueError, match="device must be one of"):
        dist_env.select_device(_env(), "tpu", cuda_devices=0)


def test_select_device_defaults_to_what_torch_sees():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert dist_env.select_device(_env(rank=0)).type == expected


@pytest.mark.parametrize(
    ("device", "choice", "expected"),
    [("cuda:0", "auto", "nccl"), ("cpu", "auto", "gloo"), ("cuda:1", "gloo", "gloo"), ("cuda:0", "nccl", "nccl"), ("cpu", "gloo", "gloo")],
)
def test_backend_follows_the_device_unless_overridden(device, choice, expected):
    assert dist_env.select_backend(torch.device(device), choice) == expected


def test_nccl_on_the_cpu_and_unknown_backends_are_refused():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        dist_env.select_backend(torch.device("cpu"), "nccl")
    with pytest.raises(ValueError, match="backend must be one of"):
        dist_env.select_backend(torch.device("cpu"), "mpi")


def _tensors(run: functools.partial) -> list[torch.Tensor]:
    return [a for a in (*run.args, *run.keywords.values()) if isinstance(a, torch.Tensor)]


@pytest.mark.parametrize("op", list(COLLECTIVES))
def test_every_buffer_of_a_case_is_on_the_requested_device(op):
    case = build_case(COLLECTIVES[op], 64 << 10, env=_env(), device=META, dtype=torch.bfloat16, seed=0, stages=2)
    assert case.device == META
    buffers = _tensors(case.run)
    assert len(buffers) == 2  # output and input, nothing left on the host
    assert all(t.device == META for t in buffers), [t.device for t in buffers]


def test_a_cpu_case_checks_its_output_against_the_oracle():
    case = build_case(COLLECTIVES["all_to_all"], 4096, env=_env(rank=0, world=1), device=torch.device("cpu"),
                      dtype=torch.float32, seed=3)  # fmt: skip
    out, inp = _tensors(case.run)
    out.fill_(float("nan"))
    assert case.check() == case.count
    out.copy_(inp)  # a world of one: all-to-all is the identity
    assert case.check() == 0


@pytest.mark.parametrize(("device", "clock"),
                         [("cuda", timing.CudaEventClock), ("cuda:3", timing.CudaEventClock), ("cpu", timing.HostClock)])
def test_timing_uses_cuda_events_on_a_gpu_and_the_host_clock_on_the_cpu(device, clock):
    chosen = timing.clock_for(torch.device(device))  # creates no CUDA event: works on a CPU-only build
    assert type(chosen) is clock
    if clock is timing.CudaEventClock:
        assert chosen.device == torch.device(device)


def test_no_clock_for_other_devices():
    with pytest.raises(ValueError, match="no clock"):
        timing.clock_for(META)


class _Intercepted(Exception):
    pass


@pytest.fixture
def reductions(monkeypatch):
    """Record every all_reduce (device, dtype, op), then stop: meta tensors hold no values to read back."""
    seen = []

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None):
        seen.append((tensor.device, tensor.dtype, op))
        raise _Intercepted

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "barrier", lambda group=None: None)
    return seen


def test_reduce_over_ranks_uses_a_tensor_on_the_given_device(reductions):
    with pytest.raises(_Intercepted):
        timing.reduce_over_ranks([1.0, 2.0], dist.ReduceOp.MAX, device=META)
    assert reductions == [(META, torch.float64, dist.ReduceOp.MAX)]


def test_time_collective_reduces_its_max_on_the_groups_device(reductions, monkeypatch):
    monkeypatch.setattr(timing, "clock_for", lambda device: timing.HostClock())
    calls = []
    with pytest.raises(_Intercepted):
        timing.time_collective(lambda: calls.append(1), iters=3, warmup=2, device=META)
    assert len(calls) == 5
    assert reductions == [(META, torch.float64, dist.ReduceOp.MAX)]


@pytest.fixture
def gloo_world_of_one():
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_time_collective_on_the_cpu(gloo_world_of_one):
    count = [0]

    def fn():
        count[0] += 3

    result = timing.time_collective(fn, iters=4, warmup=1, device=torch.device("cpu"), counter=lambda: count[0])
    assert result.seconds > 0
    assert result.counter_delta == 3.0  # per call, summed over the one rank
    assert count[0] == 15


def test_time_collective_rejects_bad_counts():
    with pytest.raises(ValueError, match="iters"):
        timing.time_collective(lambda: None, iters=0, warmup=0, device=torch.device("cpu"))
