"""``bench`` runs from the checkout: it is not installed, so child processes find it through ``PYTHONPATH``.

``pip install zcomm`` ships ``zcomm``, ``zcomm_cuda`` and ``zero_runtime`` only. Every command
that starts ``python -m bench.<suite>`` in a child process (the demo's launcher and its
ranks, the gpu-check stages) gives it :func:`checkout_environment`, so the child imports this
checkout's ``bench`` (and its ``zcomm``) whatever its working directory.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import IO, Mapping, Sequence

REPO = Path(__file__).resolve().parents[2]


def checkout_environment(base: Mapping[str, str]) -> dict[str, str]:
    """``base`` with the checkout first on ``PYTHONPATH`` (what was there stays after it)."""
    env = dict(base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), base.get("PYTHONPATH", "")) if p)
    return env


def run_from_checkout(argv: Sequence[str], log: IO[str] | None = None, **extra: str) -> int:
    """Run ``argv`` with :func:`checkout_environment` plus ``extra``, its output into ``log`` if given; its exit status."""
    env = {**checkout_environment(os.environ), **extra}
    stderr = None if log is None else subprocess.STDOUT
    return subprocess.run(argv, env=env, stdout=log, stderr=stderr, check=False).returncode
