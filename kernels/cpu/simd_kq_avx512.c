/* AVX-512 VNNI kernels for q2_K, q3_K, q5_K and iq4_xs weights against q8_K
 * activations (layouts: quant_kq.c; integer sums: simd_kq_scalar.c).
 *
 * One row kernel per type, for decode and, over blocks of 8 tokens, for
 * prefill (ROW_KERNEL_ALL_N, simd_x86.h): each weight row is read once,
 * front to back, and each super-block's codes are unpacked once into four
 * registers of 64 unsigned bytes that every token then multiplies with
 * vpdpbusd (unsigned codes times signed activations, 4-byte sums).
 *
 *  - q2_K and q3_K: a register holds the 64 elements 64c..64c+63 in natural
 *    order: the 32 bytes of 2-bit codes of their half broadcast to both
 *    halves and shifted by the two fields they hold; q3_K adds its high bit
 *    (vptestmb on hmask, a masked add of 4). Codes are at most 7, so the
 *    4-byte sums fit in 16 bits: two registers pack into words and meet the
 *    16 sub-block scales in one vpmaddwd and one vpdpwssd, as in q6_K_row.
 *    q2_K's mins and q3_K's offset of 4 come from the bsums.
 *  - q5_K: q4_K_row's layout (activations reordered by
 *    cpu_quant_q8_K4_avx512) with the fifth bit added from qh by a masked
 *    add of 16; codes up to 31 still pack into words.
 *  - iq4_xs: nibbles looked up (vpshufb) in the value table + 128, so the
 *    codes are unsigned for vpdpbusd; the +128 comes off as 128 * the
 *    sub-block sums of the activations (bsums). The 4-byte sums reach
 *    4 * 241 * 127, past 16 bits, so the sub-block scales multiply the
 *    32-bit sums (vpmulld). */
#include "kernels/cpu/cpu_internal.h"

#if PD_X86
#include <immintrin.h>

#include "kernels/cpu/simd_x86.h"

/* Bytes 0..31 equal to a, bytes 32..63 to b. */
PD_TARGET_AVX512 static inline __m512i halves_epi8(char a, char b) {
    return _mm512_inserti64x4(_mm512_set1_epi8(a), _mm256_set1_epi8(b), 1);
}

/* Scale indices for 16 sub-blocks of 16 held by registers of elements
 * 64c..64c+63 (c = 0..3): 128-bit lane k of packs(p0, p1) holds 4 words of
 * sub-block k and 4 of sub-block 4 + k; add 8 for packs(p2, p3). */
PD_TARGET_AVX512 static inline __m512i sub16_idx(void) {
    return _mm512_set_epi16(7, 7, 7, 7, 3, 3, 3, 3, 6, 6, 6, 6, 2, 2, 2, 2, 5, 5, 5, 5, 1, 1, 1, 1, 4, 4, 4, 4, 0, 0,
                            0, 0);
}

/* Sum over sub-blocks of scale * dot, for four registers of 4-byte sums
 * p0..p3 that fit in 16 bits, with the scale words sa (p0, p1) and sb
 * (p2, p3) laid out as packs_epi32 leaves them. */
PD_TARGET_AVX512 static inline __m512i scaled_sum16(__m512i p0, __m512i p1, __m512i p2, __m512i p3, __m512i sa,
                                                    __m512i sb) {
    return _mm512_dpwssd_epi32(_mm512_madd_epi16(_mm512_packs_epi32(p0, p1), sa), _mm512_packs_epi32(p2, p3), sb);
}

/* The 2-bit fields of the 64 elements 64c..64c+63 of a q2_K/q3_K block
 * (qs: its 64 bytes of 2-bit codes), one per byte. */
PD_TARGET_AVX512 static inline __m512i two_bit_codes(const uint8_t *qs, int c) {
    const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(const void *)(qs + 32 * (c / 2))));
    const short s = (short)(4 * (c % 2));
    return _mm512_and_si512(_mm512_srlv_epi16(v, halves_epi16(s, (short)(s + 2))), _mm512_set1_epi8(3));
}

