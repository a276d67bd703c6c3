// Weights on the device and the products with them: prepare_weight (the
// one-time upload; quantized types stay in their GGUF blocks), matmul (a
// GEMV kernel for decode-sized batches, cuBLAS for larger ones) and
// get_rows (embedding lookup). The quantized kernels are in quant.cu.
#include "kernels/cuda/cuda_internal.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// Batches up to this many tokens use the GEMV kernel (each weight byte read
// once for all of them); larger ones a cuBLAS GEMM.
#define GEMV_MAX_N 8
#define GEMV_THREADS 128
// x converted to 16-bit per GEMM call at most this many elements at a time,
// which bounds the MATMUL scratch (64 MiB).
#define GEMM_X_ELEMS ((int64_t)32 << 20)
// A quantized weight is multiplied by a prefill batch in chunks of
// rows dequantized to bf16 on the device, at most this many elements
// (64 MiB) at a time.
#define GEMM_W_ELEMS ((int64_t)32 << 20)

/* ------------------------------------------------------------------------
 * device weight types
 *
 * Each describes one element type of a device weight: how many elements a
 * 16-byte vector holds, how to unpack one, and how to read one element.
 * ------------------------------------------------------------------------ */

struct w_bf16 {
    static constexpr int per_vec = 8;
    static __device__ __forceinline__ float lo(uint32_t u) { return __uint_as_float(u << 16); }
    static __device__ __forceinline__ float hi(uint32_t u) { return __uint_as_float(u & 0xffff0000u); }
    static __device__ __forceinline__ void unpack(const uint4 v, float *f) {
        // little endian: element 2k is the low half of word k
        f[0] = lo(v.x), f[1] = hi(v.x), f[2] = lo(v.y), f[3] = hi(v.y);
        f[4] = lo(v.z), f[5] = hi(v.z), f[6] = lo(v.w), f[7] = hi(v.w);
    }
    static __device__ __forceinline__ float load(const void *w, int64_t i) {
        return __uint_as_float((uint32_t)((const uint16_t *)w)[i] << 16);
    }
};

struct w_f16 {
    static constexpr int per_vec = 8;
    static __device__ __forceinline__ float lo(uint32_t u) {
        return __half2float(__ushort_as_half((unsigned short)(u & 0xffffu)));
    }
    static __device__ __forceinline__ float hi(uint32_t u) {
        return __half2float(__ushort_as_half((unsigned short)(u >> 16)));
    }
    static __device__ __forceinline__ void unpack(const uint4 v, float *f) {
        f[0] = lo(v.x), f[1] = hi(v.x), f[2] = lo(v.y), f[3] = hi(v.y);
        f[4] = lo(v.z), f[5] = hi(v.z), f[6] = lo(v.w), f[7] = hi(v.w);
    }
    static __device__ __forceinline__ float load(const void *w, int64_t i) {
        return __half2float(__ushort_as_half(((const unsigned short *)w)[i]));
    }
};

struct w_f32 {
    static constexpr int per_vec = 4;
    static __device__ __forceinline__ void unpack(const uint4 v, float *f) {
        f[0] = __uint_as_float(v.x), f[1] = __uint_as_float(v.y);
        f[2] = __uint_as_float(v.z), f[3] = __uint_as_float(v.w);
    }
    static __device__ __forceinline__ float load(const void *w, int64_t i) { return ((const float *)w)[i]; }
};

/* ------------------------------------------------------------------------
 * prepare_weight
 * ------------------------------------------------------------------------ */

static size_t dev_elem_size(pd_type t) { return t == PD_TYPE_F32 ? 4 : 2; }

// Whether the device can hold weights of type t: float types as they are,
// quantized types in their blocks (quant.cu has kernels for every type the
// CPU can dequantize).
static bool dev_type_ok(pd_type t) {
    int64_t qk, qb;
    return t == PD_TYPE_F32 || t == PD_TYPE_F16 || t == PD_TYPE_BF16 || cuda_quant_block(t, &qk, &qb);
}

extern "C" uint64_t pd_cuda_weight_bytes(pd_type t, int64_t rows, int64_t cols) {
    if (!dev_type_ok(t) || rows <= 0 || cols <= 0) return 0;
    int64_t qk, qb;
    if (cuda_quant_block(t, &qk, &qb)) return (uint64_t)rows * (uint64_t)(cols / qk) * (uint64_t)qb;
    return (uint64_t)rows * (uint64_t)cols * dev_elem_size(t);
}

