/* Private x86 helpers shared by the AVX2 and AVX-512 kernel files. Every
 * helper carries the target attribute of the narrowest set it needs, so it
 * inlines into AVX2 and AVX-512 callers alike. */
#ifndef PD_KERNELS_CPU_SIMD_X86_H
#define PD_KERNELS_CPU_SIMD_X86_H

#include <immintrin.h>

#include "kernels/cpu/cpu_internal.h"

/* Little-endian 16/32-bit loads from unaligned bytes (x86 is little-endian;
 * memcpy compiles to one mov). */
static inline uint16_t pd_ld16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Decode reads each weight once, straight from memory: ask for the rows a
 * later tile will need (rows [r, r + nrows) of stride rb, `bytes` each) so
 * more loads are in flight than the hardware prefetchers start on their
 * own. Only called for rows inside the matrix. */
static inline void pd_prefetch_rows(const uint8_t *p, size_t rb, int nrows, size_t bytes) {
    for (int i = 0; i < nrows; i++)
        for (size_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)(p + (size_t)i * rb + o), _MM_HINT_T0);
}
#define PD_PF_AHEAD 8 /* rows ahead */

/* Row kernels for decode (n <= CPU_DECODE_MAX_N) read one weight row at a
 * time, front to back, for all n tokens per weight load. DECODE_PF: bytes
 * ahead of the block in use that are prefetched, enough to keep a memory
 * stream's worth of loads in flight. */
#define DECODE_PF 4096

static inline void decode_prefetch(const uint8_t *p) {
    _mm_prefetch((const char *)((uintptr_t)p + DECODE_PF), _MM_HINT_T0);
}

/* ROW(m, r, t0, NT) for rows [ra, rz) and tokens [t0, t0 + nt), nt <= 8,
 * with NT a constant so the kernels' per-token loops unroll into
 * registers. */
#define ROW_RANGE(ROW, m, ra, rz, t0, nt)                                                        \
    switch (nt) {                                                                                \
    case 1: for (int64_t r = (ra); r < (rz); r++) ROW(m, r, t0, 1); break;                       \
    case 2: for (int64_t r = (ra); r < (rz); r++) ROW(m, r, t0, 2); break;                       \
    case 3: for (int64_t r = (ra); r < (rz); r++) ROW(m, r, t0, 3); break;                       \
    case 4: for (int64_t r = (ra); r < (rz); r++) ROW(m, r, t0, 4); break;                       \
    case 5: for (int64_t r = (ra); r < (rz); r++) ROW(m, r, t0, 5); break;                       \
    case 6: for (int64_t r = (ra); r < (rz); r++) ROW(m, r, t0, 6); break;                       \
    case 7: for (int64_t r = (ra); r < (rz); r++) ROW(m, r, t0, 7); break;                       \
    default: for (int64_t r = (ra); r < (rz); r++) ROW(m, r, t0, 8); break;                      \
    }

/* Prefill with a row kernel: rows in groups that stay in L2 while every
 * block of 8 tokens passes over them. */
#define PREFILL_ROWS 64
#define ROW_KERNEL_ALL_N(ROW, m, r0, r1)                                                         \
    for (int64_t ra = (r0); ra < (r1); ra += PREFILL_ROWS) {                                     \
        const int64_t rz = ra + PREFILL_ROWS < (r1) ? ra + PREFILL_ROWS : (r1);                  \
        for (int64_t t0 = 0; t0 < (m)->n; t0 += CPU_DECODE_MAX_N) {                             \
            const int64_t nt = (m)->n - t0 < CPU_DECODE_MAX_N ? (m)->n - t0 : CPU_DECODE_MAX_N;  \
            ROW_RANGE(ROW, m, ra, rz, t0, nt)                                                    \
        }                                                                                        \
    }

PD_TARGET_AVX2 static inline int32_t pd_hsum_epi32_sse(__m128i v) {
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 0, 3, 2)));
    v = _mm_add_epi32(v, _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(v);
}

