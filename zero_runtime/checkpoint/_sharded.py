"""Sharded checkpoints: one file per rank plus a metadata file, and consolidation.

Layout of a checkpoint directory::

    meta.json           world size, model fingerprint, save tag, size and sha256 of each file
    rank00000.pt ...    that rank's masters, optimizer state, scaler and counters

[Note: atomic save] Rank 0 first deletes ``meta.json``; every rank writes its file under a
temporary name and renames it; after a barrier rank 0 writes ``meta.json`` the same way.
``load`` requires ``meta.json`` and checks every rank file against it (the save tag inside
the file, its size and hash), so a crash at any point leaves either the previous complete
checkpoint or none, never a mix that loads.

[Note: nothing half-applied] Loading validates this rank's file completely, then all ranks
agree through one all-reduce that every rank validated, and only then does any rank change
its state; a failure anywhere raises on every rank with the model untouched. The agreement
flag lives on the plan's device (an NCCL group reduces only CUDA tensors) and is read on the
host once per load (see [Note: host syncs] in ``_host_sync``).

[Note: where loaded state lives] Files are read to the CPU. The masters are then copied
into this run's master shards, and the optimizer state goes through
``torch.optim.Optimizer.load_state_dict``, which places every state tensor as the optimizer
itself would (moments on their parameter's device and dtype; Adam's ``step`` counters stay
on the CPU unless the optimizer is fused or capturable). Loading onto the GPU directly
would move the ``step`` counters there and make torch's non-fused Adam read each one on the
host every step.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

import torch

from .. import _host_sync
from .._state import TrainingState
from ..comm._plan import CommPlan
from ..offload._params import resident
from . import _reshard
from ._error import CheckpointError

FORMAT = "zero_runtime.sharded/1"
META = "meta.json"


def fingerprint(state: TrainingState) -> list[list[Any]]:
    """What must match for shards to be interchangeable: per unit, its parameters' names and
    shapes and its padded size."""
    return [[u.group_index, u.layout.numel, _slots(u)] for u in state.units]


def _slots(unit) -> list[list[Any]]:
    """Names and shapes of a unit's parameters, from its layout: a freed stage-3
    parameter's own ``.shape`` is (0,)."""
    return [[name, list(slot.shape)] for name, slot in zip(unit.names, unit.layout.slots, strict=True)]


def rank_state(state: TrainingState, plan: CommPlan) -> dict[str, Any]:
    """This rank's shard of ``state`` as a ``torch.save``-able dict (tensors cloned), with the
    learning-rate schedule's counter (the learning rate itself is in the optimizer's state);
    with an offloaded optimizer, its states read back (from NVMe too) in the same format."""
    if state.offload is not None:
        masters, optimizer = state.offload.state_dict()
    else:
        masters = [u.master.detach().clone() for u in state.units]
        optimizer = state.optimizer.state_dict()
    return {
        "format": FORMAT,
        "world_size": plan.world_size,
        "rank": plan.rank,
        "stage": state.stage,
        "fingerprint": fingerprint(state),
        "masters": masters,
        "optimizer": optimizer,
        "scaler": state.scaler.state_dict(),
        "lr_scheduler": state.lr_scheduler.state_dict() if state.lr_scheduler is not None else None,
        "counters": {"global_step": state.global_step, "skipped_steps": state.skipped_steps},
        "reduce_scatter": plan.reduce_scatter.state_dict(),  # LoCo's error buffers, {} without
    }


def validate_rank_state(state: TrainingState, plan: CommPlan, saved: Any) -> dict[str, Any]:
    """``saved`` if ``rank_state`` wrote it for this rank of a run like ``state``'s, else ``CheckpointError``."""
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise CheckpointError("not a zero_runtime state dict (missing or unknown 'format')")
    if saved["world_size"] != plan.world_size or saved["rank"] != plan.rank:
        raise CheckpointError(f"state was written by rank {saved['rank']} of {saved['world_size']} ranks; "
                              f"this is rank {plan.rank} of {plan.world_size} (resharding is not supported)")
    if saved["stage"] != state.stage:
        raise CheckpointError(f"state was written at ZeRO stage {saved['stage']}, "
                              f"this run uses stage {state.stage}")
    if saved["fingerprint"] != fingerprint(state):
        raise CheckpointError("state was written for another model or bucketing (parameter names, shapes or "
                              "bucket sizes differ)")
    masters = saved["masters"]
    if len(masters) != len(state.units) or any(m.shape != (u.layout.shard_numel,)
                                               for m, u in zip(masters, state.units, strict=True)):
        raise CheckpointError("master shard shapes do not match this run")
    groups = saved["optimizer"].get("param_groups", [])
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in state.optimizer.param_groups]:
        raise CheckpointError("optimizer parameter groups do not match this run")
    if (saved.get("lr_scheduler") is None) != (state.lr_scheduler is None):
        have = "has" if state.lr_scheduler is not None else "has no"
        raise CheckpointError(f"this run {have} a learning-rate scheduler and the state was saved "
                              f"{'without' if state.lr_scheduler is not None else 'with'} one")
    if state.offload is not None:
        problem = state.offload.state_problem(saved["optimizer"])
        if problem:
            raise CheckpointError(problem)
    return saved


