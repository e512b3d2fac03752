"""offload_optimizer.zcomm_overlap_step: the offloaded update runs during backward, unit by
unit as gradient buckets complete, and training stays bit-identical to training without
offload (the oracle), through checkpoints and gradient accumulation; the swap pipeline's
ordering; the refusals and the recovery from a failed backward.
"""

from __future__ import annotations

import os

import pytest
import torch

from zero_harness import initialize_one_rank, run
from zero_workloads import assert_trains_alike, loss_of, make_model, state_dicts_equal, train_save_resume

STEPS = 3
FREE_AFTER_USE = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                  "zcomm_stage3_fuse_numel": 0, "stage3_prefetch_bucket_size": 0, "reduce_bucket_size": 3000}
CASES = [  # (name, model, zero_optimization, top-level extras, micro-batches per step)
    ("mlp-s1", "mlp", {"stage": 1}, {}, 1),
    ("mlp-s2-accum", "mlp", {"stage": 2, "reduce_bucket_size": 300}, {}, 2),
    ("gpt-s3", "gpt", {"stage": 3, **FREE_AFTER_USE}, {}, 1),
    ("gpt-s3-accum-persist", "gpt", {"stage": 3, "stage3_param_persistence_threshold": 512}, {}, 2),
    ("gpt-zeropp", "gpt", {"stage": 3, **FREE_AFTER_USE, "zero_quantized_weights": True,
                           "zero_quantized_gradients": True}, {}, 1),
    # offload_param on NVMe as well: the update writes shards the parameter offload swaps
    ("gpt-s3-param-nvme", "gpt", {"stage": 3, **FREE_AFTER_USE, "offload_param": {"device": "nvme"}}, {}, 1),
    # hpZ's secondary partitions follow shards written during backward; bf16 shards apart from the masters
    ("gpt-hpz-param-nvme-bf16", "gpt", {"stage": 3, **FREE_AFTER_USE, "zero_quantized_weights": True,
                                        "zero_quantized_gradients": True, "zero_hpz_partition_size": 2,
                                        "offload_param": {"device": "nvme"}}, {"bf16": {"enabled": True}}, 1),
    ("mlp-s1-schedule", "mlp", {"stage": 1}, {"scheduler": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 2 * STEPS, "warmup_max_lr": 0.02, "warmup_num_steps": 2, "warmup_type": "linear"}}}, 1),
]
SUB_GROUP = 700  # elements: several sub-groups per unit, so the stream cycles its buffers


def _config(zero: dict, extra: dict, accumulation: int, device: str, root: str) -> dict:
    zero = {**zero, "sub_group_size": SUB_GROUP}
    if "offload_param" in zero:
        zero["offload_param"] = {**zero["offload_param"], "nvme_path": root, "buffer_count": 2,
                                 "buffer_size": 10**6}
        if device == "none":  # the oracle: no offload at all
            del zero["offload_param"]
    if device != "none":
        zero["offload_optimizer"] = {"device": device, "zcomm_overlap_step": True,
                                     **({"nvme_path": root, "buffer_count": 4} if device == "nvme" else {})}
    return {"zero_optimization": zero, "gradient_accumulation_steps": accumulation,
            "aio": {"block_size": 8192, "thread_count": 2, "queue_depth": 2}, **extra}


def _train(rank: int, world: int, root: str) -> dict:
    out = {}
    for name, kind, zero, extra, accumulation in CASES:
        for device in ("none", "cpu", "nvme"):
            swap_dir = os.path.join(root, f"{name}-{device}")
            os.makedirs(swap_dir, exist_ok=True)
            config = _config(zero, extra, accumulation, device, swap_dir)
            out[name, device] = train_save_resume(kind, config, rank, world, os.path.join(root, f"ckpt-{name}-{device}"),
                                                  STEPS, accumulation=accumulation)
            out[name, device]["left"] = [f for f in os.listdir(swap_dir) if f"_rank{rank:05d}_" in f]
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run(_train, 2, str(tmp_path_factory.mktemp("overlap")))


@pytest.mark.parametrize("name", [case[0] for case in CASES])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_training_is_bit_identical_to_no_offload(results, name, device):
    assert_trains_alike(results, (name, "none"), (name, device), STEPS)
    assert all(rank[name, device]["left"] == [] for rank in results)


