"""The benchmarks' precision choice from /proc/cpuinfo text (fake machines) and the CPU model name."""

from __future__ import annotations

import pytest

from bench.harness.precision import Precision, choose_precision, cpu_model, native_bf16_flags

EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 avx avx2 fma bmi2
processor\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse sse2 avx avx2 fma bmi2
"""
XEON_AMX = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile
"""
# One processor without the flag (a heterogeneous or misreported machine): not native everywhere.
MIXED = XEON_AMX + "processor\t: 2\nmodel name\t: Intel(R) Xeon(R)\nflags\t\t: avx2 avx512f\n"
GRAVITON3 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd sve bf16 i8mm
CPU part\t: 0xd40
"""


def test_cpu_model_names():
    assert cpu_model(EPYC_AVX2) == "AMD EPYC 7B13"
    assert cpu_model(XEON_AMX) == "Intel(R) Xeon(R) Platinum 8480+"
    assert cpu_model(GRAVITON3) == "0xd40"
    assert cpu_model("") == "unknown CPU"


def test_native_bf16_flags_must_be_on_every_processor():
    assert native_bf16_flags(EPYC_AVX2) == []
    assert native_bf16_flags(XEON_AMX) == ["amx_bf16", "avx512_bf16"]
    assert native_bf16_flags(MIXED) == []
    assert native_bf16_flags(GRAVITON3) == ["bf16"]
    assert native_bf16_flags("") == []


def test_auto_is_fp32_on_an_avx2_cpu_and_says_why():
    choice = choose_precision("auto", cpuinfo=EPYC_AVX2, cuda_bf16=None)
    assert choice.dtype == "fp32"
    assert "AMD EPYC 7B13" in choice.reason and "no native bf16" in choice.reason


def test_auto_is_bf16_with_amx_or_a_bf16_gpu():
    choice = choose_precision("auto", cpuinfo=XEON_AMX, cuda_bf16=None)
    assert choice.dtype == "bf16" and "amx_bf16" in choice.reason
    # On a GPU run the GPU decides, whatever the host CPU has.
    assert choose_precision("auto", cpuinfo=EPYC_AVX2, cuda_bf16=True).dtype == "bf16"
    assert choose_precision("auto", cpuinfo=XEON_AMX, cuda_bf16=False).dtype == "fp32"


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_an_explicit_dtype_is_kept(dtype):
    expected = Precision(dtype, f"{dtype} as asked (--dtype {dtype})")
    assert choose_precision(dtype, cpuinfo=EPYC_AVX2, cuda_bf16=None) == expected


def test_unknown_dtype_is_an_error():
    with pytest.raises(ValueError, match="dtype"):
        choose_precision("fp16", cpuinfo=XEON_AMX, cuda_bf16=None)
