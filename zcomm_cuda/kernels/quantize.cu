// quantize: one tensor -> one payload (see group_encoder.cuh for the algorithm).
#include "group_encoder.cuh"
#include "instantiate.cuh"

#define ZC_QUANTIZE(TAG, T, BITS)                                                                     \
    extern "C" __global__ void zc_quantize_##TAG##_int##BITS(const T* x, zc::i64 numel, zc::i64 group_size, \
                                                             zc::u8* out) {                           \
        const zc::ChunkLayout<BITS> layout{out, numel, 1, group_size, 0};                             \
        zc::encode_groups<BITS>(zc::FlatSource<T>{x}, layout);                                        \
    }

ZC_FOR_EACH_DTYPE_BITS(ZC_QUANTIZE)