// Upload w as a new table entry.
static int weight_upload(cuda_backend *cb, const pd_weight *w, const cuda_weight_entry **out, pd_error *err) {
    const pd_type_traits *tr = pd_type_get((uint32_t)w->type);
    const pd_type dev_type = w->type;
    if (!dev_type_ok(dev_type))
        return pd_errorf(err, PD_EUNSUPPORTED, "cuda backend: weights of type %s are not supported",
                         tr ? tr->name : "(unknown)");
    // cuBLAS takes int dimensions.
    if (w->rows > INT_MAX || w->cols > INT_MAX)
        return pd_errorf(err, PD_ERANGE, "cuda backend: weight of %lld x %lld is too large", (long long)w->rows,
                         (long long)w->cols);
    // Bytes per row on the device: the file's rows as they are.
    int64_t qk, qb;
    size_t dev_row_bytes;
    if (cuda_quant_block(dev_type, &qk, &qb)) {
        if (w->cols % qk != 0 || w->row_bytes != (size_t)(w->cols / qk * qb))
            return pd_errorf(err, PD_EINVAL, "cuda backend: %s weight rows of %lld elements in %zu bytes, expected "
                             "whole blocks of %lld elements in %lld bytes",
                             tr->name, (long long)w->cols, w->row_bytes, (long long)qk, (long long)qb);
        dev_row_bytes = w->row_bytes;
    } else {
        const size_t es = dev_elem_size(dev_type);
        if (w->row_bytes != (size_t)w->cols * es)
            return pd_errorf(err, PD_EINVAL, "cuda backend: weight rows of %zu bytes, expected %lld x %zu",
                             w->row_bytes, (long long)w->cols, es);
        dev_row_bytes = (size_t)w->cols * es;
    }
    if ((uint64_t)w->rows > (uint64_t)PTRDIFF_MAX / (uint64_t)dev_row_bytes)
        return pd_errorf(err, PD_ERANGE, "cuda backend: weight of %lld x %lld overflows", (long long)w->rows,
                         (long long)w->cols);
    const size_t bytes = (size_t)w->rows * dev_row_bytes;

    void *dev = NULL;
    int rc = cuda_malloc(cb, &dev, bytes, "a weight", err);
    if (rc) return rc;
    rc = cuda_upload(cb, dev, w->data, bytes, err);
    cuda_weight_entry e;
    memset(&e, 0, sizeof e);
    e.host = w->data;
    e.type = w->type;
    e.rows = w->rows;
    e.cols = w->cols;
    e.dev = dev;
    e.dev_type = dev_type;
    const cuda_weight_entry *added = rc ? NULL : cuda_weight_add(cb, &e, err);
    if (!added) {
        if (!rc) rc = err ? err->code : PD_ENOMEM;
        // Copies into dev may still be queued.
        if (cudaStreamSynchronize(cb->stream) != cudaSuccess) (void)cudaGetLastError();
        (void)cudaFree(dev);
        return rc;
    }
    *out = added;
    return PD_OK;
}

// The device copy of w, made now if there is none yet.
static int weight_get(cuda_backend *cb, const pd_weight *w, const cuda_weight_entry **out, pd_error *err) {
    *out = NULL;
    if (!w || !w->data) return pd_errorf(err, PD_EINVAL, "cuda backend: NULL weight");
    if (w->rows <= 0 || w->cols <= 0)
        return pd_errorf(err, PD_EINVAL, "cuda backend: empty weight (%lld x %lld)", (long long)w->rows,
                         (long long)w->cols);
    if (w->layout != PD_LAYOUT_GGUF)
        return pd_errorf(err, PD_EUNSUPPORTED, "cuda backend: the weight at %p was packed for the CPU backend; "
                         "load the model for the cuda backend from the file", w->data);
    const cuda_weight_entry *e = cuda_weight_find(cb, w->data);
    // Recorded, the upload would only run with the graph, while the table
    // says the copy exists: the step is redone without a graph instead.
    if (!e && cb->capturing)
        return pd_errorf(err, PD_EUNSUPPORTED, "cuda backend: a weight's first upload cannot be recorded in a graph");
    if (!e) return weight_upload(cb, w, out, err);
    if (e->type != w->type || e->rows != w->rows || e->cols != w->cols) {
        const pd_type_traits *a = pd_type_get((uint32_t)e->type), *b = pd_type_get((uint32_t)w->type);
        return pd_errorf(err, PD_EINVAL,
                         "cuda backend: the weight at %p was prepared as %s %lld x %lld and is now used as "
                         "%s %lld x %lld",
                         w->data, a ? a->name : "?", (long long)e->rows, (long long)e->cols, b ? b->name : "?",
                         (long long)w->rows, (long long)w->cols);
    }
    *out = e;
    return PD_OK;
}

