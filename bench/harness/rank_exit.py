"""How a benchmark rank ends once its work is done: ``leave(code)``.

[Note: leaving without finalization] A rank that returns normally tears its process groups
down during interpreter finalization (the model, FSDP2's DeviceMesh and zcomm's subgroup
caches can hold them until then). gloo's worker threads and the store's threads are C++
threads that may still need the GIL for a last tensor release at that moment, and a thread
that asks for the GIL during finalization is made to exit, which aborts the whole process
("terminate called without an active exception", exit 134) after all of its work succeeded
(about once per full test run). So a finished rank flushes its output and leaves with
``os._exit``, skipping finalization, as the test harness's ranks do (see [Note: teardown] in
``tests/spawn_harness.py``). A rank must therefore close what outlives it itself (``opt.close()``
for NVMe swap files) before calling this.
"""

from __future__ import annotations

import os
import sys
from typing import NoReturn


def leave(code: int = 0) -> NoReturn:
    """Flush stdout and stderr, then end the process with ``code`` without finalizing the interpreter."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing left to save
            pass
    os._exit(code)
