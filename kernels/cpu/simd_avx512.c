/* AVX-512 (F/BW/VL/DQ) + VNNI kernels, run-time dispatched.
 *
 * Decode (n <= CPU_DECODE_MAX_N) reads each weight row once, front to back,
 * for all n tokens. Prefill of q8_0 uses an integer GEMM tile kernel: up to
 * 4 weight rows x 4 activation rows, two 32-blocks per 512-bit register;
 * the K-quants use their row kernels over blocks of 8 tokens. vpdpbusd
 * multiplies unsigned by signed bytes, so q8_0 weights are flipped to
 * unsigned with XOR 0x80 (w + 128) and the accumulator starts at
 * -128 * sum(x) for the block (precomputed when x was quantized); the
 * result is the exact integer dot(w, x) of each block, which is then scaled
 * by d_w * d_x in float. K-quant codes are unsigned already. */
#include "kernels/cpu/cpu_internal.h"

#if PD_X86
#include <immintrin.h>
#include <math.h>

#include "kernels/cpu/simd_x86.h"

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
                const uint8_t *next = pf + (size_t)i * rb + (size_t)CPU_Q8_0_BYTES * (size_t)p;
                _mm_prefetch((const char *)next, _MM_HINT_T0);
                _mm_prefetch((const char *)(next + 64), _MM_HINT_T0);
            }
        }
PD_UNROLL
        for (int i = 0; i < nr; i++) {
            const uint8_t *blk = w + (size_t)i * rb + (size_t)CPU_Q8_0_BYTES * (size_t)p;
            const __m256i w0 = _mm256_loadu_si256((const __m256i *)(blk + 2));
            const __m256i w1 = _mm256_loadu_si256((const __m256i *)(blk + CPU_Q8_0_BYTES + 2));
            const __m512i wv = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1), x80);
            const uint32_t h2 = (uint32_t)pd_ld16(blk) | ((uint32_t)pd_ld16(blk + CPU_Q8_0_BYTES) << 16);
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
            const uint8_t *blk = w + (size_t)i * rb + (size_t)CPU_Q8_0_BYTES * (size_t)p;
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
            for (int i = 0; i < nr; i++) y[(t0 + j) * ldy + i] = pd_hsum_ps_avx512(acc[i][j]);
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

PD_TARGET_AVX512 static void mm_q8_0_tiles(const cpu_mm *m, int64_t r0, int64_t r1) {
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
 * q4_0 x q8_0: codes unpacked to bytes for VNNI (see q4_0_row)
 * ------------------------------------------------------------------------ */

PD_TARGET_AVX512 static inline __m256i unpack_q4_0_512(const uint8_t *qs) {
    const __m128i b = _mm_loadu_si128((const __m128i *)qs);
    const __m128i mask = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask), _mm_and_si128(b, mask));
}

/* ------------------------------------------------------------------------
 * Decode (n <= CPU_DECODE_MAX_N): one weight row at a time, front to back,
 * all n tokens per weight load (ROW_RANGE, ROW_KERNEL_ALL_N and
 * decode_prefetch in simd_x86.h).
 * ------------------------------------------------------------------------ */

/* q8_0: two 32-blocks per register, codes flipped to unsigned bytes
 * (w + 128) for vpdpbusd, the accumulator starting at c = -128 * sum(x) of
 * each block, as in the tile kernel. */
PD_TARGET_AVX512 static inline __attribute__((always_inline)) void
q8_0_row(const cpu_mm *m, int64_t r, int64_t t0, const int nt) {
    const cpu_qact *q = m->q;
    const int64_t nb = q->nblocks;
    const uint8_t *w = m->w + (size_t)r * m->rb;
    const __m512i idx01 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const __m256i x80 = _mm256_set1_epi8((char)0x80);
    __m512 acc[CPU_DECODE_MAX_N];
PD_UNROLL
    for (int j = 0; j < nt; j++) acc[j] = _mm512_setzero_ps();
    int64_t p = 0;
    for (; p + 2 <= nb; p += 2) {
        const uint8_t *blk = w + CPU_Q8_0_BYTES * (size_t)p;
        decode_prefetch(blk);
        const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 2)), x80);
        const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + CPU_Q8_0_BYTES + 2)), x80);
        const __m512i wv = _mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1);
        const uint32_t h2 = (uint32_t)pd_ld16(blk) | ((uint32_t)pd_ld16(blk + CPU_Q8_0_BYTES) << 16);
        const __m128 dw2 = _mm_cvtph_ps(_mm_cvtsi32_si128((int)h2));
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            const __m512i xv = _mm512_loadu_si512((const void *)(q->qs + (t0 + j) * q->cols + 32 * p));
            const __m128i c2 = _mm_loadl_epi64((const __m128i *)(const void *)(q->c + (t0 + j) * nb + p));
            const __m512i cv = _mm512_maskz_permutexvar_epi32((__mmask16)0x0101, idx01, _mm512_castsi128_si512(c2));
            const __m128 d2 = _mm_mul_ps(dw2, _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(const void *)(q->d + (t0 + j) * nb + p))));
            const __m512 dv = _mm512_permutexvar_ps(idx01, _mm512_castps128_ps512(d2));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(cv, wv, xv)), dv, acc[j]);
        }
    }
    if (p < nb) { /* odd block count: the tile kernel's arithmetic, bit for bit */
        const uint8_t *blk = w + CPU_Q8_0_BYTES * (size_t)p;
        const __m512i wv = _mm512_zextsi256_si512(_mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 2)), x80));
        const __m512 dw = _mm512_set1_ps(_cvtsh_ss(pd_ld16(blk)));
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            const __m512i xv = _mm512_zextsi256_si512(
                _mm256_loadu_si256((const __m256i *)(const void *)(q->qs + (t0 + j) * q->cols + 32 * p)));
            const __m512i cv = _mm512_maskz_mov_epi32((__mmask16)0x0001, _mm512_set1_epi32(q->c[(t0 + j) * nb + p]));
            const __m512 dx = _mm512_maskz_mov_ps((__mmask16)0x00ff, _mm512_set1_ps(q->d[(t0 + j) * nb + p]));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_dpbusd_epi32(cv, wv, xv)), _mm512_mul_ps(dw, dx), acc[j]);
        }
    }
PD_UNROLL
    for (int j = 0; j < nt; j++) m->y[(t0 + j) * m->ldy + r] = pd_hsum_ps_avx512(acc[j]);
}

