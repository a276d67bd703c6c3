/* kernels: type table, fp16/bf16 conversions, quantize/dequantize. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "kernels/kernels.h"

static uint32_t fbits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float ffrom(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* xorshift64* and a Box-Muller normal: test data only. */
static uint64_t rng_next(uint64_t *s) {
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545f4914f6cdd1dull;
}

static double rng_unit(uint64_t *s) {
    return ((double)(rng_next(s) >> 11) + 0.5) / 9007199254740992.0;
}

static float rng_normal(uint64_t *s) {
    const double u1 = rng_unit(s), u2 = rng_unit(s);
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

/* ------------------------------------------------------------------------
 * type table
 * ------------------------------------------------------------------------ */

Test(types, table_sizes_match_ggml) {
    const struct {
        pd_type t;
        const char *name;
        uint32_t bs, ts;
    } want[] = {
        {PD_TYPE_F32, "f32", 1, 4},      {PD_TYPE_F16, "f16", 1, 2},       {PD_TYPE_BF16, "bf16", 1, 2},
        {PD_TYPE_Q8_0, "q8_0", 32, 34},  {PD_TYPE_Q4_0, "q4_0", 32, 18},   {PD_TYPE_Q4_K, "q4_k", 256, 144},
        {PD_TYPE_Q6_K, "q6_k", 256, 210},  {PD_TYPE_Q2_K, "q2_k", 256, 84},   {PD_TYPE_Q3_K, "q3_k", 256, 110},
        {PD_TYPE_Q5_K, "q5_k", 256, 176},  {PD_TYPE_IQ4_XS, "iq4_xs", 256, 136}, {PD_TYPE_Q4_1, "q4_1", 32, 20},
        {PD_TYPE_Q5_0, "q5_0", 32, 22},    {PD_TYPE_Q5_1, "q5_1", 32, 24},  {PD_TYPE_IQ4_NL, "iq4_nl", 32, 18},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const pd_type_traits *tr = pd_type_get(want[i].t);
        cr_assert_not_null(tr, "type %d missing", (int)want[i].t);
        cr_expect_str_eq(tr->name, want[i].name);
        cr_expect_eq(tr->block_size, want[i].bs, "%s block size", want[i].name);
        cr_expect_eq(tr->type_size, want[i].ts, "%s type size", want[i].name);
        cr_expect(tr->can_quantize && tr->can_dequantize, "%s should be supported both ways", want[i].name);
    }
    /* ggml ids are fixed by the file format */
    cr_expect_eq(PD_TYPE_Q4_K, 12);
    cr_expect_eq(PD_TYPE_Q6_K, 14);
    cr_expect_eq(PD_TYPE_Q2_K, 10);
    cr_expect_eq(PD_TYPE_Q3_K, 11);
    cr_expect_eq(PD_TYPE_Q5_K, 13);
    cr_expect_eq(PD_TYPE_IQ4_XS, 23);
    cr_expect_eq(PD_TYPE_BF16, 30);
    uint64_t sz = 0;
    cr_assert_eq(pd_type_row_size(PD_TYPE_Q4_K, 4096, &sz, NULL), PD_OK);
    cr_expect_eq(sz, 16 * 144);
    cr_assert_eq(pd_type_row_size(PD_TYPE_Q6_K, 512, &sz, NULL), PD_OK);
    cr_expect_eq(sz, 420);
    cr_assert_eq(pd_type_row_size(PD_TYPE_Q8_0, 64, &sz, NULL), PD_OK);
    cr_expect_eq(sz, 68);
}

/* ------------------------------------------------------------------------
 * fp16
 * ------------------------------------------------------------------------ */

Test(half, fp16_to_fp32_known_patterns) {
    cr_expect_eq(fbits(pd_fp16_to_fp32(0x0000)), 0x00000000u);
    cr_expect_eq(fbits(pd_fp16_to_fp32(0x8000)), 0x80000000u, "negative zero keeps its sign");
    cr_expect_eq(pd_fp16_to_fp32(0x3c00), 1.0f);
    cr_expect_eq(pd_fp16_to_fp32(0xc000), -2.0f);
    cr_expect_eq(pd_fp16_to_fp32(0x3555), 0.333251953125f);
    cr_expect_eq(pd_fp16_to_fp32(0x7bff), 65504.0f);
    cr_expect_eq(pd_fp16_to_fp32(0x0400), ldexpf(1.0f, -14), "smallest normal");
    cr_expect_eq(pd_fp16_to_fp32(0x0001), ldexpf(1.0f, -24), "smallest subnormal");
    cr_expect_eq(pd_fp16_to_fp32(0x03ff), ldexpf(1023.0f, -24), "largest subnormal");
    cr_expect_eq(pd_fp16_to_fp32(0x8200), -ldexpf(512.0f, -24));
    cr_expect(isinf(pd_fp16_to_fp32(0x7c00)) && pd_fp16_to_fp32(0x7c00) > 0);
    cr_expect(isinf(pd_fp16_to_fp32(0xfc00)) && pd_fp16_to_fp32(0xfc00) < 0);
    cr_expect(isnan(pd_fp16_to_fp32(0x7e00)));
    cr_expect(isnan(pd_fp16_to_fp32(0x7c01)), "signalling NaN stays NaN");
    cr_expect(isnan(pd_fp16_to_fp32(0xfe00)));
}

Test(half, fp32_to_fp16_rounding) {
    cr_expect_eq(pd_fp32_to_fp16(0.0f), 0x0000);
    cr_expect_eq(pd_fp32_to_fp16(-0.0f), 0x8000);
    cr_expect_eq(pd_fp32_to_fp16(1.0f), 0x3c00);
    cr_expect_eq(pd_fp32_to_fp16(-2.0f), 0xc000);
    cr_expect_eq(pd_fp32_to_fp16(0.1f), 0x2e66);
    cr_expect_eq(pd_fp32_to_fp16(65504.0f), 0x7bff);
    cr_expect_eq(pd_fp32_to_fp16(65519.99f), 0x7bff, "just below the midpoint rounds down");
    cr_expect_eq(pd_fp32_to_fp16(65520.0f), 0x7c00, "midpoint to 65536 rounds to even = inf");
    cr_expect_eq(pd_fp32_to_fp16(1e10f), 0x7c00);
    cr_expect_eq(pd_fp32_to_fp16(-1e10f), 0xfc00);
    cr_expect_eq(pd_fp32_to_fp16(INFINITY), 0x7c00);
    cr_expect_eq(pd_fp32_to_fp16(-INFINITY), 0xfc00);
    /* ties to even in the normal range */
    cr_expect_eq(pd_fp32_to_fp16(1.0f + ldexpf(1.0f, -11)), 0x3c00, "1 + half ulp -> even 1.0");
    cr_expect_eq(pd_fp32_to_fp16(1.0f + 3 * ldexpf(1.0f, -11)), 0x3c02, "1 + 1.5 ulp -> even");
    cr_expect_eq(pd_fp32_to_fp16(ffrom(0x3f801001u)), 0x3c01, "just above half ulp rounds up");
    /* mantissa carry into the exponent */
    cr_expect_eq(pd_fp32_to_fp16(2.0f - ldexpf(1.0f, -12)), 0x4000);
    /* subnormals */
    cr_expect_eq(pd_fp32_to_fp16(ldexpf(1.0f, -24)), 0x0001);
    cr_expect_eq(pd_fp32_to_fp16(ldexpf(1.0f, -25)), 0x0000, "half the smallest subnormal ties to 0");
    cr_expect_eq(pd_fp32_to_fp16(ffrom(0x33000001u)), 0x0001, "just above it rounds up");
    cr_expect_eq(pd_fp32_to_fp16(ldexpf(3.0f, -25)), 0x0002, "1.5 ulp ties to even 2");
    cr_expect_eq(pd_fp32_to_fp16(ldexpf(5.0f, -25)), 0x0002, "2.5 ulp ties to even 2");
    cr_expect_eq(pd_fp32_to_fp16(-ldexpf(1023.0f, -24)), 0x83ff);
    cr_expect_eq(pd_fp32_to_fp16(ldexpf(2047.0f, -25)), 0x0400, "rounds up into the smallest normal");
    cr_expect_eq(pd_fp32_to_fp16(1e-10f), 0x0000);
    cr_expect_eq(pd_fp32_to_fp16(-1e-10f), 0x8000);
    /* NaN stays NaN (exponent all ones, mantissa non-zero) */
    const uint16_t n1 = pd_fp32_to_fp16(NAN);
    cr_expect_eq(n1 & 0x7c00, 0x7c00);
    cr_expect_neq(n1 & 0x03ff, 0);
    const uint16_t n2 = pd_fp32_to_fp16(ffrom(0x7f800001u)); /* payload only in low bits */
    cr_expect_eq(n2 & 0x7c00, 0x7c00);
    cr_expect_neq(n2 & 0x03ff, 0, "a low-payload NaN must not become infinity");
}

Test(half, fp16_round_trip_all_patterns) {
    for (uint32_t h = 0; h < 0x10000u; h++) {
        const float f = pd_fp16_to_fp32((uint16_t)h);
        const uint16_t back = pd_fp32_to_fp16(f);
        if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu)) {
            cr_assert(isnan(f), "0x%04x should be NaN", h);
            cr_assert((back & 0x7c00u) == 0x7c00u && (back & 0x3ffu), "NaN 0x%04x lost", h);
        } else {
            cr_assert_eq(back, h, "0x%04x -> %a -> 0x%04x", h, (double)f, back);
        }
    }
}

