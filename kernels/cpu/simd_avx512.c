/* AVX-512 (F/BW/VL/DQ) + VNNI kernels, run-time dispatched.
 *
 * q8_0 weights use an integer GEMM tile kernel for every n: a tile of up to
 * 4 weight rows x 4 activation rows, two 32-blocks per 512-bit register.
 * vpdpbusd multiplies unsigned by signed bytes, so the weights are flipped
 * to unsigned with XOR 0x80 (w + 128) and the accumulator starts at
 * -128 * sum(x) for the block (precomputed when x was quantized); the
 * result is the exact integer dot(w, x) of each block, which is then scaled
 * by d_w * d_x in float. The K-quants (q4_K, q6_K) take up to 4 weight
 * rows per pass against q8_K activations (maddubs + vpdpwssd). */
#include "kernels/cpu/cpu_internal.h"

#if PD_X86
#include <immintrin.h>
#include <math.h>

#include "kernels/cpu/simd_x86.h"

#define Q8_0_BYTES 34
#define Q4_0_BYTES 18

/* ------------------------------------------------------------------------
 * q8_0 x q8_0 tile kernel
 * ------------------------------------------------------------------------ */

#define TILE_M 4
#if defined(__clang__)
#define TILE_N 3 /* clang spills the registers of a 4x4 tile */
#else
#define TILE_N 4
#endif
#define TOKEN_BLOCK 64

PD_TARGET_AVX512 static inline __attribute__((always_inline)) void
q8_0_tile(const uint8_t *w, size_t rb, const int nr, const cpu_qact *q, int64_t t0, const int nt,
          float *y, int64_t ldy, const uint8_t *pf) {
    const int64_t nb = q->nblocks;
    const int64_t ldq = q->cols;
    const int8_t *xq = q->qs + t0 * ldq;
    const float *xd = q->d + t0 * nb;
    const int32_t *xc = q->c + t0 * nb;
    const __m512i idx01 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m512i x80 = _mm512_set1_epi8((char)0x80);

    __m512 acc[TILE_M][TILE_N];
PD_UNROLL
    for (int i = 0; i < nr; i++)
PD_UNROLL
        for (int j = 0; j < nt; j++) acc[i][j] = _mm512_setzero_ps();

    int64_t p = 0;
    for (; p + 2 <= nb; p += 2) {
        __m512i xv[TILE_N], cv[TILE_N];
        __m512 dx[TILE_N];
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            xv[j] = _mm512_loadu_si512((const void *)(xq + j * ldq + 32 * p));
            const __m128i d2 = _mm_loadl_epi64((const __m128i *)(const void *)(xd + j * nb + p));
            dx[j] = _mm512_permutexvar_ps(idx01, _mm512_castps128_ps512(_mm_castsi128_ps(d2)));
            const __m128i c2 = _mm_loadl_epi64((const __m128i *)(const void *)(xc + j * nb + p));
            cv[j] = _mm512_maskz_permutexvar_epi32((__mmask16)0x0101, idx01, _mm512_castsi128_si512(c2));
        }
        if (pf) { /* stream the rows a later tile needs (decode reads weights once) */
            PD_UNROLL
            for (int i = 0; i < TILE_M; i++) {
                _mm_prefetch((const char *)(pf + (size_t)i * rb + (size_t)Q8_0_BYTES * (size_t)p), _MM_HINT_T0);
                _mm_prefetch((const char *)(pf + (size_t)i * rb + (size_t)Q8_0_BYTES * (size_t)p + 64), _MM_HINT_T0);
            }
        }
PD_UNROLL
        for (int i = 0; i < nr; i++) {
            const uint8_t *blk = w + (size_t)i * rb + (size_t)Q8_0_BYTES * (size_t)p;
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(blk + 2));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(blk + Q8_0_BYTES + 2));
            const __m512i wv = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1), x80);
            const uint32_t h2 = (uint32_t)pd_ld16(blk) | ((uint32_t)pd_ld16(blk + Q8_0_BYTES) << 16);
            const __m128 dw2 = _mm_cvtph_ps(_mm_cvtsi32_si128((int)h2));
            const __m512 dw = _mm512_permutexvar_ps(idx01, _mm512_castps128_ps512(dw2));
