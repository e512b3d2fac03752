// Loads and stores of runs of 8 consecutive elements or codes, as 32-bit words.
//
// A run of 8 is the kernels' vector unit: 32 bytes of fp32 (two 16-byte accesses), 16 bytes
// of bf16/fp16 (one 16-byte access), 8 bytes of INT8 codes, 4 bytes of INT4 codes. On the
// device the words move as uint4/uint2/u32 (one vectorized memory instruction each); on the
// host as memcpy, so the host check runs the same packing code. Callers guarantee the
// alignment (see the can_vectorize_* predicates in sources.cuh); tails and misaligned
// buffers use the scalar paths instead.
#pragma once

#include "wire_math.cuh"

namespace zc {

template <int N> ZC_HD void load_words(u32 (&w)[N], const void* p) {
#ifdef __CUDA_ARCH__
    if constexpr (N == 4) {
        const uint4 v = *reinterpret_cast<const uint4*>(p);
        w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
    } else if constexpr (N == 2) {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        w[0] = v.x; w[1] = v.y;
    } else {
        static_assert(N == 1, "load_words: 1, 2 or 4 words");
        w[0] = *reinterpret_cast<const u32*>(p);
    }
#else
    std::memcpy(w, p, sizeof w);
#endif
}

template <int N> ZC_HD void store_words(void* p, const u32 (&w)[N]) {
#ifdef __CUDA_ARCH__
    if constexpr (N == 4) {
        // One 16-byte store, stated in PTX: written as a uint4 store to a bf16/fp16 address,
        // the compiler splits it into four 4-byte stores (it cannot prove the alignment the
        // callers guarantee). Every buffer is global memory, whose generic addresses are its
        // global addresses. No "memory" clobber: no kernel reads back what it stores in the
        // same launch, so later loads may still move above the store.
        asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w[0]), "r"(w[1]), "r"(w[2]),
                     "r"(w[3]));
    } else if constexpr (N == 2) {
        uint2 v;
        v.x = w[0]; v.y = w[1];
        *reinterpret_cast<uint2*>(p) = v;
    } else {
        static_assert(N == 1, "store_words: 1, 2 or 4 words");
        *reinterpret_cast<u32*>(p) = w[0];
    }
#else
    std::memcpy(p, w, sizeof w);
#endif
}

// ---- elements: 8 values <-> fp32 (little-endian: element 2i is the low half of word i) ----

ZC_HD void load8(const float* p, float (&v)[8]) {
    for (int half = 0; half < 2; ++half) {
        u32 w[4];
        load_words(w, p + 4 * half);
        for (int k = 0; k < 4; ++k) v[4 * half + k] = bits_float(w[k]);
    }
}

template <class H> ZC_HD void load8(const H* p, float (&v)[8]) {
    u32 w[4];
    load_words(w, p);
    for (int k = 0; k < 4; ++k) {
        v[2 * k] = to_float(H{static_cast<u16>(w[k] & 0xFFFFu)});
        v[2 * k + 1] = to_float(H{static_cast<u16>(w[k] >> 16)});
    }
}

ZC_HD void store8(float* p, const float (&v)[8]) {
    for (int half = 0; half < 2; ++half) {
        u32 w[4];
        for (int k = 0; k < 4; ++k) w[k] = float_bits(from_float<float>(v[4 * half + k]));
        store_words(p + 4 * half, w);
    }
}

template <class H> ZC_HD void store8(H* p, const float (&v)[8]) {
    u32 w[4];
    for (int k = 0; k < 4; ++k) {
        w[k] = static_cast<u32>(from_float<H>(v[2 * k]).bits) |
               (static_cast<u32>(from_float<H>(v[2 * k + 1]).bits) << 16);
    }
    store_words(p, w);
}

// ---- raw 16-bit runs: 8 bf16/fp16 elements as 4 words, never widened in memory ----

// The per-half unsigned max of two pairs of 16-bit values (one VIMNMX.U16x2 on sm_90).
ZC_HD u32 max_u16x2(u32 a, u32 b) {
#ifdef __CUDA_ARCH__
    return __vmaxu2(a, b);
#else
    const u32 lo = max_u32(a & 0xFFFFu, b & 0xFFFFu);
    const u32 hi = max_u32(a >> 16, b >> 16);
    return lo | (hi << 16);
#endif
}

