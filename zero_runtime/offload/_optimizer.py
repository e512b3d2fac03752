"""Optimizer offload (``offload_optimizer.device`` ``cpu`` or ``nvme``): fp32 master weights and
Adam states off the training device, stepped on the CPU by ``cpu_adam``.

The states of this rank are cut into *sub-groups* of at most ``sub_group_size`` master
elements (never spanning two units). Each holds three fp32 arrays: master, ``exp_avg``,
``exp_avg_sq``. With ``device: cpu`` they are tensors in host memory; with ``device: nvme``
they are regions of the rank's swap file (``swap_file``), and the step streams them through
``buffer_count`` host buffers (see [Note: swap pipeline] in ``offload._swap_stream``).

[Note: step during backward] Adam is elementwise, so a unit can be updated as soon as its
own reduced gradient is final, in any order. With ``zcomm_overlap_step`` the optimizer calls
``begin_step`` before the backward of an accumulation boundary, and ``add`` with the units of
each gradient bucket as its reduce-scatter completes (``GradReducer``'s ``on_shards_final``):
their sub-groups' reads, updates and writes then run during the rest of backward, and
``step()`` only drains what is left. This is exact only when nothing the update reads
depends on later gradients: no clipping by the global norm, no overflow skip (``ZeroConfig``
refuses both), and the hyper-parameters taken when ``begin_step`` is called (``step()``
raises if the param groups changed since). A unit's parameters are written while backward
still runs; no autograd node reads them any more (see [Note: last gradient hook of a unit]
in ``comm._grad_reduce``). If backward fails after the first update, the step stays in progress
and the state refuses to be read or stepped until a checkpoint is loaded (``abort_step``).

[Note: gradient copies to the host] On a CUDA run each unit's gradient shard is copied
to host memory (page-locked with ``pin_memory``) with ``non_blocking`` when its unit is
added, and an event recorded behind the copy; the unit's first update waits for that event.
Updates lag the adds: with ``device: cpu`` the sub-groups of one ``add`` are updated at the
next (or at ``end_step``); with ``nvme`` the swap stream holds back the last
``buffer_count - 2`` sub-groups, so only a bucket larger than that updates some of its own.
During backward the host thus waits mostly for copies queued a bucket earlier while the GPU
goes on with the kernels queued since, instead of draining its queue at every bucket as a
synchronous copy would. The device gradient is not freed or zeroed before the update
(``discard`` runs after ``step()``), and any memory the caching allocator reuses is reused
in stream order, after the copy.

The result is bit-identical to the torch optimizer the user gave (``cpu_adam`` replays
torch's single-tensor Adam), so a run with offload trains exactly like one without, and
the state dict has torch's format, interchangeable with an offload-free run's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from .._partition import FlatUnit, optimizer_indices
from ..config import ZeroConfig
from ._params import ParamOffload, resident
from ._swap_stream import SwapStream
from .cpu_adam import AdamHyper, adam_step
from .swap_file import SwapFile, aligned_buffer, round_up

_STATES = ("exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class SubGroup:
    unit: int  # index into the units
    lo: int
    hi: int
    offset: int = 0  # byte offset of its region in the swap file (nvme)

    @property
    def numel(self) -> int:
        return self.hi - self.lo


@dataclass
class _Step:
    """An update in progress: the hyper-parameters it uses and the gradients given so far."""

    hypers: list[AdamHyper]
    grads: dict[int, torch.Tensor] = field(default_factory=dict)  # unit index -> host gradient shard
    copied: dict[int, torch.Event] = field(default_factory=dict)  # unit index -> its gradient copy's event
    stream: SwapStream | None = None  # nvme
    pending: list[SubGroup] = field(default_factory=list)  # cpu: sub-groups of the last add, updated next
    updated: int = 0  # sub-groups updated so far


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """``ValueError`` unless ``optimizer`` is an Adam/AdamW the CPU step reproduces."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        raise ValueError(f"offload_optimizer steps on the CPU with a fused Adam/AdamW; got "
                         f"{type(optimizer).__name__}: use torch.optim.Adam or AdamW, or device 'none'")
    for group in optimizer.param_groups:
        unsupported = [k for k in ("amsgrad", "maximize", "capturable", "differentiable") if group.get(k)]
        unsupported += [k for k in ("lr", "eps", "weight_decay") if isinstance(group[k], torch.Tensor)]
        unsupported += ["betas (tensors)"] if any(isinstance(b, torch.Tensor) for b in group["betas"]) else []
        if unsupported:
            raise ValueError(f"offload_optimizer does not support Adam's {', '.join(unsupported)}")


