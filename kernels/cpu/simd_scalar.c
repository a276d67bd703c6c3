/* Portable C kernels: the reference every SIMD table is tested against and
 * the fallback on CPUs without AVX2. Integer dot products are exact; the
 * SIMD versions differ only in the order of float additions. */
#include <math.h>

#include "kernels/cpu/cpu_internal.h"

#define QK8_0 32

/* ------------------------------------------------------------------------
 * activation quantizers
 * ------------------------------------------------------------------------ */

/* Round to nearest even like cvtps2dq; NaN and out-of-range go to -127. */
static inline int8_t quant_one(float v) {
    float r = rintf(v);
    if (!(r >= -127.0f)) r = -127.0f;
    if (r > 127.0f) r = 127.0f;
    return (int8_t)r;
}

void cpu_quant_q8_0_scalar(const float *x, int64_t cols, int8_t *qs, float *d, int32_t *c,
                           int16_t *bsums) {
    (void)bsums;
    for (int64_t b = 0; b < cols / QK8_0; b++, x += QK8_0, qs += QK8_0) {
        float amax = 0.0f;
        for (int j = 0; j < QK8_0; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float db = amax / 127.0f;
        const float id = db != 0.0f ? 1.0f / db : 0.0f;
        int32_t s = 0;
        for (int j = 0; j < QK8_0; j++) {
            qs[j] = quant_one(x[j] * id);
            s += qs[j];
        }
        d[b] = db;
        c[b] = -128 * s;
    }
}

void cpu_quant_q8_K_scalar(const float *x, int64_t cols, int8_t *qs, float *d, int32_t *c,
                           int16_t *bsums) {
    (void)c;
    for (int64_t b = 0; b < cols / PD_QK_K; b++, x += PD_QK_K, qs += PD_QK_K, bsums += 16) {
        float amax = 0.0f;
        for (int j = 0; j < PD_QK_K; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float db = amax / 127.0f;
        const float id = db != 0.0f ? 1.0f / db : 0.0f;
        for (int j = 0; j < PD_QK_K; j++) qs[j] = quant_one(x[j] * id);
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int j = 0; j < 16; j++) s += qs[16 * g + j];
            bsums[g] = (int16_t)s;
        }
        d[b] = db;
    }
}

/* ------------------------------------------------------------------------
 * row dot products
 * ------------------------------------------------------------------------ */

static float dot_q8_0(const uint8_t *w, const int8_t *qs, const float *d, int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += CPU_Q8_0_BYTES, qs += QK8_0) {
        int32_t s = 0;
        for (int j = 0; j < QK8_0; j++) s += (int32_t)cpu_load_i8(w + 2 + j) * qs[j];
        acc += pd_fp16_to_fp32(cpu_load_u16(w)) * d[b] * (float)s;
    }
    return acc;
}

static float dot_q4_0(const uint8_t *w, const int8_t *qs, const float *d, int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += CPU_Q4_0_BYTES, qs += QK8_0) {
        int32_t s = 0;
        for (int j = 0; j < 16; j++) {
            s += ((int32_t)(w[2 + j] & 0x0fu) - 8) * qs[j];
            s += ((int32_t)(w[2 + j] >> 4) - 8) * qs[j + 16];
        }
        acc += pd_fp16_to_fp32(cpu_load_u16(w)) * d[b] * (float)s;
    }
    return acc;
}

static float dot_q4_K(const uint8_t *w, const int8_t *qs, const float *d, const int16_t *bsums,
                      int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += CPU_Q4_K_BYTES, qs += PD_QK_K, bsums += 16) {
        const float dd = pd_fp16_to_fp32(cpu_load_u16(w));
        const float dmin = pd_fp16_to_fp32(cpu_load_u16(w + 2));
        const uint8_t *sc = w + 4;
        const uint8_t *q = w + 16;
        int32_t sumi = 0, summ = 0;
        for (int j = 0; j < 4; j++, q += 32) {
            uint8_t sc0, m0, sc1, m1;
            cpu_q4k_scale_min(2 * j, sc, &sc0, &m0);
            cpu_q4k_scale_min(2 * j + 1, sc, &sc1, &m1);
            int32_t s0 = 0, s1 = 0;
            for (int l = 0; l < 32; l++) {
                s0 += (int32_t)(q[l] & 0x0fu) * qs[64 * j + l];
                s1 += (int32_t)(q[l] >> 4) * qs[64 * j + 32 + l];
            }
            sumi += sc0 * s0 + sc1 * s1;
            summ += m0 * (bsums[4 * j] + bsums[4 * j + 1]) + m1 * (bsums[4 * j + 2] + bsums[4 * j + 3]);
        }
        acc += d[b] * (dd * (float)sumi - dmin * (float)summ);
    }
    return acc;
}