PD_UNROLL
            for (int j = 0; j < nt; j++) {
                const __m512i s = _mm512_dpbusd_epi32(cv[j], wv, xv[j]);
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dx[j]), acc[i][j]);
            }
        }
    }
    if (p < nb) { /* odd block count: the last block in the low half */
        __m512i xv[TILE_N], cv[TILE_N];
        __m512 dx[TILE_N];
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            xv[j] = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(xq + j * ldq + 32 * p)));
            dx[j] = _mm512_maskz_mov_ps((__mmask16)0x00ff, _mm512_set1_ps(xd[j * nb + p]));
            cv[j] = _mm512_maskz_mov_epi32((__mmask16)0x0001, _mm512_set1_epi32(xc[j * nb + p]));
        }
PD_UNROLL
        for (int i = 0; i < nr; i++) {
            const uint8_t *blk = w + (size_t)i * rb + (size_t)Q8_0_BYTES * (size_t)p;
            const __m512i wv = _mm512_xor_si512(
                _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(blk + 2))), x80);
            const __m512 dw = _mm512_set1_ps(_cvtsh_ss(pd_ld16(blk)));
PD_UNROLL
            for (int j = 0; j < nt; j++) {
                const __m512i s = _mm512_dpbusd_epi32(cv[j], wv, xv[j]);
                acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dw, dx[j]), acc[i][j]);
            }
        }
    }
PD_UNROLL
    for (int j = 0; j < nt; j++) {
        if (nr == 4) {
            const __m128 s = pd_reduce4_ps_avx512(acc[0][j], acc[1][j], acc[2][j], acc[3][j]);
            _mm_storeu_ps(y + (t0 + j) * ldy, s);
        } else {
PD_UNROLL
            for (int i = 0; i < nr; i++) y[(t0 + j) * ldy + i] = _mm512_reduce_add_ps(acc[i][j]);
        }
    }
}

#define TILE_CASE(NR, NT)                                                                        \
    case (NR)*8 + (NT): q8_0_tile(w, rb, NR, q, t0, NT, y, ldy, pf); break;

PD_TARGET_AVX512 static void q8_0_tile_any(const uint8_t *w, size_t rb, int nr, const cpu_qact *q,
                                           int64_t t0, int nt, float *y, int64_t ldy,
                                           const uint8_t *pf) {
    switch (nr * 8 + nt) {
#if TILE_N >= 4
        TILE_CASE(4, 4) TILE_CASE(3, 4) TILE_CASE(2, 4) TILE_CASE(1, 4)
#endif
        TILE_CASE(4, 3) TILE_CASE(4, 2) TILE_CASE(4, 1)
        TILE_CASE(3, 3) TILE_CASE(3, 2) TILE_CASE(3, 1)
        TILE_CASE(2, 3) TILE_CASE(2, 2) TILE_CASE(2, 1)
        TILE_CASE(1, 3) TILE_CASE(1, 2) TILE_CASE(1, 1)
    default: break;
    }
}

PD_TARGET_AVX512 static void mm_q8_0(const cpu_mm *m, int64_t r0, int64_t r1) {
    for (int64_t tb = 0; tb < m->n; tb += TOKEN_BLOCK) {
        const int64_t te = tb + TOKEN_BLOCK < m->n ? tb + TOKEN_BLOCK : m->n;
        for (int64_t r = r0; r < r1; r += TILE_M) {
            const int nr = (int)(r1 - r < TILE_M ? r1 - r : TILE_M);
            const uint8_t *w = m->w + (size_t)r * m->rb;
            for (int64_t t = tb; t < te; t += TILE_N) {
                const int nt = (int)(te - t < TILE_N ? te - t : TILE_N);
                /* prefetch two tiles ahead, within this chunk, on the first
                 * pass over the rows */
                const uint8_t *pf = t == tb && r + 3 * TILE_M <= r1 ? w + 2 * TILE_M * m->rb : NULL;
                q8_0_tile_any(w, m->rb, nr, m->q, t, nt, m->y + r, m->ldy, pf);
            }
        }
    }
}