def apply_rank_state(state: TrainingState, plan: CommPlan, saved: dict[str, Any]) -> None:
    """Load a validated ``saved`` into ``state``: masters, optimizer (offloaded or not),
    scaler, counters and the reduce-scatter's state (LoCo's error buffers; checkpoints of a
    runtime without LoCo have none). The caller then writes the masters into the parameters."""
    plan.reduce_scatter.load_state_dict(saved.get("reduce_scatter", {}))
    if state.offload is not None:
        state.offload.load_state_dict(saved["masters"], saved["optimizer"])
    else:
        state.optimizer.load_state_dict(saved["optimizer"])
        with torch.no_grad():
            for unit, master in zip(state.units, saved["masters"], strict=True):
                unit.master.copy_(master)
    state.scaler.load_state_dict(saved["scaler"])
    if state.lr_scheduler is not None:
        state.lr_scheduler.load_state_dict(saved["lr_scheduler"])
    state.global_step = saved["counters"]["global_step"]
    state.skipped_steps = saved["counters"]["skipped_steps"]


def _rank_file(rank: int) -> str:
    return f"rank{rank:05d}.pt"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    write(tmp)
    os.replace(tmp, path)


def model_keys(state: TrainingState, model: torch.nn.Module) -> tuple[dict[str, list], dict[str, torch.Tensor]]:
    """Where each of ``model``'s state-dict keys lives in a checkpoint, for consolidation
    without a process group (``consolidate``): ``["unit", i, slot]`` in the masters of unit
    i, ``["frozen", i, slot]`` in the shards of frozen unit i (both names of a tied
    parameter point at the same slot), or ``["extra"]``: a buffer or an unpartitioned frozen
    parameter, returned as rank 0 holds it (second dict)."""
    where: dict[torch.nn.Parameter, list] = {}
    for kind, units in (("unit", state.units), ("frozen", state.frozen_units)):
        for i, unit in enumerate(units):
            for slot, param in enumerate(unit.params):
                where[param] = [kind, i, slot]
    keys, extras = {}, {}
    for key, value in model.state_dict(keep_vars=True).items():
        if value in where:
            keys[key] = where[value]
        else:
            keys[key] = ["extra"]
            extras[key] = value.detach().clone()
    return keys, extras


def save(state: TrainingState, plan: CommPlan, directory: str | os.PathLike,
         model: torch.nn.Module | None = None) -> None:
    """Write ``state`` to ``directory`` (collective; see [Note: atomic save]). With
    ``model``, also what ``consolidate`` needs to rebuild its whole state dict: every rank's
    frozen shards, and in rank 0's file the buffers and unpartitioned frozen parameters."""
    rank = plan.rank
    saved = rank_state(state, plan)
    saved["frozen_shards"] = []
    for unit in state.frozen_units:
        with resident(state.param_offload, [unit]):
            saved["frozen_shards"].append(unit.shard.detach().clone())
    keys = None
    if rank == 0 and model is not None:
        keys, saved["model_extras"] = model_keys(state, model)
    root = Path(directory)
    tag = plan.broadcast_from_first(uuid.uuid4().hex if rank == 0 else None)
    saved["tag"] = tag
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        (root / META).unlink(missing_ok=True)
    plan.barrier()
    path = root / _rank_file(rank)
    _write_atomic(path, lambda tmp: torch.save(saved, tmp))
    info = {"name": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path)}
    infos = plan.all_gather_objects(info)
    if rank == 0:
        meta = {"format": FORMAT, "tag": tag, "world_size": plan.world_size, "stage": state.stage,
                "shards": _shards(state, plan),
                "fingerprint": fingerprint(state), "global_step": state.global_step, "files": infos,
                "frozen_fingerprint": [[u.layout.numel, _slots(u)] for u in state.frozen_units],
                "aligns": [u.layout.align for u in state.units],
                "frozen_aligns": [u.layout.align for u in state.frozen_units],
                "model_keys": keys}
        _write_atomic(root / META, lambda tmp: tmp.write_text(json.dumps(meta, indent=1)))
    plan.barrier()


def _shards(state: TrainingState, plan: CommPlan) -> int:
    """How many rank files together hold the state: every rank's in stages 1-3, rank 0's alone
    in stage 0, where every rank holds the whole state (see [Note: stage 0] in ``comm._all_reduce``)."""
    return 1 if state.stage == 0 else plan.world_size


def _read_meta(root: Path) -> dict[str, Any]:
    try:
        meta = json.loads((root / META).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{root} holds no complete checkpoint ({META} missing)") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{root / META} is corrupt: {err}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{root / META}: unknown format {meta.get('format')!r}")
    return meta


