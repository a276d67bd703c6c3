/* Reference quantize/dequantize of the 32-element types that are not
 * K-quants: q4_1, q5_0, q5_1 and iq4_nl (ggml's layouts, byte for byte).
 *
 *   q4_1   (20 B / 32): fp16 d; fp16 m; uint8 qs[16]           x = q*d + m
 *   q5_0   (22 B / 32): fp16 d; uint8 qh[4]; uint8 qs[16]      x = (q-16)*d
 *   q5_1   (24 B / 32): fp16 d; fp16 m; uint8 qh[4]; uint8 qs[16]
 *                                                              x = q*d + m
 *   iq4_nl (18 B / 32): fp16 d; uint8 qs[16]                   x = d*K[q]
 *
 * Nibbles as in q4_0: qs[j] low nibble is element j, high nibble element
 * j+16. The fifth bit of element j of q5_0/q5_1 is bit j of qh read as a
 * little-endian uint32. K is iq4_nl's fixed non-linear codebook of 16
 * int8 values.
 *
 * As in quant.c, the dequantizers do ggml's float operations in ggml's
 * order (product, then sum, in separate statements so nothing is contracted
 * into an FMA), so they match dequantize_row_* bit for bit. The quantizers
 * are round-to-nearest against the fp16 scale and offset actually stored;
 * iq4_nl picks its scale from a few candidates by squared error, then each
 * element's nearest codebook value. */
#include <math.h>
#include <string.h>

#include "kernels/cpu/cpu_internal.h"

#define QK 32

const int8_t cpu_iq4nl_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

static inline void store_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* Pack 32 codes (0..31, or 0..15 when qh is NULL) into nibbles and, for
 * the 5-bit types, the fifth bits. */
static void pack_codes(const uint8_t L[QK], uint8_t *qs, uint8_t *qh) {
    uint32_t h = 0;
    for (int j = 0; j < QK / 2; j++) {
        qs[j] = (uint8_t)((L[j] & 0x0fu) | ((L[j + QK / 2] & 0x0fu) << 4));
        h |= (uint32_t)((L[j] >> 4) & 1u) << j;
        h |= (uint32_t)((L[j + QK / 2] >> 4) & 1u) << (j + QK / 2);
    }
    if (qh) store_u32(qh, h);
}

/* ------------------------------------------------------------------------
 * q4_1 and q5_1: scale and offset (min) per block
 * ------------------------------------------------------------------------ */

/* nmax = 15 (q4_1) or 31 (q5_1); y points at the block. */
static void quantize_min_block(const float *x, uint8_t *y, int nmax) {
    float lo = INFINITY, hi = -INFINITY;
    for (int j = 0; j < QK; j++) { /* NaN compares false: skipped */
        if (x[j] < lo) lo = x[j];
        if (x[j] > hi) hi = x[j];
    }
    if (!(lo <= hi)) lo = hi = 0.0f; /* all NaN */
    const float d = cpu_store_half(y, (hi - lo) / (float)nmax);
    const float m = cpu_store_half(y + 2, lo);
    uint8_t L[QK];
    for (int j = 0; j < QK; j++) L[j] = (uint8_t)(d != 0.0f ? cpu_round_clamp((x[j] - m) / d, 0, nmax) : 0);
    if (nmax == 15)
        pack_codes(L, y + 4, NULL);
    else
        pack_codes(L, y + 8, y + 4);
}

static void dequantize_q4_1(const uint8_t *x, float *y, uint64_t nb) {
    for (uint64_t i = 0; i < nb; i++, x += CPU_Q4_1_BYTES, y += QK) {
        const float d = cpu_load_half(x);
        const float m = cpu_load_half(x + 2);
        const uint8_t *qs = x + 4;
        for (int j = 0; j < QK / 2; j++) {
            const int x0 = qs[j] & 0x0f;
            const int x1 = qs[j] >> 4;
            const float p0 = (float)x0 * d;
            const float p1 = (float)x1 * d;
            y[j] = p0 + m;
            y[j + QK / 2] = p1 + m;
        }
    }
}

static void dequantize_q5_1(const uint8_t *x, float *y, uint64_t nb) {
    for (uint64_t i = 0; i < nb; i++, x += CPU_Q5_1_BYTES, y += QK) {
        const float d = cpu_load_half(x);
        const float m = cpu_load_half(x + 2);
        const uint32_t qh = cpu_load_u32le(x + 4);
        const uint8_t *qs = x + 8;
        for (int j = 0; j < QK / 2; j++) {
            const int x0 = (int)((qs[j] & 0x0fu) | (((qh >> j) << 4) & 0x10u));
            const int x1 = (int)((qs[j] >> 4) | ((qh >> (j + 12)) & 0x10u));
            const float p0 = (float)x0 * d;
            const float p1 = (float)x1 * d;
            y[j] = p0 + m;
            y[j + QK / 2] = p1 + m;
        }
    }
}

/* ------------------------------------------------------------------------
 * q5_0: symmetric, like q4_0 with a fifth bit
 * ------------------------------------------------------------------------ */

static void quantize_q5_0(const float *x, uint8_t *y, uint64_t nb) {
    for (uint64_t i = 0; i < nb; i++, x += QK, y += CPU_Q5_0_BYTES) {
        /* the element of largest magnitude maps to -16, using the range
         * [-16, 15] to its fullest (as ggml does) */
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < QK; j++) {
            if (fabsf(x[j]) > amax) {
                amax = fabsf(x[j]);
                max = x[j];
            }
        }
        const float d = cpu_store_half(y, max / -16.0f);
        uint8_t L[QK];
        for (int j = 0; j < QK; j++) L[j] = (uint8_t)(d != 0.0f ? cpu_round_clamp(x[j] / d, -16, 15) + 16 : 16);
        pack_codes(L, y + 6, y + 2);
    }
}

