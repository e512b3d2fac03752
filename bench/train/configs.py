"""The named training configurations of ``python -m bench.train`` and their engine configs.

A configuration names *what* is compared (ZeRO stage, which ZeRO++ options, which peer
implementation); ``zero_runtime_config`` and ``deepspeed_config`` turn it into the
DeepSpeed-style dict each engine reads. Every configuration trains the same model on the
same data with the same seed, so the table compares communication strategies only.

The ZeRO++ options map onto DeepSpeed's key names under ``zero_optimization``:
``zero_quantized_weights`` (qwZ), ``zero_hpz_partition_size`` (hpZ, set to the ranks per
node so backward gathers stay inside a node) and ``zero_quantized_gradients`` (qgZ).
``zeropp-tensorscale`` is the ablation of the ZeRO++ paper's Figure 14: ZeRO++ with one
quantization scale per communicated tensor instead of per block, through the zcomm key
``zcomm_quant_group_size`` (``TENSOR_SCALE``), which DeepSpeed does not have.
``zeropp-g128`` is ZeRO++ with 128 elements per scale for both quantized collectives (zcomm's
defaults are 256 for both). The alignment ablation: ``*-packed`` packs parameters without
gaps (``zcomm_align_quant_blocks`` false, where a quantization block may straddle two parameters);
``*-gN`` sets N elements per scale for the quantized collective(s) the row turns on;
``*-loco`` turns on LoCo error feedback for qgZ (DeepSpeed's ``zeropp_loco_param`` with its
defaults, :data:`LOCO_PARAM`); ``*-int8hop`` sends qgZ's intra-node hop in INT8
(``zcomm_qgz_first_hop_bits: 8``, after SDP4Bit; the runtime's default is the paper's INT4).
``deepspeed-zeropp`` hands DeepSpeed its own ZeRO++ keys, to show what DeepSpeed does with them.
``zero0`` is zero_runtime's stage 0 (plain data parallelism, DeepSpeed's default: gradient
buckets all-reduced with ``dist.all_reduce``), ``zero0-q`` the same with qgZ's all-reduce
(``zcomm.all_reduce_q4``: INT4 two-hop reduce-scatter, INT8 gather), DDP's peers below.
``zero2-q`` is stage 2 with qgZ and qwZ's INT8 gather after the step; ``zero2-qwd`` and
``zero1-qwd`` send 4-bit weight differences instead (``zcomm_weight_delta_bits: 4``, after
SDP4Bit); ``deepspeed-z2`` is DeepSpeed's stage 2, their peer. ``zeropp-wd`` is ZeRO++ whose
hpZ copies are refreshed by the same 4-bit differences across nodes, then gathered inside the node.
``fsdp2-qwz``, ``fsdp2-qgz`` and ``fsdp2-zeropp`` are FSDP2 with zcomm's collectives installed by
``zcomm.fsdp.enable_zeropp`` (hpZ being FSDP2's ``reshard_after_forward=<ranks per node>``;
qgZ's intra-node hop INT8, the adapter's default); ``fsdp2-zeropp-int4hop`` is the same with
the ZeRO++ paper's INT4 intra-node hop. ``hsdp`` is FSDP2's own hybrid sharding (a 2-D mesh:
sharded inside each node, replicated across nodes, its gradients all-reduced across nodes by
``torch.distributed``); ``hsdp-zeropp`` shards the same way on the node's 1-D mesh and lets
``zcomm.fsdp.enable_zeropp(replicate_group=...)`` add qwZ and qgZ inside the node and the
quantized all-reduce (``zcomm.all_reduce_q4``) across nodes. ``ddp``, ``ddp-bf16hook`` and ``ddp-zcomm`` are torch's
DistributedDataParallel (no sharding: stage 0) with its own fp32 all-reduce, torch's
``bf16_compress_hook`` and ``zcomm.ddp.quantized_allreduce_hook`` (INT8 intra-node hop, as
the FSDP2 adapter's default).

[Note: same math] Every engine trains with the same optimizer (torch AdamW, same ``lr``),
the same precision and batch, and the same gradient clipping, written out explicitly in
every engine's config (``gradient_clipping``; FSDP2 clips with torch's
``clip_grad_norm_``): DeepSpeed clips at 1.0 when the key is absent, which silently made an
earlier comparison different math. At stage 3 DeepSpeed gets its default stage-3 settings written
out (:data:`DEEPSPEED_STAGE3_DEFAULTS`), so "DeepSpeed with its defaults" stays that if a
release changes them; zero_runtime gets no stage-3 keys at all, so each row measures what a
user gets from the README's config: the runtime's defaults are DeepSpeed's values for the
``stage3_*`` keys, its own for the unit and bucket sizes (see [Note: default unit and
bucket sizes] in ``zero_runtime.config``). Bucket and unit sizes change when bytes move,
never what is computed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Engine = Literal["zero", "fsdp2", "deepspeed", "ddp"]
DDPHook = Literal["bf16", "zcomm"]

QUANT_GROUP_SIZE_KEY = "zcomm_quant_group_size"
ALIGN_KEY = "zcomm_align_quant_blocks"
LOCO_PARAM = {"err_beta": 0.8, "reset_T": 1024}
TENSOR_SCALE = "tensor"
# DeepSpeed 0.19's defaults for its stage-3 keys (deepspeed/runtime/zero/config.py), in elements.
DEEPSPEED_STAGE3_DEFAULTS: dict[str, int] = {
    "reduce_bucket_size": 500_000_000,
    "stage3_prefetch_bucket_size": 50_000_000,
    "stage3_param_persistence_threshold": 100_000,
    "stage3_max_live_parameters": 1_000_000_000,
    "stage3_max_reuse_distance": 1_000_000_000,
}

@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One row of the comparison.

    Args:
        name: the ``--configs`` name.
        engine: ``zero`` (this project's zero_runtime), ``fsdp2`` (torch ``fully_shard``, with
            ``zcomm.fsdp.enable_zeropp`` for qwZ / qgZ), ``deepspeed`` or ``ddp`` (torch
            ``DistributedDataParallel``, replicated: stage 0).
        stage: ZeRO stage 0-3 (0: zero_runtime's plain data parallelism; FSDP2 is always fully
            sharded, i.e. stage 3); 0 for DDP.
        quantized_weights: qwZ, INT8 blocked all-gather of weights in forward.
        hpz: secondary weight partition inside each node (FSDP2: ``reshard_after_forward``
            set to the ranks per node).
        quantized_gradients: qgZ, INT4 two-hop reduce-scatter of gradients.
        quant_group_size: elements per quantization scale for qwZ and qgZ, ``TENSOR_SCALE``
            for one scale per tensor (the ablation), or None for zcomm's defaults.
        align_quant_blocks: zero_runtime's parameter-aligned quantization blocks (its
            default); False packs parameters without gaps.
        loco: LoCo error feedback on qgZ (``zeropp_loco_param``, zero_runtime only).
        first_hop_bits: width of qgZ's intra-node hop, 4 or 8 (zero_runtime's
            ``zcomm_qgz_first_hop_bits``, ``first_hop_bits`` of ``enable_zeropp``), or None for
            the engine's default (the runtime's INT4, ``enable_zeropp``'s INT8, the DDP hook's INT4).
        hadamard_block: qgZ's Hadamard rotation block (``zcomm_qgz_hadamard_block``,
            zero_runtime only), or None for none.
        weight_delta_bits: stages 1 and 2 with qwZ: the width of the weight differences sent
            after each step (``zcomm_weight_delta_bits``, zero_runtime only), or None for qwZ's
            INT8 values.
        ddp_hook: DDP's communication hook: None (DDP's fp32 all-reduce), ``"bf16"`` (torch's
            ``bf16_compress_hook``) or ``"zcomm"`` (``zcomm.ddp.quantized_allreduce_hook``).
        gather_bits: zcomm's DDP hook: the width of ``zcomm.all_reduce_q4``'s gather (4), or
            None for its default (8).
        hsdp: FSDP2 sharded inside each node and replicated across nodes (FSDP2's 2-D mesh, or
            with qwZ / qgZ zcomm's replicate all-reduce, quantized with qgZ).
        summary: one line for ``--help`` and TRAINING.md.
        fails_on_cpu: why the engine is known to raise for this configuration on a CPU (the
            row then reads "expected failure" with this reason), or None.
    """

    name: str
    engine: Engine
    stage: int = 3
    quantized_weights: bool = False
    hpz: bool = False
    quantized_gradients: bool = False
    quant_group_size: int | str | None = None
    align_quant_blocks: bool = True
    loco: bool = False
    first_hop_bits: int | None = None
    hadamard_block: int | None = None
    weight_delta_bits: int | None = None
    ddp_hook: DDPHook | None = None
    gather_bits: int | None = None
    hsdp: bool = False
    summary: str
    fails_on_cpu: str | None = None

    def __post_init__(self) -> None:
        if self.engine not in ("zero", "fsdp2", "deepspeed", "ddp"):
            raise ValueError(f"{self.name}: unknown engine {self.engine!r}")
        if self.engine == "ddp":
            self._check_ddp()
            return
        if self.stage not in (1, 2, 3) and not (self.stage == 0 and self.engine == "zero"):
            raise ValueError(f"{self.name}: stage must be 1, 2 or 3 (0 for zero_runtime), got {self.stage}")
        if self.stage == 0 and self.quantized_weights:
            raise ValueError(f"{self.name}: qwZ has no parameter gather to quantize at stage 0")
        if self.ddp_hook is not None or self.gather_bits is not None:
            raise ValueError(f"{self.name}: ddp_hook and gather_bits are options of the ddp engine")
        if self.hpz and self.stage != 3:
            raise ValueError(f"{self.name}: hpZ needs stage 3")
        if (self.quantized_weights or self.quantized_gradients) and self.stage != 3 and self.engine != "zero":
            raise ValueError(f"{self.name}: qwZ and qgZ in stages 1 and 2 are zero_runtime's")
        if self.weight_delta_bits is not None and (self.engine != "zero" or not self.quantized_weights
                                                   or (self.stage == 3 and not self.hpz)):
            raise ValueError(f"{self.name}: weight differences are zero_runtime's, with qwZ (and hpZ in stage 3)")
        if self.quant_group_size is not None and not (self.quantized_weights or self.quantized_gradients):
            raise ValueError(f"{self.name}: quant_group_size needs qwZ or qgZ")
        if not self.align_quant_blocks and (self.engine != "zero" or not (self.quantized_weights or
                                                                           self.quantized_gradients)):
            raise ValueError(f"{self.name}: packed blocks are a zero_runtime layout for qwZ or qgZ")
        if self.loco and (self.engine != "zero" or not self.quantized_gradients):
            raise ValueError(f"{self.name}: LoCo is zero_runtime's error feedback for qgZ")
        if self.first_hop_bits is not None and (self.engine == "deepspeed" or not self.quantized_gradients):
            raise ValueError(f"{self.name}: the first hop's width is an option of zcomm's qgZ")
        if self.hadamard_block is not None and (self.engine != "zero" or not self.quantized_gradients):
            raise ValueError(f"{self.name}: the Hadamard rotation is an option of zero_runtime's qgZ")
        if self.engine == "fsdp2" and self.stage != 3:
            raise ValueError(f"{self.name}: FSDP2 is always stage 3")
        if self.hsdp and (self.engine != "fsdp2" or self.hpz):
            raise ValueError(f"{self.name}: HSDP is an FSDP2 layout, sharded inside the node already (no hpZ)")

    def _check_ddp(self) -> None:
        """DDP replicates everything (stage 0); its only options are the hook and, for zcomm's, the first hop."""
        if self.stage != 0:
            raise ValueError(f"{self.name}: DDP is stage 0 (replicated), got stage {self.stage}")
        if self.ddp_hook not in (None, "bf16", "zcomm"):
            raise ValueError(f"{self.name}: ddp_hook must be None, 'bf16' or 'zcomm', got {self.ddp_hook!r}")
        zeropp = (self.quantized_weights, self.hpz, self.quantized_gradients, self.loco, self.hsdp,
                  self.quant_group_size is not None, self.hadamard_block is not None, not self.align_quant_blocks,
                  self.weight_delta_bits is not None)
        if any(zeropp):
            raise ValueError(f"{self.name}: the ZeRO++ options are not DDP's (its hook quantizes the all-reduce)")
        if (self.first_hop_bits is not None or self.gather_bits is not None) and self.ddp_hook != "zcomm":
            raise ValueError(f"{self.name}: the first hop's and the gather's widths are options of zcomm's DDP hook")