/* ------------------------------------------------------------------------
 * q4_0 x q8_0 (VNNI on 256-bit halves)
 * ------------------------------------------------------------------------ */

PD_TARGET_AVX512 static inline __m256i unpack_q4_0_512(const uint8_t *qs) {
    const __m128i b = _mm_loadu_si128((const __m128i *)qs);
    const __m128i mask = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask), _mm_and_si128(b, mask));
}

PD_TARGET_AVX512 static inline __attribute__((always_inline)) void
q4_0_rows(const cpu_mm *m, int64_t r, const int nr) {
    const cpu_qact *q = m->q;
    const int64_t nb = q->nblocks;
    for (int64_t t = 0; t < m->n; t++) {
        const int8_t *xq = q->qs + t * q->cols;
        const float *xd = q->d + t * nb;
        const int32_t *xc = q->c + t * nb;
        __m256 acc[4];
PD_UNROLL
        for (int i = 0; i < nr; i++) acc[i] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + 32 * b));
            const __m256i corr = _mm256_maskz_mov_epi32((__mmask8)1, _mm256_set1_epi32(xc[b] / 16));
PD_UNROLL
            for (int i = 0; i < nr; i++) {
                const uint8_t *blk = m->w + (size_t)(r + i) * m->rb + (size_t)Q4_0_BYTES * (size_t)b;
                const __m256i p = _mm256_dpbusd_epi32(corr, unpack_q4_0_512(blk + 2), xv);
                const __m256 s = _mm256_set1_ps(_cvtsh_ss(pd_ld16(blk)) * xd[b]);
                acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), s, acc[i]);
            }
        }
PD_UNROLL
        for (int i = 0; i < nr; i++) m->y[t * m->ldy + r + i] = pd_hsum_ps_avx2(acc[i]);
    }
}

PD_TARGET_AVX512 static void mm_q4_0(const cpu_mm *m, int64_t r0, int64_t r1) {
    int64_t r = r0;
    for (; r + 4 <= r1; r += 4) {
        if (m->n <= 4 && r + PD_PF_AHEAD + 4 <= r1)
            pd_prefetch_rows(m->w + (size_t)(r + PD_PF_AHEAD) * m->rb, m->rb, 4, m->rb);
        q4_0_rows(m, r, 4);
    }
    for (; r < r1; r++) q4_0_rows(m, r, 1);
}

/* ------------------------------------------------------------------------
 * q4_K / q6_K x q8_K: up to 4 weight rows per pass, so each super-block of
 * activations is loaded once for all of them. Codes times activations are
 * paired into int16 with maddubs (no overflow: 15 * 127 * 2 and
 * 63 * 127 * 2 fit), then multiplied by the sub-block scales and summed into
 * int32 with vpdpwssd. Integer sums are exact; only the float additions are
 * in another order than the scalar reference.
 * ------------------------------------------------------------------------ */

#define Q4_K_BYTES 144
#define Q6_K_BYTES 210
#define KQ_ROWS 4

/* The 8 six-bit scales (bytes 0..7) and mins (bytes 8..15) of a q4_K block. */
PD_TARGET_AVX512 static inline __m128i q4k_scales_mins(const uint8_t *s) {
    uint32_t u[4];
    memcpy(u, s, 12);
    const uint32_t k1 = 0x3f3f3f3fu, k2 = 0x0f0f0f0fu, k3 = 0x03030303u;
    u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    const uint32_t aux = u[1] & k1;
    u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    u[2] = aux;
    u[0] &= k1;
    return _mm_loadu_si128((const __m128i *)(const void *)u);
}

/* 16-bit lanes: `a` in words 0..15, `b` in words 16..31. */
PD_TARGET_AVX512 static inline __m512i halves_epi16(short a, short b) {
    return _mm512_inserti64x4(_mm512_set1_epi16(a), _mm256_set1_epi16(b), 1);
}

