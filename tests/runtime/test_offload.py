"""offload_optimizer (cpu, nvme): training bit-identical to training without offload (the oracle),
through checkpoints too; swap files created, really used and removed; the error cases.

Every case trains the same model the same way with ``device: none`` and with each offload
mode on 2 gloo ranks and compares the consolidated fp32 weights and the losses bit for bit
(``cpu_adam`` replays torch's single-tensor AdamW, so no tolerance is needed). A small
``sub_group_size`` cuts every unit into several sub-groups, so the NVMe pipeline cycles its
buffers (reads, updates and writes overlapping) within one step.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from zero_harness import initialize_one_rank, run
from zero_workloads import assert_trains_alike, make_model, state_dicts_equal, train_save_resume, zero_steps

STEPS = 4
FREE_AFTER_USE = {"stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0,
                  "zcomm_stage3_fuse_numel": 0, "stage3_prefetch_bucket_size": 0, "reduce_bucket_size": 3000}
CASES = [  # (name, model, zero_optimization, top-level extras)
    ("mlp-s1", "mlp", {"stage": 1}, {}),
    ("mlp-s2-clip", "mlp", {"stage": 2, "reduce_bucket_size": 300}, {"gradient_clipping": 0.5}),
    # The offloaded step must step the learning-rate schedule too (it did not, at first).
    ("mlp-s1-schedule", "mlp", {"stage": 1}, {"scheduler": {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 2 * STEPS, "warmup_max_lr": 0.02, "warmup_num_steps": 2, "warmup_type": "linear"}}}),
    ("gpt-s3", "gpt", {"stage": 3, **FREE_AFTER_USE}, {}),
    ("gpt-s3-persist-bf16", "gpt", {"stage": 3, "stage3_param_persistence_threshold": 512}, {"bf16": {"enabled": True}}),
    ("gpt-zeropp", "gpt", {"stage": 3, **FREE_AFTER_USE, "zero_quantized_weights": True,
                           "zero_quantized_gradients": True}, {}),
]
SUB_GROUP = 700  # elements: several sub-groups per unit


def _config(zero: dict, extra: dict, device: str, root: str) -> dict:
    offload = {"device": device}
    if device == "nvme":
        offload.update(nvme_path=root, buffer_count=3)
    return {"zero_optimization": {**zero, "offload_optimizer": offload, "sub_group_size": SUB_GROUP},
            "aio": {"block_size": 8192, "thread_count": 2, "queue_depth": 2}, **extra}


def _train(rank: int, world: int, root: str) -> dict:
    # Both ranks share swap_dir (as ranks of a node share nvme_path): the other rank may not
    # have closed yet, so only this rank's own files are looked at.
    def mine(swap_dir: str) -> list[str]:
        return [f for f in sorted(os.listdir(swap_dir)) if f.startswith(f"zero_offload_rank{rank:05d}_")]

    out = {}
    for name, kind, zero, extra in CASES:
        for device in ("none", "cpu", "nvme"):
            swap_dir = os.path.join(root, f"{name}-{device}")
            os.makedirs(swap_dir, exist_ok=True)
            # One run of 2 * STEPS steps, and a second one that resumes from the checkpoint
            # the first saved half-way (into a fresh runtime, so everything is reloaded).
            out[name, device] = train_save_resume(
                kind, _config(zero, extra, device, swap_dir), rank, world, os.path.join(root, f"ckpt-{name}-{device}"),
                STEPS, at_start=lambda opt, swap_dir=swap_dir: {"files": mine(swap_dir)},
                after_training=lambda opt: {"report": opt.memory_report(),
                                            "numel": sum(u.layout.shard_numel for u in opt.units)})
            out[name, device]["left"] = mine(swap_dir)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("offload"))
    return run(_train, 2, root)


@pytest.mark.parametrize("name", [case[0] for case in CASES])
@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_training_is_bit_identical_to_no_offload(results, name, device):
    assert_trains_alike(results, (name, "none"), (name, device), STEPS)


@pytest.mark.parametrize("name", [case[0] for case in CASES])
def test_memory_report_moves_the_optimizer_states_off_the_device(results, name):
    """Masters, exp_avg and exp_avg_sq: 12 bytes per shard element, off the device with offload
    (the swap file rounds each sub-group up to its block alignment)."""
    for rank in range(2):
        base, cpu, nvme = (results[rank][name, device] for device in ("none", "cpu", "nvme"))
        assert base["report"].optimizer_states >= 12 * base["numel"] and base["report"].offloaded_optimizer_states == 0
        assert cpu["report"].optimizer_states == 0 and cpu["report"].offloaded_optimizer_states == 12 * cpu["numel"]
        assert nvme["report"].optimizer_states == 0
        assert 12 * nvme["numel"] <= nvme["report"].offloaded_optimizer_states < 12 * nvme["numel"] + 2**20
        assert cpu["report"].total == base["report"].total - base["report"].optimizer_states


@pytest.mark.parametrize("name", [case[0] for case in CASES])
def test_swap_files_exist_while_training_and_are_removed(results, name):
    for rank in range(2):
        got = results[rank][name, "nvme"]
        assert len(got["files"]) == 1, got["files"]  # one swap file per rank
        assert got["left"] == []
        assert results[rank][name, "cpu"]["files"] == []


def test_weights_move_so_the_comparison_means_something(results):
    for name, *_ in CASES:
        got = results[0][name, "nvme"]
        assert got["losses"][0] != got["losses"][-1]


# ----- single-process pieces: the swap file, the pipeline on real files, errors -----

def test_nvme_states_really_live_in_the_file(tmp_path, single_process):
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)},
                                    "sub_group_size": 100}}
    model, opt = initialize_one_rank(make_model("mlp"), config)
    (swap,) = tmp_path.iterdir()
    numel = sum(u.layout.shard_numel for u in opt.units)
    assert swap.stat().st_size >= 12 * numel
    assert all(u.master.numel() == 0 for u in opt.units)  # nothing resident beside the file
    report = opt.memory_report()
    assert report.optimizer_states == 0 and report.offloaded_optimizer_states >= 12 * numel
    x, y = torch.randn(4, 12), torch.randn(4, 5)
    opt.backward(torch.nn.functional.mse_loss(model(x), y))
    opt.step()
    # The masters read straight from the file equal the parameters the step wrote.
    raw = torch.from_numpy(__import__("numpy").fromfile(swap, dtype="float32"))
    sg = opt.offload.subgroups[0]
    master = raw[sg.offset // 4 : sg.offset // 4 + sg.numel]
    assert torch.equal(master, opt.units[sg.unit].shard[sg.lo : sg.hi])
    assert master.abs().sum() > 0
    opt.close()
    assert list(tmp_path.iterdir()) == []


def test_gathered_parameters_edits_reach_offloaded_masters(tmp_path, single_process):
    """``GatheredParameters(modifier_rank=0)`` writes the edit into the fp32 masters wherever
    they live (with nvme: in the swap file), so the next step starts from it as without offload."""
    import zero_runtime

    results = {}
    for device in ("none", "cpu", "nvme"):
        offload = {"device": device, "nvme_path": str(tmp_path)} if device == "nvme" else {"device": device}
        zero = {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_optimizer": offload,
                "sub_group_size": 100}
        model, opt = initialize_one_rank(make_model("mlp"), {"zero_optimization": zero})
        zero_steps("mlp", model, opt, 0, 1, range(1))
        first = next(model.parameters())
        with zero_runtime.GatheredParameters(first, modifier_rank=0), torch.no_grad():
            first.fill_(0.25)
        edited = opt.full_state_dict()
        zero_steps("mlp", model, opt, 0, 1, range(1, 2))
        results[device] = edited, opt.full_state_dict()
        opt.close()
    (name, value), *_ = results["none"][0].items()
    assert torch.equal(value, torch.full_like(value, 0.25)), name
    for device in ("cpu", "nvme"):
        for got, want in zip(results[device], results["none"], strict=True):
            assert state_dicts_equal(got, want), device


def test_swap_file_removed_after_an_uncaught_exception(tmp_path):
    script = textwrap.dedent(f"""
        import sys, torch, torch.distributed as dist
        sys.path[:0] = {[str(Path(__file__).parent), str(Path(__file__).parents[2])]!r}
        import zero_runtime
        from zero_workloads import make_model, make_optimizer
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
        config = {{"zero_optimization": {{"stage": 1, "offload_optimizer": {{"device": "nvme",
                   "nvme_path": {str(tmp_path)!r}}}}}}}
        model, opt = zero_runtime.initialize(make_model("mlp"), make_optimizer(), config)
        import os; assert os.listdir({str(tmp_path)!r})
        raise RuntimeError("boom")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "boom" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_unwritable_or_missing_path_is_a_clear_error(tmp_path, single_process):
    missing = {"zero_optimization": {"stage": 2,
                                     "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path / "no")}}}
    with pytest.raises(ValueError, match="not an existing directory"):
        initialize_one_rank(make_model("mlp"), missing)
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="not writable"):
            config = {"zero_optimization": {"stage": 2,
                                            "offload_optimizer": {"device": "nvme", "nvme_path": str(locked)}}}
            initialize_one_rank(make_model("mlp"), config)


def test_full_path_is_a_clear_error_at_start_up(tmp_path, single_process):
    # A 64 KiB tmpfs cannot hold the states of a model of 64K parameters (768 KiB).
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(mount)}}}
        with pytest.raises(ValueError, match="has no room"):
            initialize_one_rank(torch.nn.Linear(256, 256), config)
        assert list(mount.iterdir()) == []
    finally:
        subprocess.run(["umount", str(mount)], check=True)


