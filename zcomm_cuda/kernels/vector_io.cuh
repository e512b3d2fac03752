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
    for (int k = 0; k < 4; ++k) w[k] = from_float2<H>(v[2 * k], v[2 * k + 1]);  // [Note: hardware narrowing]
    store_words(p, w);
}

// store8 for 8 values none of which is a NaN ([Note: NaN groups] in run_decoder.cuh): the
// narrowing without its NaN fix-up ([Note: NaN-free narrowing]); fp32 values as they are
// (canonicalize is the identity on numbers).
ZC_HD void store8_numbers(float* p, const float (&v)[8]) {
    for (int half = 0; half < 2; ++half) {
        u32 w[4];
        for (int k = 0; k < 4; ++k) {
            expect_number(v[4 * half + k]);
            w[k] = float_bits(v[4 * half + k]);
        }
        store_words(p + 4 * half, w);
    }
}

template <class H> ZC_HD void store8_numbers(H* p, const float (&v)[8]) {
    u32 w[4];
    for (int k = 0; k < 4; ++k) w[k] = from_float2_of_numbers<H>(v[2 * k], v[2 * k + 1]);
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

// [Note: magic decode] The reverse of [Note: plain scales]' rounding magic, with no
// integer-to-float conversion (I2F, quarter rate on sm_90). A code c of `width` bits is
// stored biased, u = c + b in [0, 2b) (b = 2^(width - 1): the two's-complement bits with
// the top bit flipped, one XOR per word). Put u at bits [pos, pos + width) of the float
// M = 1.5 * 2^(23 - pos) (exponent 23 - pos, mantissa bit 22 set, zero below; pos + width
// <= 16 here), whose unit is bit pos: the float is M + u exactly, and subtracting M + b
// (exact in fp32) leaves c with no rounding (the difference of two floats of one binade,
// a small integer), +0 for c = 0 as the conversion gives. INT8: a byte permute builds
// [byte k, M's upper three bytes] (M = 1.5 * 2^23, pos 0); INT4: a mask-and-or puts
// nibble k of the word (or of the word shifted down 16 bits, for k >= 4) at pos 4 * (k % 4).
// Per code two instructions (PRMT or LOP3, then FADD) where the conversion took two or
// three, one of them the quarter-rate I2F.
ZC_HD float magic_minus(u32 bits, int pos, int width) {
    const u32 magic = ((127u + 23u - static_cast<u32>(pos)) << 23) | 0x400000u;
    return add_rn(bits_float(bits), -bits_float(magic + ((1u << (width - 1)) << pos)));
}

// The float bits M | (word & mask) of [Note: magic decode] (mask: the code's bits at pos).
ZC_HD u32 magic_or(u32 word, u32 mask, int pos) {
    const u32 magic = ((127u + 23u - static_cast<u32>(pos)) << 23) | 0x400000u;
    return (word & mask) | magic;
}

// __byte_perm(x, y, selector): byte i of the result is byte (selector >> 4i) & 7 of the
// 8-byte value y:x. The host emulates it, so the host check runs the same selectors.
ZC_HD u32 byte_perm(u32 x, u32 y, u32 selector) {
#ifdef __CUDA_ARCH__
    return __byte_perm(x, y, selector);
#else
    const unsigned long long both = (static_cast<unsigned long long>(y) << 32) | x;
    u32 r = 0;
    for (int i = 0; i < 4; ++i) r |= static_cast<u32>((both >> (8 * ((selector >> (4 * i)) & 7u))) & 0xFFu) << (8 * i);
    return r;
#endif
}
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
    // The codes as exact fp32 values, without an integer-to-float conversion: [Note: magic decode].
    ZC_HD static void to_floats(const u32 (&w)[kWords], float (&f)[8]) {
        for (int i = 0; i < kWords; ++i) {
            const u32 biased = w[i] ^ 0x80808080u;  // each byte c + 128, in [0, 255]
            for (int k = 0; k < 4; ++k) {
                // [byte k of biased, bytes 1..3 of M = 0x4B400000] (y's bytes are 4..7)
                f[4 * i + k] = magic_minus(byte_perm(biased, kF32RoundingMagic, 0x7650u | static_cast<u32>(k)), 0, 8);
            }
        }
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
    // The codes as exact fp32 values: see [Note: magic decode].
    ZC_HD static void to_floats(const u32 (&w)[kWords], float (&f)[8]) {
        const u32 biased = w[0] ^ 0x88888888u;  // each nibble c + 8, in [0, 15]
        const u32 high = biased >> 16;
        for (int k = 0; k < 8; ++k) {
            const int pos = 4 * (k % 4);
            f[k] = magic_minus(magic_or(k < 4 ? biased : high, 0xFu << pos, pos), pos, 4);
        }
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
