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

from . import _host_sync
from ._comm_plan import CommPlan
from ._state import TrainingState

FORMAT = "zero_runtime.sharded/1"
META = "meta.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this run (and nothing was changed)."""


def fingerprint(state: TrainingState) -> list[list[Any]]:
    """What must match for shards to be interchangeable: per unit, its parameters' names and
    shapes and its padded size."""
    return [[u.group_index, u.layout.numel, [[n, list(p.shape)] for n, p in zip(u.names, u.params)]]
            for u in state.units]


def rank_state(state: TrainingState, plan: CommPlan) -> dict[str, Any]:
    """This rank's shard of ``state`` as a ``torch.save``-able dict (tensors cloned); with
    an offloaded optimizer, its states read back (from NVMe too) in the same format."""
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
        "counters": {"global_step": state.global_step, "skipped_steps": state.skipped_steps},
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
    if len(masters) != len(state.units) or any(m.shape != (u.layout.shard_numel,) for m, u in zip(masters, state.units)):
        raise CheckpointError("master shard shapes do not match this run")
    groups = saved["optimizer"].get("param_groups", [])
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in state.optimizer.param_groups]:
        raise CheckpointError("optimizer parameter groups do not match this run")
    if state.offload is not None:
        problem = state.offload.state_problem(saved["optimizer"])
        if problem:
            raise CheckpointError(problem)
    return saved


def apply_rank_state(state: TrainingState, saved: dict[str, Any]) -> None:
    """Load a validated ``saved`` into ``state``: masters, optimizer, scaler and counters.
    The caller then writes the masters into the parameters."""
    if state.offload is not None:
        state.offload.load_state_dict(saved["masters"], saved["optimizer"])
    else:
        state.optimizer.load_state_dict(saved["optimizer"])
        with torch.no_grad():
            for unit, master in zip(state.units, saved["masters"]):
                unit.master.copy_(master)
    state.scaler.load_state_dict(saved["scaler"])
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


def save(state: TrainingState, plan: CommPlan, directory: str | os.PathLike) -> None:
    """Write ``state`` to ``directory`` (collective; see [Note: atomic save])."""
    rank = plan.rank
    saved = rank_state(state, plan)
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
                "fingerprint": fingerprint(state), "global_step": state.global_step, "files": infos}
        _write_atomic(root / META, lambda tmp: tmp.write_text(json.dumps(meta, indent=1)))
    plan.barrier()


def _read_rank_state(state: TrainingState, plan: CommPlan, root: Path) -> dict[str, Any]:
    try:
        meta = json.loads((root / META).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{root} holds no complete checkpoint ({META} missing)") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{root / META} is corrupt: {err}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{root / META}: unknown format {meta.get('format')!r}")
    if meta["world_size"] != plan.world_size:
        raise CheckpointError(f"checkpoint {root} was written by {meta['world_size']} ranks, this run has "
                              f"{plan.world_size} (resharding is not supported)")
    if meta["fingerprint"] != fingerprint(state):
        raise CheckpointError(f"checkpoint {root} was written for another model or bucketing")
    info = meta["files"][plan.rank]
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
    return validate_rank_state(state, plan, saved)


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
    apply_rank_state(state, saved)


def full_state_dict(state: TrainingState, plan: CommPlan, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Gather the fp32 masters (exact, never quantized) and unflatten them under every
    state-dict key of ``model`` (both names of a tied parameter); rank 0 gets the dict."""
    full_of: dict[torch.nn.Parameter, torch.Tensor] = {}
    offloaded = state.offload.masters() if state.offload is not None else None
    for unit in state.units:
        master = unit.master.detach() if offloaded is None else offloaded[unit.index].to(plan.device)
        flat = torch.empty(unit.layout.numel, dtype=torch.float32, device=plan.device)
        plan.exact_all_gather(flat, master)
        for param, view in zip(unit.params, unit.layout.views(flat)):
            full_of[param] = view.clone()
    if plan.rank != 0:
        return {}
    out = {}
    for key, value in model.state_dict(keep_vars=True).items():
        out[key] = full_of[value] if value in full_of else value.detach().clone()
    return out
