"""[Note: device guards]: the rank's GPU comes from the tensors or the group, and two ranks of a
host on one GPU under NCCL raise a clear error, checked once per group.

A CPU build of torch has no NCCL and no GPU, so the backend's name and ``torch.cuda``'s device
functions are faked, as in ``test_side_stream.py``; the store is a real ``HashStore`` shared by
threads that play the ranks of one host.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
import torch.distributed as dist

import zcomm
from zcomm import _device_guard
from zcomm import topology as topology_module


def _ranks_meeting(keys: list[str], store: dist.Store | None = None) -> list[object]:
    """``count_sharing`` run by one thread per key on one store: each rank's count, or its error."""
    store = store if store is not None else dist.HashStore()
    results: list[object] = [None] * len(keys)

    def rank(index: int) -> None:
        try:
            results[index] = _device_guard.count_sharing(store, len(keys), keys[index])
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results[index] = exc

    threads = [threading.Thread(target=rank, args=(i,)) for i in range(len(keys))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


def test_store_count_sees_ranks_sharing_a_gpu_only_after_every_rank_arrived() -> None:
    assert _ranks_meeting(["a/0", "a/1", "b/0", "b/1"]) == [1, 1, 1, 1]
    assert _ranks_meeting(["a/0", "a/0", "b/0", "b/1"]) == [2, 2, 1, 1]  # srun without set_device on host a
    store = dist.HashStore()  # a group re-created under its name meets at the same keys: counted anew
    for _ in range(3):
        assert _ranks_meeting(["a/0", "a/1"], store) == [1, 1]


@pytest.fixture
def fake_nccl(gloo_world, monkeypatch):
    """The 1-rank gloo world named an NCCL group, with fake CUDA device functions and a store log."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(_device_guard, "_CHECKED", type(_device_guard._CHECKED)())
    state = {"current": 0, "entered": [], "store_calls": 0, "sharing": 1}
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])

    @contextlib.contextmanager
    def device(index):
        state["entered"].append(torch.device(index))
        yield

    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(_device_guard, "_gpu_key", lambda device: f"host/{device.index}")

    def count_sharing(store, world_size, key):
        state["store_calls"] += 1
        return state["sharing"]

    monkeypatch.setattr(_device_guard, "count_sharing", count_sharing)
    return state


def test_two_ranks_on_one_gpu_raise_naming_the_fix_once_per_group(fake_nccl) -> None:
    fake_nccl["sharing"] = 2
    with pytest.raises(RuntimeError, match=r"torch\.cuda\.set_device\(local_rank\).*device_id"):
        _device_guard.check_distinct_gpus(dist.group.WORLD, torch.device("cuda", 0))
    fake_nccl["sharing"] = 1
    _device_guard.check_distinct_gpus(dist.group.WORLD, torch.device("cuda", 0))
    _device_guard.check_distinct_gpus(dist.group.WORLD, torch.device("cuda", 0))
    assert fake_nccl["store_calls"] == 2, "checked until it passed once, then never again for the group"


def test_no_check_off_nccl_or_off_cuda(gloo_world, monkeypatch) -> None:
    monkeypatch.setattr(_device_guard, "_CHECKED", type(_device_guard._CHECKED)())

    def fail(*args):
        raise AssertionError("the store was used")

    monkeypatch.setattr(_device_guard, "count_sharing", fail)
    _device_guard.check_distinct_gpus(dist.group.WORLD, torch.device("cpu"))
    _device_guard.check_distinct_gpus(dist.group.WORLD, torch.device("cuda", 1))  # gloo: CUDA work is not NCCL's
    assert not _device_guard._object_collective_device_needed(dist.group.WORLD)


def test_object_collective_runs_on_the_tensors_device_then_the_bound_then_the_current(fake_nccl) -> None:
    world = dist.group.WORLD
    fake_nccl["current"] = 3
    with _device_guard.object_collective_device(world, torch.device("cuda", 1)):
        pass
    with _device_guard.object_collective_device(world):
        pass
    assert fake_nccl["entered"] == [torch.device("cuda", 1), torch.device("cuda", 3)]


def test_topology_detect_exchanges_host_names_on_the_given_gpu(fake_nccl, monkeypatch) -> None:
    """Without any local-size variable, detect's object all-gather runs inside the rank's device."""
    for variable in topology_module.LOCAL_SIZE_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(topology_module, "_DETECTED_BY_HOSTNAME", type(topology_module._DETECTED_BY_HOSTNAME)())
    seen = []

    def all_gather_object(out, value, group=None):
        seen.append(list(fake_nccl["entered"]))
        out[:] = [value] * len(out)

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    found = zcomm.Topology.detect(dist.group.WORLD, device=torch.device("cuda", 2))
    assert found == zcomm.Topology(world_size=1, local_size=1)
    assert seen == [[torch.device("cuda", 2)]] and fake_nccl["store_calls"] == 1


def test_a_collective_on_cuda_tensors_checks_the_gpus_before_any_communication(monkeypatch) -> None:
    """The collectives' prologue runs the check with the tensors' device (fake CUDA tensors, fake
    process group named NCCL), and raises before the collective when two ranks share the GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
        monkeypatch.setattr(_device_guard, "_CHECKED", type(_device_guard._CHECKED)())
        monkeypatch.setattr(_device_guard, "_gpu_key", lambda device: f"host/{device.index}")
        keys = []

        def count_sharing(store, world_size, key):
            keys.append(key)
            return 2

        monkeypatch.setattr(_device_guard, "count_sharing", count_sharing)
        topology = zcomm.Topology(world_size=4, local_size=2)
        with FakeTensorMode():
            shard, full = torch.empty(8, device="cuda:1"), torch.empty(32, device="cuda:1")
            for call in (zcomm.all_gather_into_tensor, zcomm.all_gather_q8):
                with pytest.raises(RuntimeError, match=r"same GPU .*torch\.cuda\.set_device"):
                    call(full, shard, topology=topology)
        assert keys == ["host/1", "host/1"]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend,nccl,object_on_gpu", [
    ("nccl", True, True), ("cpu:gloo,cuda:nccl", True, False), ("gloo", False, False),
    ("cpu:gloo,cuda:gloo", False, False), ("zero_fake_nccl", False, False), ("cuda:zero_fake_nccl", False, False),
])
def test_which_groups_are_nccl(monkeypatch, backend, nccl, object_on_gpu) -> None:
    """NCCL is torch's backend of that name, for CUDA work; object collectives stage on a GPU only
    where no CPU backend is mapped. A backend whose name merely contains "nccl" is not NCCL."""
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert _device_guard.uses_nccl(None) is nccl
    assert _device_guard._object_collective_device_needed(None) is object_on_gpu
