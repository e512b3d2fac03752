// Host-side driver of the CUDA kernels' code, for tests/quant/test_cuda_host_math.py.
//
// It runs the same __host__ __device__ functions the kernels run (the group encoder's
// RegisterLane or lane_absmax / encode_group_lane in the team scheme, or the tile scheme,
// chosen as the kernels and the launcher choose; the decoder's decode_group_lane or
// decode_run; the job cursor, the encoder's span cursor and the team walk; the sources, the
// packing and the wire-format math), with the GPU parallelism replaced by loops: the team
// walk over a grid of kHostWarps warps, team by team, round by round, with the kernels'
// cursors (checked against a division at every step); a team's shuffle max and a tile's
// block max become maxima over their lanes, the tile scheme's atomicMax a max per group
// (the tile encode pass walks the tiles backwards, as blocks may run in any order). What
// the device alone contributes (__shfl_xor_sync, shared memory, atomics, uint4 memory
// instructions, the inline PTX arithmetic, the SIMD intrinsics __vmaxu2 / __vmaxs2 /
// __byte_perm, emulated here, and the hardware conversions cvt.f32.f16 and
// cvt.rn.f16x2.f32 / cvt.rn.bf16x2.f32 with their NaN fix-ups) is not exercised here; on the
// host that arithmetic is the plain IEEE operators and the software conversions (the narrow
// ops below check the fp32 -> fp16 and fp32 -> bf16 ones against IEEE rounding: [Note: hardware
// narrowing]).
//
// Usage (raw little-endian bytes in and out; MISALIGN=1 shifts every buffer off its
// vector alignment, forcing the scalar paths), one command per process, or many through
// `host_check serve` ([Note: host check server]):
//   host_check quantize   DTYPE BITS GS MISALIGN IN OUT
//   host_check reorder    DTYPE BITS GS MISALIGN NUM_CHUNKS PERM(comma-separated) DIVISORS IN OUT
//   host_check interleave DTYPE BITS GS MISALIGN NUM_CHUNKS PERM PARTS PART_NUMEL WIDTHS DIVISORS IN OUT
//     (interleave: IN holds the tensors one after another, tensor k being PARTS x WIDTHS[k]
//     elements; each is copied into a buffer of its own, as separate allocations; MISALIGN=2
//     shifts tensor k by k % 8 elements and leaves the output aligned, so that tensors differ
//     in their alignment while the encoder keeps its vector layout; DIVISORS = WIDE,SLICE_MAGIC,SLICE_SHIFT[,PART_MAGIC,PART_SHIFT], the
//     launcher's kernel arguments: WIDE=1 runs the 64-bit index path)
//   host_check divide     WIDE DIVISOR MAGIC SHIFT N1,N2,...
//     (prints MagicDivisor's quotient of each N, one a line)
//   host_check narrow     IN OUT
//   host_check narrow     FIRST COUNT OUT
//     (the decoders' fp32 -> fp16 rounding, f16x2_bits, on pairs of fp32 values: those of IN
//     (an even count), or the bit patterns FIRST, FIRST + 1, ... (COUNT of them, even);
//     OUT gets the fp16 bits in input order)
//   host_check narrow_bf16 IN OUT
//   host_check narrow_bf16 FIRST COUNT OUT
//     (the same for fp32 -> bf16, bf16x2_bits)
//   host_check bf16nan    IN OUT
//     (bf16x2_nan_halves of each word of IN: [Note: bf16 NaN halves])
//   host_check dequantize DTYPE BITS GS MISALIGN NUMEL K IN OUT
//   host_check reduce     DTYPE BITS GS MISALIGN NUMEL K DIVISOR_BITS(hex fp32) M OUT_BITS IN OUT
//     (reduce: M = 0 stores DTYPE values, M > 0 re-quantizes into M payloads of OUT_BITS)
//   host_check requant_regs BITS GS NUMEL K DIVISOR_BITS M OUT_BITS GROUP_MAGIC GROUP_SHIFT SIZES IN OUT
//     (the re-quantizing kernel of the register scheme on 32-bit indices, [Note: narrow
//     requant]: its cursor, spans and source on aligned buffers, for the divisor mode that
//     divisor_mode picks, with the launcher's multiplier for GS and its SIZES = CHUNK_NUMEL,
//     GROUPS_PER_CHUNK,IN_SCALES,OUT_SCALES ([Note: narrow sizes]); prints "narrow=N mode=D
//     sizes=S": whether the sizes meet the kernel's conditions (N; nothing runs otherwise),
//     the mode, and whether SIZES are what the kernel checks them against (S))
// Each simulated thread has its own copy of the source, kept across its rounds and tiles as
// on the device (the reordering sources remember a stretch per thread: [Note: stretches]).
// Prints "vec=V tiles=T regs=R teams=D": whether the vector paths were taken (V); for the
// encoder, whether the tile scheme ran (T; see [Note: large groups] in group_encoder.cuh)
// and whether teams held their groups in registers (R); for the decoder, whether the team
// layout ran (D; run_decoder.cuh).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "group_encoder.cuh"
#include "requant_rounds.cuh"
#include "run_decoder.cuh"

