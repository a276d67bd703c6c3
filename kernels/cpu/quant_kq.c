/* Reference quantize/dequantize of the 256-element types llama.cpp's
 * Q2_K, Q3_K_S/M, Q5_K_S/M and IQ4_XS files hold (pd_quantize_row and
 * pd_dequantize_row in quant.c dispatch here). Layouts are ggml's, byte for
 * byte (e = element index within the super-block of 256):
 *
 *   q2_K  (84 B):  uint8 scales[16]; uint8 qs[64]; fp16 d; fp16 dmin
 *                  16 sub-blocks of 16, scales[j] = sc | m << 4 (4 bits
 *                  each); 2-bit q of e = 128h + 32j + l (l < 32) is bits
 *                  2j of qs[32h + l]; x = d*sc*q - dmin*m
 *   q3_K (110 B):  uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; fp16 d
 *                  16 sub-blocks of 16 with 6-bit scales s (stored + 32):
 *                  low 4 bits in scales[j] (j < 8) or the high nibble of
 *                  scales[j - 8], high 2 bits at bit 2*(j/4) of
 *                  scales[8 + j%4]; q = low 2 bits (as q2_K) + 4 * (bit
 *                  e/32 of hmask[e%32]); x = d*(s-32)*(q-4)
 *   q5_K (176 B):  fp16 d; fp16 dmin; uint8 scales[12]; uint8 qh[32];
 *                  uint8 qs[128]; q4_K's scales, mins and nibbles, plus a
 *                  fifth bit: bit 2c of qh[l] for e = 64c + l, bit 2c+1 for
 *                  e = 64c + 32 + l; x = d*sc*q - dmin*m
 *   iq4_xs (136 B): fp16 d; uint16 scales_h; uint8 scales_l[4];
 *                  uint8 qs[128]; 8 sub-blocks of 32 with 6-bit scales s
 *                  (stored + 32: low nibble j%2 of scales_l[j/2], high 2
 *                  bits at bit 2j of scales_h); nibbles as q4_0 per
 *                  sub-block (qs[16j + l]: low e = 32j + l, high
 *                  e = 32j + 16 + l) index a table of 16 values;
 *                  x = d*(s-32)*value
 *
 * The dequantizers do ggml's float operations in ggml's order (one product,
 * then the min subtracted in its own statement, so nothing contracts into
 * an FMA): bit-identical to dequantize_row_q2_K/q3_K/q5_K/iq4_xs. The
 * quantizers are round-to-nearest with a small search over the neighbouring
 * sub-block scale codes, quantizing against the fp16 scales actually
 * stored, as quant.c does for q4_K/q6_K: valid blocks close to the input,
 * not llama-quantize's bytes. */
#include <math.h>
#include <string.h>

#include "kernels/cpu/cpu_internal.h"

/* ------------------------------------------------------------------------
 * helpers
 * ------------------------------------------------------------------------ */

/* Code of x on the grid dl*q - dm, q in [0, qmax]. */
static inline int affine_code(float x, float dl, float dm, int qmax) {
    return dl != 0.0f ? cpu_round_clamp((x + dm) / dl, 0, qmax) : 0;
}

/* Squared error of x[0..n) on that grid. */
static float affine_err(const float *x, int n, float dl, float dm, int qmax) {
    float e = 0.0f;
    for (int l = 0; l < n; l++) {
        const float p = dl * (float)affine_code(x[l], dl, dm, qmax);
        const float v = p - dm;
        e += (v - x[l]) * (v - x[l]);
    }
    return e;
}

/* Scale and offset of a sub-block coded as sc*q - m with q in [0, qmax]:
 * the range from min(x, 0) to max(x) (the offset is subtracted, so it is
 * never negative). */
static void affine_fit(const float *x, int n, int qmax, float *scale, float *min) {
    float lo = x[0], hi = x[0];
    for (int l = 1; l < n; l++) {
        if (x[l] < lo) lo = x[l];
        if (x[l] > hi) hi = x[l];
    }
    if (!(lo < 0.0f)) lo = 0.0f;
    if (!(hi > lo)) hi = lo;
    *scale = (hi - lo) / (float)qmax;
    *min = -lo;
}

