/* AVX-512 VNNI kernels for weights packed 16 rows at a time (x16.c has the
 * layout): each 32-bit lane of a register belongs to one of 16 rows, so a
 * vpdpbusd of 4 codes of every row against 4 activation bytes broadcast to
 * all lanes adds to 16 row sums at once. Nothing is reduced across lanes:
 * the 16 results of a group leave in one store. Against one row at a time
 * (simd_avx512.c's q4_K_row) this drops the packs, the per-block scale
 * permutes and the horizontal sums, and the activations come from 4-byte
 * broadcasts folded into vpdpbusd instead of 64-byte loads: about half the
 * instructions per weight byte, which is what lets decode run at the
 * memory's speed rather than the core's.
 *
 * q4_K (activations in cpu_quant_q8_K4_avx512's order and sums). A code
 * register holds, per row, 4 bytes of qs: 4 elements of sub-block 2p in
 * the low nibbles and the matching 4 of sub-block 2p + 1 in the high ones.
 * The high nibbles are multiplied in place (codes times 16), so one AND
 * unpacks each half; the low half's scale is taken times 16 to match and
 * the block's sum carries a factor 16 that the float scale removes. The
 * 4-byte sums per sub-block stay below 32 * 15 * 16 * 128 in magnitude and
 * a block's total below 2^29. */
#include "kernels/cpu/cpu_internal.h"

#if PD_X86
#include <immintrin.h>

#include "kernels/cpu/simd_x86.h"

/* At most this many tokens share a pass over a group's codes (q4_K: two
 * sums per token and sub-block pair, a block sum and an accumulator, 4 x 4
 * registers beside the codes and scales; q6_K: four sums, 4 x 6). */
#define X16_NT 4

/* Each code line in use asks for the line 4 KiB ahead into L1 and the one
 * 16 KiB ahead into L2. With one distance only, 8 KiB did best, and the
 * pair gave 1.1x the decode speed of that on the Llama-3.2-1B Q4_K shape
 * at 1 and 2 threads (prefix-bench, three interleaved rounds of five
 * settings; 12-24 KiB for the far one were within the noise). */
PD_TARGET_AVX512 static inline void x16_prefetch(const uint8_t *p) {
    _mm_prefetch((const char *)p + 4096, _MM_HINT_T0);
    _mm_prefetch((const char *)p + 16384, _MM_HINT_T1);
}

/* The 4 bytes at p in all 16 lanes, as one broadcast load (vpbroadcastd
 * from memory). A copy through a general register (memcpy to an int, then
 * set1) costs a load and a register move apiece; with the 68 of those per
 * q4_K block, decode from memory ran at 18 GB/s on one Zen 4 core, with
 * broadcast loads at 26.5 GB/s, as fast as the same loop with the products
 * left out (kernel-bench --cold, the q4_K x16 kernel on 2048x8192). For
 * q8_0, packed at load, it took SmolLM2-135M decode at 1 thread from 182
 * to 212 tokens/s (prefix-bench, 5 interleaved rounds). */
PD_TARGET_AVX512 static inline __m512i bcast4(const void *p) {
    return _mm512_broadcastd_epi32(_mm_loadu_si32(p));
}

/* Where sub-block s's 32 activations sit in a q8_K4 block (sub-blocks 1
 * and 2, 5 and 6 swapped). */
static inline int q8k4_pos(int s) { return 32 * ((s & 4) | (s & 1) << 1 | (s >> 1 & 1)); }

/* vpshufb controls, given for dword 0 of a 128-bit lane and moved to each
 * dword j by adding 4j to every byte (vpshufb indexes within the lane; an
 * index byte with the top bit set gives 0 either way): byte k of each
 * dword zero-extended to the dword, or bytes k and k + 1 to its words. */
PD_TARGET_AVX512 static inline __m512i dword_bytes(unsigned ctrl) {
    return _mm512_add_epi32(_mm512_set1_epi32((int)ctrl),
                            _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0x04040404, 0x08080808, 0x0c0c0c0c)));
}
PD_TARGET_AVX512 static inline __m512i byte_pick(int k) { return dword_bytes(0x80808000u | (unsigned)k); }
PD_TARGET_AVX512 static inline __m512i word_pair_pick(int k) {
    return dword_bytes(0x80008000u | (unsigned)k | ((unsigned)(k + 1) << 16));
}

/* Block b of one group (blk: its 16 rows' codes) into acc, for tokens
 * [t0, t0 + nt). */
