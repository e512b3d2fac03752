"""bench.train's configuration matrix, engine configs, CLI selection and table (no processes)."""

from __future__ import annotations

import pytest
import torch

from bench.train.configs import (
    CONFIGS,
    DEEPSPEED_STAGE3_DEFAULTS,
    EngineSetup,
    TrainConfig,
    deepspeed_config,
    engine_config,
    select_configs,
    zero_runtime_config,  # fmt: skip
)
from bench.train.loop import ConfigResult, LoopSettings
from bench.train.report import format_table
from bench.train.runner import reshard_after_forward
from bench.train.suite import build_parser, chosen, main
from zero_runtime.config import ZeroConfig


def test_zero_runtime_configs_carry_exactly_the_zeropp_keys() -> None:
    assert zero_runtime_config(CONFIGS["zero1"], local_size=2, bf16=True, gradient_clipping=0.0) == {
        "zero_optimization": {"stage": 1},
        "bf16": {"enabled": True},
        "gradient_clipping": 0.0,
    }
    # Stage 3 gets no stage-3 keys: the runtime's defaults are what the README's config gives a user.
    zeropp = zero_runtime_config(CONFIGS["zeropp"], local_size=4, bf16=False, gradient_clipping=0.0)
    assert zeropp["zero_optimization"] == {
        "stage": 3,
        "zero_quantized_weights": True,
        "zero_hpz_partition_size": 4,
        "zero_quantized_gradients": True,
    }
    alone = {
        name: zero_runtime_config(CONFIGS[name], local_size=2, bf16=True, gradient_clipping=0.0)["zero_optimization"]
        for name in ("zero3+qwz", "zero3+hpz", "zero3+qgz")
    }
    assert alone == {
        "zero3+qwz": {"stage": 3, "zero_quantized_weights": True},
        "zero3+hpz": {"stage": 3, "zero_hpz_partition_size": 2},
        "zero3+qgz": {"stage": 3, "zero_quantized_gradients": True},
    }
    tensorscale = zero_runtime_config(CONFIGS["zeropp-tensorscale"], local_size=2, bf16=True, gradient_clipping=0.0)
    assert tensorscale["zero_optimization"]["zcomm_quant_group_size"] == "tensor"
    g128 = zero_runtime_config(CONFIGS["zeropp-g128"], local_size=2, bf16=True, gradient_clipping=0.0)
    assert g128["zero_optimization"]["zcomm_quant_group_size"] == 128
    stage0 = {name: zero_runtime_config(CONFIGS[name], local_size=2, bf16=True, gradient_clipping=0.0)
              ["zero_optimization"] for name in ("zero0", "zero0-q")}
    assert stage0 == {"zero0": {"stage": 0}, "zero0-q": {"stage": 0, "zero_quantized_gradients": True}}
    stage12 = {name: zero_runtime_config(CONFIGS[name], local_size=2, bf16=True, gradient_clipping=0.0)
               ["zero_optimization"] for name in ("zero2-q", "zero2-qwd", "zero1-qwd", "zeropp-wd")}
    quantized = {"zero_quantized_weights": True, "zero_quantized_gradients": True}
    assert stage12 == {"zero2-q": {"stage": 2, **quantized},
                       "zero2-qwd": {"stage": 2, **quantized, "zcomm_weight_delta_bits": 4},
                       "zero1-qwd": {"stage": 1, **quantized, "zcomm_weight_delta_bits": 4},
                       "zeropp-wd": {"stage": 3, **quantized, "zero_hpz_partition_size": 2,
                                     "zcomm_weight_delta_bits": 4}}


@pytest.mark.parametrize("name", [name for name, config in CONFIGS.items() if config.engine == "zero"])
def test_the_runtime_accepts_every_zero_config(name: str) -> None:
    parsed = ZeroConfig.from_dict(zero_runtime_config(CONFIGS[name], local_size=2, bf16=False, gradient_clipping=0.5))
    assert parsed.gradient_clipping == 0.5 and parsed.precision == "fp32"