/* The fp16 values at a and b as floats 0 and 1. */
PD_TARGET_AVX512 static inline __m128 two_halves(const uint8_t *a, const uint8_t *b) {
    return _mm_cvtph_ps(_mm_cvtsi32_si128((int)((uint32_t)pd_ld16(a) | ((uint32_t)pd_ld16(b) << 16))));
}

/* Token t's activations for block b: codes, scale, 16 sums of 16. */
#define XQ(t) (q->qs + (t0 + (t)) * q->cols + PD_QK_K * b)
#define XD(t) (q->d[(t0 + (t)) * nb + b])
#define XBS(t) ((const void *)(q->bsums + (t0 + (t)) * (q->cols / 16) + 16 * b))

/* ------------------------------------------------------------------------
 * q2_K
 * ------------------------------------------------------------------------ */

PD_TARGET_AVX512 static inline __attribute__((always_inline)) void
q2_K_row(const cpu_mm *m, int64_t r, int64_t t0, const int nt) {
    const cpu_qact *q = m->q;
    const int64_t nb = q->nblocks;
    const uint8_t *w = m->w + (size_t)r * m->rb;
    const __m512i ia = sub16_idx(), ib = _mm512_add_epi16(ia, _mm512_set1_epi16(8));
    __m512 acc[CPU_DECODE_MAX_N];
    __m256 accm[CPU_DECODE_MAX_N];
PD_UNROLL
    for (int j = 0; j < nt; j++) {
        acc[j] = _mm512_setzero_ps();
        accm[j] = _mm256_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + (size_t)CPU_Q2_K_BYTES * (size_t)b;
        decode_prefetch(blk);
        decode_prefetch(blk + 64);
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)(const void *)blk);
        const __m256i sc16 = _mm256_cvtepu8_epi16(_mm_and_si128(sc8, _mm_set1_epi8(0x0f)));
        const __m256i mn16 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc8, 4), _mm_set1_epi8(0x0f)));
        const __m512i sa = _mm512_permutexvar_epi16(ia, _mm512_castsi256_si512(sc16));
        const __m512i sb = _mm512_permutexvar_epi16(ib, _mm512_castsi256_si512(sc16));
        __m512i cd[4];
PD_UNROLL
        for (int c = 0; c < 4; c++) cd[c] = two_bit_codes(blk + 16, c);
        const __m128 dm = two_halves(blk + 80, blk + 82);
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            const int8_t *x = XQ(j);
            const __m512i z = _mm512_setzero_si512();
            const __m512i p0 = _mm512_dpbusd_epi32(z, cd[0], _mm512_loadu_si512((const void *)x));
            const __m512i p1 = _mm512_dpbusd_epi32(z, cd[1], _mm512_loadu_si512((const void *)(x + 64)));
            const __m512i p2 = _mm512_dpbusd_epi32(z, cd[2], _mm512_loadu_si512((const void *)(x + 128)));
            const __m512i p3 = _mm512_dpbusd_epi32(z, cd[3], _mm512_loadu_si512((const void *)(x + 192)));
            const __m128 dx = _mm_mul_ps(dm, _mm_set1_ps(XD(j))); /* d * xd, dmin * xd */
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(scaled_sum16(p0, p1, p2, p3, sa, sb)),
                                     _mm512_broadcastss_ps(dx), acc[j]);
            const __m256i bs = _mm256_loadu_si256((const __m256i *)XBS(j));
            accm[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(mn16, bs)),
                                      _mm256_broadcastss_ps(_mm_permute_ps(dx, 0x55)), accm[j]);
        }
    }
PD_UNROLL
    for (int j = 0; j < nt; j++)
        m->y[(t0 + j) * m->ldy + r] = _mm512_reduce_add_ps(acc[j]) - pd_hsum_ps_avx2(accm[j]);
}

/* ------------------------------------------------------------------------
 * q3_K
 * ------------------------------------------------------------------------ */

