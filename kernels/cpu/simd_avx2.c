/* AVX2 + FMA + F16C kernels (run-time dispatched; compiled per function
 * with target attributes, so the build needs no -march flag).
 *
 * Integer dot products use the usual sign trick for q8_0
 * (maddubs(|w|, sign(x, w))), and plain maddubs for the unsigned nibble and
 * 6-bit codes of q4_0/q4_K/q6_K. All loads are unaligned loads. */
#include "kernels/cpu/cpu_internal.h"

#if PD_X86
#include <immintrin.h>
#include <math.h>

#include "kernels/cpu/simd_x86.h"

/* ------------------------------------------------------------------------
 * activation quantizers (bit-identical to the scalar ones)
 * ------------------------------------------------------------------------ */

/* Quantize 32 floats with inverse scale id into 32 int8 (in order);
 * returns their sum. */
PD_TARGET_AVX2 static inline __m256i quant32(const float *x, float id, int32_t *sum) {
    const __m256 vid = _mm256_set1_ps(id);
    __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), vid));
    __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), vid));
    __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), vid));
    __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), vid));
    /* clamp like the scalar quantizer (matters only for NaN/inf input) */
    const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
    i0 = _mm256_min_epi32(_mm256_max_epi32(i0, lo), hi);
    i1 = _mm256_min_epi32(_mm256_max_epi32(i1, lo), hi);
    i2 = _mm256_min_epi32(_mm256_max_epi32(i2, lo), hi);
    i3 = _mm256_min_epi32(_mm256_max_epi32(i3, lo), hi);
    const __m256i s = _mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3));
    *sum = pd_hsum_epi32_avx2(s);
    const __m256i p01 = _mm256_packs_epi32(i0, i1);
    const __m256i p23 = _mm256_packs_epi32(i2, i3);
    const __m256i p = _mm256_packs_epi16(p01, p23);
    return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

PD_TARGET_AVX2 static inline float amax_n(const float *x, int n) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_setzero_ps();
    for (int j = 0; j < n; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
    return pd_hmax_ps_avx2(m);
}

PD_TARGET_AVX2 void cpu_quant_q8_0_avx2(const float *x, int64_t cols, int8_t *qs, float *d,
                                      int32_t *c, int16_t *bsums) {
    (void)bsums;
    for (int64_t b = 0; b < cols / 32; b++, x += 32, qs += 32) {
        const float amax = amax_n(x, 32);
        const float db = amax / 127.0f;
        const float id = db != 0.0f ? 1.0f / db : 0.0f;
        int32_t s;
        _mm256_storeu_si256((__m256i *)qs, quant32(x, id, &s));
        d[b] = db;
        c[b] = -128 * s;
    }
}

PD_TARGET_AVX2 void cpu_quant_q8_K_avx2(const float *x, int64_t cols, int8_t *qs, float *d, int32_t *c,
                                        int16_t *bsums) {
    (void)c;
    for (int64_t b = 0; b < cols / PD_QK_K; b++, x += PD_QK_K, qs += PD_QK_K, bsums += 16) {
        const float amax = amax_n(x, PD_QK_K);
        const float db = amax / 127.0f;
        const float id = db != 0.0f ? 1.0f / db : 0.0f;
        for (int j = 0; j < PD_QK_K; j += 32) {
            int32_t s;
            const __m256i q = quant32(x + j, id, &s);
            _mm256_storeu_si256((__m256i *)(qs + j), q);
            /* sums of each 16: widen to int16 and add pairs */
            const __m256i w16 = _mm256_maddubs_epi16(_mm256_set1_epi8(1), q);
            /* w16: 16 pair sums; lanes 0..7 are bytes 0..15 */
            const __m256i w32 = _mm256_madd_epi16(w16, _mm256_set1_epi16(1));
            /* w32: lanes 0..3 bytes 0..15, lanes 4..7 bytes 16..31 */
            const __m128i lo = _mm256_castsi256_si128(w32), hi = _mm256_extracti128_si256(w32, 1);
            bsums[j / 16] = (int16_t)pd_hsum_epi32_sse(lo);
            bsums[j / 16 + 1] = (int16_t)pd_hsum_epi32_sse(hi);
        }
        d[b] = db;
    }
}

