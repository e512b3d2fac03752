// Scalar arithmetic of the zcomm wire format (zcomm/quant/wire_format.py), shared by the
// device kernels and the host-side check (tests/quant/cuda_host/host_check.cu).
//
// Every function here is __host__ __device__ so that the same source that runs on the GPU
// can be compiled for the CPU and compared byte for byte with the reference backend.
//
// [Note: explicit rounding] The wire format fixes the fp32 operations (one IEEE division
// per group for the reciprocal of the scale, multiplications by it per element; no fused
// multiply-add; no flush-to-zero), and the bytes
// must not depend on how the kernels are compiled: cupy's own compile path appends
// -ftz=true, and a user may add --use_fast_math. Compiler flags rewrite C++ float
// operators and even the __fdiv_rn/__fmul_rn/__fadd_rn intrinsics (-ftz=true turns them
// into div.rn.ftz.f32 etc., which flush subnormal inputs and results), so on the device
// every fp32 operation of the wire format is one inline PTX instruction that names its
// rounding and has no .ftz: div.rn.f32, mul.rn.f32, add.rn.f32, cvt.rni.s32.f32. Zero,
// NaN and Inf tests and the absmax work on bit patterns, and the clamp on integers, so
// no float comparison is left for a flag to turn into an ftz compare. The only other
// float instructions are exact integer-to-float conversions (cvt.rn.f32.s32/u32), which
// have no ftz form. tests/quant/test_cuda_compile.py compiles every kernel with -ftz=true and
// --use_fast_math added and finds no .ftz, .approx or fma instruction in the PTX. On the
// host the plain operators are IEEE fp32 on x86-64 SSE (the host check is built with
// -ffp-contract=off) and rint_to_int reproduces cvt.rni.s32.f32's saturation.
//
// [Note: software conversions] fp32 <-> bf16/fp16 are done on the bit patterns instead of
// through cuda_bf16.h / cuda_fp16.h: NVRTC then needs no headers, the code is identical
// on host and device (so the host check covers it), and NaN is written as the canonical
// pattern directly (hardware conversions produce other NaN payloads). The rounding is
// round-to-nearest-even, exactly what __float2bfloat16_rn / __float2half_rn compute. Two
// exceptions, on the device only: fp16 -> fp32, exact in hardware ([Note: hardware
// widening]), and fp32 -> fp16 / bf16, rounded in hardware with a NaN fix-up ([Note: hardware
// narrowing]; bf16 from sm_80); the host keeps the software paths.
#pragma once

#ifndef __CUDACC_RTC__
#include <cmath>
#include <cstdlib>
#include <cstring>
#endif

#if defined(__CUDACC__)
#define ZC_HD __host__ __device__ __forceinline__
#else
#define ZC_HD inline
#endif

// ZC_DEVICE_CHECK(cond): a kernel's check of an invariant its launcher has checked on the
// host ([Note: device checks] in zcomm_cuda/loader.py). It traps, a sticky error that ends the
// rank's CUDA context, only in a compile with -DZCOMM_DEVICE_CHECKS=1 (gpu-check's); in any
// other the condition is type-checked and never evaluated.
#if defined(ZCOMM_DEVICE_CHECKS) && ZCOMM_DEVICE_CHECKS
#define ZC_DEVICE_CHECK(cond) \
    do {                      \
        if (!(cond)) __trap(); \
    } while (0)
#else
#define ZC_DEVICE_CHECK(cond) \
    do {                      \
        (void)sizeof(!(cond)); \
    } while (0)
#endif

namespace zc {

using u8 = unsigned char;
using u16 = unsigned short;
using u32 = unsigned int;
using i64 = long long;

// 16-bit element types, kept distinct so that overloads pick the right conversion.
struct bf16_t { u16 bits; };
struct fp16_t { u16 bits; };

constexpr u32 kF32CanonicalNan = 0x7FC00000u;
constexpr u16 kBf16CanonicalNan = 0x7FC0u;
constexpr u16 kF16CanonicalNan = 0x7E00u;
constexpr u32 kF32Inf = 0x7F800000u;
constexpr u32 kF32AbsMask = 0x7FFFFFFFu;
constexpr u32 kF32One = 0x3F800000u;

ZC_HD u32 float_bits(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    u32 u;
    std::memcpy(&u, &f, sizeof u);
    return u;
#endif
}

ZC_HD float bits_float(u32 u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
#endif
}

ZC_HD float div_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
#else
    return a / b;
#endif
}

