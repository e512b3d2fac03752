// quantize: one tensor -> one payload (see group_encoder.cuh for the algorithm; `pass` and
// `group_absmax` select the scheme, see [Note: large groups]).
#include "group_encoder.cuh"
#include "instantiate.cuh"

#define ZC_QUANTIZE(TAG, T, BITS)                                                                     \
    extern "C" __global__ void zc_quantize_##TAG##_int##BITS(const T* x, zc::i64 numel, zc::i64 group_size, \
                                                             zc::u8* out, zc::u32* group_absmax, int pass) { \
        const zc::ChunkLayout<BITS> layout{out, numel, 1, group_size, 0};                             \
        zc::run_encoder<BITS, true>(zc::FlatSource<T>{x}, layout, pass, group_absmax);                \
    }

ZC_FOR_EACH_DTYPE_BITS(ZC_QUANTIZE)