PD_TARGET_AVX512 static inline __attribute__((always_inline)) void
q4_K_rows(const cpu_mm *m, int64_t r, const int nr, int64_t ta, int64_t tz) {
    const cpu_qact *q = m->q;
    const int64_t nb = q->nblocks;
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const __m512i sh = halves_epi16(0, 4); /* low nibbles | high nibbles */
    const __m512i idx0 = halves_epi16(0, 1), idx1 = halves_epi16(2, 3);
    const __m512i idx2 = halves_epi16(4, 5), idx3 = halves_epi16(6, 7);
    for (int64_t t = ta; t < tz; t++) {
        const int8_t *xq = q->qs + t * q->cols;
        const float *xd = q->d + t * nb;
        const int16_t *bs = q->bsums + t * (q->cols / 16);
        __m512 acc[KQ_ROWS];
        __m128 accm[KQ_ROWS];
PD_UNROLL
        for (int i = 0; i < nr; i++) {
            acc[i] = _mm512_setzero_ps();
            accm[i] = _mm_setzero_ps();
        }
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *xb = xq + PD_QK_K * b;
            const __m512i x0 = _mm512_loadu_si512((const void *)xb);
            const __m512i x1 = _mm512_loadu_si512((const void *)(xb + 64));
            const __m512i x2 = _mm512_loadu_si512((const void *)(xb + 128));
            const __m512i x3 = _mm512_loadu_si512((const void *)(xb + 192));
            /* sums of the activations of each 32-sub-block (for the mins) */
            const __m256i bp = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(const void *)(bs + 16 * b)),
                                                 _mm256_set1_epi16(1));
            const __m128i bsp = _mm_packs_epi32(_mm256_castsi256_si128(bp), _mm256_extracti128_si256(bp, 1));
PD_UNROLL
            for (int i = 0; i < nr; i++) {
                const uint8_t *blk = m->w + (size_t)(r + i) * m->rb + (size_t)Q4_K_BYTES * (size_t)b;
                const __m128i sm = q4k_scales_mins(blk + 4);
                const __m512i sc = _mm512_castsi128_si512(_mm_cvtepu8_epi16(sm));
                const __m128i mn = _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8));
                const uint8_t *qs = blk + 16;
#define Q4K_STEP(J, X, IDX)                                                                        \
    {                                                                                              \
        const __m512i qv = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * (J)))); \
        const __m512i nib = _mm512_and_si512(_mm512_srlv_epi16(qv, sh), m4);                       \
        sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(nib, X), _mm512_permutexvar_epi16(IDX, sc)); \
    }
                __m512i sumi = _mm512_setzero_si512();
                Q4K_STEP(0, x0, idx0)
                Q4K_STEP(1, x1, idx1)
                Q4K_STEP(2, x2, idx2)
                Q4K_STEP(3, x3, idx3)
#undef Q4K_STEP
                const float dd = _cvtsh_ss(pd_ld16(blk)) * xd[b];
                const float dmin = _cvtsh_ss(pd_ld16(blk + 2)) * xd[b];
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_set1_ps(dd), acc[i]);
                accm[i] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(mn, bsp)), _mm_set1_ps(dmin), accm[i]);
            }
        }
PD_UNROLL
        for (int i = 0; i < nr; i++)
            m->y[t * m->ldy + r + i] = _mm512_reduce_add_ps(acc[i]) - pd_hsum_ps_sse(accm[i]);
    }
}

/* Tokens in blocks of TOKEN_BLOCK, so their activations stay in L2 while
 * every row tile of the chunk passes over them. */
PD_TARGET_AVX512 static void mm_q4_K(const cpu_mm *m, int64_t r0, int64_t r1) {
    for (int64_t ta = 0; ta < m->n; ta += TOKEN_BLOCK) {
        const int64_t tz = ta + TOKEN_BLOCK < m->n ? ta + TOKEN_BLOCK : m->n;
        int64_t r = r0;
        for (; r + KQ_ROWS <= r1; r += KQ_ROWS) {
            if (m->n <= 4 && r + PD_PF_AHEAD + KQ_ROWS <= r1)
                pd_prefetch_rows(m->w + (size_t)(r + PD_PF_AHEAD) * m->rb, m->rb, KQ_ROWS, m->rb);
            q4_K_rows(m, r, KQ_ROWS, ta, tz);
        }
        for (; r < r1; r++) q4_K_rows(m, r, 1, ta, tz);
    }
}

