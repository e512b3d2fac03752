"""Config parsing and the memory estimator (single process, no process group)."""

from __future__ import annotations

import json
import re

import pytest

from zcomm import Topology
from zero_runtime import ZeroConfig
from zero_runtime.comm._hpz_gather import hpz_block_topology
from zero_runtime.estimate import hpz_estimate, main, stage_estimate


def test_deepspeed_dict_maps_to_fields(tmp_path):
    ds = {
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000, "stage3_prefetch_bucket_size": 0},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 50,
                 "hysteresis": 1, "min_loss_scale": 2},
        "gradient_clipping": 1.0,
        "gradient_accumulation_steps": 4,
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    config = ZeroConfig.from_json(path)
    assert (config.stage, config.precision) == (3, "fp16")
    assert (config.reduce_bucket_size, config.prefetch_bucket_size) == (1000, 0)
    assert (config.gradient_clipping, config.gradient_accumulation_steps) == (1.0, 4)
    assert (config.loss_scale.initial_scale_power, config.loss_scale.loss_scale_window,
            config.loss_scale.hysteresis, config.loss_scale.min_loss_scale) == (8, 50, 1, 2)
    assert ZeroConfig.from_dict({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}).precision == "bf16"


def test_unknown_keys_are_all_listed_with_the_nearest_known_key():
    with pytest.raises(ValueError) as err:
        ZeroConfig.from_dict({"zero_optimization": {"stgae": 2}, "train_batch_sizes": 8, "fancy_feature": 1,
                              "fp16": {"enabled": True, "loss_scael": 0}})
    assert str(err.value) == (
        "unknown config keys: fancy_feature, fp16.loss_scael (did you mean fp16.loss_scale?), "
        "train_batch_sizes (did you mean train_batch_size?), zero_optimization.stgae (did you mean "
        "zero_optimization.stage?)")


@pytest.mark.parametrize("bad, message", [
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"devcie": "cpu"}}},
     "zero_optimization.offload_optimizer.devcie \\(did you mean zero_optimization.offload_optimizer.device\\?\\)"),
    ({"zero_optimization": {"stage": 3}, "aio": {"queue_dept": 4}},
     "aio.queue_dept \\(did you mean aio.queue_depth\\?\\)"),
    ({"zero_optimization": {"stage": 3}, "activation_checkpointing": {"cpu_checkpoint": True}},
     "activation_checkpointing.cpu_checkpoint \\(did you mean activation_checkpointing.cpu_checkpointing\\?\\)"),
    ({"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "parms": {}}},
     "optimizer.parms \\(did you mean optimizer.params\\?\\)"),
    ({"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"weight_decy": 0.1}}},
     "weight_decy \\(did you mean weight_decay\\?\\)"),
    ({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True, "zeropp_loco_param": {"err_bta": 0.5}}},
     "zeropp_loco_param.err_bta \\(did you mean zero_optimization.zeropp_loco_param.err_beta\\?\\)"),
    ({"zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_sav": True}},
     "did you mean zero_optimization.stage3_gather_16bit_weights_on_model_save\\?"),  # an ignored key is known
])
def test_near_miss_keys_in_every_section_say_did_you_mean(bad, message):
    with pytest.raises(ValueError, match=message):
        ZeroConfig.from_dict(bad)


