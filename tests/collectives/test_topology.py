"""Topology construction and validation (detection from the environment runs in test_collectives)."""

import pytest

from zcomm import Topology
from zcomm.reduce_scatter_q4 import MAX_DEFAULT_STAGES, STAGE_BYTES, default_pipeline_stages


def test_explicit_local_size():
    topo = Topology(world_size=6, local_size=3)
    assert topo.num_nodes == 2
    assert [topo.node_of(r) for r in range(6)] == [0, 0, 0, 1, 1, 1]
    assert [topo.local_rank_of(r) for r in range(6)] == [0, 1, 2, 0, 1, 2]
    assert list(topo.node_ranks(1)) == [3, 4, 5]
    assert list(topo.local_peers(2)) == [2, 5]
    assert topo.same_node(3, 5) and not topo.same_node(2, 3)


def test_of_ranks_lays_out_a_subgroup():
    topo = Topology(world_size=6, local_size=3)
    assert topo.of_ranks(range(1, 6, 3)) == Topology(world_size=2, local_size=1)  # one rank per node
    assert topo.of_ranks([3, 4, 5, 0, 1, 2]) == Topology(world_size=6, local_size=3)  # nodes in another order
    assert topo.of_ranks([4, 5]) == Topology(world_size=2, local_size=2)
    with pytest.raises(ValueError, match="unequal numbers of ranks"):
        topo.of_ranks([0, 1, 3])


def test_world_not_divisible_by_local_size():
    with pytest.raises(ValueError, match="not divisible by the local size 3"):
        Topology(world_size=4, local_size=3)


@pytest.mark.parametrize("kwargs", [dict(world_size=0, local_size=1), dict(world_size=2, local_size=0)])
def test_sizes_must_be_positive(kwargs):
    with pytest.raises(ValueError, match=">= 1"):
        Topology(**kwargs)


def test_positional_construction_is_rejected():
    with pytest.raises(TypeError):
        Topology(4, 2)


def test_from_node_ids():
    assert Topology.from_node_ids(["b", "b", "a", "a"]) == Topology(world_size=4, local_size=2)
    assert Topology.from_node_ids([7, 8, 9]) == Topology(world_size=3, local_size=1)


def test_from_node_ids_rejects_interleaved_nodes():
    with pytest.raises(ValueError, match="not node-major.*'a'"):
        Topology.from_node_ids(["a", "b", "a", "b"])


def test_from_node_ids_rejects_unequal_nodes():
    with pytest.raises(ValueError, match=r"unequal numbers of ranks: \{'a': 3, 'b': 1\}"):
        Topology.from_node_ids(["a", "a", "a", "b"])


def test_default_pipeline_stages_rule():
    two_by_two = Topology(world_size=4, local_size=2)
    assert default_pipeline_stages(64 << 20, 1 << 24, two_by_two) == MAX_DEFAULT_STAGES
    assert default_pipeline_stages(STAGE_BYTES * 2, 1 << 20, two_by_two) == 2
    assert default_pipeline_stages(1000, 250, two_by_two) == 1
    # nothing to overlap with a single hop
    assert default_pipeline_stages(64 << 20, 1 << 24, Topology(world_size=4, local_size=4)) == 1
    assert default_pipeline_stages(64 << 20, 1 << 24, Topology(world_size=4, local_size=1)) == 1