/* word k of each 128-bit lane i (8 words) gets scale base + i */
PD_TARGET_AVX512 static inline __m512i q6k_idx(short base) {
    return _mm512_set_epi16(base + 3, base + 3, base + 3, base + 3, base + 3, base + 3, base + 3, base + 3,
                            base + 2, base + 2, base + 2, base + 2, base + 2, base + 2, base + 2, base + 2,
                            base + 1, base + 1, base + 1, base + 1, base + 1, base + 1, base + 1, base + 1,
                            base, base, base, base, base, base, base, base);
}

PD_TARGET_AVX512 static inline __attribute__((always_inline)) void
q6_K_rows(const cpu_mm *m, int64_t r, const int nr, int64_t ta, int64_t tz) {
    const cpu_qact *q = m->q;
    const int64_t nb = q->nblocks;
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const __m512i m30 = _mm512_set1_epi8(0x30);
    const __m512i shl = halves_epi16(4, 2); /* qh bits 0-1 | 2-3 to bits 4-5 */
    const __m512i shr = halves_epi16(0, 2); /* qh bits 4-5 | 6-7 to bits 4-5 */
    const __m512i idx[4] = {q6k_idx(0), q6k_idx(4), q6k_idx(8), q6k_idx(12)};
    for (int64_t t = ta; t < tz; t++) {
        const int8_t *xq = q->qs + t * q->cols;
        const float *xd = q->d + t * nb;
        const int16_t *bs = q->bsums + t * (q->cols / 16);
        __m512 acc[KQ_ROWS];
PD_UNROLL
        for (int i = 0; i < nr; i++) acc[i] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b++) {
            const int8_t *xb = xq + PD_QK_K * b;
            __m512i xv[4];
            for (int k = 0; k < 4; k++) xv[k] = _mm512_loadu_si512((const void *)(xb + 64 * k));
            const __m256i bsv = _mm256_loadu_si256((const __m256i *)(const void *)(bs + 16 * b));
PD_UNROLL
            for (int i = 0; i < nr; i++) {
                const uint8_t *blk = m->w + (size_t)(r + i) * m->rb + (size_t)Q6_K_BYTES * (size_t)b;
                const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
                const __m512i sc = _mm512_castsi256_si512(sc16);
                /* the codes are stored + 32: subtract 32 * sum(scale * bsum) */
                const __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(sc16, bsv), 5);
                __m512i sumi = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_zextsi256_si512(corr));
PD_UNROLL
                for (int h = 0; h < 2; h++) {
                    const __m512i l = _mm512_loadu_si512((const void *)(blk + 64 * h));
                    const __m512i hb =
                        _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h)));
                    const __m512i lo = _mm512_or_si512(_mm512_and_si512(l, m4),
                                                       _mm512_and_si512(_mm512_sllv_epi16(hb, shl), m30));
                    const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                                                       _mm512_and_si512(_mm512_srlv_epi16(hb, shr), m30));
                    sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(lo, xv[2 * h]),
                                               _mm512_permutexvar_epi16(idx[2 * h], sc));
                    sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(hi, xv[2 * h + 1]),
                                               _mm512_permutexvar_epi16(idx[2 * h + 1], sc));
                }
                const float dd = _cvtsh_ss(pd_ld16(blk + 208)) * xd[b];
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi), _mm512_set1_ps(dd), acc[i]);
            }
        }
PD_UNROLL
        for (int i = 0; i < nr; i++) m->y[t * m->ldy + r + i] = _mm512_reduce_add_ps(acc[i]);
    }
}

/* Tokens in blocks of TOKEN_BLOCK, so their activations stay in L2 while
 * every row tile of the chunk passes over them. */
PD_TARGET_AVX512 static void mm_q6_K(const cpu_mm *m, int64_t r0, int64_t r1) {
    for (int64_t ta = 0; ta < m->n; ta += TOKEN_BLOCK) {
        const int64_t tz = ta + TOKEN_BLOCK < m->n ? ta + TOKEN_BLOCK : m->n;
        int64_t r = r0;
        for (; r + KQ_ROWS <= r1; r += KQ_ROWS) {
            if (m->n <= 4 && r + PD_PF_AHEAD + KQ_ROWS <= r1)
                pd_prefetch_rows(m->w + (size_t)(r + PD_PF_AHEAD) * m->rb, m->rb, KQ_ROWS, m->rb);
            q6_K_rows(m, r, KQ_ROWS, ta, tz);
        }
        for (; r < r1; r++) q6_K_rows(m, r, 1, ta, tz);
    }
}