def test_same_math_clipping_and_stage3_defaults_on_both_zero_engines() -> None:
    """[Note: same math]: DeepSpeed clips at 1.0 unless told, so both dicts say it."""
    for clip in (0.0, 1.0):
        ours = zero_runtime_config(CONFIGS["zero3"], local_size=2, bf16=False, gradient_clipping=clip)
        theirs = deepspeed_config(CONFIGS["deepspeed-z3"], local_size=2, bf16=False, gradient_clipping=clip,
                                  micro_batch=1)  # fmt: skip
        assert ours["gradient_clipping"] == theirs["gradient_clipping"] == clip
        assert ours["bf16"] == theirs["bf16"] == {"enabled": False}
        assert ours["zero_optimization"] == {"stage": 3}
    assert {k: v for k, v in theirs["zero_optimization"].items() if k != "stage"} == DEEPSPEED_STAGE3_DEFAULTS


def _setup(**options: object) -> EngineSetup:
    return EngineSetup(**{**dict(lr=1e-3, local_size=2, world_size=4, bf16=False, gradient_clipping=0.0, micro_batch=2,
                                 device=torch.device("cpu")), **options})  # fmt: skip


def test_deepspeed_config_has_its_batch_and_optimizer_keys() -> None:
    common = dict(bf16=True, gradient_clipping=0.0, micro_batch=2)
    config = deepspeed_config(CONFIGS["deepspeed-z3-hpz"], local_size=8, **common)
    assert config["train_micro_batch_size_per_gpu"] == 2
    assert config["zero_allow_untested_optimizer"] is True
    assert config["zero_optimization"] == {"stage": 3, "zero_hpz_partition_size": 8, **DEEPSPEED_STAGE3_DEFAULTS}
    zeropp = deepspeed_config(CONFIGS["deepspeed-zeropp"], local_size=2, **common)
    assert {k: zeropp["zero_optimization"][k] for k in ("zero_quantized_weights", "zero_hpz_partition_size",
                                                         "zero_quantized_gradients")} == {
        "zero_quantized_weights": True, "zero_hpz_partition_size": 2, "zero_quantized_gradients": True}
    fsdp2 = engine_config(CONFIGS["fsdp2"], _setup(bf16=False, gradient_clipping=0.0))
    assert fsdp2 == {"param_dtype": "fp32", "hpz": False, "gradient_clipping": 0.0}
    zeropp = engine_config(CONFIGS["fsdp2-zeropp"], _setup(bf16=True, gradient_clipping=1.0))
    assert zeropp == {"param_dtype": "bf16", "hpz": True, "gradient_clipping": 1.0, "enable_zeropp": {
        "quantized_weights": True, "quantized_gradients": True, "group_size": None, "first_hop_bits": None}}
    int4hop = engine_config(CONFIGS["fsdp2-zeropp-int4hop"], _setup(bf16=True, gradient_clipping=1.0))
    assert int4hop["enable_zeropp"]["first_hop_bits"] == 4
    hsdp = engine_config(CONFIGS["hsdp"], _setup(bf16=True, gradient_clipping=1.0))
    assert hsdp == {"param_dtype": "bf16", "hpz": False, "hsdp": True, "gradient_clipping": 1.0}
    hsdp_zeropp = engine_config(CONFIGS["hsdp-zeropp"], _setup(bf16=True, gradient_clipping=1.0))
    assert hsdp_zeropp["hsdp"] is True and hsdp_zeropp["enable_zeropp"] == {
        "quantized_weights": True, "quantized_gradients": True, "group_size": None, "first_hop_bits": None,
        "replicate_group": "replicate", "quantized_all_reduce": True}
    only_across = engine_config(CONFIGS["hsdp-zcomm-g4"], _setup(bf16=True, gradient_clipping=1.0))
    assert only_across["enable_zeropp"] == {
        "quantized_weights": False, "quantized_gradients": False, "group_size": None, "first_hop_bits": None,
        "replicate_group": "replicate", "quantized_all_reduce": True, "replicate_gather_bits": 4}


