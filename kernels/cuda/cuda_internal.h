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

// A block of device memory the caching allocator handed out or holds.
typedef struct cuda_block {
    void *p;
    size_t bytes;
} cuda_block;

// One in-flight upload out of the staging ring: the ring bytes
// [start, end) stay untouched until its event has passed on the stream:
// ring_done[slot], or graph_done for a copy recorded into a graph.
typedef struct cuda_ring_rec {
    size_t start, end;
    bool in_graph;
} cuda_ring_rec;

// Staging ring for uploads (runtime.cu): bytes, largest piece per copy,
// in-flight records it tracks at most.
#define CUDA_RING_BYTES ((size_t)16 << 20)
#define CUDA_RING_PIECE ((size_t)4 << 20)
#define CUDA_RING_RECORDS 1024

typedef struct cuda_backend {
    pd_backend base;
    int device;
    cudaStream_t stream;
    cublasHandle_t cublas;
    cusolverDnHandle_t cusolver;
    cudaDeviceProp prop;
    // Pinned staging for downloads to pageable host memory (double-buffered).
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
    // Caching allocator (runtime.cu): blocks handed out (sorted by address)
    // and released blocks kept for reuse; every op runs in order on the one
    // stream, so a block released while queued work still reads it is only
    // written by work queued after that.
    cuda_block *live, *cached;
    int64_t n_live, cap_live, n_cached, cap_cached;
    size_t cached_bytes;
    // Pinned upload ring (runtime.cu): every upload is copied in and queued
    // from here, so the caller's buffer is free on return and the host never
    // waits, unless the ring is full of copies not yet done.
    uint8_t *ring;
    size_t ring_head; // where the next piece goes
    cuda_ring_rec ring_rec[CUDA_RING_RECORDS];
    cudaEvent_t ring_done[CUDA_RING_RECORDS];
    int ring_first, ring_count; // FIFO of in-flight records (oldest first)
    // The newest ring_pending records were staged while a graph is being
    // recorded: their copies run only when it is launched, so they cannot
    // be retired before (graph.cu).
    int ring_pending;
    // CUDA graphs (graph.cu): while `capturing`, work queued on the stream
    // is recorded for one decode step, launched as one graph at graph_end.
    bool capturing;
    bool graphs_off; // a recording failed: steps run without graphs from then on
    int capture_bucket;
    cudaGraphExec_t graph_exec[PD_GRAPH_BUCKETS]; // by batch size - 1
    cudaEvent_t graph_done;                       // recorded after every graph launch
    void *blas_workspace;                         // cuBLAS's, so a recorded GEMM allocates nothing
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

// Device pointer to at least `bytes` of scratch slot `slot` (grown through
// the caching allocator: the old block goes back to the cache, no sync).
// NULL with err filled on failure.
void *cuda_scratch_get(cuda_backend *cb, int slot, size_t bytes, pd_error *err);

// Map a failed CUDA / cuBLAS / cuSOLVER call to PD_EIO (PD_ENOMEM for
// out-of-memory) with a message naming `what`.
int cuda_fail(pd_error *err, cudaError_t e, const char *what);
int cublas_fail(pd_error *err, cublasStatus_t s, const char *what);
int cusolver_fail(pd_error *err, cusolverStatus_t s, const char *what);
// cudaGetLastError() after a kernel launch, as a status.
int cuda_check_launch(pd_error *err, const char *what);

// cudaMalloc with an out-of-memory message a user can act on (size, the
// device's free and total memory). On out-of-memory the allocator's cached
// blocks go back to the driver (after a stream sync) and the call is
// retried once. *p is NULL on failure.
int cuda_malloc(cuda_backend *cb, void **p, size_t bytes, const char *what, pd_error *err);
// The caching allocator: a cached block of at least `bytes` and at most
// about twice that (the best fit), else cuda_malloc. NULL with err filled.
void *cuda_block_alloc(cuda_backend *cb, size_t bytes, const char *what, pd_error *err);
// Back to the cache (no sync, no cudaFree). A pointer the allocator did not
// hand out is freed after a stream sync, as before the cache existed.
void cuda_block_release(cuda_backend *cb, void *p);
// Give every cached block back to the driver (after a stream sync).
void cuda_cache_trim(cuda_backend *cb);
// Teardown: free every block, cached or handed out, and the tables.
void cuda_blocks_destroy(cuda_backend *cb);
// Host waits on the stream or an event, counted in counters.syncs. An
// event that has already passed costs no wait and no count.
cudaError_t cuda_stream_wait(cuda_backend *cb);
cudaError_t cuda_event_wait(cuda_backend *cb, cudaEvent_t e);
// Create / destroy the upload ring (backend creation and teardown).
int cuda_ring_create(cuda_backend *cb, pd_error *err);
void cuda_ring_destroy(cuda_backend *cb);
// device -> host on the stream with the download op's contract: waits for
// the queued work; a pageable destination is staged through pinned[].
int cuda_download(cuda_backend *cb, void *dst, const void *src, size_t bytes, pd_error *err);

// Make cb's device current on the calling thread (every op starts here: the
// backend may move between threads).
int cuda_enter(cuda_backend *cb, pd_error *err);
// host -> device copy on the stream with the upload op's contract (src
// reusable on return), through the pinned ring; runtime.cu.
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

// Pinned staging buffers for downloads to pageable memory: two, so the
// CPU empties one while the copy engine fills the other.
#define CUDA_PINNED_BYTES ((size_t)8 << 20)


// Blocks for a grid-stride loop over `total` items: enough to fill the
// device, never more than the items need.
static inline unsigned cuda_grid_blocks(const cuda_backend *cb, int64_t total, int threads) {
    int64_t want = (total + threads - 1) / threads;
    const int64_t cap = (int64_t)(cb->prop.multiProcessorCount > 0 ? cb->prop.multiProcessorCount : 1) * 32;
    if (want > cap) want = cap;
    if (want < 1) want = 1;
    return (unsigned)want;
}

// Every kernel launch and every cuBLAS/cuSOLVER call that enqueues work
// names its stream or handle through one of these, which counts it in
// counters.launches: `k<<<grid, block, smem, cuda_launch_stream(cb)>>>(...)`,
// `cublasGemmEx(cuda_launch_blas(cb), ...)`. The count sits in the launch
// itself, so it cannot drift from the launches; tests/test_cuda.c checks
// that no launch in kernels/cuda/ names the stream any other way and that
// the count equals what cudaemu ran.
static inline cudaStream_t cuda_launch_stream(cuda_backend *cb) {
    cb->counters.launches++;
    return cb->stream;
}
static inline cublasHandle_t cuda_launch_blas(cuda_backend *cb) {
    cb->counters.launches++;
    return cb->cublas;
}
static inline cusolverDnHandle_t cuda_launch_solver(cuda_backend *cb) {
    cb->counters.launches++;
    return cb->cusolver;
}

// matmul.cu
int cuda_prepare_weight(pd_backend *be, const pd_weight *w, pd_error *err);
int cuda_matmul(pd_backend *be, const pd_weight *w, const float *x, int64_t n, float *y, pd_error *err);
int cuda_matmul_multi(pd_backend *be, const pd_weight *const *w, int n_w, const float *x, int64_t n,
                      float *const *y, pd_error *err);
int cuda_matmul_glu(pd_backend *be, const pd_weight *w_gate, const pd_weight *w_up, const float *x, int64_t n,
                    pd_glu act, float *out, float *up, pd_error *err);
int cuda_get_rows(pd_backend *be, const pd_weight *w, const int32_t *ids, int64_t n, float *out,
                  pd_error *err);
// One decode GEMV launch over up to CUDA_GEMV_MAX_W weights that share x
// (Q, K and V) or over a gate and an up weight combined into
// act(gate) * up (matmul.cu, quant.cu): every weight of the same device
// type and cols. act: CUDA_ACT_NONE, each y[j] = x w[j]^T; otherwise n_w is
// 2, rows[0] == rows[1] and y[0] gets the activation's product. Passed to
// the kernel by value.
#define CUDA_GEMV_MAX_W 3
enum { CUDA_ACT_NONE = 0, CUDA_ACT_SILU = 1, CUDA_ACT_GELU = 2 };
typedef struct cuda_gemv_job {
    const void *w[CUDA_GEMV_MAX_W];
    float *y[CUDA_GEMV_MAX_W];
    int64_t rows[CUDA_GEMV_MAX_W];
    int64_t cols;
    int n_w;
    int act;
} cuda_gemv_job;
// Blocks a job of R rows per block needs (an activation job: R/2 rows of
// each of its two weights per block).
static inline unsigned cuda_gemv_blocks(const cuda_gemv_job *job, int R) {
    if (job->act != CUDA_ACT_NONE) return (unsigned)((job->rows[0] + R / 2 - 1) / (R / 2));
    int64_t blocks = 0;
    for (int j = 0; j < job->n_w; j++) blocks += (job->rows[j] + R - 1) / R;
    return (unsigned)blocks; // rows <= INT_MAX each
}

// quant.cu: quantized weights in their GGUF blocks.
// 1 and the block's elements and bytes when t is a quantized type with
// kernels here, else 0.
int cuda_quant_block(pd_type t, int64_t *elems, int64_t *bytes);
// y[n][rows] = x[n][cols] W^T for n in 1..8, e->dev_type quantized.
int cuda_quant_gemv(cuda_backend *cb, const cuda_weight_entry *e, const float *x, int64_t n, float *y,
                    pd_error *err);
// A cuda_gemv_job of n in 1..8 tokens over weights of quantized type t.
int cuda_quant_gemv_job(cuda_backend *cb, pd_type t, const cuda_gemv_job *job, const float *x, int64_t n,
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
int cuda_add_rmsnorm(pd_backend *be, float *x, const float *h, const float *weight, int64_t n, int64_t dim,
                     float eps, float *out, pd_error *err);
int cuda_qkv_bias_rope(pd_backend *be, const pd_qkv_args *a, pd_error *err);
int cuda_convert(pd_backend *be, void *dst, pd_type dst_type, const void *src, pd_type src_type, int64_t n,
                 pd_error *err);

// attention.cu
int cuda_attention(pd_backend *be, const pd_attn_args *a, pd_error *err);
// compactor.cu
int cuda_token_scores(pd_backend *be, const pd_token_score_args *a, pd_error *err);
// timing.cu: pd_backend_timer's marks (timing events on the stream).
extern const pd_backend_timer_ops cuda_timer_ops;
// graph.cu: the graph ops, and their state's setup and teardown.
int cuda_graph_begin(pd_backend *be, int bucket, pd_error *err);
int cuda_graph_end(pd_backend *be, bool launch, pd_error *err);
int cuda_graphs_create(cuda_backend *cb, pd_error *err);
void cuda_graphs_destroy(cuda_backend *cb);

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

// silu(g) * u and gelu(g) * u (tanh approximation) with the CPU's formulas
// and rounding steps (kernels/cpu/simd_scalar.c): the swiglu and geglu ops
// and the fused gate/up GEMV's epilogue share them, so fused and unfused
// give the same bits.
static __device__ __forceinline__ float cuda_silu_mul(float g, float u) {
    return __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u);
}
static __device__ __forceinline__ float cuda_gelu_mul(float g, float u) {
    const float cubic = __fadd_rn(1.0f, __fmul_rn(__fmul_rn(0.044715f, g), g));
    const float inner = __fmul_rn(__fmul_rn(0.7978845608028654f, g), cubic);
    return __fmul_rn(__fmul_rn(__fmul_rn(0.5f, g), __fadd_rn(1.0f, tanhf(inner))), u);
}

// Where block blockIdx.x of a cuda_gemv_job (R rows per block) works: its
// weight j (0 for an activation job) and first row.
template <int R> static __device__ __forceinline__ int cuda_gemv_block(const cuda_gemv_job &job, int64_t *row0) {
    if (job.act != CUDA_ACT_NONE) {
        *row0 = (int64_t)blockIdx.x * (R / 2);
        return 0;
    }
    int64_t b = blockIdx.x;
    int j = 0;
    for (; j + 1 < job.n_w; j++) {
        const int64_t nb = (job.rows[j] + R - 1) / R;
        if (b < nb) break;
        b -= nb;
    }
    *row0 = b * R;
    return j;
}

// The weight and row that accumulator row r of the block reads: row r of
// weight j, or, in an activation job, gate rows first and up rows second.
// Rows past the end (last block) re-read the last row; their sums are
// never stored.
template <int R>
static __device__ __forceinline__ int64_t cuda_gemv_source(const cuda_gemv_job &job, int j, int64_t row0, int r,
                                                           int *w) {
    int64_t row = row0 + r;
    *w = j;
    if (job.act != CUDA_ACT_NONE) *w = r < R / 2 ? 0 : 1, row = row0 + r % (R / 2);
    return row < job.rows[*w] ? row : job.rows[*w] - 1;
}

// The GEMV kernels' epilogue: each accumulator summed over the warp with
// shuffles, then over the block's warps in shared memory in a fixed order,
// and stored (row0 + r < rows), or, in an activation job, combined
// act(gate) * up first. `part` is the kernel's shared array; every thread
// of the block must call this.
template <int N, int R, int THREADS>
static __device__ __forceinline__ void cuda_gemv_store(const cuda_gemv_job &job, int j, int64_t row0,
                                                       const float (&acc)[N][R], float (&part)[THREADS / 32][N * R]) {
    static_assert(N * R <= THREADS, "one thread per output");
    const int lane = (int)(threadIdx.x & 31u), warp = (int)(threadIdx.x >> 5), i = (int)threadIdx.x;
#pragma unroll
    for (int t = 0; t < N; t++)
#pragma unroll
        for (int r = 0; r < R; r++) {
            const float s = cuda_warp_sum(acc[t][r]);
            if (lane == 0) part[warp][t * R + r] = s;
        }
    __syncthreads();
    float s = 0.0f;
    if (i < N * R)
#pragma unroll
        for (int k = 0; k < THREADS / 32; k++) s += part[k][i];
    if (job.act == CUDA_ACT_NONE) {
        const int t = i / R, r = i % R;
        if (i < N * R && row0 + r < job.rows[j]) job.y[j][t * job.rows[j] + row0 + r] = s;
        return;
    }
    __syncthreads(); // every total read before part[0] is overwritten
    if (i < N * R) part[0][i] = s;
    __syncthreads();
    constexpr int H = R / 2;
    if (i < N * H) {
        const int t = i / H, r = i % H;
        const float g = part[0][t * R + r], u = part[0][t * R + H + r];
        if (row0 + r < job.rows[0])
            job.y[0][t * job.rows[0] + row0 + r] = job.act == CUDA_ACT_SILU ? cuda_silu_mul(g, u) : cuda_gelu_mul(g, u);
    }
}
#endif

#endif