@pytest.fixture
def ramfs(tmp_path):
    """A directory on ramfs, a file system that refuses O_DIRECT (needs root to mount)."""
    mount = tmp_path / "ramfs"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mount)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount ramfs here (needs root)")
    yield mount
    subprocess.run(["umount", str(mount)], check=True)


def test_direct_io_required_where_impossible_is_a_clear_error(ramfs, single_process):
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(ramfs)}},
              "aio": {"zcomm_direct_io": True}}
    with pytest.raises(ValueError, match="does not allow O_DIRECT"):
        initialize_one_rank(make_model("mlp"), config)
    assert list(ramfs.iterdir()) == []


def test_direct_io_auto_uses_buffered_io_where_direct_is_impossible(ramfs, tmp_path, single_process):
    for path, direct in ((ramfs, False), (tmp_path, True)):  # tmp_path: ext4 here
        config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": str(path)}}}
        model, opt = initialize_one_rank(make_model("mlp"), config)
        assert opt.offload.swap.direct is direct or path is tmp_path
        opt.backward(torch.nn.functional.mse_loss(model(torch.randn(4, 12)), torch.randn(4, 5)))
        opt.step()
        opt.close()


def test_non_adam_optimizer_is_rejected(single_process):
    config = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    with pytest.raises(ValueError, match="Adam"):
        initialize_one_rank(make_model("mlp"), config, lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(ValueError, match="amsgrad"):
        initialize_one_rank(make_model("mlp"), config, lambda p: torch.optim.AdamW(p, amsgrad=True))


@pytest.mark.parametrize("bad, match", [
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "disk"}}}, "device"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}},
     "offload_optimizer.ratio"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}}, "nvme_path"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "buffer_count": 2}}},
     "buffer_count"),
    ({"zero_optimization": {"stage": 2, "sub_group_size": 0}}, "sub_group_size"),
    ({"zero_optimization": {"stage": 2}, "aio": {"block_size": 1000}}, "block_size"),
    ({"zero_optimization": {"stage": 2}, "aio": {"use_gds": True}}, "aio.use_gds"),
])
def test_config_errors(bad, match):
    from zero_runtime import ZeroConfig

    with pytest.raises((ValueError, TypeError), match=match):
        ZeroConfig.from_dict(bad)
