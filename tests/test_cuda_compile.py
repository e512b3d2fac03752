"""Every CUDA source compiles with the machine's nvcc, with the run-time compile's flags.

Two forms per source and architecture: the ``.cu`` file as it sits in ``kernels/`` and the
single translation unit the loader hands NVRTC (headers inlined by
:func:`zcomm_cuda.loader.expand_includes`). The PTX must define every kernel the
launchers ask for and, as the wire format requires, contain no approximate division, no
flush-to-zero and no fused multiply-add.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from cuda_support import NVCC, requires_nvcc
from zcomm_cuda.loader import KERNEL_DIR, KERNEL_SOURCES, NVRTC_OPTIONS, expand_includes

pytestmark = requires_nvcc

ARCHES = ("sm_80", "sm_90")
TAGS = ("f32", "bf16", "f16")
EXPECTED_KERNELS = {
    "quantize.cu": [f"zc_quantize_{t}_int{b}" for t in TAGS for b in (8, 4)],
    "reorder_quantize.cu": [f"zc_reorder_quantize_{t}_int{b}" for t in TAGS for b in (8, 4)],
    "dequantize.cu": [f"zc_dequantize_{t}_int{b}" for t in TAGS for b in (8, 4)],
    "dequant_reduce.cu": [f"zc_dequant_reduce_{t}_int{b}" for t in TAGS for b in (8, 4)]
    + [f"zc_dequant_reduce_requant_int{b}" for b in (8, 4)],
}


def _ptx(source: Path, arch: str, out: Path) -> str:
    done = subprocess.run(
        [NVCC, "--ptx", f"-arch={arch}", *NVRTC_OPTIONS, "-Werror", "all-warnings", "-o", str(out), str(source)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return out.read_text()


def test_every_source_is_listed():
    assert sorted(KERNEL_SOURCES) == sorted(p.name for p in KERNEL_DIR.glob("*.cu")) == sorted(EXPECTED_KERNELS)


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("source", KERNEL_SOURCES)
def test_source_compiles(tmp_path, source, arch):
    ptx = _ptx(KERNEL_DIR / source, arch, tmp_path / "k.ptx")
    entries = set(re.findall(r"\.entry\s+(\w+)\(", ptx))
    assert entries == set(EXPECTED_KERNELS[source])
    for forbidden in ("div.approx", "div.full", ".ftz", "fma.", "rcp.approx"):
        assert forbidden not in ptx, forbidden


@pytest.mark.parametrize("source", KERNEL_SOURCES)
def test_nvrtc_translation_unit_compiles(tmp_path, source):
    unit = tmp_path / source
    unit.write_text(expand_includes(KERNEL_DIR / source))
    assert '#include "' not in unit.read_text()
    ptx = _ptx(unit, "sm_90", tmp_path / "k.ptx")
    assert set(re.findall(r"\.entry\s+(\w+)\(", ptx)) == set(EXPECTED_KERNELS[source])