int cuda_prepare_weight(pd_backend *be, const pd_weight *w, pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    const int rc = cuda_enter(cb, err);
    if (rc) return rc;
    const cuda_weight_entry *e;
    return weight_get(cb, w, &e, err);
}

/* ------------------------------------------------------------------------
 * GEMV: n <= GEMV_MAX_N tokens
 *
 * Block b computes rows [b*R, b*R + R) for all N tokens. Its threads split
 * each row into 16-byte vectors (thread t takes vectors t, t + THREADS,
 * ...), load the R weight vectors once and multiply them with the matching
 * x elements of every token, so each weight byte is read from memory once
 * per call. x (at most 8 x cols floats) is read through the read-only
 * cache; R rows per block divide that traffic by R. Weights are streamed
 * with evict-first loads so they do not push x out of the cache. Partial
 * sums are reduced per warp with shuffles and across the block's warps in
 * shared memory, in a fixed order (cuda_gemv_store). A launch runs one
 * cuda_gemv_job: up to 3 weights sharing x (blocks split among them), or
 * a gate/up pair whose blocks take R/2 rows of each and write
 * act(gate) * up; a row's sum is the same in every kind of job.
 * ------------------------------------------------------------------------ */

template <class WT, int N, int R>
__global__ void __launch_bounds__(GEMV_THREADS) gemv_kernel(const cuda_gemv_job job, const float *__restrict__ x) {
    constexpr int V = WT::per_vec;
    const int64_t cols = job.cols, vecs = cols / V; // the host checked cols % V == 0
    int64_t row0;
    const int j = cuda_gemv_block<R>(job, &row0);
    const uint4 *wr[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        int wi;
        const int64_t row = cuda_gemv_source<R>(job, j, row0, r, &wi);
        wr[r] = (const uint4 *)job.w[wi] + row * vecs;
    }
    float acc[N][R];
#pragma unroll
    for (int t = 0; t < N; t++)
#pragma unroll
        for (int r = 0; r < R; r++) acc[t][r] = 0.0f;

    for (int64_t c = threadIdx.x; c < vecs; c += GEMV_THREADS) {
        float wf[R][V];
#pragma unroll
        for (int r = 0; r < R; r++) WT::unpack(__ldcs(wr[r] + c), wf[r]);
#pragma unroll
        for (int t = 0; t < N; t++) {
            const float4 *xp = (const float4 *)(x + t * cols + c * V);
            float xf[V];
#pragma unroll
            for (int k = 0; k < V / 4; k++) {
                const float4 q = __ldg(xp + k);
                xf[4 * k] = q.x, xf[4 * k + 1] = q.y, xf[4 * k + 2] = q.z, xf[4 * k + 3] = q.w;
            }
#pragma unroll
            for (int r = 0; r < R; r++)
#pragma unroll
                for (int k = 0; k < V; k++) acc[t][r] = fmaf(wf[r][k], xf[k], acc[t][r]);
        }
    }

    __shared__ float part[GEMV_THREADS / 32][N * R];
    cuda_gemv_store<N, R, GEMV_THREADS>(job, j, row0, acc, part);
}

template <class WT, int N>
static int gemv_run(cuda_backend *cb, const cuda_gemv_job *job, const float *x, pd_error *err) {
    // More rows per block for more tokens: x traffic per weight byte is
    // about 2N/R (16-bit weights), kept near or below 2.
    constexpr int R = N <= 2 ? 2 : 4;
    gemv_kernel<WT, N, R><<<cuda_gemv_blocks(job, R), GEMV_THREADS, 0, cuda_launch_stream(cb)>>>(*job, x);
    return cuda_check_launch(err, "matmul (gemv)");
}

