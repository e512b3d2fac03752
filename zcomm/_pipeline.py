"""The pipeline depth of the hierarchical collectives: how many chunks overlap their two hops.

qgZ (:mod:`zcomm.reduce_scatter_q4`) and qwZ (:mod:`zcomm.all_gather_q8`) cut their data
into ``k`` chunks and run chunk ``c``'s inter-node hop while chunk ``c + 1``'s intra-node
hop is on the wire (or the other way round). Deeper pipelines overlap more but send more,
smaller messages and pay a fixed cost per chunk; the default takes one stage per
:data:`STAGE_BYTES` of the collective's full (unsharded) buffer, at most
:data:`MAX_DEFAULT_STAGES`, and only when there are two hops to overlap.
"""

from __future__ import annotations

from .topology import Topology

# A 64 MB bf16 buffer gets 4 stages; anything below 16 MB gets 1.
STAGE_BYTES = 8 << 20
MAX_DEFAULT_STAGES = 4


def default_stages(full_nbytes: int, max_stages: int, topology: Topology) -> int:
    """The default stage count for a collective whose full buffer has ``full_nbytes`` bytes
    and that can be cut into at most ``max_stages`` chunks."""
    if topology.num_nodes == 1 or topology.local_size == 1:
        return 1
    return max(1, min(MAX_DEFAULT_STAGES, full_nbytes // STAGE_BYTES, max_stages))


def check_stages(pipeline_stages: int | None) -> None:
    """``ValueError`` unless ``pipeline_stages`` is None or a positive int."""
    if pipeline_stages is None:
        return
    if isinstance(pipeline_stages, bool) or not isinstance(pipeline_stages, int) or pipeline_stages < 1:
        raise ValueError(f"pipeline_stages must be a positive int or None, got {pipeline_stages!r}")