PD_TARGET_AVX2 static inline int32_t pd_hsum_epi32_avx2(__m256i v) {
    return pd_hsum_epi32_sse(_mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}

PD_TARGET_AVX2 static inline float pd_hsum_ps_sse(__m128 v) {
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    return _mm_cvtss_f32(v);
}

PD_TARGET_AVX2 static inline float pd_hsum_ps_avx2(__m256 v) {
    return pd_hsum_ps_sse(_mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)));
}

PD_TARGET_AVX2 static inline float pd_hmax_ps_avx2(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* Horizontal sums of four vectors at once: lane i of the result is the
 * sum of the i-th argument. */
PD_TARGET_AVX2 static inline __m128 pd_reduce4_ps_avx2(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 ab = _mm256_hadd_ps(a, b); /* a01 a23 b01 b23 | a45 a67 b45 b67 */
    const __m256 cd = _mm256_hadd_ps(c, d);
    const __m256 s = _mm256_hadd_ps(ab, cd); /* a0-3 b0-3 c0-3 d0-3 | a4-7 ... */
    return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

PD_TARGET_AVX512 static inline __m128 pd_reduce4_ps_avx512(__m512 a, __m512 b, __m512 c, __m512 d) {
    /* per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3) */
    const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
    /* per 128-bit lane: (a, b, c, d) partial sums */
    const __m512 s = _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

/* The sum of one register in pd_reduce4_ps_avx512's order (pairs 2 apart in
 * each 128-bit lane, then the two pair sums, then lanes 0+2 and 1+3), so a
 * row reduced alone has the bits it has when reduced with three others. */
PD_TARGET_AVX512 static inline float pd_hsum_ps_avx512(__m512 a) {
    const __m512 p = _mm512_add_ps(a, _mm512_permute_ps(a, _MM_SHUFFLE(1, 0, 3, 2)));
    const __m512 s = _mm512_add_ps(p, _mm512_permute_ps(p, _MM_SHUFFLE(2, 3, 0, 1)));
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
    return _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

/* Lane mask for the first `rem` (capped at 8) of 8 lanes, for maskload. */
PD_TARGET_AVX2 static inline __m256i pd_tail_mask8(int64_t rem) {
    const int r = rem > 8 ? 8 : (int)rem;
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(r), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

PD_TARGET_AVX512 static inline __mmask16 pd_tail_mask16(int64_t rem) {
    return rem >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << rem) - 1u);
}

/* exp(x) for float lanes, Cephes-style: x = n*ln2 + r, degree-6 polynomial
 * for exp(r), 2^n through the exponent bits. Relative error about 2e-7.
 * Inputs below -87 give exactly 0 (so -INFINITY gives 0); inputs above 88
 * are clamped to 88 (no infinities). */
#define PD_EXP_LO (-87.0f)
#define PD_EXP_HI 88.0f
#define PD_EXP_P0 1.9875691500E-4f
#define PD_EXP_P1 1.3981999507E-3f
#define PD_EXP_P2 8.3334519073E-3f
#define PD_EXP_P3 4.1665795894E-2f
#define PD_EXP_P4 1.6666665459E-1f
#define PD_EXP_P5 5.0000001201E-1f

PD_TARGET_AVX2 static inline __m256 pd_exp_ps_avx2(__m256 x) {
    const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(PD_EXP_LO), _CMP_LT_OQ);
    x = _mm256_min_ps(x, _mm256_set1_ps(PD_EXP_HI));
    x = _mm256_max_ps(x, _mm256_set1_ps(PD_EXP_LO));
    const __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(PD_EXP_P0);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(PD_EXP_P1));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(PD_EXP_P2));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(PD_EXP_P3));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(PD_EXP_P4));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(PD_EXP_P5));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(under, y);
}

PD_TARGET_AVX512 static inline __m512 pd_exp_ps_avx512(__m512 x) {
    const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(PD_EXP_LO), _CMP_LT_OQ);
    x = _mm512_min_ps(x, _mm512_set1_ps(PD_EXP_HI));
    x = _mm512_max_ps(x, _mm512_set1_ps(PD_EXP_LO));
    const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(PD_EXP_P0);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(PD_EXP_P1));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(PD_EXP_P2));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(PD_EXP_P3));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(PD_EXP_P4));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(PD_EXP_P5));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
    y = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
    return _mm512_maskz_mov_ps((__mmask16)~under, y);
}