PD_TARGET_AVX512 static inline __attribute__((always_inline)) void
q4_K_x16_block(const cpu_qact *q, const uint8_t *blk, int64_t b, int64_t t0, const int nt, __m512 *acc) {
    const int64_t nb = q->nblocks;
    const __m512i lo4 = _mm512_set1_epi8(0x0f), hi4 = _mm512_set1_epi8((char)0xf0);
    const __m512i m6 = _mm512_set1_epi8(0x3f), m2h = _mm512_set1_epi8(0x30);
    const __m512i dd = _mm512_loadu_si512((const void *)blk);
    const __m512i s0 = _mm512_loadu_si512((const void *)(blk + 64));
    const __m512i s1 = _mm512_loadu_si512((const void *)(blk + 128));
    const __m512i s2 = _mm512_loadu_si512((const void *)(blk + 192));
    /* scales 0-3 and 4-7, mins 0-3 and 4-7, a byte each per row */
    const __m512i sc03 = _mm512_and_si512(s0, m6);
    const __m512i sc47 = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi32(s0, 2), m2h), s2, lo4, 0xf8);
    const __m512i mn03 = _mm512_and_si512(s1, m6);
    const __m512i mn47 = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi32(s1, 2), m2h),
                                                   _mm512_srli_epi32(s2, 4), lo4, 0xf8);
    const int8_t *xb[X16_NT];
    __m512i isum[X16_NT];
PD_UNROLL
    for (int t = 0; t < nt; t++) {
        xb[t] = q->qs + (t0 + t) * q->cols + PD_QK_K * b;
        isum[t] = _mm512_setzero_si512();
    }
PD_UNROLL
    for (int p = 0; p < 4; p++) {
        const __m512i sv = p < 2 ? sc03 : sc47;
        const __m512i sc_lo = _mm512_slli_epi32(_mm512_shuffle_epi8(sv, byte_pick(2 * (p & 1))), 4);
        const __m512i sc_hi = _mm512_shuffle_epi8(sv, byte_pick(2 * (p & 1) + 1));
        const int olo = q8k4_pos(2 * p), ohi = q8k4_pos(2 * p + 1);
        __m512i alo[X16_NT], ahi[X16_NT];
PD_UNROLL
        for (int t = 0; t < nt; t++) alo[t] = ahi[t] = _mm512_setzero_si512();
PD_UNROLL
        for (int k = 0; k < 8; k++) {
            const uint8_t *cp = blk + 64 * (4 + 8 * p + k);
            x16_prefetch(cp);
            const __m512i r = _mm512_loadu_si512((const void *)cp);
            const __m512i cl = _mm512_and_si512(r, lo4), ch = _mm512_and_si512(r, hi4);
PD_UNROLL
            for (int t = 0; t < nt; t++) {
                alo[t] = _mm512_dpbusd_epi32(alo[t], cl, bcast4(xb[t] + olo + 4 * k));
                ahi[t] = _mm512_dpbusd_epi32(ahi[t], ch, bcast4(xb[t] + ohi + 4 * k));
            }
        }
PD_UNROLL
        for (int t = 0; t < nt; t++)
            isum[t] = _mm512_add_epi32(isum[t], _mm512_add_epi32(_mm512_mullo_epi32(alo[t], sc_lo),
                                                                 _mm512_mullo_epi32(ahi[t], sc_hi)));
    }
    /* d and dmin of the 16 rows */
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dd));
    const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dd, 16)));
    __m512i mw[4]; /* mins 2c and 2c + 1 as the two words of each lane */
PD_UNROLL
    for (int c = 0; c < 4; c++) mw[c] = _mm512_shuffle_epi8(c < 2 ? mn03 : mn47, word_pair_pick(2 * (c & 1)));
PD_UNROLL
    for (int t = 0; t < nt; t++) {
        const int16_t *bs = q->bsums + (t0 + t) * (q->cols / 16) + 16 * (b & ~(int64_t)1) + 8 * (b & 1);
        __m512i ms = _mm512_setzero_si512();
PD_UNROLL
        for (int c = 0; c < 4; c++) {
            ms = _mm512_dpwssd_epi32(ms, mw[c], bcast4(bs + 2 * c));
        }
        const float xd = q->d[(t0 + t) * nb + b];
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_mul_ps(d, _mm512_set1_ps(xd * 0.0625f)), acc[t]);
        acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ms), _mm512_mul_ps(dmin, _mm512_set1_ps(xd)), acc[t]);
    }
}