def test_invalid_configurations_are_rejected() -> None:
    with pytest.raises(ValueError, match="stage 3"):
        TrainConfig(name="x", engine="zero", stage=2, hpz=True)
    with pytest.raises(ValueError, match="fsdp2 runs stage 3, got stage 2"):
        TrainConfig(name="x", engine="fsdp2", stage=2)
    with pytest.raises(ValueError, match="fsdp2 runs stage 3, got stage 0"):
        TrainConfig(name="x", engine="fsdp2", stage=0)
    with pytest.raises(ValueError, match="qwZ has no parameter gather"):
        TrainConfig(name="x", engine="zero", stage=0, quantized_weights=True)
    with pytest.raises(ValueError, match="quant_group_size"):
        TrainConfig(name="x", engine="zero", quant_group_size="tensor")
    with pytest.raises(ValueError, match="HSDP is an FSDP2 layout"):
        TrainConfig(name="x", engine="zero", hsdp=True)
    with pytest.raises(ValueError, match="HSDP is an FSDP2 layout"):
        TrainConfig(name="x", engine="fsdp2", hsdp=True, hpz=True)
    with pytest.raises(ValueError, match="HSDP is an FSDP2 layout"):
        TrainConfig(name="x", engine="ddp", stage=0, hsdp=True)
    with pytest.raises(ValueError, match="qwZ and qgZ outside stage 3 are zero_runtime's"):
        TrainConfig(name="x", engine="ddp", stage=0, quantized_gradients=True)
    with pytest.raises(ValueError, match="deepspeed runs stage 1/2/3, got stage 0"):
        TrainConfig(name="x", engine="deepspeed", stage=0)
    with pytest.raises(ValueError, match="gather_bits is the quantized all-reduce's"):
        TrainConfig(name="x", engine="ddp", stage=0, ddp_hook="bf16", gather_bits=4)
    with pytest.raises(ValueError, match="gather_bits is the quantized all-reduce's"):
        TrainConfig(name="x", engine="zero", stage=0, gather_bits=4)
    with pytest.raises(ValueError, match="gather_bits is the quantized all-reduce's"):
        TrainConfig(name="x", engine="fsdp2", hsdp=True, gather_bits=4)
    with pytest.raises(ValueError, match="all_reduce_q4 is HSDP's replicate all-reduce"):
        TrainConfig(name="x", engine="fsdp2", all_reduce_q4=True)
    with pytest.raises(ValueError, match="ddp_hook is an option of the ddp engine"):
        TrainConfig(name="x", engine="fsdp2", ddp_hook="zcomm")
    with pytest.raises(ValueError, match="unknown configuration"):
        select_configs(["zero3", "zero4"])
    with pytest.raises(ValueError, match="more than once"):
        select_configs(["zero3", "zero3"])
    with pytest.raises(ValueError, match="warmup"):
        LoopSettings(steps=3, warmup=3)


def test_cli_selects_the_configs() -> None:
    parser = build_parser()
    names = lambda argv: [c.name for c in chosen(parser.parse_args(argv))[0]]  # noqa: E731
    assert names(["--configs", "zeropp", "fsdp2-hpz"]) == ["zeropp", "fsdp2-hpz"]
    assert names([]) == ["zero3", "zeropp", "fsdp2"]
    with pytest.raises(ValueError, match="unknown configuration"):
        chosen(parser.parse_args(["--configs", "zero3", "zero9"]))


def test_cli_precision_and_clipping_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args([])
    assert args.dtype == "auto" and args.grad_clip == 0.0
    chosen(args)
    with pytest.raises(ValueError, match="--grad-clip"):
        chosen(build_parser().parse_args(["--grad-clip", "-1"]))
    with pytest.raises(SystemExit) as info:  # a usage error, before any rank joins
        main(["--grad-clip", "-1"])
    assert info.value.code == 2 and "--grad-clip must be >= 0" in capsys.readouterr().err


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
        ConfigResult(
            config="zeropp",
            model="tinygpt",
            median_step_s=0.5,
            tokens_per_s=100.0,
            wire_tx_bytes_per_step=2e6,
            wire_time_s=0.125,
            wire_fraction=0.25,
            memory_bytes=2**20,
            first_loss=5.5,
            last_loss=4.25,
            val_loss=4.5,
        ),
        ConfigResult(config="deepspeed-z3", model="tinygpt", status="skipped", note="needs deepspeed"),
        ConfigResult(config="deepspeed-zeropp", model="tinygpt", status="failed", note="raised ValueError: no CPU op"),
    ]
    lines = format_table(rows).splitlines()
    assert lines[0].split()[:3] == ["config", "model", "step"]
    assert lines[1].split() == ["zero3", "tinygpt", "12.5", "81920", "n/a", "n/a", "n/a", "3.00", "5.5000", "4.2500",
                                "4.5000"]
    assert lines[2].split()[4:7] == ["2.000", "125.0", "25"]
    assert lines[3].split()[:3] == ["deepspeed-z3", "tinygpt", "skipped:"] and lines[3].endswith("needs deepspeed")
    assert lines[4].split()[:3] == ["deepspeed-zeropp", "tinygpt", "failed:"] and lines[4].endswith("no CPU op")
