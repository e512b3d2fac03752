"""DeepSpeed configs as written: top-level keys, batch arithmetic, optimizer and scheduler
sections, ignored hints (single process), and one 2-rank run trained from such a config
against plain torch with the learning rates written out here (the oracle)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from zero_harness import run
from zero_runtime import ZeroConfig
from zero_runtime.lr_schedules import WarmupCosineLR, WarmupDecayLR, WarmupLR
from zero_workloads import global_batch, local_slice, loss_of, make_model

# From DeepSpeed's documentation (deepspeed.ai/docs/config-json and the ZeRO tutorial), as written.
DOCS_GETTING_STARTED = {
    "train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.00015}},
    "fp16": {"enabled": True},
    "zero_optimization": True,
}
DOCS_FULL = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 8,
    "steps_per_print": 10,
    "wall_clock_breakdown": False,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000}},
    "gradient_clipping": 1.0,
    "prescale_gradients": False,
    "fp16": {"enabled": True, "auto_cast": False, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
             "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1},
    "zero_optimization": {"stage": 3, "contiguous_gradients": True, "overlap_comm": True,
                          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_prefetch_bucket_size": 1e7, "stage3_param_persistence_threshold": 1e5,
                          "reduce_bucket_size": 1e7, "allgather_partitions": True, "allgather_bucket_size": 5e8,
                          "reduce_scatter": True, "stage3_gather_16bit_weights_on_model_save": True},
}
DEEPSPEED_EXAMPLE = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 8,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                 "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
                 "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True},
                 "bf16": {"enabled": True}}


def _parse(config: dict) -> tuple[ZeroConfig, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parsed = ZeroConfig.from_dict(config)
    return parsed, [str(w.message) for w in caught]


def test_documented_configs_parse_and_name_the_ignored_hints():
    config, messages = _parse(DOCS_FULL)
    assert (config.stage, config.precision, config.gradient_clipping) == (3, "fp16", 1.0)
    assert (config.reduce_bucket_size, config.prefetch_bucket_size) == (10**7, 10**7)
    assert config.optimizer["type"] == "Adam" and config.scheduler["type"] == "WarmupLR"
    assert len(messages) == 1  # reported once, every name in it
    for name in ("steps_per_print", "wall_clock_breakdown", "prescale_gradients", "fp16.auto_cast",
                 "fp16.consecutive_hysteresis", "zero_optimization.contiguous_gradients",
                 "zero_optimization.allgather_partitions", "zero_optimization.allgather_bucket_size",
                 "zero_optimization.reduce_scatter", "zero_optimization.stage3_gather_16bit_weights_on_model_save"):
        assert name in messages[0]
    assert "overlap_comm" not in messages[0]  # it has a meaning here
    legacy, messages = _parse(DOCS_GETTING_STARTED)
    assert (legacy.stage, legacy.precision, legacy.train_batch_size) == (1, "fp16", 8) and messages == []
    parsed, messages = _parse(DEEPSPEED_EXAMPLE)
    assert (parsed.stage, parsed.precision) == (3, "bf16") and "zero_optimization.contiguous_gradients" in messages[0]


@pytest.mark.parametrize("batch, micro, accum, world, expected", [
    (32, 8, None, 4, (32, 8, 1)),  # two given: the third derived
    (32, 8, None, 2, (32, 8, 2)),
    (32, None, 2, 4, (32, 4, 2)),
    (None, 4, 2, 4, (32, 4, 2)),
    (32, None, None, 4, (32, 8, 1)),  # one given: no accumulation
    (None, 8, None, 4, (32, 8, 1)),
    (32, 4, 2, 4, (32, 4, 2)),  # three given: checked
])
def test_batch_arithmetic_follows_deepspeed(batch, micro, accum, world, expected):
    config = ZeroConfig(stage=2, train_batch_size=batch, train_micro_batch_size_per_gpu=micro,
                        gradient_accumulation_steps=accum).for_world_size(world)
    assert (config.train_batch_size, config.train_micro_batch_size_per_gpu,
            config.gradient_accumulation_steps) == expected
    assert expected[0] == expected[1] * expected[2] * world


@pytest.mark.parametrize("batch, micro, accum, world", [
    (32, 8, 2, 4),  # 8 * 2 * 4 = 64
    (32, 8, None, 3),  # 32 // 8 // 3 = 1 accumulation step, 24 != 32
    (32, None, None, 3),  # 32 // 3 = 10 per rank, 30 != 32
    (8, 16, None, 1),  # accumulation would be 0
])
def test_batch_arithmetic_mismatch_names_the_numbers(batch, micro, accum, world):
    config = ZeroConfig(stage=2, train_batch_size=batch, train_micro_batch_size_per_gpu=micro,
                        gradient_accumulation_steps=accum)
    with pytest.raises(ValueError, match=f"x world size \\({world}\\); given: train_batch_size={batch}"):
        config.for_world_size(world)


def test_without_batch_sizes_accumulation_stays_as_given():
    assert ZeroConfig(stage=2).for_world_size(8).gradient_accumulation_steps == 1
    assert ZeroConfig(stage=2, gradient_accumulation_steps=3).for_world_size(8).gradient_accumulation_steps == 3


@pytest.mark.parametrize("bad, message", [
    ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "'Lamb' is one of DeepSpeed's own optimizers"),
    ({"optimizer": {"type": "OneBitAdam"}}, "'OneBitAdam' is one of DeepSpeed's own optimizers"),
    ({"optimizer": {"type": "Adamm"}}, "'Adamm' is neither Adam, AdamW, Adagrad nor a torch.optim.*did you mean Adam"),
    ({"optimizer": {"type": "RMSProp"}}, "did you mean RMSprop\\?"),
    ({"scheduler": {"type": "WarmupLr"}}, "not one of DeepSpeed's schedules.*did you mean WarmupLR\\?"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betaz": [0.9, 0.99]}}},
     "unknown optimizer.params for AdamW parameters: betaz"),
    ({"optimizer": {"type": "AdamW", "params": {"max_grad_norm": 1.0}}}, "use the top-level 'gradient_clipping'"),
    ({"optimizer": {"type": "AdamW", "parms": {}}}, "unknown config keys: optimizer.parms"),
    ({"optimizer": {"params": {}}}, "optimizer.type must be a string"),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, "'OneCycle' is not implemented in zero_runtime"),
    ({"scheduler": {"type": "LRRangeTest"}}, "'LRRangeTest' is not implemented in zero_runtime"),
    ({"scheduler": {"type": "StepLR"}}, "'StepLR' is not one of DeepSpeed's schedules"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_steps": 10}}},
     "unknown scheduler.params for WarmupLR parameters: warmup_steps"),
    ({"train_batch_size": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}},
     "Hugging Face Trainer placeholder.*optimizer.params.lr, train_batch_size"),
    ({"train_batch_size": 0}, "train_batch_size must be an integer >= 1"),
    ({"train_micro_batch_size_per_gpu": 2.5}, "train_micro_batch_size_per_gpu must be an integer >= 1"),
    ({"prescale_gradients": True}, "prescale_gradients = True is not supported"),
    ({"communication_data_type": "fp16"}, "communication_data_type = 'fp16' is not supported"),
    ({"zero_optimization": {"stage": 3, "mics_shard_size": 8}}, "mics_shard_size = 8 is not supported"),
    ({"steps_per_prnt": 10, "wall_clock_breakdown": False},
     "unknown config keys: steps_per_prnt \\(did you mean steps_per_print\\?\\)$"),
])
def test_bad_deepspeed_sections_are_rejected_by_name(bad, message):
    with pytest.raises((ValueError, TypeError), match=message):
        ZeroConfig.from_dict({"zero_optimization": {"stage": 2}, **bad})


def test_keys_of_other_features_are_parsed_not_ignored():
    """The offload, LoCo and activation-checkpointing keys reach their own settings (never the
    accepted-and-ignored list)."""
    with pytest.raises(TypeError, match="offload_param' must be a mapping"):
        ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "offload_param": "cpu"}})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        param = ZeroConfig.from_dict({"zero_optimization": {"stage": 3, "offload_param": {
            "device": "nvme", "nvme_path": "/x", "buffer_count": 4, "buffer_size": 1e8, "max_in_cpu": 1e9}}})
    assert (param.offload_param.device, param.offload_param.buffer_size, param.offload_param.max_in_cpu) == \
        ("nvme", 10**8, 10**9)
    config = ZeroConfig.from_dict({
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "sub_group_size": 1000,
                              "zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": 0.5}},
        "activation_checkpointing": {"cpu_checkpointing": True},
    })
    assert config.offload_optimizer.device == "cpu" and config.sub_group_size == 1000
    assert config.loco.err_beta == 0.5
    assert config.activation_checkpointing.cpu_checkpointing


def test_optimizer_types_build_deepspeeds_classes_and_defaults():
    from zero_runtime.config._optim_spec import build_optimizer

    params = [torch.nn.Parameter(torch.zeros(3))]
    adam = build_optimizer({"type": "Adam", "params": {"lr": 0.1}}, params)
    assert type(adam) is torch.optim.AdamW and adam.defaults["weight_decay"] == 0.0  # FusedAdam's adam_w_mode
    plain = build_optimizer({"type": "adam", "params": {"lr": 0.1, "adam_w_mode": False, "torch_adam": True}}, params)
    assert type(plain) is torch.optim.Adam
    adamw = build_optimizer({"type": "AdamW", "params": {"betas": [0.8, 0.9], "weight_decay": 0.1}}, params)
    assert (adamw.defaults["lr"], adamw.defaults["betas"], adamw.defaults["weight_decay"]) == (1e-3, (0.8, 0.9), 0.1)
    sgd = build_optimizer({"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}}, params)
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0.9


def _lrs(schedule, steps: int) -> list[float]:
    lrs = [schedule.optimizer.param_groups[0]["lr"]]
    for _ in range(steps):
        schedule.step()
        lrs.append(schedule.optimizer.param_groups[0]["lr"])
    return lrs


def _sgd(lr: float = 0.5) -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)


def test_schedules_follow_deepspeeds_formulas():
    # WarmupLR, log warm-up over N = 4: lr(i) = min + (max - min) * ln(i + 1) / ln(4); lr(-1) = min.
    got = _lrs(WarmupLR(_sgd(), warmup_min_lr=0.1, warmup_max_lr=0.5, warmup_num_steps=4), 6)
    want = [0.1] + [0.1 + 0.4 * math.log(i + 1) / math.log(4) for i in range(4)] + [0.5, 0.5]
    assert got == pytest.approx(want, rel=1e-12)
    assert want[1] == 0.1 and want[2] == pytest.approx(0.3)  # ln 2 / ln 4 = 1/2
    # warmup_max_lr defaults to the optimizer's lr; linear warm-up is i / N.
    got = _lrs(WarmupLR(_sgd(0.8), warmup_num_steps=4, warmup_type="linear"), 5)
    assert got == pytest.approx([0.0, 0.0, 0.2, 0.4, 0.6, 0.8])
    # WarmupDecayLR: linear warm-up over 2, then (total - i) / (total - N) down to 0 at total = 6.
    got = _lrs(WarmupDecayLR(_sgd(), total_num_steps=6, warmup_max_lr=1.0, warmup_num_steps=2,
                             warmup_type="linear"), 8)
    assert got == pytest.approx([0.0, 0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
    # WarmupCosineLR: ratio from 0 (iteration -1), linear warm-up over 2, then
    # cos_min + (1 - cos_min) * (1 + cos(pi * (i - N + 1) / (total - N))) / 2, clamped at the end.
    got = _lrs(WarmupCosineLR(_sgd(2.0), total_num_steps=6, warmup_num_steps=2, cos_min_ratio=0.1,
                              warmup_type="linear"), 8)
    cosine = [0.1 + 0.9 * (1 + math.cos(math.pi * k / 4)) / 2 for k in (1, 2, 3, 4, 4, 4)]
    assert got == pytest.approx([0.0, 0.0, 1.0] + [2.0 * r for r in cosine])


def test_schedule_state_round_trips_and_bad_params_fail():
    schedule = WarmupLR(_sgd(), warmup_max_lr=1.0, warmup_num_steps=10)
    _lrs(schedule, 3)
    resumed = WarmupLR(_sgd(), warmup_max_lr=1.0, warmup_num_steps=10)
    resumed.load_state_dict(schedule.state_dict())
    assert _lrs(resumed, 2)[1:] == _lrs(schedule, 2)[1:]
    with pytest.raises(ValueError, match="warmup_type must be one of log, linear"):
        WarmupLR(_sgd(), warmup_type="cosine")
    with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer"):
        WarmupLR(_sgd(), warmup_num_steps=0)


# ----- a training run from a DeepSpeed config, against plain torch -----
TRAIN_CONFIG = {
    "train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,  # 2 ranks -> 2 accumulation steps
    "optimizer": {"type": "AdamW", "params": {"lr": 0.02, "betas": [0.9, 0.99]}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 6, "warmup_max_lr": 0.02,
                                                      "warmup_num_steps": 2, "warmup_type": "linear"}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "contiguous_gradients": True},
    "steps_per_print": 1,
}
STEPS = 5
# WarmupDecayLR above: the lr of step k is the schedule's value at iteration k - 1.
ORACLE_LRS = [0.0, 0.0, 0.01, 0.02, 0.015]


def _train_from_config(rank: int, world: int, root: str) -> dict:
    import zero_runtime

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = zero_runtime.initialize(make_model("mlp"), None, TRAIN_CONFIG)
    accum = opt.config.gradient_accumulation_steps
    lrs = []
    for step in range(STEPS):
        lrs.append(opt.optimizer.param_groups[0]["lr"])
        mine = local_slice(global_batch("mlp", step), rank, world)
        for micro in range(accum):
            opt.backward(loss_of("mlp", model, local_slice(mine, micro, accum)))
            opt.step()
    opt.save_checkpoint(root)  # the schedule's counter travels with the checkpoint
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, resumed = zero_runtime.initialize(make_model("mlp"), None, TRAIN_CONFIG)
    resumed.load_checkpoint(root)
    return {"lrs": lrs, "accum": accum, "weights": opt.full_state_dict(), "type": type(opt.optimizer).__name__,
            "warnings": [str(w.message) for w in caught],
            "resumed": (resumed.lr_scheduler.last_batch_iteration, resumed.optimizer.param_groups[0]["lr"])}


def test_training_from_a_deepspeed_config_matches_plain_torch(tmp_path):
    results = run(_train_from_config, 2, str(tmp_path / "ckpt"))
    first = results[0]
    assert first["resumed"] == (STEPS - 1, pytest.approx(0.01))  # iteration 4: (6 - 4) / (6 - 2) x 0.02
    assert first["accum"] == 2 and first["type"] == "AdamW"
    assert first["lrs"] == pytest.approx(ORACLE_LRS, abs=1e-12)
    assert any("steps_per_print" in m and "contiguous_gradients" in m for m in first["warnings"])
    model = make_model("mlp")
    reference = torch.optim.AdamW(model.parameters(), lr=0.0, betas=(0.9, 0.99), weight_decay=0.0)
    for step in range(STEPS):
        reference.param_groups[0]["lr"] = ORACLE_LRS[step]
        loss_of("mlp", model, global_batch("mlp", step)).backward()
        reference.step()
        reference.zero_grad()
    for key, value in model.state_dict().items():
        torch.testing.assert_close(first["weights"][key], value, rtol=0, atol=2e-5, msg=key)
    assert not torch.equal(first["weights"]["layers.0.weight"], make_model("mlp").state_dict()["layers.0.weight"])