/* ------------------------------------------------------------------------
 * q8_0 x q8_0
 * ------------------------------------------------------------------------ */

/* One weight row against NT <= 8 tokens: each block's codes and |w| are
 * loaded once for all of them (prefill runs it over L2-sized row groups,
 * ROW_KERNEL_ALL_N). A token's sum is the same sequence of operations
 * whatever NT is, so a token's result does not depend on its batch. */
PD_TARGET_AVX2 static inline __attribute__((always_inline)) void
q8_0_row(const cpu_mm *m, int64_t r, int64_t t0, const int nt) {
    const cpu_qact *q = m->q;
    const int64_t nb = q->nblocks;
    const uint8_t *w = m->w + (size_t)r * m->rb;
    const int8_t *xq = q->qs + t0 * q->cols;
    const float *xd = q->d + t0 * nb;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[CPU_DECODE_MAX_N];
PD_UNROLL
    for (int j = 0; j < nt; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + CPU_Q8_0_BYTES * b;
        decode_prefetch(blk);
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(blk + 2));
        const __m256i aw = _mm256_sign_epi8(wv, wv);
        const __m256 dw = _mm256_set1_ps(_cvtsh_ss(pd_ld16(blk)));
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + j * q->cols + 32 * b));
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv)), ones);
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw, _mm256_broadcast_ss(xd + j * nb + b)), acc[j]);
        }
    }
PD_UNROLL
    for (int j = 0; j < nt; j++) m->y[(t0 + j) * m->ldy + r] = pd_hsum_ps_avx2(acc[j]);
}

PD_TARGET_AVX2 static void mm_q8_0(const cpu_mm *m, int64_t r0, int64_t r1) {
    ROW_KERNEL_ALL_N(q8_0_row, m, r0, r1)
}

/* ------------------------------------------------------------------------
 * q4_0 x q8_0
 * ------------------------------------------------------------------------ */

PD_TARGET_AVX2 static inline __m256i unpack_q4_0(const uint8_t *qs) {
    const __m128i b = _mm_loadu_si128((const __m128i *)qs);
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(b, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    return _mm256_set_m128i(hi, lo);
}

/* Like q8_0_row: one row, NT tokens, each block unpacked once. */
PD_TARGET_AVX2 static inline __attribute__((always_inline)) void
q4_0_row(const cpu_mm *m, int64_t r, int64_t t0, const int nt) {
    const cpu_qact *q = m->q;
    const int64_t nb = q->nblocks;
    const uint8_t *w = m->w + (size_t)r * m->rb;
    const int8_t *xq = q->qs + t0 * q->cols;
    const float *xd = q->d + t0 * nb;
    const int32_t *xc = q->c + t0 * nb;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[CPU_DECODE_MAX_N];
PD_UNROLL
    for (int j = 0; j < nt; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + CPU_Q4_0_BYTES * b;
        decode_prefetch(blk);
        const __m256i qv = unpack_q4_0(blk + 2);
        const __m256 dw = _mm256_set1_ps(_cvtsh_ss(pd_ld16(blk)));
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + j * q->cols + 32 * b));
            /* dot(q - 8, x) = dot(q, x) - 8 * sum(x); c = -128 * sum(x) */
            const __m256i corr = _mm256_setr_epi32(xc[j * nb + b] / 16, 0, 0, 0, 0, 0, 0, 0);
            const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(qv, xv), ones), corr);
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw, _mm256_broadcast_ss(xd + j * nb + b)), acc[j]);
        }
    }
PD_UNROLL
    for (int j = 0; j < nt; j++) m->y[(t0 + j) * m->ldy + r] = pd_hsum_ps_avx2(acc[j]);
}

PD_TARGET_AVX2 static void mm_q4_0(const cpu_mm *m, int64_t r0, int64_t r1) {
    ROW_KERNEL_ALL_N(q4_0_row, m, r0, r1)
}

/* ------------------------------------------------------------------------
 * q4_K x q8_K
 * ------------------------------------------------------------------------ */

