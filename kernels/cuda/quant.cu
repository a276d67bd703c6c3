// Quantized weights kept on the device in their GGUF blocks (the same bytes
// as the file's tensor, rows back to back) and the kernels that read them:
// a decode GEMV that dequantizes each block in registers, and a dequantizer
// to bf16 (prefill GEMM, a chunk of rows at a time) or to f32 (get_rows).
//
// Every block type is described by one trait: elements and bytes per block
// and piece(), which unpacks 8 consecutive elements ("a piece") of a block
// as small integers q with a scale and a min (w = scale * q - min). The
// dequantizer does ggml's float operations in ggml's order on them
// (products and differences rounded separately, no FMA contraction), so its
// values are bit-identical to pd_dequantize_row's. Layouts:
// kernels/cpu/quant.c and quant_kq.c.
//
// Blocks are not always 4-byte aligned on the device (34, 18, 210, 110
// bytes), so each trait reads its bytes with loads no wider than its block
// size guarantees.
#include "kernels/cuda/cuda_internal.h"

#include <cuda_fp16.h>

#include <stdint.h>
#include <string.h>

#define QGEMV_THREADS 128
#define QGEMV_MAX_N 8

/* ------------------------------------------------------------------------
 * byte helpers
 * ------------------------------------------------------------------------ */

static __device__ __forceinline__ float q_half(const uint8_t *p) { // 2-byte aligned
    return __half2float(__ushort_as_half(*(const unsigned short *)p));
}

// 8 bytes from a 2-byte aligned address, as two little-endian words.
static __device__ __forceinline__ void q_load8_a2(const uint8_t *p, uint32_t *lo, uint32_t *hi) {
    const unsigned short *s = (const unsigned short *)p;
    *lo = (uint32_t)s[0] | ((uint32_t)s[1] << 16);
    *hi = (uint32_t)s[2] | ((uint32_t)s[3] << 16);
}

// 8 bytes from an 8-byte aligned address.
static __device__ __forceinline__ void q_load8_a8(const uint8_t *p, uint32_t *lo, uint32_t *hi) {
    const uint2 v = *(const uint2 *)p;
    *lo = v.x;
    *hi = v.y;
}

static __device__ __forceinline__ uint32_t q_byte(uint32_t lo, uint32_t hi, int k) {
    return ((k < 4 ? lo : hi) >> (8 * (k & 3))) & 0xffu;
}

// a*b - c with both operations rounded (no FMA), as the CPU dequantizers.
static __device__ __forceinline__ float q_mul_sub(float a, float b, float c) { return __fsub_rn(__fmul_rn(a, b), c); }