/* For random floats the result must be the nearest half, ties to even. */
Test(half, fp32_to_fp16_is_nearest) {
    uint64_t s = 0x1234567;
    for (int i = 0; i < 200000; i++) {
        /* exponents spanning subnormal..overflow */
        const uint32_t u = (uint32_t)(rng_next(&s) & 0x807fffffu) | ((uint32_t)(100 + rng_next(&s) % 44) << 23);
        const float f = ffrom(u);
        const uint16_t h = pd_fp32_to_fp16(f);
        const double x = f, y = pd_fp16_to_fp32(h);
        if (isinf(y)) {
            cr_assert(fabs(x) >= 65520.0, "%a overflowed", x);
            continue;
        }
        const double err = fabs(y - x);
        const uint16_t mag = h & 0x7fffu;
        const uint16_t sgn = h & 0x8000u;
        if (mag < 0x7bff) {
            const double up = pd_fp16_to_fp32((uint16_t)(sgn | (mag + 1)));
            cr_assert(err <= fabs(up - x), "%a -> 0x%04x is not nearest", x, h);
            if (err == fabs(up - x)) cr_assert((mag & 1) == 0, "%a: tie not to even", x);
        }
        if (mag > 0) {
            const double dn = pd_fp16_to_fp32((uint16_t)(sgn | (mag - 1)));
            cr_assert(err <= fabs(dn - x), "%a -> 0x%04x is not nearest", x, h);
            if (err == fabs(dn - x)) cr_assert((mag & 1) == 0, "%a: tie not to even", x);
        }
    }
}

/* ------------------------------------------------------------------------
 * bf16
 * ------------------------------------------------------------------------ */

Test(half, bf16_known_patterns) {
    cr_expect_eq(pd_bf16_to_fp32(0x3f80), 1.0f);
    cr_expect_eq(pd_bf16_to_fp32(0x4049), 3.140625f);
    cr_expect_eq(fbits(pd_bf16_to_fp32(0x8000)), 0x80000000u);
    cr_expect(isinf(pd_bf16_to_fp32(0xff80)));
    cr_expect(isnan(pd_bf16_to_fp32(0x7fc1)));

    cr_expect_eq(pd_fp32_to_bf16(1.0f), 0x3f80);
    cr_expect_eq(pd_fp32_to_bf16(-0.0f), 0x8000);
    cr_expect_eq(pd_fp32_to_bf16(3.14159265f), 0x4049);
    cr_expect_eq(pd_fp32_to_bf16(ffrom(0x3f808000u)), 0x3f80, "tie to even (down)");
    cr_expect_eq(pd_fp32_to_bf16(ffrom(0x3f818000u)), 0x3f82, "tie to even (up)");
    cr_expect_eq(pd_fp32_to_bf16(ffrom(0x3f808001u)), 0x3f81, "above tie rounds up");
    cr_expect_eq(pd_fp32_to_bf16(ffrom(0x3f807fffu)), 0x3f80, "below tie rounds down");
    cr_expect_eq(pd_fp32_to_bf16(ffrom(0x3fffffffu)), 0x4000, "carry into exponent");
    cr_expect_eq(pd_fp32_to_bf16(ffrom(0x7f7fffffu)), 0x7f80, "FLT_MAX rounds to inf");
    cr_expect_eq(pd_fp32_to_bf16(INFINITY), 0x7f80);
    cr_expect_eq(pd_fp32_to_bf16(-INFINITY), 0xff80);
    cr_expect_eq(pd_fp32_to_bf16(ffrom(0x00000001u)), 0x0000, "tiny subnormal rounds to 0");
    cr_expect_eq(pd_fp32_to_bf16(ffrom(0x00018000u)), 0x0002, "subnormal tie to even");
    const uint16_t n1 = pd_fp32_to_bf16(NAN);
    cr_expect(isnan(pd_bf16_to_fp32(n1)));
    const uint16_t n2 = pd_fp32_to_bf16(ffrom(0x7f800001u)); /* payload below bit 16 */
    cr_expect(isnan(pd_bf16_to_fp32(n2)), "signalling NaN must not become inf (got 0x%04x)", n2);
    const uint16_t n3 = pd_fp32_to_bf16(ffrom(0xffffffffu)); /* would overflow a naive rounding add */
    cr_expect(isnan(pd_bf16_to_fp32(n3)));
}

Test(half, bf16_round_trip) {
    for (uint32_t h = 0; h < 0x10000u; h++) {
        const float f = pd_bf16_to_fp32((uint16_t)h);
        const uint16_t back = pd_fp32_to_bf16(f);
        if (isnan(f))
            cr_assert(isnan(pd_bf16_to_fp32(back)));
        else
            cr_assert_eq(back, h, "0x%04x", h);
    }
}

/* ------------------------------------------------------------------------
 * quantization: errors
 * ------------------------------------------------------------------------ */

Test(quant, rejects_bad_arguments) {
    float x[64] = {0};
    uint8_t buf[512];
    pd_error err = {0};
    cr_expect_eq(pd_quantize_row(PD_TYPE_Q8_0, x, buf, 33, &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "block size") != NULL, "message: %s", err.msg);
    cr_expect_eq(pd_dequantize_row(PD_TYPE_Q4_K, buf, x, 64, &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "256") != NULL, "message: %s", err.msg);
    cr_expect_eq(pd_quantize_row(PD_TYPE_IQ2_XXS, x, buf, 256, &err), PD_EUNSUPPORTED);
    cr_expect(strstr(err.msg, "iq2_xxs") != NULL, "message: %s", err.msg);
    cr_expect_eq(pd_dequantize_row(PD_TYPE_Q8_1, buf, x, 32, &err), PD_EUNSUPPORTED);
    cr_expect(strstr(err.msg, "q8_1") != NULL, "message: %s", err.msg);
    cr_expect_eq(pd_quantize_row((pd_type)99, x, buf, 32, &err), PD_EINVAL);
    cr_expect_eq(pd_quantize_row((pd_type)4, x, buf, 32, &err), PD_EINVAL, "id 4 is not a type");
    cr_expect_eq(pd_quantize_row(PD_TYPE_Q8_0, x, buf, 0, &err), PD_OK, "empty row is fine");
}

/* ------------------------------------------------------------------------
 * quantization: hand-built blocks decoded with ggml's formulas
 * ------------------------------------------------------------------------ */

Test(quant, q8_0_known_block) {
    uint8_t blk[34];
    blk[0] = 0x00; /* d = fp16 0x3800 = 0.5 */
    blk[1] = 0x38;
    for (int j = 0; j < 32; j++) {
        const int8_t q = (int8_t)(j == 31 ? 127 : 8 * j - 128); /* -128 ... 127 */
        memcpy(&blk[2 + j], &q, 1);
    }
    float y[32];
    cr_assert_eq(pd_dequantize_row(PD_TYPE_Q8_0, blk, y, 32, NULL), PD_OK);
    for (int j = 0; j < 32; j++) {
        const int q = j == 31 ? 127 : 8 * j - 128;
        cr_expect_eq(y[j], (float)q * 0.5f, "element %d", j);
    }
    cr_expect_eq(y[0], -64.0f);
    cr_expect_eq(y[31], 63.5f);
    cr_expect_eq(y[16], 0.0f);
}

Test(quant, q8_0_quantize_known_bytes) {
    float x[32];
    for (int j = 0; j < 32; j++) x[j] = (float)(j - 16) * 0.25f; /* amax 4.0 at j=0 */
    uint8_t blk[34];
    cr_assert_eq(pd_quantize_row(PD_TYPE_Q8_0, x, blk, 32, NULL), PD_OK);
    const uint16_t d16 = (uint16_t)(blk[0] | (blk[1] << 8));
    cr_expect_eq(d16, pd_fp32_to_fp16(4.0f / 127.0f));
    int8_t q0, q16;
    memcpy(&q0, &blk[2], 1);
    memcpy(&q16, &blk[2 + 16], 1);
    cr_expect_eq(q0, -127, "amax maps to -127");
    cr_expect_eq(q16, 0);
}

Test(quant, q4_0_known_block) {
    uint8_t blk[18];
    blk[0] = 0x00; /* d = fp16 0x4000 = 2.0 */
    blk[1] = 0x40;
    for (int j = 0; j < 16; j++) blk[2 + j] = (uint8_t)(j | ((15 - j) << 4));
    float y[32];
    cr_assert_eq(pd_dequantize_row(PD_TYPE_Q4_0, blk, y, 32, NULL), PD_OK);
    for (int j = 0; j < 16; j++) {
        cr_expect_eq(y[j], (float)(j - 8) * 2.0f, "low nibble -> element %d", j);
        cr_expect_eq(y[j + 16], (float)(15 - j - 8) * 2.0f, "high nibble -> element %d", j + 16);
    }
    cr_expect_eq(y[0], -16.0f);
    cr_expect_eq(y[16], 14.0f);
}