/* The 4-bit (q2_K) or 6-bit (q5_K) codes of a sub-block's scale and min:
 * the neighbours of the rounded codes of (scale / d, min / dmin) with the
 * least squared error. */
static void affine_codes(const float *x, int n, int qmax, float scale, float min, float d, float dmin, int cmax,
                         int *ls, int *lm) {
    const int ls0 = d != 0.0f ? cpu_round_clamp(scale / d, 0, cmax) : 0;
    const int lm0 = dmin != 0.0f ? cpu_round_clamp(min / dmin, 0, cmax) : 0;
    float best = INFINITY;
    *ls = ls0;
    *lm = lm0;
    for (int a = -1; a <= 1; a++) {
        for (int b = -1; b <= 1; b++) {
            const int s = ls0 + a, m = lm0 + b;
            if (s < 0 || s > cmax || m < 0 || m > cmax) continue;
            const float e = affine_err(x, n, d * (float)s, dmin * (float)m, qmax);
            if (e < best) {
                best = e;
                *ls = s;
                *lm = m;
            }
        }
    }
}

/* Symmetric sub-blocks (q3_K, iq4_xs): of x[0..n), the one of largest
 * magnitude, with its sign, so it can map to the most negative code (also
 * picks the super-block scale among the sub-block scales). */
static float signed_amax(const float *x, int n) {
    float amax = 0.0f, mx = 0.0f;
    for (int l = 0; l < n; l++) {
        if (fabsf(x[l]) > amax) {
            amax = fabsf(x[l]);
            mx = x[l];
        }
    }
    return mx;
}

/* Pack the 2-bit codes L[256] (0..3) as q2_K/q3_K store them. */
static void pack_2bit(const uint8_t *L, uint8_t *qs) {
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++)
            qs[32 * h + l] = (uint8_t)(L[128 * h + l] | (L[128 * h + l + 32] << 2) | (L[128 * h + l + 64] << 4) |
                                       (L[128 * h + l + 96] << 6));
}

/* ------------------------------------------------------------------------
 * q2_K
 * ------------------------------------------------------------------------ */

void cpu_quantize_q2_K(const float *x, uint8_t *y, uint64_t nb) {
    for (uint64_t i = 0; i < nb; i++, x += PD_QK_K, y += CPU_Q2_K_BYTES) {
        float scales[16], mins[16], max_scale = 0.0f, max_min = 0.0f;
        for (int j = 0; j < 16; j++) {
            affine_fit(x + 16 * j, 16, 3, &scales[j], &mins[j]);
            if (scales[j] > max_scale) max_scale = scales[j];
            if (mins[j] > max_min) max_min = mins[j];
        }
        const float d = cpu_store_half(y + 80, max_scale / 15.0f);
        const float dmin = cpu_store_half(y + 82, max_min / 15.0f);
        uint8_t L[PD_QK_K];
        for (int j = 0; j < 16; j++) {
            const float *xs = x + 16 * j;
            int ls, lm;
            affine_codes(xs, 16, 3, scales[j], mins[j], d, dmin, 15, &ls, &lm);
            y[j] = (uint8_t)(ls | (lm << 4));
            const float dl = d * (float)ls, dm = dmin * (float)lm;
            for (int l = 0; l < 16; l++) L[16 * j + l] = (uint8_t)affine_code(xs[l], dl, dm, 3);
        }
        pack_2bit(L, y + 16);
    }
}

void cpu_dequantize_q2_K(const uint8_t *x, float *y, uint64_t nb) {
    for (uint64_t i = 0; i < nb; i++, x += CPU_Q2_K_BYTES) {
        const float d = cpu_load_half(x + 80);
        const float min = cpu_load_half(x + 82);
        const uint8_t *sc = x;
        const uint8_t *q = x + 16;
        for (int h = 0; h < 2; h++, q += 32) {
            for (int j = 0; j < 4; j++) {
                const int shift = 2 * j;
                for (int s = 0; s < 2; s++) {
                    const uint8_t b = *sc++;
                    const float dl = d * (float)(b & 0x0fu);
                    const float ml = min * (float)(b >> 4);
                    for (int l = 0; l < 16; l++) {
                        const float p = dl * (float)((q[16 * s + l] >> shift) & 3u);
                        *y++ = p - ml;
                    }
                }
            }
        }
    }
}

