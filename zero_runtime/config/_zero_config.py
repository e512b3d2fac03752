"""The typed configuration of the ZeRO runtime: ``ZeroConfig`` and its sections.

A keyword-only frozen dataclass with one docstring per field, validated once in
``__post_init__`` (ValueError / TypeError naming DeepSpeed's key); the nested sections are
given as their configs or as DeepSpeed's dicts. Reading a DeepSpeed JSON file (key names,
"auto", unknown keys, ignored hints) is ``_deepspeed_json``'s job: ``from_dict`` hands the
dict to it and validates what it returns here.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Mapping

from zcomm import check_first_hop_bits, check_hadamard_block
from zcomm.quant import QuantSpec

from .._config_keys import unknown_keys_error
from ..activation_checkpointing import ActivationCheckpointingConfig
from ..offload._config import (
    DEFAULT_SUB_GROUP_SIZE,
    AioConfig,
    OffloadOptimizerConfig,
    OffloadParamConfig,
    aio_config,
    integral_count,
    offload_optimizer_config,
    offload_param_config,
)
from . import _deepspeed_json, _optim_spec

Precision = Literal["fp32", "bf16", "fp16"]
# Elements per quantization scale, as ``zcomm.quant.QuantSpec.group_size`` takes it: an int
# valid for both INT8 and INT4 (even, >= 2), or "tensor" (one scale per communicated shard
# or bucket row, the ZeRO++ paper's non-blocked ablation); None keeps zcomm's defaults.
QuantGroupSize = int | Literal["tensor"] | None
# The widths ``zcomm_quant_group_size`` applies to: qwZ's INT8 weights, qgZ's INT4 gradients.
_QUANT_BITS = (8, 4)


@dataclass(frozen=True, kw_only=True)
class LossScaleConfig:
    """fp16 loss scaling, DeepSpeed semantics: ``loss_scale == 0`` means dynamic scaling
    starting at ``2 ** initial_scale_power``; the scale is halved after ``hysteresis``
    consecutive overflows (never below ``min_loss_scale``) and doubled after
    ``loss_scale_window`` overflow-free steps. A positive ``loss_scale`` is static."""

    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.loss_scale < 0:
            raise ValueError(f"fp16.loss_scale must be >= 0 (0 = dynamic), got {self.loss_scale}")
        if not 0 <= self.initial_scale_power <= 64:
            raise ValueError(f"fp16.initial_scale_power must be in [0, 64], got {self.initial_scale_power}")
        for name in ("loss_scale_window", "hysteresis"):
            if getattr(self, name) < 1:
                raise ValueError(f"fp16.{name} must be >= 1, got {getattr(self, name)}")
        if self.min_loss_scale <= 0:
            raise ValueError(f"fp16.min_loss_scale must be > 0, got {self.min_loss_scale}")


# Defaults of the element counts, with DeepSpeed's values where DeepSpeed has the key.
DEFAULT_PREFETCH_BUCKET_SIZE = 50_000_000  # DeepSpeed's stage3_prefetch_bucket_size
DEFAULT_PARAM_PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's stage3_param_persistence_threshold
DEFAULT_MAX_LIVE_PARAMETERS = 1_000_000_000  # DeepSpeed's stage3_max_live_parameters
DEFAULT_MAX_REUSE_DISTANCE = 1_000_000_000  # DeepSpeed's stage3_max_reuse_distance
# [Note: default unit and bucket sizes] A unit is what stage 3 gathers at once and a
# bucket what one reduce-scatter reduces; both trade a collective's fixed latency against
# overlap. One unit per module made a 4-block GPT 56 collectives per step, too slow over
# TCP; one unit for a whole small model leaves nothing to overlap: its gather precedes all
# of forward and its gradients are final only at the end of backward. 1M elements (2 MB in
# bf16) still carry more bytes than latency (~0.17 ms on a 100 Gbit/s link against NCCL's
# ~0.05 ms, ~1.6 ms at 10 Gbit/s against TCP's ~1 ms), so a plain config gathers a
# transformer with d_model <= 288 (12 d^2 elements a block) block by block, as FSDP2 wraps
# it, and larger ones by attention and MLP halves or single matrices; a bucket is then
# about a block's gradients, reduced while the blocks before it run backward (FSDP2's
# per-unit reduce-scatter). Measured on the 2x2 simcluster at 200 Mbit/s (fp32 TinyGPT,
# shared 2-core machine, alternating in one run): with d_model 256 x 4 layers, 1M against
# 4M took plain stage 3 from 1516 to 1378 ms per step and ZeRO++ from 455 to 367 ms; with
# d_model 512 (several units per block either way) they tied (5274/5276, 1160/1176 ms), as
# did d_model 256 on loopback. DeepSpeed's reduce_bucket_size default (5e8) would put any
# model of fewer than 500M parameters in one bucket at the end of backward.
DEFAULT_FUSE_NUMEL = 1_000_000
DEFAULT_REDUCE_BUCKET_SIZE = 1_000_000



@dataclass(frozen=True, kw_only=True)
class LocoConfig:
    """DeepSpeed's ``zero_optimization.zeropp_loco_param``: LoCo error feedback on qgZ's INT4
    reduce-scatter, with DeepSpeed's sub-keys, meanings and documented defaults (a sub-key
    left out takes its default; any other sub-key is an error). ``err_beta``: weight of the
    previous error in its moving average, in [0, 1); ``reset_T``: the errors restart from
    zero every this many reductions of a bucket (>= 1). See ``zcomm.ErrorFeedback``."""

    err_beta: float = 0.8
    reset_T: int = 1024

    def __post_init__(self) -> None:
        beta = self.err_beta
        if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
            raise ValueError(f"zeropp_loco_param.err_beta must be a number in [0, 1), got {beta!r}")
        if isinstance(self.reset_T, bool) or not isinstance(self.reset_T, int) or self.reset_T < 1:
            raise ValueError(f"zeropp_loco_param.reset_T must be an int >= 1, got {self.reset_T!r}")

    @classmethod
    def parse(cls, value: Any) -> "LocoConfig":
        if isinstance(value, LocoConfig):
            return value
        if not isinstance(value, Mapping):
            raise TypeError(f"zeropp_loco_param must be a dict like {{\"err_beta\": 0.8, \"reset_T\": 1024}}, "
                            f"got {value!r}")
        unknown = set(value) - {"err_beta", "reset_T"}
        if unknown:
            raise unknown_keys_error("zero_optimization.zeropp_loco_param", unknown, ("err_beta", "reset_T"))
        return cls(**value)


# [Note: qgZ's first hop] The runtime's qgZ keeps the ZeRO++ paper's INT4 intra-node hop by
# default; zcomm_qgz_first_hop_bits 8 opts into SDP4Bit's INT8 one (same inter-node bytes,
# twice the intra-node ones). Measured for the choice (2x2, real text, 5 seeds): final
# validation loss over ZeRO-3 after 300 steps +0.64% with INT4 and -0.21% with INT8
# (bench/results/convergence_int8hop_cpu-2x2_202611), after 1000 steps +0.08% and +0.13%
# (bench/results/convergence_1000steps_cpu-2x2_202611); paired, the two widths differ by
# -0.84% (t = -1.57) and +0.06% (t = 0.16): not distinguishable, and both within the
# 1000-step target. With step 3 fused into one pass (dequant_reduce(requant_bits=4)) the step
# time is 0.98x at 200 Mbit/s and 1.01x unlimited (speed.md there; before the fusion 1.22x).
# Equal in loss and speed on this evidence, INT4 stays the default: it is the paper's and
# sends half the intra-node bytes, which on a GPU node's links are cheap but not free.


@dataclass(frozen=True, kw_only=True)
class ZeroConfig:
    """Everything that changes what the runtime computes or communicates.

    A keyword-only, frozen dataclass validated once in ``__post_init__``; each field's
    docstring (below it) names its DeepSpeed key where it has one. Element counts are in
    parameter elements (DeepSpeed's unit); DeepSpeed's JSON writes them as integral floats
    (``1e9``), which are accepted and stored as ints. ``from_dict`` / ``from_json`` read a
    DeepSpeed config (``_deepspeed_json``; see [Note: DeepSpeed keys] there).
    """

    stage: int = 0
    """0, 1, 2 or 3; DeepSpeed's default, 0, is plain data parallelism: every rank keeps the
    whole model, its gradients and optimizer states, and the gradients are all-reduced
    (see ``comm._all_reduce``). Stage 1 partitions the optimizer states, 2 also the gradients, 3 also
    the parameters."""
    precision: Precision = "fp32"
    """The training dtype: ``bf16.enabled`` / ``fp16.enabled`` in DeepSpeed's JSON."""
    reduce_bucket_size: int = DEFAULT_REDUCE_BUCKET_SIZE
    """At most this many gradient elements are reduce-scattered (stage 0: all-reduced) by one
    collective (a unit larger than that is a bucket alone; DeepSpeed's meaning). Stages 2 and 3 launch a bucket
    during backward as soon as the gradients of all its units are final; buckets are fixed at
    start-up, in the order gradients become final, so every rank issues them in the same
    order. Stage 0 does so in the backward of each accumulation boundary only (the micro-steps
    before it accumulate locally). Stages 0-2 also size their flat units by it (see [Note:
    default unit and bucket sizes])."""
    overlap_comm: bool = True
    """False launches the buckets only once backward is over, in the same order, so no
    reduce-scatter (all-reduce) overlaps backward; no effect in stage 1. DeepSpeed's key and meaning, but
    true by default in every stage, where DeepSpeed's is true for stage 3 only."""
    prefetch_bucket_size: int = DEFAULT_PREFETCH_BUCKET_SIZE
    """``stage3_prefetch_bucket_size``: at most this many elements are being gathered ahead of
    their use; 0 turns prefetching off. DeepSpeed's ``stage3_*`` keys are accepted, and have
    no effect, in stages 0-2, as in DeepSpeed; see [Note: stage-3 residency] in
    ``_stage3``."""
    param_persistence_threshold: int = DEFAULT_PARAM_PERSISTENCE_THRESHOLD
    """``stage3_param_persistence_threshold``: parameters of at most this many elements are
    never freed. They are kept whole on every rank in units of their own, their gradients are
    reduce-scattered in the buckets and their optimizer states partitioned like everyone
    else's, and each optimizer step ends with one all-gather of them (DeepSpeed's
    ``ds_persist``; with qwZ an INT8 one, where DeepSpeed's is exact). 0 partitions every
    parameter."""
    max_live_parameters: int = DEFAULT_MAX_LIVE_PARAMETERS
    """``stage3_max_live_parameters``: prefetching never makes more than this many gathered
    elements live, and a unit finished with is freed rather than kept once more than this
    many are live."""
    max_reuse_distance: int = DEFAULT_MAX_REUSE_DISTANCE
    """``stage3_max_reuse_distance``: a unit finished with is kept gathered if the trace of
    the first step says it is used again before this many other parameter elements are
    (typically: from forward into backward), or if the prefetcher has already passed that
    next use. 0 frees after each use what lies beyond the prefetch window."""
    gradient_clipping: float = 0.0
    """Global gradient-norm clipping, as ``torch.nn.utils.clip_grad_norm_``; 0 turns it off. A
    non-finite norm is not detected: only fp16 with dynamic loss scaling skips such a step."""
    gradient_accumulation_steps: int | None = None
    """Micro-batches per optimizer step; None: 1, or derived from the two batch sizes by
    ``for_world_size`` (DeepSpeed's batch arithmetic, see [Note: DeepSpeed keys])."""
    train_batch_size: int | None = None
    """DeepSpeed's global batch size, checked against the others by ``for_world_size`` when
    ``initialize`` starts; for the user's data loader (the runtime never sees the batches)."""
    train_micro_batch_size_per_gpu: int | None = None
    """DeepSpeed's per-rank micro-batch size; checked and derived like ``train_batch_size``."""
    optimizer: Mapping[str, Any] | None = None
    """DeepSpeed's ``{"type": ..., "params": {...}}`` optimizer section, checked here and
    built by ``initialize`` (see ``config._optim_spec``)."""
    scheduler: Mapping[str, Any] | None = None
    """DeepSpeed's scheduler section, checked here and built by ``initialize`` (see
    ``lr_schedules``)."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """fp16 loss scaling: DeepSpeed's ``fp16`` section but ``enabled``."""
    quantized_weights: bool = False
    """``zero_quantized_weights`` (qwZ): parameters are gathered with zcomm's INT8
    ``all_gather_q8``: for forward in stage 3, after each optimizer step in stages 1 and 2
    (and for stage 3's persistent units). With hpZ and qgZ on as well it is ZeRO++. In stages
    1 and 2, ``weight_delta_bits`` sends differences instead of values."""
    hpz_partition_size: int = 1
    """``zero_hpz_partition_size`` (hpZ; stage 3 only): above 1, a secondary copy of each
    module's parameters is kept partitioned over that many consecutive ranks after its
    forward and backward gathers from it. It must divide the world size and line up with
    nodes, checked when the runtime starts."""
    quantized_gradients: bool = False
    """``zero_quantized_gradients`` (qgZ): gradient buckets are reduce-scattered with zcomm's
    INT4 ``reduce_scatter_q4_coalesced`` (averaged in fp32); in stage 0 they are all-reduced
    with ``zcomm.all_reduce_q4`` (that reduce-scatter, then the averaged slices gathered in
    INT8 by ``all_gather_q8``)."""
    weight_delta_bits: int | None = None
    """``zcomm_weight_delta_bits``, 4 or 8 (with ``zero_quantized_weights``; in stage 3 also
    with hpZ): in stages 1 and 2, after each step every rank sends the blocked INT4 (or INT8)
    difference between its updated shard and the value every rank already holds, and every
    rank adds the same dequantized differences (SDP4Bit's weight differences; see [Note:
    weight differences] in ``comm._weight_delta``). In stage 3 the values held are hpZ's
    node-local copies, refreshed by differences across the blocks when the shards change
    ([Note: hpZ references] in ``comm._hpz_delta``). None sends INT8 values (qwZ)."""
    quant_group_size: QuantGroupSize = None
    """``zcomm_quant_group_size``: elements per quantization scale of both quantized
    collectives (see ``QuantGroupSize``; in stage 0 both halves of qgZ's all-reduce); valid
    for both widths, and set only with one of them on."""
    fuse_numel: int | None = None
    """``zcomm_stage3_fuse_numel``: a module whose subtree holds at most this many partitioned
    elements is gathered as one unit (e.g. a whole transformer block); 0 gives one unit per
    module. None: ``DEFAULT_FUSE_NUMEL`` in stage 3 (see [Note: default unit and bucket
    sizes]; on fusing, [Note: fused units] in ``_partition``), 0 otherwise; set in stages 1
    and 2 it is an error."""
    align_quant_blocks: bool = True
    """``zcomm_align_quant_blocks``: with qwZ or qgZ on, each parameter is padded in the flat
    units so that no quantization group ever holds elements of two parameters
    (``quant_block_align``; see [Note: parameter-aligned blocks] in ``_flat_buffer``); false
    packs parameters without gaps."""
    loco: LocoConfig | None = None
    """DeepSpeed's ``zeropp_loco_param`` (see ``LocoConfig``; needs qgZ): LoCo error feedback
    on both hops of qgZ, one INT8 error state per gradient bucket, counted in
    ``memory_report().error_feedback`` and saved in checkpoints."""
    qgz_first_hop_bits: int = 4
    """``zcomm_qgz_first_hop_bits``, 4 or 8: qgZ's intra-node hop in INT4 (the ZeRO++ paper's)
    or INT8 (SDP4Bit's two-level scheme; the inter-node bytes are the same; the
    ``first_hop_bits`` Note of ``zcomm.reduce_scatter_q4``); 8 needs qgZ and excludes LoCo.
    See [Note: qgZ's first hop] for the default."""
    qgz_hadamard_block: int | None = None
    """``zcomm_qgz_hadamard_block``, a power of two or None: qgZ's gradients rotated in blocks
    of that many elements by an orthonormal Hadamard matrix before quantization, and back
    after (``hadamard_block`` of ``zcomm.reduce_scatter_q4``); needs qgZ and excludes LoCo."""
    offload_optimizer: OffloadOptimizerConfig = field(default_factory=OffloadOptimizerConfig)
    """``zero_optimization.offload_optimizer`` (stages 1-3): masters and optimizer states on
    the CPU or NVMe (see ``zero_runtime.offload``)."""
    offload_param: OffloadParamConfig = field(default_factory=OffloadParamConfig)
    """``zero_optimization.offload_param`` (stage 3 only): parameter shards at home on the
    host or NVMe between uses."""
    sub_group_size: int = DEFAULT_SUB_GROUP_SIZE
    """DeepSpeed's key: the most master elements the offloaded step updates at once, one
    sub-group per NVMe transfer."""
    aio: AioConfig = field(default_factory=AioConfig)
    """DeepSpeed's ``aio`` section: how the NVMe swap files are read and written."""
    activation_checkpointing: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    """DeepSpeed's ``activation_checkpointing`` section: the options of
    ``ZeroOptimizer.checkpointer``."""

    def __post_init__(self) -> None:
        self._parse_sections()
        self._check_basics()
        self._check_counts()
        self._check_batch_sizes()
        if self.optimizer is not None:
            _optim_spec.check_optimizer(self.optimizer)
        if self.scheduler is not None:
            _optim_spec.check_scheduler(self.scheduler)
        self._check_stage0()
        self._check_zeropp()
        if self.offload_param.enabled and self.stage != 3:
            raise ValueError(f"zero_optimization.offload_param (device {self.offload_param.device!r}) needs "
                             f"zero_optimization.stage 3, got stage {self.stage}: only stage 3 frees parameters")
        if self.offload_optimizer.zcomm_overlap_step:
            self._check_overlap_step()

    def _parse_sections(self) -> None:
        """The nested sections may be given as DeepSpeed's dicts: stored as their configs."""
        object.__setattr__(self, "offload_optimizer", offload_optimizer_config(self.offload_optimizer))
        object.__setattr__(self, "offload_param", offload_param_config(self.offload_param))
        object.__setattr__(self, "aio", aio_config(self.aio))
        if not isinstance(self.activation_checkpointing, ActivationCheckpointingConfig):
            object.__setattr__(self, "activation_checkpointing",
                               ActivationCheckpointingConfig.from_dict(self.activation_checkpointing))
        if self.loco is not None:
            object.__setattr__(self, "loco", LocoConfig.parse(self.loco))

    def _check_basics(self) -> None:
        if isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {self.stage!r}")
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp16', got {self.precision!r}")
        if self.gradient_clipping < 0:
            raise ValueError(f"gradient_clipping must be >= 0 (0 = off), got {self.gradient_clipping}")
        if not isinstance(self.loss_scale, LossScaleConfig):
            raise TypeError(f"loss_scale must be a LossScaleConfig, got {type(self.loss_scale).__name__}")
        for name, key in (("quantized_weights", "zero_quantized_weights"),
                          ("quantized_gradients", "zero_quantized_gradients"), ("overlap_comm", "overlap_comm"),
                          ("align_quant_blocks", "zcomm_align_quant_blocks")):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{key} must be true or false, got {getattr(self, name)!r}")

    def _check_stage0(self) -> None:
        """Stage 0 keeps every parameter whole on every rank and updates it there: the keys that
        change how parameters are gathered or where optimizer states live have nothing to act on."""
        if self.stage != 0:
            return
        reasons = {
            "zero_quantized_weights": (self.quantized_weights, "no parameter is gathered: every rank updates its "
                                       "own whole copy"),
            "zcomm_weight_delta_bits": (self.weight_delta_bits is not None, "no parameter is gathered, so no "
                                        "difference is sent"),
            "zero_hpz_partition_size": (self.hpz_partition_size != 1, "no parameter is partitioned or gathered"),
            "offload_optimizer": (self.offload_optimizer.enabled, "the optimizer states are not partitioned; "
                                  "offloading is implemented for the partitioned states of stages 1-3"),
        }
        for key, (given, why) in reasons.items():
            if given:
                raise ValueError(f"zero_optimization.{key} is not supported at zero_optimization.stage 0 (plain data "
                                 f"parallelism): {why}; use stage 1, 2 or 3 for it")

    def _check_zeropp(self) -> None:
        """The ZeRO++ options: hpZ in stage 3 only, weight differences in stages 1 and 2, and the
        combinations of qgZ's variants."""
        if isinstance(self.hpz_partition_size, bool) or not isinstance(self.hpz_partition_size, int):
            raise TypeError(f"zero_hpz_partition_size must be an int, got {self.hpz_partition_size!r}")
        if self.hpz_partition_size < 1:
            raise ValueError(f"zero_hpz_partition_size must be >= 1, got {self.hpz_partition_size}")
        if self.hpz_partition_size > 1 and self.stage != 3:
            raise ValueError(f"zero_hpz_partition_size needs zero_optimization.stage 3, got stage {self.stage}: "
                             "only stage 3 partitions the parameters hpZ keeps a secondary copy of")
        self._check_weight_delta_bits()
        self._check_quant_group_size()
        if self.loco is not None and not self.quantized_gradients:
            raise ValueError("zeropp_loco_param (LoCo error feedback) needs zero_quantized_gradients")
        check_first_hop_bits(self.qgz_first_hop_bits, "zcomm_qgz_first_hop_bits")
        if self.qgz_first_hop_bits == 8 and not self.quantized_gradients:
            raise ValueError("zcomm_qgz_first_hop_bits 8 needs zero_quantized_gradients (qgZ)")
        if self.qgz_first_hop_bits == 8 and self.loco is not None:
            raise ValueError("zcomm_qgz_first_hop_bits 8 cannot be combined with zeropp_loco_param (LoCo's "
                             "errors model INT4 hops)")
        self._check_hadamard_block()

    def _check_overlap_step(self) -> None:
        """An update during backward cannot wait for the global gradient norm."""
        if self.gradient_clipping > 0:
            raise ValueError("offload_optimizer.zcomm_overlap_step cannot be combined with gradient_clipping: "
                             "clipping needs every gradient before the first update")
        if self.precision == "fp16" and self.loss_scale.loss_scale == 0:
            raise ValueError("offload_optimizer.zcomm_overlap_step cannot be combined with fp16 dynamic loss "
                             "scaling: a step is skipped on overflow, known only once every gradient is")

    def _check_hadamard_block(self) -> None:
        if self.qgz_hadamard_block is None:
            return
        check_hadamard_block(self.qgz_hadamard_block, "zcomm_qgz_hadamard_block")
        if not self.quantized_gradients:
            raise ValueError("zcomm_qgz_hadamard_block needs zero_quantized_gradients (qgZ)")
        if self.loco is not None:
            raise ValueError("zcomm_qgz_hadamard_block cannot be combined with zeropp_loco_param")

    def _check_batch_sizes(self) -> None:
        """Positive ints where given; with neither batch size given, accumulation defaults to 1
        (without a world size nothing more can be checked; ``for_world_size`` does the rest)."""
        for key in ("gradient_accumulation_steps", "train_batch_size", "train_micro_batch_size_per_gpu"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
        if self.train_batch_size is None and self.train_micro_batch_size_per_gpu is None:
            object.__setattr__(self, "gradient_accumulation_steps", self.gradient_accumulation_steps or 1)

    def for_world_size(self, world_size: int) -> "ZeroConfig":
        """This config with DeepSpeed's batch-size arithmetic done for ``world_size`` ranks
        (``initialize`` calls it with the group's size).

        ``train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps *
        world_size``. As in DeepSpeed: all three given are checked; two given imply the third
        (integer division, then checked, so 32 over 3 ranks fails); ``train_batch_size`` alone
        means no accumulation and ``train_batch_size / world_size`` per rank;
        ``train_micro_batch_size_per_gpu`` alone means no accumulation. With no batch size
        given the config is returned unchanged (DeepSpeed requires one; this runtime never
        sees the batches, so they are optional).
        """
        batch, micro, accum = (self.train_batch_size, self.train_micro_batch_size_per_gpu,
                               self.gradient_accumulation_steps)
        if batch is None and micro is None:
            return self
        if batch is not None and micro is not None:
            accum = accum if accum is not None else batch // micro // world_size
        elif batch is not None:
            accum = accum if accum is not None else 1
            micro = batch // world_size // accum
        else:
            accum = accum if accum is not None else 1
            batch = micro * accum * world_size
        if micro < 1 or accum < 1 or batch != micro * accum * world_size:
            raise ValueError(f"train_batch_size ({batch}) must equal train_micro_batch_size_per_gpu ({micro}) x "
                             f"gradient_accumulation_steps ({accum}) x world size ({world_size}); given: "
                             + ", ".join(f"{k}={v}" for k, v in (("train_batch_size", self.train_batch_size),
                                                                 ("train_micro_batch_size_per_gpu",
                                                                  self.train_micro_batch_size_per_gpu),
                                                                 ("gradient_accumulation_steps",
                                                                  self.gradient_accumulation_steps))
                                         if v is not None))
        return replace(self, train_batch_size=batch, train_micro_batch_size_per_gpu=micro,
                       gradient_accumulation_steps=accum)

    def _check_counts(self) -> None:
        """Element counts: ints (or integral floats, as DeepSpeed's JSON writes ``1e9``),
        stored as ints; ``fuse_numel``'s None resolved."""
        if self.fuse_numel is None:
            object.__setattr__(self, "fuse_numel", DEFAULT_FUSE_NUMEL if self.stage == 3 else 0)
        elif self.stage != 3 and integral_count("zcomm_stage3_fuse_numel", self.fuse_numel, 0):
            raise ValueError(f"zcomm_stage3_fuse_numel needs zero_optimization.stage 3, got stage {self.stage}")
        for name, key, minimum in _COUNTS:
            object.__setattr__(self, name, integral_count(key, getattr(self, name), minimum))

    def _check_weight_delta_bits(self) -> None:
        bits = self.weight_delta_bits
        if bits is None:
            return
        if isinstance(bits, bool) or not isinstance(bits, int):
            raise TypeError(f"zcomm_weight_delta_bits must be 4 or 8, got {bits!r}")
        if bits not in (4, 8):
            raise ValueError(f"zcomm_weight_delta_bits must be 4 or 8, got {bits}")
        if not self.quantized_weights:
            raise ValueError("zcomm_weight_delta_bits needs zero_quantized_weights: it chooses how the quantized "
                             "weights are sent")
        if self.stage == 3 and self.hpz_partition_size == 1:
            raise ValueError("zcomm_weight_delta_bits in zero_optimization.stage 3 needs zero_hpz_partition_size "
                             "above 1: stage 3 frees the parameters, and hpZ's node-local copies are the previous "
                             "values a difference is added to")

    def _check_quant_group_size(self) -> None:
        """Valid for both widths, whichever options are on: a config that quantizes only
        weights stays valid when gradients are quantized too."""
        size = self.quant_group_size
        if size is None:
            return
        for bits in _QUANT_BITS:
            try:
                QuantSpec(bits=bits, group_size=size)
            except (TypeError, ValueError) as err:
                raise type(err)(f"zcomm_quant_group_size {size!r} is not a group size for both INT8 qwZ and "
                                f"INT4 qgZ: {err}") from None
        if not (self.quantized_weights or self.quantized_gradients):
            # A group size with nothing quantized is almost surely a config mistake.
            raise ValueError("zcomm_quant_group_size is set but neither zero_quantized_weights nor "
                             "zero_quantized_gradients is on")

    def quant_block_align(self) -> int:
        """Elements every parameter offset and shard size of a flat unit is a multiple of: the
        least common multiple of the group sizes of the quantized collectives that are on
        (1: nothing quantized, ``"tensor"`` scales, or ``align_quant_blocks`` off). Stage 0's
        qgZ all-reduce gathers its averaged slices in INT8, so its groups count too."""
        if not self.align_quant_blocks or self.quant_group_size == "tensor":
            return 1
        weight_bits = self.weight_delta_bits or 8
        gathers_int8 = self.quantized_weights or (self.stage == 0 and self.quantized_gradients)
        widths = [bits for bits, on in ((weight_bits, gathers_int8), (4, self.quantized_gradients)) if on]
        return math.lcm(1, *(QuantSpec(bits=bits, group_size=self.quant_group_size).group_size for bits in widths))

    def zeropp_options(self) -> list[str]:
        """DeepSpeed names of the ZeRO++ options this config turns on."""
        on = []
        if self.quantized_weights:
            on.append("zero_quantized_weights")
        if self.hpz_partition_size > 1:
            on.append("zero_hpz_partition_size")
        if self.quantized_gradients:
            on.append("zero_quantized_gradients")
        return on


    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> "ZeroConfig":
        """Parse a DeepSpeed-style dict (see ``_deepspeed_json.read``: "auto", unknown keys and a
        missing stage are errors). DeepSpeed's performance hints are accepted and reported once
        as ignored, in one warning naming them, once the config is valid."""
        kwargs, ignored = _deepspeed_json.read(config)
        parsed = cls(**{**kwargs, "loss_scale": LossScaleConfig(**kwargs["loss_scale"])})
        if ignored:
            warnings.warn("zero_runtime ignores these DeepSpeed settings (performance hints with no effect "
                          f"here): {', '.join(sorted(ignored))}", UserWarning, stacklevel=2)
        return parsed

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "ZeroConfig":
        """``from_dict`` of a DeepSpeed JSON file."""
        with open(path) as f:
            return cls.from_dict(json.load(f))


# (field, DeepSpeed key, smallest valid value) of the element counts
_COUNTS = (
    ("reduce_bucket_size", "reduce_bucket_size", 1),
    ("prefetch_bucket_size", "stage3_prefetch_bucket_size", 0),
    ("param_persistence_threshold", "stage3_param_persistence_threshold", 0),
    ("max_live_parameters", "stage3_max_live_parameters", 0),
    ("max_reuse_distance", "stage3_max_reuse_distance", 0),
    ("fuse_numel", "zcomm_stage3_fuse_numel", 0),
    ("sub_group_size", "sub_group_size", 1),
)



def resolve_config(config: "ZeroConfig | Mapping[str, Any] | str | os.PathLike") -> ZeroConfig:
    """Accept a ZeroConfig, a DeepSpeed-style dict, or the path of a DeepSpeed JSON file."""
    if isinstance(config, ZeroConfig):
        return config
    if isinstance(config, Mapping):
        return ZeroConfig.from_dict(config)
    if isinstance(config, (str, os.PathLike)):
        return ZeroConfig.from_json(config)
    raise TypeError(f"config must be a ZeroConfig, a dict or a JSON path, got {type(config).__name__}")
