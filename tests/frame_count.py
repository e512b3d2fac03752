"""The Python functions one call enters on this thread: what the frame-count tests assert on.

Host work per call shows on any machine as the functions a call runs through (C functions
are not counted), where timings would depend on the machine and its load.
"""

from __future__ import annotations

import sys
from typing import Callable


def entered_functions(call: Callable[[], object]) -> list[str]:
    """``file:function`` of every Python function ``call()`` enters, in order (the call's own
    function first)."""
    entered: list[str] = []

    def profile(frame, event, arg) -> None:
        if event == "call":
            entered.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_code.co_name}")

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return entered
