/* AVX-512 VNNI kernels for q4_1, q5_0, q5_1 and iq4_nl weights (layouts in
 * quant_q32.c) against q8_0 activations in q4_0's order
 * (cpu_quant_q8_0_q4_avx512: per group of four blocks the first 16
 * elements of each, then the last 16; c divided by 16).
 *
 * One row kernel for decode and, over blocks of 8 tokens, prefill (as
 * q4_0's): each weight row is read once, front to back, four 32-blocks at a
 * time: their 64 code bytes fill one register, the low nibbles meeting the
 * first 64 activations and the high nibbles the next 64 in two chained
 * vpdpbusd (unsigned weights times signed activations), every 32-bit lane
 * within one block, with the block's correction as the accumulator's start:
 *  - q4_1, q5_1: codes 0..15 / 0..31 (the fifth bits of q5 set straight
 *    from qh used as a byte mask: bits 0..15 for the low nibbles, 16..31
 *    for the high); no correction; the offset adds m * sum(x) = -m * c / 128
 *    in float, per block.
 *  - q5_0: codes stored + 16, correction -16 * sum(x) = c / 8.
 *  - iq4_nl: vpshufb looks the nibbles up in the codebook + 128, so the
 *    correction is c (-128 * sum(x)), as for q8_0.
 * A tail of fewer than four blocks goes one block at a time. The integer
 * sums are exact, as in the scalar kernels. */
#include "kernels/cpu/cpu_internal.h"

#if PD_X86
#include <immintrin.h>

#include "kernels/cpu/simd_x86.h"

/* The correction c/16 becomes: log2 of its multiplier (see the header). */
static inline int q32_corr_shift(pd_type t) { return t == PD_TYPE_Q5_0 ? 1 : 4; }

/* The 32 codes of one block as unsigned bytes in element order (a tail
 * block, its activations in natural order). */
PD_TARGET_AVX512 static inline __attribute__((always_inline)) __m256i q32_codes(const uint8_t *blk, const pd_type t) {
    const __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(blk + cpu_q32_qs_offset(t)));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask), _mm_and_si128(b, mask));
    switch (t) {
    case PD_TYPE_Q4_1: return nib;
    case PD_TYPE_Q5_0:
    case PD_TYPE_Q5_1:
        return _mm256_mask_add_epi8(nib, (__mmask32)cpu_load_u32le(blk + cpu_q32_qh_offset(t)), nib, _mm256_set1_epi8(0x10));
    default: {
        const __m128i book = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(const void *)cpu_iq4nl_values),
                                           _mm_set1_epi8((char)0x80)); /* + 128 */
        return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(book), nib);
    }
    }
}

/* Four fp16 values at p, p + stride, ... as floats. */
PD_TARGET_AVX512 static inline __m128 half_quad(const uint8_t *p, size_t stride) {
    const uint64_t h = (uint64_t)pd_ld16(p) | ((uint64_t)pd_ld16(p + stride) << 16) |
                       ((uint64_t)pd_ld16(p + 2 * stride) << 32) | ((uint64_t)pd_ld16(p + 3 * stride) << 48);
    return _mm_cvtph_ps(_mm_cvtsi64_si128((long long)h));
}

#define Q32_GROUP 4