// [Note: exact reciprocal] When d is a power of two whose reciprocal r = 1/d is a normal
// float (d = 2^n, -126 <= n <= 126), a * r is the same real number as a / d, so the one
// rounding of mul.rn and of div.rn gives the same float for every a (zero and Inf signs,
// subnormal results and NaN included): a multiplication replaces an IEEE division
// sequence without changing a byte. Returns whether d is such a power of two, and r.
ZC_HD bool exact_reciprocal(float d, float& r) {
    const u32 b = float_bits(d);
    const u32 exponent = (b >> 23) & 0xFFu;
    if ((b & 0x7FFFFFu) != 0 || exponent == 0 || exponent > 253) return false;
    r = bits_float((b & 0x80000000u) | ((254u - exponent) << 23));
    return true;
}

ZC_HD float mul_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
#else
    return a * b;
#endif
}

ZC_HD float add_rn(float a, float b) {
#ifdef __CUDA_ARCH__
    float r;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
#else
    return a + b;
#endif
}

ZC_HD u32 max_u32(u32 a, u32 b) { return a > b ? a : b; }
ZC_HD bool is_nan(float f) { return (float_bits(f) & kF32AbsMask) > kF32Inf; }
ZC_HD bool is_finite(float f) { return (float_bits(f) & kF32AbsMask) < kF32Inf; }
ZC_HD float canonical_nan() { return bits_float(kF32CanonicalNan); }
ZC_HD bool is_zero(float f) { return (float_bits(f) & kF32AbsMask) == 0; }
ZC_HD float canonicalize(float f) { return is_nan(f) ? canonical_nan() : f; }