def _configs(*configs: TrainConfig) -> dict[str, TrainConfig]:
    return {config.name: config for config in configs}


_ZEROPP = dict(quantized_weights=True, hpz=True, quantized_gradients=True)  # qwZ + hpZ + qgZ

CONFIGS: dict[str, TrainConfig] = _configs(
    TrainConfig(name="zero0", engine="zero", stage=0,
                summary="ZeRO stage 0: plain data parallelism, gradient buckets all-reduced"),
    TrainConfig(name="zero0-q", engine="zero", stage=0, quantized_gradients=True,
                summary="stage 0 + qgZ: buckets all-reduced by zcomm.all_reduce_q4 (INT4 2-hop RS, INT8 gather)"),
    TrainConfig(name="zero1", engine="zero", stage=1, summary="ZeRO stage 1: optimizer states partitioned"),
    TrainConfig(name="zero2", engine="zero", stage=2, summary="ZeRO stage 2: + gradients partitioned"),
    TrainConfig(name="zero3", engine="zero", stage=3, summary="ZeRO stage 3: + parameters partitioned"),
    TrainConfig(name="zero2-q", engine="zero", stage=2, quantized_weights=True, quantized_gradients=True,
                summary="stage 2 + qgZ gradients + INT8 weight all-gather after the step"),
    TrainConfig(name="zero2-qwd", engine="zero", stage=2, quantized_weights=True, quantized_gradients=True,
                weight_delta_bits=4, summary="stage 2 + qgZ gradients + 4-bit weight differences after the step"),
    TrainConfig(name="zero1-qwd", engine="zero", stage=1, quantized_weights=True, quantized_gradients=True,
                weight_delta_bits=4, summary="stage 1 + qgZ gradients + 4-bit weight differences after the step"),
    TrainConfig(name="zero3+qwz", engine="zero", quantized_weights=True, summary="stage 3 + INT8 weight all-gather"),
    TrainConfig(name="zero3+hpz", engine="zero", hpz=True, summary="stage 3 + per-node secondary weights"),
    TrainConfig(name="zero3+qgz", engine="zero", quantized_gradients=True, summary="stage 3 + INT4 2-hop grad RS"),
    TrainConfig(name="zeropp", engine="zero", **_ZEROPP, summary="ZeRO++: qwZ + hpZ + qgZ"),
    TrainConfig(name="zeropp-wd", engine="zero", **_ZEROPP, weight_delta_bits=4,
                summary="ZeRO++ with hpZ's node-local weights refreshed by 4-bit differences"),
    TrainConfig(name="zeropp-tensorscale", engine="zero", **_ZEROPP, quant_group_size=TENSOR_SCALE,
                summary="ZeRO++ with one scale per tensor (Figure 14 ablation)"),
    TrainConfig(name="zeropp-g128", engine="zero", **_ZEROPP, quant_group_size=128,
                summary="ZeRO++ with 128 elements per quantization scale"),
    *(
        TrainConfig(name=f"{name}-packed", engine="zero", quantized_weights=qwz, hpz=hpz, quantized_gradients=qgz,
                    align_quant_blocks=False, summary=f"{name} with parameters packed without gaps")
        for name, qwz, hpz, qgz in (("zeropp", True, True, True), ("zero3+qwz", True, False, False),
                                    ("zero3+qgz", False, False, True))
    ),
    *(
        TrainConfig(name=f"{name}-g{size}", engine="zero", quantized_weights=qwz, quantized_gradients=qgz,
                    hpz=qwz and qgz, quant_group_size=size, summary=f"{name} with {size} elements per scale")
        for name, qwz, qgz, sizes in (("zero3+qgz", False, True, (128, 256)), ("zero3+qwz", True, False, (256, 512)),
                                      ("zeropp", True, True, (256,)))
        for size in sizes
    ),
    TrainConfig(name="zero3+qgz-loco", engine="zero", quantized_gradients=True, loco=True,
                summary="stage 3 + qgZ with LoCo error feedback"),
    TrainConfig(name="zeropp-loco", engine="zero", **_ZEROPP, loco=True, summary="ZeRO++ with LoCo error feedback on qgZ"),
    TrainConfig(name="zeropp-int8hop", engine="zero", **_ZEROPP, first_hop_bits=8,
                summary="ZeRO++ with qgZ's intra-node hop in INT8 (SDP4Bit's two-level scheme)"),
    TrainConfig(name="zeropp-hadamard", engine="zero", **_ZEROPP, hadamard_block=256,
                summary="ZeRO++ with qgZ's gradients Hadamard-rotated in blocks of 256 (SDP4Bit's smoothing)"),
    TrainConfig(name="fsdp2", engine="fsdp2", summary="torch fully_shard, bf16 MixedPrecisionPolicy"),
    TrainConfig(name="fsdp2-hpz", engine="fsdp2", hpz=True, summary="fully_shard, reshard_after_forward=ranks/node"),
    TrainConfig(name="fsdp2-qwz", engine="fsdp2", quantized_weights=True, summary="fully_shard + zcomm.fsdp qwZ"),
    TrainConfig(name="fsdp2-qgz", engine="fsdp2", quantized_gradients=True, summary="fully_shard + zcomm.fsdp qgZ"),
    TrainConfig(name="fsdp2-zeropp", engine="fsdp2", **_ZEROPP,
                summary="ZeRO++ inside FSDP2: zcomm.fsdp.enable_zeropp + reshard_after_forward=ranks/node"),
    TrainConfig(name="fsdp2-zeropp-int4hop", engine="fsdp2", **_ZEROPP, first_hop_bits=4,
                summary="fsdp2-zeropp with qgZ's intra-node hop in INT4 (the ZeRO++ paper's)"),
    TrainConfig(name="hsdp", engine="fsdp2", hsdp=True,
                summary="FSDP2 HSDP: 2-D mesh, sharded inside the node, replicated across nodes"),
    TrainConfig(name="hsdp-zeropp", engine="fsdp2", hsdp=True, quantized_weights=True, quantized_gradients=True,
                summary="HSDP with zcomm: qwZ + qgZ inside the node, zcomm.all_reduce_q4 across nodes"),
    TrainConfig(name="ddp", engine="ddp", stage=0, summary="torch DistributedDataParallel, fp32 all-reduce"),
    TrainConfig(name="ddp-bf16hook", engine="ddp", stage=0, ddp_hook="bf16",
                summary="DDP with torch's bf16_compress_hook (buckets all-reduced in bf16)"),
    TrainConfig(name="ddp-zcomm", engine="ddp", stage=0, ddp_hook="zcomm", first_hop_bits=8,
                summary="DDP with zcomm.ddp's hook: INT8 intra / INT4 inter reduce-scatter, INT8 gather"),
    TrainConfig(name="ddp-zcomm-g4", engine="ddp", stage=0, ddp_hook="zcomm", first_hop_bits=8, gather_bits=4,
                summary="as ddp-zcomm with the all-reduce's gather in INT4 (gather_bits=4)"),
    TrainConfig(name="deepspeed-z2", engine="deepspeed", stage=2, summary="DeepSpeed ZeRO-2 (needs deepspeed)"),
    TrainConfig(name="deepspeed-z3", engine="deepspeed", summary="DeepSpeed ZeRO-3 (needs deepspeed)"),
    TrainConfig(name="deepspeed-z3-hpz", engine="deepspeed", hpz=True, summary="DeepSpeed ZeRO-3 + hpZ"),
    TrainConfig(name="deepspeed-zeropp", engine="deepspeed", **_ZEROPP,
                summary="DeepSpeed ZeRO-3 with its own ZeRO++ keys (qwZ + hpZ + qgZ)",
                fails_on_cpu="DeepSpeed's ZeRO++ quantizer is CUDA-only, it has no CPU build"),
)


