"""Stage 3's peak memory grows with the prefetch depth by the prefetched units and no more.

2 gloo ranks (2 nodes of 1), qwZ forward gathers and hpZ backward gathers, a stack of
``LAYERS`` equal linear layers, one unit each of ``U`` gathered bytes; every unit is freed
after each use unless the prefetch window already covers its next one, and each unit's
gradients are reduced as soon as they are final (a bucket per unit).

[Note: the prefetch budget] ``stage3_prefetch_bucket_size = d x unit`` lets at most ``d``
units be gathered (or being gathered) ahead of their use ([Note: the window holds kept
units] in ``zero_runtime._stage3``). So at any time at most ``1 + d`` units are gathered (the
one in use and the window), and going from depth 1 to depth ``d`` may raise the peak by
``(d - 1) x U``, the extra prefetched units' buffers, and by nothing else: on CPU qwZ's chains
run one at a time on zcomm's gather worker, and a chain's temporaries (INT8 payloads, scales)
are gone when its gather is done. Memory beyond that outlives its use: a unit buffer (qwZ's
output) or a gather's temporaries held after the unit was freed, or a window that holds more
than ``d`` units. With ``record_stream`` on qwZ's outputs, a freed unit's block stayed
reserved until every gather queued when it was freed had finished, about ``d`` more units at
depth ``d``: the peak grew by about ``2 (d - 1) x U``.

Measured per rank, for a training step's forward and, separately, its backward: the peak of
the gathered unit buffers (their storages are resized, sampled at every torch op) plus every
tensor storage created during the phase (activations, gradients, qwZ's payloads, hpZ's
copies) on the training thread and on zcomm's worker threads ([Note: counting temporaries] in
``bench.collective_memory``). Asserted: at most ``1 + d`` units gathered at once, and
``peak(d) - (d - 1) x U <= peak(1) + U / 2`` (the budget subtracted; half a unit of slack for
when the worker's transient temporaries happen to coincide with the training thread's). The
detector is checked too: the deepest depth again with ``record_stream``'s lifetime emulated
(:func:`_emulate_record_stream`) must break that bound. It caught a real excess: before the
window counted kept units, depth 4 held 6 units in forward and 7 at the turn to backward.
"""

from __future__ import annotations

import gc

import pytest
import torch

from bench.collective_memory import LiveBytes, traced_workers
from zero_harness import run

WORLD = 2
LAYERS = 8
WIDTH = 64
UNIT_NUMEL = WIDTH * WIDTH  # a layer's weight: one unit
UNIT_BYTES = UNIT_NUMEL * 4  # fp32
DEPTHS = (1, 2, 4)
BATCH = 4
ZERO = {"stage": 3, "zero_quantized_weights": True, "zero_hpz_partition_size": 2, "reduce_bucket_size": UNIT_NUMEL,
        "stage3_param_persistence_threshold": 0, "stage3_max_reuse_distance": 0, "zcomm_stage3_fuse_numel": 0}
PHASES = ("forward", "backward")


class _Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class _Peak(LiveBytes):
    """``LiveBytes`` plus the gathered unit buffers, sampled after every op: their storages
    existed before, and their bytes come and go by ``resize_`` ([Note: freeing stage-3
    parameters] in ``zero_runtime._partition``), which creates no storage."""

    def __init__(self, units) -> None:
        super().__init__()
        self.units = units
        self.peak_total = 0  # created storages + gathered units
        self.peak_gathered = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = super().__torch_dispatch__(func, types, args, kwargs)
        gathered = sum(unit.full.untyped_storage().nbytes() for unit in self.units)
        with self._lock:
            self.peak_gathered = max(self.peak_gathered, gathered)
            self.peak_total = max(self.peak_total, self.live + gathered)
        return result

    def existing(self) -> None:
        """Note every tensor alive now as existing: one first seen as an op's output (a unit
        buffer a gather writes) would otherwise count as created by the phase."""
        for obj in gc.get_objects():
            if type(obj) in (torch.Tensor, torch.nn.Parameter):
                self._note(obj, created=False)


