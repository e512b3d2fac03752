"""The pipeline depth of the hierarchical collectives: how many chunks overlap their two hops.

qgZ (:mod:`zcomm.reduce_scatter_q4`) and qwZ (:mod:`zcomm.all_gather_q8`) cut their data
into ``k`` chunks and run chunk ``c``'s inter-node hop while chunk ``c + 1``'s intra-node
hop is on the wire (or the other way round). Deeper pipelines overlap more but send more,
smaller messages and pay a fixed cost per chunk; the default takes one stage per
``stage_bytes`` of the collective's full (unsharded) buffer (:data:`STAGE_BYTES` for qgZ's
input, :data:`GATHER_STAGE_BYTES` for qwZ's output), at most :data:`MAX_DEFAULT_STAGES`,
and only when there are two hops to overlap.

qwZ's rule was measured on 2 simulated nodes x 2 ranks (bench/simcluster, 200 Mbit/s, bf16,
the same process alternating depths): 64 MiB gathered took 1376 / 896 / 846 / 809 ms with
1 / 2 / 4 / 8 stages, 16 MiB 263 / 229 / 201 / 205 ms; on loopback 8 stages lost at 8-16
MiB (82-84 ms against 49-65 ms for 1-4 stages) and 4 MiB was fastest unpipelined.
"""

from __future__ import annotations

from .topology import Topology

# qgZ: a 64 MB bf16 input gets 4 stages, anything below 16 MB 1. qwZ: 16 MB gathered gets 4.
STAGE_BYTES = 8 << 20
GATHER_STAGE_BYTES = 4 << 20
MAX_DEFAULT_STAGES = 4


def default_stages(full_nbytes: int, max_stages: int, topology: Topology, *, stage_bytes: int = STAGE_BYTES) -> int:
    """The default stage count for a collective whose full buffer has ``full_nbytes`` bytes
    and that can be cut into at most ``max_stages`` chunks: one per ``stage_bytes``."""
    if topology.num_nodes == 1 or topology.local_size == 1:
        return 1
    return max(1, min(MAX_DEFAULT_STAGES, full_nbytes // stage_bytes, max_stages))


def check_stages(pipeline_stages: int | None) -> None:
    """``ValueError`` unless ``pipeline_stages`` is None or a positive int."""
    if pipeline_stages is None:
        return
    if isinstance(pipeline_stages, bool) or not isinstance(pipeline_stages, int) or pipeline_stages < 1:
        raise ValueError(f"pipeline_stages must be a positive int or None, got {pipeline_stages!r}")