def _hyper(optimizer: torch.optim.Optimizer, group: int) -> AdamHyper:
    """Read at every step, so learning-rate schedulers acting on the param groups are followed."""
    g = optimizer.param_groups[group]
    decoupled = isinstance(optimizer, torch.optim.AdamW) or bool(g.get("decoupled_weight_decay"))
    return AdamHyper(lr=float(g["lr"]), beta1=float(g["betas"][0]), beta2=float(g["betas"][1]), eps=float(g["eps"]),
                     weight_decay=float(g["weight_decay"]), decoupled=decoupled)


class OptimizerOffload:
    """The offloaded masters and states of ``units``, and their optimizer step."""

    def __init__(self, *, units: list[FlatUnit], optimizer: torch.optim.Optimizer, config: ZeroConfig,
                 rank: int, param_offload: ParamOffload | None = None) -> None:
        """``param_offload``: where the shards live (``offload_param``); a shard written as the
        compute-dtype copy (on a CPU run) is made resident for the step's writes to it."""
        check_optimizer(optimizer)
        offload = config.offload_optimizer
        self.units = units
        self.param_offload = param_offload
        self.optimizer = optimizer
        self.device = offload.device
        self.steps = [0] * len(units)
        pin = offload.pin_memory and torch.cuda.is_available()
        self.subgroups = _cut(units, config.sub_group_size)
        self.compute_copy = [u.shard if u.shard.device.type == "cpu" else
                             torch.empty(u.layout.shard_numel, dtype=u.dtype, pin_memory=pin) for u in units]
        self._pinned = pin
        self.swap: SwapFile | None = None
        self.host: list[dict[str, torch.Tensor]] = []
        self._step: _Step | None = None
        if self.device == "cpu":
            for unit in units:
                master = unit.master.detach().to("cpu", copy=unit.master.device.type != "cpu")
                self.host.append({"master": master.pin_memory() if pin else master,
                                  **{k: torch.zeros_like(master, pin_memory=pin) for k in _STATES}})
        else:
            self._init_swap(offload, config, rank, pin)
        self._by_unit = {u.index: [sg for sg in self.subgroups if sg.unit == u.index] for u in units}
        for unit in units:  # the masters now live here; the device keeps an empty placeholder
            if self.device == "nvme" or unit.master.device.type != "cpu":
                unit.master.data = torch.empty(0, dtype=torch.float32, device=unit.master.device)
            else:
                unit.master.data = self.host[unit.index]["master"]

    def _init_swap(self, offload, config: ZeroConfig, rank: int, pin: bool) -> None:
        offset, placed = 0, []
        for sg in self.subgroups:
            placed.append(SubGroup(sg.unit, sg.lo, sg.hi, offset))
            offset += round_up(12 * sg.numel)
        self.subgroups = placed
        self.swap = SwapFile(offload.nvme_path, rank=rank, nbytes=offset, aio=config.aio)
        largest = max((round_up(12 * sg.numel) for sg in placed), default=round_up(1))
        count = max(1, min(offload.buffer_count, len(placed)))
        self.buffers = [aligned_buffer(largest, pin_memory=pin) for _ in range(count)]
        try:
            for sg in placed:  # initial masters, zero moments
                buffer = self._region(self.buffers[0], sg)
                buffer[0].copy_(self.units[sg.unit].master.detach()[sg.lo : sg.hi])
                buffer[1].zero_()
                buffer[2].zero_()
                self._io(sg, self.buffers[0], write=True).wait()
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _region(buffer: torch.Tensor, sg: SubGroup) -> list[torch.Tensor]:
        """The master, exp_avg and exp_avg_sq views of ``sg`` in a host buffer."""
        floats = buffer[: 12 * sg.numel].view(torch.float32)
        return [floats[i * sg.numel : (i + 1) * sg.numel] for i in range(3)]

    def _io(self, sg: SubGroup, buffer: torch.Tensor, *, write: bool):
        region = buffer[: round_up(12 * sg.numel)]
        return self.swap.write(sg.offset, region) if write else self.swap.read(sg.offset, region)

    # ----- the step -----
    def step(self, grads: list[torch.Tensor]) -> None:
        """Adam on every sub-group with the unscaled fp32 gradient shards ``grads`` (one per
        unit); the compute-dtype copies (``compute_copy``) are written in the same pass."""
        self.begin_step()
        try:
            self.add(self.units, grads)
            self.end_step()
        except BaseException:
            self.abort_step()
            raise

    @property
    def in_step(self) -> bool:
        """Between ``begin_step`` and ``end_step`` (or a failure in between)."""
        return self._step is not None

    def begin_step(self) -> None:
        """Start an update whose units arrive by ``add``; the hyper-parameters are read now
        (see [Note: step during backward])."""
        if self._step is not None:
            raise RuntimeError("an earlier optimizer step was interrupted half-way (an exception during backward "
                               "with zcomm_overlap_step): the optimizer state is partly updated; load a checkpoint")
        for i in range(len(self.units)):
            self.steps[i] += 1
        hypers = [_hyper(self.optimizer, u.group_index) for u in self.units]
        stream = None if self.swap is None else SwapStream(buffers=self.buffers, io=self._io, region=self._region,
                                                           update=self._update)
        self._step = _Step(hypers=hypers, stream=stream)

    def add(self, units: list[FlatUnit], grads: list[torch.Tensor]) -> None:
        """Update ``units`` (each once per step) with their final unscaled gradient shards;
        with NVMe their sub-groups join the swap stream, which runs ahead as far as its
        buffers allow without waiting on reads it just started."""
        step = self._step
        assert step is not None, "add() outside begin_step()/end_step()"
        for unit, grad in zip(units, grads, strict=True):
            assert unit.index not in step.grads, "a unit was updated twice in one step"
            step.grads[unit.index] = self._host_grad(unit, grad)
        subgroups = [sg for unit in units for sg in self._by_unit[unit.index]]
        if step.stream is not None:
            step.stream.add(subgroups)
            return
        ready, step.pending = step.pending, subgroups
        self._update_in_memory(ready)

    def _host_grad(self, unit: FlatUnit, grad: torch.Tensor) -> torch.Tensor:
        """``grad`` on the host: a CUDA gradient is copied asynchronously (see [Note: gradient
        copies to the host]); its update waits for the copy."""
        if grad.device.type == "cpu":
            return grad
        host = torch.empty(grad.shape, dtype=grad.dtype, pin_memory=self._pinned)
        host.copy_(grad, non_blocking=True)
        event = torch.Event(device=grad.device)
        event.record()
        self._step.copied[unit.index] = event
        return host

    def _update_in_memory(self, subgroups: list[SubGroup]) -> None:
        for sg in subgroups:
            state = self.host[sg.unit]
            self._update(sg, *(state[k][sg.lo : sg.hi] for k in ("master", *_STATES)))

    def end_step(self) -> list[str]:
        """Finish the update (every unit must have been added); returns the names of the
        hyper-parameters that changed in the param groups since ``begin_step`` read them."""
        step = self._step
        assert step is not None and len(step.grads) == len(self.units), "end_step() before every unit was added"
        if step.stream is not None:
            step.stream.drain()
        self._update_in_memory(step.pending)
        self._step = None
        now = [_hyper(self.optimizer, u.group_index) for u in self.units]
        return sorted({name for old, new in zip(step.hypers, now, strict=True)
                       for name in (f.name for f in fields(AdamHyper)) if getattr(old, name) != getattr(new, name)})

    def abort_step(self) -> None:
        """After an exception between ``begin_step`` and ``end_step``: a step that updated
        nothing yet is undone; one that did stays in progress, so the next step and every
        read of the state refuse until ``load_state_dict`` replaces it."""
        step = self._step
        if step is None:
            return
        if step.stream is not None:
            step.stream.settle()
        if step.updated == 0:
            self.steps = [n - 1 for n in self.steps]
            self._step = None

    def _update(self, sg: SubGroup, master, exp_avg, exp_avg_sq) -> None:
        step = self._step
        if sg.unit in step.copied:
            step.copied.pop(sg.unit).synchronize()
        unit = self.units[sg.unit]
        writes_shard = self._writes_offloaded_shard(unit)
        if writes_shard:  # read its values back should anything have evicted it part-way
            self.param_offload.fetch(unit, read=sg.lo > 0)
        adam_step(master, step.grads[sg.unit][sg.lo : sg.hi], exp_avg, exp_avg_sq, hyper=step.hypers[sg.unit],
                  step=float(self.steps[sg.unit]), out=self.compute_copy[sg.unit][sg.lo : sg.hi])
        if writes_shard and sg.hi == unit.layout.shard_numel:
            self.param_offload.evict(unit)
        step.updated += 1

    def _require_whole(self, what: str) -> None:
        if self._step is not None:
            raise RuntimeError(f"{what} while an optimizer step is in progress (or was interrupted half-way: "
                               "load a checkpoint)")

    # ----- state (checkpoints) -----
    def unit_states(self) -> list[list[torch.Tensor]]:
        """Per unit: CPU copies of [master, exp_avg, exp_avg_sq]."""
        self._require_whole("the optimizer state was read")
        if self.swap is None:
            return [[s[k].clone() for k in ("master", *_STATES)] for s in self.host]
        out = [[torch.empty(u.layout.shard_numel) for _ in range(3)] for u in self.units]
        for sg in self.subgroups:
            self._io(sg, self.buffers[0], write=False).wait()
            for target, source in zip(out[sg.unit], self._region(self.buffers[0], sg), strict=True):
                target[sg.lo : sg.hi].copy_(source)
        return out

    def masters(self) -> list[torch.Tensor]:
        return [states[0] for states in self.unit_states()]

    def state_dict(self) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """The masters and ``torch.optim.Optimizer.state_dict()`` as the user's optimizer would
        return it without offload (same indices, same tensors)."""
        template = self.optimizer.state_dict()
        index = optimizer_indices(self.optimizer, self.units)
        states = self.unit_states()
        state = {}
        for unit, (_, exp_avg, exp_avg_sq) in zip(self.units, states, strict=True):
            if self.steps[unit.index]:
                state[index[unit.index]] = {"step": torch.tensor(float(self.steps[unit.index])),
                                            "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}
        return [s[0] for s in states], {"state": state, "param_groups": template["param_groups"]}

    def load_state_dict(self, masters: list[torch.Tensor], saved: dict[str, Any]) -> None:
        """Inverse of ``state_dict`` (validated by the caller); hyper-parameters go to the
        torch optimizer's param groups, as its ``load_state_dict`` would put them."""
        if self._step is not None:  # an interrupted step (abort_step): the loaded state replaces it
            if self._step.stream is not None:
                self._step.stream.settle()
            self._step = None
        for group, saved_group in zip(self.optimizer.param_groups, saved["param_groups"], strict=True):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        index = optimizer_indices(self.optimizer, self.units)
        for unit, master in zip(self.units, masters, strict=True):
            entry = saved["state"].get(index[unit.index])
            self.steps[unit.index] = int(entry["step"]) if entry else 0
            values = [master.float()] + [entry[k].float() if entry else torch.zeros_like(master) for k in _STATES]
            if self.swap is None:
                for key, value in zip(("master", *_STATES), values, strict=True):
                    self.host[unit.index][key].copy_(value)
                continue
            for sg in (sg for sg in self.subgroups if sg.unit == unit.index):
                for target, value in zip(self._region(self.buffers[0], sg), values, strict=True):
                    target.copy_(value[sg.lo : sg.hi])
                self._io(sg, self.buffers[0], write=True).wait()
        if self._pinned:  # the last write-back may still read compute_copy (see [Note: write-back copies])
            torch.cuda.synchronize()
        for unit, master in zip(self.units, masters, strict=True):
            with resident(self.param_offload, [unit] if self._writes_offloaded_shard(unit) else [], overwrite=True):
                self.compute_copy[unit.index].copy_(master)

    def _writes_offloaded_shard(self, unit: FlatUnit) -> bool:
        """Whether ``unit``'s compute-dtype copy is its shard (a CPU run) and ``offload_param``
        keeps that shard off the device between uses: writing it needs the shard resident."""
        return (self.param_offload is not None and unit.partitioned
                and self.compute_copy[unit.index] is unit.shard)

    def set_master(self, index: int, value: torch.Tensor) -> None:
        """Overwrite unit ``index``'s fp32 master shard with ``value`` (``GatheredParameters``'
        write-back); its moments and step count are kept, as without offload."""
        self._require_whole("a master was overwritten")
        unit = self.units[index]
        master = value.detach().to("cpu", torch.float32)
        if self.swap is None:
            self.host[index]["master"].copy_(master)
        else:
            for sg in (sg for sg in self.subgroups if sg.unit == index):
                self._io(sg, self.buffers[0], write=False).wait()
                self._region(self.buffers[0], sg)[0].copy_(master[sg.lo : sg.hi])
                self._io(sg, self.buffers[0], write=True).wait()
        if self.compute_copy[index] is not unit.shard:
            self.compute_copy[index].copy_(master)

    def held_bytes(self) -> int:
        """Bytes of masters and Adam states held off the device: the host tensors (``cpu``), or
        the swap file's regions (``nvme``, block-aligned per sub-group)."""
        if self.swap is None:
            return sum(t.nbytes for state in self.host for t in state.values())
        return sum(round_up(12 * sg.numel) for sg in self.subgroups)

    def state_problem(self, saved: dict[str, Any]) -> str | None:
        """Why ``saved`` (an optimizer state dict) cannot be loaded here, or None."""
        index = optimizer_indices(self.optimizer, self.units)
        for unit in self.units:
            entry = saved.get("state", {}).get(index[unit.index])
            if entry is None:
                continue
            shapes = [tuple(entry[k].shape) if isinstance(entry.get(k), torch.Tensor) else None for k in _STATES]
            if shapes != [(unit.layout.shard_numel,)] * 2 or "step" not in entry:
                return f"optimizer state of unit {unit.index} is not Adam's exp_avg/exp_avg_sq/step of its shard"
        return None

    def close(self) -> None:
        """Remove the swap file (see [Note: swap file lifetime]); idempotent."""
        if self.swap is not None:
            self.swap.close()


def _cut(units: list[FlatUnit], size: int) -> list[SubGroup]:
    return [SubGroup(u.index, lo, min(lo + size, u.layout.shard_numel))
            for u in units for lo in range(0, u.layout.shard_numel, size)]
