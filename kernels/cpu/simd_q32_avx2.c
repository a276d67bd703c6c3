/* AVX2 kernels for q4_1, q5_0, q5_1 and iq4_nl weights (layouts in
 * quant_q32.c) against q8_0 activations.
 *
 * Row kernel (decode, and prefill over blocks of 8 tokens): each weight row
 * is read once, front to back; every 32-block is unpacked once, for all the
 * tokens, to 32 bytes in element order:
 *  - q4_1, q5_0, q5_1: unsigned codes 0..15 / 0..31 (nibbles, plus the
 *    fifth bit spread from qh to bytes by a shuffle and compare), multiplied
 *    by vpmaddubsw (pairs at most 2 * 31 * 127, no saturation). q5_0's -16
 *    is the correction c / 8 added to the block's integer sum; the offset of
 *    q4_1/q5_1 adds m * sum(x) = m * (-c / 128) in float.
 *  - iq4_nl: the nibbles look up the int8 codebook with vpshufb, multiplied
 *    with the sign trick of q8_0 (|w| times x with w's sign).
 * The integer sums are exact, as in the scalar kernels. Fast dequantizers
 * (bit-identical to the reference: product, then sum) serve the
 * dequantize + sgemm path. */
#include "kernels/cpu/cpu_internal.h"

#if PD_X86
#include <immintrin.h>

#include "kernels/cpu/simd_x86.h"

/* Elements 0..15 from the low nibbles of qs[0..15], 16..31 from the high. */
PD_TARGET_AVX2 static inline __m256i nibbles32(const uint8_t *qs) {
    const __m128i b = _mm_loadu_si128((const __m128i *)(const void *)qs);
    const __m128i mask = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask), _mm_and_si128(b, mask));
}

/* 0x10 in byte j where bit j of the little-endian uint32 at qh is set. */
PD_TARGET_AVX2 static inline __m256i fifth_bits(const uint8_t *qh) {
    uint32_t h;
    memcpy(&h, qh, sizeof h);
    /* byte j gets byte j / 8 of h (vpshufb indexes within each 128-bit
     * half; the broadcast puts h in both), then tests bit j % 8 */
    const __m256i idx = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                         2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)h), idx);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

/* The 32 codes of a block as bytes: unsigned 0..31 for q4_1/q5_0/q5_1
 * (q5_0 stored + 16), the signed codebook values for iq4_nl. */
PD_TARGET_AVX2 static inline __attribute__((always_inline)) __m256i q32_codes(const uint8_t *blk, const pd_type t) {
    switch (t) {
    case PD_TYPE_Q4_1: return nibbles32(blk + cpu_q32_qs_offset(t));
    case PD_TYPE_Q5_0:
    case PD_TYPE_Q5_1: return _mm256_or_si256(nibbles32(blk + cpu_q32_qs_offset(t)), fifth_bits(blk + cpu_q32_qh_offset(t)));
    default: {
        const __m256i book = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)cpu_iq4nl_values));
        return _mm256_shuffle_epi8(book, nibbles32(blk + cpu_q32_qs_offset(t)));
    }
    }
}

PD_TARGET_AVX2 static inline __attribute__((always_inline)) void
q32_row(const cpu_mm *m, int64_t r, int64_t t0, const int nt, const pd_type t) {
    const cpu_qact *q = m->q;
    const int64_t nb = q->nblocks;
    const size_t bytes = cpu_q32_block_bytes(t);
    const bool offset = t == PD_TYPE_Q4_1 || t == PD_TYPE_Q5_1;
    const uint8_t *w = m->w + (size_t)r * m->rb;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[CPU_DECODE_MAX_N];
    float accm[CPU_DECODE_MAX_N];
PD_UNROLL
    for (int j = 0; j < nt; j++) {
        acc[j] = _mm256_setzero_ps();
        accm[j] = 0.0f;
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + bytes * (size_t)b;
        decode_prefetch(blk);
        const __m256i wv = q32_codes(blk, t);
        const __m256i wabs = t == PD_TYPE_IQ4_NL ? _mm256_sign_epi8(wv, wv) : wv;
        const float dw = _cvtsh_ss(pd_ld16(blk));
        const float mw = offset ? _cvtsh_ss(pd_ld16(blk + 2)) : 0.0f;
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            const int64_t tj = t0 + j;
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(const void *)(q->qs + tj * q->cols + 32 * b));
            const __m256i xs = t == PD_TYPE_IQ4_NL ? _mm256_sign_epi8(xv, wv) : xv;
            __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wabs, xs), ones);
            const int32_t c = q->c[tj * nb + b];
            if (t == PD_TYPE_Q5_0) p = _mm256_add_epi32(p, _mm256_setr_epi32(c / 8, 0, 0, 0, 0, 0, 0, 0));
            const float xd = q->d[tj * nb + b];
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(dw * xd), acc[j]);
            if (offset) accm[j] += mw * xd * (float)(-c / 128);
        }
    }