static inline void q4k_scales_mins_u32(const uint8_t *s, uint32_t u[4]) {
    memcpy(u, s, 12);
    const uint32_t k1 = 0x3f3f3f3fu, k2 = 0x0f0f0f0fu, k3 = 0x03030303u;
    u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    const uint32_t aux = u[1] & k1;
    u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    u[2] = aux;
    u[0] &= k1;
}

/* int16 lanes all equal to byte `k` of a 16-byte vector */
PD_TARGET_AVX2 static inline __m256i q4k_bcast_idx(int k) {
    return _mm256_set1_epi16((short)(0x8000 | k));
}

/* One row against NT <= 8 tokens: each super-block's nibbles and 6-bit
 * scales and mins are unpacked once (bytes 0..7 scales, 8..15 mins) and
 * then serve every token. */
PD_TARGET_AVX2 static inline __attribute__((always_inline)) void
q4_K_row(const cpu_mm *m, int64_t r, int64_t t0, const int nt) {
    const cpu_qact *q = m->q;
    const int64_t nb = q->nblocks;
    const uint8_t *w = m->w + (size_t)r * m->rb;
    const __m256i mask = _mm256_set1_epi8(0x0f);
    __m256 acc[CPU_DECODE_MAX_N];
    __m128 accm[CPU_DECODE_MAX_N];
PD_UNROLL
    for (int j = 0; j < nt; j++) {
        acc[j] = _mm256_setzero_ps();
        accm[j] = _mm_setzero_ps();
    }
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + (size_t)CPU_Q4_K_BYTES * (size_t)b;
        decode_prefetch(blk);
        uint32_t u[4];
        q4k_scales_mins_u32(blk + 4, u);
        const __m128i sm = _mm_loadu_si128((const __m128i *)(const void *)u);
        const __m256i scb = _mm256_broadcastsi128_si256(sm);
        const __m128i mn = _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8));
        __m256i lo[4], hi[4], sl[4], sh[4];
PD_UNROLL
        for (int k = 0; k < 4; k++) {
            const __m256i qv = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * k));
            lo[k] = _mm256_and_si256(qv, mask);
            hi[k] = _mm256_and_si256(_mm256_srli_epi16(qv, 4), mask);
            sl[k] = _mm256_shuffle_epi8(scb, q4k_bcast_idx(2 * k));
            sh[k] = _mm256_shuffle_epi8(scb, q4k_bcast_idx(2 * k + 1));
        }
        const __m256 dw = _mm256_set1_ps(_cvtsh_ss(pd_ld16(blk)));
        const __m128 dminw = _mm_set1_ps(_cvtsh_ss(pd_ld16(blk + 2)));
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            const int64_t t = t0 + j;
            const int8_t *xb = q->qs + t * q->cols + PD_QK_K * b;
            const int16_t *bs = q->bsums + t * (q->cols / 16) + 16 * b;
            const __m256i bp = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(const void *)bs),
                                                 _mm256_set1_epi16(1));
            const __m128i bsp = _mm_packs_epi32(_mm256_castsi256_si128(bp), _mm256_extracti128_si256(bp, 1));
            accm[j] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(mn, bsp)),
                                   _mm_mul_ps(dminw, _mm_broadcast_ss(q->d + t * nb + b)), accm[j]);
            __m256i sumi = _mm256_setzero_si256();
PD_UNROLL
            for (int k = 0; k < 4; k++) {
                const __m256i xl = _mm256_loadu_si256((const __m256i *)(xb + 64 * k));
                const __m256i xh = _mm256_loadu_si256((const __m256i *)(xb + 64 * k + 32));
                const __m256i pl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo[k], xl), sl[k]);
                const __m256i ph = _mm256_madd_epi16(_mm256_maddubs_epi16(hi[k], xh), sh[k]);
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
            }
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_mul_ps(dw, _mm256_broadcast_ss(q->d + t * nb + b)),
                                     acc[j]);
        }
    }
PD_UNROLL
    for (int j = 0; j < nt; j++)
        m->y[(t0 + j) * m->ldy + r] = pd_hsum_ps_avx2(acc[j]) - pd_hsum_ps_sse(accm[j]);
}

