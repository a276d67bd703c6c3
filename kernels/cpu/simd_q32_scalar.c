/* Portable kernels for q4_1, q5_0, q5_1 and iq4_nl weights (layouts in
 * quant_q32.c) against q8_0 activations: the reference the SIMD levels are
 * tested against. Per block, the integer dot product of the codes with the
 * int8 activations is exact; the offset types add m * sum(x), with
 * sum(x) = -c / 128 from the activation block. */
#include "kernels/cpu/cpu_internal.h"

#define QK 32

/* Element j's 5-bit code from nibbles qs and fifth bits qh. */
static inline int code5(const uint8_t *qs, uint32_t qh, int j) {
    const int nib = j < 16 ? (qs[j] & 0x0f) : (qs[j - 16] >> 4);
    return nib | (int)(((qh >> j) & 1u) << 4);
}

static inline int code4(const uint8_t *qs, int j) {
    return j < 16 ? (qs[j] & 0x0f) : (qs[j - 16] >> 4);
}

static float dot_q4_1(const uint8_t *w, const int8_t *qs, const float *d, const int32_t *c, int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += CPU_Q4_1_BYTES, qs += QK) {
        int32_t s = 0;
        for (int j = 0; j < QK; j++) s += code4(w + 4, j) * qs[j];
        const float dw = pd_fp16_to_fp32(cpu_load_u16(w)), mw = pd_fp16_to_fp32(cpu_load_u16(w + 2));
        acc += dw * d[b] * (float)s + mw * d[b] * (float)(-c[b] / 128);
    }
    return acc;
}

static float dot_q5_1(const uint8_t *w, const int8_t *qs, const float *d, const int32_t *c, int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += CPU_Q5_1_BYTES, qs += QK) {
        const uint32_t qh = cpu_load_u32le(w + 4);
        int32_t s = 0;
        for (int j = 0; j < QK; j++) s += code5(w + 8, qh, j) * qs[j];
        const float dw = pd_fp16_to_fp32(cpu_load_u16(w)), mw = pd_fp16_to_fp32(cpu_load_u16(w + 2));
        acc += dw * d[b] * (float)s + mw * d[b] * (float)(-c[b] / 128);
    }
    return acc;
}

static float dot_q5_0(const uint8_t *w, const int8_t *qs, const float *d, const int32_t *c, int64_t nb) {
    (void)c;
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += CPU_Q5_0_BYTES, qs += QK) {
        const uint32_t qh = cpu_load_u32le(w + 2);
        int32_t s = 0;
        for (int j = 0; j < QK; j++) s += (code5(w + 6, qh, j) - 16) * qs[j];
        acc += pd_fp16_to_fp32(cpu_load_u16(w)) * d[b] * (float)s;
    }
    return acc;
}

static float dot_iq4_nl(const uint8_t *w, const int8_t *qs, const float *d, const int32_t *c, int64_t nb) {
    (void)c;
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += CPU_IQ4_NL_BYTES, qs += QK) {
        int32_t s = 0;
        for (int j = 0; j < QK; j++) s += cpu_iq4nl_values[code4(w + 2, j)] * qs[j];
        acc += pd_fp16_to_fp32(cpu_load_u16(w)) * d[b] * (float)s;
    }
    return acc;
}

#define MM_Q32(NAME, DOT)                                                                        \
    static void NAME(const cpu_mm *m, int64_t r0, int64_t r1) {                                  \
        const cpu_qact *q = m->q;                                                                \
        for (int64_t r = r0; r < r1; r++)                                                        \
            for (int64_t t = 0; t < m->n; t++)                                                   \
                m->y[t * m->ldy + r] = DOT(m->w + (size_t)r * m->rb, q->qs + t * q->cols,        \
                                           q->d + t * q->nblocks, q->c + t * q->nblocks, q->nblocks); \
    }
MM_Q32(mm_q4_1, dot_q4_1)
MM_Q32(mm_q5_0, dot_q5_0)
MM_Q32(mm_q5_1, dot_q5_1)
MM_Q32(mm_iq4_nl, dot_iq4_nl)

void cpu_q32_kernels_scalar(cpu_kernels *k) {
    k->mm[PD_TYPE_Q4_1] = mm_q4_1;
    k->mm[PD_TYPE_Q5_0] = mm_q5_0;
    k->mm[PD_TYPE_Q5_1] = mm_q5_1;
    k->mm[PD_TYPE_IQ4_NL] = mm_iq4_nl;
}