Test(quant, q4_0_quantize_known_bytes) {
    float x[32];
    for (int j = 0; j < 32; j++) x[j] = 0.0f;
    x[0] = -8.0f; /* the largest magnitude maps to -8: d = 1 */
    x[1] = 3.0f;
    x[17] = 7.0f;
    x[20] = -2.4f;
    uint8_t blk[18];
    cr_assert_eq(pd_quantize_row(PD_TYPE_Q4_0, x, blk, 32, NULL), PD_OK);
    cr_expect_eq(blk[0] | (blk[1] << 8), 0x3c00, "d = 1.0");
    cr_expect_eq(blk[2 + 0], (uint8_t)(0 | (8 << 4)), "elements 0 and 16");
    cr_expect_eq(blk[2 + 1], (uint8_t)(11 | (15 << 4)), "elements 1 and 17");
    cr_expect_eq(blk[2 + 4], (uint8_t)(8 | (6 << 4)), "elements 4 and 20");
}

/* The q4_K block below uses these 6-bit scales and mins per sub-block of 32. */
static const uint8_t q4k_sc[8] = {1, 2, 3, 4, 17, 33, 63, 0};
static const uint8_t q4k_m[8] = {0, 1, 5, 7, 16, 40, 63, 9};
/* ... packed by hand following get_scale_min_k4:
 * bytes 0-3: sc[0..3] | (sc[4..7] >> 4) << 6
 * bytes 4-7: m[0..3]  | (m[4..7]  >> 4) << 6
 * bytes 8-11: (sc[4..7] & 15) | (m[4..7] & 15) << 4 */
static const uint8_t q4k_scales[12] = {0x41, 0x82, 0xC3, 0x04, 0x40, 0x81, 0xC5, 0x07, 0x01, 0x81, 0xFF, 0x90};

Test(quant, q4_K_known_block) {
    uint8_t blk[144];
    blk[0] = 0x00; /* d = 0.5 */
    blk[1] = 0x38;
    blk[2] = 0x00; /* dmin = 0.25 */
    blk[3] = 0x34;
    memcpy(blk + 4, q4k_scales, 12);
    for (int i = 0; i < 128; i++) blk[16 + i] = (uint8_t)(i * 7 + 3);
    float y[256];
    cr_assert_eq(pd_dequantize_row(PD_TYPE_Q4_K, blk, y, 256, NULL), PD_OK);
    for (int e = 0; e < 256; e++) {
        const int sub = e / 32;          /* sub-block: scale/min index */
        const int chunk = e / 64;        /* 32 bytes of qs per 64 elements */
        const int l = e % 32;
        const uint8_t byte = blk[16 + 32 * chunk + l];
        const int q = (sub % 2 == 0) ? (byte & 15) : (byte >> 4);
        const float want = 0.5f * (float)q4k_sc[sub] * (float)q - 0.25f * (float)q4k_m[sub];
        cr_assert_eq(y[e], want, "element %d: got %g want %g", e, (double)y[e], (double)want);
    }
}

static const int8_t q6k_scales[16] = {1, -2, 3, -4, 5, -6, 7, -8, 127, -128, 0, 10, -10, 20, -20, 64};

Test(quant, q6_K_known_block) {
    uint8_t blk[210];
    for (int i = 0; i < 128; i++) blk[i] = (uint8_t)(i * 5 + 1);     /* ql */
    for (int i = 0; i < 64; i++) blk[128 + i] = (uint8_t)(i * 3 + 7); /* qh */
    memcpy(blk + 192, q6k_scales, 16);
    blk[208] = 0x00; /* d = 0.25 */
    blk[209] = 0x34;
    float y[256];
    cr_assert_eq(pd_dequantize_row(PD_TYPE_Q6_K, blk, y, 256, NULL), PD_OK);
    for (int e = 0; e < 256; e++) {
        const int half = e / 128, r = e % 128;
        const int quad = r / 32, l = r % 32;
        const uint8_t lo = blk[64 * half + l + (quad & 1) * 32];
        const int low4 = quad < 2 ? (lo & 15) : (lo >> 4);
        const int hi2 = (blk[128 + 32 * half + l] >> (2 * quad)) & 3;
        const int q = (low4 | (hi2 << 4)) - 32;
        const int8_t sc = q6k_scales[8 * half + l / 16 + 2 * quad];
        const float want = 0.25f * (float)sc * (float)q;
        cr_assert_eq(y[e], want, "element %d: got %g want %g", e, (double)y[e], (double)want);
    }
}

/* ------------------------------------------------------------------------
 * quantization: round trips on random data
 * ------------------------------------------------------------------------ */

#define RT_N 4096

static void fill_normal(float *x, size_t n, uint64_t seed, float scale) {
    uint64_t s = seed;
    for (size_t i = 0; i < n; i++) x[i] = rng_normal(&s) * scale;
}

static double rel_rmse(const float *a, const float *b, size_t n) {
    double se = 0, ss = 0;
    for (size_t i = 0; i < n; i++) {
        se += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        ss += (double)a[i] * a[i];
    }
    return sqrt(se / ss);
}