PD_TARGET_AVX2 static void mm_q4_K(const cpu_mm *m, int64_t r0, int64_t r1) {
    ROW_KERNEL_ALL_N(q4_K_row, m, r0, r1)
}

/* ------------------------------------------------------------------------
 * q6_K x q8_K
 * ------------------------------------------------------------------------ */

/* One row against NT <= 8 tokens: each super-block's 6-bit codes and
 * scales are unpacked once for all of them. The -32 offset of the codes
 * is taken out with the activations' 16-element sums (bsums). */
PD_TARGET_AVX2 static inline __attribute__((always_inline)) void
q6_K_row(const cpu_mm *m, int64_t r, int64_t t0, const int nt) {
    const cpu_qact *q = m->q;
    const int64_t nb = q->nblocks;
    const uint8_t *w = m->w + (size_t)r * m->rb;
    const __m256i m4 = _mm256_set1_epi8(0x0f);
    const __m256i m2 = _mm256_set1_epi8(0x03);
    __m256 acc[CPU_DECODE_MAX_N];
PD_UNROLL
    for (int j = 0; j < nt; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + (size_t)CPU_Q6_K_BYTES * (size_t)b;
        decode_prefetch(blk);
        const __m128i sc8 = _mm_loadu_si128((const __m128i *)(blk + 192));
        const __m256i sc16 = _mm256_cvtepi8_epi16(sc8);
        __m256i qk[8], scv[8];
PD_UNROLL
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = blk + 64 * h;
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
            qk[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(hb, m2), 4));
            qk[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m2), 4));
            qk[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m2), 4));
            qk[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                            _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m2), 4));
        }
PD_UNROLL
        for (int k = 0; k < 8; k++)
            scv[k] = _mm256_set_m128i(_mm_set1_epi16((int8_t)blk[192 + 2 * k + 1]),
                                      _mm_set1_epi16((int8_t)blk[192 + 2 * k]));
        const __m256 dw = _mm256_set1_ps(_cvtsh_ss(pd_ld16(blk + 208)));
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            const int64_t t = t0 + j;
            const int8_t *x = q->qs + t * q->cols + PD_QK_K * b;
            const int16_t *bs = q->bsums + t * (q->cols / 16) + 16 * b;
            const int32_t corr = pd_hsum_epi32_avx2(
                _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)(const void *)bs)));
            __m256i sumi = _mm256_setr_epi32(-32 * corr, 0, 0, 0, 0, 0, 0, 0);
PD_UNROLL
            for (int k = 0; k < 8; k++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(x + 32 * k));
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(qk[k], xv), scv[k]));
            }
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi), _mm256_mul_ps(dw, _mm256_broadcast_ss(q->d + t * nb + b)),
                                     acc[j]);
        }
    }
PD_UNROLL
    for (int j = 0; j < nt; j++) m->y[(t0 + j) * m->ldy + r] = pd_hsum_ps_avx2(acc[j]);
}

PD_TARGET_AVX2 static void mm_q6_K(const cpu_mm *m, int64_t r0, int64_t r1) {
    ROW_KERNEL_ALL_N(q6_K_row, m, r0, r1)
}

/* ------------------------------------------------------------------------
 * float weights
 * ------------------------------------------------------------------------ */

