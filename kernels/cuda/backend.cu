// The CUDA backend: creation and teardown, the ops table, backend memory
// (alloc, release, upload, download, copies, gather, sync). The helpers the
// other .cu files share (errors, allocation, scratch, the weight table,
// upload) are in runtime.cu.
// The compute ops live in matmul.cu, elementwise.cu, attention.cu and
// compactor.cu.
#include "kernels/cuda/cuda_internal.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------
 * memory ops
 * ------------------------------------------------------------------------ */

static void cuda_forget_weight_op(pd_backend *be, const pd_weight *w) {
    cuda_backend *cb = cuda_impl(be);
    if (w && cuda_enter(cb, NULL) == PD_OK) cuda_weight_forget(cb, w->data);
}

static void *cuda_alloc_op(pd_backend *be, size_t bytes, pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    if (cuda_enter(cb, err) != PD_OK) return NULL;
    return cuda_block_alloc(cb, bytes, "backend memory", err);
}

// Into the allocator's cache: no sync and no cudaFree on the serving path.
static void cuda_release_op(pd_backend *be, void *p) {
    if (!p) return;
    cuda_backend *cb = cuda_impl(be);
    const cudaError_t e = cudaSetDevice(cb->device);
    if (e != cudaSuccess) {
        (void)cudaGetLastError();
        if (cb->deferred == cudaSuccess) cb->deferred = e;
    }
    cuda_block_release(cb, p);
}

static int cuda_upload_op(pd_backend *be, void *dst, const void *src, size_t bytes, pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    const int rc = cuda_enter(cb, err);
    return rc ? rc : cuda_upload(cb, dst, src, bytes, err);
}

static int cuda_download_op(pd_backend *be, void *dst, const void *src, size_t bytes, pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    const int rc = cuda_enter(cb, err);
    return rc ? rc : cuda_download(cb, dst, src, bytes, err);
}

// Page-locked host memory: downloads into it are one DMA with no staging.
static void *cuda_host_alloc_op(pd_backend *be, size_t bytes, pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    if (cuda_enter(cb, err) != PD_OK) return NULL;
    void *p = NULL;
    const cudaError_t e = cudaHostAlloc(&p, bytes ? bytes : 1, cudaHostAllocDefault);
    if (e != cudaSuccess) {
        cuda_fail(err, e, "cudaHostAlloc (pinned host memory)");
        return NULL;
    }
    return p;
}

static void cuda_host_free_op(pd_backend *be, void *p) {
    if (!p) return;
    cuda_backend *cb = cuda_impl(be);
    // cudaFreeHost waits for the device; a queued copy may still use p.
    if (cudaSetDevice(cb->device) != cudaSuccess || cudaFreeHost(p) != cudaSuccess) (void)cudaGetLastError();
}

// The driver's free memory plus what the allocator's cache holds (it is
// given back on demand).
static int cuda_memory_op(pd_backend *be, uint64_t *free_bytes, uint64_t *total_bytes, pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    int rc = cuda_enter(cb, err);
    if (rc) return rc;
    size_t f = 0, t = 0;
    const cudaError_t e = cudaMemGetInfo(&f, &t);
    if (e != cudaSuccess) return cuda_fail(err, e, "cudaMemGetInfo");
    *free_bytes = (uint64_t)f + cb->cached_bytes;
    *total_bytes = (uint64_t)t;
    return PD_OK;
}

static int cuda_copy_op(pd_backend *be, void *dst, const void *src, size_t bytes, pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    const int rc = cuda_enter(cb, err);
    if (rc) return rc;
    if (bytes == 0) return PD_OK;
    if (!dst || !src) return pd_errorf(err, PD_EINVAL, "cuda backend: copy with a NULL pointer");
    const cudaError_t e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, cb->stream);
    return e == cudaSuccess ? PD_OK : cuda_fail(err, e, "copy (cudaMemcpyAsync device to device)");
}

