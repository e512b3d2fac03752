// The group encoder: quantizes a source into `num_chunks` self-contained payloads.
//
// Algorithm. A job is one group of one chunk (payload). A team of `lanes` threads (a power
// of two, at most a warp, sized so that each lane gets about one run of 8 per group) handles
// one job: each lane takes the max of abs_bits over its elements (runs of 8 when the
// buffers allow vector access, then single elements for the tail), the team reduces the
// max with warp shuffles, every lane derives the same scale and writes its quantized
// values, and lane 0 writes the scale (plus the zero padding after the last group of a
// chunk). A warp holds 32 / lanes teams; warps walk the jobs grid-stride.
//
// Each group's elements are read twice (once for the absmax, once to quantize); the second
// read hits L1/L2, since a team's footprint is a single group.
//
// lane_absmax and encode_group_lane are __host__ __device__: the host check drives them
// lane by lane (team max as a plain loop) to run the device partitioning on the CPU.
#pragma once

#include "sources.cuh"

namespace zc {

// Lanes per group: enough for one run of 8 each, a power of two in [1, 32].
ZC_HD int team_lanes(i64 group_size) {
    int lanes = 1;
    while (lanes < 32 && lanes * 8 < group_size) lanes *= 2;
    return lanes;
}

// One group of one chunk, resolved to addresses in the output payload rows.
struct GroupSpan {
    i64 first;        // logical index of the group's first element in the source
    int len;          // elements in the group (the last of a chunk may be short)
    u8* values;       // the group's first value byte
    u8* scale_slot;   // the group's fp32 scale
    u8* pad_begin;    // zero padding to write (only for the last group of a chunk)
    int pad_len;
};

// `num_chunks` payloads of `chunk_numel` elements each, as rows of `row_stride` bytes.
template <int BITS> struct ChunkLayout {
    u8* out;
    i64 chunk_numel;
    i64 num_chunks;
    i64 group_size;
    i64 row_stride;

    ZC_HD i64 groups_per_chunk() const { return num_groups(chunk_numel, group_size); }
    ZC_HD i64 jobs() const { return groups_per_chunk() * num_chunks; }
    ZC_HD bool words_aligned() const { return aligned(out, 4) && row_stride % 4 == 0; }

    // Whole runs of 8 start on run boundaries in every chunk and every row.
    ZC_HD bool can_vectorize() const {
        constexpr int run_bytes = 4 * Codes8<BITS>::kWords;
        return group_size % 8 == 0 && chunk_numel % 8 == 0 && aligned(out, run_bytes) && row_stride % run_bytes == 0;
    }

    ZC_HD GroupSpan span(i64 job) const {
        const i64 chunk = job / groups_per_chunk();
        const i64 group = job % groups_per_chunk();
        const i64 offset = group * group_size;
        const i64 remaining = chunk_numel - offset;
        u8* row = out + chunk * row_stride;
        const bool last = remaining <= group_size;
        const i64 values_end = values_nbytes(chunk_numel, BITS);
        GroupSpan s;
        s.first = chunk * chunk_numel + offset;
        s.len = static_cast<int>(last ? remaining : group_size);
        s.values = row + offset / Bits<BITS>::kElementsPerByte;
        s.scale_slot = row + scales_offset(chunk_numel, BITS) + 4 * group;
        s.pad_begin = row + values_end;
        s.pad_len = last ? static_cast<int>(scales_offset(chunk_numel, BITS) - values_end) : 0;
        return s;
    }
};

template <int BITS, class Source>
ZC_HD u32 lane_absmax(const Source& src, const GroupSpan& s, int lane, int lanes, bool vec) {
    u32 m = 0;
    const int vector_end = vec ? (s.len & ~7) : 0;
    for (int e = 8 * lane; e < vector_end; e += 8 * lanes) {
        float v[8];
        src.load8(s.first + e, v);
        for (int k = 0; k < 8; ++k) m = max_u32(m, abs_bits(v[k]));
    }
    for (int e = vector_end + lane; e < s.len; e += lanes) m = max_u32(m, abs_bits(src.load1(s.first + e)));
    return m;
}

// One value byte: an INT8 code, or two INT4 codes (a missing odd partner packs as 0).
template <int BITS, class Source>
ZC_HD u8 encode_byte(const Source& src, i64 j, int available, const Quantizer& quantize) {
    const int lo = quantize(src.load1(j));
    if constexpr (BITS == 8) {
        return static_cast<u8>(lo);
    } else {
        const int hi = available > 1 ? quantize(src.load1(j + 1)) : 0;
        return static_cast<u8>((static_cast<u32>(lo) & 0xFu) | ((static_cast<u32>(hi) & 0xFu) << 4));
    }
}

template <int BITS, class Source>
ZC_HD void encode_group_lane(const Source& src, const GroupSpan& s, int lane, int lanes, bool vec,
                             bool words_aligned, u32 absmax_bits) {
    constexpr int per_byte = Bits<BITS>::kElementsPerByte;
    const float scale = scale_from_absmax_bits(absmax_bits, Bits<BITS>::kQmax);
    const Quantizer quantize(scale, Bits<BITS>::kQmax);
    const int vector_end = vec ? (s.len & ~7) : 0;
    for (int e = 8 * lane; e < vector_end; e += 8 * lanes) {
        float v[8];
        src.load8(s.first + e, v);
        int q[8];
        for (int k = 0; k < 8; ++k) q[k] = quantize(v[k]);
        u32 w[Codes8<BITS>::kWords];
        Codes8<BITS>::pack(q, w);
        store_words(s.values + e / per_byte, w);
    }
    for (int e = vector_end + per_byte * lane; e < s.len; e += per_byte * lanes) {
        s.values[e / per_byte] = encode_byte<BITS>(src, s.first + e, s.len - e, quantize);
    }
    if (lane == 0) {
        store_u32(s.scale_slot, float_bits(scale), words_aligned);
        for (int k = 0; k < s.pad_len; ++k) s.pad_begin[k] = 0;
    }
}

#ifdef __CUDACC__
// Max over the `lanes` aligned lanes of a team; every lane of the warp must call it.
__device__ __forceinline__ u32 team_max(u32 v, int lanes) {
    for (int offset = lanes / 2; offset > 0; offset /= 2) v = max_u32(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
    return v;
}

// Requires blockDim.x to be a multiple of 32, so that the tile loop is uniform per warp
// and the shuffles in team_max see all 32 lanes.
template <int BITS, class Source>
__device__ void encode_groups(const Source& src, const ChunkLayout<BITS>& layout) {
    const bool vec = src.can_vectorize() && layout.can_vectorize();
    const bool words_aligned = layout.words_aligned();
    const int lanes = team_lanes(layout.group_size);
    const int teams_per_warp = 32 / lanes;
    const int warp_lane = static_cast<int>(threadIdx.x & 31u);
    const int lane = warp_lane & (lanes - 1);
    const i64 warp = (static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const i64 num_warps = static_cast<i64>(gridDim.x) * blockDim.x / 32;
    const i64 jobs = layout.jobs();
    const i64 tiles = (jobs + teams_per_warp - 1) / teams_per_warp;
    for (i64 tile = warp; tile < tiles; tile += num_warps) {
        const i64 job = tile * teams_per_warp + warp_lane / lanes;
        const bool live = job < jobs;
        const GroupSpan s = layout.span(live ? job : 0);
        const u32 partial = live ? lane_absmax<BITS>(src, s, lane, lanes, vec) : 0u;
        const u32 absmax_bits = team_max(partial, lanes);
        if (live) encode_group_lane<BITS>(src, s, lane, lanes, vec, words_aligned, absmax_bits);
    }
}
#endif

}  // namespace zc
