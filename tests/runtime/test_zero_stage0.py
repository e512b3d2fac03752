"""ZeRO stage 0 (plain data parallelism, DeepSpeed's default; [Note: stage 0] in
``zero_runtime.comm._all_reduce``): every rank keeps the whole model, gradients and optimizer
states, and gradient buckets are all-reduced, with ``zcomm.all_reduce`` (``dist.all_reduce``, counted) or, under
``zero_quantized_gradients``, ``zcomm.all_reduce_q4``.

Oracles: plain single-process training on the global batch (the tolerances of
``test_zero_exactness``: fp32 round-off only), plain stage 1 (on 2 ranks a reduction adds two
values whichever collective does it, so stage 0 and stage 1 compute the same bits), the other
ranks' weights (identical bit for bit, as data parallelism needs), the run a checkpoint
interrupted (a resumed run repeats it bit for bit) and zcomm's byte counters.
"""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import pytest
import torch

from zero_harness import run
from zero_workloads import grouped_optimizer, make_model, make_optimizer, reference_run, state_dicts_equal, zero_steps

STEPS = 12
CASES = [  # (name, model, config without the optimizer, single-process oracle's options)
    ("gpt-nostage", "gpt", {"zero_optimization": {"reduce_bucket_size": 5000}}, {}),
    ("gpt-s0", "gpt", {"zero_optimization": {"stage": 0, "reduce_bucket_size": 5000}}, {}),
    ("mlp-s0-clip", "mlp", {"zero_optimization": {"stage": 0}, "gradient_clipping": 0.5}, {"clip": 0.5}),
    ("mlp-s0-accum", "mlp", {"zero_optimization": {"stage": 0, "reduce_bucket_size": 300},
                             "gradient_accumulation_steps": 2}, {}),
    ("mlp-s0-no-overlap", "mlp", {"zero_optimization": {"stage": 0, "reduce_bucket_size": 300,
                                                        "overlap_comm": False}}, {}),
    # small units of two optimizer groups share buckets: one all-reduce over several units
    ("mlp-s0-groups", "mlp", {"zero_optimization": {"stage": 0, "reduce_bucket_size": 300}}, {"grouped": True}),
]


def _comparable(key: str, tensor: torch.Tensor) -> torch.Tensor:
    """See ``test_zero_exactness``: the key third of ``qkv.bias`` has a zero true gradient."""
    if key.endswith("attn.qkv.bias"):
        third = tensor.numel() // 3
        return torch.cat([tensor[:third], tensor[2 * third:]])
    return tensor


def _initialize(kind: str, config: dict, grouped: bool = False):
    import zero_runtime

    model = make_model(kind)
    return zero_runtime.initialize(model, grouped_optimizer(model) if grouped else make_optimizer(), config)


def _two_ranks(rank: int, world: int, root: str) -> dict:
    out: dict = {"cases": {}}
    for name, kind, config, oracle in CASES:
        model, opt = _initialize(kind, config, oracle.get("grouped", False))
        losses = zero_steps(kind, model, opt, rank, world, range(STEPS),
                            accumulation=config.get("gradient_accumulation_steps", 1))
        out["cases"][name] = {"stage": opt.config.stage, "losses": losses, "weights": opt.full_state_dict(),
                              "full": [u.full.clone() for u in opt.units]}
    model, opt = _initialize("gpt", {"zero_optimization": {"stage": 1, "reduce_bucket_size": 5000}})
    out["stage1"] = zero_steps("gpt", model, opt, rank, world, range(STEPS))
    model, opt = _initialize("gpt", {"zero_optimization": {"stage": 0, "reduce_bucket_size": 5000}})
    zero_steps("gpt", model, opt, rank, world, range(1))  # AdamW makes its moments at the first step
    out["memory"] = (opt.memory_report(), [(u.layout.numel, u.master.numel(), u.grad_shard.numel())
                                           for u in opt.units])
    out["checkpoint"] = _checkpoint_round_trip(rank, world, Path(root))
    out["precisions"] = {precision: _precision_run(rank, world, precision) for precision in ("bf16", "fp16")}
    return out