static float dot_q6_K(const uint8_t *w, const int8_t *qs, const float *d, const int16_t *bsums,
                      int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; b++, w += CPU_Q6_K_BYTES, qs += PD_QK_K, bsums += 16) {
        const float dd = pd_fp16_to_fp32(cpu_load_u16(w + 208));
        int32_t sumi = 0;
        for (int h = 0; h < 2; h++) {
            const uint8_t *ql = w + 64 * h;
            const uint8_t *qh = w + 128 + 32 * h;
            const int8_t *x = qs + 128 * h;
            int32_t s[8] = {0};
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                const int q1 = (int)((ql[l] & 0x0fu) | ((qh[l] & 3u) << 4));
                const int q2 = (int)((ql[l + 32] & 0x0fu) | (((qh[l] >> 2) & 3u) << 4));
                const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3u) << 4));
                const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3u) << 4));
                s[is + 0] += q1 * x[l];
                s[is + 2] += q2 * x[l + 32];
                s[is + 4] += q3 * x[l + 64];
                s[is + 6] += q4 * x[l + 96];
            }
            for (int k = 0; k < 8; k++) {
                const int32_t scale = cpu_load_i8(w + 192 + 8 * h + k);
                sumi += scale * (s[k] - 32 * bsums[8 * h + k]);
            }
        }
        acc += d[b] * dd * (float)sumi;
    }
    return acc;
}

static float dot_f32w(const uint8_t *w, const float *x, int64_t n) {
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++) acc += cpu_load_f32(w + 4 * i) * x[i];
    return acc;
}

static float dot_f16w(const uint8_t *w, const float *x, int64_t n) {
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++) acc += pd_fp16_to_fp32(cpu_load_u16(w + 2 * i)) * x[i];
    return acc;
}

static float dot_bf16w(const uint8_t *w, const float *x, int64_t n) {
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++) acc += pd_bf16_to_fp32(cpu_load_u16(w + 2 * i)) * x[i];
    return acc;
}

/* ------------------------------------------------------------------------
 * matmul kernels: rows [r0, r1) x all tokens
 * ------------------------------------------------------------------------ */

static void mm_q8_0(const cpu_mm *m, int64_t r0, int64_t r1) {
    const cpu_qact *q = m->q;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t t = 0; t < m->n; t++)
            m->y[t * m->ldy + r] = dot_q8_0(m->w + (size_t)r * m->rb, q->qs + t * q->cols,
                                            q->d + t * q->nblocks, q->nblocks);
}

static void mm_q4_0(const cpu_mm *m, int64_t r0, int64_t r1) {
    const cpu_qact *q = m->q;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t t = 0; t < m->n; t++)
            m->y[t * m->ldy + r] = dot_q4_0(m->w + (size_t)r * m->rb, q->qs + t * q->cols,
                                            q->d + t * q->nblocks, q->nblocks);
}

static void mm_q4_K(const cpu_mm *m, int64_t r0, int64_t r1) {
    const cpu_qact *q = m->q;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t t = 0; t < m->n; t++)
            m->y[t * m->ldy + r] =
                dot_q4_K(m->w + (size_t)r * m->rb, q->qs + t * q->cols, q->d + t * q->nblocks,
                         q->bsums + t * (q->cols / 16), q->nblocks);
}

static void mm_q6_K(const cpu_mm *m, int64_t r0, int64_t r1) {
    const cpu_qact *q = m->q;
    for (int64_t r = r0; r < r1; r++)
        for (int64_t t = 0; t < m->n; t++)
            m->y[t * m->ldy + r] =
                dot_q6_K(m->w + (size_t)r * m->rb, q->qs + t * q->cols, q->d + t * q->nblocks,
                         q->bsums + t * (q->cols / 16), q->nblocks);
}

#define MM_FLOAT(name, dot)                                                                     \
    static void name(const cpu_mm *m, int64_t r0, int64_t r1) {                                 \
        for (int64_t r = r0; r < r1; r++)                                                       \
            for (int64_t t = 0; t < m->n; t++)                                                  \
                m->y[t * m->ldy + r] = dot(m->w + (size_t)r * m->rb, m->x + t * m->cols, m->cols); \
    }
MM_FLOAT(mm_f32, dot_f32w)
MM_FLOAT(mm_f16, dot_f16w)
MM_FLOAT(mm_bf16, dot_bf16w)

