"""The named training configurations of ``python -m bench.train`` and the config each engine is given.

A configuration names what is compared (ZeRO stage, which ZeRO++ options, which peer engine);
bench/TRAINING.md lists them. The ZeRO++ options map onto DeepSpeed's keys under
``zero_optimization`` (qwZ ``zero_quantized_weights``, hpZ ``zero_hpz_partition_size`` set to
the ranks per node, qgZ ``zero_quantized_gradients``); the ablations use zcomm's own keys.

[Note: same math] Every engine trains with torch's AdamW at the same ``lr``, precision, batch
and gradient clipping, the clipping written into every engine's config (DeepSpeed clips at 1.0
when the key is absent, which once made a comparison different math). DeepSpeed's stage 3 gets
its default stage-3 settings written out (:data:`DEEPSPEED_STAGE3_DEFAULTS`), so it stays
"DeepSpeed with its defaults" if a release changes them; zero_runtime gets no stage-3 keys, so
each row measures what a user gets from the README's config ([Note: default unit and bucket
sizes] in ``zero_runtime.config``). Bucket and unit sizes change when bytes move, never what is computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

LOCO_PARAM = {"err_beta": 0.8, "reset_T": 1024}  # DeepSpeed's zeropp_loco_param defaults
TENSOR_SCALE = "tensor"
# DeepSpeed 0.19's defaults for its stage-3 keys (deepspeed/runtime/zero/config.py), in elements.
DEEPSPEED_STAGE3_DEFAULTS: dict[str, int] = {
    "reduce_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
}


STAGES = {"zero": (0, 1, 2, 3), "deepspeed": (1, 2, 3), "fsdp2": (3,), "ddp": (0,)}  # the ZeRO stages each engine runs


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One row of the comparison: its ``--configs`` name, engine, ZeRO stage and options. ``fails_on_cpu``:
    why the engine is known to raise on a CPU (the row then reads "expected failure" with this reason)."""

    name: str
    engine: Literal["zero", "fsdp2", "deepspeed", "ddp"]  # zero_runtime, torch fully_shard (+ enable_zeropp)
    stage: int = 3
    quantized_weights: bool = False  # qwZ
    hpz: bool = False  # FSDP2: reshard_after_forward = ranks per node
    quantized_gradients: bool = False  # qgZ
    quant_group_size: int | str | None = None  # elements per scale of qwZ and qgZ, TENSOR_SCALE; None: zcomm's
    align_quant_blocks: bool = True  # False: zero_runtime packs parameters without gaps
    loco: bool = False  # LoCo error feedback on qgZ (zero_runtime)
    first_hop_bits: int | None = None  # width of qgZ's intra-node hop; None: the engine's default
    hadamard_block: int | None = None  # qgZ's Hadamard rotation block (zero_runtime)
    weight_delta_bits: int | None = None  # with qwZ (stage 3: and hpZ): width of the weight differences
    ddp_hook: Literal["bf16", "zcomm"] | None = None  # None: DDP's fp32 all-reduce
    gather_bits: int | None = None  # zcomm's DDP hook and HSDP's replicate all-reduce: width of all_reduce_q4's gather
    hsdp: bool = False  # FSDP2 sharded inside each node, replicated across nodes
    all_reduce_q4: bool = False  # HSDP: the replicate all-reduce by zcomm.all_reduce_q4 (enable_zeropp)
    fails_on_cpu: str | None = None

    def __post_init__(self) -> None:
        why = next((why for broken, why in self._rules() if broken), None)
        if why:
            raise ValueError(f"{self.name}: {why}")

    def _rules(self) -> list[tuple[bool, str]]:
        """(broken, why) for each option its engine would refuse or silently ignore, in the order checked."""
        zero, qwz, qgz, stages = self.engine == "zero", self.quantized_weights, self.quantized_gradients, STAGES[self.engine]
        zcomm_hook = self.ddp_hook == "zcomm"
        return [
            (self.stage not in stages, f"{self.engine} runs stage {'/'.join(map(str, stages))}, got stage {self.stage}"),
            (self.hsdp and (self.engine != "fsdp2" or self.hpz), "HSDP is an FSDP2 layout, sharded inside the node already (no hpZ)"),
            (self.hpz and self.stage != 3, "hpZ needs stage 3"),
            ((qwz or qgz) and self.stage != 3 and not zero,
             "qwZ and qgZ outside stage 3 are zero_runtime's (DDP's hook quantizes its all-reduce)"),
            (qwz and self.stage == 0, "qwZ has no parameter gather to quantize at stage 0"),
            (self.quant_group_size is not None and not (qwz or qgz), "quant_group_size needs qwZ or qgZ"),
            (not self.align_quant_blocks and not (zero and (qwz or qgz)), "packed blocks are a zero_runtime layout for qwZ or qgZ"),
            (self.loco and not (zero and qgz), "LoCo is zero_runtime's error feedback for qgZ"),
            (self.hadamard_block is not None and not (zero and qgz), "the Hadamard rotation is an option of zero_runtime's qgZ"),
            (self.weight_delta_bits is not None and not (zero and qwz and (self.stage < 3 or self.hpz)),
             "weight differences are zero_runtime's, with qwZ (and hpZ in stage 3)"),
            (self.ddp_hook is not None and self.engine != "ddp", "ddp_hook is an option of the ddp engine"),
            (self.first_hop_bits is not None and not (zcomm_hook or qgz and self.engine != "deepspeed"),
             "the first hop's width is an option of zcomm's qgZ and DDP hook"),
            (self.all_reduce_q4 and not self.hsdp, "all_reduce_q4 is HSDP's replicate all-reduce"),
            (self.gather_bits is not None and not (zcomm_hook or self.all_reduce_q4),
             "gather_bits is the quantized all-reduce's: zcomm's DDP hook or HSDP's all_reduce_q4"),
        ]  # fmt: skip


