/* AVX2 kernels for q2_K, q3_K, q5_K and iq4_xs weights against q8_K
 * activations (layouts: quant_kq.c; integer sums: simd_kq_scalar.c).
 *
 * One row kernel per type for up to 8 tokens, for decode and, over blocks
 * of 8 tokens, for prefill (ROW_KERNEL_ALL_N, simd_x86.h: at n = 256 it ran
 * 1.5 to 2.4 times as fast as dequantize + sgemm): the row is read once,
 * front to back, and each super-block's codes are unpacked once into
 * 32-byte registers of 32 consecutive elements, which every token then
 * multiplies with vpmaddubsw (unsigned codes times signed activations,
 * pairs summed into 16 bits) and vpmaddwd against the sub-block scales.
 *
 *  - q2_K, q3_K: register g holds the 2-bit field g%4 of the 32 bytes of
 *    half g/4, i.e. elements 32g..32g+31 (two sub-blocks of 16, one per
 *    128-bit lane); q3_K ORs in bit g of hmask as 4 (codes stored + 4, the
 *    offset comes off through the bsums, as do q2_K's mins).
 *  - q5_K: q4_K's nibbles of each 64 elements plus the fifth bit from qh;
 *    codes up to 31, so pair sums stay under 2 * 31 * 127.
 *  - iq4_xs: nibbles looked up (vpshufb) in the table of signed values;
 *    vpmaddubsw needs one operand unsigned, so it multiplies |value| by the
 *    activations with the value's sign (vpsignb), pair sums at most
 *    2 * 127 * 127, no saturation. */
#include "kernels/cpu/cpu_internal.h"

#if PD_X86
#include <immintrin.h>

#include "kernels/cpu/simd_x86.h"

/* Words of lane 0 all equal to word w of v's lanes, of lane 1 to word
 * w + 1 (w even, v with the same 8 words in both lanes). */
PD_TARGET_AVX2 static inline __m256i pair_of_words(__m256i v, int w) {
    const short lo = (short)((2 * w) | ((2 * w + 1) << 8)), hi = (short)((2 * w + 2) | ((2 * w + 3) << 8));
    return _mm256_shuffle_epi8(v, _mm256_setr_m128i(_mm_set1_epi16(lo), _mm_set1_epi16(hi)));
}

/* The scale words for registers of 32 elements covering sub-blocks of 16
 * 2g and 2g + 1 (g = 0..7), from their 16 scales as words. */
PD_TARGET_AVX2 static inline void sub16_scales(__m256i sc16, __m256i out[8]) {
    const __m256i lo = _mm256_permute2x128_si256(sc16, sc16, 0x00); /* words 0..7 twice */
    const __m256i hi = _mm256_permute2x128_si256(sc16, sc16, 0x11); /* words 8..15 twice */
PD_UNROLL
    for (int g = 0; g < 8; g++) out[g] = pair_of_words(g < 4 ? lo : hi, (2 * g) % 8);
}

/* Sum over 8 registers of 32 codes (unsigned, pair products within 16
 * bits) times 32 activations each, weighted by their scale words. */
PD_TARGET_AVX2 static inline __m256i scaled_dot8(const __m256i cd[8], const __m256i sc[8], const int8_t *x,
                                                 __m256i acc) {
PD_UNROLL
    for (int g = 0; g < 8; g++) {
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(const void *)(x + 32 * g));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(cd[g], xv), sc[g]));
    }
    return acc;
}

#define XQ(t) (q->qs + (t0 + (t)) * q->cols + PD_QK_K * b)
#define XD(t) (q->d[(t0 + (t)) * nb + b])
#define XBS(t) ((const __m256i *)(const void *)(q->bsums + (t0 + (t)) * (q->cols / 16) + 16 * b))

/* ------------------------------------------------------------------------
 * q2_K
 * ------------------------------------------------------------------------ */

PD_TARGET_AVX2 static inline __attribute__((always_inline)) void
q2_K_row(const cpu_mm *m, int64_t r, int64_t t0, const int nt) {
    const cpu_qact *q = m->q;
    const int64_t nb = q->nblocks;
    const uint8_t *w = m->w + (size_t)r * m->rb;
    const __m128i m4 = _mm_set1_epi8(0x0f);
    __m256 acc[CPU_DECODE_MAX_N];
PD_UNROLL
    for (int j = 0; j < nt; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + (size_t)CPU_Q2_K_BYTES * (size_t)b;
        decode_prefetch(blk);
        decode_prefetch(blk + 64);
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)(const void *)blk);
        __m256i sc[8], cd[8];
        sub16_scales(_mm256_cvtepu8_epi16(_mm_and_si128(sc8, m4)), sc);
        const __m256i mn16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc8, 4), m4));