template <class WT>
static int gemv_dispatch(cuda_backend *cb, const cuda_gemv_job *job, const float *x, int64_t n, pd_error *err) {
    switch (n) {
    case 1: return gemv_run<WT, 1>(cb, job, x, err);
    case 2: return gemv_run<WT, 2>(cb, job, x, err);
    case 3: return gemv_run<WT, 3>(cb, job, x, err);
    case 4: return gemv_run<WT, 4>(cb, job, x, err);
    case 5: return gemv_run<WT, 5>(cb, job, x, err);
    case 6: return gemv_run<WT, 6>(cb, job, x, err);
    case 7: return gemv_run<WT, 7>(cb, job, x, err);
    case 8: return gemv_run<WT, 8>(cb, job, x, err);
    default: return pd_errorf(err, PD_EINVAL, "cuda backend: gemv of %lld tokens", (long long)n);
    }
}

// Fallback for shapes the vector kernel cannot take (cols not a multiple of
// the vector width, x not 16-byte aligned): one block per row at a time,
// one token at a time, scalar loads.
template <class WT>
__global__ void gemv_generic_kernel(const void *__restrict__ w, const float *__restrict__ x, float *__restrict__ y,
                                    int64_t rows, int64_t cols, int64_t n) {
    __shared__ float red[32];
    for (int64_t row = blockIdx.x; row < rows; row += gridDim.x)
        for (int64_t t = 0; t < n; t++) {
            float acc = 0.0f;
            for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
                acc = fmaf(WT::load(w, row * cols + c), x[t * cols + c], acc);
            acc = cuda_block_sum(acc, red);
            if (threadIdx.x == 0) y[t * rows + row] = acc;
        }
}

// Whether one vector-kernel launch can serve a job of dev_type weights
// with this x (quantized weights: always).
static bool gemv_vec_ok(pd_type dev_type, int64_t cols, const float *x) {
    int64_t qk, qb;
    if (cuda_quant_block(dev_type, &qk, &qb)) return true;
    const int per_vec = dev_type == PD_TYPE_F32 ? 4 : 8;
    return cols % per_vec == 0 && (uintptr_t)x % 16 == 0;
}

// A job on the vector kernels (gemv_vec_ok holds), any weight type.
static int gemv_job_run(cuda_backend *cb, pd_type dev_type, const cuda_gemv_job *job, const float *x, int64_t n,
                        pd_error *err) {
    int64_t qk, qb;
    if (cuda_quant_block(dev_type, &qk, &qb)) return cuda_quant_gemv_job(cb, dev_type, job, x, n, err);
    switch (dev_type) {
    case PD_TYPE_BF16: return gemv_dispatch<w_bf16>(cb, job, x, n, err);
    case PD_TYPE_F16: return gemv_dispatch<w_f16>(cb, job, x, n, err);
    default: return gemv_dispatch<w_f32>(cb, job, x, n, err);
    }
}

template <class WT>
static int gemv_any(cuda_backend *cb, const cuda_weight_entry *e, const float *x, int64_t n, float *y,
                    pd_error *err) {
    if (gemv_vec_ok(e->dev_type, e->cols, x)) {
        cuda_gemv_job job;
        memset(&job, 0, sizeof job);
        job.w[0] = e->dev, job.y[0] = y, job.rows[0] = e->rows, job.cols = e->cols, job.n_w = 1;
        return gemv_dispatch<WT>(cb, &job, x, n, err);
    }
    const unsigned blocks = (unsigned)(e->rows < 65536 ? e->rows : 65536);
    gemv_generic_kernel<WT><<<blocks, 256, 0, cuda_launch_stream(cb)>>>(e->dev, x, y, e->rows, e->cols, n);
    return cuda_check_launch(err, "matmul (generic gemv)");
}

/* ------------------------------------------------------------------------
 * GEMM: n > GEMV_MAX_N tokens
 *
 * Row-major y[n][rows] is column-major y^T (rows x n, ld rows); row-major
 * W[rows][cols] is column-major W^T (cols x rows, ld cols), so op(A) = T
 * gives W; row-major x[n][cols] is column-major x^T (cols x n, ld cols).
 * Hence y^T = W x^T is GEMM(T, N, m = rows, n = n, k = cols).
 * ------------------------------------------------------------------------ */

__global__ void f32_to_bf16_kernel(const float *__restrict__ x, __nv_bfloat16 *__restrict__ o, int64_t count) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride)
        o[i] = __float2bfloat16_rn(x[i]);
}

