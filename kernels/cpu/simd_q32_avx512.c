/* AVX-512 VNNI kernels for q4_1, q5_0, q5_1 and iq4_nl weights (layouts in
 * quant_q32.c) against q8_0 activations.
 *
 * One row kernel for decode and, over blocks of 8 tokens, prefill (as
 * q4_0's): each weight row is read once, front to back, two 32-blocks per
 * 512-bit register, each unpacked once for all tokens to 32 unsigned bytes
 * in element order for vpdpbusd (unsigned weights times signed
 * activations), with the block's correction as the accumulator's start:
 *  - q4_1, q5_1: codes 0..15 / 0..31 (the fifth bits of q5 set straight
 *    from qh used as a byte mask); no correction; the offset adds
 *    m * sum(x) = -m * c / 128 in float, per block.
 *  - q5_0: codes stored + 16, correction c / 8 (-16 * sum(x)).
 *  - iq4_nl: vpshufb looks the nibbles up in the codebook + 128, so the
 *    correction is c (-128 * sum(x)), as for q8_0.
 * The integer sums are exact, as in the scalar kernels. */
#include "kernels/cpu/cpu_internal.h"

#if PD_X86
#include <immintrin.h>

#include "kernels/cpu/simd_x86.h"

static inline size_t q32_block_bytes(pd_type t) {
    switch (t) {
    case PD_TYPE_Q4_1: return 20;
    case PD_TYPE_Q5_0: return 22;
    case PD_TYPE_Q5_1: return 24;
    default: return 18; /* iq4_nl */
    }
}

static inline uint32_t ld32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* The 32 codes of one block as unsigned bytes (see the header). */
PD_TARGET_AVX512 static inline __attribute__((always_inline)) __m256i q32_codes(const uint8_t *blk, const pd_type t) {
    const size_t qs = t == PD_TYPE_Q4_1 ? 4 : t == PD_TYPE_Q5_0 ? 6 : t == PD_TYPE_Q5_1 ? 8 : 2;
    const __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(blk + qs));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m256i nib = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask), _mm_and_si128(b, mask));
    switch (t) {
    case PD_TYPE_Q4_1: return nib;
    case PD_TYPE_Q5_0: return _mm256_mask_add_epi8(nib, (__mmask32)ld32(blk + 2), nib, _mm256_set1_epi8(0x10));
    case PD_TYPE_Q5_1: return _mm256_mask_add_epi8(nib, (__mmask32)ld32(blk + 4), nib, _mm256_set1_epi8(0x10));
    default: {
        const __m128i book = _mm_xor_si128(_mm_loadu_si128((const __m128i *)(const void *)cpu_iq4nl_values),
                                           _mm_set1_epi8((char)0x80)); /* + 128 */
        return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(book), nib);
    }
    }
}

/* fp16 at p and at p + stride, as floats in lanes 0 and 1 */
PD_TARGET_AVX512 static inline __m128 half_pair(const uint8_t *p, size_t stride) {
    return _mm_cvtph_ps(_mm_cvtsi32_si128((int)((uint32_t)pd_ld16(p) | ((uint32_t)pd_ld16(p + stride) << 16))));
}

PD_TARGET_AVX512 static inline __attribute__((always_inline)) void
q32_row(const cpu_mm *m, int64_t r, int64_t t0, const int nt, const pd_type t) {
    const cpu_qact *q = m->q;
    const int64_t nb = q->nblocks;
    const size_t bytes = q32_block_bytes(t);
    const bool offset = t == PD_TYPE_Q4_1 || t == PD_TYPE_Q5_1;
    const int shift = t == PD_TYPE_Q5_0 ? 3 : 0; /* correction c >> shift; c is a multiple of 128 */
    const uint8_t *w = m->w + (size_t)r * m->rb;
    const __m512i idx01 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m512 acc[CPU_DECODE_MAX_N];
    __m128 accm[CPU_DECODE_MAX_N];
PD_UNROLL
    for (int j = 0; j < nt; j++) {
        acc[j] = _mm512_setzero_ps();
        accm[j] = _mm_setzero_ps();
    }
    int64_t p = 0;
    for (; p + 2 <= nb; p += 2) {
        const uint8_t *blk = w + bytes * (size_t)p;
        decode_prefetch(blk);
        const __m512i wv = _mm512_inserti64x4(_mm512_castsi256_si512(q32_codes(blk, t)), q32_codes(blk + bytes, t), 1);
        const __m128 dw2 = half_pair(blk, bytes);
        const __m128 mw2 = offset ? half_pair(blk + 2, bytes) : _mm_setzero_ps();
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            const int64_t tj = t0 + j;
            const __m512i xv = _mm512_loadu_si512((const void *)(q->qs + tj * q->cols + 32 * p));
            const __m128i c2 = _mm_loadl_epi64((const __m128i *)(const void *)(q->c + tj * nb + p));
            const __m128 xd2 = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(const void *)(q->d + tj * nb + p)));
            const __m512i cv = offset ? _mm512_setzero_si512()
                                      : _mm512_maskz_permutexvar_epi32((__mmask16)0x0101, idx01,
                                                                       _mm512_castsi128_si512(_mm_srai_epi32(c2, shift)));
            const __m512 dv = _mm512_permutexvar_ps(idx01, _mm512_castps128_ps512(_mm_mul_ps(dw2, xd2)));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(cv, wv, xv)), dv, acc[j]);
            if (offset) /* accm - m * xd * (c / 128) = accm + m * xd * sum(x) */
                accm[j] = _mm_fnmadd_ps(_mm_mul_ps(mw2, xd2), _mm_cvtepi32_ps(_mm_srai_epi32(c2, 7)), accm[j]);
        }
    }
    if (p < nb) { /* odd block count: the last block alone */
        const uint8_t *blk = w + bytes * (size_t)p;
        const __m256i wv = q32_codes(blk, t);
        const float dw = _cvtsh_ss(pd_ld16(blk));
        const float mw = offset ? _cvtsh_ss(pd_ld16(blk + 2)) : 0.0f;
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            const int64_t tj = t0 + j;
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(const void *)(q->qs + tj * q->cols + 32 * p));
            const int32_t c = q->c[tj * nb + p];
            const float xd = q->d[tj * nb + p];
            const __m256i cv = _mm256_maskz_mov_epi32((__mmask8)(offset ? 0 : 1), _mm256_set1_epi32(c / (1 << shift)));
            const __m256 sv = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_dpbusd_epi32(cv, wv, xv)), _mm256_set1_ps(dw * xd));
            acc[j] = _mm512_add_ps(acc[j], _mm512_zextps256_ps512(sv));
            if (offset) accm[j] = _mm_add_ss(accm[j], _mm_set_ss(mw * xd * (float)(-c / 128)));
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
    for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) k->mm_any_n[ts[i]] = true;
}

#endif /* PD_X86 */