def select_configs(names: list[str]) -> list[TrainConfig]:
    """The configurations named, in the order given; unknown or repeated names are errors."""
    unknown = [name for name in names if name not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown}; choose from {sorted(CONFIGS)}")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"configuration(s) {repeated} named more than once")
    return [CONFIGS[name] for name in names]


def configs_from_impl(impls: list[str], stages: list[int]) -> list[str]:
    """The older spelling: ``--impl zero fsdp2 --stage 1 2 3`` is zero1, zero2, zero3, fsdp2."""
    names: list[str] = []
    for impl in impls:
        if impl == "zero":
            names.extend(f"zero{stage}" for stage in stages)
        elif impl in ("fsdp2", "deepspeed"):
            names.append("fsdp2" if impl == "fsdp2" else "deepspeed-z3")
        else:
            raise ValueError(f"unknown --impl {impl!r}; choose from zero, fsdp2, deepspeed")
    return names


def _zero_optimization(config: TrainConfig, local_size: int) -> dict[str, Any]:
    section: dict[str, Any] = {"stage": config.stage}
    if config.quantized_weights:
        section["zero_quantized_weights"] = True
    if config.hpz:
        section["zero_hpz_partition_size"] = local_size
    if config.quantized_gradients:
        section["zero_quantized_gradients"] = True
    if config.quant_group_size is not None:
        section[QUANT_GROUP_SIZE_KEY] = config.quant_group_size
    return section