/* ------------------------------------------------------------------------
 * q3_K
 * ------------------------------------------------------------------------ */

/* Squared error of x[0..16) coded as dl*q, q in [-4, 3]. */
static float q3k_err(const float *x, float dl) {
    float e = 0.0f;
    for (int l = 0; l < 16; l++) {
        const int q = dl != 0.0f ? cpu_round_clamp(x[l] / dl, -4, 3) : 0;
        const float v = dl * (float)q;
        e += (v - x[l]) * (v - x[l]);
    }
    return e;
}

void cpu_quantize_q3_K(const float *x, uint8_t *y, uint64_t nb) {
    for (uint64_t i = 0; i < nb; i++, x += PD_QK_K, y += CPU_Q3_K_BYTES) {
        uint8_t *hmask = y, *qs = y + 32, *sc = y + 96;
        /* each sub-block's extreme maps to -4; the largest scale to -32 */
        float scales[16];
        for (int j = 0; j < 16; j++) scales[j] = signed_amax(x + 16 * j, 16) / -4.0f;
        const float d = cpu_store_half(y + 108, signed_amax(scales, 16) / -32.0f);
        memset(sc, 0, 12);
        uint8_t L[PD_QK_K];
        for (int j = 0; j < 16; j++) {
            const float *xs = x + 16 * j;
            int c = 0;
            if (d != 0.0f) {
                const int c0 = cpu_round_clamp(scales[j] / d, -32, 31);
                float best = INFINITY;
                for (int a = -1; a <= 1; a++) {
                    if (c0 + a < -32 || c0 + a > 31) continue;
                    const float e = q3k_err(xs, d * (float)(c0 + a));
                    if (e < best) {
                        best = e;
                        c = c0 + a;
                    }
                }
            }
            const unsigned l6 = (unsigned)(c + 32);
            if (j < 8)
                sc[j] = (uint8_t)(sc[j] | (l6 & 0x0fu));
            else
                sc[j - 8] = (uint8_t)(sc[j - 8] | ((l6 & 0x0fu) << 4));
            sc[8 + j % 4] = (uint8_t)(sc[8 + j % 4] | ((l6 >> 4) << (2 * (j / 4))));
            const float dl = d * (float)c;
            for (int l = 0; l < 16; l++)
                L[16 * j + l] = (uint8_t)((dl != 0.0f ? cpu_round_clamp(xs[l] / dl, -4, 3) : 0) + 4);
        }
        memset(hmask, 0, 32);
        for (int e = 0; e < PD_QK_K; e++) {
            if (L[e] > 3) {
                hmask[e % 32] = (uint8_t)(hmask[e % 32] | (1u << (e / 32)));
                L[e] = (uint8_t)(L[e] - 4);
            }
        }
        pack_2bit(L, qs);
    }
}

/* The 16 scales of a q3_K block, 6 bits each, minus 32 (as ggml unpacks
 * them: four 32-bit words). */
void cpu_q3k_scales(const uint8_t *s, int8_t out[16]) {
    uint32_t a[4];
    memcpy(a, s, 12);
    const uint32_t m2 = 0x0f0f0f0fu, m1 = 0x03030303u, t = a[2];
    a[2] = ((a[0] >> 4) & m2) | (((t >> 4) & m1) << 4);
    a[3] = ((a[1] >> 4) & m2) | (((t >> 6) & m1) << 4);
    a[0] = (a[0] & m2) | ((t & m1) << 4);
    a[1] = (a[1] & m2) | (((t >> 2) & m1) << 4);
    uint8_t u[16];
    memcpy(u, a, 16);
    for (int j = 0; j < 16; j++) out[j] = (int8_t)(u[j] - 32);
}

