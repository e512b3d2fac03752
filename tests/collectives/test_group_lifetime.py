"""zcomm's per-group state goes with its group ([Note: plan cache lifetime] in zcomm._plan_cache).

After ``destroy_process_group(g)`` and the caller's last reference to ``g`` dropped, nothing
zcomm made for ``g`` may keep it alive: its plans (with the checked call shapes) and its detected
topology are gone, its CPU workers' threads exit, and the private subgroups zcomm created
for it are destroyed (torch keeps a group in its registry until it is destroyed, so a
subgroup nobody destroys would hold its sockets and threads for the rest of the process).

* control: a group used only with torch's own collective is collected once destroyed and
  dropped, so whatever keeps a group alive below is zcomm's;
* a group used with every quantized collective (sync, async, coalesced, error feedback,
  prepared calls, the counted plain collectives, an hpZ block) is collected, and so are its
  workers and subgroups;
* the world, destroyed with everything by ``destroy_process_group()``, is collected too;
* a prepared call holds its group: the group and its subgroups live as long as the call;
* zero_runtime's ZeRO++ engine, closed and dropped, lets its group go;
* a live group keeps its plans: a second call finds the very plan of the first.

A world of one gloo rank, in this process; the hops' subgroups (which need peers) in one
spawn of two ranks.
"""

from __future__ import annotations

import gc
import threading
import traceback
import weakref
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zcomm
from cuda_support import requires_gpu
from spawn_harness import run_distributed
from zcomm import _chain_runner, _groups, _plan_cache, _torch_compat
from zcomm import topology as topology_module
from zcomm.all_gather_q8 import prepare_all_gather_q8
from zcomm.reduce_scatter_q4 import prepare_reduce_scatter_q4_coalesced

NUMEL = 1024
SIZES = (100, 200, 300, 424)


def _cache_sizes() -> dict[str, int]:
    """How many groups each of zcomm's per-group caches holds an entry for."""
    return {"plans": len(_plan_cache._PLANS), "groups": len(_groups._GROUPS),
            "workers": len(_chain_runner._WORKERS), "hostnames": len(topology_module._DETECTED_BY_HOSTNAME)}


def _worker_threads(group: dist.ProcessGroup) -> list[threading.Thread]:
    """The threads of ``group``'s CPU workers (one per topology and kind that ran a chain)."""
    return [thread for executor in _chain_runner._WORKERS.get(group, {}).values() for thread in executor._threads]


def _use_everything(group: dist.ProcessGroup, passed: dist.ProcessGroup | None | str = "group",
                    device: str = "cpu") -> None:
    """Every quantized collective of zcomm on ``group``, on tensors on ``device``, with the caches'
    and workers' first entries made; the collectives are given ``passed`` (``"group"``: ``group``;
    None: the world by default)."""
    if passed == "group":
        passed = group
    world = dist.get_world_size(group)
    x, full, out = (torch.randn(NUMEL, device=device), torch.empty(world * NUMEL, device=device),
                    torch.empty(NUMEL, device=device))
    inputs = [torch.randn(world * n, device=device) for n in SIZES]
    outputs = list(torch.empty(NUMEL, device=device).split(list(SIZES)))
    zcomm.all_gather_q8(full, x, passed)  # topology detected by host names: the group's first call
    zcomm.all_gather_q8(full, x, group, async_op=True).wait()  # the group itself: the same caches
    zcomm.reduce_scatter_q4(out, full, group=passed, group_size=64)
    zcomm.reduce_scatter_q4(out, full, group=passed, error_feedback=zcomm.ErrorFeedback())
    zcomm.reduce_scatter_q4_coalesced(outputs, inputs, group=passed, async_op=True).wait()
    zcomm.all_gather_into_tensor(full, x, passed)
    zcomm.reduce_scatter_tensor(out, full, group=passed)
    gather = prepare_all_gather_q8(full, x, passed)
    gather(full, x)
    reduce = prepare_reduce_scatter_q4_coalesced(outputs, inputs, group=passed, with_error_feedback=True)
    reduce(outputs, inputs, error_feedback=zcomm.ErrorFeedback())
    zcomm.consecutive_group(passed, 1)  # an hpZ block: a subgroup zcomm creates for the group


