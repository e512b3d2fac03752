"""The host-cost benchmark, one entry point: ``python -m bench.host_cost [--runtime | --launch-stand-in] [options]``.

What zcomm costs the host, three ways (docs/benchmarks.md; ``--help`` after a mode lists its
options): each call at world size 1 next to its yardstick (:mod:`.calls`, the default), a ZeRO
training step's Python work (:mod:`.runtime`), one kernel launch's Python side without a GPU (:mod:`.launch`).
"""

from __future__ import annotations

import sys

MODES = {"--runtime": "runtime", "--launch-stand-in": "launch"}


def main(argv: list[str] | None = None) -> int:
    import importlib

    argv = list(sys.argv[1:] if argv is None else argv)
    modes = [flag for flag in MODES if flag in argv]
    if len(modes) > 1:
        raise SystemExit(f"python -m bench.host_cost: {' and '.join(modes)} are two modes; give one")
    module = importlib.import_module(f"{__name__}.{MODES[modes[0]] if modes else 'calls'}")
    return module.main([arg for arg in argv if arg not in MODES])
