"""Repeated, interleaved rounds of the training comparison: their order, and what a row reports over them.

``--rounds R`` trains every configuration R times in one launch, each round from the same
seed on the same batches, so that a drift of the machine cannot decide a comparison of
5-10% (why, and the columns a row reports over its rounds: bench/TRAINING.md, "Rounds"): the
median of the round medians with their range, the ratio to the baseline paired per round
(both step times of one ratio from the same round), and whether the rounds' losses agree.

[Note: round order] Round ``r`` (0-based) runs the configurations forward when ``r`` is even
and backward when it is odd: ``A B C``, ``C B A``, ``A B C``, ... A drift that is linear in
time shifts a paired ratio ``A_r / base_r`` in proportion to how far apart ``A`` and ``base``
run inside round ``r``; a backward round has the same distance with the opposite sign, so
over every two rounds the drift cancels for every pair of configurations, not just for
neighbours. (A rotation ``A B C``, ``B C A``, ``C A B`` cancels it only over a multiple of the
number of configurations: six rounds for gpu-bench's six.) An even R is therefore best; with
an odd R the median still sits between a forward and a backward round's ratio. The
boundary between two rounds runs the same configuration twice in a row, which is harmless:
every round rebuilds its engine and has its own warm-up steps.
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from .loop import ConfigResult, RoundRecord

Unit = TypeVar("Unit", bound=Hashable)


@dataclass(frozen=True, kw_only=True)
class RoundPlan:
    """How many rounds, and the baseline configuration of the paired ratios.

    Args:
        rounds: how many times every configuration is trained (>= 1).
        baseline: the configuration every row's paired ratio divides by (one of ``configs``).
        configs: the configurations of the launch, in the order asked for.
    """

    rounds: int
    baseline: str
    configs: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {self.rounds}")
        if self.baseline not in self.configs:
            raise ValueError(
                f"--baseline {self.baseline!r} is not one of the configurations run: {', '.join(self.configs)}"
            )

    def order(self, units: Sequence[Unit], round_index: int) -> list[Unit]:
        """``units`` in the order round ``round_index`` (0-based) trains them (see [Note: round order])."""
        return list(units) if round_index % 2 == 0 else list(reversed(units))


def paired_ratios(steps: Mapping[int, float], base: Mapping[int, float]) -> list[float]:
    """``steps[r] / base[r]`` for every round ``r`` both measured, in round order."""
    return [steps[r] / base[r] for r in sorted(steps) if r in base and base[r] > 0]


def round_steps(row: ConfigResult) -> dict[int, float]:
    """The row's median step time per round number."""
    return {record.round: record.median_step_s for record in row.rounds}


def _loss_max_diff(records: list[RoundRecord]) -> float | None:
    """The largest |difference| of any train or validation loss between a round and the first."""
    if len(records) < 2:
        return None
    first = records[0]
    diffs = [abs(a - b) for other in records[1:] for a, b in zip(first.losses(), other.losses(), strict=True)]
    return max(diffs, default=0.0)


def _median_of(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if len(present) == len(values) and present else None


def combine(
    first: ConfigResult, records: list[RoundRecord], *, tokens_per_step: int, link_bytes_per_s: float | None
) -> ConfigResult:
    """One row over the rounds of a configuration: ``first`` (round 1's row) with the medians
    over ``records`` (every round's, round 1's included) in the step-time and wire columns.

    Losses, validation curve and per-step times stay round 1's (the other rounds' losses are
    compared, not averaged: they must be the same); memory is the largest round's peak.
    """
    assert records and records[0].round == 1, "round 1 is the row's own round"
    median = statistics.median(r.median_step_s for r in records)
    row = replace(
        first,
        median_step_s=median,
        tokens_per_s=tokens_per_step / median,
        min_step_s=min(r.median_step_s for r in records),
        max_step_s=max(r.median_step_s for r in records),
        wire_tx_bytes_per_step=_median_of([r.wire_tx_bytes_per_step for r in records]),
        wire_rx_bytes_per_step=_median_of([r.wire_rx_bytes_per_step for r in records]),
        wire_busiest_bytes_per_step=_median_of([r.wire_busiest_bytes_per_step for r in records]),
        memory_bytes=max((r.memory_bytes for r in records if r.memory_bytes is not None), default=None),
        loss_max_diff=_loss_max_diff(records),
        rounds=records,
    )
    if row.wire_busiest_bytes_per_step is not None and link_bytes_per_s:
        row.wire_time_s = row.wire_busiest_bytes_per_step / link_bytes_per_s
        row.wire_fraction = row.wire_time_s / median
    return row


def attach_ratios(rows: list[ConfigResult], baseline: str) -> None:
    """Set every ok row's paired ratios to ``baseline``'s row of the same model (in place)."""
    bases = {row.model: row for row in rows if row.config == baseline and row.status == "ok"}
    for row in rows:
        base = bases.get(row.model)
        if row.status != "ok" or base is None:
            continue
        ratios = paired_ratios(round_steps(row), round_steps(base))
        row.baseline = baseline
        row.paired_ratios = ratios
        if ratios:
            row.ratio_to_baseline = statistics.median(ratios)
            row.ratio_min, row.ratio_max = min(ratios), max(ratios)