PD_TARGET_AVX2 static inline __m256 load8_f32(const uint8_t *p) {
    return _mm256_loadu_ps((const float *)(const void *)p);
}
PD_TARGET_AVX2 static inline __m256 load8_f16(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
PD_TARGET_AVX2 static inline __m256 load8_bf16(const uint8_t *p) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
static inline float load1_f32(const uint8_t *p) {
    return cpu_load_f32(p);
}
static inline float load1_f16(const uint8_t *p) {
    return pd_fp16_to_fp32(pd_ld16(p));
}
static inline float load1_bf16(const uint8_t *p) {
    return pd_bf16_to_fp32(pd_ld16(p));
}

#define MM_FLOAT_AVX2(NAME, ESZ, LOAD8, LOAD1)                                                   \
    PD_TARGET_AVX2 static inline __attribute__((always_inline)) void NAME##_rows(                 \
        const cpu_mm *m, int64_t r, const int nr) {                                              \
        const int64_t cols = m->cols;                                                            \
        for (int64_t t = 0; t < m->n; t++) {                                                     \
            const float *x = m->x + t * cols;                                                    \
            __m256 acc[4][2];                                                                    \
            PD_UNROLL for (int i = 0; i < nr; i++) acc[i][0] = acc[i][1] =         \
                _mm256_setzero_ps();                                                             \
            int64_t k = 0;                                                                       \
            for (; k + 16 <= cols; k += 16) {                                                    \
                const __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);      \
                PD_UNROLL for (int i = 0; i < nr; i++) {                           \
                    const uint8_t *wr = m->w + (size_t)(r + i) * m->rb + (size_t)k * ESZ;        \
                    acc[i][0] = _mm256_fmadd_ps(LOAD8(wr), x0, acc[i][0]);                       \
                    acc[i][1] = _mm256_fmadd_ps(LOAD8(wr + 8 * ESZ), x1, acc[i][1]);             \
                }                                                                                \
            }                                                                                    \
            for (int i = 0; i < nr; i++) {                                                       \
                const uint8_t *wr = m->w + (size_t)(r + i) * m->rb;                              \
                float s = pd_hsum_ps_avx2(_mm256_add_ps(acc[i][0], acc[i][1]));                  \
                for (int64_t kk = k; kk < cols; kk++) s += LOAD1(wr + (size_t)kk * ESZ) * x[kk]; \
                m->y[t * m->ldy + r + i] = s;                                                    \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    PD_TARGET_AVX2 static void NAME(const cpu_mm *m, int64_t r0, int64_t r1) {                   \
        int64_t r = r0;                                                                          \
        for (; m->n > CPU_DECODE_MAX_N && r + 4 <= r1; r += 4) /* decode: one row at a time */   \
            NAME##_rows(m, r, 4);                                                                \
        for (; r < r1; r++) NAME##_rows(m, r, 1);                                                \
    }

MM_FLOAT_AVX2(mm_f32, 4, load8_f32, load1_f32)
MM_FLOAT_AVX2(mm_f16, 2, load8_f16, load1_f16)
MM_FLOAT_AVX2(mm_bf16, 2, load8_bf16, load1_bf16)

/* ------------------------------------------------------------------------
 * fast dequantizers for the GEMM path (same values as the reference:
 * q * d in float, exactly)
 * ------------------------------------------------------------------------ */

PD_TARGET_AVX2 static void dequant_q8_0(const uint8_t *w, int64_t cols, float *out) {
    for (int64_t b = 0; b < cols / 32; b++, w += CPU_Q8_0_BYTES, out += 32) {
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(pd_ld16(w)));
        for (int j = 0; j < 32; j += 8) {
            const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + 2 + j)));
            _mm256_storeu_ps(out + j, _mm256_mul_ps(_mm256_cvtepi32_ps(q), d));
        }
    }
}

PD_TARGET_AVX2 static void dequant_q4_0(const uint8_t *w, int64_t cols, float *out) {
    for (int64_t b = 0; b < cols / 32; b++, w += CPU_Q4_0_BYTES, out += 32) {
        const __m256 d = _mm256_set1_ps(_cvtsh_ss(pd_ld16(w)));
        const __m256i q = _mm256_sub_epi8(unpack_q4_0(w + 2), _mm256_set1_epi8(8));
        const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
        _mm256_storeu_ps(out + 0, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), d));
        _mm256_storeu_ps(out + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), d));
        _mm256_storeu_ps(out + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), d));
        _mm256_storeu_ps(out + 24, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), d));
    }
}

PD_TARGET_AVX2 static void dequant_f16(const uint8_t *w, int64_t cols, float *out) {
    int64_t k = 0;
    for (; k + 8 <= cols; k += 8) _mm256_storeu_ps(out + k, load8_f16(w + 2 * k));
    for (; k < cols; k++) out[k] = load1_f16(w + 2 * k);
}

