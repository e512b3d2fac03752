// The group encoder: quantizes a source into `num_chunks` self-contained payloads.
//
// Algorithm. A job is one group of one chunk (payload). Two schemes, picked by the launcher
// (zcomm/quant/backends/_cuda_launch.py) from the group's extent, min(group_size, chunk_numel):
//
// Teams (extent <= kTeamMaxGroup), one launch: team_walk.cuh's teams of lanes walk the
// jobs, each team's jobs (its spans in the source and the payload) stepped by a cursor
// ([Note: span cursor]). When the buffers allow vector access and the group fits in the
// team's registers (extent <= kRegisterMaxGroup; e.g. 8 lanes of 4 runs for 256 elements),
// each lane loads its runs once into registers (RegisterLane; bf16/fp16 as raw words) and
// takes their absmax from two raw maxima ([Note: two-sided max]), the team reduces it with
// warp shuffles only (team_max), every lane derives the same scale and reciprocal and
// writes its codes from the registers, two fp32 operations per element for a plain scale
// ([Note: plain scales] in wire_math.cuh): one read of memory. Groups whose scale is not
// plain (NaN, Inf, subnormal: rare) turn held floats into their codes in registers, or,
// held as raw words, are encoded again, streamed, out of line (see RegisterLane). Otherwise
// (larger groups, misaligned buffers, groups with a scalar tail) each lane streams its
// elements twice, once for the absmax and once to quantize (lane_absmax,
// encode_group_lane); the second read hits L1/L2, since a team's footprint is a single
// group. Lane 0 writes the scale (plus the zero padding after the last group of a chunk,
// which the register path never has: see GroupSpan::write_scale_word).
//
// Tiles (larger groups, e.g. one group per tensor), two launches: see [Note: large groups].
//
// RegisterLane, lane_absmax, encode_group_lane, the span cursor and the walk are
// __host__ __device__: the host check drives them lane by lane, warp by warp (team and
// block maxima as plain loops) to run every scheme on the CPU with the kernels' own index
// arithmetic.
// Element indices are 64-bit throughout, so no group or tensor size overflows them.
#pragma once

#include "sources.cuh"
#include "team_walk.cuh"

namespace zc {

// [Note: large groups] A group larger than kTeamMaxGroup elements would leave a team of
// one warp looping over it alone (a "tensor" group of millions of elements on one warp
// takes tens of milliseconds). Such groups are cut into tiles of kTileElems elements (a
// multiple of 8, so tiles keep runs of 8 and INT4 byte pairs whole), one block of
// kTileThreads threads per tile, and encoded in two launches on the same stream:
//   1. kTileAbsmax: each block reduces its tile's abs_bits max (warp shuffles, then shared
//      memory) and atomicMax-es it into group_absmax[job], which the launcher zeroes first
//      (the unsigned order of abs_bits is the NaN-aware absmax order, see abs_bits);
//   2. kTileEncode: each block reads group_absmax[job], derives the scale exactly as a
//      team would, and writes its tile's values; the group's first tile writes the scale
//      and the chunk's padding.
// The max over tiles is the max over the group, and every byte is written by the same
// functions as in the team scheme, so the output is byte-identical to it. The launches are
// ordered by the stream; group_absmax is a stream-ordered temporary of the launcher.
constexpr int kTileThreads = 256;
constexpr i64 kTileElems = 8 * 4 * kTileThreads;  // four runs of 8 per thread

enum EncoderPass : int { kTeams = 0, kTileAbsmax = 1, kTileEncode = 2 };

// One group of one chunk, resolved to addresses in the output payload rows, or one tile of
// a group (see [Note: large groups]): then only the group's first tile has a scale slot.
struct GroupSpan {
    i64 first;        // logical index of the group's first element in the source
    i64 len;          // elements in the group (the last of a chunk may be short)
    u8* values;       // the group's first value byte
    u8* scale_slot;   // the group's fp32 scale (nullptr: written by another tile)
    u8* pad_begin;    // zero padding to write (only for the last group of a chunk)
    int pad_len;      // 0..3: the values are padded to a multiple of 4 bytes

