"""``import zcomm`` loads no backend: numba, cupy, zcomm_cuda and the backend modules are
imported by the registry only when an op first runs on them (the static import rules, such
as zcomm_cuda being imported by the cuda backend alone, are in tests/test_layering.py)."""

from __future__ import annotations

import subprocess
import sys

from cuda_support import REPO


def test_import_zcomm_loads_no_backend():
    code = (
        "import sys, zcomm, zcomm.quant, zcomm.quant.ops, zcomm.quant.spec, zcomm.quant.wire_format\n"
        "print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in ('numba', 'cupy', 'zcomm_cuda')"
        " or m.startswith('zcomm.quant.backends.'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == []
