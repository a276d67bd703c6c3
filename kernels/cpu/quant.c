/* Reference (portable, scalar) quantize/dequantize of one row.
 *
 * Block layouts are exactly ggml's, byte for byte, so GGUF files produced by
 * llama.cpp read correctly here and files we write load in llama.cpp:
 *
 *   q8_0  (34 B / 32):  fp16 d; int8 qs[32]                      x = qs*d
 *   q4_0  (18 B / 32):  fp16 d; uint8 qs[16]                     x = (q-8)*d
 *                       qs[j] low nibble = element j, high nibble = element j+16
 *   q4_K (144 B / 256): fp16 d; fp16 dmin; uint8 scales[12]; uint8 qs[128]
 *                       8 sub-blocks of 32 with 6-bit scale sc and min m
 *                       (packed as in get_scale_min_k4); each 64 elements use
 *                       32 bytes of qs: low nibbles first 32, high nibbles
 *                       next 32; x = d*sc*q - dmin*m
 *   q6_K (210 B / 256): uint8 ql[128]; uint8 qh[64]; int8 scales[16]; fp16 d
 *                       16 sub-blocks of 16; x = d*scale*(q-32), q 6 bits
 *
 * The dequantizers perform the same float operations in the same order as
 * ggml's dequantize_row_* so results are bit-identical. Products are kept in
 * separate statements so no compiler contracts them into an FMA.
 *
 * The quantizers are simple round-to-nearest ones (with a small scale search
 * for the k-quants); they produce valid blocks whose dequantization is close
 * to the input, not necessarily the bytes llama-quantize would produce. They
 * quantize against the fp16-rounded scales actually stored, which keeps the
 * error within half a quantization step.
 *
 * q4_1, q5_0, q5_1 and iq4_nl live in quant_q32.c, q2_K, q3_K, q5_K and
 * iq4_xs in quant_kq.c, made the same way. */
#include "kernels/cpu/cpu_internal.h"

#include <math.h>
#include <string.h>

#include "kernels/cpu/cpu_internal.h"

#define QK4_0 32
#define QK8_0 32

/* ------------------------------------------------------------------------
 * small helpers
 * ------------------------------------------------------------------------ */

static inline void store_u16(uint8_t *p, uint16_t v) {
    p[0] = (uint8_t)(v & 0xffu);
    p[1] = (uint8_t)(v >> 8);
}

/* ------------------------------------------------------------------------
 * q8_0
 * ------------------------------------------------------------------------ */

static void quantize_q8_0(const float *x, uint8_t *y, uint64_t nb) {
    for (uint64_t i = 0; i < nb; i++, x += QK8_0, y += CPU_Q8_0_BYTES) {
        float amax = 0.0f;
        for (int j = 0; j < QK8_0; j++) {
            const float a = fabsf(x[j]);
            if (a > amax) amax = a;
        }
        const float d = cpu_store_half(y, amax / 127.0f);
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < QK8_0; j++) {
            const int q = cpu_round_clamp(x[j] * id, -127, 127);
            const int8_t q8 = (int8_t)q;
            memcpy(y + 2 + j, &q8, 1);
        }
    }
}

static void dequantize_q8_0(const uint8_t *x, float *y, uint64_t nb) {
    for (uint64_t i = 0; i < nb; i++, x += CPU_Q8_0_BYTES, y += QK8_0) {
        const float d = cpu_load_half(x);
        for (int j = 0; j < QK8_0; j++) {
            int8_t q;
            memcpy(&q, x + 2 + j, 1);
            y[j] = (float)q * d;
        }
    }
}

/* ------------------------------------------------------------------------
 * q4_0
 * ------------------------------------------------------------------------ */

