"""``initialize``: wrap a model and an optimizer into ZeRO stage 0, 1, 2 or 3 (``zero_runtime.initialize``).

It checks the model and the process group, builds the comm plan (``comm._plan``), groups the
trainable parameters into flat units (``_partition``; per optimizer group, by size for
stages 0-2 and stage 3's persistent parameters, by module for stage 3's partitioned ones),
builds the torch optimizer over their fp32 master shards and hands everything to
``ZeroOptimizer``.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map

import zcomm

from ._partition import FlatUnit, group_by_module, group_by_size, trainable_named_parameters
from ._partitioned_init import is_partitioned, materialize, partitioned_parameters
from .comm._plan import CommPlan, build_comm_plan
from .config import ZeroConfig, _optim_spec, resolve_config
from .optimizer import ZeroOptimizer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

OptimizerSpec = Callable[[list[nn.Parameter]], torch.optim.Optimizer] | torch.optim.Optimizer


def initialize(model: nn.Module, optimizer: OptimizerSpec | None = None,
               config: ZeroConfig | Mapping[str, Any] | str | os.PathLike | None = None, *,
               group: dist.ProcessGroup | None = None,
               topology: zcomm.Topology | None = None) -> tuple[nn.Module, ZeroOptimizer]:
    """Partition ``model``'s training state over the ranks of ``group`` (default: WORLD),
    whose node layout is ``topology`` (default: detected by zcomm).

    Every rank must pass an identical model (same initial weights). The model is modified in
    place: parameters become views of flat buffers in the compute dtype (stage 3: freed
    between uses, gathered by module hooks), floating inputs are cast to the compute dtype.
    ``optimizer`` is either a callable taking a list of parameters (applied to this rank's
    fp32 master shards) or a torch optimizer built on the model's parameters, used as a
    template: its class, defaults and per-group hyper-parameters are kept, each group is
    partitioned separately.

    ``optimizer`` may be None when the config has DeepSpeed's ``optimizer`` section (it is
    then built from its ``type`` and ``params``, over one group); giving both is an error. A
    ``scheduler`` section builds ``opt.lr_scheduler`` over the optimizer, stepped by
    ``opt.step()`` after each applied update. The config's batch sizes are checked against
    ``group``'s size (``ZeroConfig.for_world_size``).

    The trainable parameters must all be on one device that ``group``'s backend supports
    (``cuda:<local rank>`` for NCCL); every tensor the runtime creates lives there.

    A model built under ``zero_runtime.Init`` is taken without gathering it whole: under
    stage 3 each partitioned unit is gathered alone while its shard is cut (peak: one unit's
    full size), the parameters kept whole (persistent ones, stages 1-2) are gathered first.
    """
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: call init_process_group first")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if config is None:
        raise TypeError("initialize() needs a config (a ZeroConfig, a DeepSpeed-style dict or a JSON path)")
    group = group if group is not None else dist.group.WORLD
    config = resolve_config(config).for_world_size(dist.get_world_size(group))
    optimizer = _optimizer_spec(optimizer, config)
    names = trainable_named_parameters(model)
    if not names:
        raise ValueError("the model has no trainable parameters (requires_grad=True); nothing to optimize")
    plan = build_comm_plan(config, group, topology, device=_training_device(names, group))
    groups, build = _optimizer_groups(optimizer, names)
    dtype = DTYPES[config.precision]
    materialize([p for p in partitioned_parameters(model) if not _stage3_partitions(p, config)], group)
    _cast_untrained_state(model, dtype)
    units = _build_units(model, groups, names, config, plan, dtype)
    frozen_units = _build_frozen_units(model, config, plan, dtype, first_index=len(units))
    assert not partitioned_parameters(model), "every Init slice is gathered by a unit or before"
    masters = [[u.master for u in units if u.group_index == i] for i in range(len(groups))]
    torch_opt = build(masters)
    lr_scheduler = _optim_spec.build_scheduler(config.scheduler, torch_opt) if config.scheduler else None
    if dtype != torch.float32:
        model.register_forward_pre_hook(_input_caster(dtype), with_kwargs=True)
    return model, ZeroOptimizer(model=model, units=units, optimizer=torch_opt, config=config, plan=plan,
                                lr_scheduler=lr_scheduler, frozen_units=frozen_units)


def _optimizer_spec(optimizer: OptimizerSpec | None, config: ZeroConfig) -> OptimizerSpec:
    """The caller's optimizer, or a builder of the config's ``optimizer`` section: exactly one."""
    if optimizer is not None and config.optimizer is not None:
        raise ValueError("an optimizer was passed to initialize() and the config has an 'optimizer' section; "
                         "give one of them")
    if optimizer is not None:
        return optimizer
    if config.optimizer is None:
        raise ValueError("no optimizer: pass one to initialize() or give the config DeepSpeed's 'optimizer' "
                         "section ({\"type\": \"AdamW\", \"params\": {\"lr\": ...}})")
    spec = config.optimizer
    return lambda params: _optim_spec.build_optimizer(spec, params)


def _training_device(params: Iterable[nn.Parameter], group: dist.ProcessGroup) -> torch.device:
    """The one device of the trainable parameters, checked against the devices ``group``'s
    backend runs on (``get_backend_config`` reads e.g. ``cuda:nccl`` or ``cpu:gloo,cuda:gloo``)."""
    devices = sorted({str(p.device) for p in params})
    if len(devices) > 1:
        raise ValueError(f"the trainable parameters are on several devices ({', '.join(devices)}); the runtime "
                         "trains on one device per rank: move the model there before initialize()")
    device = torch.device(devices[0])
    config = dist.get_backend_config(group)
    supported = [pair.split(":")[0] for pair in config.split(",")]
    if device.type not in supported:
        raise ValueError(f"the model's parameters are on {device}, but the process group's backend ({config}) "
                         f"runs on {', '.join(supported)} only: move the model to that device (e.g. "
                         "cuda:<local rank> for NCCL) or pass a group whose backend supports "
                         f"{device.type}")
    return device


def _optimizer_groups(optimizer: OptimizerSpec, names: Mapping[nn.Parameter, str]):
    """Split trainable parameters into the optimizer's groups and return a builder that makes
    the real optimizer from the master shards of each group."""
    if isinstance(optimizer, torch.optim.Optimizer):
        if optimizer.state:
            raise ValueError("the template optimizer already has state; pass a fresh one")
        seen: dict[nn.Parameter, int] = {}
        groups = []
        for index, group in enumerate(optimizer.param_groups):
            for param in group["params"]:
                if param in seen:
                    raise ValueError(f"parameter {names.get(param, '<not in model>')} is in optimizer groups "
                                     f"{seen[param]} and {index}; each parameter must be in exactly one")
                if param not in names:
                    raise ValueError("the optimizer holds a parameter that is not a trainable parameter of the model")
                seen[param] = index
            groups.append([p for p in names if seen.get(p) == index])
        missing = [name for p, name in names.items() if p not in seen]
        if missing:
            raise ValueError(f"trainable parameters in no optimizer group: {', '.join(missing)}")
        hparams = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        cls = type(optimizer)
        return groups, lambda masters: cls([{"params": m, **h} for m, h in zip(masters, hparams, strict=True)])
    if not callable(optimizer):
        raise TypeError("optimizer must be a callable taking a list of parameters, or a torch optimizer")
    return [list(names)], lambda masters: optimizer(masters[0])


def _build_units(model: nn.Module, groups: Sequence[Sequence[nn.Parameter]], names: Mapping[nn.Parameter, str],
                 config: ZeroConfig, plan: CommPlan, dtype: torch.dtype) -> list[FlatUnit]:
    """Per optimizer group: stages 0-2 by size; stage 3 by module for the partitioned
    parameters and by size for the persistent ones (``param_persistence_threshold``). Stage 0's
    units have one shard, the whole buffer, split for its all-reduce into a slice per rank."""
    position = {param: i for i, param in enumerate(names)}
    shards, rank = (1, 0) if config.stage == 0 else (plan.world_size, plan.rank)
    units: list[FlatUnit] = []
    for group_index, params in enumerate(groups):
        whole = params
        buckets = []
        if config.stage == 3:
            whole = [p for p in params if not _stage3_partitions(p, config)]
            partitioned = [p for p in params if _stage3_partitions(p, config)]
            buckets = [(bucket, True) for bucket in group_by_module(model, partitioned, fuse_numel=config.fuse_numel)]
        buckets += [(bucket, False) for bucket in group_by_size(whole, config.reduce_bucket_size)]
        for bucket, partition in buckets:
            if not bucket:
                continue
            materialize(bucket, plan.group)
            units.append(FlatUnit(index=len(units), group_index=group_index, names=[names[p] for p in bucket],
                                  params=bucket, world_size=shards, rank=rank, dtype=dtype,
                                  partition_params=partition, position=min(position[p] for p in bucket),
                                  align=config.quant_block_align(), slices=plan.world_size))
    return units


def _build_frozen_units(model: nn.Module, config: ZeroConfig, plan: CommPlan, dtype: torch.dtype, *,
                        first_index: int) -> list[FlatUnit]:
    """Stage 3: frozen floating parameters above the persistence threshold, partitioned by
    module (see [Note: frozen units] in ``_partition``); none in stages 1-2."""
    if config.stage != 3:
        return []
    frozen: dict[nn.Parameter, str] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad and param.is_floating_point() and _stage3_partitions(param, config):
            frozen.setdefault(param, name)
    position = {param: i for i, (_, param) in enumerate(model.named_parameters())}
    units = []
    for bucket in group_by_module(model, list(frozen), fuse_numel=config.fuse_numel):
        materialize(bucket, plan.group)
        units.append(FlatUnit(index=first_index + len(units), group_index=-1, names=[frozen[p] for p in bucket],
                              params=bucket, world_size=plan.world_size, rank=plan.rank, dtype=dtype,
                              partition_params=True, position=min(position[p] for p in bucket), frozen=True,
                              align=config.quant_block_align()))
    return units


def _stage3_partitions(param: nn.Parameter, config: ZeroConfig) -> bool:
    """Whether ``param`` goes into a partitioned unit: stage 3, above the persistence threshold
    (a frozen one must also be floating, see ``_build_frozen_units``)."""
    return config.stage == 3 and param.numel() > config.param_persistence_threshold


def _cast_untrained_state(model: nn.Module, dtype: torch.dtype) -> None:
    """Frozen floating parameters and buffers follow the compute dtype (buffers are never
    partitioned, frozen parameters only in stage 3); trainable ones are cast while flattening."""
    with torch.no_grad():
        for param in model.parameters():
            if not param.requires_grad and param.is_floating_point() and not is_partitioned(param):
                param.data = param.data.to(dtype)  # partitioned ones are cast by their frozen unit
        for module in model.modules():
            for name, buf in list(module.named_buffers(recurse=False, remove_duplicate=False)):
                if buf.is_floating_point():
                    setattr(module, name, buf.to(dtype))


def _input_caster(dtype: torch.dtype):
    def cast(tensor):
        return tensor.to(dtype) if isinstance(tensor, torch.Tensor) and tensor.is_floating_point() else tensor

    def hook(module: nn.Module, args: tuple, kwargs: dict):
        return tree_map(cast, args), tree_map(cast, kwargs)

    return hook