/* q4_0 against activations in the layout cpu_quant_q8_0_q4_avx512 writes: per group of
 * four 32-blocks, the first 16 elements of each block, then the last 16 of
 * each. The 16 code bytes of four blocks then fill one register, whose low
 * nibbles meet the first 64 activations and high nibbles the next 64 in two
 * chained vpdpbusd, every 32-bit lane staying within one block. Codes are
 * the unsigned nibbles (w + 8); the per-block correction c is stored
 * already divided by 16 (-8 * sum(x)). A tail of fewer than 4 blocks keeps
 * the natural order. */
#define Q4_0_GROUP 4

PD_TARGET_AVX512 static inline __attribute__((always_inline)) void
q4_0_row(const cpu_mm *m, int64_t r, int64_t t0, const int nt) {
    const cpu_qact *q = m->q;
    const int64_t nb = q->nblocks, ng = nb / Q4_0_GROUP;
    const uint8_t *w = m->w + (size_t)r * m->rb;
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const __m512i idx = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    __m512 acc[CPU_DECODE_MAX_N];
PD_UNROLL
    for (int j = 0; j < nt; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t g = 0; g < ng; g++) {
        const uint8_t *blk = w + (size_t)(Q4_0_GROUP * CPU_Q4_0_BYTES) * (size_t)g;
        decode_prefetch(blk);
        decode_prefetch(blk + 64);
        __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(blk + 2)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(blk + CPU_Q4_0_BYTES + 2)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(blk + 2 * CPU_Q4_0_BYTES + 2)), 2);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(blk + 3 * CPU_Q4_0_BYTES + 2)), 3);
        const __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        const uint64_t h4 = (uint64_t)pd_ld16(blk) | ((uint64_t)pd_ld16(blk + CPU_Q4_0_BYTES) << 16) |
                            ((uint64_t)pd_ld16(blk + 2 * CPU_Q4_0_BYTES) << 32) |
                            ((uint64_t)pd_ld16(blk + 3 * CPU_Q4_0_BYTES) << 48);
        const __m128 dw4 = _mm_cvtph_ps(_mm_cvtsi64_si128((long long)h4));
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            const int8_t *x = q->qs + (t0 + j) * q->cols + 128 * g;
            const __m128i c4 = _mm_loadu_si128((const __m128i *)(const void *)(q->c + (t0 + j) * nb + 4 * g));
            const __m512i cv = _mm512_maskz_permutexvar_epi32((__mmask16)0x1111, idx, _mm512_castsi128_si512(c4));
            const __m512i s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(cv, lo, _mm512_loadu_si512((const void *)x)), hi,
                                                  _mm512_loadu_si512((const void *)(x + 64)));
            const __m128 d4 = _mm_mul_ps(dw4, _mm_loadu_ps(q->d + (t0 + j) * nb + 4 * g));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(d4)), acc[j]);
        }
    }
    for (int64_t p = ng * Q4_0_GROUP; p < nb; p++) {
        const uint8_t *blk = w + CPU_Q4_0_BYTES * (size_t)p;
        const __m256i wv = unpack_q4_0_512(blk + 2);
        const float dw = _cvtsh_ss(pd_ld16(blk));
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(const void *)(q->qs + (t0 + j) * q->cols + 32 * p));
            const __m256i cv = _mm256_maskz_mov_epi32((__mmask8)1, _mm256_set1_epi32(q->c[(t0 + j) * nb + p]));
            const __m256 sv = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_dpbusd_epi32(cv, wv, xv)),
                                            _mm256_set1_ps(dw * q->d[(t0 + j) * nb + p]));
            acc[j] = _mm512_add_ps(acc[j], _mm512_zextps256_ps512(sv));
        }
    }
PD_UNROLL
    for (int j = 0; j < nt; j++) m->y[(t0 + j) * m->ldy + r] = _mm512_reduce_add_ps(acc[j]);
}

/* q4_K against activations in the decode layout (cpu_quant_q8_K4_avx512):
 * each 64-byte load of codes gives, in its low nibbles, two sub-blocks
 * whose activations are contiguous there, and its high nibbles the next
 * 64. The
 * 4-byte VNNI sums of codes (0..15) times activations are at most 7620 in
 * magnitude, so two registers of them pack into 16-bit words and meet their
 * sub-block scales in one vpmaddwd: 4 dot products, 2 packs, 2 multiplies
 * per 256 weights. Blocks go in pairs, so that the scale/min unpacking and
 * the min correction (mins x sub-block sums of x, which quant_q8_K4 stores
 * side by side for the pair) run once per two blocks. */
PD_TARGET_AVX512 static inline __attribute__((always_inline)) __m512i
q4_K_block_dot(const uint8_t *blk, const int8_t *x, __m512i sa, __m512i sb) {
    const __m512i m4 = _mm512_set1_epi8(0x0f), z = _mm512_setzero_si512();
    const __m512i qa = _mm512_loadu_si512((const void *)(blk + 16));
    const __m512i qb = _mm512_loadu_si512((const void *)(blk + 80));
    const __m512i p0 = _mm512_dpbusd_epi32(z, _mm512_and_si512(qa, m4), _mm512_loadu_si512((const void *)x));
    const __m512i p1 = _mm512_dpbusd_epi32(z, _mm512_and_si512(_mm512_srli_epi16(qa, 4), m4),
                                           _mm512_loadu_si512((const void *)(x + 64)));
    const __m512i p2 = _mm512_dpbusd_epi32(z, _mm512_and_si512(qb, m4), _mm512_loadu_si512((const void *)(x + 128)));
    const __m512i p3 = _mm512_dpbusd_epi32(z, _mm512_and_si512(_mm512_srli_epi16(qb, 4), m4),
                                           _mm512_loadu_si512((const void *)(x + 192)));
    return _mm512_dpwssd_epi32(_mm512_madd_epi16(_mm512_packs_epi32(p0, p1), sa), _mm512_packs_epi32(p2, p3), sb);
}

/* The scales and mins of two q4_K blocks as 16-bit words: scales of the
 * first in words 0..7, its mins 8..15, the second's in 16..23 and 24..31
 * (q4k_scales_mins on both 128-bit halves at once). */