def _read_rank_file(root: Path, meta: dict[str, Any], rank: int) -> dict[str, Any]:
    """Rank ``rank``'s file, checked against ``meta`` (size, sha256, save tag); tensors only."""
    info = meta["files"][rank]
    path = root / info["name"]
    if not path.exists():
        raise CheckpointError(f"{path} is missing")
    size = path.stat().st_size
    if size != info["bytes"]:
        raise CheckpointError(f"{path} is {size} bytes, the checkpoint recorded {info['bytes']}: truncated or "
                              "overwritten")
    if _sha256(path) != info["sha256"]:
        raise CheckpointError(f"{path} does not match its recorded sha256: corrupt")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a damaged file surfaces as many different torch errors
        raise CheckpointError(f"{path} cannot be read: {err}") from err
    if saved.get("tag") != meta["tag"]:
        raise CheckpointError(f"{path} belongs to another save than {root / META}")
    return saved


def consolidate(directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model's full state dict from a checkpoint, in one process with no process group
    (``python -m zero_runtime.checkpoint.export``): what ``full_state_dict()`` returned when it was
    saved (fp32 masters for trained parameters; frozen ones and buffers in the compute dtype)."""
    root = Path(directory)
    meta = _read_meta(root)
    if meta.get("model_keys") is None:
        raise CheckpointError(f"{root} was saved without the model's keys (by an older zero_runtime); it cannot be "
                              "consolidated offline: load it in a run and call full_state_dict()")
    files = [_read_rank_file(root, meta, rank) for rank in range(_reshard.saved_shards(meta))]
    views = {"unit": [unit for _, unit in _reshard.saved_unit_views(root, meta, files)],
             "frozen": [unit for _, unit in _reshard.saved_unit_views(root, meta, files, frozen=True)]}
    out = {}
    for key, where in meta["model_keys"].items():
        out[key] = files[0]["model_extras"][key] if where[0] == "extra" else views[where[0]][where[1]][where[2]].clone()
    return out


def _same_layout(state: TrainingState, plan: CommPlan, meta: dict[str, Any], ours: list[list[Any]]) -> bool:
    """Whether this rank's saved file is its shard as is (else see [Note: resharding a
    checkpoint]); ``ours`` is this run's ``fingerprint``."""
    aligns = meta.get("aligns")
    return (meta["world_size"] == plan.world_size and meta.get("stage", state.stage) == state.stage
            and meta["fingerprint"] == ours
            and (aligns is None or aligns == [u.layout.align for u in state.units]))


def _read_rank_state(state: TrainingState, plan: CommPlan, root: Path) -> dict[str, Any]:
    meta = _read_meta(root)
    ours = fingerprint(state)
    if _same_layout(state, plan, meta, ours):
        return validate_rank_state(state, plan, _read_rank_file(root, meta, plan.rank))
    problem = _reshard.parameter_mismatch(meta["fingerprint"], ours)
    if problem:  # before reading every rank's file
        raise CheckpointError(f"checkpoint {root}: {problem}")
    files = [_read_rank_file(root, meta, rank) for rank in range(_reshard.saved_shards(meta))]
    saved = _reshard.resharded_rank_state(state, plan, root, meta, files)
    if state.offload is not None:
        problem = state.offload.state_problem(saved["optimizer"])
        if problem:
            raise CheckpointError(problem)
    return saved


def load(state: TrainingState, plan: CommPlan, directory: str | os.PathLike) -> None:
    """Load ``directory`` into ``state`` on every rank, or raise ``CheckpointError`` on every
    rank with ``state`` untouched (collective; see [Note: nothing half-applied])."""
    error: Exception | None = None
    try:
        saved = _read_rank_state(state, plan, Path(directory))
    except CheckpointError as err:
        error = err
    failed = torch.full((1,), 0.0 if error is None else 1.0, device=plan.device)
    plan.all_reduce_sum(failed)
    if error is not None:
        raise error
    if _host_sync.read_flag(failed > 0):
        raise CheckpointError(f"checkpoint {directory} failed validation on another rank; nothing was loaded")
    apply_rank_state(state, plan, saved)


def full_state_dict(state: TrainingState, plan: CommPlan, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gather the fp32 masters (exact, never quantized) and unflatten them under every
    state-dict key of ``model`` (both names of a tied parameter); rank 0 gets the dict.
    Frozen parameters (no master) and buffers come in the compute dtype, stage 3's
    partitioned frozen ones gathered from their shards, the others as rank 0 holds them."""
    full_of: dict[torch.nn.Parameter, torch.Tensor] = {}
    offloaded = state.offload.masters() if state.offload is not None else None
    for unit in state.units + state.frozen_units:
        with resident(state.param_offload, [unit] if unit.frozen else []):
            if unit.frozen:
                source = unit.shard
            else:
                source = unit.master.detach() if offloaded is None else offloaded[unit.index].to(plan.device)
            if unit.layout.world_size == 1:  # one shard, the whole unit (stage 0, or a run of one rank)
                flat = source
            else:
                flat = torch.empty(unit.layout.numel, dtype=source.dtype, device=source.device)
                plan.exact_all_gather(flat, source)
            # copied while resident: an offloaded frozen unit's shard is freed when the block ends
            for param, view in zip(unit.params, unit.layout.views(flat), strict=True):
                full_of[param] = view.clone()
    if plan.rank != 0:
        return {}
    out = {}
    for key, value in model.state_dict(keep_vars=True).items():
        out[key] = full_of[value] if value in full_of else value.detach().clone()
    return out