static void dequantize_q5_0(const uint8_t *x, float *y, uint64_t nb) {
    for (uint64_t i = 0; i < nb; i++, x += CPU_Q5_0_BYTES, y += QK) {
        const float d = cpu_load_half(x);
        const uint32_t qh = cpu_load_u32le(x + 2);
        const uint8_t *qs = x + 6;
        for (int j = 0; j < QK / 2; j++) {
            const int x0 = (int)((qs[j] & 0x0fu) | (((qh >> j) << 4) & 0x10u)) - 16;
            const int x1 = (int)((qs[j] >> 4) | ((qh >> (j + 12)) & 0x10u)) - 16;
            y[j] = (float)x0 * d;
            y[j + QK / 2] = (float)x1 * d;
        }
    }
}

/* ------------------------------------------------------------------------
 * iq4_nl: codebook values times an fp16 scale
 * ------------------------------------------------------------------------ */

/* Index of the codebook value nearest v: the number of midpoints between
 * neighbouring values that v lies above (ties and NaN go low). Counting
 * instead of searching has no branches to mispredict. */
static int iq4nl_nearest(float v) {
    static const float mid[15] = {-115.5f, -93.5f, -74.0f, -57.0f, -42.0f, -28.5f, -16.0f, -4.5f,
                                  7.0f,    19.0f,  31.5f,  45.5f,  61.0f,  79.0f,  101.0f};
    int i = 0;
    for (int k = 0; k < 15; k++) i += v > mid[k];
    return i;
}

/* Code x with the nearest values at scale 1 / id; returns sum(x * K) and
 * sum(K * K) of those codes. The least-squares scale for the codes is
 * sxv / svv, and its squared error sum(x^2) - sxv^2 / svv. */
static void iq4nl_fit(const float *x, float id, float *sxv, float *svv) {
    float a = 0.0f, b = 0.0f;
    for (int j = 0; j < QK; j++) {
        const float v = (float)cpu_iq4nl_values[iq4nl_nearest(x[j] * id)];
        a += x[j] * v;
        b += v * v;
    }
    *sxv = a;
    *svv = b; /* >= 32: no value is 0 */
}

static void quantize_iq4_nl(const float *x, uint8_t *y, uint64_t nb) {
    for (uint64_t i = 0; i < nb; i++, x += QK, y += CPU_IQ4_NL_BYTES) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < QK; j++) {
            if (fabsf(x[j]) > amax) {
                amax = fabsf(x[j]);
                max = x[j];
            }
        }
        float best = 0.0f;
        if (amax > 0.0f && isfinite(amax)) {
            /* Map the extreme element to codebook values near the wide end
             * (-127); keep the codes whose least-squares scale leaves the
             * least squared error (the largest sxv^2 / svv). */
            float best_score = -1.0f;
            for (int t = -4; t <= 4; t++) {
                float sxv, svv;
                iq4nl_fit(x, (float)(cpu_iq4nl_values[0] + t) / max, &sxv, &svv);
                if (sxv * sxv / svv > best_score) {
                    best_score = sxv * sxv / svv;
                    best = sxv / svv;
                }
            }
            if (!isfinite(best)) best = 0.0f; /* NaN input */
        }
        const float d = cpu_store_half(y, best);
        uint8_t L[QK];
        for (int j = 0; j < QK; j++) L[j] = (uint8_t)(d != 0.0f ? iq4nl_nearest(x[j] / d) : 8);
        pack_codes(L, y + 2, NULL);
    }
}

static void dequantize_iq4_nl(const uint8_t *x, float *y, uint64_t nb) {
    for (uint64_t i = 0; i < nb; i++, x += CPU_IQ4_NL_BYTES, y += QK) {
        const float d = cpu_load_half(x);
        const uint8_t *qs = x + 2;
        for (int j = 0; j < QK / 2; j++) {
            y[j] = d * (float)cpu_iq4nl_values[qs[j] & 0x0f];
            y[j + QK / 2] = d * (float)cpu_iq4nl_values[qs[j] >> 4];
        }
    }
}

/* ------------------------------------------------------------------------
 * dispatch (from quant.c)
 * ------------------------------------------------------------------------ */

bool cpu_quantize_q32(pd_type t, const float *x, uint8_t *y, uint64_t nb) {
    switch (t) {
    case PD_TYPE_Q4_1:
        for (uint64_t i = 0; i < nb; i++) quantize_min_block(x + QK * i, y + CPU_Q4_1_BYTES * i, 15);
        return true;
    case PD_TYPE_Q5_1:
        for (uint64_t i = 0; i < nb; i++) quantize_min_block(x + QK * i, y + CPU_Q5_1_BYTES * i, 31);
        return true;
    case PD_TYPE_Q5_0: quantize_q5_0(x, y, nb); return true;
    case PD_TYPE_IQ4_NL: quantize_iq4_nl(x, y, nb); return true;
    default: return false;
    }
}

bool cpu_dequantize_q32(pd_type t, const uint8_t *x, float *y, uint64_t nb) {
    switch (t) {
    case PD_TYPE_Q4_1: dequantize_q4_1(x, y, nb); return true;
    case PD_TYPE_Q5_0: dequantize_q5_0(x, y, nb); return true;
    case PD_TYPE_Q5_1: dequantize_q5_1(x, y, nb); return true;
    case PD_TYPE_IQ4_NL: dequantize_iq4_nl(x, y, nb); return true;
    default: return false;
    }
}