static void quantize_q4_0(const float *x, uint8_t *y, uint64_t nb) {
    for (uint64_t i = 0; i < nb; i++, x += QK4_0, y += CPU_Q4_0_BYTES) {
        /* The element of largest magnitude maps to -8 exactly, which uses
         * the asymmetric range [-8, 7] to its fullest (as ggml does). */
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < QK4_0; j++) {
            const float a = fabsf(x[j]);
            if (a > amax) {
                amax = a;
                max = x[j];
            }
        }
        const float d = cpu_store_half(y, max / -8.0f);
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        for (int j = 0; j < QK4_0 / 2; j++) {
            const int q0 = cpu_round_clamp(x[j] * id, -8, 7) + 8;
            const int q1 = cpu_round_clamp(x[j + QK4_0 / 2] * id, -8, 7) + 8;
            y[2 + j] = (uint8_t)((unsigned)q0 | ((unsigned)q1 << 4));
        }
    }
}

static void dequantize_q4_0(const uint8_t *x, float *y, uint64_t nb) {
    for (uint64_t i = 0; i < nb; i++, x += CPU_Q4_0_BYTES, y += QK4_0) {
        const float d = cpu_load_half(x);
        for (int j = 0; j < QK4_0 / 2; j++) {
            const int q0 = (int)(x[2 + j] & 0x0fu) - 8;
            const int q1 = (int)(x[2 + j] >> 4) - 8;
            y[j] = (float)q0 * d;
            y[j + QK4_0 / 2] = (float)q1 * d;
        }
    }
}

/* ------------------------------------------------------------------------
 * q4_K
 * ------------------------------------------------------------------------ */

/* Squared error of sub-block x[0..32) coded with step dl and offset dm. */
static float q4k_sub_err(const float *x, float dl, float dm) {
    float e = 0.0f;
    for (int l = 0; l < 32; l++) {
        int q = 0;
        if (dl != 0.0f) q = cpu_round_clamp((x[l] + dm) / dl, 0, 15);
        const float p = dl * (float)q;
        const float v = p - dm;
        e += (v - x[l]) * (v - x[l]);
    }
    return e;
}

static void quantize_q4_K(const float *x, uint8_t *y, uint64_t nb) {
    for (uint64_t i = 0; i < nb; i++, x += PD_QK_K, y += CPU_Q4_K_BYTES) {
        float scales[8], mins[8];
        float max_scale = 0.0f, max_min = 0.0f;
        for (int j = 0; j < 8; j++) {
            const float *xs = x + 32 * j;
            float lo = xs[0], hi = xs[0];
            for (int l = 1; l < 32; l++) {
                if (xs[l] < lo) lo = xs[l];
                if (xs[l] > hi) hi = xs[l];
            }
            if (!(lo < 0.0f)) lo = 0.0f; /* mins are subtracted: offset >= 0 */
            if (!(hi > lo)) hi = lo;
            scales[j] = (hi - lo) / 15.0f;
            mins[j] = -lo;
            if (scales[j] > max_scale) max_scale = scales[j];
            if (mins[j] > max_min) max_min = mins[j];
        }
        uint8_t *s = y + 4;
        memset(s, 0, 12);
        const float d = cpu_store_half(y, max_scale / 63.0f);
        const float dmin = cpu_store_half(y + 2, max_min / 63.0f);

        uint8_t L[PD_QK_K];
        for (int j = 0; j < 8; j++) {
            const float *xs = x + 32 * j;
            /* Try the neighbouring 6-bit codes of the scale and the min and
             * keep the pair with the least squared error. */
            int ls0 = d != 0.0f ? cpu_round_clamp(scales[j] / d, 0, 63) : 0;
            int lm0 = dmin != 0.0f ? cpu_round_clamp(mins[j] / dmin, 0, 63) : 0;
            int best_ls = ls0, best_lm = lm0;
            float best_e = INFINITY;
            for (int a = -1; a <= 1; a++) {
                for (int b = -1; b <= 1; b++) {
                    const int ls = ls0 + a, lm = lm0 + b;
                    if (ls < 0 || ls > 63 || lm < 0 || lm > 63) continue;
                    const float e = q4k_sub_err(xs, d * (float)ls, dmin * (float)lm);
                    if (e < best_e) {
                        best_e = e;
                        best_ls = ls;
                        best_lm = lm;
                    }
                }
            }
            cpu_q4k_pack_scale_min(j, s, (uint8_t)best_ls, (uint8_t)best_lm);
            /* Quantize against exactly what the dequantizer will compute. */
            uint8_t sc, m;
            cpu_q4k_scale_min(j, s, &sc, &m);
            const float dl = d * (float)sc;
            const float dm = dmin * (float)m;
            for (int l = 0; l < 32; l++)
                L[32 * j + l] = (uint8_t)(dl != 0.0f ? cpu_round_clamp((xs[l] + dm) / dl, 0, 15) : 0);
        }
        uint8_t *q = y + 16;
        for (int j = 0; j < PD_QK_K; j += 64) {
            for (int l = 0; l < 32; l++) q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
            q += 32;
        }
    }
}

