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

#include "magic_divide.cuh"
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

// [Note: reordering sources] PermutedSource and InterleavedSource take their index word
// (32 or 64 bits) and divide by the slice and part sizes through [Note: magic division]; the
// kernel picks the word once per launch. Neither divides per run.
template <class T, bool WIDE = false> struct PermutedSource {
    using Element = T;
    using U = typename IndexWord<WIDE>::type;
    static constexpr bool kRaw16 = sizeof(T) == 2;  // [Note: raw runs]
    static constexpr bool kLaneRuns = false;  // [Note: rows outer]
    const T* x;
    const i64* perm;  // output slice p is input slice perm[p]
    MagicDivisor<WIDE> slice;

    ZC_HD U source_index(i64 j) const {
        const U n = static_cast<U>(j);
        const U q = slice.quotient(n);
        return permuted(perm, q) * slice.divisor + (n - q * slice.divisor);
    }
    // A run of 8 stays inside one slice when slices are whole runs.
    ZC_HD bool can_vectorize() const { return aligned(x, 16) && slice.divisor % 8 == 0; }
    ZC_HD float load1(i64 j) const { return to_float(x[source_index(j)]); }
    ZC_HD void load8(i64 j, float (&v)[8]) const { zc::load8(x + source_index(j), v); }
    ZC_HD void load_raw8(i64 j, u32 (&w)[4]) const { load_words(w, x + source_index(j)); }

    // perm[q]: a slice index, below len(perm) <= numel, so on the 32-bit path its low word.
    ZC_HD static U permuted(const i64* perm, U q) { return static_cast<U>(perm[q]); }
};

