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
        self.started = clock()
        self.first_step_at: float | None = None
        self.in_place = bool(getattr(self.stream, "isatty", lambda: False)())
        self._quarters_shown = -1

    def line(self, step: int, now: float) -> str:
        elapsed = now - self.started
        # Steps after the first: construction and the first step's one-off costs stay out of the pace.
        if self.first_step_at is None or step < 2:
            left = "estimating"
        else:
            pace = (now - self.first_step_at) / (step - 1)
            left = f"~{pace * (self.steps - step):.0f} s left"
        return f"[bench.train] {self.name}: step {step} of {self.steps}, {elapsed:.1f} s so far, {left}"

    def __call__(self, step: int) -> None:
        now = self.clock()
        if step == 1:
            self.first_step_at = now
        text = self.line(step, now)
        if self.in_place:
            self.stream.write(f"\r{text}\033[K" + ("\n" if step == self.steps else ""))
        else:
            quarter = 4 * step // self.steps
            if step not in (1, self.steps) and quarter == self._quarters_shown:
                return
            self._quarters_shown = quarter
            self.stream.write(text + "\n")
        self.stream.flush()