void cpu_dequantize_q3_K(const uint8_t *x, float *y, uint64_t nb) {
    for (uint64_t i = 0; i < nb; i++, x += CPU_Q3_K_BYTES) {
        const float d_all = cpu_load_half(x + 108);
        const uint8_t *hm = x;
        const uint8_t *q = x + 32;
        int8_t scales[16];
        cpu_q3k_scales(x + 96, scales);
        int is = 0;
        unsigned m = 1;
        for (int h = 0; h < 2; h++, q += 32) {
            for (int j = 0; j < 4; j++, m <<= 1) {
                const int shift = 2 * j;
                for (int s = 0; s < 2; s++) {
                    const float dl = d_all * (float)scales[is++];
                    for (int l = 0; l < 16; l++) {
                        const int v = (int)((q[16 * s + l] >> shift) & 3u) - ((hm[16 * s + l] & m) ? 0 : 4);
                        *y++ = dl * (float)v;
                    }
                }
            }
        }
    }
}

/* ------------------------------------------------------------------------
 * q5_K
 * ------------------------------------------------------------------------ */

void cpu_quantize_q5_K(const float *x, uint8_t *y, uint64_t nb) {
    for (uint64_t i = 0; i < nb; i++, x += PD_QK_K, y += CPU_Q5_K_BYTES) {
        float scales[8], mins[8], max_scale = 0.0f, max_min = 0.0f;
        for (int j = 0; j < 8; j++) {
            affine_fit(x + 32 * j, 32, 31, &scales[j], &mins[j]);
            if (scales[j] > max_scale) max_scale = scales[j];
            if (mins[j] > max_min) max_min = mins[j];
        }
        const float d = cpu_store_half(y, max_scale / 63.0f);
        const float dmin = cpu_store_half(y + 2, max_min / 63.0f);
        uint8_t *s = y + 4, *qh = y + 16, *ql = y + 48;
        memset(s, 0, 12);
        uint8_t L[PD_QK_K];
        for (int j = 0; j < 8; j++) {
            const float *xs = x + 32 * j;
            int ls, lm;
            affine_codes(xs, 32, 31, scales[j], mins[j], d, dmin, 63, &ls, &lm);
            cpu_q4k_pack_scale_min(j, s, (uint8_t)ls, (uint8_t)lm);
            const float dl = d * (float)ls, dm = dmin * (float)lm;
            for (int l = 0; l < 32; l++) L[32 * j + l] = (uint8_t)affine_code(xs[l], dl, dm, 31);
        }
        memset(qh, 0, 32);
        for (int c = 0; c < 4; c++) {
            for (int l = 0; l < 32; l++) {
                const unsigned lo = L[64 * c + l], hi = L[64 * c + 32 + l];
                ql[32 * c + l] = (uint8_t)((lo & 0x0fu) | ((hi & 0x0fu) << 4));
                qh[l] = (uint8_t)(qh[l] | ((lo >> 4) << (2 * c)) | ((hi >> 4) << (2 * c + 1)));
            }
        }
    }
}

void cpu_dequantize_q5_K(const uint8_t *x, float *y, uint64_t nb) {
    for (uint64_t i = 0; i < nb; i++, x += CPU_Q5_K_BYTES) {
        const float d = cpu_load_half(x);
        const float min = cpu_load_half(x + 2);
        const uint8_t *s = x + 4, *qh = x + 16, *ql = x + 48;
        unsigned u1 = 1, u2 = 2;
        for (int j = 0; j < 8; j += 2, ql += 32, u1 <<= 2, u2 <<= 2) {
            uint8_t sc, m;
            cpu_q4k_scale_min(j, s, &sc, &m);
            const float d1 = d * (float)sc;
            const float m1 = min * (float)m;
            cpu_q4k_scale_min(j + 1, s, &sc, &m);
            const float d2 = d * (float)sc;
            const float m2 = min * (float)m;
            for (int l = 0; l < 32; l++) {
                const float p = d1 * (float)((ql[l] & 0x0fu) + ((qh[l] & u1) ? 16u : 0u));
                *y++ = p - m1;
            }
            for (int l = 0; l < 32; l++) {
                const float p = d2 * (float)((ql[l] >> 4) + ((qh[l] & u2) ? 16u : 0u));
                *y++ = p - m2;
            }
        }
    }
}