PD_TARGET_AVX512 static inline __attribute__((always_inline)) void
q3_K_row(const cpu_mm *m, int64_t r, int64_t t0, const int nt) {
    const cpu_qact *q = m->q;
    const int64_t nb = q->nblocks;
    const uint8_t *w = m->w + (size_t)r * m->rb;
    const __m512i ia = sub16_idx(), ib = _mm512_add_epi16(ia, _mm512_set1_epi16(8));
    __m512 acc[CPU_DECODE_MAX_N];
PD_UNROLL
    for (int j = 0; j < nt; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + (size_t)CPU_Q3_K_BYTES * (size_t)b;
        decode_prefetch(blk);
        decode_prefetch(blk + 64);
        const __m256i sc16 = _mm256_cvtepi8_epi16(q3k_scales(blk));
        const __m512i sa = _mm512_permutexvar_epi16(ia, _mm512_castsi256_si512(sc16));
        const __m512i sb = _mm512_permutexvar_epi16(ib, _mm512_castsi256_si512(sc16));
        /* the high bit of element e is bit e/32 of hmask[e % 32]: bits
         * 2c, 2c+1 for the two halves of register c */
        const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(const void *)blk));
        __m512i cd[4];
PD_UNROLL
        for (int c = 0; c < 4; c++) {
            const __m512i lo = two_bit_codes(blk + 32, c);
            const __mmask64 hi = _mm512_test_epi8_mask(hb, halves_epi8((char)(1 << (2 * c)), (char)(1 << (2 * c + 1))));
            cd[c] = _mm512_mask_add_epi8(lo, hi, lo, _mm512_set1_epi8(4));
        }
        const float dw = _cvtsh_ss(pd_ld16(blk + 108));
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            const int8_t *x = XQ(j);
            const __m512i z = _mm512_setzero_si512();
            const __m512i p0 = _mm512_dpbusd_epi32(z, cd[0], _mm512_loadu_si512((const void *)x));
            const __m512i p1 = _mm512_dpbusd_epi32(z, cd[1], _mm512_loadu_si512((const void *)(x + 64)));
            const __m512i p2 = _mm512_dpbusd_epi32(z, cd[2], _mm512_loadu_si512((const void *)(x + 128)));
            const __m512i p3 = _mm512_dpbusd_epi32(z, cd[3], _mm512_loadu_si512((const void *)(x + 192)));
            /* the codes are stored + 4: subtract 4 * sum(scale * bsum) */
            const __m256i bs = _mm256_loadu_si256((const __m256i *)XBS(j));
            const __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 2);
            const __m512i si = _mm512_sub_epi32(scaled_sum16(p0, p1, p2, p3, sa, sb), _mm512_zextsi256_si512(corr));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si), _mm512_set1_ps(dw * XD(j)), acc[j]);
        }
    }
PD_UNROLL
    for (int j = 0; j < nt; j++) m->y[(t0 + j) * m->ldy + r] = _mm512_reduce_add_ps(acc[j]);
}

/* ------------------------------------------------------------------------
 * q5_K (activations in cpu_quant_q8_K4_avx512's order)
 * ------------------------------------------------------------------------ */

