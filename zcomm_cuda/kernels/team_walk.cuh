// Teams of lanes walking groups: the work layout shared by the group encoder and the
// group decoder for groups of up to kTeamMaxGroup elements.
//
// A team is `lanes` consecutive threads of a warp (a power of two, at most 32) that handle
// one group of one row (a payload, or a segment of the output) at a time. Lane l takes the
// group's runs of 8 elements l, l + lanes, l + 2 * lanes, ...: at each step the team's lanes
// touch consecutive runs, so every memory instruction of a team covers one contiguous,
// coalesced stretch (16 bytes per lane for bf16/fp16, 2 x 16 for fp32). A warp holds
// 32 / lanes teams; warps walk the jobs (row, group) grid-stride, in rounds that are
// uniform per warp so that the team's shuffles see all 32 lanes.
//
// [Note: job cursor] A job's (row, group) would cost two 64-bit divisions per round (and
// a third for the groups per row). Instead each team divides once, at the start: its first
// job and the constant step between its jobs become (row, group) pairs, and every round
// adds the step's pair with one carry, which is exact because the step's group part is
// below groups_per_row. The host check (tests/quant/cuda_host/host_check.cu) drives this
// same cursor over the same rounds, warps and teams as the device does.
#pragma once

#include "wire_math.cuh"

namespace zc {

constexpr i64 kTeamMaxGroup = 4096;  // larger groups take the encoder's tile scheme
constexpr int kRunsPerLane = 4;      // runs of 8 a lane holds in registers
constexpr i64 kRegisterMaxGroup = 32 * 8 * kRunsPerLane;  // groups a full-warp team holds in registers

// Lanes per group: the fewest (a power of two in [1, 32]) that hold the group in
// kRunsPerLane runs of 8 per lane, or 32 for larger groups.
ZC_HD int team_lanes(i64 group_extent) {
    int lanes = 1;
    while (lanes < 32 && lanes * 8 * kRunsPerLane < group_extent) lanes *= 2;
    return lanes;
}

// The jobs (row, group) of one team, job = round * teams_per_warp + team for the rounds
// round = warp, warp + num_warps, ... (see [Note: job cursor]). Index is i64, or u32 where a
// kernel's sizes are known to fit and its registers are scarce (NarrowJobCursor).
template <class Index>
struct BasicJobCursor {
    Index row;
    Index group;
    Index step_rows;
    Index step_groups;
    Index groups_per_row;

    ZC_HD BasicJobCursor(i64 first_job, i64 step, i64 groups_per_row_)
        : row(static_cast<Index>(first_job / groups_per_row_)),
          group(static_cast<Index>(first_job % groups_per_row_)),
          step_rows(static_cast<Index>(step / groups_per_row_)),
          step_groups(static_cast<Index>(step % groups_per_row_)),
          groups_per_row(static_cast<Index>(groups_per_row_)) {}

    ZC_HD void advance() {
        group += step_groups;
        row += step_rows;
        if (group >= groups_per_row) {
            group -= groups_per_row;
            ++row;
        }
    }
};

using JobCursor = BasicJobCursor<i64>;
using NarrowJobCursor = BasicJobCursor<u32>;

// The walk of one team over its rounds: warp `warp` of `num_warps`, team `team` of the warp.
struct TeamWalk {
    int lanes;
    int teams_per_warp;
    i64 rounds;  // rounds of the whole grid: every warp runs the rounds warp, warp + num_warps, ...
    i64 num_warps;

    ZC_HD TeamWalk(i64 jobs, int lanes_, i64 num_warps_)
        : lanes(lanes_), teams_per_warp(32 / lanes_), rounds((jobs + 32 / lanes_ - 1) / (32 / lanes_)),
          num_warps(num_warps_) {}

    ZC_HD JobCursor cursor(i64 warp, int team, i64 groups_per_row) const {
        return JobCursor(warp * teams_per_warp + team, num_warps * teams_per_warp, groups_per_row);
    }
};

#ifdef __CUDACC__
// Max over the `lanes` aligned lanes of a team; every lane of the warp must call it.
// Unrolled over the five possible offsets (lanes is uniform over the warp), so the round
// loop around it holds no inner loop.
__device__ __forceinline__ u32 team_max(u32 v, int lanes) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
        if (offset < lanes) v = max_u32(v, __shfl_xor_sync(0xFFFFFFFFu, v, offset));
    }
    return v;
}
#endif

}  // namespace zc