// x rounded to the nearest integer, ties to even, saturated to the int range, NaN -> 0:
// the semantics of PTX cvt.rni.s32.f32.
ZC_HD int rint_to_int(float x) {
#ifdef __CUDA_ARCH__
    int r;
    asm("cvt.rni.s32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
#else
    if (is_nan(x)) return 0;
    if (x >= 2147483648.0f) return 2147483647;
    if (x < -2147483648.0f) return -2147483647 - 1;
    return static_cast<int>(std::rint(x));  // default rounding mode: to nearest, ties to even
#endif
}

// |x| as bits. For non-negative floats the unsigned order of the bit patterns is the float
// order, with +Inf (0x7F800000) above every finite value and every NaN above +Inf. So an
// integer max over these bits is a NaN-propagating absmax that also tells NaN from Inf,
// with no separate flags (fmaxf would drop the NaN).
ZC_HD u32 abs_bits(float x) { return float_bits(x) & kF32AbsMask; }

// ---- element types -> fp32 (exact for all three) ----

ZC_HD float to_float(float v) { return v; }
ZC_HD float to_float(bf16_t v) { return bits_float(static_cast<u32>(v.bits) << 16); }

// [Note: hardware widening] On the device fp16 -> fp32 is the hardware conversion
// cvt.f32.f16 (one instruction instead of about ten): widening is exact for every fp16
// (normal and subnormal fp16 values are all normal fp32 values), has no rounding mode to
// name, and flags cannot rewrite inline PTX (which names no .ftz; a widened fp16 is never
// an fp32 subnormal anyway), so every finite value and Inf convert to the same bits as
// the software path below. A NaN
// may come out with another payload (the hardware writes its own NaN), which no caller can
// see: to_float feeds only the encoder, where a NaN element counts through abs_bits (every
// NaN is above +Inf there, whatever its payload) and its code is 0. The host runs the
// software path, which the host check compares with the reference backend.
ZC_HD float to_float(fp16_t v) {
#ifdef __CUDA_ARCH__
    float r;
    asm("cvt.f32.f16 %0, %1;" : "=f"(r) : "h"(v.bits));
    return r;
#else
    const u32 sign = static_cast<u32>(v.bits & 0x8000u) << 16;
    const u32 exponent = (v.bits >> 10) & 0x1Fu;
    const u32 mantissa = v.bits & 0x3FFu;
    if (exponent == 0x1Fu) return bits_float(sign | kF32Inf | (mantissa << 13));
    if (exponent == 0) {
        // zero or subnormal: mantissa * 2^-24, exact in fp32 (a power-of-two scaling)
        const float magnitude = mul_rn(static_cast<float>(mantissa), 5.9604644775390625e-08f);
        return bits_float(float_bits(magnitude) | sign);
    }
    return bits_float(sign | ((exponent + 112u) << 23) | (mantissa << 13));
#endif
}

// ---- fp32 -> element types (round to nearest even, canonical NaN) ----

template <class T> ZC_HD T from_float(float f);

template <> ZC_HD float from_float<float>(float f) { return canonicalize(f); }

// fp32 -> fp16 bits in software: round to nearest even, overflow to +-Inf, the canonical
// NaN. The host's conversion everywhere; the device's is [Note: hardware narrowing].
ZC_HD u16 f16_bits_software(float f) {
    if (is_nan(f)) return kF16CanonicalNan;
    const u32 u = float_bits(f);
    const u16 sign = static_cast<u16>((u >> 16) & 0x8000u);
    u32 a = u & kF32AbsMask;
    if (a >= 0x477FF000u) return static_cast<u16>(sign | 0x7C00u);  // >= 65520 rounds to Inf
    if (a >= 0x38800000u) {  // normal fp16 range (>= 2^-14): rebias, round on the dropped 13 bits
        a += 0xC8000FFFu + ((a >> 13) & 1u);
        return static_cast<u16>(sign | (a >> 13));
    }
    // subnormal fp16: adding 0.5f aligns the fp16 subnormal grid (2^-24) to the last fp32
    // mantissa bit, so the fp32 addition itself performs the round-to-nearest-even.
    const u32 shifted = float_bits(add_rn(bits_float(a), 0.5f)) - 0x3F000000u;
    return static_cast<u16>(sign | shifted);
}

// [Note: hardware narrowing] On the device the decoders round fp32 to fp16 and bf16 in
// hardware, two elements per instruction: cvt.rn.f16x2.f32 and cvt.rn.bf16x2.f32 (sm_80 and
// later) put RN(lo) in the low half and RN(hi) in the high half. Before sm_80 fp16 takes two
// cvt.rn.f16.f32 and bf16 keeps the software path (PTX has no bf16 conversion there). In
// dequantize's INT8 loop on sm_90 (bench.kernels --static) the software paths cost about 24
// (fp16) and 7.5 (bf16) instructions per element, the hardware ones 1.5 with their fix-ups.
// Finite values and Inf: IEEE 754 round-to-nearest-even gives each fp32 that is not a NaN
// exactly one result, and .rn is that rounding (PTX ISA: "rounding to nearest, with ties to
// even"; subnormals supported by default, and the x2 forms have no .ftz; flags cannot
// rewrite inline PTX). Without .satfinite an overflow is IEEE's: fp16 65520 and above, bf16
// 0x7F7F8000 (bf16's largest finite value plus half an ulp) and above, round to Inf; bf16
// has fp32's exponent range, so fp32 subnormals round on bf16's subnormal grid. The software
// paths are checked to be that same IEEE function on the host: fp16 against numpy's
// astype(float16), bf16 against torch's float32 -> bfloat16 conversion, itself checked against
// a nearest-even choice between the two neighbouring bf16 values computed in fp64, on a dense
// sweep of every fp32 class and on every pattern of the binades where the rounding changes
// kind (test_cuda_host_math.py: test_fp16_rounding_*, test_bf16_rounding_*; all 2^32 patterns
// under ZCOMM_FP16_EXHAUSTIVE=1 / ZCOMM_BF16_EXHAUSTIVE=1). So the device's bytes equal the
// reference backend's through the IEEE definition, not through a test of the device: only
// `make gpu-check` on a GPU (test_narrowing_of_decoded_values on the cuda backend) proves the
// instructions and the fix-ups below.
// NaN: the PTX ISA leaves the NaN a plain cvt writes unspecified (only .relu promises PTX's
// canonical NaN, and .relu also clamps negatives to 0; .satfinite promises only "NaN"), while
// the wire format writes 0x7E00 (kF16CanonicalNan) and 0x7FC0 (kBf16CanonicalNan) whatever
// the NaN's sign and payload. A NaN result comes only from a NaN input (IEEE conversion keeps
// NaN a NaN and never makes one from a number), so the fix-up tests the packed result: a
// mask of 0xFFFF in each NaN half, then one LOP3 puts the canonical NaN there. The mask is
// set.nan.u32.f16x2 for fp16 (a comparison: true for every NaN, whatever its bits) and
// set.nan.u32.bf16x2 for bf16 on sm_90 and later (the bf16 form of set needs sm_90), so a
// word of two elements costs F2FP, HSET2, LOP3. On sm_80 to sm_89 the bf16 mask is the integer
// test bf16x2_nan_halves, three instructions, and a word costs five. Alternatives counted and
// rejected: an fsetp.nan per fp32 input takes a test, a mask and a predicated merge per element
// (seven instructions per word as compiled for sm_90); max.NaN.bf16x2 writes PTX's canonical
// NaN, not the wire format's, so it would still need a rewrite of the NaN halves.
// dequantize's INT8 groups of numbers skip the fix-up: [Note: NaN-free narrowing].
#ifdef __CUDA_ARCH__
// The hardware roundings themselves, RN(lo) in the low half and RN(hi) in the high half, NaN
// halves unspecified.
__device__ __forceinline__ u32 cvt_rn_f16x2(float lo, float hi) {
    u32 packed;
#if __CUDA_ARCH__ >= 800
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
#else
    u16 low, high;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(low) : "f"(lo));
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(high) : "f"(hi));
    packed = static_cast<u32>(low) | (static_cast<u32>(high) << 16);
