// Private to kernels/cuda: the CUDA backend's state and the entry points
// its .cu files share. Nothing outside kernels/cuda includes this.
#ifndef PD_KERNELS_CUDA_INTERNAL_H
#define PD_KERNELS_CUDA_INTERNAL_H

#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>
#include <math.h>

#include "kernels/backend_impl.h"

// C linkage for everything here, so a definition written either with or
// without `extern "C"` matches these declarations.
extern "C" {

// A growable device buffer owned by the backend (scratch reused across calls).
typedef struct cuda_scratch {
    void *p;
    size_t bytes;
} cuda_scratch;

// The device copy of one weight (backend.cu keeps the table, matmul.cu fills
// it): `rows` rows of `cols` elements of dev_type, row-major and contiguous,
// made from the host tensor at `host`. dev_type is the host type: F32, F16,
// BF16, or a quantized type whose rows are the GGUF tensor's blocks as they
// are (kernels in quant.cu).
typedef struct cuda_weight_entry {
    const void *host; // key: pd_weight.data
    pd_type type;     // the host tensor's type
    int64_t rows, cols;
    void *dev;
    pd_type dev_type;
} cuda_weight_entry;

typedef struct cuda_backend {
    pd_backend base;
    int device;
    cudaStream_t stream;
    cublasHandle_t cublas;
    cusolverDnHandle_t cusolver;
    cudaDeviceProp prop;
    // Pinned staging for upload/download of pageable host memory (double-buffered).
    void *pinned[2];
    cudaEvent_t pinned_done[2];
    size_t pinned_bytes;
    // Weight cache keyed by host data pointer (backend.cu).
    cuda_weight_entry *weights;
    int64_t n_weights, cap_weights;
    // Open-addressing index into `weights` (entry index + 1; 0 = empty),
    // weight_slots a power of two kept at most half full.
    int64_t *weight_index;
    int64_t weight_slots;
    // A failure seen where it could not be returned (release), reported by
    // the next sync or download.
    cudaError_t deferred;
    // Scratch for ops (matmul activations in bf16, attention partials, ...).
    cuda_scratch scratch[5];
    // What pd_backend_counters_get reports; bumped by the thread using the backend.
    pd_backend_counters counters;
} cuda_backend;

// Scratch slots: each user owns one, so nested uses never alias.
// CUDA_SCRATCH_WEIGHT: a chunk of a quantized weight's rows dequantized to
// bf16 for the prefill GEMM (matmul.cu).
enum {
    CUDA_SCRATCH_MATMUL = 0,
    CUDA_SCRATCH_ATTN = 1,
    CUDA_SCRATCH_SCORE = 2,
    CUDA_SCRATCH_MISC = 3,
    CUDA_SCRATCH_WEIGHT = 4
};

static inline cuda_backend *cuda_impl(pd_backend *be) { return (cuda_backend *)be->impl; }

// Device pointer to at least `bytes` of scratch slot `slot` (grown with
// cudaMallocAsync-free semantics: synchronises the stream before freeing
// the old block). NULL with err filled on failure.
void *cuda_scratch_get(cuda_backend *cb, int slot, size_t bytes, pd_error *err);

// Map a failed CUDA / cuBLAS / cuSOLVER call to PD_EIO (PD_ENOMEM for
// out-of-memory) with a message naming `what`.
int cuda_fail(pd_error *err, cudaError_t e, const char *what);
int cublas_fail(pd_error *err, cublasStatus_t s, const char *what);
int cusolver_fail(pd_error *err, cusolverStatus_t s, const char *what);
// cudaGetLastError() after a kernel launch, as a status.
int cuda_check_launch(pd_error *err, const char *what);

// cudaMalloc with an out-of-memory message a user can act on (size, the
// device's free and total memory). *p is NULL on failure.
int cuda_malloc(cuda_backend *cb, void **p, size_t bytes, const char *what, pd_error *err);

// Make cb's device current on the calling thread (every op starts here: the
// backend may move between threads).
int cuda_enter(cuda_backend *cb, pd_error *err);
// host -> device copy on the stream with the upload op's contract (src
// reusable on return); backend.cu.
int cuda_upload(cuda_backend *cb, void *dst, const void *src, size_t bytes, pd_error *err);

// Weight table (backend.cu): the entry for host pointer w->data, or NULL.
cuda_weight_entry *cuda_weight_find(cuda_backend *cb, const void *host);
// Add an entry (copied) and return the table's copy (NULL with err filled
// when out of host memory; the caller still owns e->dev then). The table
// owns e->dev afterwards. Adding moves entries: earlier pointers from
// cuda_weight_find are invalid after it.
cuda_weight_entry *cuda_weight_add(cuda_backend *cb, const cuda_weight_entry *e, pd_error *err);
// Drop the device copy of the weight at host (after the stream drains).
void cuda_weight_forget(cuda_backend *cb, const void *host);
// Report (once) a failure that a release could not return.
int cuda_take_deferred(cuda_backend *cb, pd_error *err);
// Whether host pointer p is page-locked (so the copy engine reads it
// directly); PD_EINVAL for device memory passed where host memory belongs.
int cuda_host_kind(const void *p, bool *pinned, const char *op, pd_error *err);

// Pinned staging buffers for pageable host copies: two, so the CPU fills
// one while the copy engine drains the other.
#define CUDA_PINNED_BYTES ((size_t)8 << 20)
// Up to this size a pageable copy goes straight through cudaMemcpyAsync:
// staging would cost more than it saves.
#define CUDA_SMALL_COPY ((size_t)64 << 10)


// Blocks for a grid-stride loop over `total` items: enough to fill the
// device, never more than the items need.
static inline unsigned cuda_grid_blocks(const cuda_backend *cb, int64_t total, int threads) {
    int64_t want = (total + threads - 1) / threads;
    const int64_t cap = (int64_t)(cb->prop.multiProcessorCount > 0 ? cb->prop.multiProcessorCount : 1) * 32;
    if (want > cap) want = cap;
    if (want < 1) want = 1;
    return (unsigned)want;
}

// matmul.cu
int cuda_prepare_weight(pd_backend *be, const pd_weight *w, pd_error *err);
int cuda_matmul(pd_backend *be, const pd_weight *w, const float *x, int64_t n, float *y, pd_error *err);
int cuda_get_rows(pd_backend *be, const pd_weight *w, const int32_t *ids, int64_t n, float *out,
                  pd_error *err);
// quant.cu: quantized weights in their GGUF blocks.
// 1 and the block's elements and bytes when t is a quantized type with
// kernels here, else 0.
int cuda_quant_block(pd_type t, int64_t *elems, int64_t *bytes);
// y[n][rows] = x[n][cols] W^T for n in 1..8, e->dev_type quantized.
int cuda_quant_gemv(cuda_backend *cb, const cuda_weight_entry *e, const float *x, int64_t n, float *y,
                    pd_error *err);
// Rows ids[0..n_rows) (device ids) or, with ids NULL, rows [r0, r0 + n_rows)
// of e dequantized into out[n_rows][cols], as bf16 (bf16 true, out 16-byte
// aligned) or f32.
int cuda_quant_dequantize(cuda_backend *cb, const cuda_weight_entry *e, const int32_t *ids, int64_t r0,
                          int64_t n_rows, bool bf16, void *out, pd_error *err);
// elementwise.cu
int cuda_rmsnorm(pd_backend *be, const float *x, const float *weight, int64_t n, int64_t dim, float eps,
                 float *out, pd_error *err);
int cuda_rope(pd_backend *be, float *x, const int32_t *pos, int64_t n, int n_heads, int head_dim,
              const pd_rope_params *p, pd_error *err);
int cuda_swiglu(pd_backend *be, const float *gate, const float *up, int64_t n, float *out, pd_error *err);
int cuda_geglu(pd_backend *be, const float *gate, const float *up, int64_t n, float *out, pd_error *err);
int cuda_softcap(pd_backend *be, float *x, int64_t n, float cap, pd_error *err);
int cuda_scale(pd_backend *be, float *x, int64_t n, float s, pd_error *err);
int cuda_add(pd_backend *be, float *y, const float *x, int64_t rows, int64_t width, int64_t x_stride,
             pd_error *err);
int cuda_convert(pd_backend *be, void *dst, pd_type dst_type, const void *src, pd_type src_type, int64_t n,
                 pd_error *err);

// attention.cu
int cuda_attention(pd_backend *be, const pd_attn_args *a, pd_error *err);
// compactor.cu
int cuda_token_scores(pd_backend *be, const pd_token_score_args *a, pd_error *err);
// timing.cu: pd_backend_timer's marks (timing events on the stream).
extern const pd_backend_timer_ops cuda_timer_ops;

} // extern "C"