/* q6_K (natural q8_K activations). Word k < 8 of a half h holds low
 * nibbles of elements 128h + 4k.. (low) and 128h + 64 + 4k.. (high), word
 * 8 + k those of 128h + 32 + 4k.. and 128h + 96 + 4k..; high-bit word k of
 * the half has their top two bits at bits 0, 2, 4, 6. Each code (0..63,
 * stored + 32) is put together with one AND and one ternary-logic merge
 * (plus the shifts), and the four runs of a word go to four sums, one per
 * 16-element sub-block. The + 32 comes off as 32 * sum(scale * bsum), word
 * pairs of scales against pairs of sums in vpdpwssd. */

PD_TARGET_AVX512 static inline __attribute__((always_inline)) void
q6_K_x16_block(const cpu_qact *q, const uint8_t *blk, int64_t b, int64_t t0, const int nt, __m512 *acc) {
    const int64_t nb = q->nblocks;
    const __m512i lo4 = _mm512_set1_epi8(0x0f), b45 = _mm512_set1_epi8(0x30);
    const int8_t *xb[X16_NT];
    __m512i isum[X16_NT];
PD_UNROLL
    for (int t = 0; t < nt; t++) {
        xb[t] = q->qs + (t0 + t) * q->cols + PD_QK_K * b;
        isum[t] = _mm512_setzero_si512();
    }
    /* scales 2i and 2i + 1 as sign-extended words of each lane */
    __m512i sp[8];
PD_UNROLL
    for (int i = 0; i < 8; i++) {
        const __m512i sw = _mm512_loadu_si512((const void *)(blk + 64 * (48 + i / 2)));
        const unsigned k = 2u * (unsigned)(i & 1);
        sp[i] = _mm512_srai_epi16(_mm512_shuffle_epi8(sw, dword_bytes(0x00800080u | k << 8 | (k + 1) << 24)), 8);
    }
PD_UNROLL
    for (int h = 0; h < 2; h++) {
PD_UNROLL
        for (int kk = 0; kk < 2; kk++) {
            __m512i a[4][X16_NT];
PD_UNROLL
            for (int j = 0; j < 4; j++)
PD_UNROLL
                for (int t = 0; t < nt; t++) a[j][t] = _mm512_setzero_si512();
PD_UNROLL
            for (int k = 4 * kk; k < 4 * kk + 4; k++) {
                const uint8_t *la = blk + 64 * (16 * h + k), *lb = la + 64 * 8, *hp = blk + 64 * (32 + 8 * h + k);
                x16_prefetch(la);
                x16_prefetch(lb);
                x16_prefetch(hp);
                const __m512i ra = _mm512_loadu_si512((const void *)la), rb = _mm512_loadu_si512((const void *)lb);
                const __m512i rh = _mm512_loadu_si512((const void *)hp);
                __m512i c[4]; /* A | (B & C): 0xf8 */
                c[0] = _mm512_ternarylogic_epi32(_mm512_and_si512(ra, lo4), _mm512_slli_epi32(rh, 4), b45, 0xf8);
                c[1] = _mm512_ternarylogic_epi32(_mm512_and_si512(rb, lo4), _mm512_slli_epi32(rh, 2), b45, 0xf8);
                c[2] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi32(ra, 4), lo4), rh, b45, 0xf8);
                c[3] = _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi32(rb, 4), lo4),
                                                 _mm512_srli_epi32(rh, 2), b45, 0xf8);
PD_UNROLL
                for (int j = 0; j < 4; j++)
PD_UNROLL
                    for (int t = 0; t < nt; t++)
                        a[j][t] = _mm512_dpbusd_epi32(a[j][t], c[j], bcast4(xb[t] + 128 * h + 32 * j + 4 * k));
            }
PD_UNROLL
            for (int j = 0; j < 4; j++) {
                const int s = 8 * h + 2 * j + kk; /* the sub-block of 16 */
                const __m512i sc = s & 1 ? _mm512_srai_epi32(sp[s / 2], 16)
                                         : _mm512_srai_epi32(_mm512_slli_epi32(sp[s / 2], 16), 16);
PD_UNROLL
                for (int t = 0; t < nt; t++) isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(a[j][t], sc));
            }
        }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(blk + 64 * 52)));
PD_UNROLL
    for (int t = 0; t < nt; t++) {
        const int16_t *bs = q->bsums + (t0 + t) * (q->cols / 16) + 16 * b;
        __m512i corr = _mm512_setzero_si512();
PD_UNROLL
        for (int i = 0; i < 8; i++) {
            corr = _mm512_dpwssd_epi32(corr, sp[i], bcast4(bs + 2 * i));
        }
        const __m512i si = _mm512_sub_epi32(isum[t], _mm512_slli_epi32(corr, 5));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(si), _mm512_mul_ps(d, _mm512_set1_ps(q->d[(t0 + t) * nb + b])),
                                 acc[t]);
    }
}