#endif
    return packed;
}

#if __CUDA_ARCH__ >= 800
__device__ __forceinline__ u32 cvt_rn_bf16x2(float lo, float hi) {
    u32 packed;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(packed) : "f"(hi), "f"(lo));
    return packed;
}
#endif
#endif

ZC_HD u32 f16x2_bits(float lo, float hi) {
#ifdef __CUDA_ARCH__
    const u32 packed = cvt_rn_f16x2(lo, hi);
    u32 nan_halves;
    asm("set.nan.u32.f16x2 %0, %1, %1;" : "=r"(nan_halves) : "r"(packed));
    constexpr u32 canonical2 = static_cast<u32>(kF16CanonicalNan) * 0x10001u;
    return (packed & ~nan_halves) | (canonical2 & nan_halves);
#else
    return static_cast<u32>(f16_bits_software(lo)) | (static_cast<u32>(f16_bits_software(hi)) << 16);
#endif
}

template <> ZC_HD fp16_t from_float<fp16_t>(float f) {
#ifdef __CUDA_ARCH__
    return fp16_t{static_cast<u16>(f16x2_bits(f, f))};  // [Note: hardware narrowing]
#else
    return fp16_t{f16_bits_software(f)};
#endif
}

// fp32 -> bf16 bits in software: round to nearest even, the canonical NaN. bf16 is the upper
// half of an fp32 with the same exponent range, so adding 0x7FFF plus the kept half's lowest
// bit and dropping the low half rounds every number: below half an ulp the sum stays in the
// kept value, from above half it carries into it (into the exponent too: a binade's top rounds
// to the next power of two, bf16's largest finite value plus half an ulp or more to Inf), and
// exactly half carries only when the kept value is odd. Zeros, subnormals and Inf need no
// case of their own. The host's conversion everywhere, and the device's before sm_80; from
// sm_80 it is [Note: hardware narrowing].
ZC_HD u16 bf16_bits_software(float f) {
    if (is_nan(f)) return kBf16CanonicalNan;
    const u32 u = float_bits(f);
    const u32 rounding = 0x7FFFu + ((u >> 16) & 1u);  // ties go to the even upper half
    return static_cast<u16>((u + rounding) >> 16);
}