using namespace zc;

namespace {

// A buffer whose data() is 64-byte aligned, or deliberately `shift` bytes past that.
struct Buffer {
    std::vector<u8> storage;
    u8* data;
    Buffer(size_t bytes, size_t shift) : storage(bytes + 128) {
        const auto base = reinterpret_cast<unsigned long long>(storage.data());
        data = storage.data() + ((64 - base % 64) % 64) + shift;
    }
};

std::vector<u8> read_file(const char* path) {
    std::ifstream in(path, std::ios::binary);
    return std::vector<u8>(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_file(const char* path, const u8* data, size_t bytes) {
    std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(bytes));
}

Buffer load_input(const char* path, size_t shift) {
    const std::vector<u8> bytes = read_file(path);
    Buffer b(bytes.size(), shift);
    std::memcpy(b.data, bytes.data(), bytes.size());
    return b;
}

i64 payload_bytes(i64 numel, int bits, i64 gs) {
    return numel == 0 ? 0 : scales_offset(numel, bits) + 4 * num_groups(numel, gs);
}

// Warps of the simulated grid: few, so that every warp runs several rounds and the job
// cursor's carry into the next row is taken (see [Note: job cursor] in team_walk.cuh).
constexpr i64 kHostWarps = 3;
bool g_registers = false;  // whether the last encode held its groups in registers
bool g_teams = false;      // whether the last decode ran the team layout

// Every (warp, team, round) of the grid in the kernels' order, with the kernels' cursor;
// `job(row, group)` runs one live job. Aborts if the cursor ever disagrees with the division.
template <class Job> void walk_jobs(i64 jobs, i64 groups_per_row, i64 rows, int lanes, Job job_fn) {
    const TeamWalk walk(jobs, lanes, kHostWarps);
    i64 visited = 0;
    for (i64 warp = 0; warp < kHostWarps; ++warp) {
        for (int team = 0; team < walk.teams_per_warp; ++team) {
            JobCursor job = walk.cursor(warp, team, groups_per_row);
            for (i64 round = warp; round < walk.rounds; round += walk.num_warps, job.advance()) {
                const i64 index = round * walk.teams_per_warp + team;
                if (job.row * groups_per_row + job.group != index || job.group >= groups_per_row) std::abort();
                if (job.row >= rows) continue;
                job_fn(job.row, job.group);
                ++visited;
            }
        }
    }
    if (visited != jobs) std::abort();
}

bool same_span(const GroupSpan& a, const GroupSpan& b) {
    return a.first == b.first && a.len == b.len && a.values == b.values && a.scale_slot == b.scale_slot &&
           a.pad_len == b.pad_len && (a.pad_len == 0 || a.pad_begin == b.pad_begin);
}

// The encoder's rounds (encode_rounds in group_encoder.cuh) over the grid of kHostWarps warps,
// team by team, with the kernels' span cursor: every span it yields is checked against
// span(row, group) from a division, and its liveness against the job count (aborts if not).
// `job_fn(span, thread)` runs one live job, `thread` the index of the team's lane 0 in the grid.
template <int BITS, bool ONE_CHUNK, class Job> void walk_encoder_jobs(const ChunkLayout<BITS>& layout, int lanes, Job job_fn) {
    const TeamWalk walk(layout.jobs(), lanes, kHostWarps);
    const i64 groups = layout.groups_per_chunk();
    i64 visited = 0;
    for (i64 warp = 0; warp < kHostWarps; ++warp) {
        for (int team = 0; team < walk.teams_per_warp; ++team) {
            SpanCursor<BITS, ONE_CHUNK> job(layout, warp * walk.teams_per_warp + team, walk.num_warps * walk.teams_per_warp);
            i64 round = warp;
            for (i64 rounds = walk.rounds > warp ? (walk.rounds - warp - 1) / walk.num_warps + 1 : 0; rounds > 0;
                 --rounds, job.advance(), round += walk.num_warps) {
                const i64 index = round * walk.teams_per_warp + team;
                if (round >= walk.rounds || job.live() != (index < layout.jobs())) std::abort();
                if (!job.live()) continue;
                const GroupSpan s = job.span();
                if (!same_span(s, layout.span(index / groups, index % groups))) std::abort();
                job_fn(s, warp * 32 + team * lanes);
                ++visited;
            }
            if (round < walk.rounds) std::abort();
        }
    }
    if (visited != layout.jobs()) std::abort();
}

template <int BITS, bool ONE_CHUNK, class Source>
void encode_teams(const Source& src, const ChunkLayout<BITS>& layout, bool vec) {
    const int lanes = team_lanes(layout.group_extent());
    g_registers = in_registers(vec, layout.group_extent());
    std::vector<Source> threads(static_cast<size_t>(32 * kHostWarps), src);
    walk_encoder_jobs<BITS, ONE_CHUNK>(layout, lanes, [&](const GroupSpan& s, i64 thread) {
        const Source* lane_src = &threads[static_cast<size_t>(thread)];
        u32 absmax_bits = 0;
        if (g_registers) {
            // what RegisterLane::store relies on: word-aligned scales and no padding
            if (!layout.words_aligned() || s.pad_len != 0) std::abort();
            std::vector<RegisterLane<BITS, Source>> held(static_cast<size_t>(lanes));
            for (int lane = 0; lane < lanes; ++lane) {
                absmax_bits = max_u32(absmax_bits, held[lane].load(lane_src[lane], s, lane, lanes));
            }
            for (int lane = 0; lane < lanes; ++lane) held[lane].store(lane_src[lane], s, lane, lanes, absmax_bits);
            return;
        }
        for (int lane = 0; lane < lanes; ++lane) {
            absmax_bits = max_u32(absmax_bits, lane_absmax<BITS>(lane_src[lane], s, lane, lanes, vec));
        }
        for (int lane = 0; lane < lanes; ++lane) {
            encode_group_lane<BITS>(lane_src[lane], s, lane, lanes, vec, layout.words_aligned(), absmax_bits);
        }
    });
}

template <int BITS, class Source> void encode_tiles(const Source& src, const ChunkLayout<BITS>& layout, bool vec) {
    std::vector<u32> group_absmax(static_cast<size_t>(layout.jobs()), 0);
    std::vector<Source> threads(static_cast<size_t>(kTileThreads), src);  // one block's threads, pass after pass
    for (i64 tile = 0; tile < layout.tiles(); ++tile) {  // pass kTileAbsmax
        const GroupSpan s = layout.tile_span(tile);
        u32& m = group_absmax[static_cast<size_t>(tile / layout.tiles_per_group())];
        for (int lane = 0; lane < kTileThreads; ++lane) {
            m = max_u32(m, lane_absmax<BITS>(threads[lane], s, lane, kTileThreads, vec));
        }
    }
    for (i64 tile = layout.tiles() - 1; tile >= 0; --tile) {  // pass kTileEncode
        const GroupSpan s = layout.tile_span(tile);
        const u32 absmax_bits = group_absmax[static_cast<size_t>(tile / layout.tiles_per_group())];
        for (int lane = 0; lane < kTileThreads; ++lane) {
            encode_group_lane<BITS>(threads[lane], s, lane, kTileThreads, vec, layout.words_aligned(), absmax_bits);
        }
    }
}

bool g_tiles = false;  // whether the last encode ran the tile scheme (printed by main)

// The scheme the launcher picks for this layout (zcomm/quant/backends/_cuda_launch.py, encoder_passes);
// ONE_CHUNK as the kernel passes it to run_encoder (quantize.cu: true).
template <int BITS, bool ONE_CHUNK = false, class Source>
bool encode_all(const Source& src, const ChunkLayout<BITS>& layout) {
    const bool vec = src.can_vectorize() && layout.can_vectorize();
    g_tiles = layout.group_extent() > kTeamMaxGroup;
    g_registers = false;
    if (g_tiles) {
        encode_tiles<BITS>(src, layout, vec);
    } else {
        encode_teams<BITS, ONE_CHUNK>(src, layout, vec);
    }
    return vec;
}

// ONE_ROW as the kernel passes it (dequantize.cu: true; dequant_reduce.cu: false).
template <bool ONE_ROW, class T, int BITS> bool decode_all(const SegmentLayout<T, BITS>& layout) {
    const bool vec = layout.can_vectorize();
    g_teams = layout.teams(vec);
    if (!g_teams) {
        for (i64 run = 0; run < layout.runs(); ++run) decode_run(layout, run, vec);
        return vec;
    }
    const int lanes = team_lanes(layout.group_extent());
    walk_jobs(layout.groups_per_segment() * layout.segments, layout.groups_per_segment(), layout.segments, lanes,
              [&](i64 segment, i64 group) {
                  for (int lane = 0; lane < lanes; ++lane) {
                      const int mode = team_divisor_mode(layout);
                      if (mode == kByOne) {
                          decode_group_lane<kByOne, ONE_ROW>(layout, segment, group, lane, lanes);
                      } else if (mode == kByReciprocal) {
                          decode_group_lane<kByReciprocal, ONE_ROW>(layout, segment, group, lane, lanes);
                      } else {
                          decode_group_lane<kByDivision, ONE_ROW>(layout, segment, group, lane, lanes);
                      }
                  }
              });
    return vec;
}

std::vector<i64> parse_list(const std::string& text) {
    std::vector<i64> values;
    std::stringstream ss(text);
    for (std::string item; std::getline(ss, item, ',');) values.push_back(std::atoll(item.c_str()));
    return values;
}

// The launcher's divisor arguments: WIDE,SLICE_MAGIC,SLICE_SHIFT[,PART_MAGIC,PART_SHIFT].
struct Divisors {
    bool wide;
    u64 slice_magic;
    int slice_shift;
    u64 part_magic;
    int part_shift;
};

Divisors parse_divisors(const char* text) {
    std::vector<u64> values;
    std::stringstream ss(text);
    for (std::string item; std::getline(ss, item, ',');) values.push_back(std::strtoull(item.c_str(), nullptr, 10));
    values.resize(5, 0);
    return Divisors{values[0] != 0, values[1], static_cast<int>(values[2]), values[3], static_cast<int>(values[4])};
}

// reorder_quantize's interleaved form: InterleavedSource over tensors in separate buffers,
// on the index path the launcher picked (WIDE).
template <class T, int BITS, bool WIDE>
bool run_interleave_as(char** argv, const std::vector<Buffer>& tensors, const std::vector<i64>& table_entries,
                       const Divisors& d, size_t byte_shift) {
    const i64 gs = std::atoll(argv[4]);
    const i64 chunks = std::atoll(argv[6]);
    const std::vector<i64> perm = parse_list(argv[7]);
    const i64 part_numel = std::atoll(argv[9]);
    const i64 numel = std::atoll(argv[8]) * part_numel;
    // the table as the launcher uploads it, followed by nonzero bytes, so that a read past
    // its zero run shows in the output
    const size_t table_bytes = (table_entries.size() + 5) * sizeof(i64);
    Buffer table(table_bytes + 64, 0);
    std::memset(table.data, 0x5A, table_bytes + 64);
    std::memset(table.data, 0, table_bytes);
    std::memcpy(table.data, table_entries.data(), table_entries.size() * sizeof(i64));
    const i64 row = payload_bytes(numel / chunks, BITS, gs);
    Buffer out(row * chunks, byte_shift);
    const ChunkLayout<BITS> layout{out.data, numel / chunks, chunks, gs, row};
    const MagicDivisor<WIDE> part(part_numel, d.part_magic, d.part_shift);
    const MagicDivisor<WIDE> slice(numel / static_cast<i64>(perm.size()), d.slice_magic, d.slice_shift);
    const InterleavedSource<T, WIDE> source(reinterpret_cast<const i64*>(table.data),
                                            static_cast<i64>(tensors.size()), part, perm.data(), slice);
    const bool vec = encode_all<BITS>(source, layout);
    write_file(argv[13], out.data, row * chunks);
    return vec;
}

template <class T, int BITS> bool run_interleave(char** argv, int misalign, size_t byte_shift) {
    const i64 parts = std::atoll(argv[8]);
    const std::vector<i64> widths = parse_list(argv[10]);
    const Divisors d = parse_divisors(argv[11]);
    const std::vector<u8> bytes = read_file(argv[12]);
    std::vector<Buffer> tensors;
    std::vector<i64> table;
    size_t offset = 0;
    i64 end = 0;
    for (size_t k = 0; k < widths.size(); ++k) {
        const size_t nbytes = static_cast<size_t>(parts * widths[k]) * sizeof(T);
        const size_t shift = misalign == 2 ? (k % 8) * sizeof(T) : (misalign ? sizeof(T) : 0);
        tensors.emplace_back(nbytes, shift);
        std::memcpy(tensors.back().data, bytes.data() + offset, nbytes);
        offset += nbytes;
        end += widths[k];
        table.insert(table.end(),
                     {static_cast<i64>(reinterpret_cast<unsigned long long>(tensors.back().data)), widths[k], end});
    }
    return d.wide ? run_interleave_as<T, BITS, true>(argv, tensors, table, d, byte_shift)
                  : run_interleave_as<T, BITS, false>(argv, tensors, table, d, byte_shift);
}

// dequant_reduce_requant: the k rows of BITS summed into m payloads of OUT_BITS.
template <int BITS, int OUT_BITS>
bool run_requant(const PayloadRows<BITS>& rows, i64 k, float divisor, i64 m, size_t byte_shift, const char* out_path) {
    const i64 row = payload_bytes(rows.numel / m, OUT_BITS, rows.group_size);
    Buffer out(row * m, byte_shift);
    const ChunkLayout<OUT_BITS> layout{out.data, rows.numel / m, m, rows.group_size, row};
    // the kernel's dispatch (requantize_sum in dequant_reduce_requant.cu): the divisor's mode, once
    const int mode = divisor_mode(divisor);
    const bool vec = mode == kByOne ? encode_all<OUT_BITS>(PayloadSum<BITS, kByOne>(rows, 0, k, divisor), layout)
                     : mode == kByReciprocal
                         ? encode_all<OUT_BITS>(PayloadSum<BITS, kByReciprocal>(rows, 0, k, divisor), layout)
                         : encode_all<OUT_BITS>(PayloadSum<BITS, kByDivision>(rows, 0, k, divisor), layout);
    write_file(out_path, out.data, row * m);
    return vec;
}

// Runs one op for element type T and BITS; returns whether vector paths ran.
template <class T, int BITS> bool run_op(const std::string& op, char** argv, int argc) {
    const i64 gs = std::atoll(argv[4]);
    const int misalign = std::atoi(argv[5]);
    const size_t elem_shift = misalign ? sizeof(T) : 0;
    const size_t byte_shift = misalign ? 1 : 0;
    const char* in_path = argv[argc - 2];
    const char* out_path = argv[argc - 1];
    if (op == "interleave") return run_interleave<T, BITS>(argv, misalign, misalign == 1 ? 1 : 0);
    if (op == "quantize" || op == "reorder") {
        Buffer in = load_input(in_path, elem_shift);
        const i64 numel = static_cast<i64>(read_file(in_path).size() / sizeof(T));
        const T* x = reinterpret_cast<const T*>(in.data);
        const i64 chunks = op == "reorder" ? std::atoll(argv[6]) : 1;
        const i64 row = payload_bytes(numel / chunks, BITS, gs);
        Buffer out(row * chunks, byte_shift);
        // quantize.cu passes row_stride 0 (one payload); mirror it so the vector decision matches
        const ChunkLayout<BITS> layout{out.data, numel / chunks, chunks, gs, op == "quantize" ? 0 : row};
        bool vec;
        if (op == "quantize") {
            vec = encode_all<BITS, true>(FlatSource<T>{x}, layout);
        } else {
            const std::vector<i64> perm = parse_list(argv[7]);
            const Divisors d = parse_divisors(argv[8]);
            const i64 slice_numel = numel / static_cast<i64>(perm.size());
            if (d.wide) {
                const MagicDivisor<true> slice(slice_numel, d.slice_magic, d.slice_shift);
                vec = encode_all<BITS>(PermutedSource<T, true>{x, perm.data(), slice}, layout);
            } else {
                const MagicDivisor<false> slice(slice_numel, d.slice_magic, d.slice_shift);
                vec = encode_all<BITS>(PermutedSource<T, false>{x, perm.data(), slice}, layout);
            }
        }
        write_file(out_path, out.data, row * chunks);
        return vec;
    }
    const i64 numel = std::atoll(argv[6]);
    const i64 k = std::atoll(argv[7]);
    const i64 stride = payload_bytes(numel, BITS, gs);
    Buffer in = load_input(in_path, byte_shift);
    const PayloadRows<BITS> rows{in.data, stride, numel, gs};
    const i64 segments = op == "dequantize" ? k : 1;
    float divisor = 1.0f;
    i64 m = 0;
    int out_bits = BITS;
    if (op == "reduce") {
        const u32 divisor_bits = static_cast<u32>(std::strtoul(argv[8], nullptr, 16));
        divisor = bits_float(divisor_bits);
        m = std::atoll(argv[9]);
        out_bits = std::atoi(argv[10]);
    }
    if (m > 0) {
        return out_bits == 8 ? run_requant<BITS, 8>(rows, k, divisor, m, byte_shift, out_path)
                             : run_requant<BITS, 4>(rows, k, divisor, m, byte_shift, out_path);
    }
    Buffer out(segments * numel * sizeof(T), elem_shift);
    T* dst = reinterpret_cast<T*>(out.data);
    const SegmentLayout<T, BITS> layout{rows, dst, segments, op == "dequantize" ? 1 : k, divisor};
    const bool vec = op == "dequantize" ? decode_all<true>(layout) : decode_all<false>(layout);
    write_file(out_path, out.data, segments * numel * sizeof(T));
    return vec;
}

// The narrow kernel's rounds (encode_narrow_rounds in requant_rounds.cuh) over the grid of
// kHostWarps warps, team by team, with its 32-bit cursor and spans: each span is checked
// against ChunkLayout::span from a division, and its liveness against the job count.
template <int MODE, int BITS, int OUT_BITS>
void encode_narrow(const NarrowPayloadSum<BITS, MODE>& src, const ChunkLayout<OUT_BITS>& wide_layout,
                   const NarrowSizes& sizes) {
    using Source = NarrowPayloadSum<BITS, MODE>;
    // as requantize_narrow builds them
    const NarrowChunks<OUT_BITS> layout{wide_layout.out, static_cast<u32>(sizes.chunk_numel),
                                       static_cast<u32>(wide_layout.num_chunks), static_cast<u32>(wide_layout.group_size),
                                       static_cast<u32>(wide_layout.row_stride), static_cast<u32>(sizes.out_scales)};
    const int lanes = team_lanes(wide_layout.group_extent());
    const TeamWalk walk(wide_layout.jobs(), lanes, kHostWarps);
    const i64 groups = sizes.groups_per_chunk;
    i64 visited = 0;
    for (i64 warp = 0; warp < kHostWarps; ++warp) {
        for (int team = 0; team < walk.teams_per_warp; ++team) {
            NarrowJobCursor job(warp * walk.teams_per_warp + team, walk.num_warps * walk.teams_per_warp, groups);
            for (i64 round = warp; round < walk.rounds; round += walk.num_warps, job.advance()) {
                const i64 index = round * walk.teams_per_warp + team;
                const bool live = job.row < layout.num_chunks;
                if (live != (index < wide_layout.jobs())) std::abort();
                if (!live) continue;
                const GroupSpan s = layout.span(job.row, job.group);
                if (!same_span(s, wide_layout.span(index / groups, index % groups))) std::abort();
                std::vector<RegisterLane<OUT_BITS, Source>> held(static_cast<size_t>(lanes));
                u32 absmax_bits = 0;
                for (int lane = 0; lane < lanes; ++lane) {
                    absmax_bits = max_u32(absmax_bits, held[lane].load(src, s, lane, lanes));
                }
                for (int lane = 0; lane < lanes; ++lane) held[lane].store(src, s, lane, lanes, absmax_bits);
                ++visited;
            }
        }
    }
    if (visited != wide_layout.jobs()) std::abort();
}

template <int BITS, int OUT_BITS> int run_requant_regs(char** argv) {
    const i64 gs = std::atoll(argv[3]);
    const i64 numel = std::atoll(argv[4]);
    const i64 k = std::atoll(argv[5]);
    const float divisor = bits_float(static_cast<u32>(std::strtoul(argv[6], nullptr, 16)));
    const i64 m = std::atoll(argv[7]);
    const MagicDivisor<false> group(gs, std::strtoull(argv[9], nullptr, 10), std::atoi(argv[10]));
    const std::vector<i64> s = parse_list(argv[11]);
    const NarrowSizes sizes{s.at(0), s.at(1), s.at(2), s.at(3)};
    const i64 stride = payload_bytes(numel, BITS, gs);
    Buffer in = load_input(argv[12], 0);
    const PayloadRows<BITS> rows{in.data, stride, numel, gs};
    const i64 row = payload_bytes(numel / m, OUT_BITS, gs);
    Buffer out(row * m, 0);
    const ChunkLayout<OUT_BITS> layout{out.data, numel / m, m, gs, row};
    const bool narrow = rows.can_vectorize() && layout.can_vectorize() && in_registers(true, layout.group_extent()) &&
                        numel <= (i64{1} << 31);
    const int mode = divisor_mode(divisor);
    const bool described = sizes.describe(rows, layout);  // else the kernel traps
    if (narrow && described) {
        const i64 scales = sizes.in_scales;
        if (mode == kByOne) {
            encode_narrow(NarrowPayloadSum<BITS, kByOne>(in.data, stride, scales, k, group, divisor), layout, sizes);
        } else if (mode == kByReciprocal) {
            encode_narrow(NarrowPayloadSum<BITS, kByReciprocal>(in.data, stride, scales, k, group, divisor), layout,
                          sizes);
        } else {
            encode_narrow(NarrowPayloadSum<BITS, kByDivision>(in.data, stride, scales, k, group, divisor), layout,
                          sizes);
        }
        write_file(argv[13], out.data, row * m);
    }
    std::printf("narrow=%d mode=%d sizes=%d\n", narrow ? 1 : 0, mode, described ? 1 : 0);
    return 0;
}

template <class T> bool dispatch_bits(const std::string& op, int bits, char** argv, int argc) {
    return bits == 8 ? run_op<T, 8>(op, argv, argc) : run_op<T, 4>(op, argv, argc);
}

}  // namespace

// MagicDivisor's quotients of a list of numerators ([Note: magic division]), one a line.
template <bool WIDE> int run_divide(char** argv) {
    const MagicDivisor<WIDE> d(static_cast<i64>(std::strtoull(argv[3], nullptr, 10)), std::strtoull(argv[4], nullptr, 10),
                               std::atoi(argv[5]));
    std::stringstream ss(argv[6]);
    for (std::string item; std::getline(ss, item, ',');) {
        const auto n = static_cast<typename MagicDivisor<WIDE>::U>(std::strtoull(item.c_str(), nullptr, 10));
        std::printf("%llu\n", static_cast<unsigned long long>(d.quotient(n)));
    }
    return 0;
}

// The decoders' fp32 -> fp16 or bf16 rounding ([Note: hardware narrowing]; its host path,
// `narrow2` = f16x2_bits or bf16x2_bits) on pairs of inputs, `count` fp32 bit patterns from
// `input(i)`, written to `out_path` in order.
template <class Input, class Narrow2> int run_narrow(u32 count, Input input, const char* out_path, Narrow2 narrow2) {
    if (count % 2 != 0) return 2;
    std::ofstream out(out_path, std::ios::binary);
    std::vector<u32> words(1u << 20);
    for (u32 begin = 0; begin < count; begin += 2 * static_cast<u32>(words.size())) {
        const u32 n = std::min(count - begin, 2 * static_cast<u32>(words.size())) / 2;
        for (u32 k = 0; k < n; ++k) {
            words[k] = narrow2(bits_float(input(begin + 2 * k)), bits_float(input(begin + 2 * k + 1)));
        }
        out.write(reinterpret_cast<const char*>(words.data()), static_cast<std::streamsize>(4 * n));
    }
    return out ? 0 : 2;
}

const auto kToFp16 = [](float lo, float hi) { return f16x2_bits(lo, hi); };
const auto kToBf16 = [](float lo, float hi) { return bf16x2_bits(lo, hi); };

// One command, argv[1] naming the op (the usage above); its exit status.
int run_command(int argc, char** argv) {
    g_tiles = g_registers = g_teams = false;
    if (argc == 14 && std::string(argv[1]) == "requant_regs") {
        const int bits = std::atoi(argv[2]), out_bits = std::atoi(argv[8]);
        if (bits == 8) return out_bits == 8 ? run_requant_regs<8, 8>(argv) : run_requant_regs<8, 4>(argv);
        return out_bits == 8 ? run_requant_regs<4, 8>(argv) : run_requant_regs<4, 4>(argv);
    }
    if (argc == 7 && std::string(argv[1]) == "divide") {
        return std::atoi(argv[2]) ? run_divide<true>(argv) : run_divide<false>(argv);
    }
    if (argc == 4 && std::string(argv[1]) == "narrow") {
        const std::vector<u8> bytes = read_file(argv[2]);
        std::vector<u32> bits(bytes.size() / 4);
        std::memcpy(bits.data(), bytes.data(), 4 * bits.size());
        return run_narrow(static_cast<u32>(bits.size()), [&](u32 i) { return bits[i]; }, argv[3], kToFp16);
    }
    if (argc == 5 && std::string(argv[1]) == "narrow") {
        const u32 first = static_cast<u32>(std::strtoull(argv[2], nullptr, 10));
        const u32 count = static_cast<u32>(std::strtoull(argv[3], nullptr, 10));
        return run_narrow(count, [&](u32 i) { return first + i; }, argv[4], kToFp16);
    }
    if ((argc == 4 || argc == 5) && std::string(argv[1]) == "narrow_bf16") {
        if (argc == 5) {
            const u32 first = static_cast<u32>(std::strtoull(argv[2], nullptr, 10));
            const u32 count = static_cast<u32>(std::strtoull(argv[3], nullptr, 10));
            return run_narrow(count, [&](u32 i) { return first + i; }, argv[4], kToBf16);
        }
        const std::vector<u8> bytes = read_file(argv[2]);
        std::vector<u32> bits(bytes.size() / 4);
        std::memcpy(bits.data(), bytes.data(), 4 * bits.size());
        return run_narrow(static_cast<u32>(bits.size()), [&](u32 i) { return bits[i]; }, argv[3], kToBf16);
    }
    if (argc == 4 && std::string(argv[1]) == "bf16nan") {
        const std::vector<u8> bytes = read_file(argv[2]);
        std::vector<u32> words(bytes.size() / 4);
        std::memcpy(words.data(), bytes.data(), 4 * words.size());
        for (u32& w : words) w = bf16x2_nan_halves(w);
        write_file(argv[3], reinterpret_cast<const u8*>(words.data()), 4 * words.size());
        return 0;
    }
    if (argc < 8) {
        std::fprintf(stderr, "usage: see the header of host_check.cu\n");
        return 2;
    }
    const std::string op = argv[1];
    const std::string dtype = argv[2];
    const int bits = std::atoi(argv[3]);
    bool vec;
    if (dtype == "f32") {
        vec = dispatch_bits<float>(op, bits, argv, argc);
    } else if (dtype == "bf16") {
        vec = dispatch_bits<bf16_t>(op, bits, argv, argc);
    } else if (dtype == "f16") {
        vec = dispatch_bits<fp16_t>(op, bits, argv, argc);
    } else {
        std::fprintf(stderr, "unknown dtype %s\n", dtype.c_str());
        return 2;
    }
    std::printf("vec=%d tiles=%d regs=%d teams=%d\n", vec ? 1 : 0, g_tiles ? 1 : 0, g_registers ? 1 : 0, g_teams ? 1 : 0);
    return 0;
}

// [Note: host check server] `host_check serve` runs commands read from standard input, one a
// line, their arguments separated by tabs (paths may hold spaces), each as `host_check ARGS...`
// would run it; after each, the command's output and then a line "\x1e STATUS" (its exit
// status) on standard output, flushed. One process serves every case of a build: starting a
// process per case cost more than most cases' work. A case that aborts ends the process, and
// the test harness (tests/quant/host_check_server.py) starts another for the next case.
int serve() {
    for (std::string line; std::getline(std::cin, line);) {
        std::vector<std::string> args{"host_check"};
        std::stringstream ss(line);
        for (std::string item; std::getline(ss, item, '\t');) args.push_back(item);
        std::vector<char*> argv;
        for (std::string& arg : args) argv.push_back(arg.data());
        argv.push_back(nullptr);
        const int status = run_command(static_cast<int>(args.size()), argv.data());
        std::printf("\x1e %d\n", status);
        std::fflush(stdout);
    }
    return 0;
}

int main(int argc, char** argv) {
    if (argc == 2 && std::string(argv[1]) == "serve") return serve();
    return run_command(argc, argv);
}