_ZEROPP = dict(quantized_weights=True, hpz=True, quantized_gradients=True)  # qwZ + hpZ + qgZ
_QWZ_QGZ = dict(quantized_weights=True, quantized_gradients=True)
_QWZ, _QGZ = dict(quantized_weights=True), dict(quantized_gradients=True)

# What each configuration is: bench/TRAINING.md, "Configurations".
CONFIGS: dict[str, TrainConfig] = {config.name: config for config in (
    TrainConfig(name="zero0", engine="zero", stage=0),
    TrainConfig(name="zero0-q", engine="zero", stage=0, **_QGZ),
    TrainConfig(name="zero1", engine="zero", stage=1),
    TrainConfig(name="zero2", engine="zero", stage=2),
    TrainConfig(name="zero3", engine="zero", stage=3),
    TrainConfig(name="zero2-q", engine="zero", stage=2, **_QWZ_QGZ),
    TrainConfig(name="zero2-qwd", engine="zero", stage=2, **_QWZ_QGZ, weight_delta_bits=4),
    TrainConfig(name="zero1-qwd", engine="zero", stage=1, **_QWZ_QGZ, weight_delta_bits=4),
    TrainConfig(name="zero3+qwz", engine="zero", **_QWZ),
    TrainConfig(name="zero3+hpz", engine="zero", hpz=True),
    TrainConfig(name="zero3+qgz", engine="zero", **_QGZ),
    TrainConfig(name="zeropp", engine="zero", **_ZEROPP),
    TrainConfig(name="zeropp-wd", engine="zero", **_ZEROPP, weight_delta_bits=4),
    TrainConfig(name="zeropp-tensorscale", engine="zero", **_ZEROPP, quant_group_size=TENSOR_SCALE),
    TrainConfig(name="zeropp-g128", engine="zero", **_ZEROPP, quant_group_size=128),
    TrainConfig(name="zeropp-g256", engine="zero", **_ZEROPP, quant_group_size=256),
    TrainConfig(name="zero3+qgz-g128", engine="zero", **_QGZ, quant_group_size=128),
    TrainConfig(name="zero3+qgz-g256", engine="zero", **_QGZ, quant_group_size=256),
    TrainConfig(name="zero3+qwz-g256", engine="zero", **_QWZ, quant_group_size=256),
    TrainConfig(name="zero3+qwz-g512", engine="zero", **_QWZ, quant_group_size=512),
    TrainConfig(name="zeropp-packed", engine="zero", **_ZEROPP, align_quant_blocks=False),
    TrainConfig(name="zero3+qwz-packed", engine="zero", **_QWZ, align_quant_blocks=False),
    TrainConfig(name="zero3+qgz-packed", engine="zero", **_QGZ, align_quant_blocks=False),
    TrainConfig(name="zero3+qgz-loco", engine="zero", **_QGZ, loco=True),
    TrainConfig(name="zeropp-loco", engine="zero", **_ZEROPP, loco=True),
    TrainConfig(name="zeropp-int8hop", engine="zero", **_ZEROPP, first_hop_bits=8),
    TrainConfig(name="zeropp-hadamard", engine="zero", **_ZEROPP, hadamard_block=256),
    TrainConfig(name="fsdp2", engine="fsdp2"),
    TrainConfig(name="fsdp2-hpz", engine="fsdp2", hpz=True),
    TrainConfig(name="fsdp2-qwz", engine="fsdp2", **_QWZ),
    TrainConfig(name="fsdp2-qgz", engine="fsdp2", **_QGZ),
    TrainConfig(name="fsdp2-zeropp", engine="fsdp2", **_ZEROPP),
    TrainConfig(name="fsdp2-zeropp-int4hop", engine="fsdp2", **_ZEROPP, first_hop_bits=4),
    TrainConfig(name="hsdp", engine="fsdp2", hsdp=True),
    TrainConfig(name="hsdp-zeropp", engine="fsdp2", hsdp=True, **_QWZ_QGZ, all_reduce_q4=True),
    TrainConfig(name="hsdp-zeropp-g4", engine="fsdp2", hsdp=True, **_QWZ_QGZ, all_reduce_q4=True, gather_bits=4),
    TrainConfig(name="hsdp-zcomm", engine="fsdp2", hsdp=True, all_reduce_q4=True),
    TrainConfig(name="hsdp-zcomm-g4", engine="fsdp2", hsdp=True, all_reduce_q4=True, gather_bits=4),
    TrainConfig(name="ddp", engine="ddp", stage=0),
    TrainConfig(name="ddp-bf16hook", engine="ddp", stage=0, ddp_hook="bf16"),
    TrainConfig(name="ddp-zcomm", engine="ddp", stage=0, ddp_hook="zcomm", first_hop_bits=8),
    TrainConfig(name="ddp-zcomm-g4", engine="ddp", stage=0, ddp_hook="zcomm", first_hop_bits=8, gather_bits=4),
    TrainConfig(name="deepspeed-z2", engine="deepspeed", stage=2),
    TrainConfig(name="deepspeed-z3", engine="deepspeed"),
    TrainConfig(name="deepspeed-z3-hpz", engine="deepspeed", hpz=True),
    TrainConfig(name="deepspeed-zeropp", engine="deepspeed", **_ZEROPP,
                fails_on_cpu="DeepSpeed's ZeRO++ quantizer is CUDA-only, it has no CPU build"),
)}


