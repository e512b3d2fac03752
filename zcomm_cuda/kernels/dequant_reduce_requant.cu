// dequant_reduce_requant: the general re-quantizing dequant_reduce. k payload rows of IN_BITS,
// dequantized and summed in fp32 in row order, divided once, and re-quantized in the same pass
// into m payloads of OUT_BITS (the group encoder reading a PayloadSum, so the fp32 sums never
// go to memory). It holds every encoder scheme (registers, streamed teams, tiles) for the
// three divisor modes on 64-bit indices: the sizes and alignments the narrow kernels of
// dequant_reduce.cu do not take ([Note: narrow requant] in requant_rounds.cuh). It is a
// translation unit of its own because its four kernels are most of the kernels' compile time
// (about as much as every other source together): NVRTC compiles it next to the others, in
// parallel ([Note: kernel cache] in zcomm_cuda/_disk_cache.py).
#include "group_encoder.cuh"
#include "instantiate.cuh"

namespace zc {
// The kernels' body: the divisor's kind is checked once per launch, so that the encoder's
// loops hold only its operation (divisor_mode in sources.cuh), as the decoder's do.
template <int OUT_BITS, int IN_BITS>
__device__ void requantize_sum(const PayloadRows<IN_BITS>& rows, i64 k, float divisor, const ChunkLayout<OUT_BITS>& layout,
                               int pass, u32* group_absmax) {
    const int mode = divisor_mode(divisor);
    if (mode == kByOne) {
        run_encoder<OUT_BITS>(PayloadSum<IN_BITS, kByOne>(rows, 0, k, divisor), layout, pass, group_absmax);
    } else if (mode == kByReciprocal) {
        run_encoder<OUT_BITS>(PayloadSum<IN_BITS, kByReciprocal>(rows, 0, k, divisor), layout, pass, group_absmax);
    } else {
        run_encoder<OUT_BITS>(PayloadSum<IN_BITS, kByDivision>(rows, 0, k, divisor), layout, pass, group_absmax);
    }
}
}  // namespace zc

#define ZC_DEQUANT_REDUCE_REQUANT(IN_BITS, OUT_BITS)                                                  \
    extern "C" __global__ void zc_dequant_reduce_requant_int##IN_BITS##_int##OUT_BITS(                 \
        const zc::u8* payloads, zc::i64 stride, zc::i64 numel, zc::i64 group_size, zc::i64 k, float divisor, \
        zc::i64 num_chunks, zc::i64 out_stride, zc::u8* out, zc::u32* group_absmax, int pass) {       \
        const zc::PayloadRows<IN_BITS> rows{payloads, stride, numel, group_size};                     \
        const zc::ChunkLayout<OUT_BITS> layout{out, numel / num_chunks, num_chunks, group_size, out_stride}; \
        zc::requantize_sum<OUT_BITS>(rows, k, divisor, layout, pass, group_absmax);                    \
    }

ZC_FOR_EACH_BITS_PAIR(ZC_DEQUANT_REDUCE_REQUANT)
