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


def test_measure_cuda_reports_the_peak_above_what_was_allocated_before(monkeypatch):
    """The CUDA measurement's arithmetic and order (no GPU here: torch.cuda's statistics are stood in
    for): a warm-up call, then the peak of the measured call above the bytes allocated before it."""
    events, allocated = [], {"now": 1000, "peak": 1000}

    def call():
        events.append("call")
        allocated["peak"] = max(allocated["peak"], allocated["now"] + 512 * len(events))

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: events.append("sync"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: allocated["now"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: allocated.update(peak=allocated["now"]))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: allocated["peak"])
    monkeypatch.setattr(collective_memory.dist, "barrier", lambda group: events.append("barrier"))
    peak = collective_memory.measure_cuda(call, None, torch.device("cuda", 0))
    assert events == ["call", "sync", "barrier", "call", "sync"]
    assert peak == 512 * 4  # the measured call's own peak, not the warm-up's
