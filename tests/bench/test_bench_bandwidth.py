"""bench.harness.bandwidth against nccl-tests' definitions (doc/PERFORMANCE.md of nccl-tests).

algbw = S / t; busbw = algbw * (n-1)/n for AllGather, ReduceScatter and AlltoAll and
algbw * 2(n-1)/n for AllReduce, with S the AllGather output and the ReduceScatter input.
"""

import pytest

from bench.harness.bandwidth import algbw_gbps, bus_factor, busbw_gbps, ring_internode_bytes


def test_algbw_is_bytes_per_second_in_decimal_gigabytes():
    assert algbw_gbps(2_000_000_000, 0.5) == pytest.approx(4.0)


@pytest.mark.parametrize("kind", ["all_gather", "reduce_scatter", "all_to_all"])
@pytest.mark.parametrize("n", [1, 2, 4, 8, 16])
def test_ring_factor_is_n_minus_1_over_n(kind, n):
    assert bus_factor(kind, n) == pytest.approx((n - 1) / n)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_all_reduce_factor_is_twice_the_ring(n):
    assert bus_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)


def test_nccl_tests_example_allgather_on_8_ranks():
    # 1 GiB gathered in 10 ms on 8 ranks: algbw = 107.37 GB/s, busbw = 7/8 of it.
    size = 1 << 30
    assert algbw_gbps(size, 0.01) == pytest.approx(107.374182, rel=1e-6)
    assert busbw_gbps("all_gather", size, 0.01, 8) == pytest.approx(107.374182 * 7 / 8, rel=1e-6)


def test_single_rank_moves_nothing_over_the_bus():
    assert busbw_gbps("reduce_scatter", 1 << 20, 1e-3, 1) == 0.0


@pytest.mark.parametrize(
    ("num_nodes", "local_size", "expected"),
    [(1, 4, 0.0), (2, 1, 1.0), (2, 2, 1.5), (4, 2, 3.5), (3, 3, 3 * 8 / 9)],
)
def test_ring_internode_bytes(num_nodes, local_size, expected):
    # A node-major ring: each of its `num_nodes` node-crossing links carries (n-1)/n of S.
    assert ring_internode_bytes(1000, num_nodes, local_size) == pytest.approx(1000 * expected)


def test_bad_arguments_are_rejected():
    with pytest.raises(ValueError, match="kind"):
        bus_factor("broadcast", 4)
    with pytest.raises(ValueError, match="nranks"):
        bus_factor("all_gather", 0)
    with pytest.raises(TypeError, match="nranks"):
        bus_factor("all_gather", 2.0)
    with pytest.raises(ValueError, match="seconds"):
        algbw_gbps(1, 0.0)
