"""The public path ``zero_runtime.export`` (and ``python -m zero_runtime.export``): offline
consolidation of a sharded checkpoint lives in :mod:`zero_runtime.checkpoint.export`; this
module re-exports its public names and runs its command line."""

import sys

from .checkpoint.export import DTYPES, CheckpointError, consolidate, export, main

__all__ = ["export", "consolidate", "main", "CheckpointError", "DTYPES"]

if __name__ == "__main__":
    sys.exit(main())
