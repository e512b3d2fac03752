"""Loading a checkpoint saved at another world size, stage or bucketing.

[Note: resharding a checkpoint] When a checkpoint's ranks, stage or units (``fingerprint``)
differ from the run's, every rank reads all the saved rank files, each checked against
``meta.json`` and loaded with ``weights_only`` as ``consolidate`` does (of a stage-0
checkpoint, whose every file holds the whole state, rank 0's alone: ``saved_shards``),
rebuilds each trained parameter's full fp32 master and each element-wise optimizer state (Adam's
``exp_avg``/``exp_avg_sq``, or any state shaped like a master shard) under the parameter's
name from the saved layouts, and cuts its own shard of each of this run's units out of
them, padding zero (aligned layouts included). Values are copied, never recomputed, so the
masters and states are bit-identical to the saved ones. A scalar state (``step``) belongs to a
whole saved unit; a new unit takes it when all the saved units it draws on agree (they do in
any ZeRO run: every unit steps together), else the load is refused. Hyper-parameters, the
loss scale, the learning-rate schedule and the counters come from rank 0's file. Everything
is built before ``load`` changes anything (see [Note: nothing half-applied]).

What is refused or dropped: a checkpoint whose trained parameters (names, shapes or optimizer
groups) differ from the run's fails with ``CheckpointError`` naming them; LoCo's error
buffers are per gradient bucket and rank, so they are not resharded but reset to zero
with a warning (error feedback restarts from zero, as in a fresh run; the first steps lose
the compensation of the old error only). An offloaded optimizer (``offload_optimizer``)
saves and loads the same format, so it reshards like any other. Each rank holds every
saved file in host memory while it reshards (the whole model's fp32 state, briefly).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from .._flat_buffer import FlatLayout
from .._partition import optimizer_indices
from ._error import CheckpointError


def saved_shards(meta: dict[str, Any]) -> int:
    """How many rank files, from rank 0 on, hold the saved state between them: 1 for stage 0,
    whose every file holds all of it; the world size otherwise (and in checkpoints that
    predate the key)."""
    return meta.get("shards", meta["world_size"])


def _saved_layout(meta: dict[str, Any], entry: list, align: int | None) -> FlatLayout:
    """The layout a saved unit had: ``entry`` is its fingerprint entry (``[..., numel,
    slots]``), ``align`` its recorded alignment (None in checkpoints that predate it: then it
    must have been packed)."""
    numel, slots = entry[-2], entry[-1]
    layout = FlatLayout([shape for _, shape in slots], world_size=saved_shards(meta), align=align or 1,
                        slices=meta["world_size"])
    if layout.numel != numel:
        raise CheckpointError(f"a saved unit of {numel} elements does not match its recorded layout "
                              f"({layout.numel}); the checkpoint predates recorded alignments and cannot be resharded")
    return layout


def saved_unit_views(root: Path, meta: dict[str, Any], files: list[dict[str, Any]], *,
                     frozen: bool = False) -> list[tuple[FlatLayout, list[torch.Tensor]]]:
    """Per saved unit (trained, or with ``frozen`` stage 3's frozen ones), its saved layout and
    its parameters' full values: views of the shards of ``files`` (the first
    ``saved_shards(meta)`` rank files) laid end to end."""
    entries = meta["frozen_fingerprint" if frozen else "fingerprint"]
    aligns = meta.get("frozen_aligns" if frozen else "aligns") or [None] * len(entries)
    field = "frozen_shards" if frozen else "masters"
    out = []
    for i, (entry, align) in enumerate(zip(entries, aligns, strict=True)):
        layout = _saved_layout(meta, entry, align)
        flat = torch.cat([f[field][i] for f in files])
        if flat.numel() != layout.numel:
            raise CheckpointError(f"{root}: the {field} of saved unit {i} hold {flat.numel()} elements, "
                                  f"its layout {layout.numel}")
        out.append((layout, layout.views(flat)))
    return out


def _params(entries: list) -> dict[str, tuple[list[int], int]]:
    return {name: (list(shape), entry[0]) for entry in entries for name, shape in entry[-1]}


def parameter_mismatch(saved_fp: list, run_fp: list) -> str | None:
    """Which trained parameters differ between two fingerprints (name, shape, optimizer group), or None."""
    saved, ours = _params(saved_fp), _params(run_fp)
    problems = [f"{n} (missing from the checkpoint)" for n in ours if n not in saved]
    problems += [f"{n} (only in the checkpoint)" for n in saved if n not in ours]
    problems += [f"{n} (shape/group {saved[n][0]}/{saved[n][1]} in the checkpoint, {ours[n][0]}/{ours[n][1]} here)"
                 for n in ours if n in saved and saved[n] != ours[n]]
    if not problems:
        return None
    shown = ", ".join(problems[:8]) + (f" and {len(problems) - 8} more" if len(problems) > 8 else "")
    return f"the checkpoint was written for another model: {len(problems)} parameter(s) differ: {shown}"


def _optimizer_order(group_indices: list[int]) -> list[int]:
    """Per unit, the index of its master in the optimizer's state dict: the runtime builds the
    optimizer from the masters group by group, in unit order (``_initialize``)."""
    order = sorted(range(len(group_indices)), key=lambda i: (group_indices[i], i))
    index = [0] * len(order)
    for position, unit in enumerate(order):
        index[unit] = position
    return index


def resharded_rank_state(state, plan, root: Path, meta: dict[str, Any], files: list[dict[str, Any]]) -> dict[str, Any]:
    """A ``rank_state``-shaped dict for this rank of this run, built from the saved ``files``
    (the first ``saved_shards(meta)``) of a checkpoint written at another layout (see [Note: resharding a checkpoint]); the caller
    has checked that the trained parameters match (``parameter_mismatch``)."""
    saved_fp = meta["fingerprint"]
    first = files[0]
    groups = first["optimizer"].get("param_groups", [])
    if len(groups) != len(state.optimizer.param_groups):
        raise CheckpointError(f"{root}: {len(groups)} optimizer parameter groups in the checkpoint, "
                              f"{len(state.optimizer.param_groups)} here")
    if (first.get("lr_scheduler") is None) != (state.lr_scheduler is None):
        raise CheckpointError(f"{root}: the checkpoint and this run differ in having a learning-rate scheduler")

    saved_index = _optimizer_order([entry[0] for entry in saved_fp])
    masters: dict[str, torch.Tensor] = {}  # parameter name -> full fp32 master
    elementwise: dict[str, dict[str, torch.Tensor]] = {}  # name -> state key -> full tensor
    scalars: dict[str, dict[str, torch.Tensor] | None] = {}  # name -> its saved unit's scalar states (None: no state)
    for i, (entry, (layout, views)) in enumerate(zip(saved_fp, saved_unit_views(root, meta, files), strict=True)):
        names = [name for name, _ in entry[-1]]
        masters.update(zip(names, views, strict=True))
        entries = [f["optimizer"].get("state", {}).get(saved_index[i]) for f in files]
        if all(e is None for e in entries):
            for name in names:
                scalars[name] = None
            continue
        if any(e is None for e in entries) or any(e.keys() != entries[0].keys() for e in entries):
            raise CheckpointError(f"{root}: the ranks saved different optimizer state keys for unit {i}")
        unit_scalars = {}
        for key, value in entries[0].items():
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(f"{root}: optimizer state {key!r} is not a tensor; it cannot be resharded")
            if value.dim() == 0:
                if any(not torch.equal(e[key], value) for e in entries):
                    raise CheckpointError(f"{root}: the ranks saved different {key!r} for unit {i}")
                unit_scalars[key] = value
                continue
            whole = torch.cat([e[key] for e in entries])
            if whole.shape != (layout.numel,):
                raise CheckpointError(f"{root}: optimizer state {key!r} of unit {i} is neither a scalar nor "
                                      "shaped like the master shards; it cannot be resharded")
            for name, view in zip(names, layout.views(whole), strict=True):
                elementwise.setdefault(name, {})[key] = view
        for name in names:
            scalars[name] = unit_scalars

    new_masters, new_state = [], {}
    for unit, our_index in zip(state.units, optimizer_indices(state.optimizer, state.units), strict=True):
        start, end = unit.shard_range()
        new_masters.append(unit.layout.flatten([masters[n] for n in unit.names], dtype=torch.float32)[start:end].clone())
        drawn = [scalars[n] for n in unit.names]
        if all(d is None for d in drawn):
            continue
        if any(d is None or d.keys() != drawn[0].keys() or any(not torch.equal(d[k], drawn[0][k]) for k in d)
               for d in drawn):
            raise CheckpointError(f"{root}: unit {unit.index} here joins parameters whose saved optimizer steps differ "
                                  f"({', '.join(unit.names[:4])}...); it cannot be resharded")
        entry = {key: value.clone() for key, value in drawn[0].items()}  # Adam increments ``step`` in place
        keys = elementwise.get(unit.names[0], {}).keys()
        if any(elementwise.get(n, {}).keys() != keys for n in unit.names):
            raise CheckpointError(f"{root}: unit {unit.index} here joins parameters with different optimizer states")
        for key in keys:
            full = unit.layout.flatten([elementwise[n][key] for n in unit.names], dtype=elementwise[unit.names[0]][key].dtype)
            entry[key] = full[start:end].clone()
        new_state[our_index] = entry
    current = state.optimizer.state_dict()["param_groups"]
    param_groups = [{**saved, "params": ours["params"]} for saved, ours in zip(groups, current, strict=True)]

    if any(f.get("reduce_scatter") for f in files):
        warnings.warn(f"{root}: LoCo's error-feedback buffers are per gradient bucket and rank and are not resharded; "
                      "they restart from zero", stacklevel=4)
    return {"masters": new_masters, "optimizer": {"state": new_state, "param_groups": param_groups},
            "scaler": first["scaler"], "lr_scheduler": first.get("lr_scheduler"),
            "counters": first["counters"], "reduce_scatter": {}}