@pytest.mark.parametrize("config", [
    {"zero_optimization": {"stage": 2}, "bf16": {"enabled": "auto"}},
    {"zero_optimization": {"stage": 2}, "fp16": {"enabled": "auto", "loss_scale": 0}},
    {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": "auto"}}},
    {"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"betas": ["auto", 0.999]}}},
    {"zero_optimization": {"stage": 2}, "activation_checkpointing": {"number_checkpoints": "auto"}},
])
def test_hugging_face_auto_at_any_depth_is_an_error_naming_its_path(config):
    paths = {"bf16": "bf16.enabled", "fp16": "fp16.enabled", "optimizer": "optimizer.params.betas[0]",
             "activation_checkpointing": "activation_checkpointing.number_checkpoints"}
    path = next((v for k, v in paths.items() if k in config), "zero_optimization.offload_optimizer.pin_memory")
    with pytest.raises(ValueError, match=f"Hugging Face Trainer placeholder.*give values for: {re.escape(path)}$"):
        ZeroConfig.from_dict(config)


def test_auto_is_a_value_only_for_zcomms_own_direct_io_key():
    config = ZeroConfig.from_dict({"zero_optimization": {"stage": 2}, "aio": {"zcomm_direct_io": "auto"}})
    assert config.aio.zcomm_direct_io == "auto"


@pytest.mark.parametrize("config", [{}, {"zero_optimization": {"reduce_bucket_size": 1000}},
                                    {"zero_optimization": {"stage": 0}}, {"zero_optimization": False}])
def test_a_config_without_a_stage_runs_deepspeeds_stage_0(config):
    assert ZeroConfig.from_dict(config).stage == 0
    assert ZeroConfig().stage == 0
    assert ZeroConfig.from_dict({"zero_optimization": True}).stage == 1  # DeepSpeed's legacy flag


@pytest.mark.parametrize("bad, message", [
    ({"zero_optimization": {"stage": 4}}, "stage must be 0, 1, 2 or 3"),
    ({"zero_optimization": {"stage": True}}, "stage must be 0, 1, 2 or 3"),
    ({"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}, "fp16": {"enabled": True}}, "pick one"),
    ({"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 0},
     "gradient_accumulation_steps must be an integer >= 1"),
    ({"zero_optimization": {"stage": 2}, "gradient_clipping": -1}, "gradient_clipping must be >= 0"),
    ({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True, "hysteresis": 0}}, "hysteresis must be >= 1"),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 0}}, "zero_hpz_partition_size must be >= 1"),
    ({"zero_optimization": {"stage": 2, "zero_hpz_partition_size": 2}}, "needs zero_optimization.stage 3"),
    ({"zero_optimization": []}, "must be a mapping"),
    ({"zero_optimization": {"stage": 3, "zcomm_stage3_fuse_numel": -1}},
     "zcomm_stage3_fuse_numel must be an integer >= 0"),
    ({"zero_optimization": {"stage": 2, "zcomm_stage3_fuse_numel": 100}}, "zcomm_stage3_fuse_numel needs"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 0}}, "reduce_bucket_size must be an integer >= 1"),
    ({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": -1}}, "stage3_prefetch_bucket_size must be"),
    ({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": -1}},
     "stage3_param_persistence_threshold must be an integer >= 0"),
    ({"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1.5e3 + 0.5}},
     "stage3_max_live_parameters must be an integer >= 0 \\(elements\\), got 1500.5"),
    ({"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": True}}, "stage3_max_reuse_distance must be"),
    ({"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": "auto"}},
     "placeholder, not a DeepSpeed value; give values for: zero_optimization.stage3_max_reuse_distance"),
    ({"zero_optimization": {"stage": 2, "overlap_comm": "yes"}}, "overlap_comm must be true or false"),
    ({"zero_optimization": {"stage": 3, "stage3_param_persistence_thresold": 0}},
     "unknown config keys: zero_optimization.stage3_param_persistence_thresold"),
])
def test_invalid_values_are_rejected(bad, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ZeroConfig.from_dict(bad)


def test_stage3_keys_take_deepspeeds_defaults_and_json_numbers():
    from zero_runtime.config import DEFAULT_FUSE_NUMEL, DEFAULT_REDUCE_BUCKET_SIZE

    plain = ZeroConfig(stage=3)
    assert (plain.param_persistence_threshold, plain.max_live_parameters, plain.max_reuse_distance,
            plain.prefetch_bucket_size) == (100_000, 10**9, 10**9, 5 * 10**7)  # DeepSpeed's defaults
    assert (plain.fuse_numel, plain.reduce_bucket_size) == (DEFAULT_FUSE_NUMEL, DEFAULT_REDUCE_BUCKET_SIZE)
    assert ZeroConfig(stage=2).fuse_numel == 0  # no units to fuse below stage 3
    # DeepSpeed's JSON writes counts as 1e9; they are stored as ints.
    parsed = ZeroConfig.from_dict({"zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 1e4, "stage3_max_live_parameters": 3e8,
        "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 5e6, "reduce_bucket_size": 2e5,
        "zcomm_stage3_fuse_numel": 0}})
    values = (parsed.param_persistence_threshold, parsed.max_live_parameters, parsed.max_reuse_distance,
              parsed.prefetch_bucket_size, parsed.reduce_bucket_size, parsed.fuse_numel)
    assert values == (10_000, 300_000_000, 0, 5_000_000, 200_000, 0)
    assert all(type(value) is int for value in values)
    assert plain.overlap_comm
    assert not ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "overlap_comm": False}}).overlap_comm
    # As in DeepSpeed, the stage-3 keys are accepted, and have no effect, below stage 3.
    assert ZeroConfig.from_dict({"zero_optimization": {"stage": 2, "stage3_max_live_parameters": 1e9}}).stage == 2


