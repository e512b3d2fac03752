"""ZeRO++ inside PyTorch FSDP2: :func:`enable_zeropp` installs zcomm's collectives on ``fully_shard`` modules.

FSDP2 gathers each unit's weights with one flat all-gather and reduces its gradients with
one flat reduce-scatter, through comm objects a module can replace
(``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``, per module, not
recursive). :func:`enable_zeropp` gives every ``FSDPModule`` in a tree its own pair:

* :class:`ZeroppAllGather`: qwZ, :func:`zcomm.all_gather_q8` (blocked INT8, two hops) for
  the gathers on the unit's shard group; the unquantized, counted
  :func:`zcomm.all_gather_into_tensor` for the rest (see below);
* :class:`ZeroppReduceScatter`: qgZ, :func:`zcomm.reduce_scatter_q4` (INT4, two hops, fp32
  reduction) for ``AVG``, ``SUM`` and ``PREMUL_SUM`` (FSDP2's three ops); the counted
  :func:`zcomm.reduce_scatter_tensor` when gradients are not quantized.

hpZ is FSDP2's own: ``fully_shard(..., reshard_after_forward=<ranks per node>)`` keeps each
unit's weights sharded inside the node after forward, so the backward all-gather runs on a
node-local group. Those gathers copy weights that qwZ already quantized in forward, and
stay unquantized (counted as ``all_gather_into_tensor``): quantizing them again would add
a second rounding and save no inter-node traffic.

Gathers that cannot be quantized are counted and warned about once per module, never
silently swapped: FSDP2 gathers a unit whose all-gather inputs have several dtypes (float8
training, a frozen parameter of another dtype) as one ``uint8`` buffer, and the split
sizes needed to quantize its pieces are not passed to the comm; fp64 has no quantized form.

Results: an ``async_op=True`` quantized gather returns a real ``torch.distributed.Work``
whose ``wait()`` completes zcomm's chain (FSDP2 waits only on ``Work`` instances). The
quantization blocks run across parameter boundaries of the flat buffer (``group_size``
elements each, zcomm's defaults when None): a LayerNorm weight near 1.0 next to small
Linear weights shares a scale with them in at most one block per boundary.

HSDP (a 2-D mesh) is rejected: FSDP2's replicate all-reduce is not replaceable.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import nn

from ._fsdp_compat import AllGather, FSDPModule, ReduceScatter, as_work, torch_problem
from .all_gather_q8 import all_gather_q8
from .plain_collectives import all_gather_into_tensor, reduce_scatter_tensor
from .quant import SUPPORTED_DTYPES
from .reduce_scatter_q4 import reduce_scatter_q4
from .topology import Topology

__all__ = ["ZeroppAllGather", "ZeroppReduceScatter", "enable_zeropp"]

GroupSize = int | Literal["tensor"] | None


class _GroupTopologies:
    """The topology of the unit's shard group, and of its subgroups (FSDP2's hpZ groups) derived from it."""

    def __init__(self, shard_group: dist.ProcessGroup, topology: Topology) -> None:
        self.shard_group = shard_group
        self._found: weakref.WeakKeyDictionary[dist.ProcessGroup, Topology] = weakref.WeakKeyDictionary()
        self._found[shard_group] = topology

    def of(self, group: dist.ProcessGroup) -> Topology:
        if group not in self._found:
            shard_topology = self._found[self.shard_group]
            shard_ranks = [dist.get_group_rank(self.shard_group, g) for g in dist.get_process_group_ranks(group)]
            self._found[group] = Topology.from_node_ids([shard_topology.node_of(r) for r in shard_ranks])
        return self._found[group]


class _WarnOnce:
    """One warning per module and reason for a collective that could not be quantized."""

    def __init__(self, module_name: str) -> None:
        self._module_name = module_name
        self._seen: set[str] = set()

    def __call__(self, what: str, reason: str) -> None:
        if reason not in self._seen:
            self._seen.add(reason)
            warnings.warn(
                f"zcomm.fsdp: {what} of module {self._module_name!r} is not quantized ({reason}); it runs "
                "unquantized and is counted in zcomm.comm_stats() as such",
                RuntimeWarning,
                stacklevel=3,
            )


class _ZeroppComm:
    """What both adapters share: their unit's groups and settings, and FSDP2's ``allocate``."""

    def __init__(
        self, topologies: _GroupTopologies, *, quantized: bool, group_size: GroupSize, module_name: str
    ) -> None:
        self._topologies = topologies
        self._quantized = quantized
        self._group_size = group_size
        self._warn = _WarnOnce(module_name)

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Buffers where FSDP2 asks for them: on the device of the data they serve."""
        return torch.empty(*size, dtype=dtype, device=device)


