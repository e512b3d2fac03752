"""The collectives of the suite, in table order: one spec file each (``bench/collectives/<name>.py``)."""

from __future__ import annotations

from bench.harness.collective import Collective

from . import all_gather, all_gather_q8, all_reduce, all_reduce_q4, all_to_all, reduce_scatter, reduce_scatter_q4

COLLECTIVES: dict[str, Collective] = {
    collective.name: collective
    for collective in (*(spec.COLLECTIVE for spec in (all_gather, reduce_scatter, all_to_all, all_reduce, all_gather_q8,
                                                      reduce_scatter_q4, all_reduce_q4)), all_reduce_q4.COLLECTIVE_G4)
}
ALL_OPS = tuple(COLLECTIVES)
