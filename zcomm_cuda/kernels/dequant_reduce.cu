// dequant_reduce: k payload rows, dequantized and summed in fp32 in row order, divided
// once, then either stored as floats (the run decoder with one segment of k rows) or, for the
// common re-quantizing sizes, re-quantized in the same pass into m payloads of IN_BITS or
// another width OUT_BITS by the narrow kernels of requant_rounds.cuh ([Note: narrow
// requant]); the other re-quantizing sizes run the general kernel, in
// dequant_reduce_requant.cu.
#include "instantiate.cuh"
#include "requant_rounds.cuh"
#include "run_decoder.cuh"

#define ZC_DEQUANT_REDUCE(TAG, T, BITS)                                                               \
    extern "C" __global__ void zc_dequant_reduce_##TAG##_int##BITS(                                   \
        const zc::u8* payloads, zc::i64 stride, zc::i64 numel, zc::i64 group_size, zc::i64 k, float divisor, \
        T* out) {                                                                                     \
        const zc::PayloadRows<BITS> rows{payloads, stride, numel, group_size};                        \
        zc::decode_segments(zc::SegmentLayout<T, BITS>{rows, out, 1, k, divisor});                    \
    }

ZC_FOR_EACH_DTYPE_BITS(ZC_DEQUANT_REDUCE)

// The register scheme on 32-bit indices, one kernel per divisor mode ([Note: narrow requant]
// in requant_rounds.cuh): `_regs_one`, `_regs_pow2` (a power of two), `_regs_div` (any other).
#define ZC_DEQUANT_REDUCE_REQUANT_REGS_AS(IN_BITS, OUT_BITS, TAG, MODE)                               \
    extern "C" __global__ void zc_dequant_reduce_requant_regs_##TAG##_int##IN_BITS##_int##OUT_BITS(    \
        const zc::u8* payloads, zc::i64 stride, zc::i64 numel, zc::i64 group_size, zc::u64 group_magic, \
        int group_shift, zc::i64 k, float divisor, zc::i64 num_chunks, zc::i64 out_stride, zc::u8* out, \
        zc::i64 chunk_numel, zc::i64 groups_per_chunk, zc::i64 in_scales, zc::i64 out_scales) {        \
        const zc::PayloadRows<IN_BITS> rows{payloads, stride, numel, group_size};                     \
        const zc::ChunkLayout<OUT_BITS> layout{out, numel / num_chunks, num_chunks, group_size, out_stride}; \
        const zc::NarrowSizes sizes{chunk_numel, groups_per_chunk, in_scales, out_scales};            \
        zc::requantize_narrow<MODE>(rows, k, divisor, layout, group_magic, group_shift, sizes);       \
    }

#define ZC_DEQUANT_REDUCE_REQUANT_REGS(IN_BITS, OUT_BITS)                        \
    ZC_DEQUANT_REDUCE_REQUANT_REGS_AS(IN_BITS, OUT_BITS, one, zc::kByOne)         \
    ZC_DEQUANT_REDUCE_REQUANT_REGS_AS(IN_BITS, OUT_BITS, pow2, zc::kByReciprocal) \
    ZC_DEQUANT_REDUCE_REQUANT_REGS_AS(IN_BITS, OUT_BITS, div, zc::kByDivision)

ZC_FOR_EACH_BITS_PAIR(ZC_DEQUANT_REDUCE_REQUANT_REGS)