def zero_runtime_config(
    config: TrainConfig, *, local_size: int, bf16: bool, gradient_clipping: float
) -> dict[str, Any]:
    """The dict for ``zero_runtime.initialize``: the stage and ZeRO++ keys only, so the
    runtime's defaults apply (see [Note: same math])."""
    section = _zero_optimization(config, local_size)
    if not config.align_quant_blocks:
        section[ALIGN_KEY] = False
    if config.loco:
        section["zeropp_loco_param"] = dict(LOCO_PARAM)
    if config.first_hop_bits is not None:
        section["zcomm_qgz_first_hop_bits"] = config.first_hop_bits
    if config.hadamard_block is not None:
        section["zcomm_qgz_hadamard_block"] = config.hadamard_block
    if config.weight_delta_bits is not None:
        section["zcomm_weight_delta_bits"] = config.weight_delta_bits
    return {"zero_optimization": section, "bf16": {"enabled": bf16}, "gradient_clipping": gradient_clipping}


def deepspeed_config(
    config: TrainConfig, *, local_size: int, bf16: bool, gradient_clipping: float, micro_batch: int
) -> dict[str, Any]:
    """The dict for ``deepspeed.initialize``; the optimizer is passed in, so allow torch's AdamW."""
    section = _zero_optimization(config, local_size)
    if config.stage == 3:
        section.update(DEEPSPEED_STAGE3_DEFAULTS)
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": gradient_clipping,
        "zero_allow_untested_optimizer": True,
        "zero_optimization": section,
        "bf16": {"enabled": bf16},
    }