/* ------------------------------------------------------------------------
 * float weights
 * ------------------------------------------------------------------------ */

PD_TARGET_AVX512 static inline __m512 load16_f32(const uint8_t *p) {
    return _mm512_loadu_ps((const void *)p);
}
PD_TARGET_AVX512 static inline __m512 load16_f16(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
PD_TARGET_AVX512 static inline __m512 load16_bf16(const uint8_t *p) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
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

#define MM_FLOAT_512(NAME, ESZ, LOAD16, LOAD1)                                                   \
    PD_TARGET_AVX512 static inline __attribute__((always_inline)) void NAME##_rows(               \
        const cpu_mm *m, int64_t r, const int nr) {                                              \
        const int64_t cols = m->cols;                                                            \
        for (int64_t t = 0; t < m->n; t++) {                                                     \
            const float *x = m->x + t * cols;                                                    \
            __m512 acc[4][2];                                                                    \
            PD_UNROLL for (int i = 0; i < nr; i++) acc[i][0] = acc[i][1] =         \
                _mm512_setzero_ps();                                                             \
            int64_t k = 0;                                                                       \
            for (; k + 32 <= cols; k += 32) {                                                    \
                const __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);      \
                PD_UNROLL for (int i = 0; i < nr; i++) {                           \
                    const uint8_t *wr = m->w + (size_t)(r + i) * m->rb + (size_t)k * ESZ;        \
                    acc[i][0] = _mm512_fmadd_ps(LOAD16(wr), x0, acc[i][0]);                      \
                    acc[i][1] = _mm512_fmadd_ps(LOAD16(wr + 16 * ESZ), x1, acc[i][1]);           \
                }                                                                                \
            }                                                                                    \
            for (; k + 16 <= cols; k += 16) {                                                    \
                const __m512 x0 = _mm512_loadu_ps(x + k);                                        \
                PD_UNROLL for (int i = 0; i < nr; i++) {                           \
                    const uint8_t *wr = m->w + (size_t)(r + i) * m->rb + (size_t)k * ESZ;        \
                    acc[i][0] = _mm512_fmadd_ps(LOAD16(wr), x0, acc[i][0]);                      \
                }                                                                                \
            }                                                                                    \
            for (int i = 0; i < nr; i++) {                                                       \
                const uint8_t *wr = m->w + (size_t)(r + i) * m->rb;                              \
                float s = _mm512_reduce_add_ps(_mm512_add_ps(acc[i][0], acc[i][1]));             \
                for (int64_t kk = k; kk < cols; kk++) s += LOAD1(wr + (size_t)kk * ESZ) * x[kk]; \
                m->y[t * m->ldy + r + i] = s;                                                    \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
    PD_TARGET_AVX512 static void NAME(const cpu_mm *m, int64_t r0, int64_t r1) {                 \
        int64_t r = r0;                                                                          \
        for (; r + 4 <= r1; r += 4) {                                                            \
            if (m->n <= 4 && r + PD_PF_AHEAD + 4 <= r1)                                          \
                pd_prefetch_rows(m->w + (size_t)(r + PD_PF_AHEAD) * m->rb, m->rb, 4, m->rb);     \
            NAME##_rows(m, r, 4);                                                                \
        }                                                                                        \
        for (; r < r1; r++) NAME##_rows(m, r, 1);                                                \
    }

MM_FLOAT_512(mm_f32, 4, load16_f32, load1_f32)
MM_FLOAT_512(mm_f16, 2, load16_f16, load1_f16)
MM_FLOAT_512(mm_bf16, 2, load16_bf16, load1_bf16)

/* ------------------------------------------------------------------------
 * element-wise
 * ------------------------------------------------------------------------ */

PD_TARGET_AVX512 static void swiglu(const float *g, const float *u, int64_t n, float *out) {
    int64_t i = 0;
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; i + 16 <= n; i += 16) {
        const __m512 x = _mm512_loadu_ps(g + i);
        const __m512 e = pd_exp_ps_avx512(_mm512_sub_ps(_mm512_setzero_ps(), x));
        const __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, e));
        _mm512_storeu_ps(out + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
    }
    for (; i < n; i++) out[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

PD_TARGET_AVX512 static float softmax_exp(const float *s, float m, int64_t n, float *p) {
    const __m512 vm = _mm512_set1_ps(m);
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 e = pd_exp_ps_avx512(_mm512_sub_ps(_mm512_loadu_ps(s + i), vm));
        _mm512_storeu_ps(p + i, e);
        acc = _mm512_add_ps(acc, e);
    }
    float sum = _mm512_reduce_add_ps(acc);
    for (; i < n; i++) {
        p[i] = expf(s[i] - m);
        sum += p[i];
    }
    return sum;
}

PD_TARGET_AVX512 static float dot_f32(const float *a, const float *b, int64_t n) {
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), a1);
    }
    for (; i + 16 <= n; i += 16) a0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), a0);
    float s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