def _destroy_and_drop(make: Callable[[], dist.ProcessGroup], use: Callable[[dist.ProcessGroup], object],
                      destroy: Callable[[dist.ProcessGroup], object] = dist.destroy_process_group,
                      ) -> tuple[weakref.ref, list[threading.Thread], list[dist.ProcessGroup]]:
    """Make a group, ``use`` it, ``destroy`` it and drop it: (a reference to it, its workers'
    threads, the subgroups zcomm made for it)."""
    group = make()
    use(group)
    threads = _worker_threads(group)
    subgroups = list(_groups._GROUPS.get(group, {}).values())
    dead = weakref.ref(group)
    destroy(group)
    del group
    gc.collect()
    return dead, threads, subgroups


def test_is_registered_until_destroyed(gloo_world) -> None:
    """What zcomm reads of torch's registry of groups (a private one: zcomm._torch_compat)."""
    group = dist.new_group([0])
    assert _torch_compat.is_registered(group) and _torch_compat.is_registered(gloo_world)
    dist.destroy_process_group(group)
    assert not _torch_compat.is_registered(group) and _torch_compat.is_registered(gloo_world)


def test_torch_lets_a_destroyed_group_go(gloo_world) -> None:
    x, full = torch.randn(NUMEL), torch.empty(NUMEL)
    dead, _, _ = _destroy_and_drop(lambda: dist.new_group([0]),
                                   lambda group: _torch_compat.all_gather_single(full, x, group=group))
    assert dead() is None, [type(referrer).__name__ for referrer in gc.get_referrers(dead())]


def test_zcomm_lets_a_destroyed_group_go(gloo_world) -> None:
    before = _cache_sizes()
    dead, threads, subgroups = _destroy_and_drop(lambda: dist.new_group([0]), _use_everything)
    assert dead() is None, [type(referrer).__name__ for referrer in gc.get_referrers(dead())]
    assert _cache_sizes() == before
    assert threads and subgroups  # what the test watches did exist
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive(), thread.name
    for subgroup in subgroups:
        assert not _torch_compat.is_registered(subgroup), "a subgroup of a collected group was not destroyed"


def test_zcomm_lets_a_destroyed_world_go() -> None:
    """The world, used through ``group=None``, destroyed with everything by ``destroy_process_group()``:
    torch destroys zcomm's subgroups itself, and zcomm lets the world object go."""
    before = _cache_sizes()

    def make() -> dist.ProcessGroup:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return dist.group.WORLD

    def destroy(world: dist.ProcessGroup) -> None:
        dist.destroy_process_group()

    dead, threads, subgroups = _destroy_and_drop(make, lambda world: _use_everything(world, None), destroy)
    assert dead() is None, [type(referrer).__name__ for referrer in gc.get_referrers(dead())]
    assert _cache_sizes() == before
    assert threads and subgroups
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive(), thread.name


def test_a_prepared_call_keeps_its_group(gloo_world) -> None:
    """The caller owns a prepared call, and it owns its group: destroyed by the caller but held by
    the call, the group stays, with its subgroups and workers, until the call is dropped."""
    x, full = torch.randn(NUMEL), torch.empty(NUMEL)
    prepared = []

    def use(group: dist.ProcessGroup) -> None:
        prepared.append(prepare_all_gather_q8(full, x, group))
        prepared[0](full, x)
        zcomm.consecutive_group(group, 1)

    dead, threads, subgroups = _destroy_and_drop(lambda: dist.new_group([0]), use)
    assert dead() is not None
    assert all(thread.is_alive() for thread in threads) and all(map(_torch_compat.is_registered, subgroups))
    prepared.clear()
    gc.collect()
    assert dead() is None
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive(), thread.name
    assert not any(map(_torch_compat.is_registered, subgroups))


def test_a_live_group_keeps_its_plans(gloo_world) -> None:
    group = dist.new_group([0])
    x, full, out = torch.randn(NUMEL), torch.empty(NUMEL), torch.empty(NUMEL)
    zcomm.all_gather_q8(full, x, group)
    zcomm.reduce_scatter_q4(out, x, group=group)
    plans = dict(_plan_cache._PLANS[group])
    threads = _worker_threads(group)
    gc.collect()
    zcomm.all_gather_q8(full, x, group)
    zcomm.reduce_scatter_q4(out, x, group=group)
    assert len(plans) == 2 and all(_plan_cache._PLANS[group][key] is plan for key, plan in plans.items())
    assert _worker_threads(group) == threads and all(thread.is_alive() for thread in threads)


