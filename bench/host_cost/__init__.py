"""The host-cost benchmark, one entry point: ``python -m bench.host_cost [MODE] [options]``.

What one zcomm call costs the host, next to torch's call for the same data, measured three
ways (``--help`` after a mode lists its options):

* default (:mod:`.calls`): the ops, the collectives, the prepared calls and the FSDP2
  adapter's comms at world size 1, host enqueue and synchronized time per call, each next
  to its yardstick (``clone``, torch's collective, the call it prepares), under each CUDA
  kernel launcher with ``--launcher cupy,driver``; targets marked PASS or MISS;
* ``--runtime`` (:mod:`.runtime`): a ZeRO training step's Python work per configuration
  (calls per step by phase and thread, step times in alternating rounds);
* ``--launch-stand-in`` (:mod:`.launch`): the Python side of one kernel launch per launcher
  on a machine without a GPU (the driver replaced by a C no-op).
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
