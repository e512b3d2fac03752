// reorder_quantize: slices of x read through a permutation, quantized into num_chunks
// payloads; the reordered tensor is never written (see sources.cuh). The interleaved form
// reads several tensors, or one with a zero fill, through a table (InterleavedSource).
// Divisions by the slice and part sizes are multiplications by the launcher's multipliers
// ([Note: magic division]). Each kernel comes twice: on 32-bit indices, and (`_wide`) on
// 64-bit ones for inputs of more than 2^31 elements; the launcher picks one per launch, and
// each has its own register count (the 32-bit path's is what the common sizes run with);
// the interleaved form has a third, for its register scheme ([Note: register kernel]).
#include "group_encoder.cuh"
#include "instantiate.cuh"

#define ZC_REORDER_QUANTIZE_AS(NAME, T, BITS, WIDE)                                                  \
    extern "C" __global__ void NAME(const T* x, const zc::i64* perm, zc::i64 slice_numel, zc::u64 slice_magic, \
                                    int slice_shift, zc::i64 chunk_numel, zc::i64 num_chunks, zc::i64 group_size, \
                                    zc::i64 row_stride, zc::u8* out, zc::u32* group_absmax, int pass) { \
        const zc::ChunkLayout<BITS> layout{out, chunk_numel, num_chunks, group_size, row_stride};    \
        const zc::MagicDivisor<WIDE> slice(slice_numel, slice_magic, slice_shift);                   \
        zc::run_encoder<BITS>(zc::PermutedSource<T, WIDE>{x, perm, slice}, layout, pass, group_absmax); \
    }

#define ZC_REORDER_INTERLEAVED_AS(NAME, T, BITS, WIDE)                                               \
    extern "C" __global__ void NAME(const zc::i64* table, zc::i64 tensors, zc::i64 part_numel, zc::u64 part_magic, \
                                    int part_shift, const zc::i64* perm, zc::i64 slice_numel, zc::u64 slice_magic, \
                                    int slice_shift, zc::i64 chunk_numel, zc::i64 num_chunks, zc::i64 group_size, \
                                    zc::i64 row_stride, zc::u8* out, zc::u32* group_absmax, int pass) { \
        const zc::ChunkLayout<BITS> layout{out, chunk_numel, num_chunks, group_size, row_stride};    \
        const zc::MagicDivisor<WIDE> part(part_numel, part_magic, part_shift);                       \
        const zc::MagicDivisor<WIDE> slice(slice_numel, slice_magic, slice_shift);                   \
        const zc::InterleavedSource<T, WIDE> source(table, tensors, part, perm, slice);              \
        zc::run_encoder<BITS>(source, layout, pass, group_absmax);                                   \
    }

// [Note: register kernel] A kernel runs with the registers of its most demanding path. The
// interleaved source's general paths (streamed teams, tiles), which the compiler unrolls
// around its loads, need more than the register scheme (it cost the kernel a block per SM
// when they shared one; bench.kernels --static shows both kernels). So the common case, the
// register scheme on 32-bit indices, has a kernel of its own (`_regs`), which runs
// encode_rounds<true> only (group_absmax and pass unused: the scheme is one launch): the
// launcher picks it when in_registers() holds, which it decides from the sizes and the
// output's address exactly as the general kernel would (_cuda_launch.in_registers, checked
// against the host check's choice).
#define ZC_REORDER_INTERLEAVED_REGS(TAG, T, BITS)                                                    \
    extern "C" __global__ void zc_reorder_interleaved_regs_##TAG##_int##BITS(                        \
        const zc::i64* table, zc::i64 tensors, zc::i64 part_numel, zc::u64 part_magic, int part_shift, \
        const zc::i64* perm, zc::i64 slice_numel, zc::u64 slice_magic, int slice_shift, zc::i64 chunk_numel, \
        zc::i64 num_chunks, zc::i64 group_size, zc::i64 row_stride, zc::u8* out, zc::u32* group_absmax, \
        int pass) {                                                                                  \
        const zc::ChunkLayout<BITS> layout{out, chunk_numel, num_chunks, group_size, row_stride};    \
        const zc::MagicDivisor<false> part(part_numel, part_magic, part_shift);                      \
        const zc::MagicDivisor<false> slice(slice_numel, slice_magic, slice_shift);                  \
        const zc::InterleavedSource<T, false> source(table, tensors, part, perm, slice);             \
        zc::encode_rounds<true, BITS, false>(source, layout, true);                                  \
    }

#define ZC_REORDER_QUANTIZE(TAG, T, BITS)                                          \
    ZC_REORDER_QUANTIZE_AS(zc_reorder_quantize_##TAG##_int##BITS, T, BITS, false) \
    ZC_REORDER_QUANTIZE_AS(zc_reorder_quantize_wide_##TAG##_int##BITS, T, BITS, true)

#define ZC_REORDER_INTERLEAVED(TAG, T, BITS)                                          \
    ZC_REORDER_INTERLEAVED_AS(zc_reorder_interleaved_##TAG##_int##BITS, T, BITS, false) \
    ZC_REORDER_INTERLEAVED_AS(zc_reorder_interleaved_wide_##TAG##_int##BITS, T, BITS, true) \
    ZC_REORDER_INTERLEAVED_REGS(TAG, T, BITS)

ZC_FOR_EACH_DTYPE_BITS(ZC_REORDER_QUANTIZE)
ZC_FOR_EACH_DTYPE_BITS(ZC_REORDER_INTERLEAVED)