/* The 8 six-bit scales (bytes 0..7) and mins (bytes 8..15) of a q4_K (or
 * q5_K) block, computed in a register (12 bytes read as 16: the codes
 * follow). */
PD_TARGET_AVX2 static inline __m128i q4k_scales_mins(const uint8_t *s) {
    const __m128i u = _mm_loadu_si128((const __m128i *)(const void *)s); /* words u0 u1 u2 */
    const __m128i lo = _mm_and_si128(u, _mm_set1_epi8(0x3f));            /* sc0-3 mn0-3 */
    const __m128i u2 = _mm_shuffle_epi32(u, 0xaa);
    const __m128i hl = _mm_and_si128(_mm_srlv_epi32(u2, _mm_setr_epi32(0, 4, 0, 4)), _mm_set1_epi8(0x0f));
    const __m128i hh = _mm_and_si128(_mm_slli_epi32(_mm_srli_epi32(u, 6), 4), _mm_set1_epi8(0x30));
    return _mm_unpacklo_epi32(lo, _mm_or_si128(hl, hh)); /* sc0-3 sc4-7 mn0-3 mn4-7 */
}

/* The 16 six-bit scales of a q3_K block minus 32, as int8 (cpu_q3k_scales
 * in a register). blk is the block: its 12 scale bytes end 2 bytes before
 * the block does, so they are read as the last 16 bytes of the block. */
PD_TARGET_AVX2 static inline __m128i q3k_scales(const uint8_t *blk) {
    const __m128i v = _mm_srli_si128(_mm_loadu_si128((const __m128i *)(const void *)(blk + 94)), 2);
    const __m128i m4 = _mm_set1_epi8(0x0f);
    /* low 4 bits: bytes 0..7 for scales 0..7, their high nibbles for 8..15 */
    const __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(v, m4), _mm_and_si128(_mm_srli_epi16(v, 4), m4));
    /* high 2 bits: scale j at bit 2*(j/4) of byte 8 + j%4 */
    const __m128i h = _mm_shuffle_epi8(v, _mm_setr_epi8(8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11));
    const __m128i hi = _mm_and_si128(_mm_srlv_epi32(h, _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
    return _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi32(hi, 4)), _mm_set1_epi8(32));
}

/* The 8 six-bit scales of an iq4_xs block minus 32, as int8 in bytes
 * 0..7: the nibbles of scales_l and the bit pairs of scales_h spread to
 * one byte each with shifts and masks. */
PD_TARGET_AVX2 static inline __m128i iq4xs_scales(const uint8_t *blk) {
    uint64_t lo = (uint64_t)blk[4] | (uint64_t)blk[5] << 8 | (uint64_t)blk[6] << 16 | (uint64_t)blk[7] << 24;
    lo = (lo | lo << 16) & 0x0000ffff0000ffffull;
    lo = (lo | lo << 8) & 0x00ff00ff00ff00ffull;
    lo = (lo | lo << 4) & 0x0f0f0f0f0f0f0f0full; /* byte j: nibble j */
    uint64_t hi = pd_ld16(blk + 2);
    hi = (hi | hi << 24) & 0x000000ff000000ffull;
    hi = (hi | hi << 12) & 0x000f000f000f000full;
    hi = (hi | hi << 6) & 0x0303030303030303ull; /* byte j: bits 2j, 2j+1 */
    return _mm_sub_epi8(_mm_cvtsi64_si128((long long)(lo | hi << 4)), _mm_set1_epi8(32));
}

/* 16-bit lanes: `a` in words 0..15, `b` in words 16..31. */
PD_TARGET_AVX512 static inline __m512i halves_epi16(short a, short b) {
    return _mm512_inserti64x4(_mm512_set1_epi16(a), _mm256_set1_epi16(b), 1);
}

#endif