def _checkpoint_round_trip(rank: int, world: int, root: Path) -> dict:
    """Save after 3 steps, train 3 more; a fresh engine loads and repeats them. Then the same
    checkpoint loaded by stage 1 (resharded), a stage-1 checkpoint loaded by stage 0, and the
    offline export of the stage-0 checkpoint."""
    from zero_runtime.checkpoint._sharded import consolidate

    config = {"zero_optimization": {"stage": 0, "reduce_bucket_size": 5000}}
    model, opt = _initialize("gpt", config)
    zero_steps("gpt", model, opt, rank, world, range(3))
    opt.save_checkpoint(root / "s0")
    saved_weights = opt.full_state_dict()
    first = zero_steps("gpt", model, opt, rank, world, range(3, 6))
    out = {"first": first, "first_weights": opt.full_state_dict(), "saved_weights": saved_weights}
    model, opt = _initialize("gpt", config)
    opt.load_checkpoint(root / "s0")
    out["loaded_weights"] = opt.full_state_dict()
    out["resumed"] = zero_steps("gpt", model, opt, rank, world, range(3, 6))
    out["resumed_weights"] = opt.full_state_dict()
    out["exported"] = consolidate(root / "s0") if rank == 0 else {}

    model, opt = _initialize("gpt", {"zero_optimization": {"stage": 1, "reduce_bucket_size": 5000}})
    opt.load_checkpoint(root / "s0")
    out["stage1_loaded"] = opt.full_state_dict()
    out["stage1_resumed"] = zero_steps("gpt", model, opt, rank, world, range(3, 6))
    opt.save_checkpoint(root / "s1")
    stage1_weights = opt.full_state_dict()
    model, opt = _initialize("gpt", config)
    opt.load_checkpoint(root / "s1")
    out["from_stage1"] = (stage1_weights, opt.full_state_dict())
    return out


def _precision_run(rank: int, world: int, precision: str) -> dict:
    section = {"enabled": True}
    if precision == "fp16":  # a scale that overflows the first steps: they are skipped, on every rank
        section.update(initial_scale_power=20, hysteresis=1)
    config = {"zero_optimization": {}, precision: section, "gradient_clipping": 1.0}
    model, opt = _initialize("gpt", config)
    losses = zero_steps("gpt", model, opt, rank, world, range(STEPS))
    return {"losses": losses, "loss_scale": opt.loss_scale, "skipped": opt.skipped_steps,
            "dtype": opt.units[0].full.dtype, "full": [u.full.clone() for u in opt.units]}


@pytest.fixture(scope="module")
def two_ranks():
    with tempfile.TemporaryDirectory() as root:
        return run(_two_ranks, 2, root)


@pytest.fixture(scope="module")
def references():
    return {name: reference_run(kind, STEPS, clip=oracle.get("clip", 0.0), grouped=oracle.get("grouped", False))
            for name, kind, _, oracle in CASES}


@pytest.mark.slow
def test_stage0_matches_single_process_training(two_ranks, references):
    results = two_ranks[0]["cases"]
    for name, _, _, _ in CASES:
        got, (ref_losses, ref_weights) = results[name], references[name]
        assert got["stage"] == 0, name
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")
        assert got["weights"].keys() == ref_weights.keys()
        for key in ref_weights:
            torch.testing.assert_close(_comparable(key, got["weights"][key]), _comparable(key, ref_weights[key]),
                                       rtol=0, atol=2e-5, msg=lambda m, name=name, key=key: f"{name} {key}: {m}")


@pytest.mark.slow
def test_a_config_without_a_stage_is_stage_0_and_two_ranks_compute_stage_1s_bits(two_ranks):
    results = two_ranks[0]["cases"]
    assert results["gpt-nostage"]["losses"] == results["gpt-s0"]["losses"] == two_ranks[0]["stage1"]
    assert state_dicts_equal(results["gpt-nostage"]["weights"], results["gpt-s0"]["weights"])