PD_TARGET_AVX512 static void axpy_f32(float a, const float *x, int64_t n, float *y) {
    const __m512 va = _mm512_set1_ps(a);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_fmadd_ps(va, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
    for (; i < n; i++) y[i] += a * x[i];
}

PD_TARGET_AVX512 static void scale_f32(float a, int64_t n, float *y) {
    const __m512 va = _mm512_set1_ps(a);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_mul_ps(va, _mm512_loadu_ps(y + i)));
    for (; i < n; i++) y[i] *= a;
}

PD_TARGET_AVX512 static void attn_scores(const float *q, const float *k, int64_t hd, int64_t nk,
                                         float scale, float *s) {
    int64_t j = 0;
    if (hd == 64) { /* the common head size: q in registers, plain loads, 8 keys per pass */
        const __m512 q0 = _mm512_loadu_ps(q), q1 = _mm512_loadu_ps(q + 16);
        const __m512 q2 = _mm512_loadu_ps(q + 32), q3 = _mm512_loadu_ps(q + 48);
        const __m128 vs = _mm_set1_ps(scale);
        for (; j + 8 <= nk; j += 8) {
            const float *k0 = k + j * 64;
            __m512 acc[8];
            PD_UNROLL
            for (int i = 0; i < 8; i++) {
                const float *ki = k0 + i * 64;
                const __m512 x = _mm512_mul_ps(q0, _mm512_loadu_ps(ki));
                const __m512 y = _mm512_mul_ps(q1, _mm512_loadu_ps(ki + 16));
                acc[i] = _mm512_add_ps(_mm512_fmadd_ps(q2, _mm512_loadu_ps(ki + 32), x),
                                       _mm512_fmadd_ps(q3, _mm512_loadu_ps(ki + 48), y));
            }
            _mm_storeu_ps(s + j, _mm_mul_ps(pd_reduce4_ps_avx512(acc[0], acc[1], acc[2], acc[3]), vs));
            _mm_storeu_ps(s + j + 4, _mm_mul_ps(pd_reduce4_ps_avx512(acc[4], acc[5], acc[6], acc[7]), vs));
        }
    }
    for (; j + 4 <= nk; j += 4) {
        const float *k0 = k + j * hd;
        __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t d = 0; d < hd; d += 16) {
            const __mmask16 m = pd_tail_mask16(hd - d);
            const __m512 qv = _mm512_maskz_loadu_ps(m, q + d);
            a0 = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, k0 + d), a0);
            a1 = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, k0 + hd + d), a1);
            a2 = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, k0 + 2 * hd + d), a2);
            a3 = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, k0 + 3 * hd + d), a3);
        }
        _mm_storeu_ps(s + j, _mm_mul_ps(pd_reduce4_ps_avx512(a0, a1, a2, a3), _mm_set1_ps(scale)));
    }
    for (; j < nk; j++) {
        __m512 a0 = _mm512_setzero_ps();
        for (int64_t d = 0; d < hd; d += 16) {
            const __mmask16 m = pd_tail_mask16(hd - d);
            a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + d), _mm512_maskz_loadu_ps(m, k + j * hd + d), a0);
        }
        s[j] = scale * _mm512_reduce_add_ps(a0);
    }
}

