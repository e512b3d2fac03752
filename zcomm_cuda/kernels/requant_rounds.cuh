// The re-quantizing dequant_reduce's register scheme on 32-bit indices: the kernels that the
// common sizes run (groups held in registers, at most 2^31 elements).
//
// [Note: narrow requant] A kernel runs with the registers of its most demanding path. The
// general re-quantizing kernel (dequant_reduce_requant.cu) holds every scheme (registers, streamed
// teams, tiles) for three divisor modes on 64-bit indices and needs more than 110
// registers: two blocks of 256 threads per SM on sm_90, where quantize runs four. The
// narrow kernels hold the register scheme alone, one kernel per divisor mode (one kernel
// holding the three loops needs some 30 registers more than any one of them), on 32-bit
// words: the team's held sums (RegisterLane), a cursor of 32-bit (row, group) pairs
// (NarrowJobCursor, team_walk.cuh), the spans of a vector layout (NarrowChunks), the rows'
// sums with 32-bit offsets and the input group by a multiplication (NarrowPayloadSum), and
// nothing the round can recompute cheaply ([Note: per-round lanes]) or read from its
// parameters ([Note: narrow sizes]): at most 72 registers, three blocks per SM, and 64
// for INT4 inputs, four.
// The arithmetic is the general kernel's: the same rows-outer sums (add_row_runs, shared
// with PayloadSum: [Note: rows outer] in sources.cuh), the same RegisterLane and team
// maximum, so the bytes are the same (the host check runs this kernel's cursor, spans and
// source against the reference). The launcher (dequant_reduce_requant in
// zcomm/quant/backends/_cuda_launch.py) picks it when the groups are held in registers, both
// buffers have the vector layout, the input has at most 2^31 elements (every element index,
// group index and byte offset in a row then fits 32 bits, and the multiplier's quotient is
// exact: [Note: magic division]), and by the divisor's mode (divisor_mode).
#pragma once

#include "group_encoder.cuh"

namespace zc {

// k payload rows of `numel` elements each, summed as PayloadSum sums them (see [Note: narrow
// requant]): every element index, byte offset in a row and group index is a u32; only the
// row addresses are 64-bit. The input group of an element is a multiplication by the
// launcher's multiplier for group_size ([Note: magic division]).
template <int BITS, int MODE> struct NarrowPayloadSum {
    static constexpr bool kRaw16 = false;
    static constexpr bool kLaneRuns = true;  // [Note: rows outer]
    const u8* base;
    u32 stride;   // bytes per row
    u32 count;    // rows
    u32 scales;   // scales_offset(numel, BITS): the first scale's offset in a row
    MagicDivisor<false> group;
    float divisor;  // kByReciprocal: its exact reciprocal

    ZC_HD NarrowPayloadSum(const u8* base_, i64 stride_, i64 scales_, i64 count_, MagicDivisor<false> group_,
                           float divisor_)
        : base(base_), stride(static_cast<u32>(stride_)), count(static_cast<u32>(count_)),
          scales(static_cast<u32>(scales_)), group(group_), divisor(divisor_) {
        float reciprocal;
        if (MODE == kByReciprocal && exact_reciprocal(divisor_, reciprocal)) divisor = reciprocal;
    }

    ZC_HD float finish(float acc) const {
        if constexpr (MODE == kByOne) return acc;  // NaN payloads may differ: [Note: decoded NaN]
        if constexpr (MODE == kByReciprocal) return mul_rn(acc, divisor);
        return div_rn(acc, divisor);
    }

    // PayloadSum::load_runs on 32-bit words ([Note: rows outer]).
    template <int N>
    ZC_HD void load_runs(i64 first_, int lane, int lanes, int len, float (&v)[N][8]) const {
        const u32 first = static_cast<u32>(first_);
        const u32 g = group.quotient(first);
        const u32 rest = group.divisor - (first - g * group.divisor);  // elements left in the input group
        const int split = rest < static_cast<u32>(len) ? static_cast<int>(rest) : len;
        const u8* row_bytes = base;
        const u32 values = first / Bits<BITS>::kElementsPerByte;
        const u32 head = scales + 4 * g;
        const int runs = runs_before<N>(len, lane, lanes);
        const int head_runs = runs_before<N>(split, lane, lanes);
        add_row_runs<BITS, true>(row_bytes, values, head, runs, head_runs, lane, lanes, v);
        for (u32 r = 1; r < count; ++r) {
            row_bytes += stride;
            add_row_runs<BITS, false>(row_bytes, values, head, runs, head_runs, lane, lanes, v);
        }
#pragma unroll  // [Note: held runs] in group_encoder.cuh
        for (int i = 0; i < N; ++i) {
            for (int k = 0; k < 8; ++k) v[i][k] = finish(v[i][k]);
        }
    }
};

// `num_chunks` payloads of `chunk_numel` elements as rows of `row_stride` bytes, in 32-bit
// words (ChunkLayout's vector case, which the launcher has checked: whole runs, aligned rows,
// no padding after a chunk's values).
template <int BITS> struct NarrowChunks {
    u8* out;
    u32 chunk_numel;
    u32 num_chunks;
    u32 group_size;
    u32 row_stride;
    u32 scales;  // scales_offset(chunk_numel, BITS)

    // ChunkLayout::span(row, group) for the register scheme (pad_len is 0: see
    // GroupSpan::write_scale_word).
    ZC_HD GroupSpan span(u32 row, u32 group) const {
        const u32 offset = group * group_size;
        const u32 remaining = chunk_numel - offset;
        u8* row_bytes = out + static_cast<u64>(row) * row_stride;
        GroupSpan s;
        s.first = static_cast<i64>(row * chunk_numel + offset);
        s.len = remaining < group_size ? remaining : group_size;
        s.values = row_bytes + offset / Bits<BITS>::kElementsPerByte;
        s.scale_slot = row_bytes + scales + 4 * group;
        s.pad_begin = nullptr;
        s.pad_len = 0;
        return s;
    }
};

// The sizes of [Note: narrow sizes].
struct NarrowSizes {
    i64 chunk_numel;
    i64 groups_per_chunk;
    i64 in_scales;   // scales_offset(numel, IN_BITS)
    i64 out_scales;  // scales_offset(chunk_numel, OUT_BITS)