/* ------------------------------------------------------------------------
 * element-wise helpers
 * ------------------------------------------------------------------------ */

static void swiglu_scalar(const float *g, const float *u, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) {
        const float x = g[i];
        out[i] = x / (1.0f + expf(-x)) * u[i];
    }
}

static float softmax_exp_scalar(const float *s, float m, int64_t n, float *p) {
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        p[i] = expf(s[i] - m);
        sum += p[i];
    }
    return sum;
}

static float dot_f32_scalar(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

static void axpy_f32_scalar(float a, const float *x, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

static void scale_f32_scalar(float a, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i++) y[i] *= a;
}

static void attn_scores_scalar(const float *q, const float *k, int64_t hd, int64_t nk, float scale,
                               float *s) {
    for (int64_t j = 0; j < nk; j++) s[j] = scale * dot_f32_scalar(q, k + j * hd, hd);
}

static void attn_pv_scalar(const float *p, const float *v, int64_t hd, int64_t nk, float *o) {
    for (int64_t j = 0; j < nk; j++) axpy_f32_scalar(p[j], v + j * hd, hd, o);
}

static void attn_scores_f16_scalar(const float *q, const uint16_t *k, int64_t hd, int64_t nk, float scale,
                                   float *s) {
    for (int64_t j = 0; j < nk; j++) {
        float acc = 0.0f;
        for (int64_t d = 0; d < hd; d++) acc += q[d] * pd_fp16_to_fp32(k[j * hd + d]);
        s[j] = scale * acc;
    }
}

static void attn_pv_f16_scalar(const float *p, const uint16_t *v, int64_t hd, int64_t nk, float *o) {
    for (int64_t j = 0; j < nk; j++)
        for (int64_t d = 0; d < hd; d++) o[d] += p[j] * pd_fp16_to_fp32(v[j * hd + d]);
}

static void f32_to_f16_scalar(const float *x, int64_t n, uint16_t *y) {
    for (int64_t i = 0; i < n; i++) y[i] = pd_fp32_to_fp16(x[i]);
}

static void f16_to_f32_scalar(const uint16_t *x, int64_t n, float *y) {
    for (int64_t i = 0; i < n; i++) y[i] = pd_fp16_to_fp32(x[i]);
}

static void scale_mul_scalar(const float *x, float a, const float *w, int64_t n, float *o) {
    if (w)
        for (int64_t i = 0; i < n; i++) o[i] = x[i] * a * w[i];
    else
        for (int64_t i = 0; i < n; i++) o[i] = x[i] * a;
}

static float max_f32_scalar(const float *x, int64_t n) {
    float m = x[0];
    for (int64_t i = 1; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

static int32_t max_i32_scalar(const int32_t *x, int64_t n) {
    int32_t m = x[0];
    for (int64_t i = 1; i < n; i++) m = x[i] > m ? x[i] : m;
    return m;
}

void cpu_kernels_scalar(cpu_kernels *k) {
    memset(k, 0, sizeof *k);
    k->level = CPU_SIMD_SCALAR;
    k->mm[PD_TYPE_F32] = mm_f32;
    k->mm[PD_TYPE_F16] = mm_f16;
    k->mm[PD_TYPE_BF16] = mm_bf16;
    k->mm[PD_TYPE_Q8_0] = mm_q8_0;
    k->mm[PD_TYPE_Q4_0] = mm_q4_0;
    k->mm[PD_TYPE_Q4_K] = mm_q4_K;
    k->mm[PD_TYPE_Q6_K] = mm_q6_K;
    k->quant_q8_0 = cpu_quant_q8_0_scalar;
    k->quant_q8_K = cpu_quant_q8_K_scalar;
    k->swiglu = swiglu_scalar;
    k->softmax_exp = softmax_exp_scalar;
    k->dot_f32 = dot_f32_scalar;
    k->axpy_f32 = axpy_f32_scalar;
    k->scale_f32 = scale_f32_scalar;
    k->scale_mul = scale_mul_scalar;
    k->max_f32 = max_f32_scalar;
    k->max_i32 = max_i32_scalar;
    k->attn_scores = attn_scores_scalar;
    k->attn_pv = attn_pv_scalar;
    k->attn_scores_f16 = attn_scores_f16_scalar;
    k->attn_pv_f16 = attn_pv_f16_scalar;
    k->f32_to_f16 = f32_to_f16_scalar;
    k->f16_to_f32 = f16_to_f32_scalar;
    cpu_kernels_kq_scalar(k);
    cpu_q32_kernels_scalar(k);
}