PD_UNROLL
    for (int j = 0; j < nt; j++) m->y[(t0 + j) * m->ldy + r] = pd_hsum_ps_avx2(acc[j]) + accm[j];
}

#define q4_1_row(m, r, t0, nt) q32_row(m, r, t0, nt, PD_TYPE_Q4_1)
#define q5_0_row(m, r, t0, nt) q32_row(m, r, t0, nt, PD_TYPE_Q5_0)
#define q5_1_row(m, r, t0, nt) q32_row(m, r, t0, nt, PD_TYPE_Q5_1)
#define iq4_nl_row(m, r, t0, nt) q32_row(m, r, t0, nt, PD_TYPE_IQ4_NL)

PD_TARGET_AVX2 static void mm_q4_1(const cpu_mm *m, int64_t r0, int64_t r1) { ROW_KERNEL_ALL_N(q4_1_row, m, r0, r1) }
PD_TARGET_AVX2 static void mm_q5_0(const cpu_mm *m, int64_t r0, int64_t r1) { ROW_KERNEL_ALL_N(q5_0_row, m, r0, r1) }
PD_TARGET_AVX2 static void mm_q5_1(const cpu_mm *m, int64_t r0, int64_t r1) { ROW_KERNEL_ALL_N(q5_1_row, m, r0, r1) }
PD_TARGET_AVX2 static void mm_iq4_nl(const cpu_mm *m, int64_t r0, int64_t r1) { ROW_KERNEL_ALL_N(iq4_nl_row, m, r0, r1) }

/* ------------------------------------------------------------------------
 * dequantize for the sgemm path: q * d (+ m), the reference's operations
 * ------------------------------------------------------------------------ */

PD_TARGET_AVX2 static inline __attribute__((always_inline)) void
q32_dequant(const uint8_t *w, int64_t cols, float *out, const pd_type t) {
    const size_t bytes = cpu_q32_block_bytes(t);
    const bool offset = t == PD_TYPE_Q4_1 || t == PD_TYPE_Q5_1;
    for (int64_t b = 0; b < cols / 32; b++, w += bytes, out += 32) {
        __m256i v = q32_codes(w, t); /* int8 lanes: all codes fit */
        if (t == PD_TYPE_Q5_0) v = _mm256_sub_epi8(v, _mm256_set1_epi8(16));
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(pd_ld16(w)));
        const __m256 mv = _mm256_set1_ps(offset ? _cvtsh_ss(pd_ld16(w + 2)) : 0.0f);
        const __m128i half[2] = {_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)};
        for (int h = 0; h < 2; h++) {
            for (int k = 0; k < 2; k++) {
                const __m128i q8 = k ? _mm_srli_si128(half[h], 8) : half[h];
                const __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), d);
                _mm256_storeu_ps(out + 16 * h + 8 * k, offset ? _mm256_add_ps(p, mv) : p);
            }
        }
    }
}

PD_TARGET_AVX2 static void dequant_q4_1(const uint8_t *w, int64_t cols, float *out) { q32_dequant(w, cols, out, PD_TYPE_Q4_1); }
PD_TARGET_AVX2 static void dequant_q5_0(const uint8_t *w, int64_t cols, float *out) { q32_dequant(w, cols, out, PD_TYPE_Q5_0); }
PD_TARGET_AVX2 static void dequant_q5_1(const uint8_t *w, int64_t cols, float *out) { q32_dequant(w, cols, out, PD_TYPE_Q5_1); }
PD_TARGET_AVX2 static void dequant_iq4_nl(const uint8_t *w, int64_t cols, float *out) { q32_dequant(w, cols, out, PD_TYPE_IQ4_NL); }

void cpu_q32_kernels_avx2(cpu_kernels *k) {
    k->mm[PD_TYPE_Q4_1] = mm_q4_1;
    k->mm[PD_TYPE_Q5_0] = mm_q5_0;
    k->mm[PD_TYPE_Q5_1] = mm_q5_1;
    k->mm[PD_TYPE_IQ4_NL] = mm_iq4_nl;
    k->dequant[PD_TYPE_Q4_1] = dequant_q4_1;
    k->dequant[PD_TYPE_Q5_0] = dequant_q5_0;
    k->dequant[PD_TYPE_Q5_1] = dequant_q5_1;
    k->dequant[PD_TYPE_IQ4_NL] = dequant_iq4_nl;
}

#endif /* PD_X86 */