class ZeroppAllGather(_ZeroppComm, AllGather):
    """FSDP2's all-gather of one unit: qwZ on the shard group, unquantized (counted) elsewhere."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> dist.Work | None:
        topology = self._topologies.of(group)
        if self._quantized and group is self._topologies.shard_group:
            if input_tensor.dtype in SUPPORTED_DTYPES:
                result = all_gather_q8(
                    output_tensor, input_tensor, group, async_op, group_size=self._group_size, topology=topology
                )
                return as_work(result)
            if input_tensor.dtype == torch.uint8:
                self._warn("weight all-gather", "parameters of several dtypes, gathered as one uint8 buffer")
            else:
                self._warn("weight all-gather", f"no quantized form: {input_tensor.dtype}")
        return all_gather_into_tensor(output_tensor, input_tensor, group, async_op, topology=topology)


class ZeroppReduceScatter(_ZeroppComm, ReduceScatter):
    """FSDP2's gradient reduce-scatter of one unit: qgZ, or the unquantized (counted) collective."""

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: dist.ReduceOp,
        async_op: bool = False,
    ) -> dist.Work | None:
        topology = self._topologies.of(group)
        if self._quantized:
            if input_tensor.dtype in SUPPORTED_DTYPES:
                result = reduce_scatter_q4(
                    output_tensor, input_tensor, op, group, async_op, group_size=self._group_size, topology=topology
                )
                return as_work(result)
            self._warn("gradient reduce-scatter", f"no quantized form: {input_tensor.dtype}")
        return reduce_scatter_tensor(output_tensor, input_tensor, op, group, async_op, topology=topology)


def enable_zeropp(
    module: nn.Module,
    *,
    quantized_weights: bool = True,
    quantized_gradients: bool = True,
    group_size: GroupSize = None,
    topology: Topology | None = None,
) -> None:
    """Install zcomm's collectives on ``module`` and every ``FSDPModule`` below it (after ``fully_shard``).

    Collective: every rank of the shard groups calls it, in the same order. Calling it again
    replaces the collectives with ones of the new settings; with both ``quantized_*`` False,
    FSDP2 trains bit for bit as without it, with its traffic counted in :func:`zcomm.comm_stats`.

    Args:
        module: a module that is, or contains, an ``FSDPModule`` (from ``fully_shard``).
        quantized_weights: qwZ, INT8 all-gather of the weights on each unit's shard group.
        quantized_gradients: qgZ, INT4 two-hop reduce-scatter of the gradients.
        group_size: elements per quantization scale for both (see :func:`zcomm.all_gather_q8`
            and :func:`zcomm.reduce_scatter_q4`; None: zcomm's defaults).
        topology: which ranks of the shard group share a node (default:
            :meth:`zcomm.Topology.detect` on that group).

    Raises:
        ValueError: the installed torch has no supported FSDP2 comm API; ``module`` holds no
            ``FSDPModule``; a module is sharded on a 2-D mesh (HSDP), whose replicate
            all-reduce FSDP2 does not let anyone replace.
    """
    problem = torch_problem()
    if problem is not None:
        raise ValueError(problem)
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    for name, flag in (("quantized_weights", quantized_weights), ("quantized_gradients", quantized_gradients)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {flag!r}")
    units = [(name, sub) for name, sub in module.named_modules() if isinstance(sub, FSDPModule)]
    if not units:
        raise ValueError(f"{type(module).__name__} holds no FSDPModule: apply fully_shard before enable_zeropp")
    groups = [(name, sub, _shard_group(name, sub)) for name, sub in units]
    topologies: dict[dist.ProcessGroup, _GroupTopologies] = {}
    for name, sub, group in groups:
        if group is None:  # a unit with no parameters of its own communicates nothing
            continue
        if group not in topologies:
            topologies[group] = _GroupTopologies(group, topology if topology is not None else Topology.detect(group))
        label = name or type(sub).__name__
        common = dict(group_size=group_size, module_name=label)
        sub.set_custom_all_gather(ZeroppAllGather(topologies[group], quantized=quantized_weights, **common))
        sub.set_custom_reduce_scatter(ZeroppReduceScatter(topologies[group], quantized=quantized_gradients, **common))


def _shard_group(name: str, unit: nn.Module) -> dist.ProcessGroup | None:
    """The process group ``unit``'s own parameters are sharded on (None if it has none); ValueError for HSDP."""
    inner = [sub for sub in unit.modules() if sub is not unit and isinstance(sub, FSDPModule)]
    nested = {id(p) for sub in inner for p in sub.parameters()}
    own = [p for p in unit.parameters() if id(p) not in nested]
    if not own:
        return None
    mesh = own[0].device_mesh
    if mesh.ndim != 1:
        raise ValueError(
            f"module {name or type(unit).__name__!r} is sharded on a {mesh.ndim}-D mesh (HSDP): FSDP2's replicate "
            "all-reduce cannot be replaced, so zcomm.fsdp supports 1-D meshes only"
        )
    return mesh.get_group()
