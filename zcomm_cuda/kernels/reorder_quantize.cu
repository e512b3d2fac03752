// reorder_quantize: slices of x read through a permutation, quantized into num_chunks
// payloads; the reordered tensor is never written (see sources.cuh). The interleaved form
// reads several tensors, or one with a zero fill, through a table (InterleavedSource).
#include "group_encoder.cuh"
#include "instantiate.cuh"

#define ZC_REORDER_QUANTIZE(TAG, T, BITS)                                                            \
    extern "C" __global__ void zc_reorder_quantize_##TAG##_int##BITS(                                \
        const T* x, const zc::i64* perm, zc::i64 slice_numel, zc::i64 chunk_numel, zc::i64 num_chunks, \
        zc::i64 group_size, zc::i64 row_stride, zc::u8* out, zc::u32* group_absmax, int pass) {      \
        const zc::ChunkLayout<BITS> layout{out, chunk_numel, num_chunks, group_size, row_stride};    \
        zc::run_encoder<BITS>(zc::PermutedSource<T>{x, perm, slice_numel}, layout, pass, group_absmax); \
    }

#define ZC_REORDER_INTERLEAVED(TAG, T, BITS)                                                         \
    extern "C" __global__ void zc_reorder_interleaved_##TAG##_int##BITS(                             \
        const zc::i64* table, zc::i64 tensors, zc::i64 part_numel, const zc::i64* perm,              \
        zc::i64 slice_numel, zc::i64 chunk_numel, zc::i64 num_chunks, zc::i64 group_size,            \
        zc::i64 row_stride, zc::u8* out, zc::u32* group_absmax, int pass) {                          \
        const zc::ChunkLayout<BITS> layout{out, chunk_numel, num_chunks, group_size, row_stride};    \
        const zc::InterleavedSource<T> source{table, tensors, part_numel, perm, slice_numel};        \
        zc::run_encoder<BITS>(source, layout, pass, group_absmax);                                    \
    }

ZC_FOR_EACH_DTYPE_BITS(ZC_REORDER_QUANTIZE)
ZC_FOR_EACH_DTYPE_BITS(ZC_REORDER_INTERLEAVED)
