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
host once per load (see [Note: host syncs] in ``host_sync``).

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
from typing import TYPE_CHECKING, Any

import torch

from . import host_sync

if TYPE_CHECKING:
    from .engine import ZeroOptimizer

FORMAT = "zero_runtime.sharded/1"
META = "meta.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into this run (and nothing was changed)."""


def fingerprint(opt: "ZeroOptimizer") -> list[list[Any]]:
    """What must match for shards to be interchangeable: per unit, its parameters' names and
    shapes and its padded size."""
    return [[u.group_index, u.layout.numel, [[n, list(p.shape)] for n, p in zip(u.names, u.params)]]
            for u in opt.units]


def rank_state(opt: "ZeroOptimizer") -> dict[str, Any]:
    if opt.micro_step % opt.config.gradient_accumulation_steps or opt._backward_since_step:
        raise RuntimeError("state can only be saved on an accumulation boundary, after step()")
    return {
        "format": FORMAT,
        "world_size": opt.plan.world_size,
        "rank": opt.plan.rank,
        "stage": opt.config.stage,
        "fingerprint": fingerprint(opt),
        "masters": [u.master.detach().clone() for u in opt.units],
        "optimizer": opt.optimizer.state_dict(),
        "scaler": opt.scaler.state_dict(),
        "counters": {"global_step": opt.global_step, "skipped_steps": opt.skipped_steps},
    }


def validate_rank_state(opt: "ZeroOptimizer", state: Any) -> dict[str, Any]:
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError("not a zero_runtime state dict (missing or unknown 'format')")
    if state["world_size"] != opt.plan.world_size or state["rank"] != opt.plan.rank:
        raise CheckpointError(f"state was written by rank {state['rank']} of {state['world_size']} ranks; "
                              f"this is rank {opt.plan.rank} of {opt.plan.world_size} (resharding is not supported)")
    if state["stage"] != opt.config.stage:
        raise CheckpointError(f"state was written at ZeRO stage {state['stage']}, "
                              f"this run uses stage {opt.config.stage}")
    if state["fingerprint"] != fingerprint(opt):
        raise CheckpointError("state was written for another model or bucketing (parameter names, shapes or "
                              "bucket sizes differ)")
    masters = state["masters"]
    if len(masters) != len(opt.units) or any(m.shape != u.master.shape for m, u in zip(masters, opt.units)):
        raise CheckpointError("master shard shapes do not match this run")
    groups = state["optimizer"].get("param_groups", [])
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in opt.optimizer.param_groups]:
        raise CheckpointError("optimizer parameter groups do not match this run")
    return state


def apply_rank_state(opt: "ZeroOptimizer", state: dict[str, Any]) -> None:
    opt.optimizer.load_state_dict(state["optimizer"])
    with torch.no_grad():
        for unit, master in zip(opt.units, state["masters"]):
            unit.master.copy_(master)
    opt.scaler.load_state_dict(state["scaler"])
    opt.global_step = state["counters"]["global_step"]
    opt.skipped_steps = state["counters"]["skipped_steps"]
    opt.zero_grad()
    opt.sync_params_from_masters()


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


def save(opt: "ZeroOptimizer", directory: str | os.PathLike) -> None:
    rank = opt.plan.rank
    state = rank_state(opt)
    root = Path(directory)
    tag = opt.plan.broadcast_from_first(uuid.uuid4().hex if rank == 0 else None)
    state["tag"] = tag
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        (root / META).unlink(missing_ok=True)
    opt.plan.barrier()
    path = root / _rank_file(rank)
    _write_atomic(path, lambda tmp: torch.save(state, tmp))
    info = {"name": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path)}
    infos = opt.plan.all_gather_objects(info)
    if rank == 0:
        meta = {"format": FORMAT, "tag": tag, "world_size": opt.plan.world_size, "stage": opt.config.stage,
                "fingerprint": fingerprint(opt), "global_step": opt.global_step, "files": infos}
        _write_atomic(root / META, lambda tmp: tmp.write_text(json.dumps(meta, indent=1)))
    opt.plan.barrier()


def _read_rank_state(opt: "ZeroOptimizer", root: Path) -> dict[str, Any]:
    try:
        meta = json.loads((root / META).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{root} holds no complete checkpoint ({META} missing)") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{root / META} is corrupt: {err}") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{root / META}: unknown format {meta.get('format')!r}")
    if meta["world_size"] != opt.plan.world_size:
        raise CheckpointError(f"checkpoint {root} was written by {meta['world_size']} ranks, this run has "
                              f"{opt.plan.world_size} (resharding is not supported)")
    if meta["fingerprint"] != fingerprint(opt):
        raise CheckpointError(f"checkpoint {root} was written for another model or bucketing")
    info = meta["files"][opt.plan.rank]
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
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a damaged file surfaces as many different torch errors
        raise CheckpointError(f"{path} cannot be read: {err}") from err
    if state.get("tag") != meta["tag"]:
        raise CheckpointError(f"{path} belongs to another save than {root / META}")
    return validate_rank_state(opt, state)


def load(opt: "ZeroOptimizer", directory: str | os.PathLike) -> None:
    error: Exception | None = None
    try:
        state = _read_rank_state(opt, Path(directory))
    except CheckpointError as err:
        error = err
    failed = torch.full((1,), 0.0 if error is None else 1.0, device=opt.plan.device)
    opt.plan.all_reduce_sum(failed)
    if error is not None:
        raise error
    if host_sync.read_flag(failed > 0):
        raise CheckpointError(f"checkpoint {directory} failed validation on another rank; nothing was loaded")
    apply_rank_state(opt, state)


def full_state_dict(opt: "ZeroOptimizer") -> dict[str, torch.Tensor]:
    """Gather the fp32 masters (exact, never quantized) and unflatten them under every
    state-dict key of the model (both names of a tied parameter); rank 0 gets the dict."""
    full_of: dict[torch.nn.Parameter, torch.Tensor] = {}
    for unit in opt.units:
        flat = torch.empty(unit.layout.numel, dtype=torch.float32, device=unit.master.device)
        opt.plan.exact_all_gather(flat, unit.master.detach())
        for param, view in zip(unit.params, unit.layout.views(flat)):
            full_of[param] = view.clone()
    if opt.plan.rank != 0:
        return {}
    out = {}
    for key, value in opt.model.state_dict(keep_vars=True).items():
        out[key] = full_of[value] if value in full_of else value.detach().clone()
    return out
