"""Every CUDA source compiles, and its PTX keeps the wire format whatever flags are added.

The loader compiles each source with NVRTC through :func:`zcomm_cuda.loader.compile_source`
(exactly its options, then ``-arch``). Two compilers check that code path:

* NVRTC itself, through ``compile_source``, the very function the loader runs, wherever
  cupy and an NVRTC library are importable (no GPU needed: the arch is given);
* nvcc, when found, on the same translation unit (headers inlined by ``expand_includes``)
  with the same options, and on each ``.cu`` file as it sits in ``kernels/``. Each nvcc
  compile runs once per session and in the background ([Note: background builds] in
  nvcc_builds.py); the tests below read its PTX, several of them the same one.

Both compile with the loader's options as they are and with hostile flags appended:
``-ftz=true`` (what cupy's cached compile path appends after a caller's options) and
``--use_fast_math``. The PTX must define every kernel the cuda backend asks for and contain no
flush-to-zero, approximate, fused multiply-add, reciprocal or ``div.full`` instruction: the
wire format's bytes must not depend on how the kernels were compiled ([Note: explicit
rounding] in wire_math.cuh).
"""

from __future__ import annotations

import re

import pytest

from cuda_support import requires_nvcc, requires_nvrtc
from nvcc_builds import Builds, Nvrtc, Ptx
from zcomm_cuda.loader import KERNEL_DIR, KERNEL_SOURCES, NVRTC_OPTIONS, compile_source, target_arch

ARCHES = ("sm_80", "sm_90")
HOSTILE_FLAGS = {"as-is": (), "ftz": ("-ftz=true",), "ftz+fast-math": ("-ftz=true", "--use_fast_math")}
TAGS = ("f32", "bf16", "f16")
EXPECTED_KERNELS = {
    "quantize.cu": [f"zc_quantize_{t}_int{b}" for t in TAGS for b in (8, 4)],
    "reorder_quantize.cu": [f"zc_reorder_{kind}_{t}_int{b}" for kind in ("quantize", "interleaved", "quantize_wide",
                            "interleaved_wide", "interleaved_regs") for t in TAGS for b in (8, 4)],
    "dequantize.cu": [f"zc_dequantize_{t}_int{b}" for t in TAGS for b in (8, 4)],
    "dequant_reduce.cu": [f"zc_dequant_reduce_{t}_int{b}" for t in TAGS for b in (8, 4)]
    + [f"zc_dequant_reduce_requant_regs_{m}_int{a}_int{b}" for m in ("one", "pow2", "div") for a in (8, 4) for b in (8, 4)],
    "dequant_reduce_requant.cu": [f"zc_dequant_reduce_requant_int{a}_int{b}" for a in (8, 4) for b in (8, 4)],
}
# opcode fragments the wire format forbids: flush-to-zero, approximations (div/rcp/sqrt/ex2
# .approx, div.full), contraction into fused multiply-adds, multiplication by a reciprocal
FORBIDDEN = re.compile(r"\.ftz\b|\.approx\b|\bdiv\.full\b|\bfma\.|\brcp\.")


def _instructions(ptx: str) -> list[str]:
    """The PTX's instruction lines (comments and blank lines dropped)."""
    lines = (line.split("//", 1)[0].strip() for line in ptx.splitlines())
    return [line for line in lines if line]


def _check_ptx(ptx: str, source: str) -> None:
    assert set(re.findall(r"\.entry\s+(\w+)\(", ptx)) == set(EXPECTED_KERNELS[source])
    bad = sorted({line for line in _instructions(ptx) if FORBIDDEN.search(line)})
    assert not bad, f"{len(bad)} forbidden instructions, e.g. {bad[:5]}"
    # no trap without the device checks' define ([Note: device checks] in zcomm_cuda/loader.py)
    assert not [line for line in _instructions(ptx) if re.search(r"\btrap\s*;", line)]


def _in_place(source: str, arch: str) -> Ptx:
    """The file as it sits in kernels/, warnings as errors."""
    return Ptx(source, False, arch, (*NVRTC_OPTIONS, "-Werror", "all-warnings"))


def _unit(source: str, arch: str, flags: tuple[str, ...]) -> Ptx:
    """The loader's translation unit with its options and ``flags`` appended."""
    return Ptx(source, True, arch, (*NVRTC_OPTIONS, *flags))