PD_TARGET_AVX512 static inline __m512i q4k_scales_mins2(const uint8_t *s0, const uint8_t *s1) {
    const __m256i u = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)s0)),
                                              _mm_loadu_si128((const __m128i *)(const void *)s1), 1);
    const __m256i lo = _mm256_and_si256(u, _mm256_set1_epi8(0x3f));
    const __m256i u2 = _mm256_shuffle_epi32(u, 0xaa);
    const __m256i hl = _mm256_and_si256(_mm256_srlv_epi32(u2, _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4)),
                                        _mm256_set1_epi8(0x0f));
    const __m256i hh = _mm256_and_si256(_mm256_slli_epi32(_mm256_srli_epi32(u, 6), 4), _mm256_set1_epi8(0x30));
    return _mm512_cvtepu8_epi16(_mm256_unpacklo_epi32(lo, _mm256_or_si256(hl, hh)));
}

/* A pair of q4_K blocks' scale and min words (q4k_scales_mins2's layout)
 * as q4_K_block_dot and the min correction take them: sa/sb per block,
 * and the mins of both (of the first only, zero-extended, unless two). */
typedef struct q4k_words {
    __m512i sa0, sb0, sa1, sb1;
    __m256i mn;
} q4k_words;

PD_TARGET_AVX512 static inline __attribute__((always_inline)) q4k_words q4k_pair_words(__m512i sm, bool two) {
    /* 128-bit lane k of packs(p0, p1): 4 words of p0's sub-block, 4 of p1's */
    const __m512i ia = _mm512_set_epi16(3, 3, 3, 3, 2, 2, 2, 2, 3, 3, 3, 3, 2, 2, 2, 2,
                                        1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i ib = _mm512_add_epi16(ia, _mm512_set1_epi16(4));
    const __m512i imn = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                         31, 30, 29, 28, 27, 26, 25, 24, 15, 14, 13, 12, 11, 10, 9, 8);
    q4k_words o;
    o.sa0 = _mm512_permutexvar_epi16(ia, sm);
    o.sb0 = _mm512_permutexvar_epi16(ib, sm);
    o.sa1 = two ? _mm512_permutexvar_epi16(_mm512_add_epi16(ia, _mm512_set1_epi16(16)), sm) : o.sa0;
    o.sb1 = two ? _mm512_permutexvar_epi16(_mm512_add_epi16(ib, _mm512_set1_epi16(16)), sm) : o.sb0;
    const __m512i mp = _mm512_permutexvar_epi16(imn, sm);
    o.mn = two ? _mm512_castsi512_si256(mp) : _mm256_zextsi128_si256(_mm512_castsi512_si128(mp));
    return o;
}

/* One token's float steps for blocks b and b + 1, in the order the packed
 * kernel (simd_x16_avx512.c) takes them for a row: each block's exact
 * integer total times d x xd, then its min total times dmin x xd taken
 * off. The same operations on the same values give the same bits, so a
 * token's product does not depend on which of the two kernels its batch
 * size picked. v0, v1: the blocks' code sums in 16 lanes each; mins: the
 * two blocks' min x bsum pairs in lanes 0-3 and 4-7 (4-7 zero for one
 * block); dx: d0 xd0, dmin0 xd0, d1 xd1, dmin1 xd1. */
PD_TARGET_AVX512 static inline __attribute__((always_inline)) __m128
q4_K_pair_steps(__m128 acc, __m512i v0, __m512i v1, __m256i mins, __m128 dx, bool two) {
    const __m256i a = _mm256_add_epi32(_mm512_castsi512_si256(v0), _mm512_extracti64x4_epi64(v0, 1));
    const __m256i c = _mm256_add_epi32(_mm512_castsi512_si256(v1), _mm512_extracti64x4_epi64(v1, 1));
    const __m256i h = _mm256_hadd_epi32(a, c); /* a0+a1 a2+a3 c0+c1 c2+c3 | a4+a5 a6+a7 c4+c5 c6+c7 */
    const __m128i y = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    const __m128i m = _mm_hadd_epi32(_mm256_castsi256_si128(mins), _mm256_extracti128_si256(mins, 1));
    const __m128 t = _mm_cvtepi32_ps(_mm_hadd_epi32(y, m)); /* I0 I1 M0 M1, exact */
    acc = _mm_fmadd_ss(t, dx, acc);
    acc = _mm_fnmadd_ss(_mm_movehl_ps(t, t), _mm_shuffle_ps(dx, dx, 1), acc);
    if (two) {
        acc = _mm_fmadd_ss(_mm_shuffle_ps(t, t, 1), _mm_movehl_ps(dx, dx), acc);
        acc = _mm_fnmadd_ss(_mm_shuffle_ps(t, t, 3), _mm_shuffle_ps(dx, dx, 3), acc);
    }
    return acc;
}

PD_TARGET_AVX512 static inline __attribute__((always_inline)) void
q4_K_row(const cpu_mm *m, int64_t r, int64_t t0, const int nt) {
    const cpu_qact *q = m->q;
    const int64_t nb = q->nblocks;
    const uint8_t *w = m->w + (size_t)r * m->rb;
    __m128 acc[CPU_DECODE_MAX_N];
PD_UNROLL
    for (int j = 0; j < nt; j++) acc[j] = _mm_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        const uint8_t *b0 = w + (size_t)CPU_Q4_K_BYTES * (size_t)b, *b1 = b0 + CPU_Q4_K_BYTES;
        decode_prefetch(b0);
        decode_prefetch(b0 + 64);
        decode_prefetch(b0 + 128);
        decode_prefetch(b0 + 192);
        decode_prefetch(b0 + 256);
        const q4k_words sw = q4k_pair_words(q4k_scales_mins2(b0 + 4, b1 + 4), true);
        /* d0 dmin0 d1 dmin1 */
        const uint64_t h4 = (uint64_t)pd_ld16(b0) | ((uint64_t)pd_ld16(b0 + 2) << 16) |
                            ((uint64_t)pd_ld16(b1) << 32) | ((uint64_t)pd_ld16(b1 + 2) << 48);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi64_si128((long long)h4));
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            const int8_t *x = q->qs + (t0 + j) * q->cols + PD_QK_K * b;
            /* xd0 xd1 (a 4-byte aligned pair: movq, not a double load) */
            const __m128 xd = _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(const void *)(q->d + (t0 + j) * nb + b)));
            const __m128 dx = _mm_mul_ps(dm, _mm_unpacklo_ps(xd, xd)); /* d0 xd0, dmin0 xd0, d1 xd1, dmin1 xd1 */
            const __m256i bs = _mm256_loadu_si256((const __m256i *)(const void *)(q->bsums + (t0 + j) * (q->cols / 16) + 16 * b));
            acc[j] = q4_K_pair_steps(acc[j], q4_K_block_dot(b0, x, sw.sa0, sw.sb0),
                                     q4_K_block_dot(b1, x + PD_QK_K, sw.sa1, sw.sb1), _mm256_madd_epi16(sw.mn, bs), dx,
                                     true);
        }
    }
    if (b < nb) { /* odd block count: the last one alone */
        const uint8_t *b0 = w + (size_t)CPU_Q4_K_BYTES * (size_t)b;
        const q4k_words sw = q4k_pair_words(q4k_scales_mins2(b0 + 4, b0 + 4), false);
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int)((uint32_t)pd_ld16(b0) | ((uint32_t)pd_ld16(b0 + 2) << 16))));
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            const int8_t *x = q->qs + (t0 + j) * q->cols + PD_QK_K * b;
            const __m128 dx = _mm_mul_ps(dm, _mm_set1_ps(q->d[(t0 + j) * nb + b]));
            const __m256i bs = _mm256_zextsi128_si256(
                _mm_loadu_si128((const __m128i *)(const void *)(q->bsums + (t0 + j) * (q->cols / 16) + 16 * b)));
            acc[j] = q4_K_pair_steps(acc[j], q4_K_block_dot(b0, x, sw.sa0, sw.sb0), _mm512_setzero_si512(),
                                     _mm256_madd_epi16(sw.mn, bs), dx, false);
        }
    }