    template <int IN_BITS, int OUT_BITS>
    ZC_HD bool describe(const PayloadRows<IN_BITS>& rows, const ChunkLayout<OUT_BITS>& layout) const {
        return chunk_numel == layout.chunk_numel && groups_per_chunk == layout.groups_per_chunk() &&
               in_scales == scales_offset(rows.numel, IN_BITS) && out_scales == scales_offset(chunk_numel, OUT_BITS);
    }
};

#ifdef __CUDACC__
// [Note: per-round lanes] The team's width and a lane's place in it are the same in every
// round, so the compiler hoists what it derives from them out of the round loop and holds it
// in registers for the whole kernel: the five shuffle offsets of team_offsets and each held
// run's element offset 8 * (lane + lanes * i), about nine registers, enough to keep the
// INT8-input kernels above 80 (and to spill when 80 is forced). per_round() passes a value
// through an empty asm statement, which the compiler must assume to change it, so that what
// the round derives from it is recomputed in the round (a handful of integer operations per
// group, against up to 32 elements per lane) and not held across the loop.
template <class T> __device__ __forceinline__ T per_round(T x) {
    asm volatile("" : "+r"(x));
    return x;
}

// encode_rounds<true> (group_encoder.cuh) over NarrowChunks and NarrowJobCursor.
template <int BITS, class Source>
__device__ __forceinline__ void encode_narrow_rounds(const Source& src, const NarrowChunks<BITS>& layout,
                                                     const ChunkLayout<BITS>& wide_layout, u32 groups_per_chunk) {
    const int lanes = team_lanes(wide_layout.group_extent());
    const int warp_lane = static_cast<int>(threadIdx.x & 31u);
    const int lane = warp_lane & (lanes - 1);
    const u32 warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const TeamWalk walk(wide_layout.jobs(), lanes, static_cast<i64>(gridDim.x) * blockDim.x / 32);
    NarrowJobCursor job(warp * walk.teams_per_warp + warp_lane / lanes, walk.num_warps * walk.teams_per_warp,
                        groups_per_chunk);
    // the warp's rounds warp, warp + num_warps, ... < walk.rounds, counted down
    for (u32 rounds = walk.rounds > warp ? static_cast<u32>((walk.rounds - warp - 1) / walk.num_warps + 1) : 0;
         rounds > 0; --rounds, job.advance()) {
        const bool live = job.row < layout.num_chunks;
        const GroupSpan s = layout.span(job.row, job.group);
        const int round_lanes = per_round(lanes);  // [Note: per-round lanes]
        const int round_lane = per_round(lane);
        RegisterLane<BITS, Source> held;
        const u32 partial = live ? held.load(src, s, round_lane, round_lanes) : 0u;
        const u32 absmax_bits = team_max(partial, team_offsets(round_lanes));
        if (live) held.store(src, s, round_lane, round_lanes, absmax_bits);
    }
}

// [Note: narrow sizes] The kernel's per-launch sizes derived from its arguments (a chunk's
// elements and groups, the scales' offsets in an input and an output row) come from the
// launcher (_resolve_requant in _cuda_launch.py) as arguments too: the kernel reads them
// from its parameter space where it uses them, where values it computed itself would each
// hold a register for the whole kernel: with these four, the INT4-input kernels need 64
// registers (four blocks per SM) instead of 69-70 (three). The launcher derives them, and
// picks the kernel of the divisor's mode, with the kernel's own formulas (_resolve_requant,
// narrow_requant_sizes, divisor_mode); a mismatch would give wrong bytes. The kernel checks
// both against its own computation only in a compile with the device checks on
// (ZC_DEVICE_CHECK). A buffer off its vector alignment faults on its first load.
template <int MODE, int OUT_BITS, int IN_BITS>
__device__ void requantize_narrow(const PayloadRows<IN_BITS>& rows, i64 k, float divisor,
                                  const ChunkLayout<OUT_BITS>& wide, u64 group_magic, int group_shift,
                                  const NarrowSizes& sizes) {
    ZC_DEVICE_CHECK(divisor_mode(divisor) == MODE && sizes.describe(rows, wide));
    const MagicDivisor<false> group(rows.group_size, group_magic, group_shift);
    const NarrowPayloadSum<IN_BITS, MODE> src(rows.base, rows.stride, sizes.in_scales, k, group, divisor);
    const NarrowChunks<OUT_BITS> layout{wide.out, static_cast<u32>(sizes.chunk_numel), static_cast<u32>(wide.num_chunks),
                                        static_cast<u32>(wide.group_size), static_cast<u32>(wide.row_stride),
                                        static_cast<u32>(sizes.out_scales)};
    encode_narrow_rounds<OUT_BITS>(src, layout, wide, static_cast<u32>(sizes.groups_per_chunk));
}
#endif

}  // namespace zc