#ifdef __CUDACC__
// Sum of v over the warp; every lane gets the total.
static __device__ __forceinline__ float cuda_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Largest v over the warp (fmaxf: NaN lanes are ignored); every lane gets it.
static __device__ __forceinline__ float cuda_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum of v over the block (blockDim.x a multiple of 32, at most 1024); every
// thread gets the same total, summed in a fixed order. `shared` holds 32
// floats; every thread of the block must call this.
static __device__ __forceinline__ float cuda_block_sum(float v, float *shared) {
    const int lane = (int)(threadIdx.x & 31u), warp = (int)(threadIdx.x >> 5);
    const int n_warps = (int)(blockDim.x >> 5);
    v = cuda_warp_sum(v);
    __syncthreads(); // a previous call may still be reading `shared`
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    return cuda_warp_sum(lane < n_warps ? shared[lane] : 0.0f);
}

// Largest v over the block, as cuda_block_sum (same conditions, `shared`
// holds 32 floats, every thread must call it).
static __device__ __forceinline__ float cuda_block_max(float v, float *shared) {
    const int lane = (int)(threadIdx.x & 31u), warp = (int)(threadIdx.x >> 5);
    const int n_warps = (int)(blockDim.x >> 5);
    v = cuda_warp_max(v);
    __syncthreads(); // a previous call may still be reading `shared`
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    return cuda_warp_max(lane < n_warps ? shared[lane] : -INFINITY);
}
#endif

#endif