PD_UNROLL
    for (int j = 0; j < nt; j++) m->y[(t0 + j) * m->ldy + r] = _mm_cvtss_f32(acc[j]);
}

/* q4_K decode over four rows at once, far apart: rows r, r + h, r + 2h,
 * r + 3h, h a quarter of the matrix (cpu_mm.far, planned in matmul.c),
 * each read front to back, so that four streams of the matrix are in
 * flight where q4_K_row had one. Each row's dot products are q4_K_row's,
 * and so are its float
 * steps (the same operations on the same values, so the same bits, see
 * q4_K_pair_steps): the four rows' block totals and min totals meet in
 * one reduction tree and the steps run with the rows in the lanes of one
 * register, which also halves the instructions per weight byte. One
 * stream per row was not enough for the memory: on the Llama-3.2-1B Q4_K
 * shape this took decode from 40.2 to 44.4 tok/s at 1 thread and from 71.4
 * to 78.2 at 2 (prefix-bench, 4 interleaved rounds). Four *adjacent* rows
 * at once ran at half the speed from memory: the hardware prefetcher does
 * not follow four streams a row apart. FAR4_PF: bytes ahead in each
 * stream that are prefetched (1-3 KiB were within the noise of each
 * other, none 10% slower). */
#define FAR4_PF 2048

/* The 16 bytes at the starts (d, dmin, 12 bytes of scales) of blocks p
 * and p + next of a row, then of the row rb bytes on, as one register. */
PD_TARGET_AVX512 static inline __m512i q4k_heads4(const uint8_t *p, size_t next, size_t rb) {
    __m512i u = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(const void *)p));
    u = _mm512_inserti32x4(u, _mm_loadu_si128((const __m128i *)(const void *)(p + next)), 1);
    u = _mm512_inserti32x4(u, _mm_loadu_si128((const __m128i *)(const void *)(p + rb)), 2);
    return _mm512_inserti32x4(u, _mm_loadu_si128((const __m128i *)(const void *)(p + rb + next)), 3);
}

/* q4k_scales_mins2 on four blocks' heads (q4k_heads4): 8 scales then 8
 * mins per 128-bit lane, as bytes. */
PD_TARGET_AVX512 static inline __m512i q4k_scales_mins4(__m512i heads) {
    const __m512i u = _mm512_bsrli_epi128(heads, 4);
    const __m512i lo = _mm512_and_si512(u, _mm512_set1_epi8(0x3f));
    const __m512i u2 = _mm512_shuffle_epi32(u, 0xaa);
    const __m512i hl = _mm512_and_si512(_mm512_srlv_epi32(u2, _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0)),
                                        _mm512_set1_epi8(0x0f));
    const __m512i hh = _mm512_and_si512(_mm512_slli_epi32(_mm512_srli_epi32(u, 6), 4), _mm512_set1_epi8(0x30));
    return _mm512_unpacklo_epi32(lo, _mm512_or_si512(hl, hh));
}

/* The 8 sums of v0[i], v1[i] (i = 0..3: the rows, v0 block b, v1 block b +
 * 1), as r0b r0b1 r1b r1b1 | r2b r2b1 r3b r3b1. Integer adds: any order
 * gives the exact totals. */