PD_UNROLL
        for (int g = 0; g < 8; g++) {
            const __m256i qv = _mm256_loadu_si256((const __m256i *)(const void *)(blk + 16 + 32 * (g / 4)));
            cd[g] = _mm256_and_si256(_mm256_srli_epi16(qv, 2 * (g % 4)), _mm256_set1_epi8(3));
        }
        const float d = _cvtsh_ss(pd_ld16(blk + 80)), dmin = _cvtsh_ss(pd_ld16(blk + 82));
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            const __m256i si = scaled_dot8(cd, sc, XQ(j), _mm256_setzero_si256());
            const __m256i sm = _mm256_madd_epi16(mn16, _mm256_loadu_si256(XBS(j)));
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), _mm256_set1_ps(d * XD(j)), acc[j]);
            acc[j] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(sm), _mm256_set1_ps(dmin * XD(j)), acc[j]);
        }
    }
PD_UNROLL
    for (int j = 0; j < nt; j++) m->y[(t0 + j) * m->ldy + r] = pd_hsum_ps_avx2(acc[j]);
}

/* ------------------------------------------------------------------------
 * q3_K
 * ------------------------------------------------------------------------ */

PD_TARGET_AVX2 static inline __attribute__((always_inline)) void
q3_K_row(const cpu_mm *m, int64_t r, int64_t t0, const int nt) {
    const cpu_qact *q = m->q;
    const int64_t nb = q->nblocks;
    const uint8_t *w = m->w + (size_t)r * m->rb;
    __m256 acc[CPU_DECODE_MAX_N];
PD_UNROLL
    for (int j = 0; j < nt; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + (size_t)CPU_Q3_K_BYTES * (size_t)b;
        decode_prefetch(blk);
        decode_prefetch(blk + 64);
        const __m256i sc16 = _mm256_cvtepi8_epi16(q3k_scales(blk));
        __m256i sc[8], cd[8];
        sub16_scales(sc16, sc);
        const __m256i hm = _mm256_loadu_si256((const __m256i *)(const void *)blk);
PD_UNROLL
        for (int g = 0; g < 8; g++) {
            const __m256i qv = _mm256_loadu_si256((const __m256i *)(const void *)(blk + 32 + 32 * (g / 4)));
            const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(qv, 2 * (g % 4)), _mm256_set1_epi8(3));
            const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hm, g), _mm256_set1_epi8(1));
            cd[g] = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 2));
        }
        const float d = _cvtsh_ss(pd_ld16(blk + 108));
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            /* the codes are stored + 4: start from -4 * sum(scale * bsum) */
            const __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(sc16, _mm256_loadu_si256(XBS(j))), 2);
            const __m256i si = scaled_dot8(cd, sc, XQ(j), _mm256_sub_epi32(_mm256_setzero_si256(), corr));
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), _mm256_set1_ps(d * XD(j)), acc[j]);
        }
    }
PD_UNROLL
    for (int j = 0; j < nt; j++) m->y[(t0 + j) * m->ldy + r] = pd_hsum_ps_avx2(acc[j]);
}

/* ------------------------------------------------------------------------
 * q5_K
 * ------------------------------------------------------------------------ */

PD_TARGET_AVX2 static inline __attribute__((always_inline)) void
q5_K_row(const cpu_mm *m, int64_t r, int64_t t0, const int nt) {
    const cpu_qact *q = m->q;
    const int64_t nb = q->nblocks;
    const uint8_t *w = m->w + (size_t)r * m->rb;
    const __m256i m4 = _mm256_set1_epi8(0x0f), one = _mm256_set1_epi8(1);
    __m256 acc[CPU_DECODE_MAX_N];
PD_UNROLL
    for (int j = 0; j < nt; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + (size_t)CPU_Q5_K_BYTES * (size_t)b;
        decode_prefetch(blk);
        decode_prefetch(blk + 64);
        decode_prefetch(blk + 128);
        const __m128i sm = q4k_scales_mins(blk + 4); /* sc0-7, mn0-7 */
        const __m256i scw = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));
        /* each min twice: one per bsum of 16 */
        const __m256i mn16 = _mm256_cvtepu8_epi16(
            _mm_shuffle_epi8(sm, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15)));
        __m256i sc[8], cd[8];
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(const void *)(blk + 16));
PD_UNROLL
        for (int c = 0; c < 4; c++) {
            const __m256i qv = _mm256_loadu_si256((const __m256i *)(const void *)(blk + 48 + 32 * c));
            const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c), one);
            const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(qh, 2 * c + 1), one);
            cd[2 * c] = _mm256_or_si256(_mm256_and_si256(qv, m4), _mm256_slli_epi16(h0, 4));
            cd[2 * c + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qv, 4), m4), _mm256_slli_epi16(h1, 4));
        }
