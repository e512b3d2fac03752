// Value sources: where the group encoder and the run decoder get their fp32 inputs.
//
// A source maps a logical element index j (over the concatenation of all output payloads)
// to an fp32 value, one at a time (load1) or as a run of 8 (load8, only when its
// can_vectorize() holds and j is a multiple of 8). Four sources cover the four ops:
//   FlatSource      x[j]                                  (quantize)
//   PermutedSource  x[perm[j / slice] * slice + j % slice] (reorder_quantize: the
//                   reordered tensor is never materialized)
//   InterleavedSource  the same through the interleaving of several tensors and a zero
//                   fill (reorder_quantize of a list, or with part_numel > the pieces)
//   PayloadSum      sum over k payload rows of the dequantized element j, then the
//                   divisor (dequantize with k = 1, dequant_reduce)
#pragma once

#include "vector_io.cuh"

namespace zc {

// [Note: raw runs] Sources of bf16/fp16 elements straight from a tensor (kRaw16) also give
// a run of 8 as its 4 raw words (load_raw8, same conditions as load8): the encoder holds
// those (half the registers of 8 floats), takes the absmax on the 16-bit halves
// (max_u16x2) and widens each element only when it quantizes it.
template <class T> struct FlatSource {
    using Element = T;
    static constexpr bool kRaw16 = sizeof(T) == 2;
    static constexpr bool kLaneRuns = false;  // [Note: rows outer]
    const T* x;

    ZC_HD bool can_vectorize() const { return aligned(x, 16); }
    ZC_HD float load1(i64 j) const { return to_float(x[j]); }
    ZC_HD void load8(i64 j, float (&v)[8]) const { zc::load8(x + j, v); }
    ZC_HD void load_raw8(i64 j, u32 (&w)[4]) const { load_words(w, x + j); }
};

template <class T> struct PermutedSource {
    using Element = T;
    static constexpr bool kRaw16 = sizeof(T) == 2;  // [Note: raw runs]
    static constexpr bool kLaneRuns = false;  // [Note: rows outer]
    const T* x;
    const i64* perm;  // output slice p is input slice perm[p]
    i64 slice_numel;

    ZC_HD i64 source_index(i64 j) const { return perm[j / slice_numel] * slice_numel + j % slice_numel; }
    // A run of 8 stays inside one slice when slices are whole runs.
    ZC_HD bool can_vectorize() const { return aligned(x, 16) && slice_numel % 8 == 0; }
    ZC_HD float load1(i64 j) const { return to_float(x[source_index(j)]); }
    ZC_HD void load8(i64 j, float (&v)[8]) const { zc::load8(x + source_index(j), v); }
    ZC_HD void load_raw8(i64 j, u32 (&w)[4]) const { load_words(w, x + source_index(j)); }
};

// reorder_quantize's interleaved input v ([Note: interleaved input] in zcomm/quant/_contract.py)
// read through the permutation. Element j of the reordered tensor is element
// e = perm[j / slice] * slice + j % slice of v; e lies in part r = e / part_numel at position
// t = e % part_numel, which is tensor k's element r * width_k + t - begin_k for the tensor
// whose piece [begin_k, end_k) of the part holds t (a binary search over the ends), or the
// zero fill past the last piece. The table is 3 i64 per tensor: its address, width, end.
template <class T> struct InterleavedSource {
    static constexpr bool kRaw16 = false;  // runs are checked one by one in load8
    static constexpr bool kLaneRuns = false;  // [Note: rows outer]
    const i64* table;
    i64 tensors;
    i64 part_numel;
    const i64* perm;  // output slice p is v's slice perm[p]
    i64 slice_numel;

    // The address of element j (nullptr in the fill), and in `run` how many elements from j
    // on are contiguous there (the rest of j's slice, part and piece).
    ZC_HD const T* locate(i64 j, i64& run) const {
        const i64 offset = j % slice_numel;
        const i64 e = perm[j / slice_numel] * slice_numel + offset;
        const i64 part = e / part_numel;
        const i64 t = e % part_numel;
        run = slice_numel - offset < part_numel - t ? slice_numel - offset : part_numel - t;
        i64 lo = 0, hi = tensors;  // the first tensor whose piece ends after t
        while (lo < hi) {
            const i64 mid = (lo + hi) / 2;
            if (table[3 * mid + 2] > t) hi = mid; else lo = mid + 1;
        }
        if (lo == tensors) return nullptr;
        const i64 width = table[3 * lo + 1];
        const i64 end = table[3 * lo + 2];
        if (end - t < run) run = end - t;
        const T* x = reinterpret_cast<const T*>(static_cast<unsigned long long>(table[3 * lo]));
        return x + part * width + (t - (end - width));
    }
    // Each run of 8 is checked in load8: whole in one piece (or the fill) and aligned, or scalar.
    ZC_HD bool can_vectorize() const { return true; }
    ZC_HD float load1(i64 j) const {
        i64 run;
        const T* p = locate(j, run);
        return p != nullptr ? to_float(*p) : 0.0f;
    }
    ZC_HD void load8(i64 j, float (&v)[8]) const {
        i64 run;
        const T* p = locate(j, run);
        if (run >= 8 && p != nullptr && aligned(p, 16)) {
            zc::load8(p, v);
        } else if (run >= 8 && p == nullptr) {
            for (int k = 0; k < 8; ++k) v[k] = 0.0f;
        } else {
            for (int k = 0; k < 8; ++k) v[k] = load1(j + k);
        }
    }
};

// k payloads of `numel` elements each, stacked as rows of `stride` bytes.
template <int BITS> struct PayloadRows {
    const u8* base;
    i64 stride;
    i64 numel;
    i64 group_size;

    ZC_HD const u8* row(i64 r) const { return base + r * stride; }
    ZC_HD bool words_aligned() const { return aligned(base, 4) && stride % 4 == 0; }
    // Runs of 8 codes are 8 (INT8) or 4 (INT4) bytes and share one scale.
    // [Note: vector scales] This implies words_aligned() (base and stride multiples of 4),
    // so the vector paths read scales as words with no run-time test of the alignment.
    ZC_HD bool can_vectorize() const {
        constexpr int run_bytes = 4 * Codes8<BITS>::kWords;
        return group_size % 8 == 0 && aligned(base, run_bytes) && stride % run_bytes == 0;
    }
    // The scale of group `group` of a row.
    ZC_HD float scale(const u8* row_bytes, i64 group, bool word_aligned) const {
        const u8* slot = row_bytes + scales_offset(numel, BITS) + 4 * group;
        return bits_float(load_u32(slot, word_aligned));
    }
    ZC_HD float value1(const u8* row_bytes, i64 j, bool word_aligned) const {
        return dequantize_value(load_code<BITS>(row_bytes, j), scale(row_bytes, j / group_size, word_aligned));
    }
    // Elements [j, j + 8) of a row, times `s`, the dequantize_scale of their group.
    ZC_HD void scaled8(const u8* row_bytes, i64 j, float s, float (&v)[8]) const {
        u32 w[Codes8<BITS>::kWords];
        load_words(w, row_bytes + j / Bits<BITS>::kElementsPerByte);
        float q[8];
        Codes8<BITS>::to_floats(w, q);
        for (int k = 0; k < 8; ++k) v[k] = mul_rn(q[k], s);
    }
    // Elements [j, j + 8), all in group `group`. HOISTED tests the scale once per run
    // (dequantize_scale) instead of per element: the loops whose divisor mode is fixed (the
    // team decoders, the re-quantizing kernels' streamed and tile paths) take it; the run
    // decoder (kAnyDivisor) keeps the per-element select.
    template <bool HOISTED>
    ZC_HD void value8(const u8* row_bytes, i64 j, i64 group, bool word_aligned, float (&v)[8]) const {
        u32 w[Codes8<BITS>::kWords];
        load_words(w, row_bytes + j / Bits<BITS>::kElementsPerByte);
        float q[8];
        Codes8<BITS>::to_floats(w, q);
        const float s = scale(row_bytes, group, word_aligned);
        if constexpr (HOISTED) {
            const float finite_or_nan = dequantize_scale(s);
            for (int k = 0; k < 8; ++k) v[k] = mul_rn(q[k], finite_or_nan);
        } else {
            for (int k = 0; k < 8; ++k) v[k] = is_finite(s) ? mul_rn(q[k], s) : canonical_nan();
        }
    }
};

// How PayloadSum divides: decided per element at run time (kAnyDivisor), or fixed by the
// caller who has checked the divisor once (kByReciprocal: a power of two, [Note: exact
// reciprocal]; kByDivision: any other; kByOne: 1, where x * 1 is x for every x, so there
// is nothing to do), so that the main loop holds one of them only.
enum DivisorMode : int { kAnyDivisor = 0, kByReciprocal = 1, kByDivision = 2, kByOne = 3 };

// The mode a caller that checks the divisor once picks for it.
ZC_HD int divisor_mode(float divisor) {
    float reciprocal;
    if (float_bits(divisor) == kF32One) return kByOne;
    return exact_reciprocal(divisor, reciprocal) ? kByReciprocal : kByDivision;
}

// Rows [first_row, first_row + count) summed in row order, starting from the first row's
// value (no leading 0 +, which would turn -0 into +0), then divided once by `divisor`.
template <int BITS, int MODE = kAnyDivisor> struct PayloadSum {
    static constexpr bool kRaw16 = false;
    static constexpr bool kLaneRuns = true;  // [Note: rows outer]
    PayloadRows<BITS> rows;
    i64 first_row;
    i64 count;
    float divisor;
    bool word_aligned;
    bool by_reciprocal;  // the divisor is a power of two: `divisor` holds its exact reciprocal

    int group_shift;     // log2(group_size) when it is a power of two, else -1

    ZC_HD PayloadSum(const PayloadRows<BITS>& rows_, i64 first_row_, i64 count_, float divisor_)
        : rows(rows_), first_row(first_row_), count(count_), divisor(divisor_), word_aligned(rows_.words_aligned()),
          group_shift(-1) {
        float reciprocal = 1.0f;
        by_reciprocal = exact_reciprocal(divisor_, reciprocal);
        if (by_reciprocal) divisor = reciprocal;
        for (int shift = 0; shift < 63; ++shift) {
            if ((i64{1} << shift) == rows_.group_size) group_shift = shift;
        }
    }

    ZC_HD bool can_vectorize() const { return rows.can_vectorize(); }

    // The division by a power of two (the mean over 2^n ranks, or 1 for a plain sum) is a
    // multiplication by its exact reciprocal, byte for byte the same ([Note: exact
    // reciprocal]); any other divisor keeps the IEEE division per element. A NaN keeps
    // whatever payload it has: [Note: decoded NaN].
    ZC_HD float finish(float acc) const {
        if constexpr (MODE == kByOne) return acc;  // NaN payloads may differ: [Note: decoded NaN]
        if constexpr (MODE == kByReciprocal) return mul_rn(acc, divisor);
        if constexpr (MODE == kByDivision) return div_rn(acc, divisor);
        return by_reciprocal ? mul_rn(acc, divisor) : div_rn(acc, divisor);
    }

    ZC_HD float load1(i64 j) const {
        float acc = rows.value1(rows.row(first_row), j, word_aligned);
        for (i64 r = 1; r < count; ++r) acc = add_rn(acc, rows.value1(rows.row(first_row + r), j, word_aligned));
        return finish(acc);
    }

    // [Note: rows outer] The re-quantizing encoder holds one lane's runs of a group at
    // elements first + 8 * (lane + lanes * i), i < N (those below len), in registers. Run by
    // run (load8), each run would cost a 64-bit division for its input group and one scale
    // load per row. Instead the job's input group is found once (a shift when the group
    // size is a power of two), and the rows are the outer loop: per row, one scale load per
    // input group the job touches (at most two: the output group is no longer than an input
    // group, and when chunks are not whole groups it may cross one boundary, at `split`),
    // then every run's codes. Each element still sums its rows in row order from the first
    // row's value, and finish() runs last, so the values are load8's bit for bit. The
    // scale's NaN/Inf test is once per row and group (dequantize_scale): a NaN element's
    // payload may then differ from dequantize_value's, which the encoder cannot see
    // ([Note: decoded NaN]). Requires the vector conditions (runs whole and aligned).
    template <int N>
    ZC_HD void load_runs(i64 first, int lane, int lanes, int len, float (&v)[N][8]) const {
        const i64 gs = rows.group_size;
        const i64 group = group_shift >= 0 ? first >> group_shift : first / gs;
        const i64 rest = gs - (first - group * gs);  // elements left in the input group
        const int split = rest < len ? static_cast<int>(rest) : len;
        const u8* row_bytes = rows.row(first_row);
        add_row_runs<true>(row_bytes, first, group, split, lane, lanes, len, v);
        for (i64 r = 1; r < count; ++r) {
            row_bytes += rows.stride;
            add_row_runs<false>(row_bytes, first, group, split, lane, lanes, len, v);
        }
#pragma unroll  // [Note: held runs] in group_encoder.cuh
        for (int i = 0; i < N; ++i) {
            for (int k = 0; k < 8; ++k) v[i][k] = finish(v[i][k]);
        }
    }

    // One row's values of the lane's runs, stored (FIRST) or added to v (see [Note: rows outer]).
    template <bool FIRST, int N>
    ZC_HD void add_row_runs(const u8* row_bytes, i64 first, i64 group, int split, int lane, int lanes, int len,
                            float (&v)[N][8]) const {
        const float head = dequantize_scale(rows.scale(row_bytes, group, true));  // [Note: vector scales]
        const float tail = split < len ? dequantize_scale(rows.scale(row_bytes, group + 1, true)) : head;
        const u8* values = row_bytes + first / Bits<BITS>::kElementsPerByte;
#pragma unroll  // [Note: held runs] in group_encoder.cuh
        for (int i = 0; i < N; ++i) {
            const int e = 8 * (lane + lanes * i);
            if (e < len) {
                u32 w[Codes8<BITS>::kWords];
                load_words(w, values + e / Bits<BITS>::kElementsPerByte);
                float q[8];
                Codes8<BITS>::to_floats(w, q);
                const float s = e < split ? head : tail;
                for (int k = 0; k < 8; ++k) {
                    const float d = mul_rn(q[k], s);
                    v[i][k] = FIRST ? d : add_rn(v[i][k], d);
                }
            }
        }
    }

    // A run of 8 lies in one input group (can_vectorize: group_size % 8 == 0), whose index
    // is computed once for all rows.
    ZC_HD void load8(i64 j, float (&v)[8]) const { load8_in_group(j, j / rows.group_size, v); }

    // load8 of a run the caller knows to lie in input group `group`.
    ZC_HD void load8_in_group(i64 j, i64 group, float (&v)[8]) const {
        constexpr bool hoisted = MODE != kAnyDivisor;  // see value8
        // a vector path: [Note: vector scales]
        rows.template value8<hoisted>(rows.row(first_row), j, group, true, v);
        for (i64 r = 1; r < count; ++r) {
            float d[8];
            rows.template value8<hoisted>(rows.row(first_row + r), j, group, true, d);
            for (int k = 0; k < 8; ++k) v[k] = add_rn(v[k], d[k]);
        }
        for (int k = 0; k < 8; ++k) v[k] = finish(v[k]);
    }
};

}  // namespace zc