def test_a_closed_engine_lets_its_group_go(gloo_world) -> None:
    """zero_runtime's ZeRO++ engine holds its prepared calls (and so its group): once closed and
    dropped, its group and its workers go. With qgZ the engine makes no gradient group of the
    same ranks ([Note: communicators per rank] in zero_runtime.comm._plan)."""
    import zero_runtime

    config = {"train_micro_batch_size_per_gpu": 1,
              "zero_optimization": {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True}}

    def train(group: dist.ProcessGroup) -> None:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
        model, opt = zero_runtime.initialize(model, lambda params: torch.optim.AdamW(params, lr=1e-3), config,
                                             group=group)
        for _ in range(2):
            opt.backward(model(torch.randn(4, 8)).square().mean())
            opt.step()
            opt.zero_grad()
        assert group not in _groups._GROUPS  # no consecutive_group(group, ...) for the gradients
        engine.append(weakref.ref(opt))
        opt.close()

    engine: list[weakref.ref] = []
    dead, own_threads, subgroups = _destroy_and_drop(lambda: dist.new_group([0]), train)
    del subgroups
    gc.collect()
    assert dead() is None and all(ref() is None for ref in engine)
    assert own_threads  # qwZ's and qgZ's workers on the group
    for thread in own_threads:
        thread.join(timeout=30)
        assert not thread.is_alive(), thread.name


def _hops_destroyed_with_their_group(rank: int, world_size: int) -> tuple[int, int]:
    """On 2 nodes of one rank: qwZ's and qgZ's inter-node subgroups, destroyed with their parent."""
    before = len(_plan_cache._PLANS), len(_groups._GROUPS), len(_chain_runner._WORKERS)
    dead, threads, subgroups = _destroy_and_drop(lambda: dist.new_group([0, 1]), _use_everything)
    assert dead() is None, [type(referrer).__name__ for referrer in gc.get_referrers(dead())]
    after = len(_plan_cache._PLANS), len(_groups._GROUPS), len(_chain_runner._WORKERS)
    assert after == before, (before, after)
    for thread in threads:
        thread.join(timeout=30)
        assert not thread.is_alive(), thread.name
    assert not any(map(_torch_compat.is_registered, subgroups))
    return len(subgroups), len(threads)


def test_hops_subgroups_are_destroyed_with_their_group() -> None:
    results = run_distributed(_hops_destroyed_with_their_group, 2, env={"ZCOMM_LOCAL_SIZE": "1"})
    # a gather and a reduce inter-node group and the hpZ block; a gather and a reduce worker
    assert results == [(3, 2), (3, 2)]


def _nccl_group_goes(results, bound: bool) -> None:
    """In a process of its own: a one-rank NCCL world (bound to the GPU: zcomm splits its
    subgroups from their parent; or not), a group of it used by every collective on CUDA
    tensors, destroyed and dropped. Reports (collected, subgroups, subgroups still registered)."""
    try:
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                **({"device_id": device} if bound else {}))
        try:
            dead, _, subgroups = _destroy_and_drop(lambda: dist.new_group([0]),
                                                   lambda group: _use_everything(group, device="cuda"))
            torch.cuda.synchronize()
            results.put((True, (dead() is None, len(subgroups), sum(map(_torch_compat.is_registered, subgroups)))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # reported to the test, which fails with the traceback
        results.put((False, traceback.format_exc()))


@requires_gpu
@pytest.mark.parametrize("bound", [True, False], ids=["bound", "unbound"])
def test_an_nccl_group_goes_with_its_subgroups(bound: bool) -> None:
    """On NCCL: the group is collected, and its hpZ block (split from it when the world is bound)
    is destroyed, without a hang. A process per case: a bound world once per process
    ([Note: one bound world per process] in test_collectives_cuda)."""
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    child = context.Process(target=_nccl_group_goes, args=(results, bound), daemon=True)
    child.start()
    child.join(300)
    if child.is_alive():
        child.kill()
        child.join()
        pytest.fail("the NCCL case did not finish in 300 s (a hang destroying a group?)")
    assert not results.empty(), f"the NCCL case died with exit code {child.exitcode}"
    ok, value = results.get()
    assert ok, value
    assert value == (True, 1, 0)  # collected; its one subgroup (the hpZ block) destroyed