static int cuda_copy2d_op(pd_backend *be, void *dst, size_t dst_pitch, const void *src, size_t src_pitch,
                          size_t width, size_t rows, pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    const int rc = cuda_enter(cb, err);
    if (rc) return rc;
    if (width == 0 || rows == 0) return PD_OK;
    if (!dst || !src) return pd_errorf(err, PD_EINVAL, "cuda backend: copy2d with a NULL pointer");
    // A single row has no pitch to speak of; cudaMemcpy2D still wants one.
    if (rows == 1) dst_pitch = src_pitch = width;
    if (width > dst_pitch || width > src_pitch)
        return pd_errorf(err, PD_EINVAL, "cuda backend: copy2d rows of %zu bytes exceed the pitch (%zu / %zu)",
                         width, dst_pitch, src_pitch);
    const cudaError_t e =
        cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, rows, cudaMemcpyDeviceToDevice, cb->stream);
    return e == cudaSuccess ? PD_OK : cuda_fail(err, e, "copy2d (cudaMemcpy2DAsync)");
}

// dst row r = src row idx[r], rows of `words` elements of T (T picked by the
// host from the row size and the pointers' alignment).
template <typename T>
__global__ void gather_rows_kernel(T *__restrict__ dst, const T *__restrict__ src, const int32_t *__restrict__ idx,
                                   int64_t n, int64_t words) {
    const int64_t total = n * words;
    const int64_t stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const int64_t r = i / words, c = i - r * words;
        dst[i] = src[(int64_t)idx[r] * words + c];
    }
}

template <typename T>
static int gather_launch(cuda_backend *cb, void *dst, const void *src, const int32_t *idx, int64_t n,
                         size_t row_bytes, pd_error *err) {
    const int64_t words = (int64_t)(row_bytes / sizeof(T));
    const int threads = 256;
    gather_rows_kernel<T><<<cuda_grid_blocks(cb, n * words, threads), threads, 0, cuda_launch_stream(cb)>>>(
        (T *)dst, (const T *)src, idx, n, words);
    return cuda_check_launch(err, "gather");
}

// One descriptor per blockIdx.x; blockIdx.y and the threads stride over its
// rows x words. Every pointer, pitch and width was checked to be a
// multiple of 4 bytes, so whole 32-bit words move.
typedef struct copy2d_desc_dev {
    uint32_t *dst;
    const uint32_t *src;
    int64_t dst_pitch, src_pitch, words, rows; // pitches in words
} copy2d_desc_dev;

__global__ void copy2d_batch_kernel(const copy2d_desc_dev *__restrict__ descs) {
    const copy2d_desc_dev d = descs[blockIdx.x];
    const int64_t total = d.rows * d.words;
    const int64_t stride = (int64_t)gridDim.y * blockDim.x;
    for (int64_t i = (int64_t)blockIdx.y * blockDim.x + threadIdx.x; i < total; i += stride) {
        const int64_t r = i / d.words, c = i - r * d.words;
        d.dst[r * d.dst_pitch + c] = d.src[r * d.src_pitch + c];
    }
}

