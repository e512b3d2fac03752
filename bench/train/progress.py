"""One progress line per configuration of ``python -m bench.train``, printed by rank 0.

After each step: the step reached, the seconds since the configuration started (construction
included) and the steps still to run at the pace of the steps after the first. On a terminal
the line is rewritten in place; elsewhere (a log) it is printed at the first step, at each
quarter of the run and at the last step, so a log stays short.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class StepProgress:
    """``StepProgress(name, steps)(step)`` after step ``step`` (1-based) of ``steps``."""

    def __init__(self, name: str, steps: int, *, stream: TextIO | None = None, clock=time.perf_counter) -> None:
        self.name, self.steps, self.stream, self.clock = name, steps, stream or sys.stderr, clock
        self.started, self.first_step_at, self.quarter = clock(), 0.0, -1
        self.in_place = bool(getattr(self.stream, "isatty", lambda: False)())

    def __call__(self, step: int) -> None:
        now, quarter = self.clock(), 4 * step // self.steps
        if step == 1:
            self.first_step_at = now  # construction and the first step's one-off costs stay out of the pace
        elif not self.in_place and step != self.steps and quarter == self.quarter:
            return
        self.quarter = quarter
        left = "estimating" if step == 1 else f"~{(now - self.first_step_at) / (step - 1) * (self.steps - step):.0f} s left"
        text = f"[bench.train] {self.name}: step {step} of {self.steps}, {now - self.started:.1f} s so far, {left}"
        self.stream.write(f"\r{text}\033[K" + ("\n" if step == self.steps else "") if self.in_place else text + "\n")
        self.stream.flush()