// ggml's get_scale_min_k4 (q4_K, q5_K): 6-bit scale and min of sub-block j.
static __device__ __forceinline__ void q_scale_min_k4(int j, const uint8_t *s, float *sc, float *m) {
    if (j < 4) {
        *sc = (float)(s[j] & 63u);
        *m = (float)(s[j + 4] & 63u);
    } else {
        *sc = (float)((s[j + 4] & 0x0fu) | ((s[j - 4] >> 6) << 4));
        *m = (float)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

// The float value of a small integer v = u - bias, u < 2^23: 2^23 + u is
// built in the bits (one logic op and one exact subtraction, no
// int-to-float conversion, which runs at a quarter of the FMA rate).
static __device__ __forceinline__ float q_int_f(uint32_t u, float bias) {
    return __uint_as_float(0x4b000000u | u) - (8388608.0f + bias);
}

/* ------------------------------------------------------------------------
 * block traits: QK elements in BYTES bytes. piece(b, p, q, scale, min)
 * gives elements 8p + k (p < QK / 8) of block b as
 *     w[k] = scale * q[k] - min    (each operation rounded: ggml's order)
 * with q[k] small integers held exactly in floats; HAS_MIN false means min
 * is 0. deq8() turns a piece into its 8 values.
 * ------------------------------------------------------------------------ */

struct q_q8_0 { // fp16 d; int8 qs[32]: w = q * d
    static constexpr int QK = 32, BYTES = 34;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void piece(const uint8_t *b, int p, float *q, float *scale, float *min) {
        *scale = q_half(b), *min = 0.0f;
        uint32_t lo, hi;
        q_load8_a2(b + 2 + 8 * p, &lo, &hi);
#pragma unroll
        for (int k = 0; k < 8; k++) q[k] = q_int_f(q_byte(lo, hi, k) ^ 0x80u, 128.0f); // int8 biased by 128
    }
};

struct q_q4_0 { // fp16 d; qs[16]: low nibble element j, high nibble j + 16; w = (q - 8) * d
    static constexpr int QK = 32, BYTES = 18;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void piece(const uint8_t *b, int p, float *q, float *scale, float *min) {
        *scale = q_half(b), *min = 0.0f;
        uint32_t lo, hi;
        q_load8_a2(b + 2 + 8 * (p & 1), &lo, &hi);
        const int shift = p < 2 ? 0 : 4;
#pragma unroll
        for (int k = 0; k < 8; k++) q[k] = q_int_f((q_byte(lo, hi, k) >> shift) & 15u, 8.0f);
    }
};

struct q_q4_K { // fp16 d, dmin; scales[12]; qs[128]: w = d*sc * q - dmin*m
    static constexpr int QK = 256, BYTES = 144;
    static constexpr bool HAS_MIN = true;
    static __device__ __forceinline__ void piece(const uint8_t *b, int p, float *q, float *scale, float *min) {
        const int j = p >> 2, c = j >> 1; // sub-block of 32, chunk of 64
        float sc, m;
        q_scale_min_k4(j, b + 4, &sc, &m);
        *scale = __fmul_rn(q_half(b), sc), *min = __fmul_rn(q_half(b + 2), m);
        uint32_t lo, hi;
        q_load8_a8(b + 16 + 32 * c + 8 * (p & 3), &lo, &hi);
        const int shift = 4 * (j & 1);
#pragma unroll
        for (int k = 0; k < 8; k++) q[k] = q_int_f((q_byte(lo, hi, k) >> shift) & 15u, 0.0f);
    }
};

struct q_q5_K { // fp16 d, dmin; scales[12]; qh[32]; qs[128]: as q4_K, q with a fifth bit
    static constexpr int QK = 256, BYTES = 176;
    static constexpr bool HAS_MIN = true;
    static __device__ __forceinline__ void piece(const uint8_t *b, int p, float *q, float *scale, float *min) {
        const int j = p >> 2, c = j >> 1, l0 = 8 * (p & 3);
        float sc, m;
        q_scale_min_k4(j, b + 4, &sc, &m);
        *scale = __fmul_rn(q_half(b), sc), *min = __fmul_rn(q_half(b + 2), m);
        uint32_t lo, hi, hlo, hhi;
        q_load8_a8(b + 48 + 32 * c + l0, &lo, &hi);
        q_load8_a8(b + 16 + l0, &hlo, &hhi);
        const int shift = 4 * (j & 1), hbit = j; // bit 2c (+1 for the high nibbles) of qh
#pragma unroll
        for (int k = 0; k < 8; k++)
            q[k] = q_int_f(((q_byte(lo, hi, k) >> shift) & 15u) | (((q_byte(hlo, hhi, k) >> hbit) & 1u) << 4), 0.0f);
    }
};

struct q_q6_K { // ql[128]; qh[64]; int8 scales[16]; fp16 d: w = d*sc * (q - 32)
    static constexpr int QK = 256, BYTES = 210;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void piece(const uint8_t *b, int p, float *q, float *scale, float *min) {
        const int h = p >> 4, g = (p >> 2) & 3, l0 = 8 * (p & 3); // half of 128, quarter of 32
        *scale = __fmul_rn(q_half(b + 208), (float)(int8_t)b[192 + 8 * h + (l0 >> 4) + 2 * g]), *min = 0.0f;
        uint32_t lo, hi, hlo, hhi;
        q_load8_a2(b + 64 * h + 32 * (g & 1) + l0, &lo, &hi);
        q_load8_a2(b + 128 + 32 * h + l0, &hlo, &hhi);
        const int shift = 4 * (g >> 1);
#pragma unroll
        for (int k = 0; k < 8; k++)
            q[k] = q_int_f(((q_byte(lo, hi, k) >> shift) & 15u) | (((q_byte(hlo, hhi, k) >> (2 * g)) & 3u) << 4), 32.0f);
    }
};

// q2_K and q3_K: element e = 128h + 32j + 16s + l (l < 16) has its 2 low
// bits at bit 2j of qs[32h + 16s + l] and its scale at index 8h + 2j + s.
struct q_q2_K { // scales[16]; qs[64]; fp16 d, dmin: w = d*sc * q - dmin*m
    static constexpr int QK = 256, BYTES = 84;
    static constexpr bool HAS_MIN = true;
    static __device__ __forceinline__ void piece(const uint8_t *b, int p, float *q, float *scale, float *min) {
        const int h = p >> 4, j = (p >> 2) & 3, s = (p >> 1) & 1, l0 = 8 * (p & 1);
        const uint32_t sb = b[8 * h + 2 * j + s];
        *scale = __fmul_rn(q_half(b + 80), (float)(sb & 15u));
        *min = __fmul_rn(q_half(b + 82), (float)(sb >> 4));
        const uint32_t *qs = (const uint32_t *)(b + 16 + 32 * h + 16 * s + l0); // 4-byte aligned
        const uint32_t lo = qs[0], hi = qs[1];
#pragma unroll
        for (int k = 0; k < 8; k++) q[k] = q_int_f((q_byte(lo, hi, k) >> (2 * j)) & 3u, 0.0f);
    }
};

struct q_q3_K { // hmask[32]; qs[64]; scales[12]; fp16 d: w = d*(s - 32) * (q - 4)
    static constexpr int QK = 256, BYTES = 110;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void piece(const uint8_t *b, int p, float *q, float *scale, float *min) {
        const int h = p >> 4, j = (p >> 2) & 3, s = (p >> 1) & 1, l0 = 8 * (p & 1);
        const int is = 8 * h + 2 * j + s;
        const uint8_t *sc = b + 96;
        const uint32_t low = is < 8 ? (sc[is] & 15u) : (uint32_t)(sc[is - 8] >> 4);
        const uint32_t high = (sc[8 + (is & 3)] >> (2 * (is >> 2))) & 3u;
        *scale = __fmul_rn(q_half(b + 108), (float)((int)(low | (high << 4)) - 32)), *min = 0.0f;
        uint32_t lo, hi, mlo, mhi;
        q_load8_a2(b + 32 + 32 * h + 16 * s + l0, &lo, &hi);
        q_load8_a2(b + 16 * s + l0, &mlo, &mhi);
        const int mbit = 4 * h + j;
#pragma unroll
        for (int k = 0; k < 8; k++) // 2 low bits, + 4 where the hmask bit is set, - 4
            q[k] = q_int_f(((q_byte(lo, hi, k) >> (2 * j)) & 3u) | (((q_byte(mlo, mhi, k) >> mbit) & 1u) << 2), 4.0f);
    }
};

// IQ4_NL's 16 values (cpu_iq4nl_values) plus 128, packed in two words.
static __device__ __forceinline__ uint32_t q_iq4_biased(uint32_t i) {
    const uint64_t lo = 0x766a5d4f3f2d1801ull, hi = 0xf1d9c5b5a6998d81ull;
    return (uint32_t)((i < 8 ? lo : hi) >> (8 * (i & 7))) & 0xffu;
}

struct q_iq4_xs { // fp16 d; uint16 scales_h; scales_l[4]; qs[128]: w = d*(s - 32) * value
    static constexpr int QK = 256, BYTES = 136;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void piece(const uint8_t *b, int p, float *q, float *scale, float *min) {
        const int ib = p >> 2, part = p & 3;
        const uint32_t scales_h = *(const unsigned short *)(b + 2);
        const int ls = (int)(((b[4 + ib / 2] >> (4 * (ib & 1))) & 15u) | (((scales_h >> (2 * ib)) & 3u) << 4));
        *scale = __fmul_rn(q_half(b), (float)(ls - 32)), *min = 0.0f;
        uint32_t lo, hi;
        q_load8_a8(b + 8 + 16 * ib + 8 * (part & 1), &lo, &hi);
        const int shift = part < 2 ? 0 : 4;
#pragma unroll
        for (int k = 0; k < 8; k++) q[k] = q_int_f(q_iq4_biased((q_byte(lo, hi, k) >> shift) & 15u), 128.0f);
    }
};

// The 32-element types of kernels/cpu/quant_q32.c: nibbles as q4_0 (piece
// p < 2: low nibbles of qs[8p..], else high nibbles of qs[8(p-2)..]), the
// fifth bit of element e (q5_0, q5_1) bit e of qh. An offset m is added
// (q4_1, q5_1: w = q*d + m), which is the min -m exactly.
static __device__ __forceinline__ uint32_t q_qh_bits(const uint8_t *qh) { // 2-byte aligned
    const unsigned short *h = (const unsigned short *)qh;
    return (uint32_t)h[0] | ((uint32_t)h[1] << 16);
}

struct q_q4_1 { // fp16 d; fp16 m; qs[16]
    static constexpr int QK = 32, BYTES = 20;
    static constexpr bool HAS_MIN = true;
    static __device__ __forceinline__ void piece(const uint8_t *b, int p, float *q, float *scale, float *min) {
        *scale = q_half(b), *min = -q_half(b + 2);
        uint32_t lo, hi;
        q_load8_a2(b + 4 + 8 * (p & 1), &lo, &hi);
        const int shift = p < 2 ? 0 : 4;
#pragma unroll
        for (int k = 0; k < 8; k++) q[k] = q_int_f((q_byte(lo, hi, k) >> shift) & 15u, 0.0f);
    }
};

struct q_q5_0 { // fp16 d; qh[4]; qs[16]: w = (q - 16) * d
    static constexpr int QK = 32, BYTES = 22;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void piece(const uint8_t *b, int p, float *q, float *scale, float *min) {
        *scale = q_half(b), *min = 0.0f;
        const uint32_t qh = q_qh_bits(b + 2) >> (8 * p);
        uint32_t lo, hi;
        q_load8_a2(b + 6 + 8 * (p & 1), &lo, &hi);
        const int shift = p < 2 ? 0 : 4;
#pragma unroll
        for (int k = 0; k < 8; k++) q[k] = q_int_f(((q_byte(lo, hi, k) >> shift) & 15u) | (((qh >> k) & 1u) << 4), 16.0f);
    }
};

struct q_q5_1 { // fp16 d; fp16 m; qh[4]; qs[16]
    static constexpr int QK = 32, BYTES = 24;
    static constexpr bool HAS_MIN = true;
    static __device__ __forceinline__ void piece(const uint8_t *b, int p, float *q, float *scale, float *min) {
        *scale = q_half(b), *min = -q_half(b + 2);
        const uint32_t qh = q_qh_bits(b + 4) >> (8 * p);
        uint32_t lo, hi;
        q_load8_a2(b + 8 + 8 * (p & 1), &lo, &hi);
        const int shift = p < 2 ? 0 : 4;
#pragma unroll
        for (int k = 0; k < 8; k++) q[k] = q_int_f(((q_byte(lo, hi, k) >> shift) & 15u) | (((qh >> k) & 1u) << 4), 0.0f);
    }
};

struct q_iq4_nl { // fp16 d; qs[16]: w = d * value
    static constexpr int QK = 32, BYTES = 18;
    static constexpr bool HAS_MIN = false;
    static __device__ __forceinline__ void piece(const uint8_t *b, int p, float *q, float *scale, float *min) {
        *scale = q_half(b), *min = 0.0f;
        uint32_t lo, hi;
        q_load8_a2(b + 2 + 8 * (p & 1), &lo, &hi);
        const int shift = p < 2 ? 0 : 4;
#pragma unroll
        for (int k = 0; k < 8; k++) q[k] = q_int_f(q_iq4_biased((q_byte(lo, hi, k) >> shift) & 15u), 128.0f);
    }
};

// Elements 8p .. 8p + 7 of block b, bit-identical to pd_dequantize_row.
template <class QT> static __device__ __forceinline__ void q_deq8(const uint8_t *b, int p, float *f) {
    float q[8], scale, min;
    QT::piece(b, p, q, &scale, &min);
#pragma unroll
    for (int k = 0; k < 8; k++) f[k] = QT::HAS_MIN ? q_mul_sub(scale, q[k], min) : __fmul_rn(scale, q[k]);
}

/* ------------------------------------------------------------------------
 * GEMV: n <= 8 tokens
 *
 * Block b computes rows [b*R, b*R + R) for all N tokens. A row is a run of
 * pieces (8 elements each, QK/8 per block); thread t takes pieces t,
 * t + THREADS, ..., so a warp reads a contiguous stretch of blocks, and
 * unpacks each piece of its R rows in registers once for all N tokens:
 * every weight byte is read once per call. x is read through the read-only
 * cache (8 floats per piece per token, shared by the R rows). A piece adds
 * scale * dot(q, x) - min * sum(x) (sum(x) shared by the R rows), which is
 * its exact dot product up to f32 rounding: per weight, one unpack and one
 * FMA per token, where dequantizing first would add a multiply and a
 * subtraction per weight. Partial sums: warp
 * shuffles, then the block's warps in shared memory in a fixed order, and
 * the job's kind (several weights, gate/up + activation) as the 16-bit
 * GEMV (cuda_gemv_store in cuda_internal.h).
 * ------------------------------------------------------------------------ */

template <bool XVEC>
static __device__ __forceinline__ void q_load_x8(const float *x, float *xf) {
    if (XVEC) {
        const float4 a = __ldg((const float4 *)x), b = __ldg((const float4 *)x + 1);
        xf[0] = a.x, xf[1] = a.y, xf[2] = a.z, xf[3] = a.w;
        xf[4] = b.x, xf[5] = b.y, xf[6] = b.z, xf[7] = b.w;
    } else {
#pragma unroll
        for (int k = 0; k < 8; k++) xf[k] = __ldg(x + k);
    }
}

template <class QT, int N, int R, bool XVEC>
__global__ void __launch_bounds__(QGEMV_THREADS) qgemv_kernel(const cuda_gemv_job job, const float *__restrict__ x) {
    constexpr int P = QT::QK / 8;
    const int64_t cols = job.cols, nb = cols / QT::QK, pieces = nb * P, row_bytes = nb * QT::BYTES;
    int64_t row0;
    const int j = cuda_gemv_block<R>(job, &row0);
    const uint8_t *wr[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        int wi;
        const int64_t row = cuda_gemv_source<R>(job, j, row0, r, &wi);
        wr[r] = (const uint8_t *)job.w[wi] + row * row_bytes;
    }
    float acc[N][R];
#pragma unroll
    for (int t = 0; t < N; t++)
#pragma unroll
        for (int r = 0; r < R; r++) acc[t][r] = 0.0f;

    for (int64_t pc = threadIdx.x; pc < pieces; pc += QGEMV_THREADS) {
        const int64_t blk = pc / P;
        const int p = (int)(pc - blk * P);
        float q[R][8], scale[R], min[R];
#pragma unroll
        for (int r = 0; r < R; r++) QT::piece(wr[r] + blk * QT::BYTES, p, q[r], &scale[r], &min[r]);
        const int64_t c0 = blk * QT::QK + 8 * p;
#pragma unroll
        for (int t = 0; t < N; t++) {
            float xf[8];
            q_load_x8<XVEC>(x + t * cols + c0, xf);
            float sx = 0.0f;
            if (QT::HAS_MIN)
#pragma unroll
                for (int k = 0; k < 8; k++) sx += xf[k];
#pragma unroll
            for (int r = 0; r < R; r++) {
                float dot = 0.0f;
#pragma unroll
                for (int k = 0; k < 8; k++) dot = fmaf(q[r][k], xf[k], dot);
                acc[t][r] = fmaf(scale[r], dot, acc[t][r]);
                if (QT::HAS_MIN) acc[t][r] = fmaf(-min[r], sx, acc[t][r]);
            }
        }
    }

    __shared__ float part[QGEMV_THREADS / 32][N * R];
    cuda_gemv_store<N, R, QGEMV_THREADS>(job, j, row0, acc, part);
}

template <class QT, int N>
static int qgemv_run(cuda_backend *cb, const cuda_gemv_job *job, const float *x, pd_error *err) {
    // More rows per block for more tokens, as the 16-bit GEMV: each x
    // piece loaded serves R rows.
    constexpr int R = N <= 2 ? 2 : 4;
    const unsigned blocks = cuda_gemv_blocks(job, R);
    if ((uintptr_t)x % 16 == 0)
        qgemv_kernel<QT, N, R, true><<<blocks, QGEMV_THREADS, 0, cuda_launch_stream(cb)>>>(*job, x);
    else
        qgemv_kernel<QT, N, R, false><<<blocks, QGEMV_THREADS, 0, cuda_launch_stream(cb)>>>(*job, x);
    return cuda_check_launch(err, "matmul (quantized gemv)");
}

template <class QT>
static int qgemv_dispatch(cuda_backend *cb, const cuda_gemv_job *job, const float *x, int64_t n, pd_error *err) {
    switch (n) {
    case 1: return qgemv_run<QT, 1>(cb, job, x, err);
    case 2: return qgemv_run<QT, 2>(cb, job, x, err);
    case 3: return qgemv_run<QT, 3>(cb, job, x, err);
    case 4: return qgemv_run<QT, 4>(cb, job, x, err);
    case 5: return qgemv_run<QT, 5>(cb, job, x, err);
    case 6: return qgemv_run<QT, 6>(cb, job, x, err);
    case 7: return qgemv_run<QT, 7>(cb, job, x, err);
    case 8: return qgemv_run<QT, 8>(cb, job, x, err);
    default: return pd_errorf(err, PD_EINVAL, "cuda backend: quantized gemv of %lld tokens", (long long)n);
    }
}

/* ------------------------------------------------------------------------
 * dequantize rows: to bf16 (the prefill GEMM's weight chunk) or to f32
 * (get_rows). One thread per piece of 8 elements, grid-stride; output row i
 * is weight row ids[i] (ids on the device) or r0 + i.
 * ------------------------------------------------------------------------ */

// Round to nearest even, NaN kept quiet: pd_fp32_to_bf16 bit for bit.
static __device__ __forceinline__ uint32_t q_bf16_bits(float f) {
    const uint32_t u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

template <class QT, bool BF16>
__global__ void qdequant_kernel(const uint8_t *__restrict__ w, const int32_t *__restrict__ ids, int64_t r0,
                                int64_t n_rows, int64_t cols, void *__restrict__ out) {
    constexpr int P = QT::QK / 8;
    const int64_t nb = cols / QT::QK, per_row = nb * P, row_bytes = nb * QT::BYTES;
    const int64_t total = n_rows * per_row;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const int64_t orow = i / per_row, pc = i - orow * per_row, blk = pc / P;
        const int p = (int)(pc - blk * P);
        const int64_t row = ids ? (int64_t)ids[orow] : r0 + orow;
        float f[8];
        q_deq8<QT>(w + row * row_bytes + blk * QT::BYTES, p, f);
        const int64_t o = orow * cols + blk * QT::QK + 8 * p; // a multiple of 8
        if (BF16) {
            uint4 v;
            v.x = q_bf16_bits(f[0]) | (q_bf16_bits(f[1]) << 16);
            v.y = q_bf16_bits(f[2]) | (q_bf16_bits(f[3]) << 16);
            v.z = q_bf16_bits(f[4]) | (q_bf16_bits(f[5]) << 16);
            v.w = q_bf16_bits(f[6]) | (q_bf16_bits(f[7]) << 16);
            *(uint4 *)((uint16_t *)out + o) = v; // 16-byte aligned: out is a device allocation
        } else {
            float *fo = (float *)out + o;
#pragma unroll
            for (int k = 0; k < 8; k++) fo[k] = f[k];
        }
    }
}

template <class QT>
static int qdequant_run(cuda_backend *cb, const cuda_weight_entry *e, const int32_t *ids, int64_t r0, int64_t n_rows,
                        bool bf16, void *out, pd_error *err) {
    const int64_t pieces = n_rows * (e->cols / 8);
    const unsigned blocks = cuda_grid_blocks(cb, pieces, 256);
    const uint8_t *w = (const uint8_t *)e->dev;
    if (bf16)
        qdequant_kernel<QT, true><<<blocks, 256, 0, cuda_launch_stream(cb)>>>(w, ids, r0, n_rows, e->cols, out);
    else
        qdequant_kernel<QT, false><<<blocks, 256, 0, cuda_launch_stream(cb)>>>(w, ids, r0, n_rows, e->cols, out);
    return cuda_check_launch(err, "dequantize (quantized weight)");
}

/* ------------------------------------------------------------------------
 * entry points (cuda_internal.h)
 * ------------------------------------------------------------------------ */

// One switch over the quantized types, so the list lives in one place.
#define QUANT_TYPES(X)                                                                                                 \
    X(PD_TYPE_Q8_0, q_q8_0)                                                                                            \
    X(PD_TYPE_Q4_0, q_q4_0)                                                                                            \
    X(PD_TYPE_Q4_1, q_q4_1)                                                                                            \
    X(PD_TYPE_Q5_0, q_q5_0)                                                                                            \
    X(PD_TYPE_Q5_1, q_q5_1)                                                                                            \
    X(PD_TYPE_IQ4_NL, q_iq4_nl)                                                                                        \
    X(PD_TYPE_Q2_K, q_q2_K)                                                                                            \
    X(PD_TYPE_Q3_K, q_q3_K)                                                                                            \
    X(PD_TYPE_Q4_K, q_q4_K)                                                                                            \
    X(PD_TYPE_Q5_K, q_q5_K)                                                                                            \
    X(PD_TYPE_Q6_K, q_q6_K)                                                                                            \
    X(PD_TYPE_IQ4_XS, q_iq4_xs)

extern "C" int cuda_quant_block(pd_type t, int64_t *elems, int64_t *bytes) {
    switch (t) {
#define X(T, Q)                                                                                                        \
    case T: *elems = Q::QK, *bytes = Q::BYTES; return 1;
        QUANT_TYPES(X)
#undef X
    default: return 0;
    }
}

extern "C" int cuda_quant_gemv_job(cuda_backend *cb, pd_type t, const cuda_gemv_job *job, const float *x, int64_t n,
                                   pd_error *err) {
    switch (t) {
#define X(T, Q)                                                                                                        \
    case T: return qgemv_dispatch<Q>(cb, job, x, n, err);
        QUANT_TYPES(X)
#undef X
    default: return pd_errorf(err, PD_EINVAL, "cuda backend: no quantized gemv for this type");
    }
}

extern "C" int cuda_quant_gemv(cuda_backend *cb, const cuda_weight_entry *e, const float *x, int64_t n, float *y,
                               pd_error *err) {
    cuda_gemv_job job;
    memset(&job, 0, sizeof job);
    job.w[0] = e->dev, job.y[0] = y, job.rows[0] = e->rows, job.cols = e->cols, job.n_w = 1;
    return cuda_quant_gemv_job(cb, e->dev_type, &job, x, n, err);
}

extern "C" int cuda_quant_dequantize(cuda_backend *cb, const cuda_weight_entry *e, const int32_t *ids, int64_t r0,
                                     int64_t n_rows, bool bf16, void *out, pd_error *err) {
    switch (e->dev_type) {
#define X(T, Q)                                                                                                        \
    case T: return qdequant_run<Q>(cb, e, ids, r0, n_rows, bf16, out, err);
        QUANT_TYPES(X)
#undef X
    default: return pd_errorf(err, PD_EINVAL, "cuda backend: no dequantizer for this type");
    }
}