/* q8_0 (q8_0 activations): the codes flipped to unsigned bytes (w + 128)
 * for vpdpbusd, each block's sum starting at c = -128 * sum(x), as in the
 * row kernel; one float scale step per block of 32. */
PD_TARGET_AVX512 static inline __attribute__((always_inline)) void
q8_0_x16_block(const cpu_qact *q, const uint8_t *blk, int64_t b, int64_t t0, const int nt, __m512 *acc) {
    const int64_t nb = q->nblocks;
    const __m512i x80 = _mm512_set1_epi8((char)0x80);
    x16_prefetch(blk);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)blk));
    __m512i s[X16_NT];
PD_UNROLL
    for (int t = 0; t < nt; t++) s[t] = bcast4(q->c + (t0 + t) * nb + b);
PD_UNROLL
    for (int k = 0; k < 8; k++) {
        const uint8_t *cp = blk + 2 * CPU_X16 + 64 * k;
        x16_prefetch(cp + 32);
        const __m512i r = _mm512_xor_si512(_mm512_loadu_si512((const void *)cp), x80);
PD_UNROLL
        for (int t = 0; t < nt; t++) s[t] = _mm512_dpbusd_epi32(s[t], r, bcast4(q->qs + (t0 + t) * q->cols + 32 * b + 4 * k));
    }
PD_UNROLL
    for (int t = 0; t < nt; t++)
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[t]), _mm512_mul_ps(d, _mm512_set1_ps(q->d[(t0 + t) * nb + b])),
                                 acc[t]);
}

/* NAME(m, g, h, ng, t0, nt): groups g, g + h, ... (ng of them, 1 or 4)
 * for tokens [t0, t0 + nt), a block of each in turn, with BLOCK the
 * type's step over one block of one group (BYTES a row's block). Four
 * groups far apart put four streams of the matrix in flight where one
 * group has one (as q4_K_rows4 in simd_avx512.c: one core reads memory
 * faster from several far-apart streams than from one); each group's
 * steps, and so its bits, are the same either way. */
#define X16_KERNEL(NAME, BLOCK, BYTES)                                                                  \
    PD_TARGET_AVX512 static inline __attribute__((always_inline)) void NAME(                            \
        const cpu_mm *m, int64_t g, int64_t h, const int ng, int64_t t0, const int nt) {                \
        const size_t gs = (size_t)h * CPU_X16 * m->rb;                                                  \
        const uint8_t *w = m->w + (size_t)g * CPU_X16 * m->rb;                                          \
        __m512 acc[4][X16_NT];                                                                          \
        PD_UNROLL                                                                                       \
        for (int i = 0; i < ng; i++)                                                                    \
            PD_UNROLL                                                                                   \
            for (int t = 0; t < nt; t++) acc[i][t] = _mm512_setzero_ps();                               \
        for (int64_t b = 0; b < m->q->nblocks; b++)                                                     \
            PD_UNROLL                                                                                   \
            for (int i = 0; i < ng; i++)                                                                \
                BLOCK(m->q, w + (size_t)i * gs + (size_t)b * CPU_X16 * (BYTES), b, t0, nt, acc[i]);     \
        PD_UNROLL                                                                                       \
        for (int i = 0; i < ng; i++)                                                                    \
            PD_UNROLL                                                                                   \
            for (int t = 0; t < nt; t++)                                                                \
                _mm512_storeu_ps(m->y + (t0 + t) * m->ldy + (g + i * h) * CPU_X16, acc[i][t]);          \
    }

X16_KERNEL(q4_K_x16, q4_K_x16_block, CPU_Q4_K_BYTES)
X16_KERNEL(q6_K_x16, q6_K_x16_block, CPU_Q6_K_BYTES)
X16_KERNEL(q8_0_x16, q8_0_x16_block, CPU_Q8_0_BYTES)

/* Groups [g0, g1) for every token, X16_NT tokens per pass; prefill takes
 * CPU_X16_BATCH_GROUPS at a time so their codes stay in L2 across the
 * passes. */