// f16 tops out at 65504, and activations (a SwiGLU output, say) can exceed
// it: each token's row is scaled by a power of two 2^-k that brings its
// largest |x| below 2^15 (k = 0, no change, for the usual row), and
// scales[t] = 2^k undoes it on the GEMM's output. Powers of two are exact,
// so only the f16 rounding of x remains, as for rows that need no scaling.
// One block per token row; blockDim.x a multiple of 32.
__global__ void f32_to_f16_scaled_kernel(const float *__restrict__ x, __half *__restrict__ o, int64_t cols,
                                         float *__restrict__ scales) {
    __shared__ float red[32];
    const float *xr = x + (int64_t)blockIdx.x * cols;
    __half *orow = o + (int64_t)blockIdx.x * cols;
    float amax = 0.0f;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) amax = fmaxf(amax, fabsf(xr[c]));
    amax = cuda_block_max(amax, red);
    int e = 0;
    if (isfinite(amax)) (void)frexpf(amax, &e); // amax = m * 2^e, m in [0.5, 1)
    const int k = e > 15 ? e - 15 : 0;
    const float down = ldexpf(1.0f, -k);
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) orow[c] = __float2half_rn(xr[c] * down);
    if (threadIdx.x == 0) scales[blockIdx.x] = ldexpf(1.0f, k);
}

// y[t][r] *= scales[t] (y row-major, n rows of `rows`).
__global__ void unscale_rows_kernel(float *__restrict__ y, const float *__restrict__ scales, int64_t rows,
                                    int64_t count) {
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) y[i] *= scales[i / rows];
}

// A quantized weight times n > 8 tokens: for each chunk of tokens,
// x to bf16 once, then chunks of the weight's rows dequantized to bf16 in
// scratch (GEMM_W_ELEMS at most, so no bf16 copy of the weight is kept)
// and multiplied by cuBLAS into the matching rows of y (ldc = rows).
static int gemm_quant(cuda_backend *cb, const cuda_weight_entry *e, const float *x, int64_t n, float *y,
                      pd_error *err) {
    const int rows = (int)e->rows, cols = (int)e->cols;
    const float alpha = 1.0f, beta = 0.0f;
    int64_t chunk = GEMM_X_ELEMS / cols, wrows = GEMM_W_ELEMS / cols;
    if (chunk < 1) chunk = 1;
    if (wrows < 1) wrows = 1;
    if (wrows > rows) wrows = rows;
    const int64_t first = n < chunk ? n : chunk;
    void *xs = cuda_scratch_get(cb, CUDA_SCRATCH_MATMUL, (size_t)(first * cols) * 2, err);
    if (!xs) return err ? err->code : PD_ENOMEM;
    void *ws = cuda_scratch_get(cb, CUDA_SCRATCH_WEIGHT, (size_t)(wrows * cols) * 2, err);
    if (!ws) return err ? err->code : PD_ENOMEM;
    for (int64_t t0 = 0; t0 < n; t0 += chunk) {
        const int nn = (int)(n - t0 < chunk ? n - t0 : chunk);
        const int64_t count = (int64_t)nn * cols;
        f32_to_bf16_kernel<<<cuda_grid_blocks(cb, count, 256), 256, 0, cuda_launch_stream(cb)>>>(x + t0 * cols,
                                                                                    (__nv_bfloat16 *)xs, count);
        int rc = cuda_check_launch(err, "matmul (convert x)");
        if (rc) return rc;
        for (int64_t r0 = 0; r0 < rows; r0 += wrows) {
            const int nr = (int)(rows - r0 < wrows ? rows - r0 : wrows);
            rc = cuda_quant_dequantize(cb, e, NULL, r0, nr, true, ws, err);
            if (rc) return rc;
            const cublasStatus_t s =
                cublasGemmEx(cuda_launch_blas(cb), CUBLAS_OP_T, CUBLAS_OP_N, nr, nn, cols, &alpha, ws, CUDA_R_16BF, cols, xs,
                             CUDA_R_16BF, cols, &beta, y + t0 * rows + r0, CUDA_R_32F, rows, CUBLAS_COMPUTE_32F,
                             CUBLAS_GEMM_DEFAULT);
            if (s != CUBLAS_STATUS_SUCCESS) return cublas_fail(err, s, "cublasGemmEx (quantized matmul)");
        }
    }
    return PD_OK;
}