    // The scale, then the padding: three predicated byte stores at most, not a loop (a
    // loop of unknown length unrolls into a hundred instructions of the round loop).
    ZC_HD void write_scale(float scale, bool words_aligned) const {
        store_u32(scale_slot, float_bits(scale), words_aligned);
        if (pad_len > 0) pad_begin[0] = 0;
        if (pad_len > 1) pad_begin[1] = 0;
        if (pad_len > 2) pad_begin[2] = 0;
    }

    // The scale alone, as one word: for the register encoder, whose vector conditions
    // (ChunkLayout::can_vectorize) make rows and slots word-aligned and the value bytes of a
    // chunk a multiple of 4, so that no padding follows them (pad_len == 0, asserted by the
    // host check).
    ZC_HD void write_scale_word(float scale) const {
        const u32 w[1] = {float_bits(scale)};
        store_words(scale_slot, w);
    }
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
    // The longest group: what the launcher compares with kTeamMaxGroup.
    ZC_HD i64 group_extent() const { return group_size < chunk_numel ? group_size : chunk_numel; }
    ZC_HD i64 tiles_per_group() const { return (group_extent() + kTileElems - 1) / kTileElems; }
    ZC_HD i64 tiles() const { return jobs() * tiles_per_group(); }
    ZC_HD bool words_aligned() const { return aligned(out, 4) && row_stride % 4 == 0; }

    // Whole runs of 8 start on run boundaries in every chunk and every row.
    ZC_HD bool can_vectorize() const {
        constexpr int run_bytes = 4 * Codes8<BITS>::kWords;
        return group_size % 8 == 0 && chunk_numel % 8 == 0 && aligned(out, run_bytes) && row_stride % run_bytes == 0;
    }

    ZC_HD GroupSpan span(i64 job) const { return span(job / groups_per_chunk(), job % groups_per_chunk()); }

    ZC_HD GroupSpan span(i64 chunk, i64 group) const {
        const i64 offset = group * group_size;
        const i64 remaining = chunk_numel - offset;
        u8* row = out + chunk * row_stride;
        const bool last = remaining <= group_size;
        const i64 values_end = values_nbytes(chunk_numel, BITS);
        GroupSpan s;
        s.first = chunk * chunk_numel + offset;
        s.len = last ? remaining : group_size;
        s.values = row + offset / Bits<BITS>::kElementsPerByte;
        s.scale_slot = row + scales_offset(chunk_numel, BITS) + 4 * group;
        s.pad_begin = row + values_end;
        s.pad_len = last ? static_cast<int>(scales_offset(chunk_numel, BITS) - values_end) : 0;
        return s;
    }