PD_TARGET_AVX2 static void dequant_bf16(const uint8_t *w, int64_t cols, float *out) {
    int64_t k = 0;
    for (; k + 8 <= cols; k += 8) _mm256_storeu_ps(out + k, load8_bf16(w + 2 * k));
    for (; k < cols; k++) out[k] = load1_bf16(w + 2 * k);
}

/* ------------------------------------------------------------------------
 * element-wise
 * ------------------------------------------------------------------------ */

PD_TARGET_AVX2 static void swiglu(const float *g, const float *u, int64_t n, float *out) {
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 x = _mm256_loadu_ps(g + i);
        const __m256 e = pd_exp_ps_avx2(_mm256_sub_ps(_mm256_setzero_ps(), x));
        const __m256 s = _mm256_div_ps(x, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
    }
    for (; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

PD_TARGET_AVX2 static float softmax_exp(const float *s, float m, int64_t n, float *p) {
    const __m256 vm = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = pd_exp_ps_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + i), vm));
        _mm256_storeu_ps(p + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float sum = pd_hsum_ps_avx2(acc);
    for (; i < n; i++) {
        p[i] = expf(s[i] - m);
        sum += p[i];
    }
    return sum;
}

PD_TARGET_AVX2 static float dot_f32(const float *a, const float *b, int64_t n) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), a1);
    }
    for (; i + 8 <= n; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), a0);
    float s = pd_hsum_ps_avx2(_mm256_add_ps(a0, a1));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

PD_TARGET_AVX2 static void axpy_f32(float a, const float *x, int64_t n, float *y) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

PD_TARGET_AVX2 static void scale_f32(float a, int64_t n, float *y) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(va, _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] *= a;
}

PD_TARGET_AVX2 static void attn_scores(const float *q, const float *k, int64_t hd, int64_t nk,
                                       float scale, float *s) {
    int64_t j = 0;
    for (; j + 4 <= nk; j += 4) {
        const float *k0 = k + j * hd;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t d = 0; d < hd; d += 8) {
            const __m256i m = pd_tail_mask8(hd - d);
            const __m256 qv = _mm256_maskload_ps(q + d, m);
            a0 = _mm256_fmadd_ps(qv, _mm256_maskload_ps(k0 + d, m), a0);
            a1 = _mm256_fmadd_ps(qv, _mm256_maskload_ps(k0 + hd + d, m), a1);
            a2 = _mm256_fmadd_ps(qv, _mm256_maskload_ps(k0 + 2 * hd + d, m), a2);
            a3 = _mm256_fmadd_ps(qv, _mm256_maskload_ps(k0 + 3 * hd + d, m), a3);
        }
        _mm_storeu_ps(s + j, _mm_mul_ps(pd_reduce4_ps_avx2(a0, a1, a2, a3), _mm_set1_ps(scale)));
    }
    for (; j < nk; j++) s[j] = scale * dot_f32(q, k + j * hd, hd);
}

PD_TARGET_AVX2 static void attn_pv(const float *p, const float *v, int64_t hd, int64_t nk, float *o) {
    int64_t d = 0;
    for (; d + 32 <= hd; d += 32) {
        __m256 o0 = _mm256_loadu_ps(o + d), o1 = _mm256_loadu_ps(o + d + 8);
        __m256 o2 = _mm256_loadu_ps(o + d + 16), o3 = _mm256_loadu_ps(o + d + 24);
        for (int64_t j = 0; j < nk; j++) {
            const __m256 b = _mm256_set1_ps(p[j]);
            const float *vj = v + j * hd + d;
            o0 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vj), o0);
            o1 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vj + 8), o1);
            o2 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vj + 16), o2);
            o3 = _mm256_fmadd_ps(b, _mm256_loadu_ps(vj + 24), o3);
        }
        _mm256_storeu_ps(o + d, o0);
        _mm256_storeu_ps(o + d + 8, o1);
        _mm256_storeu_ps(o + d + 16, o2);
        _mm256_storeu_ps(o + d + 24, o3);
    }
    for (; d < hd; d += 8) {
        const __m256i m = pd_tail_mask8(hd - d);
        __m256 o0 = _mm256_maskload_ps(o + d, m);
        for (int64_t j = 0; j < nk; j++)
            o0 = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_maskload_ps(v + j * hd + d, m), o0);
        _mm256_maskstore_ps(o + d, m, o0);
    }
}