PD_TARGET_AVX512 static void attn_pv(const float *p, const float *v, int64_t hd, int64_t nk, float *o) {
    int64_t d = 0;
    for (; d + 64 <= hd; d += 64) {
        /* two sets of accumulators: consecutive keys do not wait on each other */
        __m512 a[8];
        a[0] = _mm512_loadu_ps(o + d), a[1] = _mm512_loadu_ps(o + d + 16);
        a[2] = _mm512_loadu_ps(o + d + 32), a[3] = _mm512_loadu_ps(o + d + 48);
        a[4] = a[5] = a[6] = a[7] = _mm512_setzero_ps();
        int64_t j = 0;
        for (; j + 2 <= nk; j += 2) {
            const __m512 b0 = _mm512_set1_ps(p[j]), b1 = _mm512_set1_ps(p[j + 1]);
            const float *v0 = v + j * hd + d, *v1 = v0 + hd;
            PD_UNROLL
            for (int c = 0; c < 4; c++) {
                a[c] = _mm512_fmadd_ps(b0, _mm512_loadu_ps(v0 + 16 * c), a[c]);
                a[4 + c] = _mm512_fmadd_ps(b1, _mm512_loadu_ps(v1 + 16 * c), a[4 + c]);
            }
        }
        if (j < nk) {
            const __m512 b0 = _mm512_set1_ps(p[j]);
            const float *v0 = v + j * hd + d;
            PD_UNROLL
            for (int c = 0; c < 4; c++) a[c] = _mm512_fmadd_ps(b0, _mm512_loadu_ps(v0 + 16 * c), a[c]);
        }
        PD_UNROLL
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + d + 16 * c, _mm512_add_ps(a[c], a[4 + c]));
    }
    for (; d < hd; d += 16) {
        const __mmask16 m = pd_tail_mask16(hd - d);
        __m512 o0 = _mm512_maskz_loadu_ps(m, o + d);
        for (int64_t j = 0; j < nk; j++)
            o0 = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), _mm512_maskz_loadu_ps(m, v + j * hd + d), o0);
        _mm512_mask_storeu_ps(o + d, m, o0);
    }
}

PD_TARGET_AVX512 static void scale_mul(const float *x, float a, const float *w, int64_t n, float *o) {
    const __m512 va = _mm512_set1_ps(a);
    int64_t i = 0;
    if (w)
        for (; i + 16 <= n; i += 16)
            _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(x + i), va), _mm512_loadu_ps(w + i)));
    else
        for (; i + 16 <= n; i += 16) _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), va));
    for (; i < n; i++) o[i] = w ? x[i] * a * w[i] : x[i] * a;
}

void cpu_kernels_avx512(cpu_kernels *k) {
    cpu_kernels_avx2(k);
    k->level = CPU_SIMD_AVX512;
    k->mm[PD_TYPE_Q8_0] = mm_q8_0;
    k->mm_any_n[PD_TYPE_Q8_0] = true;
    k->mm[PD_TYPE_Q4_0] = mm_q4_0;
    k->mm[PD_TYPE_Q4_K] = mm_q4_K;
    k->mm[PD_TYPE_Q6_K] = mm_q6_K;
    k->mm_any_n[PD_TYPE_Q4_K] = true;
    k->mm_any_n[PD_TYPE_Q6_K] = true;
    k->mm[PD_TYPE_F32] = mm_f32;
    k->mm[PD_TYPE_F16] = mm_f16;
    k->mm[PD_TYPE_BF16] = mm_bf16;
    k->swiglu = swiglu;
    k->softmax_exp = softmax_exp;
    k->dot_f32 = dot_f32;
    k->axpy_f32 = axpy_f32;
    k->scale_f32 = scale_f32;
    k->scale_mul = scale_mul;
    k->attn_scores = attn_scores;
    k->attn_pv = attn_pv;
}

#endif /* PD_X86 */
