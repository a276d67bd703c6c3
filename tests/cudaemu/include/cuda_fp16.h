// cudaemu: __half as the CUDA headers' host side has it (a 16-bit IEEE
// half), with the conversions kernels/cuda uses.
#ifndef CUDAEMU_CUDA_FP16_H
#define CUDAEMU_CUDA_FP16_H

#include <stdint.h>
#include <string.h>

struct __half {
    unsigned short __x;
};

static inline float __half2float(__half h) {
    const uint32_t sign = (uint32_t)(h.__x & 0x8000u) << 16;
    const uint32_t exp = (h.__x >> 10) & 0x1fu, man = h.__x & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { // subnormal: value = man * 2^-24
        float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// Round to nearest even, overflow to inf, NaN kept quiet.
static inline __half __float2half_rn(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t ax = x & 0x7fffffffu;
    __half h;
    if (ax >= 0x7f800000u) {
        h.__x = (unsigned short)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
        return h;
    }
    if (ax >= 0x477ff000u) { // rounds to >= 65520: inf
        h.__x = (unsigned short)(sign | 0x7c00u);
        return h;
    }
    if (ax < 0x38800000u) { // below the smallest normal half: subnormal or zero
        float af;
        memcpy(&af, &ax, 4);
        const float scaled = af * 16777216.0f; // units of 2^-24, exact
        // round half to even on the integer part
        uint32_t q = (uint32_t)scaled;
        const float rem = scaled - (float)q;
        if (rem > 0.5f || (rem == 0.5f && (q & 1u))) q++;
        h.__x = (unsigned short)(sign | q);
        return h;
    }
    uint32_t e = ((ax >> 23) - 112u) << 10, m = (ax >> 13) & 0x3ffu;
    const uint32_t rest = ax & 0x1fffu;
    uint32_t v = e | m;
    if (rest > 0x1000u || (rest == 0x1000u && (v & 1u))) v++;
    h.__x = (unsigned short)(sign | v);
    return h;
}

static inline __half __float2half(float f) { return __float2half_rn(f); }
static inline __half __ushort_as_half(unsigned short u) {
    __half h;
    h.__x = u;
    return h;
}
static inline unsigned short __half_as_ushort(__half h) { return h.__x; }

#endif