// [Note: bf16 NaN halves] 0xFFFF in each half of a word of two bf16 values that is a NaN, 0 in
// the others, with integer instructions (for sm_80 to sm_89, which lack set.nan.u32.bf16x2):
// a half h is a NaN when |h| = h & 0x7FFF is above 0x7F80 (Inf), i.e. when |h| + 0x7F reaches
// 0x8000, its bit 15. The sum is at most 0x7FFF + 0x7F = 0x807E, so the low half's never
// carries into the high half. prmt's sign mode (a selector nibble 8 + b fills the result byte
// with the top bit of byte b) spreads bit 15 over bytes 0-1 (selector 9: byte 1's top bit) and
// bit 31 over bytes 2-3 (B: byte 3's). Per word LOP3, IADD, PRMT. The host runs the same
// arithmetic and emulates prmt's generic form as the PTX ISA defines it (host_check's bf16nan
// op checks it on every half pattern); __byte_perm has no sign mode (it reads 3 bits per
// selector nibble), hence the inline PTX.
constexpr u32 kSpreadHalfSigns = 0xBB99u;

ZC_HD u32 bf16x2_nan_halves(u32 packed) {
    const u32 top_bits = (packed & 0x7FFF7FFFu) + 0x007F007Fu;  // bit 15 / 31: that half is a NaN
#ifdef __CUDA_ARCH__
    u32 mask;
    asm("prmt.b32 %0, %1, 0, %2;" : "=r"(mask) : "r"(top_bits), "n"(kSpreadHalfSigns));
    return mask;
#else
    // prmt.b32 d, top_bits, 0, selector: result byte i from selector nibble i, whose 3 low bits
    // pick a byte of {0, top_bits} and whose top bit fills the result byte with that byte's msb
    u32 mask = 0;
    for (int i = 0; i < 4; ++i) {
        const u32 nibble = (kSpreadHalfSigns >> (4 * i)) & 0xFu;
        const u32 picked = (nibble & 7u) < 4 ? (top_bits >> (8 * (nibble & 7u))) & 0xFFu : 0u;
        mask |= ((nibble & 8u) ? ((picked & 0x80u) ? 0xFFu : 0u) : picked) << (8 * i);
    }
    return mask;
#endif
}

// Two fp32 values rounded to bf16 as one word, lo in the low half: [Note: hardware narrowing]
// on the device from sm_80, the software path on the host and before sm_80.
ZC_HD u32 bf16x2_bits(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const u32 packed = cvt_rn_bf16x2(lo, hi);
#if __CUDA_ARCH__ >= 900
    u32 nan_halves;
    asm("set.nan.u32.bf16x2 %0, %1, %1;" : "=r"(nan_halves) : "r"(packed));
#else
    const u32 nan_halves = bf16x2_nan_halves(packed);
#endif
    constexpr u32 canonical2 = static_cast<u32>(kBf16CanonicalNan) * 0x10001u;
    return (packed & ~nan_halves) | (canonical2 & nan_halves);
#else
    return static_cast<u32>(bf16_bits_software(lo)) | (static_cast<u32>(bf16_bits_software(hi)) << 16);
#endif
}

template <> ZC_HD bf16_t from_float<bf16_t>(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    return bf16_t{static_cast<u16>(bf16x2_bits(f, f))};  // [Note: hardware narrowing]
#else
    return bf16_t{bf16_bits_software(f)};
#endif
}

// [Note: NaN-free narrowing] The conversions of [Note: hardware narrowing] without their NaN
// fix-up, for values the caller knows are not NaN ([Note: NaN groups] in run_decoder.cuh): on
// the device the cvt alone (fp16 on every arch, bf16 from sm_80), whose result for every input
// that is not a NaN is the fix-up's (the fix-up changes NaN halves only). The host and bf16
// before sm_80 run the full conversions (the software paths), the same bytes for numbers.

