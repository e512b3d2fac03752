// The run decoder: dequantizes (and sums) payload rows into a float tensor.
//
// Algorithm. The output is `segments` stretches of `numel` elements; segment s is the sum
// of payload rows [s * rows_per_segment, (s + 1) * rows_per_segment) (see PayloadSum).
// dequantize is segments = k, rows_per_segment = 1; dequant_reduce is segments = 1,
// rows_per_segment = k. Each thread decodes one run of 8 elements of one segment at a time
// (vector loads and stores when the buffers allow, else element by element, also for the
// short last run of a segment); threads walk the runs grid-stride.
#pragma once

#include "sources.cuh"

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
};

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
template <class T, int BITS> __device__ void decode_segments(const SegmentLayout<T, BITS>& layout) {
    const bool vec = layout.can_vectorize();
    const i64 stride = static_cast<i64>(gridDim.x) * blockDim.x;
    const i64 runs = layout.runs();
    for (i64 run = static_cast<i64>(blockIdx.x) * blockDim.x + threadIdx.x; run < runs; run += stride) {
        decode_run(layout, run, vec);
    }
}
#endif

}  // namespace zc