// reorder_quantize's interleaved input v ([Note: interleaved input] in zcomm/quant/_contract.py)
// read through the permutation. Element j of the reordered tensor is element
// e = perm[j / slice] * slice + j % slice of v; e lies in part r = e / part_numel at position
// t = e % part_numel, which is tensor k's element r * width_k + t - begin_k for the tensor
// whose piece [begin_k, end_k) of the part holds t (a binary search over the ends), or the
// zero fill past the last piece. The table ([Note: interleaved table] in
// zcomm/quant/backends/_cuda_launch.py) is 3 i64 per tensor, its address, width and end,
// then, at the next 16-byte boundary, 32 zero bytes: the fill's run of 8.
//
// [Note: stretches] Each thread remembers the stretch it located last: the elements from
// `first_` on that lie contiguous in one piece (the rest of j's slice, part and piece), at
// the address base_ + j * sizeof(T) (the base may lie below the buffer: it is only ever
// offset back into the stretch). In the fill a stretch is at most 8 elements, read from the
// zero run after the table's entries.
// A run of 8 inside it (one unsigned compare of j - first_, which wraps for j < first_)
// whose base is 16-byte aligned (then so is every run's address: j * size is a multiple of
// 16) is one vector load, with no division, search or table read. A lane's runs of a group
// usually share a stretch. Any other run (load_run) is located anew if it starts outside the
// stretch (two multiplications for the divisions, one perm read and a binary search over the
// table), then loaded as one vector if the new stretch serves it, else element by element,
// locating each stretch it enters: runs crossing a slice, part or piece end, or off the
// vector alignment. The runs a lane loads are its own, so the stretch is per thread
// (mutable: the encoders hold the source as const).
//
// [Note: round stretch] The register encoder's lane loads its runs of a group through
// load_runs. The team walk moves a lane a grid's worth of groups ahead each round (millions
// of elements at one wave), past the end of most stretches, so a lane locates its first run
// every round: that locate is part of the round loop's hot path, once per lane and group.
// (Testing the remembered stretch first saves a locate in the few rounds it serves, but
// keeps it in registers across rounds: about one more instruction per element in the loop.)
// After it one test covers all the lane's runs: when the stretch serves the group's last run
// as a vector load, it serves every run of the lane in between, and the runs are loaded with
// no further test. Only a group that straddles a stretch end, lies in the fill or off the
// vector alignment takes load_straddling, one rolled copy of load_run out of the hot path.
// That path is rare only where every width, the part and the slice sizes are multiples of
// 8 elements (16-byte stretches); where pieces and slices are whole groups (zero_runtime's
// parameter-aligned buckets whose stage parts are whole groups: [Note: parameter-aligned
// blocks] in zero_runtime/_flat_buffer.py) no group takes it. One width or slice size off a
// multiple of 8 puts the stretches after it off the alignment: then most groups take it
// (element by element, as any run off the alignment always did).
template <class T, bool WIDE = false> struct InterleavedSource {
    using Element = T;
    using U = typename IndexWord<WIDE>::type;
    static constexpr bool kRaw16 = false;  // runs are checked one by one
    static constexpr bool kLaneRuns = true;  // load_runs
    const i64* table;
    U tensors;
    MagicDivisor<WIDE> part;
    const i64* perm;  // output slice p is v's slice perm[p]
    MagicDivisor<WIDE> slice;
    mutable U first_ = 0;   // the stretch: [first_, first_ + len_) at base_ + j * sizeof(T)
    mutable U len_ = 0;
    mutable U vlen_ = 0;    // len_ - 7 when base_ is 16-byte aligned and len_ >= 8, else 0
    mutable u64 base_ = 0;

    ZC_HD InterleavedSource(const i64* table_, i64 tensors_, MagicDivisor<WIDE> part_, const i64* perm_,
                            MagicDivisor<WIDE> slice_)
        : table(table_), tensors(static_cast<U>(tensors_)), part(part_), perm(perm_), slice(slice_) {}

    // Locates element n's stretch (see [Note: stretches]).
    ZC_HD void locate(U n) const {
        const U q = slice.quotient(n);
        const U offset = n - q * slice.divisor;
        const U e = PermutedSource<T, WIDE>::permuted(perm, q) * slice.divisor + offset;
        const U r = part.quotient(e);
        const U t = e - r * part.divisor;
        U len = slice.divisor - offset < part.divisor - t ? slice.divisor - offset : part.divisor - t;
        U lo = 0, hi = tensors;  // the first tensor whose piece ends after t
        while (lo < hi) {
            const U mid = (lo + hi) / 2;
            if (static_cast<U>(table[3 * mid + 2]) > t) hi = mid; else lo = mid + 1;
        }
        u64 address;
        if (lo < tensors) {
            const U width = static_cast<U>(table[3 * lo + 1]);
            const U end = static_cast<U>(table[3 * lo + 2]);
            if (end - t < len) len = end - t;
            address = static_cast<u64>(table[3 * lo]) + sizeof(T) * static_cast<u64>(r * width + t - (end - width));
        } else {  // the fill: the zero run after the table's entries, at most 8 elements at a time
            address = (reinterpret_cast<u64>(table) + 24 * static_cast<u64>(tensors) + 15) & ~u64{15};
            if (len > 8) len = 8;
        }
        first_ = n;
        len_ = len;
        base_ = address - sizeof(T) * static_cast<u64>(n);
        vlen_ = base_ % 16 == 0 && len >= 8 ? len - 7 : 0;
    }
    ZC_HD const T* at(U n) const { return reinterpret_cast<const T*>(base_ + sizeof(T) * static_cast<u64>(n)); }

    ZC_HD bool can_vectorize() const { return true; }  // each run is checked where it is loaded
    ZC_HD float load1(i64 j) const {
        const U n = static_cast<U>(j);
        if (n - first_ >= len_) locate(n);
        return to_float(*at(n));
    }
    ZC_HD void load8(i64 j, float (&v)[8]) const {
        const U n = static_cast<U>(j);
        if (n - first_ < vlen_) {
            zc::load8(at(n), v);
        } else {
            load_run(n, v);
        }
    }
    // The register encoder's runs of a lane (see [Note: rows outer] for the layout): the lane
    // locates the stretch of its first run ([Note: round stretch]), and when that stretch
    // serves every run up to the group's last as vector loads, loads them with no further
    // test; otherwise (the group straddles a stretch end, or the stretch is off the vector
    // alignment or in the fill) load_straddling loads them.
    template <int N>
    ZC_HD void load_runs(i64 first, int lane, int lanes, int len, float (&v)[N][8]) const {
        if (8 * lane >= len) return;  // the lane holds no run of this group
        const U n0 = static_cast<U>(first) + 8 * static_cast<U>(lane);
        const U step = 8 * static_cast<U>(lanes);
        locate(n0);
        // first_ = n0 <= the group's last run: the stretch serves every run between them when
        // it serves the last one
        if (static_cast<U>(first) + static_cast<U>(len - 8) - first_ < vlen_) {
#pragma unroll  // [Note: held runs] in group_encoder.cuh
            for (int i = 0; i < N; ++i) {
                if (8 * (lane + lanes * i) < len) zc::load8(at(n0 + step * i), v[i]);
            }
        } else {
            load_straddling(n0, step, lane, lanes, len, v);
        }
    }
    // The lane's runs one at a time, each by the general path (load_run): the runs rotate
    // through v[N - 1] (N rotations bring each back to its place), so that the loop stays
    // rolled and v is indexed by constants.
    template <int N>
    ZC_HD void load_straddling(U n0, U step, int lane, int lanes, int len, float (&v)[N][8]) const {
#pragma unroll 1
        for (int i = 0; i < N; ++i) {
            for (int k = 0; k < 8; ++k) {
                const float front = v[0][k];
                for (int m = 0; m < N - 1; ++m) v[m][k] = v[m + 1][k];
                v[N - 1][k] = front;
            }
            // v[N - 1] now holds run i
            if (8 * (lane + lanes * i) < len) load_run(n0 + step * i, v[N - 1]);
        }
    }
    // A run that its stretch does not serve as one vector load: located anew if it starts
    // outside the stretch, then one vector load if the new stretch serves it, else element by
    // element (locating each stretch the run enters). Each value is shifted in at the end, so
    // that the loop stays rolled (one locate in it) and v is indexed by constants.
    ZC_HD void load_run(U n, float (&v)[8]) const {
#pragma unroll 1
        for (U k = 0; k < 8; ++k) {
            if (n + k - first_ >= len_) locate(n + k);
            if (k == 0 && n - first_ < vlen_) {
                zc::load8(at(n), v);
                return;
            }
            const float value = to_float(*at(n + k));
            for (int m = 0; m < 7; ++m) v[m] = v[m + 1];
            v[7] = value;
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

// How many of a lane's runs (at elements 8 * (lane + lanes * i), i < N) start before `end`:
// the runs a job holds (end = its length) or those before an input group's end (end =
// split). Since a lane's runs increase with i, run i is among them exactly when i is below
// the count, which add_row_runs tests against constants.
template <int N> ZC_HD int runs_before(int end, int lane, int lanes) {
    int runs = 0;
#pragma unroll
    for (int i = 0; i < N; ++i) runs += 8 * (lane + lanes * i) < end ? 1 : 0;
    return runs;
}

// One row's values of a lane's runs ([Note: rows outer] in PayloadSum), stored (FIRST) or
// added to v: runs i < `runs` at elements 8 * (lane + lanes * i) of a job whose codes start
// `values` bytes into the row; runs i < `head_runs` take the scale that is the word `head`
// bytes into the row, the others the next word (runs_before counts both). U is the offsets'
// word (i64, or u32 for the narrow kernel: [Note: narrow requant] in requant_rounds.cuh).
template <int BITS, bool FIRST, class U, int N>
ZC_HD void add_row_runs(const u8* row_bytes, U values, U head, int runs, int head_runs, int lane, int lanes,
                        float (&v)[N][8]) {
    const float head_scale = dequantize_scale(bits_float(load_u32(row_bytes + head, true)));  // [Note: vector scales]
    const float tail_scale =
        head_runs < runs ? dequantize_scale(bits_float(load_u32(row_bytes + head + 4, true))) : head_scale;
    constexpr int per_byte = Bits<BITS>::kElementsPerByte;
    const u8* codes = row_bytes + values + static_cast<U>(8 / per_byte * lane);  // run i: + i * step
    const U step = static_cast<U>(8 / per_byte * lanes);
#pragma unroll  // [Note: held runs] in group_encoder.cuh
    for (int i = 0; i < N; ++i, codes += step) {
        if (i < runs) {
            u32 w[Codes8<BITS>::kWords];
            load_words(w, codes);
            float q[8];
            Codes8<BITS>::to_floats(w, q);
            const float s = i < head_runs ? head_scale : tail_scale;
            for (int k = 0; k < 8; ++k) {
                const float d = mul_rn(q[k], s);
                v[i][k] = FIRST ? d : add_rn(v[i][k], d);
            }
        }
    }
}

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
        const i64 values = first / Bits<BITS>::kElementsPerByte;
        const i64 head = scales_offset(rows.numel, BITS) + 4 * group;
        const int runs = runs_before<N>(len, lane, lanes);
        const int head_runs = runs_before<N>(split, lane, lanes);
        add_row_runs<BITS, true>(row_bytes, values, head, runs, head_runs, lane, lanes, v);
        for (i64 r = 1; r < count; ++r) {
            row_bytes += rows.stride;
            add_row_runs<BITS, false>(row_bytes, values, head, runs, head_runs, lane, lanes, v);
        }
#pragma unroll  // [Note: held runs] in group_encoder.cuh
        for (int i = 0; i < N; ++i) {
            for (int k = 0; k < 8; ++k) v[i][k] = finish(v[i][k]);
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