def engine_config(
    config: TrainConfig, *, local_size: int, bf16: bool, gradient_clipping: float, micro_batch: int
) -> dict[str, Any]:
    """What ``config``'s engine is given, for the JSON record: the ZeRO engines' dicts, FSDP2's settings."""
    if config.engine == "zero":
        return zero_runtime_config(config, local_size=local_size, bf16=bf16, gradient_clipping=gradient_clipping)
    if config.engine == "deepspeed":
        return deepspeed_config(config, local_size=local_size, bf16=bf16, gradient_clipping=gradient_clipping,
                                micro_batch=micro_batch)  # fmt: skip
    if config.engine == "ddp":
        return {"autocast": "bf16" if bf16 else None, "ddp_hook": config.ddp_hook,
                "first_hop_bits": config.first_hop_bits, "gather_bits": config.gather_bits,
                "gradient_clipping": gradient_clipping}
    settings: dict[str, Any] = {"param_dtype": "bf16" if bf16 else "fp32", "hpz": config.hpz}
    if config.hsdp:
        settings["hsdp"] = True
    if config.quantized_weights or config.quantized_gradients:
        settings["enable_zeropp"] = {
            "quantized_weights": config.quantized_weights,
            "quantized_gradients": config.quantized_gradients,
            "group_size": config.quant_group_size,
            "first_hop_bits": config.first_hop_bits,  # None: enable_zeropp's default
        }
        if config.hsdp:
            settings["enable_zeropp"].update(replicate_group="replicate", quantized_all_reduce=config.quantized_gradients)
    return {**settings, "gradient_clipping": gradient_clipping}