// The caller's promise that v is not a NaN ([Note: NaN-free narrowing]), checked where it costs
// the device nothing: on the host (the host check runs every decoder case) a broken one aborts.
ZC_HD void expect_number(float v) {
#ifndef __CUDA_ARCH__
    if (is_nan(v)) std::abort();
#else
    (void)v;
#endif
}

ZC_HD u32 f16x2_bits_of_numbers(float lo, float hi) {
    expect_number(lo);
    expect_number(hi);
#ifdef __CUDA_ARCH__
    return cvt_rn_f16x2(lo, hi);
#else
    return f16x2_bits(lo, hi);
#endif
}

ZC_HD u32 bf16x2_bits_of_numbers(float lo, float hi) {
    expect_number(lo);
    expect_number(hi);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    return cvt_rn_bf16x2(lo, hi);
#else
    return bf16x2_bits(lo, hi);
#endif
}

// Two elements as one word, the first in the low half (little-endian order in memory).
template <class H> ZC_HD u32 from_float2(float lo, float hi) {
    return static_cast<u32>(from_float<H>(lo).bits) | (static_cast<u32>(from_float<H>(hi).bits) << 16);
}

template <> ZC_HD u32 from_float2<fp16_t>(float lo, float hi) { return f16x2_bits(lo, hi); }
template <> ZC_HD u32 from_float2<bf16_t>(float lo, float hi) { return bf16x2_bits(lo, hi); }

// from_float2 for two values that are not NaN: [Note: NaN-free narrowing].
template <class H> ZC_HD u32 from_float2_of_numbers(float lo, float hi);
template <> ZC_HD u32 from_float2_of_numbers<fp16_t>(float lo, float hi) { return f16x2_bits_of_numbers(lo, hi); }
template <> ZC_HD u32 from_float2_of_numbers<bf16_t>(float lo, float hi) { return bf16x2_bits_of_numbers(lo, hi); }

// ---- wire-format rules per group and per element ----

// The scale of a group from the max of abs_bits over its elements (see abs_bits).
ZC_HD float scale_from_absmax_bits(u32 absmax_bits, int qmax) {
    if (absmax_bits > kF32Inf) return canonical_nan();
    if (absmax_bits == kF32Inf) return bits_float(kF32Inf);
    return div_rn(bits_float(absmax_bits), static_cast<float>(qmax));
}

// Quantizes elements of one group (wire format version 2): once per group the pre-scale
// p (2^64 for a subnormal scale, else 1) and the reciprocal r = 1 / (scale * p), an IEEE
// division; per element q = clamp(rint((x * p) * r), -qmax, qmax), two multiplications and
// no division. The whole group gets 0 when the scale is 0, NaN or Inf. x is finite whenever
// the scale is usable (a NaN or Inf element makes the scale NaN or Inf) and |x| <= qmax *
// scale, so (x * p) * r is finite and the saturating rint_to_int followed by an integer
// clamp equals the float clamp. An unusable scale gets r = 0 (and p = 1), so that every
// code is 0 without a per-element test: x * 0 is +-0 for the finite x of a zero group, and
// a NaN or Inf x (only in NaN or Inf groups) gives NaN, which rint_to_int maps to 0.
constexpr u32 kF32SmallestNormal = 0x00800000u;  // 2^-126
constexpr u32 kF32TwoPow64 = 0x5F800000u;        // 2^64, the pre-scale of subnormal scales
constexpr int kWireFormatVersion = 2;            // zcomm/quant/wire_format.py: WIRE_FORMAT_VERSION

struct Quantizer {
    float prescale;
    float reciprocal;
    int qmax;

    ZC_HD Quantizer(float scale, int qmax_) : prescale(1.0f), reciprocal(0.0f), qmax(qmax_) {
        const u32 bits = float_bits(scale);  // scales are >= +0 or the canonical NaN
        if (is_finite(scale) && !is_zero(scale)) {
            prescale = bits < kF32SmallestNormal ? bits_float(kF32TwoPow64) : 1.0f;
            reciprocal = div_rn(1.0f, mul_rn(scale, prescale));
        }
    }