/* ------------------------------------------------------------------------
 * iq4_xs
 * ------------------------------------------------------------------------ */

/* Index of the table value nearest to v (0 for NaN). */
static int iq4_nearest(float v) {
    int best = 0;
    float best_e = INFINITY;
    for (int k = 0; k < 16; k++) {
        const float e = fabsf(v - (float)cpu_iq4nl_values[k]);
        if (e < best_e) {
            best_e = e;
            best = k;
        }
    }
    return best;
}

static float iq4_err(const float *x, float dl) {
    if (dl == 0.0f) {
        float e = 0.0f;
        for (int l = 0; l < 32; l++) e += x[l] * x[l];
        return e;
    }
    float e = 0.0f;
    for (int l = 0; l < 32; l++) {
        const float v = dl * (float)cpu_iq4nl_values[iq4_nearest(x[l] / dl)];
        e += (v - x[l]) * (v - x[l]);
    }
    return e;
}

void cpu_quantize_iq4_xs(const float *x, uint8_t *y, uint64_t nb) {
    for (uint64_t i = 0; i < nb; i++, x += PD_QK_K, y += CPU_IQ4_XS_BYTES) {
        /* each sub-block's extreme maps to the value -127; the largest
         * scale to the code -32 */
        float scales[8];
        for (int j = 0; j < 8; j++) scales[j] = signed_amax(x + 32 * j, 32) / -127.0f;
        const float d = cpu_store_half(y, signed_amax(scales, 8) / -32.0f);
        unsigned scales_h = 0;
        uint8_t *scales_l = y + 4, *qs = y + 8;
        memset(scales_l, 0, 4);
        for (int j = 0; j < 8; j++) {
            const float *xs = x + 32 * j;
            int c = 0;
            if (d != 0.0f) {
                const int c0 = cpu_round_clamp(scales[j] / d, -32, 31);
                float best = INFINITY;
                for (int a = -2; a <= 2; a++) {
                    if (c0 + a < -32 || c0 + a > 31) continue;
                    const float e = iq4_err(xs, d * (float)(c0 + a));
                    if (e < best) {
                        best = e;
                        c = c0 + a;
                    }
                }
            }
            const unsigned ls = (unsigned)(c + 32);
            scales_l[j / 2] = (uint8_t)(scales_l[j / 2] | ((ls & 0x0fu) << (4 * (j % 2))));
            scales_h |= (ls >> 4) << (2 * j);
            const float dl = d * (float)c;
            for (int l = 0; l < 16; l++) {
                /* a zero scale: every code decodes to 0; take the smallest */
                const int lo = dl != 0.0f ? iq4_nearest(xs[l] / dl) : 8;
                const int hi = dl != 0.0f ? iq4_nearest(xs[l + 16] / dl) : 8;
                qs[16 * j + l] = (uint8_t)(lo | (hi << 4));
            }
        }
        y[2] = (uint8_t)(scales_h & 0xffu);
        y[3] = (uint8_t)(scales_h >> 8);
    }
}

void cpu_dequantize_iq4_xs(const uint8_t *x, float *y, uint64_t nb) {
    for (uint64_t i = 0; i < nb; i++, x += CPU_IQ4_XS_BYTES) {
        const float d = cpu_load_half(x);
        const unsigned scales_h = cpu_load_u16(x + 2);
        const uint8_t *scales_l = x + 4, *qs = x + 8;
        for (int ib = 0; ib < 8; ib++, qs += 16, y += 32) {
            const int ls = (int)(((scales_l[ib / 2] >> (4 * (ib % 2))) & 0x0fu) | (((scales_h >> (2 * ib)) & 3u) << 4));
            const float dl = d * (float)(ls - 32);
            for (int l = 0; l < 16; l++) {
                y[l] = dl * (float)cpu_iq4nl_values[qs[l] & 0x0fu];
                y[l + 16] = dl * (float)cpu_iq4nl_values[qs[l] >> 4];
            }
        }
    }
}