def test_every_source_is_listed():
    assert sorted(KERNEL_SOURCES) == sorted(p.name for p in KERNEL_DIR.glob("*.cu")) == sorted(EXPECTED_KERNELS)


@requires_nvcc
@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("source", KERNEL_SOURCES)
def test_nvcc_compiles_each_file_without_warnings(nvcc_builds, source, arch):
    _check_ptx(nvcc_builds.ptx(_in_place(source, arch)), source)


@requires_nvcc
@pytest.mark.parametrize("flags", HOSTILE_FLAGS.values(), ids=HOSTILE_FLAGS.keys())
@pytest.mark.parametrize("source", KERNEL_SOURCES)
def test_nvcc_translation_unit_under_hostile_flags(nvcc_builds, source, flags):
    """nvcc takes the last value of a repeated option, as NVRTC does (with a warning)."""
    _check_ptx(nvcc_builds.ptx(_unit(source, "sm_90", flags)), source)


def _entries(ptx: str) -> dict[str, list[str]]:
    """Each kernel's instruction lines, by name."""
    parts = re.split(r"\.entry\s+(\w+)\(", ptx)
    return {name: _instructions(body) for name, body in zip(parts[1::2], parts[2::2], strict=True)}


# The decoders' narrowing stores ([Note: hardware narrowing] in wire_math.cuh): per output tag
# the cvts that round, and the NaN mask each word of the general store8 gets: fp16
# cvt.rn.f16x2.f32 (sm_80 and later; two cvt.rn.f16.f32 per word before) and set.nan.u32.f16x2;
# bf16 cvt.rn.bf16x2.f32 from sm_80, with set.nan.u32.bf16x2 from sm_90 (the bf16 form of set
# needs it) or before it the prmt sign-mode test of [Note: bf16 NaN halves]; before sm_80 no
# cvt narrows to bf16 (the software path) and there is no bf16 mask.
NARROWING = {"f16": re.compile(r"cvt\.\w+(\.\w+)*\.f16(x2)?\.f32\b"), "bf16": re.compile(r"cvt\.\w+(\.\w+)*\.bf16(x2)?\.f32\b")}
NAN_MASK = {
    "f16": re.compile(r"set\.nan\.u32\.f16x2\b"),
    "bf16-set": re.compile(r"set\.nan\.u32\.bf16x2\b"),
    "bf16-prmt": re.compile(r"prmt\.b32\s.*,\s*48025;"),  # selector 0xBB99
}
HARDWARE = {  # (tag, arch): (the cvt every narrowing is, cvts per word, the NaN mask)
    ("f16", "sm_75"): ("cvt.rn.f16.f32", 2, "f16"),
    ("f16", "sm_90"): ("cvt.rn.f16x2.f32", 1, "f16"),
    ("bf16", "sm_75"): (None, 0, None),
    ("bf16", "sm_80"): ("cvt.rn.bf16x2.f32", 1, "bf16-prmt"),
    ("bf16", "sm_86"): ("cvt.rn.bf16x2.f32", 1, "bf16-prmt"),
    ("bf16", "sm_90"): ("cvt.rn.bf16x2.f32", 1, "bf16-set"),
}
# the sources of the decoders, whose kernels store fp16 / bf16 outputs (the re-quantizing
# kernels store payloads: dequant_reduce_requant.cu has no decoder)
DECODERS = tuple(source for source, kernels in EXPECTED_KERNELS.items()
                 if any("dequant" in k and k.split("_")[-2] in TAGS for k in kernels))
# dequantize's INT8 groups of numbers store without a mask ([Note: NaN groups] in
# run_decoder.cuh): the four words of the one store8_numbers in their loop
UNMASKED_WORDS = {"zc_dequantize_f16_int8": 4, "zc_dequantize_bf16_int8": 4}


