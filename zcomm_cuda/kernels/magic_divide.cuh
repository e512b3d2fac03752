// Division by a launch constant with a multiplication: the reordering sources' index arithmetic.
//
// [Note: magic division] A source that maps an element index n to its slice (n / slice) and
// its part (e / part) divides by constants of the launch. A 64-bit integer division is a
// long SASS subroutine, and even a 32-bit one is a dozen instructions; per run of 8 elements
// that costs more than quantizing them. Instead the launcher (reorder_quantize in
// zcomm/quant/backends/_cuda_launch.py, magic_divisor) computes for each divisor d >= 1, once
// per sizes,
//     l = ceil(log2(d)),  m = ceil(2^(N + l) / d),
// where N = 31 on the 32-bit path and 63 on the 64-bit path, and the kernel takes
//     n / d = floor(n * m / 2^(N + l)) = mul_high(2n, m) >> l
// (mul_high: the high word of the 2W-bit product of two W-bit words, W = N + 1; 2n < 2^W).
// Exact for every 0 <= n < 2^N (Granlund and Montgomery's round-up method): m * d = 2^(N+l) + e
// with 0 <= e <= d - 1 < 2^l (d <= 2^l), so n * m / 2^(N+l) = n/d + n * e / (d * 2^(N+l)), and
// n * e < 2^N * 2^l makes the error term below 1/d. With n = q * d + r (0 <= r <= d - 1) the
// sum is q + (r + something below 1) / d, below q + 1: the floor is q. The multiplier fits
// one word, m < 2^W: for d = 2^l it is 2^N; otherwise 2^(l-1) < d < 2^l (so l >= 2 and
// 2d - 2^l >= 2), and 2^W - 2^(N+l)/d = 2^N (2d - 2^l) / d >= 2^(N+1) / d > 1 for d <= 2^N,
// so the ceiling stays below 2^W. l <= N < W keeps the shift inside the word.
//
// Which path a launch takes is chosen once per launch from its element count (numel =
// chunk_numel * num_chunks): every index a source divides or offsets (the logical index j,
// the interleaved index e, the position t in a part, an offset into one tensor) is below
// numel, so numel <= 2^31 lets every one of them, and 2n, live in 32 bits; larger inputs take
// the 64-bit words. tests/quant/test_cuda_host_math.py checks the launcher's multipliers and
// this header's quotients against Python's integer division at the ends of both ranges.
#pragma once

#include "wire_math.cuh"

namespace zc {

using u64 = unsigned long long;

// The index word of a path: 32 bits, or 64 for inputs of more than 2^31 elements.
template <bool WIDE> struct IndexWord { using type = u32; };
template <> struct IndexWord<true> { using type = u64; };

ZC_HD u32 mul_high(u32 a, u32 b) {
#ifdef __CUDA_ARCH__
    return __umulhi(a, b);
#else
    return static_cast<u32>((static_cast<u64>(a) * b) >> 32);
#endif
}

ZC_HD u64 mul_high(u64 a, u64 b) {
#ifdef __CUDA_ARCH__
    return __umul64hi(a, b);
#else
    return static_cast<u64>((static_cast<unsigned __int128>(a) * b) >> 64);
#endif
}

// A divisor d with its multiplier and shift ([Note: magic division]); quotient(n) needs n < 2^N.
template <bool WIDE> struct MagicDivisor {
    using U = typename IndexWord<WIDE>::type;
    U divisor;
    U magic;
    int shift;

    ZC_HD MagicDivisor(i64 divisor_, u64 magic_, int shift_)
        : divisor(static_cast<U>(divisor_)), magic(static_cast<U>(magic_)), shift(shift_) {}
    ZC_HD U quotient(U n) const { return mul_high(n + n, magic) >> shift; }
};

}  // namespace zc
