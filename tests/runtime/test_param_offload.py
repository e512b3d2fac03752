"""offload_param (stage 3; cpu, nvme): training bit-identical to training without it (the
oracle), alone and with offload_optimizer, with ZeRO++ and through checkpoints; shards that
really live in the swap file and are read ahead of their gathers; files removed; the errors.

Every distributed case trains the same model the same way with ``offload_param: none`` and
with each mode on 2 gloo ranks and compares the losses and the consolidated fp32 weights bit
for bit: offload only moves the shards, never changes a value. Units are freed after every
use (``FREE_AFTER_USE``), so every forward and backward gathers, and so fetches, every shard.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from zero_harness import initialize_one_rank, run
from zero_workloads import assert_trains_alike, make_model, state_dicts_equal, train_save_resume, zero_steps

STEPS = 3
FREE_AFTER_USE = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                  "zcomm_stage3_fuse_numel": 0, "reduce_bucket_size": 3000}
CASES = [  # (name, zero_optimization, top-level extras)
    ("s3", {"stage": 3, **FREE_AFTER_USE}, {}),
    # Persistent units (never freed, never offloaded) beside offloaded ones.
    ("s3-kept-persist-bf16", {"stage": 3, "stage3_param_persistence_threshold": 512, "zcomm_stage3_fuse_numel": 0},
     {"bf16": {"enabled": True}}),
    ("zeropp", {"stage": 3, **FREE_AFTER_USE, "zero_quantized_weights": True, "zero_quantized_gradients": True,
                "zero_hpz_partition_size": 2}, {}),
]
MODES = [  # (offload_param device, offload_optimizer device)
    ("cpu", "none"), ("nvme", "none"), ("nvme", "nvme"), ("nvme", "cpu"),
]


def _config(zero: dict, extra: dict, param: str, optimizer: str, root: str) -> dict:
    zero = {**zero, "offload_param": {"device": param}, "offload_optimizer": {"device": optimizer}}
    if param == "nvme":  # few small buffers: they are recycled many times a step
        zero["offload_param"].update(nvme_path=root, buffer_count=2, buffer_size=4096)
    if optimizer == "nvme":
        zero["offload_optimizer"].update(nvme_path=root)
    return {"zero_optimization": zero, "aio": {"block_size": 8192, "thread_count": 2, "queue_depth": 2}, **extra}


def _mine(root: str, rank: int) -> list[str]:
    return sorted(f for f in os.listdir(root) if f.startswith(f"zero_param_rank{rank:05d}_"))


def _train(rank: int, world: int, root: str) -> dict:
    def after_training(opt) -> dict:
        return {"report": opt.memory_report(), "reads": opt.param_offload.reads() if opt.param_offload is not None else 0,
                "shards": sum(u.shard.numel() * u.shard.element_size() for u in opt.units if u.partitioned)}

    out = {}
    for name, zero, extra in CASES:
        for param, optimizer in [("none", "none"), *MODES]:
            swap_dir = os.path.join(root, f"{name}-{param}-{optimizer}")
            os.makedirs(swap_dir, exist_ok=True)
            ckpt = os.path.join(root, f"ckpt-{name}-{param}-{optimizer}")
            out[name, param, optimizer] = train_save_resume(
                "gpt", _config(zero, extra, param, optimizer, swap_dir), rank, world, ckpt, STEPS,
                at_start=lambda opt, swap_dir=swap_dir: {"files": _mine(swap_dir, rank)}, after_training=after_training)
            out[name, param, optimizer]["left"] = _mine(swap_dir, rank)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run(_train, 2, str(tmp_path_factory.mktemp("param_offload")))


@pytest.mark.parametrize("name", [case[0] for case in CASES])
@pytest.mark.parametrize("param,optimizer", MODES)
def test_training_is_bit_identical_to_no_offload(results, name, param, optimizer):
    assert_trains_alike(results, (name, "none", "none"), (name, param, optimizer), STEPS)


@pytest.mark.parametrize("name", [case[0] for case in CASES])
def test_nvme_shards_are_read_from_their_files_which_are_removed(results, name):
    """One parameter swap file per rank while training, gone after close(); every forward and
    backward read shards from it (at least one read per unit use of the trace)."""
    for rank in range(2):
        for param, optimizer in MODES:
            got = results[rank][name, param, optimizer]
            assert got["left"] == []
            if param == "nvme":
                assert len(got["files"]) == 1, got["files"]
                assert got["reads"] >= 2 * STEPS
            else:
                assert got["files"] == [] and got["reads"] == 0


@pytest.mark.parametrize("name", [case[0] for case in CASES])
def test_memory_report_moves_the_shards_off_the_device(results, name):
    """nvme: the shards leave ``parameters`` for ``offloaded_parameters`` (the swap file, its
    regions block-aligned); cpu on a CPU run moves nothing, so nothing is reported moved."""
    for rank in range(2):
        base = results[rank][name, "none", "none"]["report"]
        cpu = results[rank][name, "cpu", "none"]["report"]
        nvme = results[rank][name, "nvme", "none"]
        shards = nvme["shards"]
        assert cpu == base and base.offloaded_parameters == 0
        assert nvme["report"].parameters == base.parameters - shards
        assert shards <= nvme["report"].offloaded_parameters < shards + 4096 * 64


# ----- single process: the file really holds the shards, reads run ahead, errors -----

def _nvme(tmp_path, **extra) -> dict:
    return {"zero_optimization": {"stage": 3, **FREE_AFTER_USE, "offload_param": {
        "device": "nvme", "nvme_path": str(tmp_path), **extra}}}


def test_shards_live_only_in_the_file(tmp_path, single_process):
    """Between steps no shard has storage; the step's new values are in the file (read back
    raw), and a value written into the file is what the next gather returns."""
    import zero_runtime

    model, opt = initialize_one_rank(make_model("gpt"), _nvme(tmp_path))
    offload = opt.param_offload
    units = [u for u in opt.units if u.partitioned]
    zero_steps("gpt", model, opt, 0, 1, range(1))
    assert all(not offload.is_resident(u) for u in units)
    (swap,) = tmp_path.iterdir()
    unit = units[0]
    start = offload.homes[id(unit)].offset // 4
    raw = torch.from_numpy(np.fromfile(swap, dtype="float32"))
    assert torch.equal(raw[start : start + unit.shard.numel()], unit.master.detach())  # fp32, one rank
    with open(swap, "r+b") as f:  # the file is the only copy: change it, and the weights change
        f.seek(offload.homes[id(unit)].offset)
        f.write(np.full(unit.shard.numel(), 0.125, dtype="float32").tobytes())
    first = dict(model.named_parameters())[unit.names[0]]
    with zero_runtime.GatheredParameters(first):
        assert torch.all(first == 0.125)
    assert not offload.is_resident(unit)
    opt.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("max_in_cpu", [10**9, 0])
def test_reads_run_ahead_of_the_gathers(tmp_path, single_process, max_in_cpu):
    """From the second step on, the scheduler starts the reads of the units past its prefetch
    front, within buffer_count buffers: gathers then find their shards read ahead. With
    ``max_in_cpu: 0`` nothing is read ahead and every shard is read when its gather needs it."""
    model, opt = initialize_one_rank(make_model("gpt"), _nvme(tmp_path, buffer_count=3, max_in_cpu=max_in_cpu))
    offload = opt.param_offload
    zero_steps("gpt", model, opt, 0, 1, range(1))
    waited = []
    original = offload.fetch

    def fetch(unit, *, read=True):
        waited.append(offload.homes[id(unit)].read is not None)
        original(unit, read=read)

    offload.fetch = fetch
    zero_steps("gpt", model, opt, 0, 1, range(1, 2))
    if max_in_cpu:
        assert sum(waited) >= len(waited) // 2, waited
    else:
        assert waited and not any(waited)
    opt.close()


def test_gathered_parameters_edits_reach_offloaded_shards(tmp_path, single_process):
    """``GatheredParameters(modifier_rank=0)`` on a unit whose shard is on NVMe writes the edit
    home, so the next step starts from it exactly as without offload."""
    import zero_runtime

    results = {}
    for device in ("none", "nvme"):
        config = _nvme(tmp_path) if device == "nvme" else {"zero_optimization": {"stage": 3, **FREE_AFTER_USE}}
        model, opt = initialize_one_rank(make_model("gpt"), config)
        zero_steps("gpt", model, opt, 0, 1, range(1))
        first = next(model.parameters())
        with zero_runtime.GatheredParameters(first, modifier_rank=0), torch.no_grad():
            first.fill_(0.25)
        losses = zero_steps("gpt", model, opt, 0, 1, range(1, 3))
        results[device] = losses, opt.full_state_dict()
        opt.close()
    assert results["nvme"][0] == results["none"][0]
    assert state_dicts_equal(results["nvme"][1], results["none"][1])


def test_frozen_units_are_offloaded_and_checkpointed(tmp_path, single_process):
    """Stage 3 partitions frozen parameters too: their shards live in the file, and a
    checkpoint and ``full_state_dict`` still read them."""
    from zero_runtime.checkpoint.export import consolidate

    model = make_model("gpt")
    model.tok.weight.requires_grad_(False)
    swap_dir = tmp_path / "swap"
    swap_dir.mkdir()
    model, opt = initialize_one_rank(model, _nvme(swap_dir))
    assert opt.frozen_units and all(not opt.param_offload.is_resident(u) for u in opt.frozen_units)
    zero_steps("gpt", model, opt, 0, 1, range(1))
    opt.save_checkpoint(tmp_path / "ckpt")
    want = make_model("gpt").tok.weight.detach()
    assert torch.equal(opt.full_state_dict()["tok.weight"], want)
    assert torch.equal(consolidate(tmp_path / "ckpt")["tok.weight"], want)
    assert all(not opt.param_offload.is_resident(u) for u in opt.frozen_units)
    opt.close()


@pytest.mark.parametrize("bad,match", [
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "needs zero_optimization.stage 3"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "needs offload_param.nvme_path"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}, "must be 'none', 'cpu' or 'nvme'"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_count": 0}}},
     "buffer_count must be an integer >= 1"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "max_in_cpu": 1.5}}},
     "max_in_cpu must be an integer"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "buffer_sise": 10}}},
     "unknown config keys: zero_optimization.offload_param.buffer_sise"),
])
def test_config_errors(bad, match):
    from zero_runtime import ZeroConfig

    with pytest.raises((ValueError, TypeError), match=match):
        ZeroConfig.from_dict(bad)


def test_buffers_smaller_than_a_shard_are_a_clear_error_at_start_up(tmp_path, single_process):
    with pytest.raises(ValueError, match=r"buffer_size \(16 elements\) is smaller than the largest parameter shard"):
        initialize_one_rank(make_model("gpt"), _nvme(tmp_path, buffer_size=16))
    assert list(tmp_path.iterdir()) == []


def test_unwritable_path_is_a_clear_error(tmp_path, single_process):
    with pytest.raises(ValueError, match="is not an existing directory"):
        initialize_one_rank(make_model("gpt"), _nvme(tmp_path / "missing"))