static void dequantize_q4_K(const uint8_t *x, float *y, uint64_t nb) {
    for (uint64_t i = 0; i < nb; i++, x += CPU_Q4_K_BYTES) {
        const float d = cpu_load_half(x);
        const float min = cpu_load_half(x + 2);
        const uint8_t *s = x + 4;
        const uint8_t *q = x + 16;
        for (int j = 0; j < 8; j += 2) {
            uint8_t sc, m;
            cpu_q4k_scale_min(j, s, &sc, &m);
            const float d1 = d * (float)sc;
            const float m1 = min * (float)m;
            cpu_q4k_scale_min(j + 1, s, &sc, &m);
            const float d2 = d * (float)sc;
            const float m2 = min * (float)m;
            for (int l = 0; l < 32; l++) {
                const float p = d1 * (float)(q[l] & 0x0fu);
                *y++ = p - m1;
            }
            for (int l = 0; l < 32; l++) {
                const float p = d2 * (float)(q[l] >> 4);
                *y++ = p - m2;
            }
            q += 32;
        }
    }
}

/* ------------------------------------------------------------------------
 * q6_K
 * ------------------------------------------------------------------------ */

static float q6k_sub_err(const float *x, float dl) {
    float e = 0.0f;
    for (int l = 0; l < 16; l++) {
        int q = 0;
        if (dl != 0.0f) q = cpu_round_clamp(x[l] / dl, -32, 31);
        const float v = dl * (float)q;
        e += (v - x[l]) * (v - x[l]);
    }
    return e;
}

static void quantize_q6_K(const float *x, uint8_t *y, uint64_t nb) {
    for (uint64_t i = 0; i < nb; i++, x += PD_QK_K, y += CPU_Q6_K_BYTES) {
        uint8_t *ql = y;
        uint8_t *qh = y + 128;
        uint8_t *sc8 = y + 192;
        uint8_t *dp = y + 208;

        /* Per sub-block of 16: the element of largest magnitude maps to -32
         * (range [-32, 31]). The sub-block scale of largest magnitude then
         * maps to the int8 code -128. */
        float scales[16];
        float max_scale = 0.0f, max_abs = 0.0f;
        for (int j = 0; j < 16; j++) {
            float amax = 0.0f, mx = 0.0f;
            for (int l = 0; l < 16; l++) {
                const float a = fabsf(x[16 * j + l]);
                if (a > amax) {
                    amax = a;
                    mx = x[16 * j + l];
                }
            }
            scales[j] = mx / -32.0f;
            if (amax > max_abs) {
                max_abs = amax;
                max_scale = scales[j];
            }
        }
        const float d = cpu_store_half(dp, max_scale / -128.0f);

        int8_t L[PD_QK_K];
        for (int j = 0; j < 16; j++) {
            const float *xs = x + 16 * j;
            int8_t code = 0;
            if (d != 0.0f) {
                const int c0 = cpu_round_clamp(scales[j] / d, -128, 127);
                float best_e = INFINITY;
                for (int a = -1; a <= 1; a++) {
                    const int c = c0 + a;
                    if (c < -128 || c > 127) continue;
                    const float e = q6k_sub_err(xs, d * (float)c);
                    if (e < best_e) {
                        best_e = e;
                        code = (int8_t)c;
                    }
                }
            }
            memcpy(sc8 + j, &code, 1);
            const float dl = d * (float)code;
            for (int l = 0; l < 16; l++)
                L[16 * j + l] = (int8_t)(dl != 0.0f ? cpu_round_clamp(xs[l] / dl, -32, 31) : 0);
        }

        for (int j = 0; j < PD_QK_K; j += 128) {
            for (int l = 0; l < 32; l++) {
                const unsigned q1 = (unsigned)(L[j + l + 0] + 32);
                const unsigned q2 = (unsigned)(L[j + l + 32] + 32);
                const unsigned q3 = (unsigned)(L[j + l + 64] + 32);
                const unsigned q4 = (unsigned)(L[j + l + 96] + 32);
                ql[l] = (uint8_t)((q1 & 0x0fu) | ((q3 & 0x0fu) << 4));
                ql[l + 32] = (uint8_t)((q2 & 0x0fu) | ((q4 & 0x0fu) << 4));
                qh[l] = (uint8_t)((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6));
            }
            ql += 64;
            qh += 32;
        }
    }
}

