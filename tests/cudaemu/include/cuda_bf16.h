// cudaemu: __nv_bfloat16 (the upper half of a float) and its conversions.
#ifndef CUDAEMU_CUDA_BF16_H
#define CUDAEMU_CUDA_BF16_H

#include <stdint.h>
#include <string.h>

struct __nv_bfloat16 {
    unsigned short __x;
};

static inline float __bfloat162float(__nv_bfloat16 b) {
    const uint32_t bits = (uint32_t)b.__x << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// Round to nearest even; NaN stays a quiet NaN.
static inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    __nv_bfloat16 b;
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        b.__x = (unsigned short)((x >> 16) | 0x40u);
        return b;
    }
    x += 0x7fffu + ((x >> 16) & 1u);
    b.__x = (unsigned short)(x >> 16);
    return b;
}

static inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
static inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) {
    __nv_bfloat16 b;
    b.__x = u;
    return b;
}

#endif