static void round_trip(pd_type t, const float *x, float *y, uint8_t **q_out) {
    uint64_t bytes;
    cr_assert_eq(pd_type_row_size(t, RT_N, &bytes, NULL), PD_OK);
    /* +1: use an odd address so unaligned access is exercised */
    uint8_t *buf = malloc(bytes + 1);
    cr_assert_not_null(buf);
    pd_error err = {0};
    cr_assert_eq(pd_quantize_row(t, x, buf + 1, RT_N, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_dequantize_row(t, buf + 1, y, RT_N, &err), PD_OK, "%s", err.msg);
    *q_out = buf;
}

Test(quant, f16_bf16_f32_round_trip) {
    static float x[RT_N], y[RT_N];
    fill_normal(x, RT_N, 11, 3.0f);
    uint8_t *q;
    round_trip(PD_TYPE_F32, x, y, &q);
    cr_expect_eq(memcmp(x, y, sizeof x), 0, "f32 is exact");
    free(q);
    round_trip(PD_TYPE_F16, x, y, &q);
    for (int i = 0; i < RT_N; i++)
        cr_assert_leq(fabsf(y[i] - x[i]), fabsf(x[i]) * 0x1p-11f + 0x1p-25f, "f16 element %d", i);
    free(q);
    round_trip(PD_TYPE_BF16, x, y, &q);
    for (int i = 0; i < RT_N; i++)
        cr_assert_leq(fabsf(y[i] - x[i]), fabsf(x[i]) * 0x1p-8f, "bf16 element %d", i);
    free(q);
}

Test(quant, q8_0_error_within_half_step) {
    static float x[RT_N], y[RT_N];
    fill_normal(x, RT_N, 12, 0.02f);
    uint8_t *q;
    round_trip(PD_TYPE_Q8_0, x, y, &q);
    for (int b = 0; b < RT_N / 32; b++) {
        const uint8_t *blk = q + 1 + 34 * b;
        const float d = pd_fp16_to_fp32((uint16_t)(blk[0] | (blk[1] << 8)));
        float amax = 0;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[32 * b + j]));
        cr_assert_leq(fabsf(d - amax / 127.0f), amax / 127.0f * 0x1p-10f, "block %d scale", b);
        for (int j = 0; j < 32; j++)
            cr_assert_leq(fabsf(y[32 * b + j] - x[32 * b + j]), d * 0.5f * 1.0001f, "block %d elem %d", b, j);
    }
    cr_expect_lt(rel_rmse(x, y, RT_N), 0.01);
    free(q);
}

Test(quant, q4_0_error_bounds) {
    static float x[RT_N], y[RT_N];
    fill_normal(x, RT_N, 13, 1.0f);
    uint8_t *q;
    round_trip(PD_TYPE_Q4_0, x, y, &q);
    for (int b = 0; b < RT_N / 32; b++) {
        const uint8_t *blk = q + 1 + 18 * b;
        const float d = fabsf(pd_fp16_to_fp32((uint16_t)(blk[0] | (blk[1] << 8))));
        /* half a step, except values of the opposite sign to the extreme may
         * clip at +7 (a full step at most) */
        for (int j = 0; j < 32; j++)
            cr_assert_leq(fabsf(y[32 * b + j] - x[32 * b + j]), d * 1.0001f, "block %d elem %d", b, j);
    }
    const double e = rel_rmse(x, y, RT_N);
    cr_expect_lt(e, 0.12, "q4_0 relative rmse %g", e);
    free(q);
}

Test(quant, q4_K_rmse) {
    static float x[RT_N], y[RT_N];
    fill_normal(x, RT_N, 14, 0.02f);
    uint8_t *q;
    round_trip(PD_TYPE_Q4_K, x, y, &q);
    const double e = rel_rmse(x, y, RT_N);
    cr_expect_lt(e, 0.11, "q4_K relative rmse %g", e);
    /* every element within about one step of its sub-block */
    for (int b = 0; b < RT_N / 256; b++) {
        const uint8_t *blk = q + 1 + 144 * b;
        const float d = pd_fp16_to_fp32((uint16_t)(blk[0] | (blk[1] << 8)));
        for (int s = 0; s < 8; s++) {
            const uint8_t sc = s < 4 ? (blk[4 + s] & 63) : (uint8_t)((blk[4 + s + 4] & 15) | ((blk[4 + s - 4] >> 6) << 4));
            for (int j = 0; j < 32; j++) {
                const int i = 256 * b + 32 * s + j;
                cr_assert_leq(fabsf(y[i] - x[i]), d * sc * 1.01f + 1e-4f, "elem %d", i);
            }
        }
    }
    free(q);
}

Test(quant, q6_K_rmse) {
    static float x[RT_N], y[RT_N];
    fill_normal(x, RT_N, 15, 0.02f);
    uint8_t *q;
    round_trip(PD_TYPE_Q6_K, x, y, &q);
    const double e = rel_rmse(x, y, RT_N);
    cr_expect_lt(e, 0.03, "q6_K relative rmse %g", e);
    free(q);
}

Test(quant, quantize_special_rows) {
    const pd_type types[] = {PD_TYPE_Q8_0, PD_TYPE_Q4_0, PD_TYPE_Q4_K, PD_TYPE_Q6_K, PD_TYPE_F16, PD_TYPE_BF16,
                             PD_TYPE_Q2_K, PD_TYPE_Q3_K, PD_TYPE_Q5_K, PD_TYPE_IQ4_XS, PD_TYPE_Q4_1, PD_TYPE_Q5_0,
                             PD_TYPE_Q5_1, PD_TYPE_IQ4_NL};
    static float x[256], y[256];
    static uint8_t buf[1024];
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++) {
        const pd_type t = types[k];
        const char *name = pd_type_get(t)->name;
        /* zeros decode to zeros */
        memset(x, 0, sizeof x);
        cr_assert_eq(pd_quantize_row(t, x, buf, 256, NULL), PD_OK);
        cr_assert_eq(pd_dequantize_row(t, buf, y, 256, NULL), PD_OK);
        for (int i = 0; i < 256; i++) cr_assert_eq(y[i], 0.0f, "%s zero row elem %d", name, i);
        /* constant rows (positive and negative) come back close */
        for (int sign = -1; sign <= 1; sign += 2) {
            for (int i = 0; i < 256; i++) x[i] = 0.75f * (float)sign;
            cr_assert_eq(pd_quantize_row(t, x, buf, 256, NULL), PD_OK);
            cr_assert_eq(pd_dequantize_row(t, buf, y, 256, NULL), PD_OK);
            for (int i = 0; i < 256; i++)
                cr_assert_leq(fabsf(y[i] - x[i]), 0.75f * 0.01f, "%s constant %d elem %d: %g", name, sign, i,
                              (double)y[i]);
        }
        /* NaN and inf inputs must not crash (or trip the sanitizers) */
        for (int i = 0; i < 256; i++) x[i] = (float)i;
        x[3] = NAN;
        x[200] = INFINITY;
        cr_assert_eq(pd_quantize_row(t, x, buf, 256, NULL), PD_OK);
        cr_assert_eq(pd_dequantize_row(t, buf, y, 256, NULL), PD_OK);
    }
}