def _emulate_record_stream(scheduler) -> None:
    """``record_stream``'s lifetime on CPU: a freed unit's bytes stay reserved until every gather
    in flight when it was freed has been waited for."""
    reserved: list[tuple[torch.Tensor, set[int]]] = []
    free, wait = scheduler._free, scheduler._wait

    def freeing(unit, **kwargs):
        in_flight = {u.index for u in scheduler.units if u.handle is not None and u is not unit}
        block = torch.empty(unit.full_nbytes, dtype=torch.uint8)
        free(unit, **kwargs)
        if in_flight:
            reserved.append((block, in_flight))

    def waiting(unit):
        wait(unit)
        for _, pending in reserved:
            pending.discard(unit.index)
        reserved[:] = [(block, pending) for block, pending in reserved if pending]

    scheduler._free, scheduler._wait = freeing, waiting


def _phase_peaks(rank: int, depth: int, *, record_stream: bool = False) -> dict[str, tuple[int, int]]:
    """phase -> (peak bytes, peak gathered units) of the third training step (the first records
    the trace, the second prepares every unit's gathers)."""
    import zero_runtime

    config = {"zero_optimization": {**ZERO, "stage3_prefetch_bucket_size": depth * UNIT_NUMEL}}
    model, opt = zero_runtime.initialize(_Stack(), torch.optim.SGD, config)
    if record_stream:
        _emulate_record_stream(opt.scheduler)
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randn(BATCH, WIDTH, generator=gen) for _ in range(3)]
    for x in batches[:2]:
        opt.backward(model(x).square().mean())
        opt.step()
    peaks, loss = {}, None
    for phase in PHASES:
        tracker = _Peak(opt.scheduler.units)
        tracker.existing()
        with traced_workers(tracker), tracker:
            tracker.reset()
            base = tracker.live
            if phase == "forward":
                loss = model(batches[2]).square().mean()
            else:
                opt.backward(loss)
        peaks[phase] = (tracker.peak_total - base, tracker.peak_gathered // UNIT_BYTES)
    opt.step()
    return peaks


def _peaks(rank: int, world: int) -> dict:
    assert world == WORLD
    return {"depths": {depth: _phase_peaks(rank, depth) for depth in DEPTHS},
            "record_stream": _phase_peaks(rank, DEPTHS[-1], record_stream=True)}


@pytest.fixture(scope="module")
def peaks():
    return run(_peaks, WORLD, env={"ZCOMM_LOCAL_SIZE": "1"})


def _beyond_budget(peak: int, depth: int, shallow: int) -> int:
    """Bytes of ``peak`` at ``depth`` beyond depth 1's ``shallow`` plus the extra prefetched units
    and the slack ([Note: the prefetch budget]); positive: memory outlives its use."""
    return peak - (depth - 1) * UNIT_BYTES - (shallow + UNIT_BYTES // 2)


def test_at_most_one_unit_in_use_and_the_prefetch_window_are_gathered(peaks):
    for rank, found in enumerate(peaks):
        for depth, phases in found["depths"].items():
            for phase, (_, units) in phases.items():
                assert units <= 1 + depth, (rank, depth, phase, units)
        # prefetching did run: depth 4 holds more than depth 1
        assert found["depths"][4]["forward"][1] > found["depths"][1]["forward"][1]


def test_peak_grows_with_the_depth_by_the_prefetched_units_only(peaks):
    for rank, found in enumerate(peaks):
        for phase in PHASES:
            shallow = found["depths"][1][phase][0]
            for depth in DEPTHS[1:]:
                peak = found["depths"][depth][phase][0]
                assert _beyond_budget(peak, depth, shallow) <= 0, (rank, phase, depth, peak, shallow, UNIT_BYTES)


def test_record_streams_lifetime_breaks_the_budget(peaks):
    """The detector itself: freed units held as ``record_stream`` held them are caught."""
    depth = DEPTHS[-1]
    for found in peaks:
        shallow = found["depths"][1]["forward"][0]
        assert _beyond_budget(found["record_stream"]["forward"][0], depth, shallow) > UNIT_BYTES
