"""``ZeroOptimizer``: the object ``initialize`` returns as ``opt``.

It owns the training state (``TrainingState``: the flat units, the torch optimizer over
their fp32 master shards, the loss scaler, the step counters), the gradient reducer and
(stage 3) the parameter scheduler and module hooks. Stage 0 runs the same machinery over a
partition of one (see [Note: stage 0] in ``comm._all_reduce``). A training step is
``opt.backward(loss)`` then ``opt.step()`` for every micro-batch; with
``gradient_accumulation_steps = n`` the update happens on every n-th ``step()``
(DeepSpeed's accumulation-boundary semantics) and the loss is divided by n in ``backward``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from . import _gathered, _host_sync
from ._clip import clip_by_norm_, global_grad_norm
from ._contract import Phase
from ._loss_scaler import LossScaler, make_scaler
from ._memory import MemoryReport, measure
from ._param_hooks import ModuleHooks
from ._partition import FlatUnit
from ._stage3 import ParamScheduler
from ._state import TrainingState
from .activation_checkpointing import Checkpointer
from .checkpoint import _sharded
from .comm._grad_reduce import GradReducer
from .comm._plan import CommPlan
from .config import ZeroConfig
from .offload._optimizer import OptimizerOffload
from .offload._params import ParamOffload, resident


class ZeroOptimizer:
    def __init__(self, *, model: nn.Module, units: list[FlatUnit], optimizer: torch.optim.Optimizer,
                 config: ZeroConfig, plan: CommPlan, lr_scheduler: Any = None,
                 frozen_units: list[FlatUnit] | None = None) -> None:
        assert config.gradient_accumulation_steps is not None, "initialize resolves the batch sizes"
        self.model = model
        self.config = config
        self.plan = plan
        partitioned = [unit for unit in units if unit.partitioned] + list(frozen_units or [])
        param_offload = offload = None
        try:
            if config.offload_param.enabled and partitioned:
                param_offload = ParamOffload(units=partitioned, config=config, rank=plan.rank)
            if config.offload_optimizer.enabled:
                offload = OptimizerOffload(units=units, optimizer=optimizer, config=config, rank=plan.rank,
                                           param_offload=param_offload)
        except BaseException:
            if param_offload is not None:
                param_offload.close()
            raise
        self.training_state = TrainingState(stage=config.stage, units=units, optimizer=optimizer,
                                            scaler=make_scaler(config.precision, config.loss_scale),
                                            lr_scheduler=lr_scheduler, frozen_units=list(frozen_units or []),
                                            offload=offload, param_offload=param_offload)
        self.scheduler: ParamScheduler | None = None
        self.hooks: ModuleHooks | None = None
        on_ready = None
        if config.stage == 3:
            self.scheduler = ParamScheduler(units=partitioned, plan=plan, prefetch_numel=config.prefetch_bucket_size,
                                            max_live=config.max_live_parameters,
                                            max_reuse_distance=config.max_reuse_distance, offload=param_offload)
            self.hooks = ModuleHooks(model=model, units=partitioned, scheduler=self.scheduler)
            on_ready = self._unit_grads_ready
        self.closed = False  # close() ran: the gradient hooks are gone
        self.reducer = GradReducer(units=units, plan=plan, stage=config.stage, bucket_numel=config.reduce_bucket_size,
                                   overlap=config.overlap_comm, on_unit_ready=on_ready,
                                   on_shards_final=self._shards_final if offload is not None else None)
        # activation checkpointing with the config's options: opt.checkpointer.checkpoint(fn, *args)
        self.checkpointer = Checkpointer(config.activation_checkpointing)
        self.micro_step = 0
        self.last_step_skipped = False
        self._backward_since_step = False
        _gathered.register_owner(self)
        self._state_dict_guard = (_gathered.guard_state_dict(model, partitioned)
                                  if self.hooks is not None else _gathered.StateDictGuard())

    def _unit_grads_ready(self, unit: FlatUnit) -> None:
        if unit.partitioned:
            self.scheduler.grads_ready(unit)

    def _shards_final(self, units: tuple[FlatUnit, ...]) -> None:
        """A bucket's gradient shards are complete: during an overlapped step (see [Note: step
        during backward] in ``offload._optimizer``) its units are updated now."""
        if self.offload.in_step:
            scale = self.scaler.scale
            self.offload.add(list(units), [self._unscaled(unit, scale) for unit in units])

    @property
    def units(self) -> list[FlatUnit]:
        return self.training_state.units

    @property
    def frozen_units(self) -> list[FlatUnit]:
        """Stage 3's partitioned frozen parameters (see [Note: frozen units] in ``_partition``)."""
        return self.training_state.frozen_units

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer over this rank's fp32 master shards (with offload_optimizer:
        its param groups' hyper-parameters are used, its ``state`` stays empty)."""
        return self.training_state.optimizer

    @property
    def lr_scheduler(self) -> Any:
        """The schedule built from the config's ``scheduler`` section (None without one),
        stepped after every applied optimizer step, as DeepSpeed's engine does."""
        return self.training_state.lr_scheduler

    @property
    def offload(self) -> OptimizerOffload | None:
        """The offloaded masters and optimizer states (``offload_optimizer``), else None."""
        return self.training_state.offload

    @property
    def param_offload(self) -> ParamOffload | None:
        """Where stage 3's parameter shards live between uses (``offload_param``), else None."""
        return self.training_state.param_offload

    @property
    def scaler(self) -> LossScaler:
        return self.training_state.scaler

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    @property
    def global_step(self) -> int:
        """Optimizer steps applied (skipped fp16 overflow steps not counted)."""
        return self.training_state.global_step

    @property
    def skipped_steps(self) -> int:
        return self.training_state.skipped_steps

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss`` (scaled for fp16 and divided for accumulation), then the
        gradient reduce-scatter (stage 0: all-reduce) of this micro-step."""
        if self.closed:
            raise RuntimeError("backward() on a closed engine: close() removed its gradient hooks")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError("backward() expects a scalar loss tensor")
        if not loss.requires_grad:
            raise ValueError("the loss does not require grad: was it computed under torch.no_grad()?")
        if self._backward_since_step:
            raise RuntimeError("backward() called twice without step() in between; call step() after "
                               "every backward (it only updates on accumulation boundaries)")
        factor = self.scaler.scale / self.config.gradient_accumulation_steps
        boundary = (self.micro_step + 1) % self.config.gradient_accumulation_steps == 0
        overlap = self.config.offload_optimizer.zcomm_overlap_step and boundary
        if overlap:
            self._require_unpinned()
            self.offload.begin_step()
        try:
            self.reducer.begin_backward(boundary=boundary)
            (loss * factor if factor != 1.0 else loss).backward()
            self.micro_step += 1
            self.reducer.finish(reduce=self.config.stage >= 2 or boundary)
        except BaseException:  # the window's gradients are dropped; a half-applied update: see abort_step
            self.reducer.abandon()
            self.micro_step = 0
            if overlap:
                self.offload.abort_step()
            raise
        if self.scheduler is not None:
            self.scheduler.end_backward()
            self.hooks.end_of_outside_uses()
        self._backward_since_step = True

    def step(self) -> None:
        """Update on an accumulation boundary: unscale, check overflow (fp16 dynamic loss
        scaling only), clip by the global norm, step the master shards and write them back to
        the compute-dtype parameters."""
        if not self._backward_since_step:
            raise RuntimeError("step() called without backward() since the last step()")
        self._require_unpinned()
        self._backward_since_step = False
        if self.micro_step % self.config.gradient_accumulation_steps:
            return
        changed: list[str] = []
        if self.offload is not None and self.offload.in_step:  # updated during backward
            self.last_step_skipped = False
            changed = self._apply(None)
        else:
            scale = self.scaler.scale
            grads = [self._unscaled(unit, scale) for unit in self.units]
            self.last_step_skipped = not self._clip_or_detect_overflow(grads)
            if self.last_step_skipped:
                self.training_state.skipped_steps += 1
            else:
                self._apply(grads)
        self.reducer.discard()
        if not self.last_step_skipped:
            self.sync_params_from_masters()
            self.training_state.global_step += 1
        if changed:
            raise RuntimeError(f"the optimizer's {', '.join(changed)} changed between backward() and step(): with "
                               "offload_optimizer.zcomm_overlap_step this step used the values at backward(); "
                               "change hyper-parameters after step(), as an lr scheduler does")

    def _apply(self, grads: list[torch.Tensor] | None) -> list[str]:
        """The optimizer step on the master shards (offloaded or not), then the schedule's.
        ``grads`` None: finish the step the backward started (see [Note: step during
        backward] in ``offload._optimizer``); returns the hyper-parameters changed since it began."""
        changed = []
        if grads is None:
            changed = self.offload.end_step()
        elif self.offload is not None:
            self.offload.step(grads)
        else:
            for unit, grad in zip(self.units, grads, strict=True):
                unit.master.grad = grad
            self.optimizer.step()
            for unit in self.units:
                unit.master.grad = None
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        return changed

    @staticmethod
    def _unscaled(unit: FlatUnit, scale: float) -> torch.Tensor:
        """``unit``'s reduced gradient shard in fp32 (the shard itself when it is fp32: the
        step consumes it before ``discard`` zeroes it), divided by the loss scale ``scale``."""
        grad = unit.grad_shard.float()
        return grad.div_(scale) if scale != 1.0 else grad

    def _clip_or_detect_overflow(self, grads: list[torch.Tensor]) -> bool:
        """Clip ``grads`` in place by the global norm; with the fp16 dynamic scaler, False
        (skip the step) if that norm is not finite.

        The norm is one all-reduce over every rank's shard, so every rank takes the same
        decision (see [Note: loss-scale handling] in ``_loss_scaler``); in stage 0 every rank
        holds the same whole gradient and computes it alone. Only the dynamic scaler
        reads the norm on the host (see [Note: host syncs] in ``_host_sync``); clipping alone
        stays on the device, like ``torch.nn.utils.clip_grad_norm_``, and so does not detect a
        non-finite norm.
        """
        clip = self.config.gradient_clipping > 0
        if not (clip or self.scaler.dynamic):
            return True
        norm = global_grad_norm(grads, self.plan, partitioned=self.config.stage != 0)
        if self.scaler.dynamic:
            finite = _host_sync.read_flag(torch.isfinite(norm))
            self.scaler.update(overflow=not finite)
            if not finite:
                return False
        if clip:
            clip_by_norm_(grads, norm, self.config.gradient_clipping)
        return True

    def zero_grad(self) -> None:
        """Drop gradients accumulated since the last update (``step`` already clears them)."""
        if self.offload is not None and self.offload.in_step:
            raise RuntimeError("zero_grad() after a backward() that already updated the weights "
                               "(offload_optimizer.zcomm_overlap_step): call step() to finish that update")
        self.reducer.discard()
        self.micro_step = 0
        self._backward_since_step = False

    def sync_params_from_masters(self) -> None:
        """Write the fp32 masters into the compute-dtype parameters: partitioned units
        (stage 3) update their shards (the next forward gathers them); units kept whole
        (stages 1 and 2, stage 3's persistent ones) all-gather their full buffers; stage 0's,
        whose shard is the whole buffer, are written in place. With an
        offloaded optimizer the step already wrote the masters in the compute dtype
        (``offload.compute_copy``, the shard itself on a CPU run): that is the source.

        [Note: write-back copies] On a CUDA run with an offloaded optimizer the copies from
        ``compute_copy`` to the device are asynchronous (``non_blocking``; truly so when
        ``pin_memory`` made ``compute_copy`` page-locked): they queue on the current stream
        ahead of the gathers that read the shards. The host writes ``compute_copy`` again
        only in the next update of that unit, which first waits for the event recorded behind
        the unit's gradient copy on the same stream (see [Note: gradient copies to the host]
        in ``offload._optimizer``), queued after every copy here, so these have finished by then;
        ``set_master`` copies its value to the host synchronously first, and
        ``load_state_dict`` synchronizes the device before it writes ``compute_copy`` from a
        checkpoint.
        """
        self._require_unpinned()
        if self.scheduler is not None:
            self.scheduler.free_all()
            self.hooks.end_of_outside_uses()
        offload, param_offload = self.offload, self.param_offload  # properties: read once, not per unit
        whole = self.config.stage == 0
        with torch.no_grad():
            handles = []
            gather = self.plan.forward_gather
            for unit in self.units:
                source = unit.master if offload is None else offload.compute_copy[unit.index]
                if unit.partitioned or whole:
                    if source is unit.shard:
                        continue
                    if param_offload is None:
                        unit.shard.copy_(source, non_blocking=True)
                    else:
                        with resident(param_offload, [unit], overwrite=True):
                            unit.shard.copy_(source, non_blocking=True)
                else:
                    shard = gather.allocate(unit.layout.shard_numel, dtype=unit.dtype, device=self.plan.device)
                    shard.copy_(source, non_blocking=True)
                    handles.append((gather(unit.full, shard, unit=unit.index, phase=Phase.STEP), shard))
            for handle, _ in handles:
                handle.wait()
        if self.param_offload is not None:
            self.param_offload.flush()
        self.plan.weights_changed()

    def _require_unpinned(self) -> None:
        if any(unit.pinned for unit in self.units + self.frozen_units):
            raise RuntimeError("the weights cannot change inside a GatheredParameters block (step(), "
                               "load_checkpoint(), load_state_dict()); leave the block first")

    def require_idle(self, what: str) -> None:
        """Raise unless no forward or backward is running (``GatheredParameters``)."""
        if self.hooks is not None and (self.hooks.running() or any(u.in_backward for u in self.scheduler.units)):
            raise RuntimeError(f"{what} inside a forward or backward of the model is not supported")

    # ----- state -----
    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the training state (masters, optimizer, scaler, counters)."""
        self._require_boundary()
        return _sharded.rank_state(self.training_state, self.plan)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load what ``state_dict`` returned on this rank; validated before anything changes."""
        self._require_unpinned()
        saved = _sharded.validate_rank_state(self.training_state, self.plan, state)
        _sharded.apply_rank_state(self.training_state, self.plan, saved)
        self._after_load()

    def save_checkpoint(self, directory: str | os.PathLike) -> None:
        """Collective: every rank writes its shard under ``directory`` (see ``checkpoint._sharded``)."""
        self._require_boundary()
        with self._state_dict_guard.suspended():
            _sharded.save(self.training_state, self.plan, directory, self.model)

    def load_checkpoint(self, directory: str | os.PathLike) -> None:
        """Collective: load what ``save_checkpoint`` wrote, or raise ``CheckpointError`` on
        every rank with nothing changed."""
        self._require_unpinned()
        _sharded.load(self.training_state, self.plan, directory)
        self._after_load()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Consolidated fp32 weights under the model's state-dict keys, on rank 0 ({} elsewhere)."""
        with self._state_dict_guard.suspended():
            return _sharded.full_state_dict(self.training_state, self.plan, self.model)

    def close(self) -> None:
        """Release what outlives the process otherwise: the NVMe swap files (also removed at
        exit and when this object is collected; see [Note: swap file lifetime]), and the
        gradient hooks on the parameters, which would keep the engine alive ([Note: gradient
        hook handles]). The engine cannot train after it (``backward`` raises)."""
        self.closed = True
        self.reducer.remove_hooks()
        try:
            if self.offload is not None:
                self.offload.close()
        finally:
            if self.param_offload is not None:
                self.param_offload.close()

    def memory_report(self) -> MemoryReport:
        return measure(self.training_state, secondary_bytes=self.plan.held_bytes(),
                       error_feedback_bytes=self.plan.reduce_scatter.held_bytes())

    def _require_boundary(self) -> None:
        if self.micro_step % self.config.gradient_accumulation_steps or self._backward_since_step:
            raise RuntimeError("state can only be saved on an accumulation boundary, after step()")

    def _after_load(self) -> None:
        """Loaded masters replace the weights: drop gradients, rewrite the parameters exactly."""
        self.zero_grad()
        self.plan.weights_replaced()
        self.sync_params_from_masters()