/* q2_K, q3_K, q5_K, iq4_xs: relative rms error on normal data; a block
 * layout packed one way and read another would be off by about the signal
 * itself (about 1.4). The bounds sit above what these round-to-nearest
 * quantizers reach (0.28, 0.15, 0.035, 0.076), in the order of their bits
 * per weight (2.6, 3.4, 5.5, 4.25). */
Test(quant, q2_K_q3_K_q5_K_iq4_xs_rmse) {
    static float x[RT_N], y[RT_N];
    const struct {
        pd_type t;
        double max_rel;
    } cases[] = {{PD_TYPE_Q2_K, 0.31}, {PD_TYPE_Q3_K, 0.17}, {PD_TYPE_Q5_K, 0.04}, {PD_TYPE_IQ4_XS, 0.085}};
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        fill_normal(x, RT_N, 17 + k, 0.02f);
        uint8_t *q;
        round_trip(cases[k].t, x, y, &q);
        const double e = rel_rmse(x, y, RT_N);
        cr_expect_lt(e, cases[k].max_rel, "%s relative rmse %g", pd_type_get(cases[k].t)->name, e);
        cr_expect_gt(e, 0.0);
        free(q);
    }
}

/* ------------------------------------------------------------------------
 * q2_K, q3_K, q5_K, iq4_xs: random blocks decoded element by element from
 * ggml's block layouts (written here from the format, independently of
 * quant_kq.c), with ggml's float operations: the reference dequantizer
 * must match bit for bit.
 * ------------------------------------------------------------------------ */

#define SPEC_BLOCKS 16

static float half_at(const uint8_t *p) {
    return pd_fp16_to_fp32((uint16_t)(p[0] | (p[1] << 8)));
}

/* Random bytes with finite fp16 scales at the given offsets. */
static uint8_t *random_blocks(uint64_t *s, size_t block_bytes, const int *half_offs, int n_halfs) {
    uint8_t *b = malloc(block_bytes * SPEC_BLOCKS + 1);
    cr_assert_not_null(b);
    for (size_t i = 0; i < block_bytes * SPEC_BLOCKS + 1; i++) b[i] = (uint8_t)rng_next(s);
    for (int k = 0; k < SPEC_BLOCKS; k++)
        for (int h = 0; h < n_halfs; h++) {
            const uint16_t v = pd_fp32_to_fp16(rng_normal(s) * 0.01f);
            b[1 + block_bytes * k + half_offs[h]] = (uint8_t)(v & 0xff);
            b[1 + block_bytes * k + half_offs[h] + 1] = (uint8_t)(v >> 8);
        }
    return b;
}

/* q2_K element e: sub-block e/16 with scale byte sc | m << 4; 2-bit code in
 * bits 2 * ((e % 128) / 32) of qs[32 * (e / 128) + e % 32]. */
