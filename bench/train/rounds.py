"""Repeated, interleaved rounds of the training comparison (``--rounds``, bench/TRAINING.md "Rounds"):
their order, and what a row reports over them.

[Note: round order] Round ``r`` (0-based) runs the configurations forward when ``r`` is even
and backward when it is odd: ``A B C``, ``C B A``, ``A B C``, ... A drift that is linear in time
shifts a paired ratio ``A_r / base_r`` in proportion to how far apart ``A`` and ``base`` run
inside round ``r``; a backward round has the same distance with the opposite sign, so over
every two rounds the drift cancels for every pair of configurations (a rotation ``A B C``,
``B C A``, ``C A B`` needs a multiple of the number of configurations: six rounds for
gpu-bench's six). An even R is therefore best. The boundary between two rounds runs one
configuration twice in a row, which is harmless: every round rebuilds its engine and warms up.
"""

from __future__ import annotations

import statistics
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from .loop import ConfigResult

Unit = TypeVar("Unit", bound=Hashable)
# What a round record keeps of its run's row, besides the round (1-based) and the position in its order (0-based).
ROUND_FIELDS = ("median_step_s", "step_times_s", "wire_tx_bytes_per_step", "wire_rx_bytes_per_step",
                "wire_busiest_bytes_per_step", "memory_bytes", "train_losses", "val_curve")  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class RoundPlan:
    """How many rounds, and the baseline of the paired ratios (one of the launch's ``configs``)."""

    rounds: int
    baseline: str
    configs: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.rounds < 1:
            raise ValueError(f"--rounds must be >= 1, got {self.rounds}")
        if self.baseline not in self.configs:
            raise ValueError(f"--baseline {self.baseline!r} is not one of the configurations run: {', '.join(self.configs)}")

    def order(self, units: Sequence[Unit], round_index: int) -> list[Unit]:
        """``units`` in the order round ``round_index`` (0-based) trains them (see [Note: round order])."""
        return list(units) if round_index % 2 == 0 else list(reversed(units))


def round_record(row: ConfigResult, *, round: int, position: int) -> dict[str, Any]:
    assert row.status == "ok" and row.median_step_s is not None, row.status
    return {"round": round, "position": position, **{name: getattr(row, name) for name in ROUND_FIELDS}}


def paired_ratios(steps: Mapping[int, float], base: Mapping[int, float]) -> list[float]:
    """``steps[r] / base[r]`` for every round ``r`` both measured, in round order."""
    return [steps[r] / base[r] for r in sorted(steps) if r in base and base[r] > 0]


def _losses(record: Mapping[str, Any]) -> list[float]:
    """Every loss of a round, train then validation, in a fixed order."""
    return [*record["train_losses"], *(loss for _, loss in record["val_curve"])]


def _median_of(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if len(present) == len(values) and present else None


def combine(first: ConfigResult, records: list[dict[str, Any]], *, tokens_per_step: int,
            link_bytes_per_s: float | None) -> ConfigResult:  # fmt: skip
    """One row over the rounds of a configuration: ``first`` (round 1's row) with the medians over
    ``records`` (every round's) in the step-time and wire columns. Losses, validation curve and
    per-step times stay round 1's (the other rounds' losses are compared, not averaged: they must
    be the same); memory is the largest round's peak; wire time is the busiest node's bytes over
    one node's measured link throughput (None without either)."""
    assert records and records[0]["round"] == 1, "round 1 is the row's own round"
    steps = [r["median_step_s"] for r in records]
    median = statistics.median(steps)
    diffs = [abs(a - b) for other in records[1:] for a, b in zip(_losses(records[0]), _losses(other), strict=True)]
    row = replace(first, median_step_s=median, tokens_per_s=tokens_per_step / median, min_step_s=min(steps),
                  max_step_s=max(steps), rounds=records, loss_max_diff=max(diffs) if diffs else None,
                  **{key: _median_of([r[key] for r in records]) for key in ROUND_FIELDS if key.startswith("wire_")},
                  memory_bytes=max((r["memory_bytes"] for r in records if r["memory_bytes"] is not None), default=None))
    if row.wire_busiest_bytes_per_step is not None and link_bytes_per_s:
        row.wire_time_s = row.wire_busiest_bytes_per_step / link_bytes_per_s
        row.wire_fraction = row.wire_time_s / median
    return row


def round_steps(row: ConfigResult) -> dict[int, float]:
    """The row's median step time per round number."""
    return {record["round"]: record["median_step_s"] for record in row.rounds}


def attach_ratios(rows: list[ConfigResult], baseline: str) -> None:
    """Set every ok row's paired ratios to ``baseline``'s row of the same model (in place)."""
    bases = {row.model: row for row in rows if row.config == baseline and row.status == "ok"}
    for row in (row for row in rows if row.status == "ok" and row.model in bases):
        ratios = paired_ratios(round_steps(row), round_steps(bases[row.model]))
        row.baseline, row.paired_ratios = baseline, ratios
        if ratios:
            row.ratio_to_baseline = statistics.median(ratios)
            row.ratio_min, row.ratio_max = min(ratios), max(ratios)