    // Tile `tile` (in [0, tiles())): elements [t * kTileElems, (t + 1) * kTileElems) of its
    // job's group, t = tile % tiles_per_group(); empty past the end of a short group.
    ZC_HD GroupSpan tile_span(i64 tile) const {
        GroupSpan s = span(tile / tiles_per_group());
        const i64 offset = (tile % tiles_per_group()) * kTileElems;
        const i64 rest = s.len - offset;
        s.first += offset;
        s.values += offset / Bits<BITS>::kElementsPerByte;
        s.len = rest < 0 ? 0 : (rest < kTileElems ? rest : kTileElems);
        if (offset > 0) {
            s.scale_slot = nullptr;
            s.pad_len = 0;
        }
        return s;
    }
};

// [Note: span cursor] A team's jobs are job0, job0 + step, job0 + 2 * step, ... (see
// TeamWalk). With one chunk (ONE_CHUNK: quantize's single payload), job j's group starts at
// element j * group_size, its values at that element's byte (INT4: half of it) and its
// scale at slot j: every position is linear in j, so the cursor keeps the group's first
// element and its scale slot and adds the step's fixed offsets every round, where
// span(row, group) would cost 64-bit multiplications and JobCursor's carry. A job is live
// while its first element lies before the end of the chunk (jobs past the end have
// j >= groups_per_chunk). The scale slot is kept as a byte offset into the output, so that
// the cursor itself holds no pointer past the payload (the span of a dead job, which the
// round loop forms but never uses, does point past it). With several
// chunks, the cursor is JobCursor and span(row, group): carrying the three positions
// across rows as well (fixed offsets per round and per carry) would hold ~20 registers of
// per-launch offsets, a block per SM less for the re-quantizing kernels. The host check
// drives this cursor over the kernels' rounds and compares every live span with
// span(row, group).
template <int BITS, bool ONE_CHUNK> struct SpanCursor;

template <int BITS> struct SpanCursor<BITS, true> {
    static constexpr int kPerByte = Bits<BITS>::kElementsPerByte;
    // fixed per launch
    u8* out;
    i64 group_size;
    i64 end;                     // elements in the chunk: the first element of the first dead job
    i64 step_first, step_scale;  // added every round
    i64 pad_offset;              // the padding after the chunk's last group, from `out`
    int pad_len;                 // 0..3 bytes
    // the job
    i64 first;                   // the group's first element
    i64 scale;                   // the offset in `out` of its scale

    ZC_HD SpanCursor(const ChunkLayout<BITS>& layout, i64 first_job, i64 step) {
        out = layout.out;
        group_size = layout.group_size;
        end = layout.chunk_numel;
        pad_offset = values_nbytes(layout.chunk_numel, BITS);
        pad_len = static_cast<int>(scales_offset(layout.chunk_numel, BITS) - pad_offset);
        step_first = step * group_size;
        step_scale = 4 * step;
        first = first_job * group_size;
        scale = scales_offset(layout.chunk_numel, BITS) + 4 * first_job;
    }

    ZC_HD bool live() const { return first < end; }

    ZC_HD GroupSpan span() const {
        const bool last = end - first <= group_size;
        GroupSpan s;
        s.first = first;
        s.len = last ? end - first : group_size;
        s.values = out + first / kPerByte;  // INT4: group_size, hence first, is even
        s.scale_slot = out + scale;
        s.pad_begin = out + pad_offset;
        s.pad_len = last ? pad_len : 0;
        return s;
    }

    ZC_HD void advance() {
        first += step_first;
        scale += step_scale;
    }
};

template <int BITS> struct SpanCursor<BITS, false> {
    ChunkLayout<BITS> layout;
    JobCursor job;

    ZC_HD SpanCursor(const ChunkLayout<BITS>& layout_, i64 first_job, i64 step)
        : layout(layout_), job(first_job, step, layout_.groups_per_chunk()) {}

    ZC_HD bool live() const { return job.row < layout.num_chunks; }
    ZC_HD GroupSpan span() const { return layout.span(job.row, job.group); }
    ZC_HD void advance() { job.advance(); }
};

template <int BITS, class Source>
ZC_HD u32 lane_absmax(const Source& src, const GroupSpan& s, int lane, int lanes, bool vec) {
    u32 m = 0;
    const i64 vector_end = vec ? (s.len & ~i64{7}) : 0;
    for (i64 e = 8 * lane; e < vector_end; e += 8 * lanes) {
        float v[8];
        src.load8(s.first + e, v);
        for (int k = 0; k < 8; ++k) m = max_u32(m, abs_bits(v[k]));
    }
    for (i64 e = vector_end + lane; e < s.len; e += lanes) m = max_u32(m, abs_bits(src.load1(s.first + e)));
    return m;
}

// One value byte: an INT8 code, or two INT4 codes (a missing odd partner packs as 0).
template <int BITS, class Source>
ZC_HD u8 encode_byte(const Source& src, i64 j, bool has_partner, const Quantizer& quantize) {
    const int lo = quantize(src.load1(j));
    if constexpr (BITS == 8) {
        return static_cast<u8>(lo);
    } else {
        const int hi = has_partner ? quantize(src.load1(j + 1)) : 0;
        return static_cast<u8>((static_cast<u32>(lo) & 0xFu) | ((static_cast<u32>(hi) & 0xFu) << 4));
    }
}

template <int BITS, class Source>
ZC_HD void encode_group_lane(const Source& src, const GroupSpan& s, int lane, int lanes, bool vec,
                             bool words_aligned, u32 absmax_bits) {
    constexpr int per_byte = Bits<BITS>::kElementsPerByte;
    const float scale = scale_from_absmax_bits(absmax_bits, Bits<BITS>::kQmax);
    const Quantizer quantize(scale, Bits<BITS>::kQmax);
    const i64 vector_end = vec ? (s.len & ~i64{7}) : 0;
    for (i64 e = 8 * lane; e < vector_end; e += 8 * lanes) {
        float v[8];
        src.load8(s.first + e, v);
        int q[8];
        for (int k = 0; k < 8; ++k) q[k] = quantize(v[k]);
        u32 w[Codes8<BITS>::kWords];
        Codes8<BITS>::pack(q, w);
        store_words(s.values + e / per_byte, w);
    }
    for (i64 e = vector_end + per_byte * lane; e < s.len; e += per_byte * lanes) {
        s.values[e / per_byte] = encode_byte<BITS>(src, s.first + e, s.len - e > 1, quantize);
    }
    if (lane == 0 && s.scale_slot != nullptr) {
        s.write_scale(scale, words_aligned);
    }
}

// [Note: two-sided max] The absmax of a lane's elements, without clearing every element's
// sign bit first (abs_bits: one instruction per element or word). Two maxima of the raw
// bits are taken instead, three inputs per instruction: the signed one, S, is the largest
// non-negative element when there is one (as signed integers non-negative floats rank above
// negative ones, and among themselves in float order), and the unsigned one, U, is the
// negative element of the largest magnitude when there is one (as unsigned integers negative
// floats rank above non-negative ones, and among themselves by magnitude). Both are elements,
// so the max of their abs_bits is the max of every element's abs_bits: the same NaN-aware
// absmax (see abs_bits). Raw 16-bit words do the same per half (VIMNMX.S16x2 / .U16x2).
// The starting values are the identity of each max: 0 unsigned, INT_MIN signed (-0, whose
// abs_bits are 0, should no element come).
ZC_HD u32 max_s32_bits(u32 a, u32 b) { return static_cast<int>(a) > static_cast<int>(b) ? a : b; }

// The per-half signed max of two pairs of 16-bit values (one VIMNMX.S16x2 on sm_90).
ZC_HD u32 max_s16x2(u32 a, u32 b) {
#ifdef __CUDA_ARCH__
    return __vmaxs2(a, b);
#else
    const auto half = [](u32 x, u32 y) { return static_cast<short>(x) > static_cast<short>(y) ? x : y; };
    return (half(a & 0xFFFFu, b & 0xFFFFu) & 0xFFFFu) | (half(a >> 16, b >> 16) << 16);
#endif
}

struct TwoSidedMax {
    u32 above;  // the unsigned max of the raw bits (per half for 16-bit words)
    u32 below;  // the signed max
};

// Whether a source is a plain array (FlatSource): a lane then reads its runs through a
// pointer that advances by the lane's run stride, one 64-bit add per run, where the source's
// index needs an add and a scaling (two 64-bit LEAs) per run.
template <class S> struct PlainArray {
    static constexpr bool kValue = false;
};
template <class T> struct PlainArray<FlatSource<T>> {
    static constexpr bool kValue = true;
};

// A lane's runs between load and store: 8 floats per run, or, for sources of raw 16-bit
// runs, their 4 words ([Note: raw runs] in sources.cuh). load() folds the run into the
// lane's maxima ([Note: two-sided max]), from start(); lane_absmax_bits() turns them into
// abs_bits of an fp32 value; values() gives the run as fp32.
template <class Source, bool RAW = Source::kRaw16> struct HeldRuns {
    static constexpr bool kRewritable = true;  // see rewrite_as_codes
    float v[kRunsPerLane][8];

    ZC_HD static TwoSidedMax start() { return TwoSidedMax{0u, 0x80000000u}; }
    ZC_HD static void fold(TwoSidedMax& m, const float (&run)[8]) {
        for (int k = 0; k < 8; ++k) {
            m.above = max_u32(m.above, float_bits(run[k]));
            m.below = max_s32_bits(m.below, float_bits(run[k]));
        }
    }
    ZC_HD static u32 lane_absmax_bits(const TwoSidedMax& m) {
        return max_u32(m.above & kF32AbsMask, m.below & kF32AbsMask);
    }

    // The cold path of RegisterLane::store for held floats: each live run's values become
    // their codes under the general rule (small integers, exact in fp32), so that the
    // plain path with a reciprocal of 1 writes them. A call would cost ~20 registers.
    // Returns the group's scale.
    ZC_HD float rewrite_as_codes(u32 absmax_bits, int qmax, int lane, int lanes, int len) {
        const float scale = scale_from_absmax_bits(absmax_bits, qmax);
        const Quantizer quantize(scale, qmax);
#pragma unroll  // [Note: held runs]
        for (int i = 0; i < kRunsPerLane; ++i) {
            if (8 * (lane + lanes * i) < len) {
                for (int k = 0; k < 8; ++k) v[i][k] = static_cast<float>(quantize(v[i][k]));
            }
        }
        return scale;
    }

    ZC_HD void load(const Source& src, i64 j, int i, TwoSidedMax& m) {
        src.load8(j, v[i]);
        fold(m, v[i]);
    }
    template <class T> ZC_HD void load_at(const T* p, int i, TwoSidedMax& m) {
        zc::load8(p, v[i]);
        fold(m, v[i]);
    }
    // All of a lane's runs from a source that loads them together ([Note: rows outer] in
    // sources.cuh); returns their absmax bits.
    ZC_HD u32 load_lane(const Source& src, i64 first, int lane, int lanes, int len) {
        src.load_runs(first, lane, lanes, len, v);
        TwoSidedMax m = start();
#pragma unroll  // [Note: held runs]
        for (int i = 0; i < kRunsPerLane; ++i) {
            if (8 * (lane + lanes * i) < len) fold(m, v[i]);
        }
        return lane_absmax_bits(m);
    }
    ZC_HD void values(int i, float (&out)[8]) const {
        for (int k = 0; k < 8; ++k) out[k] = v[i][k];
    }
};

template <class Source> struct HeldRuns<Source, true> {
    using H = typename Source::Element;
    static constexpr bool kRewritable = false;  // cold groups are encoded again from memory
    u32 w[kRunsPerLane][4];

    ZC_HD static TwoSidedMax start() { return TwoSidedMax{0u, 0x80008000u}; }
    ZC_HD void load(const Source& src, i64 j, int i, TwoSidedMax& m) {
        src.load_raw8(j, w[i]);
        fold(m, w[i]);
    }
    ZC_HD void load_at(const H* p, int i, TwoSidedMax& m) {
        load_words(w[i], p);
        fold(m, w[i]);
    }
    ZC_HD static void fold(TwoSidedMax& m, const u32 (&run)[4]) {
        for (int k = 0; k < 4; ++k) {
            m.above = max_u16x2(m.above, run[k]);
            m.below = max_s16x2(m.below, run[k]);
        }
    }
    ZC_HD static u32 lane_absmax_bits(const TwoSidedMax& m) {
        return abs_bits_of_max16x2<H>(max_u16x2(m.above & kAbs16x2Mask, m.below & kAbs16x2Mask));
    }
    ZC_HD void values(int i, float (&out)[8]) const {
        for (int k = 0; k < 4; ++k) {
            out[2 * k] = raw_low<H>(w[i][k]);
            out[2 * k + 1] = raw_high<H>(w[i][k]);
        }
    }
};

// A run's codes, packed as Codes8<BITS>::pack packs them, from words whose low byte holds
// each code (two's complement; for INT4 its low nibble is the code): byte permutes gather
// the low bytes, four per word (three PRMT per word). INT4 gathers the even elements' bytes
// and the odd ones' and merges them as nibbles with one shift and one select (eight
// instructions per run, where Codes8<4>::pack's shifts and ors of each nibble take about
// twenty).
template <int BITS> ZC_HD void pack_code_bytes(const u32 (&q)[8], u32 (&w)[Codes8<BITS>::kWords]) {
    // [x.byte0, y.byte0, -, -], then [a.byte0, a.byte1, b.byte0, b.byte1]
    const auto low_bytes = [](u32 a, u32 b, u32 c, u32 d) {
        return byte_perm(byte_perm(a, b, 0x0040u), byte_perm(c, d, 0x0040u), 0x5410u);
    };
    if constexpr (BITS == 8) {
        w[0] = low_bytes(q[0], q[1], q[2], q[3]);
        w[1] = low_bytes(q[4], q[5], q[6], q[7]);
    } else {
        const u32 even = low_bytes(q[0], q[2], q[4], q[6]);  // element 2i: the low nibble of byte i
        const u32 odd = low_bytes(q[1], q[3], q[5], q[7]);
        w[0] = (even & 0x0F0F0F0Fu) | ((odd << 4) & 0xF0F0F0F0u);
    }
}

// The general encoding of a team's group, out of line on the device: the register encoder's
// cold path (see RegisterLane), kept out of its round loop so that the loop stays small.
#if defined(__CUDACC__)
#define ZC_COLD __host__ __device__ __noinline__
#else
#define ZC_COLD inline
#endif
// Its arguments are what a team's group in registers needs (no padding, words aligned: see
// GroupSpan::write_scale_word), by value: a reference would put them on the stack every round.
template <int BITS, class Source>
ZC_COLD void encode_group_again(const Source src, i64 first, int len, u8* values, u8* scale_slot, int lane,
                                int lanes, u32 absmax_bits) {
    GroupSpan s;
    s.first = first;
    s.len = len;
    s.values = values;
    s.scale_slot = scale_slot;
    s.pad_begin = nullptr;
    s.pad_len = 0;
    encode_group_lane<BITS>(src, s, lane, lanes, true, true, absmax_bits);
}

// One lane of a team that holds its group in registers: the runs of 8 at elements
// 8 * (lane + lanes * i), i < kRunsPerLane, of a group whose length is a multiple of 8
// (the vector condition) and at most 8 * kRunsPerLane * lanes. load() reads them once and
// returns the lane's absmax bits; store() quantizes them with the team's absmax and writes
// the codes (and, on lane 0, the scale), with no second read of the source, when the
// group's scale is plain ([Note: plain scales] in wire_math.cuh): a multiplication and an
// addition per element, and one division each for the scale and its reciprocal per lane and
// group. The rare other groups (a NaN or Inf element, or a scale below the normal range)
// take the general rule: held floats are rewritten as their codes
// (HeldRuns::rewrite_as_codes, a branch the plain groups jump over), held raw words are
// encoded again from memory by encode_group_again (out of line; the second read hits
// L1/L2). A call costs registers (~20 for held floats, which have no raw form to spare
// them), a rewritten raw word would need a second conversion.
template <int BITS, class Source> struct RegisterLane {
    HeldRuns<Source> held;

    ZC_HD u32 load(const Source& src, const GroupSpan& s, int lane, int lanes) {
        const int len = static_cast<int>(s.len);  // <= kRegisterMaxGroup: int offsets suffice
        if constexpr (Source::kLaneRuns) {
            return held.load_lane(src, s.first, lane, lanes, len);
        } else {
            return load_each(src, s.first, lane, lanes, len);
        }
    }

    // load() of a source that loads its runs one at a time.
    ZC_HD u32 load_each(const Source& src, i64 first, int lane, int lanes, int len) {
        TwoSidedMax m = held.start();
        i64 j = first + 8 * lane;  // run i's first element: first + e
        // [Note: held runs] Unrolled, so that the held runs are indexed by constants only
        // and stay in registers: a loop the compiler kept would index them at run time and
        // put them on the stack.
        if constexpr (PlainArray<Source>::kValue) {
            const auto* p = src.x + j;
#pragma unroll
            for (int i = 0, e = 8 * lane; i < kRunsPerLane; ++i, e += 8 * lanes, p += 8 * lanes) {
                if (e < len) held.load_at(p, i, m);
            }
        } else {
#pragma unroll
            for (int i = 0, e = 8 * lane; i < kRunsPerLane; ++i, e += 8 * lanes, j += 8 * lanes) {
                if (e < len) held.load(src, j, i, m);
            }
        }
        return held.lane_absmax_bits(m);
    }

    ZC_HD void store(const Source& src, const GroupSpan& s, int lane, int lanes, u32 absmax_bits) {
        const int len = static_cast<int>(s.len);
        // The scale when it is plain, with no test for a NaN or Inf absmax: those give a NaN or
        // Inf quotient, which is not plain, and the cold paths derive the group's scale again.
        float scale = div_rn(bits_float(absmax_bits), static_cast<float>(Bits<BITS>::kQmax));
        float reciprocal;
        if (plain_scale(scale)) {
            reciprocal = plain_reciprocal(scale);
        } else if constexpr (HeldRuns<Source>::kRewritable) {
            scale = held.rewrite_as_codes(absmax_bits, Bits<BITS>::kQmax, lane, lanes, len);
            reciprocal = 1.0f;
        } else {
            encode_group_again<BITS>(src, s.first, len, s.values, s.scale_slot, lane, lanes, absmax_bits);
            return;
        }
        constexpr int per_byte = Bits<BITS>::kElementsPerByte;
        u8* values = s.values + 8 / per_byte * lane;  // run i's codes: s.values + e / per_byte
#pragma unroll  // [Note: held runs]
        for (int i = 0, e = 8 * lane; i < kRunsPerLane; ++i, e += 8 * lanes, values += 8 / per_byte * lanes) {
            if (e < len) {
                float v[8];
                held.values(i, v);
                u32 q[8];  // the low byte / nibble of each is the code
                for (int k = 0; k < 8; ++k) q[k] = plain_code_bits(v[k], reciprocal);
                u32 w[Codes8<BITS>::kWords];
                pack_code_bytes<BITS>(q, w);
                store_words(values, w);
            }
        }
        if (lane == 0) s.write_scale_word(scale);
    }
};

// Whether a team holds its group in registers (see RegisterLane).
ZC_HD bool in_registers(bool vec, i64 group_extent) { return vec && group_extent <= kRegisterMaxGroup; }

#ifdef __CUDACC__
// Max over the `lanes` aligned lanes of a team; every lane of the warp must call it, with
// the offsets team_offsets() gives. Five shuffles whatever the team's width, with no branch:
// an offset the team does not use is 0, a lane's own value, and max(v, v) is v. (Testing
// each offset against the width costs a compare, a branch and the shuffle's own divergence
// check per offset in the round loop; a narrow team's extra shuffles cost less.)
struct TeamOffsets {
    int xor_mask[5];
};

__device__ __forceinline__ TeamOffsets team_offsets(int lanes) {
    TeamOffsets t;
#pragma unroll
    for (int k = 0; k < 5; ++k) t.xor_mask[k] = (16 >> k) & (lanes - 1);  // lanes: a power of two
    return t;
}

__device__ __forceinline__ u32 team_max(u32 v, const TeamOffsets& t) {
#pragma unroll
    for (int k = 0; k < 5; ++k) v = max_u32(v, __shfl_xor_sync(0xFFFFFFFFu, v, t.xor_mask[k]));
    return v;
}

// The rounds of the team scheme, with the group in registers (REGISTERS) or streamed.
template <bool REGISTERS, int BITS, bool ONE_CHUNK, class Source>
__device__ __forceinline__ void encode_rounds(const Source& src, const ChunkLayout<BITS>& layout, bool vec) {
    const bool words_aligned = layout.words_aligned();
    const int lanes = team_lanes(layout.group_extent());
    const TeamOffsets offsets = team_offsets(lanes);
    const int warp_lane = static_cast<int>(threadIdx.x & 31u);
    const int lane = warp_lane & (lanes - 1);
    const i64 warp = (static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const TeamWalk walk(layout.jobs(), lanes, static_cast<i64>(gridDim.x) * blockDim.x / 32);
    SpanCursor<BITS, ONE_CHUNK> job(layout, warp * walk.teams_per_warp + warp_lane / lanes,
                                    walk.num_warps * walk.teams_per_warp);
    // the warp's rounds warp, warp + num_warps, ... < walk.rounds, counted down
    for (i64 rounds = walk.rounds > warp ? (walk.rounds - warp - 1) / walk.num_warps + 1 : 0; rounds > 0;
         --rounds, job.advance()) {
        const bool live = job.live();
        const GroupSpan s = job.span();
        if constexpr (REGISTERS) {
            RegisterLane<BITS, Source> held;
            const u32 partial = live ? held.load(src, s, lane, lanes) : 0u;
            const u32 absmax_bits = team_max(partial, offsets);
            if (live) held.store(src, s, lane, lanes, absmax_bits);
        } else {
            const u32 partial = live ? lane_absmax<BITS>(src, s, lane, lanes, vec) : 0u;
            const u32 absmax_bits = team_max(partial, offsets);
            if (live) encode_group_lane<BITS>(src, s, lane, lanes, vec, words_aligned, absmax_bits);
        }
    }
}

// The team scheme. Requires blockDim.x to be a multiple of 32, so that the round loop is
// uniform per warp and the shuffles in team_max see all 32 lanes.
template <int BITS, bool ONE_CHUNK, class Source>
__device__ void encode_groups(const Source& src, const ChunkLayout<BITS>& layout) {
    const bool vec = src.can_vectorize() && layout.can_vectorize();
    if (in_registers(vec, layout.group_extent())) {
        encode_rounds<true, BITS, ONE_CHUNK>(src, layout, vec);
    } else {
        encode_rounds<false, BITS, ONE_CHUNK>(src, layout, vec);
    }
}

// Max over the block (kTileThreads threads), returned to thread 0. Every thread must call it.
__device__ __forceinline__ u32 block_max(u32 v) {
    __shared__ u32 warp_max[kTileThreads / 32];
    v = team_max(v, 32);
    if ((threadIdx.x & 31u) == 0) warp_max[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < kTileThreads / 32; ++w) v = max_u32(v, warp_max[w]);
    }
    __syncthreads();  // warp_max is free again for the next call
    return v;
}

// Pass kTileAbsmax of [Note: large groups]. Requires blockDim.x == kTileThreads.
template <int BITS, class Source>
__device__ void absmax_tiles(const Source& src, const ChunkLayout<BITS>& layout, u32* group_absmax) {
    const bool vec = src.can_vectorize() && layout.can_vectorize();
    const i64 tiles = layout.tiles();
    for (i64 tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const GroupSpan s = layout.tile_span(tile);
        const u32 m = block_max(lane_absmax<BITS>(src, s, static_cast<int>(threadIdx.x), kTileThreads, vec));
        if (threadIdx.x == 0) atomicMax(group_absmax + tile / layout.tiles_per_group(), m);
    }
}

// Pass kTileEncode of [Note: large groups]. Requires blockDim.x == kTileThreads.
template <int BITS, class Source>
__device__ void encode_tiles(const Source& src, const ChunkLayout<BITS>& layout, const u32* group_absmax) {
    const bool vec = src.can_vectorize() && layout.can_vectorize();
    const bool words_aligned = layout.words_aligned();
    const i64 tiles = layout.tiles();
    for (i64 tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const GroupSpan s = layout.tile_span(tile);
        const u32 absmax_bits = group_absmax[tile / layout.tiles_per_group()];
        encode_group_lane<BITS>(src, s, static_cast<int>(threadIdx.x), kTileThreads, vec, words_aligned, absmax_bits);
    }
}

// The body of every encoder kernel: one launch of the team scheme, or one pass of the
// tile scheme (group_absmax is unused by kTeams). ONE_CHUNK: the layout has one chunk
// (num_chunks == 1), which spares the team scheme's cursor its carry ([Note: span cursor]).
template <int BITS, bool ONE_CHUNK = false, class Source>
__device__ void run_encoder(const Source& src, const ChunkLayout<BITS>& layout, int pass, u32* group_absmax) {
    if (pass == kTeams) {
        encode_groups<BITS, ONE_CHUNK>(src, layout);
    } else if (pass == kTileAbsmax) {
        absmax_tiles<BITS>(src, layout, group_absmax);
    } else {
        encode_tiles<BITS>(src, layout, group_absmax);
    }
}
#endif

}  // namespace zc