@dataclass(frozen=True, kw_only=True)
class EngineSetup:
    """What every engine of a launch is built with besides its configuration."""

    lr: float
    local_size: int
    world_size: int
    bf16: bool
    gradient_clipping: float
    micro_batch: int  # sequences per rank and step
    device: torch.device


def select_configs(names: list[str]) -> list[TrainConfig]:
    """The configurations named, in the order given; unknown or repeated names are errors."""
    unknown = [name for name in names if name not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown}; choose from {sorted(CONFIGS)}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"configuration(s) {repeated} named more than once")
    return [CONFIGS[name] for name in names]


def _given(keys: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``keys`` whose value is not None."""
    return {key: value for key, value in keys.items() if value is not None}


def _zero_optimization(config: TrainConfig, local_size: int) -> dict[str, Any]:
    return {"stage": config.stage, **_given({
        "zero_quantized_weights": config.quantized_weights or None,
        "zero_hpz_partition_size": local_size if config.hpz else None,
        "zero_quantized_gradients": config.quantized_gradients or None,
        "zcomm_quant_group_size": config.quant_group_size})}  # fmt: skip


def zero_runtime_config(config: TrainConfig, *, local_size: int, bf16: bool, gradient_clipping: float) -> dict[str, Any]:
    """The dict for ``zero_runtime.initialize``: the stage and ZeRO++ keys only, so the
    runtime's defaults apply (see [Note: same math])."""
    section = {**_zero_optimization(config, local_size), **_given({
        "zcomm_align_quant_blocks": None if config.align_quant_blocks else False,
        "zeropp_loco_param": dict(LOCO_PARAM) if config.loco else None,
        "zcomm_qgz_first_hop_bits": config.first_hop_bits,
        "zcomm_qgz_hadamard_block": config.hadamard_block,
        "zcomm_weight_delta_bits": config.weight_delta_bits})}  # fmt: skip
    return {"zero_optimization": section, "bf16": {"enabled": bf16}, "gradient_clipping": gradient_clipping}


def deepspeed_config(config: TrainConfig, *, local_size: int, bf16: bool, gradient_clipping: float,
                     micro_batch: int) -> dict[str, Any]:  # fmt: skip
    """The dict for ``deepspeed.initialize``; the optimizer is passed in, so allow torch's AdamW."""
    section = {**_zero_optimization(config, local_size), **(DEEPSPEED_STAGE3_DEFAULTS if config.stage == 3 else {})}
    return {"zero_optimization": section, "bf16": {"enabled": bf16}, "gradient_clipping": gradient_clipping,
            "train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1,
            "zero_allow_untested_optimizer": True}  # fmt: skip


def engine_config(config: TrainConfig, setup: EngineSetup) -> dict[str, Any]:
    """What ``config``'s engine is given, also kept in the JSON: the ZeRO engines' dicts; for FSDP2
    and DDP the settings their runners apply (``enable_zeropp``'s arguments, None: its default)."""
    bf16, clip = setup.bf16, setup.gradient_clipping
    common = dict(local_size=setup.local_size, bf16=bf16, gradient_clipping=clip)
    if config.engine == "zero":
        return zero_runtime_config(config, **common)
    if config.engine == "deepspeed":
        return deepspeed_config(config, **common, micro_batch=setup.micro_batch)
    if config.engine == "ddp":
        return {"autocast": "bf16" if bf16 else None, "ddp_hook": config.ddp_hook, "first_hop_bits": config.first_hop_bits,
                "gather_bits": config.gather_bits, "gradient_clipping": clip}  # fmt: skip
    settings: dict[str, Any] = {"param_dtype": "bf16" if bf16 else "fp32", "hpz": config.hpz, "gradient_clipping": clip,
                                **({"hsdp": True} if config.hsdp else {})}
    if config.quantized_weights or config.quantized_gradients or config.all_reduce_q4:
        settings["enable_zeropp"] = {"quantized_weights": config.quantized_weights, "group_size": config.quant_group_size,
                                     "quantized_gradients": config.quantized_gradients,
                                     "first_hop_bits": config.first_hop_bits}  # fmt: skip
        if config.hsdp:  # the runner passes the mesh's "replicate" group
            settings["enable_zeropp"].update(replicate_group="replicate", quantized_all_reduce=config.all_reduce_q4,
                                             **_given({"replicate_gather_bits": config.gather_bits}))
    return settings