// A decode step appends K/V rows to every (sequence, layer, kv head)
// stream: one upload of descriptors and one launch instead of hundreds of
// cudaMemcpy2DAsync calls. Copies that are not word-aligned fall back to
// cudaMemcpy2DAsync one by one.
static int cuda_copy2d_batch_op(pd_backend *be, const pd_copy2d *d, int64_t n, pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    int rc = cuda_enter(cb, err);
    if (rc) return rc;
    if (n < 0) return pd_errorf(err, PD_EINVAL, "cuda backend: copy2d_batch of a negative count %lld", (long long)n);
    bool words = true;
    int64_t most = 0;
    for (int64_t i = 0; i < n; i++) {
        const uintptr_t bits = (uintptr_t)d[i].dst | (uintptr_t)d[i].src | d[i].dst_pitch | d[i].src_pitch | d[i].width;
        if (d[i].rows > 1 && (d[i].width > d[i].dst_pitch || d[i].width > d[i].src_pitch))
            return pd_errorf(err, PD_EINVAL, "cuda backend: copy2d rows of %zu bytes exceed the pitch (%zu / %zu)",
                             d[i].width, d[i].dst_pitch, d[i].src_pitch);
        words &= bits % 4 == 0;
        const int64_t w = (int64_t)(d[i].rows * d[i].width / 4);
        most = w > most ? w : most;
    }
    if (n == 0 || most == 0) return PD_OK;
    if (!words || n > INT32_MAX) {
        for (int64_t i = 0; i < n && !rc; i++)
            rc = be->ops->copy2d(be, d[i].dst, d[i].dst_pitch, d[i].src, d[i].src_pitch, d[i].width, d[i].rows, err);
        return rc;
    }
    const size_t bytes = (size_t)n * sizeof(copy2d_desc_dev);
    copy2d_desc_dev *host = (copy2d_desc_dev *)malloc(bytes);
    if (!host) return pd_errorf(err, PD_ENOMEM, "cuda backend: out of memory for %lld copy descriptors", (long long)n);
    for (int64_t i = 0; i < n; i++)
        host[i] = (copy2d_desc_dev){(uint32_t *)d[i].dst, (const uint32_t *)d[i].src, (int64_t)(d[i].dst_pitch / 4),
                                    (int64_t)(d[i].src_pitch / 4), (int64_t)(d[i].width / 4), (int64_t)d[i].rows};
    copy2d_desc_dev *dev = (copy2d_desc_dev *)cuda_scratch_get(cb, CUDA_SCRATCH_MISC, bytes, err);
    rc = dev ? cuda_upload(cb, dev, host, bytes, err) : PD_ENOMEM;
    free(host);
    if (rc) return rc;
    const int threads = 256;
    int64_t per = (most + threads - 1) / threads;
    dim3 grid((unsigned)n, (unsigned)(per < 1 ? 1 : per > 64 ? 64 : per));
    copy2d_batch_kernel<<<grid, threads, 0, cuda_launch_stream(cb)>>>(dev);
    return cuda_check_launch(err, "copy2d_batch");
}

static int cuda_gather_op(pd_backend *be, void *dst, const void *src, const int32_t *idx, int64_t n,
                          size_t row_bytes, pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    int rc = cuda_enter(cb, err);
    if (rc) return rc;
    if (n < 0) return pd_errorf(err, PD_EINVAL, "cuda backend: gather of a negative count %lld", (long long)n);
    if (n == 0 || row_bytes == 0) return PD_OK;
    if (!dst || !src || !idx) return pd_errorf(err, PD_EINVAL, "cuda backend: gather with a NULL pointer");
    if ((uint64_t)n > (uint64_t)PTRDIFF_MAX / row_bytes || (uint64_t)n > SIZE_MAX / sizeof(int32_t))
        return pd_errorf(err, PD_ERANGE, "cuda backend: gather of %lld rows of %zu bytes overflows", (long long)n,
                         row_bytes);
    // The source's row count is not known here; negative indices at least
    // are certainly wrong.
    for (int64_t i = 0; i < n; i++)
        if (idx[i] < 0)
            return pd_errorf(err, PD_EINVAL, "cuda backend: gather index %d at position %lld is negative",
                             (int)idx[i], (long long)i);
    const size_t idx_bytes = (size_t)n * sizeof(int32_t);
    int32_t *idx_dev = (int32_t *)cuda_scratch_get(cb, CUDA_SCRATCH_MISC, idx_bytes, err);
    if (!idx_dev) return err ? err->code : PD_ENOMEM;
    rc = cuda_upload(cb, idx_dev, idx, idx_bytes, err);
    if (rc) return rc;
    const uintptr_t align = (uintptr_t)dst | (uintptr_t)src;
    if (row_bytes % 16 == 0 && align % 16 == 0) return gather_launch<uint4>(cb, dst, src, idx_dev, n, row_bytes, err);
    if (row_bytes % 4 == 0 && align % 4 == 0) return gather_launch<uint32_t>(cb, dst, src, idx_dev, n, row_bytes, err);
    return gather_launch<uint8_t>(cb, dst, src, idx_dev, n, row_bytes, err);
}