@pytest.mark.slow
def test_every_rank_holds_the_same_whole_weights(two_ranks):
    for name in two_ranks[0]["cases"]:
        mine, other = two_ranks[0]["cases"][name]["full"], two_ranks[1]["cases"][name]["full"]
        assert all(torch.equal(a, b) for a, b in zip(mine, other, strict=True)), name
    for precision in ("bf16", "fp16"):
        mine, other = two_ranks[0]["precisions"][precision]["full"], two_ranks[1]["precisions"][precision]["full"]
        assert all(torch.equal(a, b) for a, b in zip(mine, other, strict=True)), precision


@pytest.mark.slow
def test_nothing_is_partitioned_and_memory_counts_whole_states(two_ranks):
    report, units = two_ranks[0]["memory"]
    assert all(numel == master == grad for numel, master, grad in units)
    numel = sum(n for n, _, _ in units)
    # fp32 masters and AdamW's two moments, whole, plus a scalar ``step`` per unit
    assert 0 <= report.optimizer_states - 3 * 4 * numel <= 8 * len(units)
    assert report.gradients == 2 * 4 * numel  # full gradient buffers and reduced gradients, fp32
    assert report.parameters == 4 * numel


@pytest.mark.slow
def test_bf16_and_fp16_train_like_fp32(two_ranks):
    fp32 = two_ranks[0]["cases"]["gpt-s0"]["losses"]
    for precision, expected in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        got = two_ranks[0]["precisions"][precision]
        assert got["dtype"] == expected
        assert all(abs(a - b) <= 0.02 * b for a, b in zip(got["losses"], fp32, strict=True)), (precision, got["losses"], fp32)
    fp16 = two_ranks[0]["precisions"]["fp16"]
    # dynamic scaling from 2**20: the first steps overflow and are skipped, then it trains
    assert 0 < fp16["skipped"] < STEPS and fp16["loss_scale"] < 2 ** 20
    assert two_ranks[1]["precisions"]["fp16"]["skipped"] == fp16["skipped"]


@pytest.mark.slow
def test_checkpoint_round_trip_is_bit_identical(two_ranks):
    for rank, out in enumerate(two_ranks):
        ckpt = out["checkpoint"]
        assert ckpt["resumed"] == ckpt["first"], rank
        if rank == 0:
            assert ckpt["saved_weights"] and state_dicts_equal(ckpt["loaded_weights"], ckpt["saved_weights"])
            assert state_dicts_equal(ckpt["resumed_weights"], ckpt["first_weights"])
            assert state_dicts_equal(ckpt["exported"], ckpt["saved_weights"])


@pytest.mark.slow
def test_checkpoints_reshard_between_stage_0_and_stage_1(two_ranks):
    ckpt = two_ranks[0]["checkpoint"]
    assert state_dicts_equal(ckpt["stage1_loaded"], ckpt["saved_weights"])
    # Adam's moments travelled too: stage 1 continues as stage 0 did (same bits on 2 ranks)
    assert ckpt["stage1_resumed"] == ckpt["first"]
    saved, loaded = ckpt["from_stage1"]
    assert saved and state_dicts_equal(loaded, saved)


# ----- qgZ: 4 ranks as 2 nodes x 2 -----