# ----- single process: the update really happens during backward; refusals; recovery -----

def _one_rank(tmp_path, device: str = "nvme", **offload):
    config = {"zero_optimization": {"stage": 3, **FREE_AFTER_USE, "sub_group_size": SUB_GROUP,
                                    "offload_optimizer": {"device": device, "zcomm_overlap_step": True,
                                                          "nvme_path": str(tmp_path), "buffer_count": 4, **offload}}}
    return initialize_one_rank(make_model("gpt"), config)


def _batch(step: int = 0):
    from zero_workloads import global_batch

    return global_batch("gpt", step)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_units_are_updated_during_backward(tmp_path, single_process, device):
    """After backward() (before step()) most shards already hold their new values; step()
    finishes the rest. On NVMe the stream has updated sub-groups and kept some reads ahead."""
    model, opt = _one_rank(tmp_path, device)
    before = [u.shard.clone() for u in opt.units]
    opt.backward(loss_of("gpt", model, _batch()))
    assert opt.offload.in_step
    moved = sum(not torch.equal(u.shard, b) for u, b in zip(opt.units, before, strict=True))
    assert moved >= len(opt.units) // 2, (moved, len(opt.units))
    if device == "nvme":
        stream = opt.offload._step.stream
        assert 0 < stream.updated < len(stream.items) and stream.read_next > stream.updated
    opt.step()
    assert not opt.offload.in_step
    assert all(not torch.equal(u.shard, b) for u, b in zip(opt.units, before, strict=True))
    opt.close()


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_gradient_copies_are_waited_for_once_before_their_units_update(tmp_path, single_process, monkeypatch,
                                                                        device):
    """The CUDA path's ordering with stand-in events (a CPU run makes no copies): each unit's
    copy event is synchronized exactly once, before its first update; with ``device: cpu``
    no update happens in the add that brought its unit (with NVMe, only the read-ahead's
    sub-groups wait; see [Note: gradient copies to the host])."""
    from zero_runtime.offload import _optimizer as _offload

    log = []

    class Event:
        def __init__(self, unit: int) -> None:
            self.unit = unit

        def synchronize(self) -> None:
            log.append(("sync", self.unit))

    def host_grad(self, unit, grad):
        log.append(("copy", unit.index))
        self._step.copied[unit.index] = Event(unit.index)
        return grad.clone()

    update = _offload.OptimizerOffload._update

    def logged_update(self, sg, *views):
        update(self, sg, *views)
        log.append(("update", sg.unit))

    monkeypatch.setattr(_offload.OptimizerOffload, "_host_grad", host_grad)
    monkeypatch.setattr(_offload.OptimizerOffload, "_update", logged_update)
    model, opt = _one_rank(tmp_path, device)
    opt.backward(loss_of("gpt", model, _batch()))
    opt.step()
    for unit in range(len(opt.units)):
        copy, sync = log.index(("copy", unit)), log.index(("sync", unit))
        assert log.count(("sync", unit)) == 1 and copy < sync < log.index(("update", unit))
        assert ("copy", unit) == log[copy] and not any(e == ("update", unit) for e in log[copy:sync])
    adds = [i for i, e in enumerate(log) if e[0] == "copy"]
    for i, e in enumerate(log):  # cpu: an update follows the copy of a later unit, or comes after every copy
        if e[0] == "update" and device == "cpu":
            own = log.index(("copy", e[1]))
            assert any(own < j < i for j in adds) or i > adds[-1]
    opt.close()


def test_learning_rate_changed_between_backward_and_step_is_an_error(tmp_path, single_process):
    model, opt = _one_rank(tmp_path)
    opt.backward(loss_of("gpt", model, _batch()))
    opt.optimizer.param_groups[0]["lr"] *= 2
    with pytest.raises(RuntimeError, match="lr changed between backward"):
        opt.step()
    assert opt.global_step == 1 and not opt.offload.in_step  # the step itself completed, with the old lr
    opt.backward(loss_of("gpt", model, _batch(1)))
    opt.step()
    opt.close()