PD_TARGET_AVX512 static inline __m256i reduce_4x2(const __m512i v0[4], const __m512i v1[4]) {
    __m512i w[4];
PD_UNROLL
    for (int i = 0; i < 4; i++) /* lane k: b, b1, b, b1 partials */
        w[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v0[i], v1[i]), _mm512_unpackhi_epi32(v0[i], v1[i]));
    /* lane k: r0b r0b1 r1b r1b1 partials (x01), r2.. r3.. (x23) */
    const __m512i x01 = _mm512_add_epi32(_mm512_unpacklo_epi64(w[0], w[1]), _mm512_unpackhi_epi64(w[0], w[1]));
    const __m512i x23 = _mm512_add_epi32(_mm512_unpacklo_epi64(w[2], w[3]), _mm512_unpackhi_epi64(w[2], w[3]));
    const __m512i y = _mm512_add_epi32(_mm512_shuffle_i32x4(x01, x23, _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_i32x4(x01, x23, _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i z = _mm512_add_epi32(_mm512_shuffle_i32x4(y, y, _MM_SHUFFLE(3, 1, 2, 0)),
                                       _mm512_shuffle_i32x4(y, y, _MM_SHUFFLE(2, 0, 3, 1)));
    return _mm512_castsi512_si256(z);
}

/* Blocks b and b + 1 (b alone unless `two`) of the four rows at p, p + rb,
 * p + 2 rb, p + 3 rb into acc (lane i: row i), in q4_K_pair_steps' order. */
PD_TARGET_AVX512 static inline __attribute__((always_inline)) void
q4_K_rows4_step(const cpu_qact *q, const uint8_t *p, size_t rb, int64_t b, int64_t t0, const int nt, bool two,
                __m128 *acc) {
    const int64_t nb = q->nblocks;
    /* d, dmin words of the heads of rows (0, 1) | (2, 3) to
     * d0(r0..r3) dmin0(..) d1(..) dmin1(..): word 8k of a head register
     * is lane k's d, 8k + 1 its dmin; the second register's from 32 */
    const __m512i idm = _mm512_castsi256_si512(_mm256_setr_epi16(0, 16, 32, 48, 1, 17, 33, 49, 8, 24, 40, 56, 9, 25, 41, 57));
    /* the totals (reduce_4x2) and min totals (lane k, dwords 0 and 1:
     * block k%2 of rows k/2 and k/2 + 2) to I0 M0 I1 M1, four rows each */
    const __m512i itot = _mm512_setr_epi32(0, 2, 4, 6, 16, 24, 17, 25, 1, 3, 5, 7, 20, 28, 21, 29);
    const __m512i ixd = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    const size_t next = two ? CPU_Q4_K_BYTES : 0;
PD_UNROLL
    for (int i = 0; i < 4; i++)
        for (int o = 0; o < (two ? 2 : 1) * CPU_Q4_K_BYTES; o += 64)
            _mm_prefetch((const char *)p + (size_t)i * rb + FAR4_PF + o, _MM_HINT_T0);
    const __m512i h01 = q4k_heads4(p, next, rb), h23 = q4k_heads4(p + 2 * rb, next, rb);
    const __m512i s01 = q4k_scales_mins4(h01), s23 = q4k_scales_mins4(h23);
    __m512i sm[4];
    sm[0] = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(s01));
    sm[1] = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(s01, 1));
    sm[2] = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(s23));
    sm[3] = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(s23, 1));
    const __m512 dm = _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi16(h01, idm, h23)));
    q4k_words sw[4];
PD_UNROLL
    for (int i = 0; i < 4; i++) sw[i] = q4k_pair_words(sm[i], two);
PD_UNROLL
    for (int j = 0; j < nt; j++) {
        const int8_t *x = q->qs + (t0 + j) * q->cols + PD_QK_K * b;
        const float *xdp = q->d + (t0 + j) * nb + b;
        const __m128 xd2 = two ? _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)(const void *)xdp)) : _mm_load_ss(xdp);
        const __m512 dx = _mm512_mul_ps(dm, _mm512_permutexvar_ps(ixd, _mm512_castps128_ps512(xd2)));
        const int16_t *bsp = q->bsums + (t0 + j) * (q->cols / 16) + 16 * b;
        const __m256i bs = two ? _mm256_loadu_si256((const __m256i *)(const void *)bsp)
                               : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)bsp));
        __m512i v0[4], v1[4];
PD_UNROLL
        for (int i = 0; i < 4; i++) {
            v0[i] = q4_K_block_dot(p + (size_t)i * rb, x, sw[i].sa0, sw[i].sb0);
            v1[i] = two ? q4_K_block_dot(p + (size_t)i * rb + CPU_Q4_K_BYTES, x + PD_QK_K, sw[i].sa1, sw[i].sb1)
                        : _mm512_setzero_si512();
        }
        /* lane k of m01 (m23) sums to block k%2's min total of row k/2 (+ 2) */
        const __m512i m01 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_madd_epi16(sw[0].mn, bs)),
                                               _mm256_madd_epi16(sw[1].mn, bs), 1);
        const __m512i m23 = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_madd_epi16(sw[2].mn, bs)),
                                               _mm256_madd_epi16(sw[3].mn, bs), 1);
        __m512i ms = _mm512_add_epi32(_mm512_unpacklo_epi32(m01, m23), _mm512_unpackhi_epi32(m01, m23));
        ms = _mm512_add_epi32(ms, _mm512_shuffle_epi32(ms, _MM_SHUFFLE(1, 0, 3, 2)));
        const __m512 t = _mm512_cvtepi32_ps(_mm512_permutex2var_epi32(_mm512_castsi256_si512(reduce_4x2(v0, v1)), itot, ms));
        acc[j] = _mm_fmadd_ps(_mm512_castps512_ps128(t), _mm512_castps512_ps128(dx), acc[j]);
        acc[j] = _mm_fnmadd_ps(_mm512_extractf32x4_ps(t, 1), _mm512_extractf32x4_ps(dx, 1), acc[j]);
        if (two) {
            acc[j] = _mm_fmadd_ps(_mm512_extractf32x4_ps(t, 2), _mm512_extractf32x4_ps(dx, 2), acc[j]);
            acc[j] = _mm_fnmadd_ps(_mm512_extractf32x4_ps(t, 3), _mm512_extractf32x4_ps(dx, 3), acc[j]);
        }
    }
}

/* Rows r, r + h, r + 2h, r + 3h (h = m->far) for tokens [t0, t0 + nt). */
PD_TARGET_AVX512 static inline __attribute__((always_inline)) void
q4_K_rows4(const cpu_mm *m, int64_t r, int64_t t0, const int nt) {
    const cpu_qact *q = m->q;
    const int64_t nb = q->nblocks, h = m->far;
    const size_t stride = (size_t)h * m->rb;
    const uint8_t *w = m->w + (size_t)r * m->rb;
    __m128 acc[CPU_DECODE_MAX_N];
PD_UNROLL
    for (int j = 0; j < nt; j++) acc[j] = _mm_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) q4_K_rows4_step(q, w + (size_t)CPU_Q4_K_BYTES * (size_t)b, stride, b, t0, nt, true, acc);
    if (b < nb) q4_K_rows4_step(q, w + (size_t)CPU_Q4_K_BYTES * (size_t)b, stride, b, t0, nt, false, acc);
PD_UNROLL
    for (int j = 0; j < nt; j++) {
        float v[4];
        _mm_storeu_ps(v, acc[j]);
        for (int i = 0; i < 4; i++) m->y[(t0 + j) * m->ldy + r + i * h] = v[i];
    }
}

/* q6_K: codes 0..63 (stored + 32) from the low nibbles and two high bits;
 * 4-byte VNNI sums are at most 4 * 63 * 127 = 32004, so they pack into
 * words as in q4_K_row. Natural activation order (quant_q8_K). A block's
 * codes and scale words, unpacked once for all tokens: */