WORLD_Q = 4
STEPS_Q = 6
GROUP = 64
Q_CASES = {
    "plain": {},
    "qgZ": {"zero_quantized_gradients": True, "zcomm_quant_group_size": GROUP},
    "qgZ-int8hop": {"zero_quantized_gradients": True, "zcomm_quant_group_size": GROUP, "zcomm_qgz_first_hop_bits": 8},
    "qgZ-hadamard": {"zero_quantized_gradients": True, "zcomm_quant_group_size": GROUP, "zcomm_qgz_hadamard_block": 64},
    "qgZ-loco": {"zero_quantized_gradients": True, "zcomm_quant_group_size": GROUP,
                 "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024}},
}


def _quantized(rank: int, world: int, root: str) -> dict:
    import zcomm
    import zero_runtime

    out = {}
    for name, zero in Q_CASES.items():
        config = {"zero_optimization": {"stage": 0, "reduce_bucket_size": 5000, **zero}}
        model, opt = zero_runtime.initialize(make_model("gpt"), functools.partial(torch.optim.AdamW, lr=1e-3), config)
        zcomm.reset_comm_stats()
        losses = zero_steps("gpt", model, opt, rank, world, range(STEPS_Q))
        stats = zcomm.comm_stats()
        out[name] = {"losses": losses, "full": [u.full.clone() for u in opt.units],
                     "stats": {op: (s.calls, s.intra_bytes, s.inter_bytes) for op, s in stats.items()},
                     "buckets": len(opt.reducer.buckets), "numel": [u.layout.numel for u in opt.units],
                     "aligned": [u.layout.align for u in opt.units],
                     "error_feedback": opt.memory_report().error_feedback}
    # LoCo's error buffers travel in the checkpoint: a resumed run repeats the interrupted one
    config = {"zero_optimization": {"stage": 0, "reduce_bucket_size": 5000, **Q_CASES["qgZ-loco"]}}
    model, opt = zero_runtime.initialize(make_model("gpt"), functools.partial(torch.optim.AdamW, lr=1e-3), config)
    zero_steps("gpt", model, opt, rank, world, range(3))
    opt.save_checkpoint(Path(root) / "loco")
    first = zero_steps("gpt", model, opt, rank, world, range(3, 6))
    model, opt = zero_runtime.initialize(make_model("gpt"), functools.partial(torch.optim.AdamW, lr=1e-3), config)
    opt.load_checkpoint(Path(root) / "loco")
    out["loco_resume"] = (first, zero_steps("gpt", model, opt, rank, world, range(3, 6)))
    return out


@pytest.fixture(scope="module")
def quantized():
    with tempfile.TemporaryDirectory() as root:
        return run(_quantized, WORLD_Q, root, env={"ZCOMM_LOCAL_SIZE": "2"})


@pytest.mark.slow
def test_qgz_all_reduce_tracks_plain_stage_0(quantized):
    plain = quantized[0]["plain"]["losses"]
    for name in Q_CASES:
        losses = quantized[0][name]["losses"]
        assert all(abs(a - b) <= 0.02 * b for a, b in zip(losses, plain, strict=True)), (name, losses, plain)
        if name != "plain":
            assert losses != plain, f"{name}: nothing was quantized"


@pytest.mark.slow
def test_qgz_all_reduce_leaves_the_same_weights_on_every_rank(quantized):
    for name in Q_CASES:
        first = quantized[0][name]["full"]
        for later in quantized[1:]:
            assert all(torch.equal(a, b) for a, b in zip(first, later[name]["full"], strict=True)), name


@pytest.mark.slow
def test_comm_stats_count_the_all_reduce_q4_bytes(quantized):
    plain_inter = quantized_inter = 0
    for out in quantized:
        plain = out["plain"]["stats"]
        # zcomm.all_reduce counts a ring's bytes
        assert plain.keys() == {"all_reduce"} and plain["all_reduce"][0] == STEPS_Q * out["plain"]["buckets"], plain
        plain_inter += plain["all_reduce"][2]
        quantized_inter += out["qgZ"]["stats"]["reduce_scatter_q4"][2] + out["qgZ"]["stats"]["all_gather_q8"][2]
        for name in Q_CASES:
            if name == "plain":
                continue
            stats = out[name]["stats"]
            calls = STEPS_Q * out[name]["buckets"]
            assert stats.keys() == {"reduce_scatter_q4", "all_gather_q8"}, (name, stats)
            assert stats["reduce_scatter_q4"][0] == stats["all_gather_q8"][0] == calls, (name, stats)
            # 2 nodes: each rank sends its node sum's quarter across (INT4) and gathers the other
            # node's averaged slices (INT8), about 1.5 bytes per element of its slice per step
            numel = sum(out[name]["numel"])
            inter = stats["reduce_scatter_q4"][2] + stats["all_gather_q8"][2]
            slice_bytes = STEPS_Q * numel / WORLD_Q
            assert 1.5 * slice_bytes <= inter <= 1.5 * slice_bytes * 1.2, (name, inter, slice_bytes)
            assert stats["reduce_scatter_q4"][1] > 0 and stats["all_gather_q8"][1] > 0, name
    # fp32 gradients over a ring that crosses nodes twice against about 1.5 bytes per element of a slice
    assert 0 < quantized_inter <= 0.2 * plain_inter, (quantized_inter, plain_inter)
    assert quantized[0]["qgZ-loco"]["error_feedback"] > 0
    assert quantized[0]["qgZ"]["error_feedback"] == 0


@pytest.mark.slow
def test_qgz_units_are_padded_to_aligned_slices(quantized):
    for name in Q_CASES:
        for numel, align in zip(quantized[0][name]["numel"], quantized[0][name]["aligned"], strict=True):
            assert numel % (WORLD_Q * align) == 0, (name, numel, align)
    assert any(align > 1 for align in quantized[0]["qgZ"]["aligned"])


@pytest.mark.slow
def test_qgz_checkpoint_with_loco_resumes_bit_for_bit(quantized):
    for out in quantized:
        first, resumed = out["loco_resume"]
        assert resumed == first


# ----- keys stage 0 refuses -----

@pytest.mark.parametrize("zero, key", [
    ({"zero_quantized_weights": True}, "zero_quantized_weights"),
    ({"zero_quantized_weights": True, "zcomm_weight_delta_bits": 4}, "zero_quantized_weights"),
    ({"zcomm_weight_delta_bits": 4}, "zcomm_weight_delta_bits"),
    ({"zero_hpz_partition_size": 2}, "zero_hpz_partition_size"),
    ({"offload_optimizer": {"device": "cpu"}}, "offload_optimizer"),
])
def test_keys_without_meaning_at_stage_0_are_refused_by_name(zero, key):
    from zero_runtime.config import ZeroConfig

    for config in ({"zero_optimization": {"stage": 0, **zero}}, {"zero_optimization": zero}):
        with pytest.raises(ValueError, match=f"zero_optimization.{key} is not supported at zero_optimization.stage 0"):
            ZeroConfig.from_dict(config)


@pytest.mark.parametrize("zero, message", [
    ({"offload_param": {"device": "cpu"}}, "offload_param .* needs zero_optimization.stage 3"),
    ({"zcomm_stage3_fuse_numel": 100}, "zcomm_stage3_fuse_numel needs zero_optimization.stage 3"),
    ({"zeropp_loco_param": {"err_beta": 0.8}}, "zeropp_loco_param .* needs zero_quantized_gradients"),
])
def test_other_stage_keys_keep_their_errors_at_stage_0(zero, message):
    from zero_runtime.config import ZeroConfig

    with pytest.raises(ValueError, match=message):
        ZeroConfig.from_dict({"zero_optimization": zero})


def test_stage_0_accepts_qgz_options_and_stage3_hints():
    from zero_runtime.config import ZeroConfig

    config = ZeroConfig.from_dict({"zero_optimization": {
        "zero_quantized_gradients": True, "zcomm_qgz_first_hop_bits": 8, "zcomm_quant_group_size": 128,
        "stage3_max_live_parameters": 1e9}})
    assert (config.stage, config.quantized_gradients, config.qgz_first_hop_bits) == (0, True, 8)
    # the all-reduce gathers in INT8 too: its groups count in the alignment
    assert config.quant_block_align() == 128
    assert ZeroConfig(stage=0, quantized_gradients=True, quant_group_size=None).quant_block_align() == 256
