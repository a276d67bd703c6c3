/* AVX-512 activation quantizers: q8_0 and q8_K in the element orders the
 * AVX-512 weight kernels read (simd_avx512.c, simd_kq_avx512.c,
 * simd_q32_avx512.c). Same quantized values as the natural-order
 * quantizers, only rearranged; in a file of their own so that the kernel
 * files use them without using each other. */
#include <string.h>

#include "kernels/cpu/cpu_internal.h"

#if PD_X86
#include <immintrin.h>

#include "kernels/cpu/simd_x86.h"

/* Blocks per group of the four-block layout (q4_0_row, q32_row). */
#define Q4_0_GROUP 4

/* q8_0 activations in the order q4_0_row (simd_avx512.c) reads them, with c
 * divided by 16. Same quantized values as quant_q8_0. */
PD_TARGET_AVX512 void cpu_quant_q8_0_q4_avx512(const float *x, int64_t cols, int8_t *qs, float *d, int32_t *c,
                                              int16_t *bsums) {
    cpu_quant_q8_0_avx2(x, cols, qs, d, c, bsums);
    const int64_t nb = cols / 32;
    for (int64_t g = 0; g < nb / Q4_0_GROUP; g++) {
        int8_t *xg = qs + 128 * g;
        __m128i h[8];
        for (int b = 0; b < 4; b++) {
            h[b] = _mm_loadu_si128((const __m128i *)(const void *)(xg + 32 * b));
            h[4 + b] = _mm_loadu_si128((const __m128i *)(const void *)(xg + 32 * b + 16));
        }
        for (int i = 0; i < 8; i++) _mm_storeu_si128((__m128i *)(void *)(xg + 16 * i), h[i]);
    }
    for (int64_t b = 0; b < nb; b++) c[b] /= 16; /* a multiple of 128 */
}

/* q8_K activations in the order q4_K_row reads them: per 256-block the
 * 32-sub-blocks 0 2 1 3 4 6 5 7; the sums of each 32-sub-block (natural
 * order) of a pair of blocks 2k, 2k+1 in bsums[32k .. 32k + 15] (a last
 * odd block's in its first 8): block b's eight start at 16 b - 8 (b & 1).
 * Same quantized values as quant_q8_K. q5_K_row (simd_kq_avx512.c) reads
 * the same layout. */
PD_TARGET_AVX512 void cpu_quant_q8_K4_avx512(const float *x, int64_t cols, int8_t *qs, float *d, int32_t *c,
                                             int16_t *bsums) {
    cpu_quant_q8_K_avx2(x, cols, qs, d, c, bsums);
    const int64_t nb = cols / PD_QK_K;
    for (int64_t b = 0; b < nb; b++) {
        int8_t *xb = qs + PD_QK_K * b;
        for (int h = 0; h < 2; h++) { /* swap sub-blocks 1 and 2 of each half */
            const __m256i t = _mm256_loadu_si256((const __m256i *)(const void *)(xb + 128 * h + 32));
            _mm256_storeu_si256((__m256i *)(void *)(xb + 128 * h + 32),
                                _mm256_loadu_si256((const __m256i *)(const void *)(xb + 128 * h + 64)));
            _mm256_storeu_si256((__m256i *)(void *)(xb + 128 * h + 64), t);
        }
    }
    for (int64_t b = 0; b < nb; b += 2) {
        int16_t *bs = bsums + 16 * b, s32[16];
        const int nblk = b + 1 < nb ? 2 : 1;
        for (int k = 0; k < nblk; k++)
            for (int s = 0; s < 8; s++) s32[8 * k + s] = (int16_t)(bs[16 * k + 2 * s] + bs[16 * k + 2 * s + 1]);
        memcpy(bs, s32, sizeof(int16_t) * 8 * (size_t)nblk);
    }
}

#endif /* PD_X86 */