typedef struct q6k_block {
    __m256i sc16;  /* the 16 scales as words */
    __m512i sa, sb; /* scale words against packs(p0, p1) and packs(p2, p3) */
    __m512i cd[4];  /* the codes, 64 bytes each */
} q6k_block;

PD_TARGET_AVX512 static inline __attribute__((always_inline)) q6k_block q6k_unpack(const uint8_t *blk) {
    const __m512i m4 = _mm512_set1_epi8(0x0f);
    const __m512i m30 = _mm512_set1_epi8(0x30);
    const __m512i shl = halves_epi16(4, 2); /* qh bits 0-1 | 2-3 to bits 4-5 */
    const __m512i shr = halves_epi16(0, 2); /* qh bits 4-5 | 6-7 to bits 4-5 */
    /* lane k of packs(p0, p1): sub-blocks (of 16) k and 4 + k; of
     * packs(p2, p3): 8 + k and 12 + k */
    const __m512i ia = _mm512_set_epi16(7, 7, 7, 7, 3, 3, 3, 3, 6, 6, 6, 6, 2, 2, 2, 2,
                                        5, 5, 5, 5, 1, 1, 1, 1, 4, 4, 4, 4, 0, 0, 0, 0);
    const __m512i ib = _mm512_add_epi16(ia, _mm512_set1_epi16(8));
    q6k_block k;
    k.sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(blk + 192)));
    k.sa = _mm512_permutexvar_epi16(ia, _mm512_castsi256_si512(k.sc16));
    k.sb = _mm512_permutexvar_epi16(ib, _mm512_castsi256_si512(k.sc16));
PD_UNROLL
    for (int h = 0; h < 2; h++) {
        const __m512i l = _mm512_loadu_si512((const void *)(blk + 64 * h));
        const __m512i hb = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h)));
        k.cd[2 * h] = _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_and_si512(_mm512_sllv_epi16(hb, shl), m30));
        k.cd[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                                          _mm512_and_si512(_mm512_srlv_epi16(hb, shr), m30));
    }
    return k;
}

/* A block's integer total against one token's activations x and sub-block
 * sums bs, in 8 lanes (exact: any order of the lanes' sum gives it). */
PD_TARGET_AVX512 static inline __attribute__((always_inline)) __m256i
q6k_block_sums(const q6k_block *k, const int8_t *x, const int16_t *bs) {
    const __m512i z = _mm512_setzero_si512();
    const __m512i p0 = _mm512_dpbusd_epi32(z, k->cd[0], _mm512_loadu_si512((const void *)x));
    const __m512i p1 = _mm512_dpbusd_epi32(z, k->cd[1], _mm512_loadu_si512((const void *)(x + 64)));
    const __m512i p2 = _mm512_dpbusd_epi32(z, k->cd[2], _mm512_loadu_si512((const void *)(x + 128)));
    const __m512i p3 = _mm512_dpbusd_epi32(z, k->cd[3], _mm512_loadu_si512((const void *)(x + 192)));
    /* the codes are stored + 32: subtract 32 * sum(scale * bsum) */
    const __m256i corr = _mm256_slli_epi32(_mm256_madd_epi16(k->sc16, _mm256_loadu_si256((const __m256i *)(const void *)bs)), 5);
    const __m512i si = _mm512_dpwssd_epi32(_mm512_madd_epi16(_mm512_packs_epi32(p0, p1), k->sa),
                                           _mm512_packs_epi32(p2, p3), k->sb);
    return _mm256_sub_epi32(_mm256_add_epi32(_mm512_castsi512_si256(si), _mm512_extracti64x4_epi64(si, 1)), corr);
}

PD_TARGET_AVX512 static inline __attribute__((always_inline)) void
q6_K_row(const cpu_mm *m, int64_t r, int64_t t0, const int nt) {
    const cpu_qact *q = m->q;
    const int64_t nb = q->nblocks;
    const uint8_t *w = m->w + (size_t)r * m->rb;
    /* one float step per block, as the packed kernel takes it: the
     * block's exact integer total times d x xd (see q4_K_pair_steps) */
    __m128 acc[CPU_DECODE_MAX_N];
PD_UNROLL
    for (int j = 0; j < nt; j++) acc[j] = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + (size_t)CPU_Q6_K_BYTES * (size_t)b;
        decode_prefetch(blk);
        decode_prefetch(blk + 64);
        decode_prefetch(blk + 128);
        decode_prefetch(blk + 192);
        const q6k_block k = q6k_unpack(blk);
        const float dw = _cvtsh_ss(pd_ld16(blk + 208));
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            const __m256i s8 = q6k_block_sums(&k, q->qs + (t0 + j) * q->cols + PD_QK_K * b,
                                              q->bsums + (t0 + j) * (q->cols / 16) + 16 * b);
            const __m128 total = _mm_cvtepi32_ps(_mm_set1_epi32(pd_hsum_epi32_avx2(s8)));
            acc[j] = _mm_fmadd_ss(total, _mm_set_ss(dw * q->d[(t0 + j) * nb + b]), acc[j]);
        }
    }
PD_UNROLL
    for (int j = 0; j < nt; j++) m->y[(t0 + j) * m->ldy + r] = _mm_cvtss_f32(acc[j]);
}

/* The four 8-lane totals s[i] summed: lane i of the result is s[i]'s sum.
 * Integer adds, so the totals are exact in any order. */
PD_TARGET_AVX2 static inline __m128i reduce4_epi32(const __m256i s[4]) {
    const __m256i c = _mm256_hadd_epi32(_mm256_hadd_epi32(s[0], s[1]), _mm256_hadd_epi32(s[2], s[3]));
    return _mm_add_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
}

/* q6_K decode over four far-apart rows, as q4_K_rows4: rows r, r + h,
 * r + 2h, r + 3h (h = m->far), each row's block totals q6_K_row's and its
 * float steps the same operations on the same values (the same bits), with
 * the four rows in the lanes of one register. Rows one at a time within a block
 * (each row's codes then stay in registers for all tokens); the four
 * streams still advance a block at a time together. */