    ZC_HD int operator()(float x) const {
        const int r = rint_to_int(mul_rn(mul_rn(x, prescale), reciprocal));
        return r > qmax ? qmax : (r < -qmax ? -qmax : r);
    }
};

// [Note: plain scales] Most groups have a plain scale: +0, or a normal finite float. For
// them the per-element rule above shrinks to two fp32 operations with the same result:
//   * p = 1, so (x * p) * r is x * r;
//   * no clamp is needed: scale = RN(a / qmax) and r = RN(1 / scale) are normal, each
//     within a relative 2^-24 of the exact quotient, so for |x| <= a (the absmax)
//     |x * r| <= a * r <= qmax * (1 + 2^-24) / (1 - 2^-24) < qmax + 2^-16, and rounding
//     the product (monotonic) and then to an integer gives at most qmax. A zero scale
//     has r = 0 and finite x, so x * r is +-0 and the code 0;
//   * rint(y) for |y| < 2^22 is read off y + 1.5 * 2^23 (kRoundingMagic): the sum lies in
//     [2^23, 2^24), where fp32's spacing is 1, so add.rn rounds it to the nearest integer,
//     ties to even (the magic is even, so the sum's parity is the integer's); its bits are
//     0x4B400000 + rint(y), whose low byte is the INT8 code and low nibble the INT4 code
//     (two's complement), with no float-to-int conversion (a quarter-rate instruction).
// Subnormal scales (p = 2^64, and rint can pass qmax) and NaN or Inf scales keep the
// Quantizer. The host check runs both paths against the reference backend.
constexpr u32 kF32RoundingMagic = 0x4B400000u;  // 1.5 * 2^23

ZC_HD bool plain_scale(float scale) {
    const u32 bits = float_bits(scale);  // scales are >= +0 or the canonical NaN
    return bits == 0 || (bits >= kF32SmallestNormal && bits < kF32Inf);
}

// r of a plain scale (see [Note: plain scales]).
ZC_HD float plain_reciprocal(float scale) { return is_zero(scale) ? 0.0f : div_rn(1.0f, scale); }

// The bits whose low byte (INT8) or nibble (INT4) is x's code, under a plain scale's r.
ZC_HD u32 plain_code_bits(float x, float reciprocal) {
    return float_bits(add_rn(mul_rn(x, reciprocal), bits_float(kF32RoundingMagic)));
}

// One element's fp32 value: q * scale, or NaN when the scale is NaN or Inf (a non-finite
// group never dequantizes to finite numbers).
// [Note: decoded NaN] The NaN's payload is left open: every decoder output goes through
// from_float or from_float2, which write the canonical NaN of their type, and the
// re-quantizing encoder sees a NaN only through abs_bits.
ZC_HD float dequantize_value(int q, float scale) {
    return is_finite(scale) ? mul_rn(static_cast<float>(q), scale) : canonical_nan();
}

// The scale a group's elements are multiplied by: the scale, or NaN for a NaN or Inf scale,
// so that q * dequantize_scale(scale) is dequantize_value(q, scale) for every q up to the
// NaN's payload ([Note: decoded NaN]) with one multiplication per element and the test
// once per group.
ZC_HD float dequantize_scale(float scale) { return is_finite(scale) ? scale : canonical_nan(); }

template <int BITS> struct Bits;
template <> struct Bits<8> {
    static constexpr int kQmax = 127;
    static constexpr int kElementsPerByte = 1;
};
template <> struct Bits<4> {
    static constexpr int kQmax = 7;
    static constexpr int kElementsPerByte = 2;
};

// ---- payload layout ----

ZC_HD i64 values_nbytes(i64 numel, int bits) { return bits == 8 ? numel : (numel + 1) / 2; }
ZC_HD i64 scales_offset(i64 numel, int bits) { return (values_nbytes(numel, bits) + 3) / 4 * 4; }
ZC_HD i64 num_groups(i64 numel, i64 group_size) { return (numel + group_size - 1) / group_size; }
ZC_HD bool aligned(const void* p, i64 bytes) {
    return reinterpret_cast<unsigned long long>(p) % static_cast<unsigned long long>(bytes) == 0;
}

}  // namespace zc