static int gemm(cuda_backend *cb, const cuda_weight_entry *e, const float *x, int64_t n, float *y, pd_error *err) {
    const int rows = (int)e->rows, cols = (int)e->cols;
    const float alpha = 1.0f, beta = 0.0f;
    // Tokens per cuBLAS call: n must fit an int, and for 16-bit weights the
    // converted x must fit the scratch bound.
    int64_t chunk = e->dev_type == PD_TYPE_F32 ? INT_MAX : GEMM_X_ELEMS / cols;
    if (chunk < 1) chunk = 1;
    void *xs = NULL;
    float *scales = NULL; // f16: per-token power-of-two scales, after x
    if (e->dev_type != PD_TYPE_F32) {
        const int64_t first = n < chunk ? n : chunk;
        const size_t x_bytes = ((size_t)(first * cols) * 2 + 255) & ~(size_t)255;
        xs = cuda_scratch_get(cb, CUDA_SCRATCH_MATMUL, x_bytes + sizeof(float) * (size_t)first, err);
        if (!xs) return err ? err->code : PD_ENOMEM;
        scales = (float *)((char *)xs + x_bytes);
    }
    for (int64_t t0 = 0; t0 < n; t0 += chunk) {
        const int nn = (int)(n - t0 < chunk ? n - t0 : chunk);
        const float *xc = x + t0 * cols;
        float *yc = y + t0 * rows;
        cublasStatus_t s;
        if (e->dev_type == PD_TYPE_F32) {
            s = cublasSgemm(cuda_launch_blas(cb), CUBLAS_OP_T, CUBLAS_OP_N, rows, nn, cols, &alpha, (const float *)e->dev, cols,
                            xc, cols, &beta, yc, rows);
            if (s != CUBLAS_STATUS_SUCCESS) return cublas_fail(err, s, "cublasSgemm (matmul)");
            continue;
        }
        // x rounded to the weight's 16-bit type (tensor cores take both
        // operands in one type), products accumulated in f32.
        const int64_t count = (int64_t)nn * cols;
        const unsigned blocks = cuda_grid_blocks(cb, count, 256);
        cudaDataType_t dt;
        if (e->dev_type == PD_TYPE_BF16) {
            f32_to_bf16_kernel<<<blocks, 256, 0, cuda_launch_stream(cb)>>>(xc, (__nv_bfloat16 *)xs, count);
            dt = CUDA_R_16BF;
        } else {
            f32_to_f16_scaled_kernel<<<(unsigned)nn, 256, 0, cuda_launch_stream(cb)>>>(xc, (__half *)xs, cols, scales);
            dt = CUDA_R_16F;
        }
        int rc = cuda_check_launch(err, "matmul (convert x)");
        if (rc) return rc;
        s = cublasGemmEx(cuda_launch_blas(cb), CUBLAS_OP_T, CUBLAS_OP_N, rows, nn, cols, &alpha, e->dev, dt, cols, xs, dt, cols,
                         &beta, yc, CUDA_R_32F, rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
        if (s != CUBLAS_STATUS_SUCCESS) return cublas_fail(err, s, "cublasGemmEx (matmul)");
        if (dt == CUDA_R_16F) {
            const int64_t out = (int64_t)nn * rows;
            unscale_rows_kernel<<<cuda_grid_blocks(cb, out, 256), 256, 0, cuda_launch_stream(cb)>>>(yc, scales, rows, out);
            rc = cuda_check_launch(err, "matmul (unscale y)");
            if (rc) return rc;
        }
    }
    return PD_OK;
}

int cuda_matmul(pd_backend *be, const pd_weight *w, const float *x, int64_t n, float *y, pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    int rc = cuda_enter(cb, err);
    if (rc) return rc;
    if (n < 0) return pd_errorf(err, PD_EINVAL, "matmul: negative token count %lld", (long long)n);
    if (n == 0) return PD_OK;
    if (!x || !y) return pd_errorf(err, PD_EINVAL, "matmul: NULL input or output");
    const cuda_weight_entry *e;
    rc = weight_get(cb, w, &e, err);
    if (rc) return rc;
    int64_t qk, qb;
    if (cuda_quant_block(e->dev_type, &qk, &qb))
        return n > GEMV_MAX_N ? gemm_quant(cb, e, x, n, y, err) : cuda_quant_gemv(cb, e, x, n, y, err);
    if (n > GEMV_MAX_N) return gemm(cb, e, x, n, y, err);
    switch (e->dev_type) {
    case PD_TYPE_BF16: return gemv_any<w_bf16>(cb, e, x, n, y, err);
    case PD_TYPE_F16: return gemv_any<w_f16>(cb, e, x, n, y, err);
    default: return gemv_any<w_f32>(cb, e, x, n, y, err);
    }
}

/* ------------------------------------------------------------------------
 * fused products: several weights sharing x (Q, K, V), gate/up + GLU
 * ------------------------------------------------------------------------ */

// The device entries of ws[0..n) (uploading any missing), in es. Entries
// are looked up again once all exist, since an upload moves the table.
static int weights_get(cuda_backend *cb, const pd_weight *const *ws, int n, const cuda_weight_entry **es,
                       pd_error *err) {
    for (int pass = 0; pass < 2; pass++)
        for (int j = 0; j < n; j++) {
            const int rc = weight_get(cb, ws[j], &es[j], err);
            if (rc) return rc;
        }
    return PD_OK;
}

// One GEMV launch can serve these entries: a decode batch, one device type
// and cols, an x the vector kernels take.
static bool job_fits(const cuda_weight_entry *const *es, int n_w, const float *x, int64_t n) {
    if (n < 1 || n > GEMV_MAX_N) return false;
    for (int j = 1; j < n_w; j++)
        if (es[j]->dev_type != es[0]->dev_type || es[j]->cols != es[0]->cols) return false;
    return gemv_vec_ok(es[0]->dev_type, es[0]->cols, x);
}

int cuda_matmul_multi(pd_backend *be, const pd_weight *const *w, int n_w, const float *x, int64_t n, float *const *y,
                      pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    int rc = cuda_enter(cb, err);
    if (rc) return rc;
    if (n_w < 1 || n_w > PD_MATMUL_MULTI_MAX)
        return pd_errorf(err, PD_EINVAL, "matmul_multi: %d weights, 1 to %d supported", n_w, PD_MATMUL_MULTI_MAX);
    if (n < 0) return pd_errorf(err, PD_EINVAL, "matmul_multi: negative token count %lld", (long long)n);
    if (n == 0) return PD_OK;
    const cuda_weight_entry *es[PD_MATMUL_MULTI_MAX];
    if ((rc = weights_get(cb, w, n_w, es, err))) return rc;
    for (int j = 0; j < n_w; j++)
        if (!y[j]) return pd_errorf(err, PD_EINVAL, "matmul_multi: NULL output %d", j);
    if (!x || !job_fits(es, n_w, x, n)) {
        for (int j = 0; j < n_w && !rc; j++) rc = cuda_matmul(be, w[j], x, n, y[j], err);
        return rc;
    }
    cuda_gemv_job job;
    memset(&job, 0, sizeof job);
    for (int j = 0; j < n_w; j++) job.w[j] = es[j]->dev, job.y[j] = y[j], job.rows[j] = es[j]->rows;
    job.cols = es[0]->cols, job.n_w = n_w, job.act = CUDA_ACT_NONE;
    return gemv_job_run(cb, es[0]->dev_type, &job, x, n, err);
}

int cuda_matmul_glu(pd_backend *be, const pd_weight *w_gate, const pd_weight *w_up, const float *x, int64_t n,
                    pd_glu act, float *out, float *up, pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    int rc = cuda_enter(cb, err);
    if (rc) return rc;
    if (act != PD_GLU_SILU && act != PD_GLU_GELU) return pd_errorf(err, PD_EINVAL, "matmul_glu: unknown activation %d", (int)act);
    if (n < 0) return pd_errorf(err, PD_EINVAL, "matmul_glu: negative token count %lld", (long long)n);
    if (n == 0) return PD_OK;
    if (!x || !out) return pd_errorf(err, PD_EINVAL, "matmul_glu: NULL input or output");
    const pd_weight *ws[2] = {w_gate, w_up};
    const cuda_weight_entry *es[2];
    if ((rc = weights_get(cb, ws, 2, es, err))) return rc;
    if (es[0]->rows != es[1]->rows || es[0]->cols != es[1]->cols)
        return pd_errorf(err, PD_EINVAL, "matmul_glu: gate %lld x %lld and up %lld x %lld differ in shape",
                         (long long)es[0]->rows, (long long)es[0]->cols, (long long)es[1]->rows, (long long)es[1]->cols);
    if (!job_fits(es, 2, x, n)) {
        // Prefill (or shapes the vector kernels cannot take): two products
        // and the elementwise kernel.
        if (!up) return pd_errorf(err, PD_EINVAL, "matmul_glu: NULL up scratch");
        if ((rc = cuda_matmul(be, w_gate, x, n, out, err)) || (rc = cuda_matmul(be, w_up, x, n, up, err))) return rc;
        const int64_t count = n * es[0]->rows;
        return act == PD_GLU_SILU ? cuda_swiglu(be, out, up, count, out, err) : cuda_geglu(be, out, up, count, out, err);
    }
    cuda_gemv_job job;
    memset(&job, 0, sizeof job);
    job.w[0] = es[0]->dev, job.w[1] = es[1]->dev, job.y[0] = out;
    job.rows[0] = job.rows[1] = es[0]->rows;
    job.cols = es[0]->cols, job.n_w = 2, job.act = act == PD_GLU_SILU ? CUDA_ACT_SILU : CUDA_ACT_GELU;
    return gemv_job_run(cb, es[0]->dev_type, &job, x, n, err);
}

/* ------------------------------------------------------------------------
 * get_rows
 * ------------------------------------------------------------------------ */

template <class WT>
__global__ void get_rows_kernel(const void *__restrict__ w, const int32_t *__restrict__ ids, int64_t n, int64_t cols,
                                float *__restrict__ out) {
    const int64_t total = n * cols;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const int64_t r = i / cols, c = i - r * cols;
        out[i] = WT::load(w, (int64_t)ids[r] * cols + c);
    }
}