PD_TARGET_AVX512 static inline __attribute__((always_inline)) void
q6_K_rows4(const cpu_mm *m, int64_t r, int64_t t0, const int nt) {
    const cpu_qact *q = m->q;
    const int64_t nb = q->nblocks, h = m->far;
    const size_t stride = (size_t)h * m->rb;
    const uint8_t *w = m->w + (size_t)r * m->rb;
    __m128 acc[CPU_DECODE_MAX_N];
PD_UNROLL
    for (int j = 0; j < nt; j++) acc[j] = _mm_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = w + (size_t)CPU_Q6_K_BYTES * (size_t)b;
PD_UNROLL
        for (int i = 0; i < 4; i++)
            for (int o = 0; o < CPU_Q6_K_BYTES; o += 64)
                _mm_prefetch((const char *)p + (size_t)i * stride + FAR4_PF + o, _MM_HINT_T0);
        const uint64_t h4 = (uint64_t)pd_ld16(p + 208) | ((uint64_t)pd_ld16(p + stride + 208) << 16) |
                            ((uint64_t)pd_ld16(p + 2 * stride + 208) << 32) |
                            ((uint64_t)pd_ld16(p + 3 * stride + 208) << 48);
        const __m128 dw = _mm_cvtph_ps(_mm_cvtsi64_si128((long long)h4));
        __m256i s8[CPU_DECODE_MAX_N][4];
PD_UNROLL
        for (int i = 0; i < 4; i++) {
            const q6k_block k = q6k_unpack(p + (size_t)i * stride);
PD_UNROLL
            for (int j = 0; j < nt; j++)
                s8[j][i] = q6k_block_sums(&k, q->qs + (t0 + j) * q->cols + PD_QK_K * b,
                                          q->bsums + (t0 + j) * (q->cols / 16) + 16 * b);
        }
PD_UNROLL
        for (int j = 0; j < nt; j++) {
            const __m128 total = _mm_cvtepi32_ps(reduce4_epi32(s8[j]));
            acc[j] = _mm_fmadd_ps(total, _mm_mul_ps(dw, _mm_set1_ps(q->d[(t0 + j) * nb + b])), acc[j]);
        }
    }
PD_UNROLL
    for (int j = 0; j < nt; j++) {
        float v[4];
        _mm_storeu_ps(v, acc[j]);
        for (int i = 0; i < 4; i++) m->y[(t0 + j) * m->ldy + r + i * h] = v[i];
    }
}

PD_TARGET_AVX512 static void mm_q8_0(const cpu_mm *m, int64_t r0, int64_t r1) {
    if (m->n > CPU_DECODE_MAX_N) return mm_q8_0_tiles(m, r0, r1); /* 4x4 tiles win at large n */
    ROW_RANGE(q8_0_row, m, r0, r1, 0, m->n)
}

/* The K-quant row kernels beat tiles at every n (twice the GFLOP/s). */
PD_TARGET_AVX512 static void mm_q4_K(const cpu_mm *m, int64_t r0, int64_t r1) {
    if (m->far) {
        ROW_RANGE(q4_K_rows4, m, r0, r1, 0, m->n)
        return;
    }
    ROW_KERNEL_ALL_N(q4_K_row, m, r0, r1)
}

PD_TARGET_AVX512 static void mm_q6_K(const cpu_mm *m, int64_t r0, int64_t r1) {
    if (m->far) {
        ROW_RANGE(q6_K_rows4, m, r0, r1, 0, m->n)
        return;
    }
    ROW_KERNEL_ALL_N(q6_K_row, m, r0, r1)
}