def test_zero_grad_after_an_updating_backward_is_an_error(tmp_path, single_process):
    model, opt = _one_rank(tmp_path, "cpu")
    opt.backward(loss_of("gpt", model, _batch()))
    with pytest.raises(RuntimeError, match="call step"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()
    opt.close()


def test_failure_before_any_update_is_undone(tmp_path, single_process):
    """A backward that fails before a gradient bucket completes leaves nothing updated:
    training goes on exactly as if that backward had not happened."""
    model, opt = _one_rank(tmp_path)
    reference_model, reference = _one_rank(tmp_path)

    def fails(*_):
        raise RuntimeError("injected")

    loss = loss_of("gpt", model, _batch())
    handle = loss.grad_fn.register_prehook(fails)
    with pytest.raises(RuntimeError, match="injected"):
        opt.backward(loss)
    handle.remove()
    assert not opt.offload.in_step
    for o, m in ((opt, model), (reference, reference_model)):
        o.backward(loss_of("gpt", m, _batch()))
        o.step()
    assert state_dicts_equal(opt.full_state_dict(), reference.full_state_dict())
    opt.close()
    reference.close()


def test_failure_after_updates_refuses_until_a_checkpoint_is_loaded(tmp_path, single_process):
    model, opt = _one_rank(tmp_path)
    ckpt = tmp_path / "ckpt"
    opt.save_checkpoint(ckpt)
    loss = loss_of("gpt", model, _batch())
    calls = []

    def fail_late(grad):  # the position embedding's gradient comes last in backward
        calls.append(1)
        raise RuntimeError("injected late")

    model.pos.weight.register_hook(fail_late)
    with pytest.raises(RuntimeError, match="injected late"):
        opt.backward(loss)
    assert calls and opt.offload.in_step
    with pytest.raises(RuntimeError, match="interrupted half-way"):
        opt.backward(loss_of("gpt", model, _batch()))
    with pytest.raises(RuntimeError, match="in progress"):
        opt.state_dict()
    opt.load_checkpoint(ckpt)
    assert not opt.offload.in_step
    opt.close()


@pytest.mark.parametrize("extra, match", [
    ({"gradient_clipping": 1.0}, "gradient_clipping"),
    ({"fp16": {"enabled": True}}, "dynamic loss scaling"),
])
def test_refused_where_an_update_needs_every_gradient(extra, match):
    from zero_runtime import ZeroConfig

    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "zcomm_overlap_step": True}},
              **extra}
    with pytest.raises(ValueError, match=match):
        ZeroConfig.from_dict(config)


def test_static_fp16_scale_is_allowed_and_other_bad_values_refused():
    from zero_runtime import ZeroConfig

    ZeroConfig.from_dict({"fp16": {"enabled": True, "loss_scale": 128},
                          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                                  "zcomm_overlap_step": True}}})
    with pytest.raises(ValueError, match="needs offload_optimizer.device"):
        ZeroConfig.from_dict({"zero_optimization": {"stage": 2, "offload_optimizer": {"zcomm_overlap_step": True}}})
    with pytest.raises(TypeError, match="true or false"):
        ZeroConfig.from_dict({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                                    "zcomm_overlap_step": 1}}})


# ----- a failed backward without offload (the same change made it recoverable) -----

def test_failed_backward_discards_the_accumulated_gradients(single_process):
    """Accumulation over 2 micro-steps: the second backward fails. The gradients of the
    window are dropped and the next two micro-steps make a whole update, equal to that of a
    runtime that never saw the failed window."""
    config = {"zero_optimization": {"stage": 3, **FREE_AFTER_USE}, "gradient_accumulation_steps": 2}
    model, opt = initialize_one_rank(make_model("gpt"), config)
    reference_model, reference = initialize_one_rank(make_model("gpt"), config)
    opt.backward(loss_of("gpt", model, _batch(0)))
    opt.step()
    loss = loss_of("gpt", model, _batch(1))

    def fail(grad):
        raise RuntimeError("injected")

    handle = model.pos.weight.register_hook(fail)
    with pytest.raises(RuntimeError, match="injected"):
        opt.backward(loss)
    handle.remove()
    for o, m in ((opt, model), (reference, reference_model)):
        for micro in (2, 3):
            o.backward(loss_of("gpt", m, _batch(micro)))
            o.step()
    assert opt.global_step == reference.global_step == 1
    assert state_dicts_equal(opt.full_state_dict(), reference.full_state_dict())