PD_UNROLL
        for (int g = 0; g < 8; g++) {
            const short k = (short)((2 * g) | ((2 * g + 1) << 8));
            sc[g] = _mm256_shuffle_epi8(scw, _mm256_set1_epi16(k));
        }
        const float d = _cvtsh_ss(pd_ld16(blk)), dmin = _cvtsh_ss(pd_ld16(blk + 2));
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            const __m256i si = scaled_dot8(cd, sc, XQ(j), _mm256_setzero_si256());
            const __m256i sm8 = _mm256_madd_epi16(mn16, _mm256_loadu_si256(XBS(j)));
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), _mm256_set1_ps(d * XD(j)), acc[j]);
            acc[j] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(sm8), _mm256_set1_ps(dmin * XD(j)), acc[j]);
        }
    }
PD_UNROLL
    for (int j = 0; j < nt; j++) m->y[(t0 + j) * m->ldy + r] = pd_hsum_ps_avx2(acc[j]);
}

/* ------------------------------------------------------------------------
 * iq4_xs
 * ------------------------------------------------------------------------ */

PD_TARGET_AVX2 static inline __attribute__((always_inline)) void
iq4_xs_row(const cpu_mm *m, int64_t r, int64_t t0, const int nt) {
    const cpu_qact *q = m->q;
    const int64_t nb = q->nblocks;
    const uint8_t *w = m->w + (size_t)r * m->rb;
    const __m128i m4 = _mm_set1_epi8(0x0f);
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)cpu_iq4nl_values));
    __m256 acc[CPU_DECODE_MAX_N];
PD_UNROLL
    for (int j = 0; j < nt; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + (size_t)CPU_IQ4_XS_BYTES * (size_t)b;
        decode_prefetch(blk);
        decode_prefetch(blk + 64);
        decode_prefetch(blk + 128);
        /* scale g as words, twice: words 0..7 and 8..15 hold the same */
        const __m128i l8 = iq4xs_scales(blk);
        const __m256i ls = _mm256_cvtepi8_epi16(_mm_unpacklo_epi64(l8, l8));
        __m256i val[8], mag[8], sc[8];
PD_UNROLL
        for (int g = 0; g < 8; g++) {
            sc[g] = _mm256_shuffle_epi8(ls, _mm256_set1_epi16((short)((2 * g) | ((2 * g + 1) << 8))));
            const __m128i nib = _mm_loadu_si128((const __m128i *)(const void *)(blk + 8 + 16 * g));
            const __m256i idx = _mm256_setr_m128i(_mm_and_si128(nib, m4), _mm_and_si128(_mm_srli_epi16(nib, 4), m4));
            val[g] = _mm256_shuffle_epi8(table, idx);
            mag[g] = _mm256_sign_epi8(val[g], val[g]);
        }
        const float d = _cvtsh_ss(pd_ld16(blk));
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            const int8_t *x = XQ(j);
            __m256i si = _mm256_setzero_si256();
PD_UNROLL
            for (int g = 0; g < 8; g++) {
                const __m256i xg = _mm256_loadu_si256((const __m256i *)(const void *)(x + 32 * g));
                const __m256i xv = _mm256_sign_epi8(xg, val[g]);
                si = _mm256_add_epi32(si, _mm256_madd_epi16(_mm256_maddubs_epi16(mag[g], xv), sc[g]));
            }
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), _mm256_set1_ps(d * XD(j)), acc[j]);
        }
    }
PD_UNROLL
    for (int j = 0; j < nt; j++) m->y[(t0 + j) * m->ldy + r] = pd_hsum_ps_avx2(acc[j]);
}

#undef XQ
#undef XD
#undef XBS

PD_TARGET_AVX2 static void mm_q2_K(const cpu_mm *m, int64_t r0, int64_t r1) {
    ROW_KERNEL_ALL_N(q2_K_row, m, r0, r1)
}

PD_TARGET_AVX2 static void mm_q3_K(const cpu_mm *m, int64_t r0, int64_t r1) {
    ROW_KERNEL_ALL_N(q3_K_row, m, r0, r1)
}

PD_TARGET_AVX2 static void mm_q5_K(const cpu_mm *m, int64_t r0, int64_t r1) {
    ROW_KERNEL_ALL_N(q5_K_row, m, r0, r1)
}

PD_TARGET_AVX2 static void mm_iq4_xs(const cpu_mm *m, int64_t r0, int64_t r1) {
    ROW_KERNEL_ALL_N(iq4_xs_row, m, r0, r1)
}

void cpu_kernels_kq_avx2(cpu_kernels *k) {
    k->mm[PD_TYPE_Q2_K] = mm_q2_K;
    k->mm[PD_TYPE_Q3_K] = mm_q3_K;
    k->mm[PD_TYPE_Q5_K] = mm_q5_K;
    k->mm[PD_TYPE_IQ4_XS] = mm_iq4_xs;
}

#endif /* PD_X86 */