@requires_nvcc
@pytest.mark.parametrize("source", DECODERS)
@pytest.mark.parametrize("tag,arch", HARDWARE, ids=[f"{t}-{a}" for t, a in HARDWARE])
def test_16_bit_outputs_round_in_hardware(nvcc_builds, source, tag, arch):
    """The decoders' fp16 / bf16 stores round with the arch's cvt, and every word of the general
    store8 gets one NaN mask of the arch's kind and no other kind (all of dequant_reduce's words;
    dequantize's INT8 kernels also have their loop of numbers, unmasked). The loader's translation
    unit compiled with -ftz=true added (the PTX of the hostile "ftz" test at sm_90, and one PTX per
    arch for both tags). Kernels with other outputs have neither."""
    convert, per_word, mask = HARDWARE[(tag, arch)]
    ptx = nvcc_builds.ptx(_unit(source, arch, HOSTILE_FLAGS["ftz"]))
    _check_ptx(ptx, source)
    mine = [kind for kind in NAN_MASK if kind.split("-")[0] == tag]
    checked = 0
    for kernel, lines in _entries(ptx).items():
        narrowing = [line for line in lines if NARROWING[tag].match(line)]
        masks = {kind: sum(1 for line in lines if NAN_MASK[kind].match(line)) for kind in mine}
        if convert is None or kernel.split("_")[-2] != tag:
            assert narrowing == [] and not any(masks.values()), (kernel, narrowing[:3], masks)
            continue
        assert narrowing and all(line.startswith(convert + " ") for line in narrowing), (kernel, narrowing[:3])
        assert len(narrowing) == per_word * (masks[mask] + UNMASKED_WORDS.get(kernel, 0)), (kernel, masks)
        assert masks[mask] > 0 and all(masks[kind] == 0 for kind in mine if kind != mask), (kernel, masks)
        checked += 1
    assert checked == (0 if convert is None else 2)  # the INT8 and INT4 kernels of these outputs


@requires_nvrtc
@pytest.mark.parametrize("source", KERNEL_SOURCES)
def test_loader_nvrtc_compile(nvcc_builds, source):
    """The loader's own compile (NVRTC, PTX and cubin) with its options. The hostile flags'
    PTX is checked on the same expanded translation unit by nvcc above; repeating them here
    would only add minutes of ptxas (the cubin)."""
    compiled = nvcc_builds.nvrtc(Nvrtc(source, "sm_90", NVRTC_OPTIONS))
    _check_ptx(compiled.ptx, source)
    assert compiled.cubin  # what the loader loads for a device NVRTC knows


@requires_nvrtc
def test_loader_nvrtc_compile_reports_errors(nvcc_builds, monkeypatch, tmp_path):
    nvcc_builds.wait()  # no compile in the background reads the KERNEL_DIR patched here
    (tmp_path / "broken.cu").write_text('extern "C" __global__ void k() { this is not C++; }\n')
    monkeypatch.setattr("zcomm_cuda.loader.KERNEL_DIR", tmp_path)
    with pytest.raises(RuntimeError, match=r"NVRTC could not compile broken\.cu for sm_90"):
        compile_source("broken.cu", "sm_90")


def test_target_arch_prefers_a_cubin_for_the_device():
    supported = (75, 80, 86, 89, 90, 100, 120)
    assert target_arch((9, 0), supported) == "sm_90"
    assert target_arch((8, 6), supported) == "sm_86"
    assert target_arch((12, 1), supported) == "compute_120"  # newer than NVRTC: PTX, JIT-compiled at load
    with pytest.raises(RuntimeError, match="none of them runs on compute capability 70"):
        target_arch((7, 0), supported)


def builds_of(item: pytest.Item, builds: Builds) -> None:
    """Start the nvcc compiles ``item`` reads ([Note: background builds] in nvcc_builds.py)."""
    params = getattr(item, "callspec", None)
    params = params.params if params is not None else {}
    name = getattr(item, "originalname", item.name)
    if name == "test_nvcc_compiles_each_file_without_warnings":
        builds.start_ptx(_in_place(params["source"], params["arch"]))
    elif name == "test_nvcc_translation_unit_under_hostile_flags":
        builds.start_ptx(_unit(params["source"], "sm_90", params["flags"]))
    elif name == "test_16_bit_outputs_round_in_hardware":
        builds.start_ptx(_unit(params["source"], params["arch"], HOSTILE_FLAGS["ftz"]))
    elif name == "test_loader_nvrtc_compile":
        builds.start_nvrtc(Nvrtc(params["source"], "sm_90", NVRTC_OPTIONS))
