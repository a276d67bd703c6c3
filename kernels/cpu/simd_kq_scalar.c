/* Portable C matmul kernels for q2_K, q3_K, q5_K and iq4_xs weights against
 * q8_K activations (layouts: quant_kq.c): the reference the SIMD tables are
 * tested against. Per super-block the integer dot products are exact and
 * the same at every level:
 *
 *   q2_K:   sum_j sc_j * dot(q_j, x_j), minus dmin * sum_j m_j * bsum_j
 *   q3_K:   sum_j s_j * (dot(q_j + 4, x_j) - 4 * bsum_j), codes stored + 4
 *   q5_K:   as q4_K: sum_j sc_j * dot(q_j, x_j), minus the mins by bsums
 *   iq4_xs: sum_j s_j * dot(value(q_j), x_j)
 *
 * (j runs over sub-blocks, bsum_j = sum of x over sub-block j, from the
 * q8_K bsums), then scaled by the fp16 super-block scales and the
 * activation scale in float. */
#include "kernels/cpu/cpu_internal.h"

static float dot_q2_K(const uint8_t *w, const int8_t *qs, const float *d, const int16_t *bsums, int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += CPU_Q2_K_BYTES, qs += PD_QK_K, bsums += 16) {
        const float dd = pd_fp16_to_fp32(cpu_load_u16(w + 80));
        const float dmin = pd_fp16_to_fp32(cpu_load_u16(w + 82));
        int32_t sumi = 0, summ = 0;
        for (int j = 0; j < 16; j++) {
            const int h = j / 8, shift = 2 * ((j / 2) % 4);
            const uint8_t *q = w + 16 + 32 * h + 16 * (j % 2);
            int32_t s = 0;
            for (int l = 0; l < 16; l++) s += (int32_t)((q[l] >> shift) & 3u) * qs[16 * j + l];
            sumi += (int32_t)(w[j] & 0x0fu) * s;
            summ += (int32_t)(w[j] >> 4) * bsums[j];
        }
        acc += d[b] * (dd * (float)sumi - dmin * (float)summ);
    }
    return acc;
}

static float dot_q3_K(const uint8_t *w, const int8_t *qs, const float *d, const int16_t *bsums, int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += CPU_Q3_K_BYTES, qs += PD_QK_K, bsums += 16) {
        const float dd = pd_fp16_to_fp32(cpu_load_u16(w + 108));
        int8_t sc[16];
        cpu_q3k_scales(w + 96, sc);
        int32_t sumi = 0;
        for (int j = 0; j < 16; j++) {
            const int h = j / 8, k = (j / 2) % 4; /* 2-bit field k of half h */
            const uint8_t *q = w + 32 + 32 * h + 16 * (j % 2);
            const uint8_t *hm = w + 16 * (j % 2);
            int32_t s = 0;
            for (int l = 0; l < 16; l++) {
                const int u = (int)((q[l] >> (2 * k)) & 3u) | (int)(((hm[l] >> (4 * h + k)) & 1u) << 2);
                s += u * qs[16 * j + l];
            }
            sumi += sc[j] * (s - 4 * bsums[j]);
        }
        acc += d[b] * dd * (float)sumi;
    }
    return acc;
}

static float dot_q5_K(const uint8_t *w, const int8_t *qs, const float *d, const int16_t *bsums, int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += CPU_Q5_K_BYTES, qs += PD_QK_K, bsums += 16) {
        const float dd = pd_fp16_to_fp32(cpu_load_u16(w));
        const float dmin = pd_fp16_to_fp32(cpu_load_u16(w + 2));
        const uint8_t *qh = w + 16, *ql = w + 48;
        int32_t sumi = 0, summ = 0;
        for (int c = 0; c < 4; c++, ql += 32) {
            uint8_t sc0, m0, sc1, m1;
            cpu_q4k_scale_min(2 * c, w + 4, &sc0, &m0);
            cpu_q4k_scale_min(2 * c + 1, w + 4, &sc1, &m1);
            int32_t s0 = 0, s1 = 0;
            for (int l = 0; l < 32; l++) {
                const int q0 = (int)(ql[l] & 0x0fu) | (int)(((qh[l] >> (2 * c)) & 1u) << 4);
                const int q1 = (int)(ql[l] >> 4) | (int)(((qh[l] >> (2 * c + 1)) & 1u) << 4);
                s0 += q0 * qs[64 * c + l];
                s1 += q1 * qs[64 * c + 32 + l];
            }
            sumi += sc0 * s0 + sc1 * s1;
            summ += m0 * (bsums[4 * c] + bsums[4 * c + 1]) + m1 * (bsums[4 * c + 2] + bsums[4 * c + 3]);
        }
        acc += d[b] * (dd * (float)sumi - dmin * (float)summ);
    }
    return acc;
}

static float dot_iq4_xs(const uint8_t *w, const int8_t *qs, const float *d, const int16_t *bsums, int64_t nb) {
    (void)bsums;
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += CPU_IQ4_XS_BYTES, qs += PD_QK_K) {
        const float dd = pd_fp16_to_fp32(cpu_load_u16(w));
        const unsigned sh = cpu_load_u16(w + 2);
        int32_t sumi = 0;
        for (int j = 0; j < 8; j++) {
            const int ls = (int)(((w[4 + j / 2] >> (4 * (j % 2))) & 0x0fu) | (((sh >> (2 * j)) & 3u) << 4)) - 32;
            const uint8_t *q = w + 8 + 16 * j;
            int32_t s = 0;
            for (int l = 0; l < 16; l++) {
                s += cpu_iq4nl_values[q[l] & 0x0fu] * qs[32 * j + l];
                s += cpu_iq4nl_values[q[l] >> 4] * qs[32 * j + 16 + l];
            }
            sumi += ls * s;
        }
        acc += d[b] * dd * (float)sumi;
    }
    return acc;
}

#define MM_KQ(NAME, DOT)                                                                                     \
    static void NAME(const cpu_mm *m, int64_t r0, int64_t r1) {                                              \
        const cpu_qact *q = m->q;                                                                            \
        for (int64_t r = r0; r < r1; r++)                                                                    \
            for (int64_t t = 0; t < m->n; t++)                                                               \
                m->y[t * m->ldy + r] = DOT(m->w + (size_t)r * m->rb, q->qs + t * q->cols,                    \
                                           q->d + t * q->nblocks, q->bsums + t * (q->cols / 16), q->nblocks); \
    }
MM_KQ(mm_q2_K, dot_q2_K)
MM_KQ(mm_q3_K, dot_q3_K)
MM_KQ(mm_q5_K, dot_q5_K)
MM_KQ(mm_iq4_xs, dot_iq4_xs)

void cpu_kernels_kq_scalar(cpu_kernels *k) {
    k->mm[PD_TYPE_Q2_K] = mm_q2_K;
    k->mm[PD_TYPE_Q3_K] = mm_q3_K;
    k->mm[PD_TYPE_Q5_K] = mm_q5_K;
    k->mm[PD_TYPE_IQ4_XS] = mm_iq4_xs;
}