static void dequantize_q6_K(const uint8_t *x, float *y, uint64_t nb) {
    for (uint64_t i = 0; i < nb; i++, x += CPU_Q6_K_BYTES) {
        const float d = cpu_load_half(x + 208);
        const uint8_t *ql = x;
        const uint8_t *qh = x + 128;
        const uint8_t *scb = x + 192;
        for (int n = 0; n < PD_QK_K; n += 128) {
            int8_t sc[8];
            memcpy(sc, scb, 8);
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                const int q1 = (int)((ql[l] & 0x0fu) | (((qh[l] >> 0) & 3u) << 4)) - 32;
                const int q2 = (int)((ql[l + 32] & 0x0fu) | (((qh[l] >> 2) & 3u) << 4)) - 32;
                const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3u) << 4)) - 32;
                const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3u) << 4)) - 32;
                const float s1 = d * (float)sc[is + 0];
                const float s2 = d * (float)sc[is + 2];
                const float s3 = d * (float)sc[is + 4];
                const float s4 = d * (float)sc[is + 6];
                y[l + 0] = s1 * (float)q1;
                y[l + 32] = s2 * (float)q2;
                y[l + 64] = s3 * (float)q3;
                y[l + 96] = s4 * (float)q4;
            }
            y += 128;
            ql += 64;
            qh += 32;
            scb += 8;
        }
    }
}

/* ------------------------------------------------------------------------
 * plain types and dispatch
 * ------------------------------------------------------------------------ */

/* Validate (t, n) for the direction asked; on success *nb = blocks. */
static int check_row(pd_type t, uint64_t n, bool quantize, uint64_t *nb, pd_error *err) {
    const pd_type_traits *tr = pd_type_get((uint32_t)t);
    if (!tr) return pd_errorf(err, PD_EINVAL, "unknown tensor type id %u", (unsigned)t);
    if (quantize ? !tr->can_quantize : !tr->can_dequantize)
        return pd_errorf(err, PD_EUNSUPPORTED,
                         "%s of type %s is not implemented (supported: f32, f16, bf16, q8_0, "
                         "q4_0, q4_1, q5_0, q5_1, iq4_nl, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_xs)",
                         quantize ? "quantizing to" : "dequantizing from", tr->name);
    if (n % tr->block_size != 0)
        return pd_errorf(err, PD_EINVAL,
                         "row of %llu elements is not a multiple of the %s block size %u",
                         (unsigned long long)n, tr->name, tr->block_size);
    *nb = n / tr->block_size;
    return PD_OK;
}