/* Eight f16 elements widened to f32 (F16C). */
PD_TARGET_AVX2 static inline __m256 kv_load8_f16(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

PD_TARGET_AVX2 static void attn_scores_f16(const float *q, const uint16_t *k, int64_t hd, int64_t nk,
                                           float scale, float *s) {
    const int64_t hd8 = hd & ~(int64_t)7; /* F16C has no masked load: the rest is scalar */
    int64_t j = 0;
    for (; j + 4 <= nk; j += 4) {
        const uint16_t *k0 = k + j * hd;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t d = 0; d < hd8; d += 8) {
            const __m256 qv = _mm256_loadu_ps(q + d);
            a0 = _mm256_fmadd_ps(qv, kv_load8_f16(k0 + d), a0);
            a1 = _mm256_fmadd_ps(qv, kv_load8_f16(k0 + hd + d), a1);
            a2 = _mm256_fmadd_ps(qv, kv_load8_f16(k0 + 2 * hd + d), a2);
            a3 = _mm256_fmadd_ps(qv, kv_load8_f16(k0 + 3 * hd + d), a3);
        }
        float t[4];
        _mm_storeu_ps(t, pd_reduce4_ps_avx2(a0, a1, a2, a3));
        for (int i = 0; i < 4; i++) {
            for (int64_t d = hd8; d < hd; d++) t[i] += q[d] * pd_fp16_to_fp32(k0[i * hd + d]);
            s[j + i] = scale * t[i];
        }
    }
    for (; j < nk; j++) {
        const uint16_t *kj = k + j * hd;
        __m256 a0 = _mm256_setzero_ps();
        for (int64_t d = 0; d < hd8; d += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), kv_load8_f16(kj + d), a0);
        float t = pd_hsum_ps_avx2(a0);
        for (int64_t d = hd8; d < hd; d++) t += q[d] * pd_fp16_to_fp32(kj[d]);
        s[j] = scale * t;
    }
}

PD_TARGET_AVX2 static void attn_pv_f16(const float *p, const uint16_t *v, int64_t hd, int64_t nk, float *o) {
    int64_t d = 0;
    for (; d + 32 <= hd; d += 32) {
        __m256 o0 = _mm256_loadu_ps(o + d), o1 = _mm256_loadu_ps(o + d + 8);
        __m256 o2 = _mm256_loadu_ps(o + d + 16), o3 = _mm256_loadu_ps(o + d + 24);
        for (int64_t j = 0; j < nk; j++) {
            const __m256 b = _mm256_set1_ps(p[j]);
            const uint16_t *vj = v + j * hd + d;
            o0 = _mm256_fmadd_ps(b, kv_load8_f16(vj), o0);
            o1 = _mm256_fmadd_ps(b, kv_load8_f16(vj + 8), o1);
            o2 = _mm256_fmadd_ps(b, kv_load8_f16(vj + 16), o2);
            o3 = _mm256_fmadd_ps(b, kv_load8_f16(vj + 24), o3);
        }
        _mm256_storeu_ps(o + d, o0);
        _mm256_storeu_ps(o + d + 8, o1);
        _mm256_storeu_ps(o + d + 16, o2);
        _mm256_storeu_ps(o + d + 24, o3);
    }
    for (; d + 8 <= hd; d += 8) {
        __m256 o0 = _mm256_loadu_ps(o + d);
        for (int64_t j = 0; j < nk; j++) o0 = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), kv_load8_f16(v + j * hd + d), o0);
        _mm256_storeu_ps(o + d, o0);
    }
    for (; d < hd; d++)
        for (int64_t j = 0; j < nk; j++) o[d] += p[j] * pd_fp16_to_fp32(v[j * hd + d]);
}