PD_TARGET_AVX512 static void mm_q4_0(const cpu_mm *m, int64_t r0, int64_t r1) {
    ROW_KERNEL_ALL_N(q4_0_row, m, r0, r1)
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
        for (; m->n > CPU_DECODE_MAX_N && r + 4 <= r1; r += 4) /* decode: one row at a time */   \
            NAME##_rows(m, r, 4);                                                                \
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

/* Sixteen K/V elements as f32 lanes: f32 rows as they are, f16 rows
 * widened as they are loaded; the masked forms read only the first lanes of
 * m (row tails). */
PD_TARGET_AVX512 static inline __m512 kv_load16_f32(const float *p) { return _mm512_loadu_ps(p); }
PD_TARGET_AVX512 static inline __m512 kv_maskload16_f32(__mmask16 m, const float *p) {
    return _mm512_maskz_loadu_ps(m, p);
}
PD_TARGET_AVX512 static inline __m512 kv_load16_f16(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
PD_TARGET_AVX512 static inline __m512 kv_maskload16_f16(__mmask16 m, const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

/* attn_scores and attn_pv over rows of element type T (f32 or f16), the
 * arithmetic f32 either way. */
#define ATTN_KERNELS_512(SUFFIX, T)                                                              \
    PD_TARGET_AVX512 static void attn_scores##SUFFIX(const float *q, const T *k, int64_t hd, int64_t nk, \
                                                     float scale, float *s) {                    \
        int64_t j = 0;                                                                           \
        if (hd == 64) { /* the common head size: q in registers, 8 keys per pass */              \
            const __m512 q0 = _mm512_loadu_ps(q), q1 = _mm512_loadu_ps(q + 16);                  \
            const __m512 q2 = _mm512_loadu_ps(q + 32), q3 = _mm512_loadu_ps(q + 48);             \
            const __m128 vs = _mm_set1_ps(scale);                                                \
            for (; j + 8 <= nk; j += 8) {                                                        \
                const T *k0 = k + j * 64;                                                        \
                __m512 acc[8];                                                                   \
                PD_UNROLL for (int i = 0; i < 8; i++) {                                          \
                    const T *ki = k0 + i * 64;                                                   \
                    const __m512 x = _mm512_mul_ps(q0, kv_load16##SUFFIX(ki));                   \
                    const __m512 y = _mm512_mul_ps(q1, kv_load16##SUFFIX(ki + 16));              \
                    acc[i] = _mm512_add_ps(_mm512_fmadd_ps(q2, kv_load16##SUFFIX(ki + 32), x),   \
                                           _mm512_fmadd_ps(q3, kv_load16##SUFFIX(ki + 48), y));  \
                }                                                                                \
                _mm_storeu_ps(s + j, _mm_mul_ps(pd_reduce4_ps_avx512(acc[0], acc[1], acc[2], acc[3]), vs)); \
                _mm_storeu_ps(s + j + 4, _mm_mul_ps(pd_reduce4_ps_avx512(acc[4], acc[5], acc[6], acc[7]), vs)); \
            }                                                                                    \
        }                                                                                        \
        for (; j + 4 <= nk; j += 4) {                                                            \
            const T *k0 = k + j * hd;                                                            \
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                          \
            for (int64_t d = 0; d < hd; d += 16) {                                               \
                const __mmask16 m = pd_tail_mask16(hd - d);                                      \
                const __m512 qv = _mm512_maskz_loadu_ps(m, q + d);                               \
                a0 = _mm512_fmadd_ps(qv, kv_maskload16##SUFFIX(m, k0 + d), a0);                  \
                a1 = _mm512_fmadd_ps(qv, kv_maskload16##SUFFIX(m, k0 + hd + d), a1);             \
                a2 = _mm512_fmadd_ps(qv, kv_maskload16##SUFFIX(m, k0 + 2 * hd + d), a2);         \
                a3 = _mm512_fmadd_ps(qv, kv_maskload16##SUFFIX(m, k0 + 3 * hd + d), a3);         \
            }                                                                                    \
            _mm_storeu_ps(s + j, _mm_mul_ps(pd_reduce4_ps_avx512(a0, a1, a2, a3), _mm_set1_ps(scale))); \
        }                                                                                        \
        for (; j < nk; j++) {                                                                    \
            __m512 a0 = _mm512_setzero_ps();                                                     \
            for (int64_t d = 0; d < hd; d += 16) {                                               \
                const __mmask16 m = pd_tail_mask16(hd - d);                                      \
                a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, q + d), kv_maskload16##SUFFIX(m, k + j * hd + d), a0); \
            }                                                                                    \
            s[j] = scale * _mm512_reduce_add_ps(a0);                                             \
        }                                                                                        \
    }                                                                                            \
    PD_TARGET_AVX512 static void attn_pv##SUFFIX(const float *p, const T *v, int64_t hd, int64_t nk, float *o) { \
        int64_t d = 0;                                                                           \
        for (; d + 64 <= hd; d += 64) {                                                          \
            /* two sets of accumulators: consecutive keys do not wait on each other */           \
            __m512 a[8];                                                                         \
            a[0] = _mm512_loadu_ps(o + d), a[1] = _mm512_loadu_ps(o + d + 16);                   \
            a[2] = _mm512_loadu_ps(o + d + 32), a[3] = _mm512_loadu_ps(o + d + 48);              \
            a[4] = a[5] = a[6] = a[7] = _mm512_setzero_ps();                                     \
            int64_t j = 0;                                                                       \
            for (; j + 2 <= nk; j += 2) {                                                        \
                const __m512 b0 = _mm512_set1_ps(p[j]), b1 = _mm512_set1_ps(p[j + 1]);           \
                const T *v0 = v + j * hd + d, *v1 = v0 + hd;                                     \
                PD_UNROLL for (int c = 0; c < 4; c++) {                                          \
                    a[c] = _mm512_fmadd_ps(b0, kv_load16##SUFFIX(v0 + 16 * c), a[c]);            \
                    a[4 + c] = _mm512_fmadd_ps(b1, kv_load16##SUFFIX(v1 + 16 * c), a[4 + c]);    \
                }                                                                                \
            }                                                                                    \
            if (j < nk) {                                                                        \
                const __m512 b0 = _mm512_set1_ps(p[j]);                                          \
                const T *v0 = v + j * hd + d;                                                    \
                PD_UNROLL for (int c = 0; c < 4; c++) a[c] = _mm512_fmadd_ps(b0, kv_load16##SUFFIX(v0 + 16 * c), a[c]); \
            }                                                                                    \
            PD_UNROLL for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + d + 16 * c, _mm512_add_ps(a[c], a[4 + c])); \
        }                                                                                        \
        for (; d < hd; d += 16) {                                                                \
            const __mmask16 m = pd_tail_mask16(hd - d);                                          \
            __m512 o0 = _mm512_maskz_loadu_ps(m, o + d);                                         \
            for (int64_t j = 0; j < nk; j++)                                                     \
                o0 = _mm512_fmadd_ps(_mm512_set1_ps(p[j]), kv_maskload16##SUFFIX(m, v + j * hd + d), o0); \
            _mm512_mask_storeu_ps(o + d, m, o0);                                                 \
        }                                                                                        \
    }

ATTN_KERNELS_512(_f32, float)
ATTN_KERNELS_512(_f16, uint16_t)

/* Masks only for the tail: masked stores are slow on some cores. */
PD_TARGET_AVX512 static void f32_to_f16(const float *x, int64_t n, uint16_t *y) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(y + i),
                            _mm512_cvtps_ph(_mm512_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    if (i < n) {
        const __mmask16 m = pd_tail_mask16(n - i);
        const __m256i h =
            _mm512_cvtps_ph(_mm512_maskz_loadu_ps(m, x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        _mm256_mask_storeu_epi16(y + i, m, h);
    }
}

PD_TARGET_AVX512 static void f16_to_f32(const uint16_t *x, int64_t n, float *y) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, kv_load16_f16(x + i));
    if (i < n) {
        const __mmask16 m = pd_tail_mask16(n - i);
        _mm512_mask_storeu_ps(y + i, m, kv_maskload16_f16(m, x + i));
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
    k->mm[PD_TYPE_Q4_0] = mm_q4_0;
    k->mm[PD_TYPE_Q4_K] = mm_q4_K;
    k->mm[PD_TYPE_Q6_K] = mm_q6_K;
    k->decode_far[PD_TYPE_Q4_K] = k->decode_far[PD_TYPE_Q6_K] = true;
    k->quant_act[PD_TYPE_Q4_K] = cpu_quant_q8_K4_avx512;
    k->quant_act[PD_TYPE_Q4_0] = cpu_quant_q8_0_q4_avx512;
    k->mm[PD_TYPE_F32] = mm_f32;
    k->mm[PD_TYPE_F16] = mm_f16;
    k->mm[PD_TYPE_BF16] = mm_bf16;
    k->swiglu = swiglu;
    k->softmax_exp = softmax_exp;
    k->dot_f32 = dot_f32;
    k->axpy_f32 = axpy_f32;
    k->scale_f32 = scale_f32;
    k->scale_mul = scale_mul;
    k->attn_scores = attn_scores_f32;
    k->attn_pv = attn_pv_f32;
    k->attn_scores_f16 = attn_scores_f16;
    k->attn_pv_f16 = attn_pv_f16;
    k->f32_to_f16 = f32_to_f16;
    k->f16_to_f32 = f16_to_f32;
    cpu_kernels_kq_avx512(k);
    cpu_kernels_x16_avx512(k);
    cpu_q32_kernels_avx512(k);
}

#endif /* PD_X86 */