PD_TARGET_AVX512 static inline __attribute__((always_inline)) void
q5_K_row(const cpu_mm *m, int64_t r, int64_t t0, const int nt) {
    const cpu_qact *q = m->q;
    const int64_t nb = q->nblocks;
    const uint8_t *w = m->w + (size_t)r * m->rb;
    const __m512i m4 = _mm512_set1_epi8(0x0f), b4 = _mm512_set1_epi8(0x10);
    /* as q4_K_row: lane k of packs(p0, p1) holds 4 words of each of two
     * sub-blocks of 32 */
    const __m512i ia = _mm512_set_epi16(3, 3, 3, 3, 2, 2, 2, 2, 3, 3, 3, 3, 2, 2, 2, 2,
                                        1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i ib = _mm512_add_epi16(ia, _mm512_set1_epi16(4));
    __m512 acc[CPU_DECODE_MAX_N];
    __m128 accm[CPU_DECODE_MAX_N];
PD_UNROLL
    for (int j = 0; j < nt; j++) {
        acc[j] = _mm512_setzero_ps();
        accm[j] = _mm_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + (size_t)CPU_Q5_K_BYTES * (size_t)b;
        decode_prefetch(blk);
        decode_prefetch(blk + 64);
        decode_prefetch(blk + 128);
        const __m128i sm = q4k_scales_mins(blk + 4);
        const __m512i sc16 = _mm512_castsi128_si512(_mm_cvtepu8_epi16(sm));
        const __m512i sa = _mm512_permutexvar_epi16(ia, sc16), sb = _mm512_permutexvar_epi16(ib, sc16);
        const __m128i mn16 = _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8));
        const __m512i qa = _mm512_loadu_si512((const void *)(blk + 48));
        const __m512i qb = _mm512_loadu_si512((const void *)(blk + 112));
        /* fifth bits: qh[l] bit 2c for the low nibbles of chunk c, 2c + 1
         * for its high nibbles; each register holds two chunks */
        const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(const void *)(blk + 16)));
        __m512i n[4];
        n[0] = _mm512_and_si512(qa, m4);
        n[1] = _mm512_and_si512(_mm512_srli_epi16(qa, 4), m4);
        n[2] = _mm512_and_si512(qb, m4);
        n[3] = _mm512_and_si512(_mm512_srli_epi16(qb, 4), m4);
PD_UNROLL
        for (int k = 0; k < 4; k++) {
            const int bit = 4 * (k / 2) + k % 2; /* chunk 2*(k/2), nibble k%2 */
            const __mmask64 hi = _mm512_test_epi8_mask(hb, halves_epi8((char)(1 << bit), (char)(1 << (bit + 2))));
            n[k] = _mm512_mask_add_epi8(n[k], hi, n[k], b4);
        }
        const __m128 dm = two_halves(blk, blk + 2);
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            const int8_t *x = XQ(j);
            const __m512i z = _mm512_setzero_si512();
            const __m512i p0 = _mm512_dpbusd_epi32(z, n[0], _mm512_loadu_si512((const void *)x));
            const __m512i p1 = _mm512_dpbusd_epi32(z, n[1], _mm512_loadu_si512((const void *)(x + 64)));
            const __m512i p2 = _mm512_dpbusd_epi32(z, n[2], _mm512_loadu_si512((const void *)(x + 128)));
            const __m512i p3 = _mm512_dpbusd_epi32(z, n[3], _mm512_loadu_si512((const void *)(x + 192)));
            const __m128 dx = _mm_mul_ps(dm, _mm_set1_ps(XD(j))); /* d * xd, dmin * xd */
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(scaled_sum16(p0, p1, p2, p3, sa, sb)),
                                     _mm512_broadcastss_ps(dx), acc[j]);
            /* sums of 32, pairs of blocks side by side (cpu_quant_q8_K4_avx512) */
            const __m128i bs = _mm_loadu_si128((const __m128i *)(const void *)((const int16_t *)XBS(j) - 8 * (b & 1)));
            accm[j] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(mn16, bs)), _mm_permute_ps(dx, 0x55), accm[j]);
        }
    }
PD_UNROLL
    for (int j = 0; j < nt; j++) m->y[(t0 + j) * m->ldy + r] = _mm512_reduce_add_ps(acc[j]) - pd_hsum_ps_sse(accm[j]);
}

/* ------------------------------------------------------------------------
 * iq4_xs
 * ------------------------------------------------------------------------ */

PD_TARGET_AVX512 static inline __attribute__((always_inline)) void
iq4_xs_row(const cpu_mm *m, int64_t r, int64_t t0, const int nt) {
    const cpu_qact *q = m->q;
    const int64_t nb = q->nblocks;
    const uint8_t *w = m->w + (size_t)r * m->rb;
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const __m512i table = _mm512_broadcast_i32x4(
        _mm_xor_si128(_mm_loadu_si128((const __m128i *)(const void *)cpu_iq4nl_values), _mm_set1_epi8((char)0x80)));
    /* 16 bytes of nibbles as lanes (low, high, low, high) of the next 16 */
    const __m512i spread = _mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3);
    const __m512i shift = _mm512_broadcast_i64x4(_mm256_setr_epi16(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4));
    __m512 acc[CPU_DECODE_MAX_N];