int cuda_get_rows(pd_backend *be, const pd_weight *w, const int32_t *ids, int64_t n, float *out, pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    int rc = cuda_enter(cb, err);
    if (rc) return rc;
    if (n < 0) return pd_errorf(err, PD_EINVAL, "get_rows: negative count %lld", (long long)n);
    if (n == 0) return PD_OK;
    if (!ids || !out) return pd_errorf(err, PD_EINVAL, "get_rows: NULL ids or output");
    if (!w) return pd_errorf(err, PD_EINVAL, "get_rows: NULL weight");
    // Same check and status as the CPU backend.
    for (int64_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= w->rows)
            return pd_errorf(err, PD_ERANGE, "get_rows: id %d at index %lld is outside [0, %lld)", (int)ids[i],
                             (long long)i, (long long)w->rows);
    const cuda_weight_entry *e;
    rc = weight_get(cb, w, &e, err);
    if (rc) return rc;
    if ((uint64_t)n > SIZE_MAX / sizeof(int32_t))
        return pd_errorf(err, PD_ERANGE, "get_rows: %lld ids overflow", (long long)n);
    int32_t *ids_dev = (int32_t *)cuda_scratch_get(cb, CUDA_SCRATCH_MISC, (size_t)n * sizeof(int32_t), err);
    if (!ids_dev) return err ? err->code : PD_ENOMEM;
    rc = cuda_upload(cb, ids_dev, ids, (size_t)n * sizeof(int32_t), err);
    if (rc) return rc;
    int64_t qk, qb;
    if (cuda_quant_block(e->dev_type, &qk, &qb)) return cuda_quant_dequantize(cb, e, ids_dev, 0, n, false, out, err);
    const unsigned blocks = cuda_grid_blocks(cb, n * e->cols, 256);
    switch (e->dev_type) {
    case PD_TYPE_BF16:
        get_rows_kernel<w_bf16><<<blocks, 256, 0, cuda_launch_stream(cb)>>>(e->dev, ids_dev, n, e->cols, out);
        break;
    case PD_TYPE_F16:
        get_rows_kernel<w_f16><<<blocks, 256, 0, cuda_launch_stream(cb)>>>(e->dev, ids_dev, n, e->cols, out);
        break;
    default: get_rows_kernel<w_f32><<<blocks, 256, 0, cuda_launch_stream(cb)>>>(e->dev, ids_dev, n, e->cols, out); break;
    }
    return cuda_check_launch(err, "get_rows");
}