#define X16_GROUPS(KERNEL, m, g0, g1)                                                           \
    for (int64_t ga = (g0); ga < (g1); ga += CPU_X16_BATCH_GROUPS) {                            \
        const int64_t gz = ga + CPU_X16_BATCH_GROUPS < (g1) ? ga + CPU_X16_BATCH_GROUPS : (g1); \
        for (int64_t t0 = 0; t0 < (m)->n; t0 += X16_NT) {                                       \
            const int64_t nt = (m)->n - t0 < X16_NT ? (m)->n - t0 : X16_NT;                     \
            switch (nt) {                                                                       \
            case 1: for (int64_t g = ga; g < gz; g++) KERNEL(m, g, 0, 1, t0, 1); break;         \
            case 2: for (int64_t g = ga; g < gz; g++) KERNEL(m, g, 0, 1, t0, 2); break;         \
            case 3: for (int64_t g = ga; g < gz; g++) KERNEL(m, g, 0, 1, t0, 3); break;         \
            default: for (int64_t g = ga; g < gz; g++) KERNEL(m, g, 0, 1, t0, 4); break;        \
            }                                                                                   \
        }                                                                                       \
    }

/* Decode of one or two tokens with cpu_mm.far set: groups [g0, g1) and
 * the groups far, 2 far and 3 far rows after them, a block of each in
 * turn. */
#define X16_DECODE(KERNEL, m, g0, g1)                                                           \
    do {                                                                                        \
        const int64_t h = (m)->far / CPU_X16;                                                   \
        for (int64_t g = (g0); g < (g1); g++) {                                                 \
            if ((m)->n == 1) KERNEL(m, g, h, 4, 0, 1);                                          \
            else KERNEL(m, g, h, 4, 0, 2);                                                      \
        }                                                                                       \
    } while (0)

/* Rows [r0, r1) of a packed (or repacked) weight, both multiples of 16. */
PD_TARGET_AVX512 static void mm_q4_K_x16(const cpu_mm *m, int64_t r0, int64_t r1) {
    X16_GROUPS(q4_K_x16, m, r0 / CPU_X16, r1 / CPU_X16)
}

PD_TARGET_AVX512 static void mm_q6_K_x16(const cpu_mm *m, int64_t r0, int64_t r1) {
    X16_GROUPS(q6_K_x16, m, r0 / CPU_X16, r1 / CPU_X16)
}

PD_TARGET_AVX512 static void mm_q8_0_x16(const cpu_mm *m, int64_t r0, int64_t r1) {
    if (m->far) X16_DECODE(q8_0_x16, m, r0 / CPU_X16, r1 / CPU_X16);
    else X16_GROUPS(q8_0_x16, m, r0 / CPU_X16, r1 / CPU_X16)
}

/* cpu_kernels.x16_repack for the types repacked per call (blocks with no
 * head: whole words, then a 2-byte tail for q6_K): each 64-byte line is
 * one gather of a word of the 16 rows, a few times faster than word
 * copies, so a prefill batch of 16 tokens pays little for it. */
PD_TARGET_AVX512 static void x16_repack(pd_type t, const uint8_t *src, int64_t groups, size_t rb, uint8_t *dst) {
    const size_t bb = pd_type_get((uint32_t)t)->type_size, words = bb / 4, nb = rb / bb;
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32((int)rb));
    for (int64_t g = 0; g < groups; g++)
        for (size_t b = 0; b < nb; b++) {
            const uint8_t *in = src + (size_t)g * CPU_X16 * rb + b * bb;
            uint8_t *out = dst + ((size_t)g * nb + b) * CPU_X16 * bb;
            for (size_t k = 0; k < words; k++)
                _mm512_storeu_si512((void *)(out + 64 * k), _mm512_i32gather_epi32(idx, (const void *)(in + 4 * k), 1));
            if (bb % 4) { /* the last 2 bytes: the high half of the block's last word-sized load */
                const __m512i v = _mm512_i32gather_epi32(idx, (const void *)(in + bb - 4), 1);
                _mm256_storeu_si256((__m256i *)(void *)(out + 64 * words), _mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
            }
        }
}

void cpu_kernels_x16_avx512(cpu_kernels *k) {
    k->mm_x16[PD_TYPE_Q8_0] = mm_q8_0_x16;
    k->mm_x16[PD_TYPE_Q4_K] = mm_q4_K_x16;
    k->mm_x16[PD_TYPE_Q6_K] = mm_q6_K_x16;
    /* From memory the q8_0 x16 kernel reads about as fast as its row
     * kernel in decode and faster at 2 threads; the K-quant ones read
     * 18-36% slower than theirs (kernel-bench --cold, docs/bench-peer.md),
     * so K-quants are only repacked for prefill batches. */
    k->x16_at_load[PD_TYPE_Q8_0] = true;
    k->x16_decode_far[PD_TYPE_Q8_0] = true; /* for one or two tokens (X16_DECODE); the K-quant
                                             * blocks over four groups ran at half the speed */
    k->x16_repack = x16_repack;
}

#endif /* PD_X86 */
