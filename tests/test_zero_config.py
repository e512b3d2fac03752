"""Config parsing and the memory estimator (single process, no process group)."""

from __future__ import annotations

import json

import pytest

from zero_runtime import ZeroConfig
from zero_runtime.comm import build_comm_plan
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
    assert ZeroConfig.from_dict({"bf16": {"enabled": True}}).precision == "bf16"


def test_unknown_keys_are_all_listed():
    with pytest.raises(ValueError, match="unknown config keys: fp16.loss_scael, train_batch_size, "
                                         "zero_optimization.stgae"):
        ZeroConfig.from_dict({"zero_optimization": {"stgae": 2}, "train_batch_size": 8,
                              "fp16": {"enabled": True, "loss_scael": 0}})


@pytest.mark.parametrize("bad, message", [
    ({"zero_optimization": {"stage": 4}}, "stage must be 1, 2 or 3"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "pick one"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps must be >= 1"),
    ({"gradient_clipping": -1}, "gradient_clipping must be >= 0"),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, "hysteresis must be >= 1"),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 0}}, "zero_hpz_partition_size must be >= 1"),
    ({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}}, "need zero_optimization.stage 3"),
    ({"zero_optimization": []}, "must be a mapping"),
])
def test_invalid_values_are_rejected(bad, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ZeroConfig.from_dict(bad)


def test_zeropp_keys_validate_but_are_not_yet_wired():
    config = ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                                                         "zero_hpz_partition_size": 2,
                                                         "zero_quantized_gradients": True}})
    assert config.zeropp_options() == ["zero_quantized_weights", "zero_hpz_partition_size", "zero_quantized_gradients"]
    with pytest.raises(ValueError, match="not yet supported"):
        build_comm_plan(config, group=None)


def test_keyword_only_dataclass():
    with pytest.raises(TypeError):
        ZeroConfig(3)  # type: ignore[misc]


def test_estimator_matches_paper_formulas(capsys):
    P, N, K = 7e9, 64, 12
    expected = {0: (2 * P, 2 * P, K * P), 1: (2 * P, 2 * P, K * P / N),
                2: (2 * P, 2 * P / N, K * P / N), 3: (2 * P / N, 2 * P / N, K * P / N)}
    for stage, (params, grads, states) in expected.items():
        row = stage_estimate(stage, params=P, ranks=N, k=K)
        assert (row.parameters, row.gradients, row.optimizer_states) == pytest.approx((params, grads, states))
    # The paper's headline numbers: 16P bytes without ZeRO, ~4P, ~2P, and 16P/Nd.
    assert stage_estimate(0, params=P, ranks=N).total == pytest.approx(16 * P)
    assert stage_estimate(3, params=P, ranks=N).total == pytest.approx(16 * P / N)
    assert hpz_estimate(params=P, ranks=N, ranks_per_node=8).secondary == pytest.approx(2 * P / 8)

    main(["--params", "7e9", "--ranks", "64", "--ranks-per-node", "8"])
    lines = capsys.readouterr().out.splitlines()
    gib = 2 ** 30
    table = {line.split()[0]: line.split()[-1] for line in lines[2:6]}
    for stage in range(4):
        assert float(table[str(stage)]) == pytest.approx(sum(expected[stage]) / gib, abs=0.006)
    assert lines[6].startswith("3 + hpZ")


def test_estimator_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        main(["--params", "7e9", "--ranks", "12", "--ranks-per-node", "8"])
