"""A collective's plan resolves every kernel it launches before its first hop ([Note: one plan per
call] in zcomm._plan, [Note: planned kernels] in zcomm.quant._contract).

On this CPU machine the collectives run the ``cuda`` backend's real launch code on CPU tensors:
torch's fake process group plays rank 1 of 2 nodes x 2 ranks (hops return at once, no data
moves), the plans take the cuda backend's planner, and the GPU-only steps of a launch plan
(compiling, loading and sizing a kernel, uploading tables; ``tests/cuda_fakes.py``) and the
launch itself record into one timeline with every hop issued. What the chains compute is
garbage here; the order of events is what is checked: no kernel is resolved after the call's
first hop (so nothing compiles between hops, e.g. qgZ's ``dequant_reduce.cu`` after its
intra-node all-to-all), a later call of the same shape resolves nothing, and a resolution
that fails raises before any hop is issued.
"""

from __future__ import annotations

import importlib
import threading

import pytest
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

import zcomm
from cuda_fakes import fake_launch_plans
from zcomm import _hop_release
from zcomm.quant import _capture, _contract, _registry
from zcomm.quant.backends import _cuda_launch as cuda_launch
from zcomm_cuda import loader

TOPOLOGY = zcomm.Topology(world_size=4, local_size=2)
qwz = importlib.import_module("zcomm.all_gather_q8")
qgz = importlib.import_module("zcomm.reduce_scatter_q4")


@pytest.fixture
def fake_world():
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def timeline(monkeypatch: pytest.MonkeyPatch, fake_world) -> list[tuple[str, str]]:
    """("resolve", kernel or "load <source>"), ("launch", kernel) and ("hop", collective) in the order they happen."""
    events: list[tuple[str, str]] = []
    lock = threading.Lock()

    def record(kind: str, name: str) -> None:
        with lock:
            events.append((kind, name))

    resolved = fake_launch_plans(monkeypatch)
    fake_resolve = cuda_launch.resolve_kernel

    def resolve_kernel(source: str, name: str, index: int) -> int:
        record("resolve", name)
        return fake_resolve(source, name, index)

    monkeypatch.setattr(cuda_launch, "resolve_kernel", resolve_kernel)
    monkeypatch.setattr(cuda_launch, "load_sources",
                        lambda sources, device: [record("resolve", f"load {source}") for source in sources])
    monkeypatch.setattr(loader, "launch", lambda source, name, *args: record("launch", name))
    start_hop = _hop_release.start_hop

    def hop(collective, received, send, group):
        record("hop", collective.__name__)
        return start_hop(collective, received, send, group)

    for module in (qwz, qgz):
        monkeypatch.setattr(module, "start_hop", hop)
    # the plans take the cuda backend's planner and kernels (which run on any tensor here)
    monkeypatch.setattr(_registry, "select", lambda backend, device: "cuda")
    for op in _contract.SCHEMAS:
        monkeypatch.setitem(_contract._KERNELS, (op, "cuda"), getattr(cuda_launch, op))
    monkeypatch.setitem(_contract._PLANNERS, "cuda", cuda_launch.plan_kernels)
    assert resolved == []
    return events


def _resolved_before_hops(events: list[tuple[str, str]]) -> None:
    kinds = [kind for kind, _ in events]
    assert "hop" in kinds and "launch" in kinds, events
    first_hop = kinds.index("hop")
    assert "resolve" not in kinds[first_hop:], events


