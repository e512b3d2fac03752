// Expands a kernel-defining macro M(TAG, T, BITS) for every input/output dtype and bit
// width (or M(IN_BITS, OUT_BITS) for every pair of widths), so each .cu file states its
// kernel once and the loader finds it by name (zcomm/quant/backends/_cuda_launch.py builds
// the same "<op>_<TAG>_int<BITS>" and "<op>_int<IN_BITS>_int<OUT_BITS>" names).
#pragma once

#include "wire_math.cuh"

#define ZC_FOR_EACH_DTYPE_BITS(M) \
    M(f32, float, 8)              \
    M(f32, float, 4)              \
    M(bf16, zc::bf16_t, 8)        \
    M(bf16, zc::bf16_t, 4)        \
    M(f16, zc::fp16_t, 8)         \
    M(f16, zc::fp16_t, 4)

// (input bits, output bits) of a re-quantizing kernel
#define ZC_FOR_EACH_BITS_PAIR(M) \
    M(8, 8)                      \
    M(8, 4)                      \
    M(4, 8)                      \
    M(4, 4)