static int cuda_sync_op(pd_backend *be, pd_error *err) {
    cuda_backend *cb = cuda_impl(be);
    if (cb->capturing)
        return pd_errorf(err, PD_EINVAL, "cuda backend: sync while a graph is being recorded (end it first)");
    int rc = cuda_enter(cb, err);
    if (rc) return rc;
    rc = cuda_take_deferred(cb, err);
    if (rc) return rc;
    cudaError_t e = cuda_stream_wait(cb);
    if (e != cudaSuccess) return cuda_fail(err, e, "stream synchronize");
    e = cudaGetLastError();
    return e == cudaSuccess ? PD_OK : cuda_fail(err, e, "an earlier operation");
}

/* ------------------------------------------------------------------------
 * create / free
 * ------------------------------------------------------------------------ */

// Tear down whatever part of cb exists (creation uses it to unwind).
static void cuda_destroy(cuda_backend *cb) {
    if (!cb) return;
    if (cudaSetDevice(cb->device) != cudaSuccess) (void)cudaGetLastError();
    if (cb->stream && cudaStreamSynchronize(cb->stream) != cudaSuccess) (void)cudaGetLastError();
    for (int64_t i = 0; i < cb->n_weights; i++) (void)cudaFree(cb->weights[i].dev);
    free(cb->weights);
    free(cb->weight_index);
    // Scratch blocks are the allocator's: this frees them with the rest.
    cuda_blocks_destroy(cb);
    cuda_ring_destroy(cb);
    for (int i = 0; i < 2; i++) {
        if (cb->pinned_done[i]) (void)cudaEventDestroy(cb->pinned_done[i]);
        if (cb->pinned[i]) (void)cudaFreeHost(cb->pinned[i]);
    }
    if (cb->cusolver) (void)cusolverDnDestroy(cb->cusolver);
    if (cb->cublas) (void)cublasDestroy(cb->cublas);
    cuda_graphs_destroy(cb);
    if (cb->stream) (void)cudaStreamDestroy(cb->stream);
    (void)cudaGetLastError();
    free(cb);
}

static void cuda_free_op(pd_backend *be) {
    if (be) cuda_destroy(cuda_impl(be));
}

static void cuda_counters_op(const pd_backend *be, pd_backend_counters *out) {
    *out = ((const cuda_backend *)be->impl)->counters;
}

static pd_backend_ops make_cuda_ops(void) {
    pd_backend_ops o;
    memset(&o, 0, sizeof o);
    o.name = "cuda";
    o.host_memory = false;
    o.free = cuda_free_op;
    o.alloc = cuda_alloc_op;
    o.release = cuda_release_op;
    o.upload = cuda_upload_op;
    o.download = cuda_download_op;
    o.copy = cuda_copy_op;
    o.copy2d = cuda_copy2d_op;
    o.copy2d_batch = cuda_copy2d_batch_op;
    o.convert = cuda_convert;
    o.forget_weight = cuda_forget_weight_op;
    o.gather = cuda_gather_op;
    o.sync = cuda_sync_op;
    o.prepare_weight = cuda_prepare_weight;
    o.matmul = cuda_matmul;
    o.get_rows = cuda_get_rows;
    o.rmsnorm = cuda_rmsnorm;
    o.rope = cuda_rope;
    o.swiglu = cuda_swiglu;
    o.geglu = cuda_geglu;
    o.softcap = cuda_softcap;
    o.scale = cuda_scale;
    o.add = cuda_add;
    o.attention = cuda_attention;
    o.add_rmsnorm = cuda_add_rmsnorm;
    o.matmul_multi = cuda_matmul_multi;
    o.matmul_glu = cuda_matmul_glu;
    o.qkv_bias_rope = cuda_qkv_bias_rope;
    o.token_scores = cuda_token_scores;
    o.graph_begin = cuda_graph_begin;
    o.graph_end = cuda_graph_end;
    o.counters = cuda_counters_op;
    o.host_alloc = cuda_host_alloc_op;
    o.host_free = cuda_host_free_op;
    o.memory = cuda_memory_op;
    o.timer = &cuda_timer_ops;
    return o;
}

// The ops table: built on first use (C++ makes that thread-safe),
// read-only afterwards.
static const pd_backend_ops *cuda_ops(void) {
    static const pd_backend_ops ops = make_cuda_ops();
    return &ops;
}