CALLS = {
    "all_gather_q8": lambda x, out: zcomm.all_gather_q8(out, x, topology=TOPOLOGY, group_size=64),
    "all_gather_q8 pipelined": lambda x, out: zcomm.all_gather_q8(out, x, topology=TOPOLOGY, group_size=64,
                                                                  pipeline_stages=3),
    "reduce_scatter_q4": lambda x, out: zcomm.reduce_scatter_q4(out[: x.numel() // 4], x, topology=TOPOLOGY,
                                                                group_size=64, op=dist.ReduceOp.AVG),
    "reduce_scatter_q4 2 stages, INT8 first hop": lambda x, out: zcomm.reduce_scatter_q4(
        out[: x.numel() // 4], x, topology=TOPOLOGY, group_size=64, pipeline_stages=2, first_hop_bits=8),
    "reduce_scatter_q4_coalesced": lambda x, out: zcomm.reduce_scatter_q4_coalesced(
        list(out[: x.numel() // 4].split([96, 160])), [x[: 4 * 96], x[4 * 96 :]], topology=TOPOLOGY, group_size=64),
    "reduce_scatter_q4 hadamard": lambda x, out: zcomm.reduce_scatter_q4(
        out[: x.numel() // 4], x, topology=TOPOLOGY, group_size=64, hadamard_block=16),
}


@pytest.mark.parametrize("call", CALLS.values(), ids=CALLS.keys())
def test_no_kernel_is_resolved_between_hops(timeline, call) -> None:
    x, out = torch.randn(1024), torch.empty(4 * 1024)
    call(x, out)
    _resolved_before_hops(timeline)
    names = {name for kind, name in timeline if kind == "launch"}
    assert names <= {name for kind, name in timeline if kind == "resolve"}, names
    timeline.clear()
    call(x, out)  # the same shape: the plan is found, nothing is resolved again
    kinds = {kind for kind, _ in timeline}
    assert "resolve" not in kinds and {"hop", "launch"} <= kinds, timeline


def test_error_feedback_resolves_before_hops(timeline) -> None:
    """With error feedback (its second call restores the stored errors), every kernel of the chain and
    of the feedback's steps is planned ([Note: feedback kernels] in zcomm._error_feedback)."""
    x, out = torch.randn(1024), torch.empty(256)
    feedback = zcomm.ErrorFeedback()
    for _ in range(2):
        zcomm.reduce_scatter_q4(out, x, topology=TOPOLOGY, group_size=64, error_feedback=feedback)
        _resolved_before_hops(timeline)
        timeline.clear()
    assert feedback.calls == 2


def test_a_failing_resolution_raises_before_any_hop(timeline, monkeypatch: pytest.MonkeyPatch) -> None:
    """A compile (or load) that fails when the plan is made raises on the calling rank before it
    issues a hop, so its peers are not left waiting inside a collective."""
    def fail(source: str, name: str, index: int) -> int:
        raise RuntimeError(f"NVRTC failed on {source}")

    monkeypatch.setattr(cuda_launch, "resolve_kernel", fail)
    x, out = torch.randn(1024), torch.empty(4 * 1024)
    for call in CALLS.values():
        with pytest.raises(RuntimeError, match="NVRTC failed"):
            call(x, out)
    assert not [event for event in timeline if event[0] == "hop"], timeline


def test_a_requant_launch_check_raises_before_any_hop(timeline, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host checks of the re-quantizing kernel ([Note: narrow sizes]) run when qgZ's plan is
    made: a launch whose sizes break the kernel's invariant raises LaunchCheckError there."""
    monkeypatch.setattr(cuda_launch, "narrow_requant_sizes", lambda *args: (1, 2, 3, 4))
    x, out = torch.randn(1024), torch.empty(256)
    with pytest.raises(cuda_launch.LaunchCheckError, match=r"sizes\.describe\(rows, layout\)"):
        zcomm.reduce_scatter_q4(out, x, topology=TOPOLOGY, group_size=64)
    assert not [event for event in timeline if event[0] == "hop"], timeline


def test_a_plan_is_not_made_under_capture(fake_world, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under CUDA-graph capture a CUDA call with no plan yet raises CaptureError (making a plan
    creates subgroups and uploads tables, which a graph cannot replay) before it does anything."""
    monkeypatch.setattr(_capture, "capturing", lambda: True)
    with FakeTensorMode():
        shard, full = torch.empty(64, device="cuda"), torch.empty(4 * 64, device="cuda")
        with pytest.raises(_capture.CaptureError, match="outside the capture"):
            zcomm.all_gather_q8(full, shard, topology=TOPOLOGY)
        with pytest.raises(_capture.CaptureError, match="outside the capture"):
            zcomm.reduce_scatter_q4(shard, full, topology=TOPOLOGY)
        with pytest.raises(_capture.CaptureError, match="outside the capture"):
            zcomm.prepare_reduce_scatter_q4_coalesced([shard], [full], topology=TOPOLOGY)
