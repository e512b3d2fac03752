"""zcomm: ZeRO++ quantized collectives on torch.distributed.

* :func:`all_gather_q8` (qwZ) and :func:`reduce_scatter_q4` (qgZ): drop-ins for
  ``torch.distributed.all_gather_into_tensor`` / ``reduce_scatter_tensor``; ``async_op=True``
  returns a :class:`Handle`. :func:`reduce_scatter_q4_coalesced` reduces a list of tensors
  (a gradient bucket) as one collective, like ``reduce_scatter_tensor_coalesced``;
  :func:`check_hadamard_block` and :func:`check_first_hop_bits` validate its ``hadamard_block`` and
  ``first_hop_bits`` (for a config that sets them).
* :func:`prepare_all_gather_q8` / :func:`prepare_reduce_scatter_q4_coalesced`: the same
  collectives resolved once for a caller whose shapes never change (a runtime's unit or
  gradient bucket): :class:`PreparedAllGatherQ8` / :class:`PreparedReduceScatterQ4` recheck
  only the tensors on each call.
* :func:`all_reduce_q4`: drop-in for ``torch.distributed.all_reduce`` (in place, AVG by
  default): qgZ's hierarchical INT4 reduce-scatter, then the reduced slices gathered in INT8;
  :func:`prepare_all_reduce_q4` (:class:`PreparedAllReduceQ4`) for fixed shapes.
* :func:`all_gather_into_tensor`, :func:`reduce_scatter_tensor`, :func:`all_reduce`: the unquantized ones, counted;
  :func:`all_gather_hierarchical`: an unquantized all-gather in qwZ's two hops (for payloads
  a caller encoded itself).
* :class:`ErrorFeedback`: LoCo error feedback, an explicit state a caller may pass to
  :func:`reduce_scatter_q4` (the collectives are stateless without it).
* :class:`Topology`: which ranks share a node; :func:`consecutive_group`: hpZ's blocks,
  :func:`block_peers_group`: the same position in every block.
* :func:`comm_stats` / :func:`reset_comm_stats` (:class:`OpStats`): bytes each rank sent,
  intra vs inter node.
* ``zcomm.quant``: the block-quantization ops, :class:`zcomm.quant.QuantSpec` and the wire format.
* ``zcomm.fsdp`` (imported on its own: ``import zcomm.fsdp``): :func:`zcomm.fsdp.enable_zeropp`
  installs qwZ / qgZ as the custom collectives of PyTorch FSDP2 (``fully_shard``) modules.
* ``zcomm.ddp`` (imported on its own: ``import zcomm.ddp``): :func:`zcomm.ddp.quantized_allreduce_hook`,
  a DDP communication hook that averages each gradient bucket with :func:`all_reduce_q4`.

Modules with a leading underscore are internal. The CPU kernels use the rank's share of
threads (``ZCOMM_NUM_THREADS``, else ``torch.get_num_threads()``).
"""

from . import quant
from ._contract import Handle
from ._error_feedback import ErrorFeedback
from ._groups import block_peers_group, consecutive_group
from .all_gather_q8 import PreparedAllGatherQ8, all_gather_q8, prepare_all_gather_q8
from .all_reduce_q4 import PreparedAllReduceQ4, all_reduce_q4, prepare_all_reduce_q4
from .comm_stats import OpStats, comm_stats, reset_comm_stats
from .hierarchical_gather import all_gather_hierarchical
from .plain_collectives import all_gather_into_tensor, all_reduce, reduce_scatter_tensor
from .reduce_scatter_q4 import (
                                PreparedReduceScatterQ4,
                                check_first_hop_bits,
                                check_hadamard_block,
                                prepare_reduce_scatter_q4_coalesced,
                                reduce_scatter_q4,
                                reduce_scatter_q4_coalesced,
)
from .topology import Topology

__all__ = [
    "ErrorFeedback",
    "Handle",
    "OpStats",
    "PreparedAllGatherQ8",
    "PreparedAllReduceQ4",
    "PreparedReduceScatterQ4",
    "Topology",
    "all_gather_hierarchical",
    "all_gather_into_tensor",
    "all_gather_q8",
    "all_reduce",
    "all_reduce_q4",
    "block_peers_group",
    "check_first_hop_bits",
    "check_hadamard_block",
    "comm_stats",
    "consecutive_group",
    "prepare_all_gather_q8",
    "prepare_all_reduce_q4",
    "prepare_reduce_scatter_q4_coalesced",
    "quant",
    "reduce_scatter_q4",
    "reduce_scatter_q4_coalesced",
    "reduce_scatter_tensor",
    "reset_comm_stats",
]