PD_UNROLL
    for (int j = 0; j < nt; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + (size_t)CPU_IQ4_XS_BYTES * (size_t)b;
        decode_prefetch(blk);
        decode_prefetch(blk + 64);
        decode_prefetch(blk + 128);
        const __m128i ls = iq4xs_scales(blk);
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(ls, ls)); /* per 16: its sub-block's */
        const __m512i sc32 = _mm512_castsi256_si512(_mm256_cvtepi8_epi32(ls));
        __m512i v[4], s[4];
PD_UNROLL
        for (int c = 0; c < 4; c++) {
            const __m256i nib = _mm256_loadu_si256((const __m256i *)(const void *)(blk + 8 + 32 * c));
            const __m512i raw = _mm512_permutexvar_epi64(spread, _mm512_castsi256_si512(nib));
            v[c] = _mm512_shuffle_epi8(table, _mm512_and_si512(_mm512_srlv_epi16(raw, shift), m4));
            const __m512i sub = _mm512_inserti64x4(_mm512_set1_epi32(2 * c), _mm256_set1_epi32(2 * c + 1), 1);
            s[c] = _mm512_permutexvar_epi32(sub, sc32); /* sub-blocks 2c, 2c + 1 */
        }
        const float dw = _cvtsh_ss(pd_ld16(blk));
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            const int8_t *x = XQ(j);
            const __m512i z = _mm512_setzero_si512();
            __m512i si = _mm512_setzero_si512();
PD_UNROLL
            for (int c = 0; c < 4; c++) {
                const __m512i p = _mm512_dpbusd_epi32(z, v[c], _mm512_loadu_si512((const void *)(x + 64 * c)));
                si = _mm512_add_epi32(si, _mm512_mullo_epi32(p, s[c]));
            }
            /* the values are stored + 128: subtract 128 * sum(scale * bsum) */
            const __m256i bs = _mm256_loadu_si256((const __m256i *)XBS(j));
            const __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 7);
            si = _mm512_sub_epi32(si, _mm512_zextsi256_si512(corr));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si), _mm512_set1_ps(dw * XD(j)), acc[j]);
        }
    }
PD_UNROLL
    for (int j = 0; j < nt; j++) m->y[(t0 + j) * m->ldy + r] = _mm512_reduce_add_ps(acc[j]);
}

#undef XQ
#undef XD
#undef XBS

/* The row kernels beat dequantize + sgemm at every n, as for q4_K/q6_K
 * (135 to 170 GFLOP/s at n = 256 on one Zen 4 core, sgemm alone 90). */
PD_TARGET_AVX512 static void mm_q2_K(const cpu_mm *m, int64_t r0, int64_t r1) {
    ROW_KERNEL_ALL_N(q2_K_row, m, r0, r1)
}

PD_TARGET_AVX512 static void mm_q3_K(const cpu_mm *m, int64_t r0, int64_t r1) {
    ROW_KERNEL_ALL_N(q3_K_row, m, r0, r1)
}

PD_TARGET_AVX512 static void mm_q5_K(const cpu_mm *m, int64_t r0, int64_t r1) {
    ROW_KERNEL_ALL_N(q5_K_row, m, r0, r1)
}

PD_TARGET_AVX512 static void mm_iq4_xs(const cpu_mm *m, int64_t r0, int64_t r1) {
    ROW_KERNEL_ALL_N(iq4_xs_row, m, r0, r1)
}

void cpu_kernels_kq_avx512(cpu_kernels *k) {
    k->mm[PD_TYPE_Q2_K] = mm_q2_K;
    k->mm[PD_TYPE_Q3_K] = mm_q3_K;
    k->mm[PD_TYPE_Q5_K] = mm_q5_K;
    k->mm[PD_TYPE_IQ4_XS] = mm_iq4_xs;
    k->quant_act[PD_TYPE_Q5_K] = cpu_quant_q8_K4_avx512;
}

#endif /* PD_X86 */
