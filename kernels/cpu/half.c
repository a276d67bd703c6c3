/* IEEE binary16 and bfloat16 <-> binary32 conversions, done on the bit
 * patterns so the result never depends on the compiler, the FPU mode or the
 * presence of F16C: round to nearest, ties to even; infinities, NaNs and
 * subnormals handled exactly. */
#include "kernels/cpu/cpu_internal.h"

#include <string.h>

#if PD_X86
#include <cpuid.h>
#include <immintrin.h>
#include <stdatomic.h>

/* cpuid, not __builtin_cpu_supports: clang 14 does not know "f16c". Asked
 * once (cpuid traps to the hypervisor in a VM) and kept: a hardware fact. */
bool cpu_has_f16c(void) {
    static atomic_int known; /* 0 not asked yet, 1 no, 2 yes */
    int k = atomic_load_explicit(&known, memory_order_relaxed);
    if (!k) {
        unsigned a, b, c, d;
        k = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C) && (c & bit_AVX) ? 2 : 1;
        atomic_store_explicit(&known, k, memory_order_relaxed);
    }
    return k == 2;
}
#endif

static inline uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

float pd_fp16_to_fp32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;

    if (exp == 0) {
        if (mant == 0) return f32_from_bits(sign); /* +-0 */
        /* Subnormal: value = mant * 2^-24. Normalise so the leading one
         * lands on bit 10, adjusting the exponent as we go. */
        uint32_t e = 127 - 15 + 1;
        while (!(mant & 0x400u)) {
            mant <<= 1;
            e--;
        }
        mant &= 0x3ffu;
        return f32_from_bits(sign | (e << 23) | (mant << 13));
    }
    if (exp == 31) { /* inf, or NaN: payload kept, quieted as F16C hardware does */
        if (mant == 0) return f32_from_bits(sign | 0x7f800000u);
        return f32_from_bits(sign | 0x7fc00000u | (mant << 13));
    }
    return f32_from_bits(sign | ((exp + 127 - 15) << 23) | (mant << 13));
}

uint16_t pd_fp32_to_fp16(float f) {
    const uint32_t x = f32_bits(f);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    const uint32_t a = x & 0x7fffffffu;

    if (a > 0x7f800000u) {
        /* NaN: keep the top payload bits and force the quiet bit so the
         * result can never collapse into infinity. */
        return (uint16_t)(sign | 0x7c00u | 0x0200u | ((a >> 13) & 0x3ffu));
    }
    /* 65520 is the midpoint between 65504 (largest half, odd mantissa) and
     * 65536; ties go to even, i.e. up to infinity. */
    if (a >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);

    if (a < 0x38800000u) { /* below 2^-14: half subnormal or zero */
        /* 2^-25 is exactly half the smallest subnormal: ties to even -> 0. */
        if (a <= 0x33000000u) return sign;
        const uint32_t e = a >> 23;                 /* 102..112 */
        const uint32_t m = (a & 0x7fffffu) | 0x800000u; /* implicit one */
        const uint32_t shift = 126 - e;             /* 14..24 */
        uint32_t r = m >> shift;
        const uint32_t rem = m & ((1u << shift) - 1u);
        const uint32_t half = 1u << (shift - 1);
        if (rem > half || (rem == half && (r & 1u))) r++; /* may carry into the smallest normal */
        return (uint16_t)(sign | r);
    }

    /* Normal. Adding the rounding increment to the packed exponent|mantissa
     * lets a mantissa carry bump the exponent correctly. */
    uint32_t r = ((((a >> 23) - 127 + 15) << 10) | ((a & 0x7fffffu) >> 13));
    const uint32_t rem = a & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
    return (uint16_t)(sign | r);
}

float pd_bf16_to_fp32(uint16_t h) {
    return f32_from_bits((uint32_t)h << 16);
}

uint16_t pd_fp32_to_bf16(float f) {
    const uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) /* NaN: truncate, force quiet bit */
        return (uint16_t)((x >> 16) | 0x0040u);
    /* Round to nearest even; overflow of the largest finite values rounds
     * to infinity as it should. */
    const uint32_t rounded = x + 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(rounded >> 16);
}

#if PD_X86
/* F16C rounds to nearest even and handles subnormals, infinities and NaNs
 * as the bit-pattern code above does (MXCSR's DAZ/FTZ are never set here). */
PD_TARGET_AVX2 static size_t fp32_to_fp16_f16c(const float *x, uint16_t *y, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(y + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
    return i;
}

PD_TARGET_AVX2 static size_t fp16_to_fp32_f16c(const uint16_t *x, float *y, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))));
    return i;
}

#endif

void pd_fp32_to_fp16_row(const float *x, uint16_t *y, size_t n) {
    size_t i = 0;
#if PD_X86
    if (cpu_has_f16c()) i = fp32_to_fp16_f16c(x, y, n);
#endif
    for (; i < n; i++) y[i] = pd_fp32_to_fp16(x[i]);
}

void pd_fp16_to_fp32_row(const uint16_t *x, float *y, size_t n) {
    size_t i = 0;
#if PD_X86
    if (cpu_has_f16c()) i = fp16_to_fp32_f16c(x, y, n);
#endif
    for (; i < n; i++) y[i] = pd_fp16_to_fp32(x[i]);
}