int pd_quantize_row(pd_type t, const float *src, void *dst, uint64_t n, pd_error *err) {
    uint64_t nb;
    int rc = check_row(t, n, true, &nb, err);
    if (rc) return rc;
    if (n == 0) return PD_OK;
    if (!src || !dst) return pd_errorf(err, PD_EINVAL, "pd_quantize_row: NULL buffer");
    uint8_t *y = dst;
    switch (t) {
    case PD_TYPE_F32:
        memmove(y, src, n * sizeof(float));
        return PD_OK;
    case PD_TYPE_F16:
        for (uint64_t i = 0; i < n; i++) store_u16(y + 2 * i, pd_fp32_to_fp16(src[i]));
        return PD_OK;
    case PD_TYPE_BF16:
        for (uint64_t i = 0; i < n; i++) store_u16(y + 2 * i, pd_fp32_to_bf16(src[i]));
        return PD_OK;
    case PD_TYPE_Q8_0: quantize_q8_0(src, y, nb); return PD_OK;
    case PD_TYPE_Q4_0: quantize_q4_0(src, y, nb); return PD_OK;
    case PD_TYPE_Q4_K: quantize_q4_K(src, y, nb); return PD_OK;
    case PD_TYPE_Q6_K: quantize_q6_K(src, y, nb); return PD_OK;
    case PD_TYPE_Q2_K: cpu_quantize_q2_K(src, y, nb); return PD_OK;
    case PD_TYPE_Q3_K: cpu_quantize_q3_K(src, y, nb); return PD_OK;
    case PD_TYPE_Q5_K: cpu_quantize_q5_K(src, y, nb); return PD_OK;
    case PD_TYPE_IQ4_XS: cpu_quantize_iq4_xs(src, y, nb); return PD_OK;
    default:
        if (cpu_quantize_q32(t, src, y, nb)) return PD_OK;
        break;
    }
    return pd_errorf(err, PD_EUNSUPPORTED, "quantizing to type %s is not implemented",
                     pd_type_get((uint32_t)t)->name);
}

int pd_dequantize_row(pd_type t, const void *src, float *dst, uint64_t n, pd_error *err) {
    uint64_t nb;
    int rc = check_row(t, n, false, &nb, err);
    if (rc) return rc;
    if (n == 0) return PD_OK;
    if (!src || !dst) return pd_errorf(err, PD_EINVAL, "pd_dequantize_row: NULL buffer");
    const uint8_t *x = src;
    switch (t) {
    case PD_TYPE_F32:
        memmove(dst, x, n * sizeof(float));
        return PD_OK;
    case PD_TYPE_F16:
        for (uint64_t i = 0; i < n; i++) dst[i] = pd_fp16_to_fp32(cpu_load_u16(x + 2 * i));
        return PD_OK;
    case PD_TYPE_BF16:
        for (uint64_t i = 0; i < n; i++) dst[i] = pd_bf16_to_fp32(cpu_load_u16(x + 2 * i));
        return PD_OK;
    case PD_TYPE_Q8_0: dequantize_q8_0(x, dst, nb); return PD_OK;
    case PD_TYPE_Q4_0: dequantize_q4_0(x, dst, nb); return PD_OK;
    case PD_TYPE_Q4_K: dequantize_q4_K(x, dst, nb); return PD_OK;
    case PD_TYPE_Q6_K: dequantize_q6_K(x, dst, nb); return PD_OK;
    case PD_TYPE_Q2_K: cpu_dequantize_q2_K(x, dst, nb); return PD_OK;
    case PD_TYPE_Q3_K: cpu_dequantize_q3_K(x, dst, nb); return PD_OK;
    case PD_TYPE_Q5_K: cpu_dequantize_q5_K(x, dst, nb); return PD_OK;
    case PD_TYPE_IQ4_XS: cpu_dequantize_iq4_xs(x, dst, nb); return PD_OK;
    default:
        if (cpu_dequantize_q32(t, x, dst, nb)) return PD_OK;
        break;
    }
    return pd_errorf(err, PD_EUNSUPPORTED, "dequantizing from type %s is not implemented",
                     pd_type_get((uint32_t)t)->name);
}