static float spec_q2_K(const uint8_t *blk, int e) {
    const float d = half_at(blk + 80), dmin = half_at(blk + 82);
    const uint8_t sc = blk[e / 16];
    const int q = (blk[16 + 32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
    const float dl = d * (float)(sc & 15), ml = dmin * (float)(sc >> 4);
    const float p = dl * (float)q;
    return p - ml;
}

/* q3_K element e: 6-bit scale of sub-block j = e/16 (low 4 bits in
 * scales[j] or scales[j-8] >> 4, high 2 bits in scales[8 + j%4] at bit
 * 2*(j/4)), minus 32; low 2 bits as q2_K; high bit e/32 of hmask[e%32],
 * clear meaning -4. */
static float spec_q3_K(const uint8_t *blk, int e) {
    const uint8_t *sc = blk + 96;
    const int j = e / 16;
    const int lo = j < 8 ? (sc[j] & 15) : (sc[j - 8] >> 4);
    const int hi = (sc[8 + j % 4] >> (2 * (j / 4))) & 3;
    const int s = (lo | (hi << 4)) - 32;
    const int q2 = (blk[32 + 32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
    const int v = q2 - (((blk[e % 32] >> (e / 32)) & 1) ? 0 : 4);
    const float dl = half_at(blk + 108) * (float)s;
    return dl * (float)v;
}

/* q5_K element e: q4_K's scale and min of sub-block e/32 and nibble, plus
 * bit 2*(e/64) + (e%64 >= 32) of qh[e%32] as 16. */
static float spec_q5_K(const uint8_t *blk, int e) {
    const uint8_t *s = blk + 4;
    const int j = e / 32;
    const int sc = j < 4 ? (s[j] & 63) : ((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
    const int m = j < 4 ? (s[j + 4] & 63) : ((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    const int c = e / 64, upper = (e % 64) >= 32, l = e % 32;
    const uint8_t byte = blk[48 + 32 * c + l];
    const int q = (upper ? byte >> 4 : byte & 15) + 16 * ((blk[16 + l] >> (2 * c + upper)) & 1);
    const float d1 = half_at(blk) * (float)sc, m1 = half_at(blk + 2) * (float)m;
    const float p = d1 * (float)q;
    return p - m1;
}

static const int8_t iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* iq4_xs element e: sub-block j = e/32 with 6-bit scale (nibble j%2 of
 * scales_l[j/2], bits 2j of the u16 scales_h) minus 32; nibble as q4_0
 * within the sub-block. */
static float spec_iq4_xs(const uint8_t *blk, int e) {
    const int j = e / 32, l = e % 32;
    const unsigned scales_h = (unsigned)(blk[2] | (blk[3] << 8));
    const int ls = ((blk[4 + j / 2] >> (4 * (j % 2))) & 15) | (int)(((scales_h >> (2 * j)) & 3) << 4);
    const uint8_t byte = blk[8 + 16 * j + l % 16];
    const int nib = l < 16 ? (byte & 15) : (byte >> 4);
    const float dl = half_at(blk) * (float)(ls - 32);
    return dl * (float)iq4_values[nib];
}

static void check_against_spec(pd_type t, float (*spec)(const uint8_t *, int), const int *half_offs, int n_halfs,
                               uint64_t seed) {
    uint64_t s = seed;
    const size_t bb = pd_type_get(t)->type_size;
    uint8_t *b = random_blocks(&s, bb, half_offs, n_halfs);
    static float y[256 * SPEC_BLOCKS];
    pd_error err = {0};
    cr_assert_eq(pd_dequantize_row(t, b + 1, y, 256 * SPEC_BLOCKS, &err), PD_OK, "%s", err.msg);
    for (int k = 0; k < SPEC_BLOCKS; k++)
        for (int e = 0; e < 256; e++) {
            const float want = spec(b + 1 + bb * (size_t)k, e);
            cr_assert_eq(fbits(y[256 * k + e]), fbits(want), "%s block %d element %d: got %a want %a",
                         pd_type_get(t)->name, k, e, (double)y[256 * k + e], (double)want);
        }
    free(b);
}

Test(quant, q2_K_q3_K_q5_K_iq4_xs_dequantize_as_specified) {
    const int q2k[] = {80, 82}, q3k[] = {108}, q5k[] = {0, 2}, iq4xs[] = {0};
    check_against_spec(PD_TYPE_Q2_K, spec_q2_K, q2k, 2, 21);
    check_against_spec(PD_TYPE_Q3_K, spec_q3_K, q3k, 1, 22);
    check_against_spec(PD_TYPE_Q5_K, spec_q5_K, q5k, 2, 23);
    check_against_spec(PD_TYPE_IQ4_XS, spec_iq4_xs, iq4xs, 1, 24);
}

/* Quantizing what a block decodes to gives the same values back: the
 * quantizers pick consistent codes for values already on the grid. */
Test(quant, requantize_is_stable_for_q8_0_q4_0_and_q5_0) {
    static float x[RT_N], y[RT_N], z[RT_N];
    fill_normal(x, RT_N, 16, 1.0f);
    const pd_type types[] = {PD_TYPE_Q8_0, PD_TYPE_Q4_0, PD_TYPE_Q5_0};
    for (size_t k = 0; k < 3; k++) {
        uint8_t *q, *q2;
        round_trip(types[k], x, y, &q);
        round_trip(types[k], y, z, &q2);
        for (int i = 0; i < RT_N; i++) cr_assert_eq(z[i], y[i], "%s elem %d", pd_type_get(types[k])->name, i);
        free(q);
        free(q2);
    }
}

/* ------------------------------------------------------------------------
 * q4_1, q5_0, q5_1, iq4_nl
 * ------------------------------------------------------------------------ */


static size_t q32_bytes(pd_type t) {
    return t == PD_TYPE_Q4_1 ? 20 : t == PD_TYPE_Q5_0 ? 22 : t == PD_TYPE_Q5_1 ? 24 : 18;
}

/* Element e (0..31) of one block, from ggml's block definitions:
 *   q4_1 {half d; half m; u8 qs[16]}       q5_0 {half d; u8 qh[4]; u8 qs[16]}
 *   q5_1 {half d; half m; u8 qh[4]; u8 qs[16]}   iq4_nl {half d; u8 qs[16]}
 * The low 4 bits of element e are the low nibble of qs[e] for e < 16, the
 * high nibble of qs[e - 16] otherwise; the fifth bit is bit e of qh (bytes
 * little-endian). Values, with ggml's float operations in ggml's order:
 * q4_1/q5_1 q*d + m, q5_0 (q - 16)*d, iq4_nl d*K[q]. */
static float spec_element(pd_type t, const uint8_t *blk, int e) {
    const uint8_t *qs = blk + q32_bytes(t) - 16;
    int q = e < 16 ? (qs[e] & 15) : (qs[e - 16] >> 4);
    if (t == PD_TYPE_Q5_0 || t == PD_TYPE_Q5_1) {
        const uint8_t *qh = blk + (t == PD_TYPE_Q5_0 ? 2 : 4);
        q |= ((qh[e / 8] >> (e % 8)) & 1) << 4;
    }
    const float d = half_at(blk);
    switch (t) {
    case PD_TYPE_Q4_1:
    case PD_TYPE_Q5_1: {
        const float p = (float)q * d;
        return p + half_at(blk + 2);
    }
    case PD_TYPE_Q5_0: return (float)(q - 16) * d;
    default: return d * (float)iq4_values[q];
    }
}

static const pd_type q32_types[] = {PD_TYPE_Q4_1, PD_TYPE_Q5_0, PD_TYPE_Q5_1, PD_TYPE_IQ4_NL};

Test(quant, q32_known_blocks) {
    float y[32];
    /* q4_1: d = 0.5, m = -1 */
    uint8_t b41[20] = {0x00, 0x38, 0x00, 0xbc};
    for (int j = 0; j < 16; j++) b41[4 + j] = (uint8_t)(j | ((15 - j) << 4));
    cr_assert_eq(pd_dequantize_row(PD_TYPE_Q4_1, b41, y, 32, NULL), PD_OK);
    cr_expect(y[0] == -1.0f && y[15] == 6.5f && y[16] == 6.5f && y[31] == -1.0f && y[3] == 0.5f,
              "q4_1: %g %g %g %g %g", (double)y[0], (double)y[15], (double)y[16], (double)y[31], (double)y[3]);
    /* q5_0: d = 2, fifth bits of elements 0 and 31 */
    uint8_t b50[22] = {0x00, 0x40, 0x01, 0x00, 0x00, 0x80};
    b50[6 + 0] = 0x3f;
    b50[6 + 15] = 0xa0;
    cr_assert_eq(pd_dequantize_row(PD_TYPE_Q5_0, b50, y, 32, NULL), PD_OK);
    cr_expect(y[0] == 30.0f && y[16] == -26.0f && y[15] == -32.0f && y[31] == 20.0f && y[1] == -32.0f,
              "q5_0: %g %g %g %g %g", (double)y[0], (double)y[16], (double)y[15], (double)y[31], (double)y[1]);
    /* q5_1: d = 0.25, m = 0.5, fifth bit of element 16 */
    uint8_t b51[24] = {0x00, 0x34, 0x00, 0x38, 0x00, 0x00, 0x01, 0x00};
    b51[8] = 0x21;
    cr_assert_eq(pd_dequantize_row(PD_TYPE_Q5_1, b51, y, 32, NULL), PD_OK);
    cr_expect(y[0] == 0.75f && y[16] == 5.0f && y[1] == 0.5f && y[17] == 0.5f, "q5_1: %g %g %g %g", (double)y[0],
              (double)y[16], (double)y[1], (double)y[17]);
    /* iq4_nl: d = 0.5 */
    uint8_t bnl[18] = {0x00, 0x38};
    for (int j = 0; j < 16; j++) bnl[2 + j] = (uint8_t)(j | ((15 - j) << 4));
    cr_assert_eq(pd_dequantize_row(PD_TYPE_IQ4_NL, bnl, y, 32, NULL), PD_OK);
    cr_expect(y[0] == -63.5f && y[15] == 56.5f && y[16] == 56.5f && y[8] == 0.5f && y[31] == -63.5f,
              "iq4_nl: %g %g %g %g %g", (double)y[0], (double)y[15], (double)y[16], (double)y[8], (double)y[31]);
}

/* Random blocks (any codes, any finite fp16 scale and offset, subnormals
 * included) decode bit for bit as the spec says. */
Test(quant, q32_dequantize_is_bit_exact) {
    enum { NB = 257 };
    uint64_t s = 21;
    static uint8_t buf[NB * 24];
    static float y[NB * 32];
    for (size_t k = 0; k < sizeof q32_types / sizeof q32_types[0]; k++) {
        const pd_type t = q32_types[k];
        const size_t bytes = q32_bytes(t);
        for (size_t i = 0; i < sizeof buf; i++) buf[i] = (uint8_t)rng_next(&s);
        for (int b = 0; b < NB; b++)
            for (int h = 0; h < 2; h++) { /* d and m (q4_1/q5_1): finite */
                uint8_t *p = buf + bytes * b + 2 * h;
                if (((p[1] >> 2) & 31) == 31) p[1] ^= 0x40;
            }
        cr_assert_eq(pd_dequantize_row(t, buf, y, NB * 32, NULL), PD_OK);
        for (int b = 0; b < NB; b++)
            for (int e = 0; e < 32; e++) {
                const float want = spec_element(t, buf + bytes * b, e);
                cr_assert_eq(fbits(y[32 * b + e]), fbits(want), "%s block %d element %d: %a, want %a",
                             pd_type_get(t)->name, b, e, (double)y[32 * b + e], (double)want);
            }
    }
}

/* Round to nearest on the grid of the stored scale and offset: half a
 * step, plus the fp16 rounding of the offset and scale at the ends. */
Test(quant, q4_1_q5_1_error_within_half_step) {
    static float x[RT_N], y[RT_N];
    const pd_type ts[] = {PD_TYPE_Q4_1, PD_TYPE_Q5_1};
    const double max_rmse[] = {0.11, 0.055};
    for (int k = 0; k < 2; k++) {
        fill_normal(x, RT_N, 17 + (uint64_t)k, 0.5f);
        uint8_t *q;
        round_trip(ts[k], x, y, &q);
        const size_t bytes = q32_bytes(ts[k]);
        for (int b = 0; b < RT_N / 32; b++) {
            const float d = half_at(q + 1 + bytes * b);
            float lo = INFINITY, hi = -INFINITY;
            for (int j = 0; j < 32; j++) {
                lo = fminf(lo, x[32 * b + j]);
                hi = fmaxf(hi, x[32 * b + j]);
            }
            const float slack = 0x1p-10f * (fabsf(lo) + fabsf(hi));
            for (int j = 0; j < 32; j++)
                cr_assert_leq(fabsf(y[32 * b + j] - x[32 * b + j]), 0.5f * d * 1.001f + slack, "%s block %d elem %d",
                              pd_type_get(ts[k])->name, b, j);
        }
        const double e = rel_rmse(x, y, RT_N);
        cr_expect_lt(e, max_rmse[k], "%s relative rmse %g", pd_type_get(ts[k])->name, e);
        free(q);
    }
}

Test(quant, q5_0_error_bounds) {
    static float x[RT_N], y[RT_N];
    fill_normal(x, RT_N, 19, 1.0f);
    uint8_t *q;
    round_trip(PD_TYPE_Q5_0, x, y, &q);
    for (int b = 0; b < RT_N / 32; b++) {
        const float d = fabsf(half_at(q + 1 + 22 * b));
        /* half a step; values of the opposite sign to the extreme may clip
         * at +15 (a full step at most) */
        for (int j = 0; j < 32; j++)
            cr_assert_leq(fabsf(y[32 * b + j] - x[32 * b + j]), d * 1.0001f, "block %d elem %d", b, j);
    }
    const double e = rel_rmse(x, y, RT_N);
    cr_expect_lt(e, 0.06, "q5_0 relative rmse %g", e);
    free(q);
}

/* Every element takes the codebook value nearest to it at the block's
 * stored scale, and the scale search does better than mapping the extreme
 * to -127 alone would. */
Test(quant, iq4_nl_codes_are_nearest) {
    static float x[RT_N], y[RT_N];
    fill_normal(x, RT_N, 20, 0.02f);
    uint8_t *q;
    round_trip(PD_TYPE_IQ4_NL, x, y, &q);
    double se_naive = 0, se = 0;
    for (int b = 0; b < RT_N / 32; b++) {
        const float d = half_at(q + 1 + 18 * b);
        float amax = 0, max = 0;
        for (int j = 0; j < 32; j++)
            if (fabsf(x[32 * b + j]) > amax) {
                amax = fabsf(x[32 * b + j]);
                max = x[32 * b + j];
            }
        const float d_naive = max / -127.0f;
        for (int j = 0; j < 32; j++) {
            const float v = x[32 * b + j];
            float best = INFINITY, best_naive = INFINITY;
            for (int c = 0; c < 16; c++) {
                best = fminf(best, fabsf(d * (float)iq4_values[c] - v));
                best_naive = fminf(best_naive, fabsf(d_naive * (float)iq4_values[c] - v));
            }
            cr_assert_leq(fabsf(y[32 * b + j] - v), best * 1.000001f + 1e-12f, "block %d elem %d", b, j);
            se += (double)(y[32 * b + j] - v) * (y[32 * b + j] - v);
            se_naive += (double)best_naive * best_naive;
        }
    }
    cr_expect_lt(se, se_naive, "squared error %g, with d = max / -127: %g", se, se_naive);
    const double e = rel_rmse(x, y, RT_N);
    cr_expect_lt(e, 0.1, "iq4_nl relative rmse %g", e);
    free(q);
}
