"""bench.train's configuration matrix, engine configs, CLI selection and table (no processes)."""

from __future__ import annotations

import pytest

from bench.train.cli import build_parser, chosen_configs
from bench.train.configs import CONFIGS, STAGE3_FUSE_NUMEL, TrainConfig, deepspeed_config, select_configs, zero_runtime_config
from bench.train.fsdp2_runner import reshard_after_forward
from bench.train.loop import ConfigResult, LoopSettings
from bench.train.report import format_table


def test_zero_runtime_configs_carry_exactly_the_zeropp_keys() -> None:
    assert zero_runtime_config(CONFIGS["zero1"], local_size=2, bf16=True) == {
        "zero_optimization": {"stage": 1},
        "bf16": {"enabled": True},
    }
    # Stage 3 also gets the unit-fusion threshold (zcomm's own key, not a ZeRO++ one).
    fuse = {"zcomm_stage3_fuse_numel": STAGE3_FUSE_NUMEL}
    assert zero_runtime_config(CONFIGS["zeropp"], local_size=4, bf16=False)["zero_optimization"] == {
        "stage": 3,
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": 4,
        "zero_quantized_gradients": True,
        **fuse,
    }
    alone = {
        name: zero_runtime_config(CONFIGS[name], local_size=2, bf16=True)["zero_optimization"]
        for name in ("zero3+qwz", "zero3+hpz", "zero3+qgz")
    }
    assert alone == {
        "zero3+qwz": {"stage": 3, "zero_quantized_weights": True, **fuse},
        "zero3+hpz": {"stage": 3, "zero_hpz_partition_size": 2, **fuse},
        "zero3+qgz": {"stage": 3, "zero_quantized_gradients": True, **fuse},
    }
    tensorscale = zero_runtime_config(CONFIGS["zeropp-tensorscale"], local_size=2, bf16=True)
    assert tensorscale["zero_optimization"]["zcomm_quant_group_size"] == "tensor"
    g128 = zero_runtime_config(CONFIGS["zeropp-g128"], local_size=2, bf16=True)
    assert g128["zero_optimization"]["zcomm_quant_group_size"] == 128


def test_deepspeed_config_has_its_batch_and_optimizer_keys() -> None:
    config = deepspeed_config(CONFIGS["deepspeed-z3-hpz"], local_size=8, bf16=True, micro_batch=2)
    assert config["train_micro_batch_size_per_gpu"] == 2
    assert config["zero_allow_untested_optimizer"] is True
    assert config["zero_optimization"] == {"stage": 3, "zero_hpz_partition_size": 8}


def test_invalid_configurations_are_rejected() -> None:
    with pytest.raises(ValueError, match="stage 3"):
        TrainConfig(name="x", engine="zero", stage=2, hpz=True, summary="")
    with pytest.raises(ValueError, match="FSDP2"):
        TrainConfig(name="x", engine="fsdp2", quantized_weights=True, summary="")
    with pytest.raises(ValueError, match="quant_group_size"):
        TrainConfig(name="x", engine="zero", quant_group_size="tensor", summary="")
    with pytest.raises(ValueError, match="unknown configuration"):
        select_configs(["zero3", "zero4"])
    with pytest.raises(ValueError, match="more than once"):
        select_configs(["zero3", "zero3"])
    with pytest.raises(ValueError, match="warmup"):
        LoopSettings(steps=3, warmup=3)


def test_cli_selects_issue5_and_issue6_spellings() -> None:
    parser = build_parser()
    names = lambda argv: [c.name for c in chosen_configs(parser.parse_args(argv))]  # noqa: E731
    assert names(["--impl", "zero", "fsdp2", "--stage", "1", "2", "3"]) == ["zero1", "zero2", "zero3", "fsdp2"]
    assert names(["--configs", "zeropp", "fsdp2-hpz"]) == ["zeropp", "fsdp2-hpz"]
    assert names([]) == ["zero3", "zeropp", "fsdp2"]
    with pytest.raises(ValueError, match="either"):
        chosen_configs(parser.parse_args(["--configs", "zero3", "--impl", "zero"]))


@pytest.mark.parametrize(("local_size", "world_size", "expected"), [(2, 4, 2), (4, 4, True), (1, 4, False)])
def test_fsdp2_hpz_reshards_to_the_node(local_size: int, world_size: int, expected: bool | int) -> None:
    got = reshard_after_forward(CONFIGS["fsdp2-hpz"], local_size=local_size, world_size=world_size)
    assert got is expected if isinstance(expected, bool) else got == expected
    assert reshard_after_forward(CONFIGS["fsdp2"], local_size=2, world_size=4) is True


def test_table_shows_measured_values_and_skip_notes() -> None:
    rows = [
        ConfigResult(
            config="zero3",
            model="tinygpt",
            median_step_s=0.0125,
            tokens_per_s=81920.0,
            wire_tx_bytes_per_step=None,
            memory_bytes=3 * 2**20,
            first_loss=5.5,
            last_loss=4.25,
            val_loss=4.5,
        ),
        ConfigResult(config="deepspeed-z3", model="tinygpt", status="skipped", note="needs deepspeed"),
    ]
    lines = format_table(rows).splitlines()
    assert lines[0].split()[:3] == ["config", "model", "step"]
    assert lines[1].split() == ["zero3", "tinygpt", "12.5", "81920", "n/a", "3.00", "5.5000", "4.2500", "4.5000"]
    assert lines[2].split()[:3] == ["deepspeed-z3", "tinygpt", "skipped:"] and lines[2].endswith("needs deepspeed")