#define CREATE_TRY(call, what)                                                                     \
    do {                                                                                           \
        const cudaError_t e_ = (call);                                                             \
        if (e_ != cudaSuccess) {                                                                   \
            rc = cuda_fail(err, e_, what);                                                         \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)

extern "C" int pd_backend_cuda_create(int index, pd_backend **out, pd_error *err) {
    *out = NULL;
    int count = 0;
    const cudaError_t ce = cudaGetDeviceCount(&count);
    if (ce != cudaSuccess) {
        (void)cudaGetLastError();
        return pd_errorf(err, PD_ENOTFOUND,
                         "no usable CUDA device (%s); set model.device = cpu, or auto to fall back to the CPU",
                         cudaGetErrorString(ce));
    }
    if (index < 0 || index >= count)
        return pd_errorf(err, PD_ENOTFOUND,
                         "CUDA device %d does not exist: this machine has %d CUDA device%s; set model.device = "
                         "cpu or auto%s",
                         index, count, count == 1 ? "" : "s", count > 0 ? ", or cuda:N with N below the count" : "");

    int rc = PD_OK;
    cublasStatus_t bs;
    cusolverStatus_t ss;
    cuda_backend *cb = (cuda_backend *)calloc(1, sizeof *cb);
    if (!cb) return pd_errorf(err, PD_ENOMEM, "cuda backend: out of host memory");
    cb->device = index;
    cb->deferred = cudaSuccess;

    CREATE_TRY(cudaSetDevice(index), "cudaSetDevice");
    CREATE_TRY(cudaGetDeviceProperties(&cb->prop, index), "cudaGetDeviceProperties");
    // Non-blocking: no implicit ordering with the legacy default stream that
    // other code in the process might use.
    CREATE_TRY(cudaStreamCreateWithFlags(&cb->stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");

    bs = cublasCreate(&cb->cublas);
    if (bs != CUBLAS_STATUS_SUCCESS) {
        cb->cublas = NULL;
        rc = cublas_fail(err, bs, "cublasCreate");
        goto fail;
    }
    bs = cublasSetStream(cb->cublas, cb->stream);
    if (bs != CUBLAS_STATUS_SUCCESS) {
        rc = cublas_fail(err, bs, "cublasSetStream");
        goto fail;
    }
    // Default math: bf16/f16 GEMMs (cublasGemmEx) use tensor cores with f32
    // accumulation; f32 GEMMs stay full f32 (no TF32), as on the CPU.
    bs = cublasSetMathMode(cb->cublas, CUBLAS_DEFAULT_MATH);
    if (bs != CUBLAS_STATUS_SUCCESS) {
        rc = cublas_fail(err, bs, "cublasSetMathMode");
        goto fail;
    }
    ss = cusolverDnCreate(&cb->cusolver);
    if (ss != CUSOLVER_STATUS_SUCCESS) {
        cb->cusolver = NULL;
        rc = cusolver_fail(err, ss, "cusolverDnCreate");
        goto fail;
    }
    ss = cusolverDnSetStream(cb->cusolver, cb->stream);
    if (ss != CUSOLVER_STATUS_SUCCESS) {
        rc = cusolver_fail(err, ss, "cusolverDnSetStream");
        goto fail;
    }

    cb->pinned_bytes = CUDA_PINNED_BYTES;
    for (int i = 0; i < 2; i++) {
        CREATE_TRY(cudaHostAlloc(&cb->pinned[i], cb->pinned_bytes, cudaHostAllocDefault),
                   "cudaHostAlloc (pinned staging buffer)");
        CREATE_TRY(cudaEventCreateWithFlags(&cb->pinned_done[i], cudaEventDisableTiming), "cudaEventCreate");
    }
    if ((rc = cuda_ring_create(cb, err))) goto fail;
    if ((rc = cuda_graphs_create(cb, err))) goto fail;

    cb->base.ops = cuda_ops();
    cb->base.impl = cb;
    *out = &cb->base;
    return PD_OK;

fail:
    pd_error_prefix(err, "cuda backend on device %d", index);
    cuda_destroy(cb);
    return rc;
}