def test_zeropp_keys_map_to_fields():
    config = ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                                         "zero_hpz_partition_size": 2,
                                                         "zero_quantized_gradients": True,
                                                         "zcomm_quant_group_size": "tensor"}})
    assert config.zeropp_options() == ["zero_quantized_weights", "zero_hpz_partition_size", "zero_quantized_gradients"]
    assert (config.quantized_weights, config.hpz_partition_size, config.quantized_gradients) == (True, 2, True)
    assert config.quant_group_size == "tensor"
    assert ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True,
                                                       "zcomm_quant_group_size": 64}}).quant_group_size == 64
    assert ZeroConfig(stage=3).quant_group_size is None  # zcomm's defaults


@pytest.mark.parametrize("zero, message", [
    ({"stage": 3, "zero_quantized_weights": True, "zcomm_weight_delta_bits": 4},
     "zcomm_weight_delta_bits in zero_optimization.stage 3 needs zero_hpz_partition_size"),
    ({"stage": 1, "zero_hpz_partition_size": 2}, "zero_hpz_partition_size needs zero_optimization.stage 3"),
    ({"stage": 3, "zero_quantized_weights": 1}, "zero_quantized_weights must be true or false"),
    ({"stage": 3, "zero_hpz_partition_size": 2.0}, "zero_hpz_partition_size must be an int"),
    # Validated by zcomm.quant.QuantSpec for both widths, even with only INT8 qwZ on.
    ({"stage": 3, "zero_quantized_weights": True, "zcomm_quant_group_size": 7},
     "zcomm_quant_group_size 7 .*must be even for 4-bit"),
    ({"stage": 3, "zero_quantized_weights": True, "zcomm_quant_group_size": 0},
     "zcomm_quant_group_size 0 .*must be >= 2"),
    ({"stage": 3, "zero_quantized_weights": True, "zcomm_quant_group_size": True},
     "zcomm_quant_group_size True .*must be an int >= 2, \"tensor\" or None"),
    ({"stage": 3, "zero_quantized_weights": True, "zcomm_quant_group_size": "block"},
     "zcomm_quant_group_size 'block' .*must be an int >= 2, \"tensor\" or None"),
    ({"stage": 3, "zcomm_quant_group_size": 64}, "neither zero_quantized_weights nor"),
    ({"stage": 2, "zcomm_quant_group_size": 64}, "neither zero_quantized_weights nor"),
])
def test_zeropp_config_errors(zero, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ZeroConfig.from_dict({"zero_optimization": zero})


@pytest.mark.parametrize("world, local, size, message", [
    (4, 2, 3, "3 must divide the world size 4"),
    (8, 2, 16, "16 must divide the world size 8"),
    (6, 3, 2, "must divide the ranks per node \\(local_size 3\\) or be a multiple of it"),
    (12, 3, 4, "must divide the ranks per node \\(local_size 3\\) or be a multiple of it"),
])
def test_hpz_partition_size_must_divide_the_world_and_line_up_with_nodes(world, local, size, message):
    with pytest.raises(ValueError, match=message):
        hpz_block_topology(Topology(world_size=world, local_size=local), 0, size)


def test_hpz_block_topology_follows_the_nodes():
    two_by_two = Topology(world_size=4, local_size=2)
    assert hpz_block_topology(two_by_two, 3, 2) == Topology(world_size=2, local_size=2)  # one node
    assert hpz_block_topology(two_by_two, 1, 4) == Topology(world_size=4, local_size=2)  # spans both nodes
    assert hpz_block_topology(Topology(world_size=8, local_size=4), 5, 2) == Topology(world_size=2, local_size=2)
    assert hpz_block_topology(Topology(world_size=4, local_size=1), 2, 2) == Topology(world_size=2, local_size=1)


def test_keyword_only_dataclass():
    with pytest.raises(TypeError):
        ZeroConfig(3)  # type: ignore[misc]


def test_estimator_matches_paper_formulas(capsys):
    P, N, K = 7e9, 64, 12
    expected = {0: (2 * P, 2 * P, K * P), 1: (2 * P, 2 * P, K * P / N),
                2: (2 * P, 2 * P / N, K * P / N), 3: (2 * P / N, 2 * P / N, K * P / N)}
    for stage, (params, grads, states) in expected.items():
        row = stage_estimate(stage, params=P, world_size=N, k=K)
        assert (row.parameters, row.gradients, row.optimizer_states) == pytest.approx((params, grads, states))
    # The paper's headline numbers: 16P bytes without ZeRO, ~4P, ~2P, and 16P/Nd.
    assert stage_estimate(0, params=P, world_size=N).total == pytest.approx(16 * P)
    assert stage_estimate(3, params=P, world_size=N).total == pytest.approx(16 * P / N)
    assert hpz_estimate(params=P, world_size=N, partition_size=8).secondary == pytest.approx(2 * P / 8)

    main(["--params", "7e9", "--world-size", "64", "--local-size", "8"])
    lines = capsys.readouterr().out.splitlines()
    gib = 2 ** 30
    table = {line.split()[0]: line.split()[-1] for line in lines[2:6]}
    for stage in range(4):
        assert float(table[str(stage)]) == pytest.approx(sum(expected[stage]) / gib, abs=0.006)
    assert lines[6].startswith("3 + hpZ")
    main(["--params", "7e9", "--world-size", "64", "--local-size", "8", "--hpz-partition-size", "16"])
    hpz_row = capsys.readouterr().out.splitlines()[6].split()
    assert float(hpz_row[-3]) == pytest.approx(2 * P / 16 / gib, abs=0.006)  # the secondary column
    assert float(hpz_row[-2]) == 0.0  # no LoCo buffers


def test_estimator_loco_row_counts_both_hops_of_int8_errors(capsys):
    """LoCo's error buffers are not partitioned: P bytes (hop 1) + P / local_size (hop 2), plus
    a 4-byte scale per group."""
    P, gib = 7e9, 2 ** 30
    main(["--params", "7e9", "--world-size", "64", "--local-size", "8", "--loco-group-size", "512"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[7].startswith("3 + hpZ + LoCo")
    loco, hpz = lines[7].split(), lines[6].split()
    expected = (P + P / 8) * (1 + 4 / 512)
    assert float(loco[-2]) == pytest.approx(expected / gib, abs=0.006)
    assert float(loco[-1]) == pytest.approx(float(hpz[-1]) + expected / gib, abs=0.011)
    main(["--params", "7e9", "--world-size", "8", "--local-size", "8"])  # one node: one hop
    assert float(capsys.readouterr().out.splitlines()[7].split()[-2]) == pytest.approx(P * (1 + 4 / 512) / gib,
                                                                                       abs=0.006)


@pytest.mark.parametrize("extra, message", [
    (["--local-size", "8"], "--world-size 12 is not a multiple of --local-size 8"),
    (["--local-size", "4", "--hpz-partition-size", "8"], "--world-size 12 is not a multiple of --hpz-partition-size 8"),
])
def test_estimator_rejects_bad_arguments(extra, message, capsys):
    with pytest.raises(SystemExit):
        main(["--params", "7e9", "--world-size", "12", *extra])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("old, new", [("--ranks", "--world-size"), ("--ranks-per-node", "--local-size")])
def test_estimator_old_flag_spellings_name_the_new_ones(old, new, capsys):
    args = {"--ranks": ["--ranks", "64", "--local-size", "8"],
            "--ranks-per-node": ["--world-size", "64", "--ranks-per-node", "8"]}[old]
    with pytest.raises(SystemExit):
        main(["--params", "7e9", *args])
    assert f"{old} is now {new}" in capsys.readouterr().err