/* The F16C row conversions of half.c (this level implies F16C). */
static void f32_to_f16(const float *x, int64_t n, uint16_t *y) { pd_fp32_to_fp16_row(x, y, (size_t)n); }
static void f16_to_f32(const uint16_t *x, int64_t n, float *y) { pd_fp16_to_fp32_row(x, y, (size_t)n); }

PD_TARGET_AVX2 static float max_f32(const float *x, int64_t n) {
    int64_t i = 0;
    float m = x[0];
    if (n >= 8) {
        __m256 v = _mm256_loadu_ps(x);
        for (i = 8; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + i));
        m = pd_hmax_ps_avx2(v);
    }
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

PD_TARGET_AVX2 static int32_t max_i32(const int32_t *x, int64_t n) {
    int64_t i = 0;
    int32_t m = x[0];
    if (n >= 8) {
        __m256i v = _mm256_loadu_si256((const __m256i *)x);
        for (i = 8; i + 8 <= n; i += 8) v = _mm256_max_epi32(v, _mm256_loadu_si256((const __m256i *)(x + i)));
        __m128i h = _mm_max_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
        h = _mm_max_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(1, 0, 3, 2)));
        h = _mm_max_epi32(h, _mm_shuffle_epi32(h, _MM_SHUFFLE(2, 3, 0, 1)));
        m = _mm_cvtsi128_si32(h);
    }
    for (; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

PD_TARGET_AVX2 static void scale_mul(const float *x, float a, const float *w, int64_t n, float *o) {
    const __m256 va = _mm256_set1_ps(a);
    int64_t i = 0;
    if (w)
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), va), _mm256_loadu_ps(w + i)));
    else
        for (; i + 8 <= n; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), va));
    for (; i < n; i++) o[i] = w ? x[i] * a * w[i] : x[i] * a;
}

void cpu_kernels_avx2(cpu_kernels *k) {
    cpu_kernels_scalar(k);
    k->level = CPU_SIMD_AVX2;
    k->mm[PD_TYPE_F32] = mm_f32;
    k->mm[PD_TYPE_F16] = mm_f16;
    k->mm[PD_TYPE_BF16] = mm_bf16;
    k->mm[PD_TYPE_Q8_0] = mm_q8_0;
    k->mm[PD_TYPE_Q4_0] = mm_q4_0;
    k->mm[PD_TYPE_Q4_K] = mm_q4_K;
    k->mm[PD_TYPE_Q6_K] = mm_q6_K;
    k->dequant[PD_TYPE_Q8_0] = dequant_q8_0;
    k->dequant[PD_TYPE_Q4_0] = dequant_q4_0;
    k->dequant[PD_TYPE_F16] = dequant_f16;
    k->dequant[PD_TYPE_BF16] = dequant_bf16;
    k->quant_q8_0 = cpu_quant_q8_0_avx2;
    k->quant_q8_K = cpu_quant_q8_K_avx2;
    k->swiglu = swiglu;
    k->softmax_exp = softmax_exp;
    k->dot_f32 = dot_f32;
    k->axpy_f32 = axpy_f32;
    k->scale_f32 = scale_f32;
    k->scale_mul = scale_mul;
    k->attn_scores = attn_scores;
    k->attn_pv = attn_pv;
    k->attn_scores_f16 = attn_scores_f16;
    k->attn_pv_f16 = attn_pv_f16;
    k->f32_to_f16 = f32_to_f16;
    k->f16_to_f32 = f16_to_f32;
    k->max_f32 = max_f32;
    k->max_i32 = max_i32;
    cpu_kernels_kq_avx2(k);
    cpu_q32_kernels_avx2(k);
    /* Every quantized type on its integer kernel at every batch size: a
     * token's result then does not depend on how many tokens share its
     * call, which is what makes the automatic prefix cache exact (the
     * tokens after a cache hit are computed in a smaller batch than the
     * first time); dequantize + sgemm rounds in another order. */
    for (int t = 0; t < PD_TYPE_COUNT; t++)
        if (k->mm[t] && !cpu_type_is_float((pd_type)t)) k->mm_any_n[t] = true;
}

#endif /* PD_X86 */