// |x| of both halves of a word of 16-bit floats (the sign bits cleared). For bf16 and fp16
// alike the unsigned order of these bits is the order of |x|, +Inf above every finite value
// and every NaN above +Inf, as for abs_bits; the max of a run is max_u16x2 over its words.
constexpr u32 kAbs16x2Mask = 0x7FFF7FFFu;

// abs_bits of the larger half of a max_u16x2 result, as an fp32 value's (widening keeps
// the order: it is exact, and NaN stays NaN).
template <class H> ZC_HD u32 abs_bits_of_max16x2(u32 m) {
    const u32 lo = m & 0xFFFFu;
    const u32 hi = m >> 16;
    return abs_bits(to_float(H{static_cast<u16>(lo > hi ? lo : hi)}));
}

// Element 2k (low half) and 2k + 1 (high half) of a raw word, widened to fp32.
template <class H> ZC_HD float raw_low(u32 w) { return to_float(H{static_cast<u16>(w & 0xFFFFu)}); }
template <class H> ZC_HD float raw_high(u32 w) { return to_float(H{static_cast<u16>(w >> 16)}); }

// ---- codes: 8 quantized values <-> packed bytes ----
// INT8: element k is byte k (two's complement). INT4: element k is nibble k of one word,
// i.e. element 2i in the low nibble of byte i (the wire format's rule).

template <int BITS> struct Codes8;

template <> struct Codes8<8> {
    static constexpr int kWords = 2;
    ZC_HD static void pack(const int (&q)[8], u32 (&w)[kWords]) {
        w[0] = w[1] = 0;
        for (int k = 0; k < 8; ++k) w[k / 4] |= (static_cast<u32>(q[k]) & 0xFFu) << (8 * (k % 4));
    }
    ZC_HD static void unpack(const u32 (&w)[kWords], int (&q)[8]) {
        for (int k = 0; k < 8; ++k) q[k] = static_cast<signed char>((w[k / 4] >> (8 * (k % 4))) & 0xFFu);
    }
};

ZC_HD int sign_extend_nibble(u32 nibble) { return static_cast<int>(nibble ^ 8u) - 8; }

template <> struct Codes8<4> {
    static constexpr int kWords = 1;
    ZC_HD static void pack(const int (&q)[8], u32 (&w)[kWords]) {
        w[0] = 0;
        for (int k = 0; k < 8; ++k) w[0] |= (static_cast<u32>(q[k]) & 0xFu) << (4 * k);
    }
    ZC_HD static void unpack(const u32 (&w)[kWords], int (&q)[8]) {
        for (int k = 0; k < 8; ++k) q[k] = sign_extend_nibble((w[0] >> (4 * k)) & 0xFu);
    }
};

// A 32-bit word at any byte address: payload buffers may be byte-offset views, so the
// scales are read and written word-wise only when the address allows it.
ZC_HD u32 load_u32(const u8* p, bool word_aligned) {
    if (word_aligned) {
        u32 w[1];
        load_words(w, p);
        return w[0];
    }
    return static_cast<u32>(p[0]) | (static_cast<u32>(p[1]) << 8) | (static_cast<u32>(p[2]) << 16) |
           (static_cast<u32>(p[3]) << 24);
}

ZC_HD void store_u32(u8* p, u32 value, bool word_aligned) {
    if (word_aligned) {
        const u32 w[1] = {value};
        store_words(p, w);
        return;
    }
    for (int k = 0; k < 4; ++k) p[k] = static_cast<u8>(value >> (8 * k));
}

// One code of element j of a payload's value bytes (scalar path).
template <int BITS> ZC_HD int load_code(const u8* values, i64 j) {
    if constexpr (BITS == 8) {
        return static_cast<signed char>(values[j]);
    } else {
        const u32 byte = values[j >> 1];
        return sign_extend_nibble((j & 1) ? (byte >> 4) : (byte & 0xFu));
    }
}

}  // namespace zc
