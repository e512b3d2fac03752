// The run decoder: dequantizes (and sums) payload rows into a float tensor.
//
// Algorithm. The output is `segments` stretches of `numel` elements; segment s is the sum
// of payload rows [s * rows_per_segment, (s + 1) * rows_per_segment) (see PayloadSum).
// dequantize is segments = k, rows_per_segment = 1; dequant_reduce is segments = 1,
// rows_per_segment = k. Each thread decodes one run of 8 elements of one segment at a time
// (vector loads and stores when the buffers allow, else element by element, also for the
// short last run of a segment); threads walk the runs grid-stride.
//
// Groups of up to kTeamMaxGroup elements, when the buffers allow vector access, take the
// team layout of team_walk.cuh instead: a team of lanes per group of one segment, each lane
// decoding the group's runs lane, lane + lanes, ... The group index of every run is then
// known without a division, a lane reads its group's scale once (dequantize: one row per
// segment) or each row's scale once per run (sums), and no index arithmetic is repeated
// per run beyond an add. decode_group_lane is what the host check
// drives, over the same cursor.
#pragma once

#include "sources.cuh"
#include "team_walk.cuh"

namespace zc {

template <class T, int BITS> struct SegmentLayout {
    PayloadRows<BITS> rows;
    T* out;
    i64 segments;
    i64 rows_per_segment;
    float divisor;

    ZC_HD i64 runs_per_segment() const { return (rows.numel + 7) / 8; }
    ZC_HD i64 runs() const { return runs_per_segment() * segments; }
    ZC_HD bool can_vectorize() const { return rows.can_vectorize() && rows.numel % 8 == 0 && aligned(out, 16); }
    ZC_HD i64 groups_per_segment() const { return num_groups(rows.numel, rows.group_size); }
    ZC_HD i64 group_extent() const { return rows.group_size < rows.numel ? rows.group_size : rows.numel; }
    // Whether the team layout runs (the vector paths, and groups a team takes at once).
    ZC_HD bool teams(bool vec) const { return vec && group_extent() <= kTeamMaxGroup; }
};

// The divisor mode of the team layout's main loop: checked once per launch, so that the
// loop holds either the multiplication by a power of two's reciprocal or the division.
template <class T, int BITS> ZC_HD int team_divisor_mode(const SegmentLayout<T, BITS>& layout) {
    return divisor_mode(layout.divisor);  // kByOne: dequantize, and sums
}

// One lane's runs of group `group` of segment `segment` (vector paths only: the group's
// length is a multiple of 8 and every run is aligned), MODE as team_divisor_mode says.
// ONE_ROW: the caller guarantees one row per segment (dequantize), so that the lane reads
// the group's scale and tests it for NaN/Inf once, not once per run.
template <int MODE, bool ONE_ROW = false, class T, int BITS>
ZC_HD void decode_group_lane(const SegmentLayout<T, BITS>& layout, i64 segment, i64 group, int lane, int lanes) {
    const i64 first = group * layout.rows.group_size;
    const i64 rest = layout.rows.numel - first;
    const i64 len = rest < layout.rows.group_size ? rest : layout.rows.group_size;
    const PayloadSum<BITS, MODE> src(layout.rows, segment * layout.rows_per_segment, layout.rows_per_segment,
                                     layout.divisor);
    T* dst = layout.out + segment * layout.rows.numel + first;
    if constexpr (ONE_ROW) {
        const u8* row = layout.rows.row(src.first_row);
        const float s = dequantize_scale(layout.rows.scale(row, group, true));  // [Note: vector scales]
        if constexpr (MODE == kByOne && BITS == 8) {
            // [Note: NaN groups] A dequantized value is q * s, q an integer code and s the
            // group's scale, or NaN when s is NaN or Inf (dequantize_scale). With a finite s no
            // value is a NaN (a finite product of finite factors, or +-Inf on overflow; dividing
            // by 1 leaves it as it is), and with a NaN or Inf s every value is. So a group of
            // numbers stores without the per-word NaN test (store8_numbers in vector_io.cuh:
            // with the hardware narrowing one F2FP per word instead of F2FP, HSET2 and LOP3, or
            // the integer test; fp32 values without a compare and a select each), and a NaN group
            // (rare) takes the general loop below, which writes the canonical NaN. The bytes are
            // the general loop's: the conversions agree on numbers. Other divisors could make a
            // NaN from numbers (Inf / Inf), so they keep the general loop. Measured on sm_90
            // (bench.kernels --static), register counts decided the shape: one loop with a
            // per-group mask cost the INT8 kernels 6-8 registers (40 -> 46-48, a block fewer
            // per SM), and for INT4 codes even the two loops cost 2-7 (40 -> 42-47), so INT4
            // keeps the general loop only.
            if (!is_nan(s)) {
                for (i64 e = 8 * static_cast<i64>(lane); e < len; e += 8 * static_cast<i64>(lanes)) {
                    float v[8];
                    layout.rows.scaled8(row, first + e, s, v);
                    store8_numbers(dst + e, v);
                }
                return;
            }
        }
        for (i64 e = 8 * static_cast<i64>(lane); e < len; e += 8 * static_cast<i64>(lanes)) {
            float v[8];
            layout.rows.scaled8(row, first + e, s, v);
            for (int k = 0; k < 8; ++k) v[k] = src.finish(v[k]);
            store8(dst + e, v);
        }
    } else {
        for (i64 e = 8 * static_cast<i64>(lane); e < len; e += 8 * static_cast<i64>(lanes)) {
            float v[8];
            src.load8_in_group(first + e, group, v);
            store8(dst + e, v);
        }
    }
}

template <class T, int BITS> ZC_HD void decode_run(const SegmentLayout<T, BITS>& layout, i64 run, bool vec) {
    const i64 segment = run / layout.runs_per_segment();
    const i64 first = (run % layout.runs_per_segment()) * 8;
    const i64 remaining = layout.rows.numel - first;
    const int count = remaining < 8 ? static_cast<int>(remaining) : 8;
    const PayloadSum<BITS> src(layout.rows, segment * layout.rows_per_segment, layout.rows_per_segment, layout.divisor);
    T* dst = layout.out + segment * layout.rows.numel + first;
    if (vec && count == 8) {
        float v[8];
        src.load8(first, v);
        store8(dst, v);
        return;
    }
    for (int k = 0; k < count; ++k) dst[k] = from_float<T>(src.load1(first + k));
}

#ifdef __CUDACC__
template <class T, int BITS> __device__ void decode_runs(const SegmentLayout<T, BITS>& layout, bool vec) {
    const i64 stride = static_cast<i64>(gridDim.x) * blockDim.x;
    const i64 runs = layout.runs();
    for (i64 run = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; run < runs; run += stride) {
        decode_run(layout, run, vec);
    }
}

template <int MODE, bool ONE_ROW, class T, int BITS> __device__ void decode_teams(const SegmentLayout<T, BITS>& layout) {
    const int lanes = team_lanes(layout.group_extent());
    const int warp_lane = static_cast<int>(threadIdx.x & 31u);
    const i64 warp = (static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const i64 groups = layout.groups_per_segment();
    const TeamWalk walk(groups * layout.segments, lanes, static_cast<i64>(gridDim.x) * blockDim.x / 32);
    JobCursor job = walk.cursor(warp, warp_lane / lanes, groups);
    for (i64 round = warp; round < walk.rounds; round += walk.num_warps, job.advance()) {
        if (job.row < layout.segments) {
            decode_group_lane<MODE, ONE_ROW>(layout, job.row, job.group, warp_lane & (lanes - 1), lanes);
        }
    }
}

// ONE_ROW: every segment is one row (dequantize; see decode_group_lane).
template <bool ONE_ROW = false, class T, int BITS> __device__ void decode_segments(const SegmentLayout<T, BITS>& layout) {
    const bool vec = layout.can_vectorize();
    if (layout.teams(vec)) {
        const int mode = team_divisor_mode(layout);
        if (mode == kByOne) {
            decode_teams<kByOne, ONE_ROW>(layout);
        } else if (mode == kByReciprocal) {
            decode_teams<kByReciprocal, ONE_ROW>(layout);
        } else {
            decode_teams<kByDivision, ONE_ROW>(layout);
        }
    } else {
        decode_runs(layout, vec);
    }
}
#endif

}  // namespace zc