PD_TARGET_AVX512 static inline __attribute__((always_inline)) void
q32_row(const cpu_mm *m, int64_t r, int64_t t0, const int nt, const pd_type t) {
    const cpu_qact *q = m->q;
    const int64_t nb = q->nblocks, ng = nb / Q32_GROUP;
    const size_t bytes = cpu_q32_block_bytes(t), qs = cpu_q32_qs_offset(t);
    const bool offset = t == PD_TYPE_Q4_1 || t == PD_TYPE_Q5_1;
    const bool fifth = t == PD_TYPE_Q5_0 || t == PD_TYPE_Q5_1;
    const int shift = q32_corr_shift(t);
    const uint8_t *w = m->w + (size_t)r * m->rb;
    const __m512i m4 = _mm512_set1_epi8(0x0f), x10 = _mm512_set1_epi8(0x10);
    const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i book = _mm512_broadcast_i32x4(
        _mm_xor_si128(_mm_loadu_si128((const __m128i *)(const void *)cpu_iq4nl_values), _mm_set1_epi8((char)0x80)));
    __m512 acc[CPU_DECODE_MAX_N];
    __m128 accm[CPU_DECODE_MAX_N];
PD_UNROLL
    for (int j = 0; j < nt; j++) {
        acc[j] = _mm512_setzero_ps();
        accm[j] = _mm_setzero_ps();
    }
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *blk = w + (size_t)Q32_GROUP * bytes * (size_t)g;
        decode_prefetch(blk);
        decode_prefetch(blk + 64);
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(const void *)(blk + qs)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(const void *)(blk + bytes + qs)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(const void *)(blk + 2 * bytes + qs)), 2);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(const void *)(blk + 3 * bytes + qs)), 3);
        __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        if (fifth) {
            uint64_t mlo = 0, mhi = 0;
            for (int b = 0; b < Q32_GROUP; b++) {
                const uint32_t h = cpu_load_u32le(blk + (size_t)b * bytes + cpu_q32_qh_offset(t));
                mlo |= (uint64_t)(h & 0xffff) << (16 * b);
                mhi |= (uint64_t)(h >> 16) << (16 * b);
            }
            lo = _mm512_mask_add_epi8(lo, (__mmask64)mlo, lo, x10);
            hi = _mm512_mask_add_epi8(hi, (__mmask64)mhi, hi, x10);
        } else if (t == PD_TYPE_IQ4_NL) {
            lo = _mm512_shuffle_epi8(book, lo);
            hi = _mm512_shuffle_epi8(book, hi);
        }
        const __m128 dw4 = half_quad(blk, bytes);
        const __m128 mw4 = offset ? half_quad(blk + 2, bytes) : _mm_setzero_ps();
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            const int8_t *x = q->qs + (t0 + j) * q->cols + 128 * g;
            const __m128i c4 = _mm_loadu_si128((const __m128i *)(const void *)(q->c + (t0 + j) * nb + 4 * g));
            const __m512i cv = offset ? _mm512_setzero_si512()
                                      : _mm512_maskz_permutexvar_epi32((__mmask16)0x1111, idx,
                                                                       _mm512_castsi128_si512(_mm_slli_epi32(c4, shift)));
            const __m512i s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(cv, lo, _mm512_loadu_si512((const void *)x)), hi,
                                                  _mm512_loadu_si512((const void *)(x + 64)));
            const __m128 xd4 = _mm_loadu_ps(q->d + (t0 + j) * nb + 4 * g);
            const __m128 d4 = _mm_mul_ps(dw4, xd4);
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(d4)), acc[j]);
            if (offset) /* accm - m * xd * (c / 128) = accm + m * xd * sum(x); c/16 is a multiple of 8 */
                accm[j] = _mm_fnmadd_ps(_mm_mul_ps(mw4, xd4), _mm_cvtepi32_ps(_mm_srai_epi32(c4, 3)), accm[j]);
        }
    }
    for (int64_t p = ng * Q32_GROUP; p < nb; p++) { /* the tail, one block at a time */
        const uint8_t *blk = w + bytes * (size_t)p;
        const __m256i wv = q32_codes(blk, t);
        const float dw = _cvtsh_ss(pd_ld16(blk));
        const float mw = offset ? _cvtsh_ss(pd_ld16(blk + 2)) : 0.0f;
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            const int64_t tj = t0 + j;
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(const void *)(q->qs + tj * q->cols + 32 * p));
            const int32_t c16 = q->c[tj * nb + p];
            const float xd = q->d[tj * nb + p];
            const __m256i cv = _mm256_maskz_mov_epi32((__mmask8)(offset ? 0 : 1), _mm256_set1_epi32(c16 * (1 << shift)));
            const __m256 sv = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_dpbusd_epi32(cv, wv, xv)), _mm256_set1_ps(dw * xd));
            acc[j] = _mm512_add_ps(acc[j], _mm512_zextps256_ps512(sv));
            if (offset) accm[j] = _mm_add_ss(accm[j], _mm_set_ss(mw * xd * (float)(-c16 / 8)));
        }
    }
PD_UNROLL
    for (int j = 0; j < nt; j++)
        m->y[(t0 + j) * m->ldy + r] = _mm512_reduce_add_ps(acc[j]) + (offset ? pd_hsum_ps_sse(accm[j]) : 0.0f);
}

#define q4_1_row(m, r, t0, nt) q32_row(m, r, t0, nt, PD_TYPE_Q4_1)
#define q5_0_row(m, r, t0, nt) q32_row(m, r, t0, nt, PD_TYPE_Q5_0)
#define q5_1_row(m, r, t0, nt) q32_row(m, r, t0, nt, PD_TYPE_Q5_1)
#define iq4_nl_row(m, r, t0, nt) q32_row(m, r, t0, nt, PD_TYPE_IQ4_NL)

PD_TARGET_AVX512 static void mm_q4_1(const cpu_mm *m, int64_t r0, int64_t r1) { ROW_KERNEL_ALL_N(q4_1_row, m, r0, r1) }
PD_TARGET_AVX512 static void mm_q5_0(const cpu_mm *m, int64_t r0, int64_t r1) { ROW_KERNEL_ALL_N(q5_0_row, m, r0, r1) }
PD_TARGET_AVX512 static void mm_q5_1(const cpu_mm *m, int64_t r0, int64_t r1) { ROW_KERNEL_ALL_N(q5_1_row, m, r0, r1) }
PD_TARGET_AVX512 static void mm_iq4_nl(const cpu_mm *m, int64_t r0, int64_t r1) { ROW_KERNEL_ALL_N(iq4_nl_row, m, r0, r1) }

/* On top of the AVX2 entries (their dequantizers stay). */
void cpu_q32_kernels_avx512(cpu_kernels *k) {
    const pd_type ts[] = {PD_TYPE_Q4_1, PD_TYPE_Q5_0, PD_TYPE_Q5_1, PD_TYPE_IQ4_NL};
    k->mm[PD_TYPE_Q4_1] = mm_q4_1;
    k->mm[PD_TYPE_Q5_0] = mm_q5_0;
    k->mm[PD_TYPE_Q5_1] = mm_q5_1;
    k->mm[PD_TYPE_IQ4_NL] = mm_iq4_nl;
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) k->quant_act[ts[i]] = cpu_quant_q8_0_q4_avx512;
}

#endif /* PD_X86 */
