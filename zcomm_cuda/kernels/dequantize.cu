// dequantize: k payload rows -> k * numel elements, row i at [i * numel, (i + 1) * numel)
// (the run decoder with one row per segment; see run_decoder.cuh).
#include "instantiate.cuh"
#include "run_decoder.cuh"

#define ZC_DEQUANTIZE(TAG, T, BITS)                                                                  \
    extern "C" __global__ void zc_dequantize_##TAG##_int##BITS(const zc::u8* payloads, zc::i64 stride, \
                                                               zc::i64 numel, zc::i64 group_size,    \
                                                               zc::i64 k, T* out) {                  \
        const zc::PayloadRows<BITS> rows{payloads, stride, numel, group_size};                       \
        zc::decode_segments<true>(zc::SegmentLayout<T, BITS>{rows, out, k, 1, 1.0f});                \
    }

ZC_FOR_EACH_DTYPE_BITS(ZC_DEQUANTIZE)
