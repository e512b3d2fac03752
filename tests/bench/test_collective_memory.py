"""bench.collective_memory: its allocation counter on known allocations, and one case on 2 gloo ranks."""

from __future__ import annotations

import pytest
import torch

from bench import collective_memory


def test_live_bytes_counts_what_the_block_creates_until_it_is_freed():
    tracker = collective_memory.LiveBytes()
    before = torch.zeros(1000)  # existed before: never a temporary
    with tracker:
        tracker.reset()
        a = torch.empty(4096, dtype=torch.uint8)
        b = before + 1  # 4000 bytes created by the op
        assert tracker.live == 4096 + 4000
        del a
        assert tracker.live == 4000
        c = torch.empty(100, dtype=torch.uint8)
        del b, c
    assert tracker.peak == 4096 + 4000 and tracker.live == 0


@pytest.mark.multirank  # its ranks start in bench.collective_memory, which the marker's search does not follow
def test_one_case_on_two_ranks_reports_its_peak_against_its_output():
    results = collective_memory.run(world=2, local_size=1, numel=4096, dtype=torch.bfloat16,
                                    names=("all_gather_q8",), timeout=120)
    peak, out_bytes, in_bytes = results["all_gather_q8"]
    assert (out_bytes, in_bytes) == (2 * 4096 * 2, 4096 * 2)
    # at least the payload this rank sends and the payloads it receives (INT8: a byte an element)
    assert out_bytes // 2 < peak < 4 * out_bytes, peak
    assert "| all_gather_q8 |" in collective_memory.table(results)
