/* kernels/backend.h: the compute backend: weights, op arguments, the pd_backend_* operations, the CPU and CUDA backends and device selection.
 * Part of kernels' public contract (kernels/kernels.h includes every part). */
#ifndef PD_KERNELS_BACKEND_H
#define PD_KERNELS_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/types.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------
 * Compute backend
 *
 * The engine calls every heavy operation through this vtable, so a CUDA
 * backend takes the CPU's place without the engine changing (the shape of
 * ggml's backend interface, without the graph).
 *
 * Memory. Every float/int array an op reads or writes, except where a
 * comment says "host", is *backend memory*: obtained from ops->alloc and
 * filled with ops->upload / ops->copy / ops->copy2d. On a backend whose
 * `host_memory` is true (the CPU), backend memory is plain host memory and
 * the copies are memcpy, so host pointers may be passed directly. On a
 * device backend ops are queued in order on one stream: they may return
 * before the work is done, and a failure that happens later is reported by
 * the next op that can fail, by download, or by sync.
 *
 * Weights (pd_weight.data) are always host pointers into the mapped GGUF. A
 * device backend keeps its own copy of each weight, keyed by data pointer,
 * made by prepare_weight (called by the model loader for every matrix, so
 * upload cost and out-of-memory show at load time) or on first use.
 * ------------------------------------------------------------------------ */

/* How a weight's bytes are arranged. PD_LAYOUT_GGUF: as the file stores
 * them. PD_LAYOUT_CPU_X16: rearranged in place by the CPU backend's
 * pack_weight for its AVX-512 kernels (16 rows interleaved block by block;
 * rows past the last whole 16 as in the file); only a CPU backend with
 * those kernels computes with it. */
typedef enum pd_weight_layout {
    PD_LAYOUT_GGUF = 0,
    PD_LAYOUT_CPU_X16 = 1,
} pd_weight_layout;

/* A 2-D weight: `rows` rows of `cols` elements of `type`, each row
 * `row_bytes` long (in the GGUF layout, contiguous). y = W x means
 * y[r] = dot(W[r, :], x). */
typedef struct pd_weight {
    pd_type type;
    const void *data;
    int64_t rows;
    int64_t cols;
    size_t row_bytes;
    pd_weight_layout layout;
} pd_weight;

/* Fill a pd_weight for a tensor of the given type and shape; checks that
 * cols is a multiple of the type's block size. */
int pd_weight_init(pd_weight *w, pd_type type, const void *data, int64_t rows, int64_t cols,
                   pd_error *err);

typedef enum pd_rope_mode {
    PD_ROPE_NORM = 0, /* rotate adjacent pairs (x[2i], x[2i+1]): llama in GGUF */
    PD_ROPE_NEOX = 2, /* rotate halves (x[i], x[i + n_rot/2]): qwen2 */
} pd_rope_mode;

#define PD_ROPE_MAX_FACTORS 256 /* n_rot/2 <= this: head_dim up to 512 */

typedef struct pd_rope_params {
    pd_rope_mode mode;
    int n_rot;                  /* rotated dimensions per head (<= head_dim, even) */
    float freq_base;            /* theta */
    const float *freq_factors;  /* host: n_rot/2 divisors of each frequency (llama3 scaling), or NULL */
} pd_rope_params;

/* One (layer, kv_head) run of cached keys and values. Rows are head_dim
 * elements of `type`: PD_TYPE_F32 (0, so a zeroed view is f32) or
 * PD_TYPE_F16 (IEEE half, half the bytes; attention converts on load and
 * computes in f32). Each view has its own type, so an f32 prefix and f16
 * own rows can be attended to in one call. `pos` gives each row's original
 * position (kept tokens keep theirs, so positions may have gaps). `keep`,
 * if not NULL, masks rows out (0 = ignore this key), which tests use to
 * check eviction against masking (host-memory backends only). */
typedef struct pd_kv_view {
    const void *k;
    const void *v;
    const int32_t *pos;
    const uint8_t *keep;
    int64_t len;
    pd_type type;
} pd_kv_view;

/* Element types a pd_kv_view may hold. */
static inline bool pd_kv_type_ok(pd_type t) { return t == PD_TYPE_F32 || t == PD_TYPE_F16; }

/* Attention of n_tokens queries over segments of KV per kv head, each
 * processed with an online softmax and merged with log-sum-exp, so the
 * result equals softmax attention over the concatenation. Query head h
 * reads kv head h / (n_head / n_head_kv). With `causal`, keys whose position
 * is greater than the query's are ignored. A query with no visible key gets
 * zeros.
 *
 * Batching. The tokens form n_groups contiguous groups (one per sequence;
 * n_groups 0 means one group of all tokens), group g owning tokens
 * [group_start[g], group_start[g + 1]). Every group attends to the
 * n_shared `shared` segments (a compressed prefix common to the batch: a
 * device backend reads it once per call for all groups) and to its own
 * n_segments segments. At most PD_MAX_KV_SEGMENTS segments per group in
 * all. The pd_kv_view arrays and group_start are host memory; what the
 * views point to is backend memory. Whatever the views' types, scores,
 * softmax and the weighted value sums are f32 (f16 rows are widened
 * exactly as they are read), and out is f32. */
#define PD_MAX_KV_SEGMENTS 4
typedef struct pd_attn_args {
    const float *q;       /* [n_tokens][n_head][head_dim], f32 whatever the KV type */
    const int32_t *q_pos; /* [n_tokens] */
    int64_t n_tokens;
    int n_head, n_head_kv, head_dim;
    int n_segments;
    const pd_kv_view *kv;          /* [n_groups][n_segments][n_head_kv] */
    int n_shared;
    const pd_kv_view *shared;      /* [n_shared][n_head_kv] */
    int n_groups;
    const int64_t *group_start;    /* host, [n_groups + 1], 0 .. n_tokens, non-decreasing */
    float scale;          /* usually 1/sqrt(head_dim) */
    bool causal;
    /* Sliding window (0 = none): a key at position p is visible to a query
     * at position t only if t - p < window (llama.cpp's rule), on top of
     * causality. Positions are the rows' original ones, so a compressed
     * prefix's kept rows drop out of the window where their tokens would. */
    int32_t window;
    /* Soft-capping (0 = none): each scaled score s becomes
     * softcap * tanh(s / softcap) before masking and the softmax (Gemma 2). */
    float softcap;
    float *out;           /* [n_tokens][n_head][head_dim] */
} pd_attn_args;

/* Token importance scores of one layer on the backend, from two signals
 * (the GPU path of the policies' Compactor, leverage and non-causal
 * scorers; see policies/score_compactor.c for the CPU reference it must
 * match):
 *   lev = z-score over all (head, token) of the approximate leverage of the
 *         pre-RoPE keys of tokens [lo, hi), per kv head, in chunks of
 *         lev_chunk rows (0 = all): centre the chunk, X = rows * phi,
 *         G = X^T X + ridge I (ridge x10 up to 4 more times while Cholesky
 *         fails; a zero ridge retries at 1e-2), l_i = ||L^-1 x_i||^2;
 *   att = z-score of the non-causal attention that the keys of [lo, hi)
 *         receive from the queries of the same chunk of attn_chunk tokens,
 *         summed over the kv head's query heads, times ||v|| if vnorm, then
 *         average-pooled over `pool` tokens (odd; 1 = none);
 *   scores[h][i] = att + lambda * lev (or only the half that is enabled).
 * Inputs are the layer's rows for all n_tokens tokens, backend memory;
 * phi (host, [head_dim][sketch]) and scores (host, [n_head_kv][hi - lo])
 * are host memory. Fails with PD_ERANGE where the CPU reference would
 * (non-finite keys, Cholesky failing every time). */
typedef struct pd_token_score_args {
    const float *q;      /* [n_tokens][n_head][head_dim], after RoPE */
    const float *k;      /* [n_tokens][n_head_kv][head_dim], after RoPE */
    const float *k_pre;  /* [n_tokens][n_head_kv][head_dim], before RoPE */
    const float *v;      /* [n_tokens][n_head_kv][head_dim] */
    int64_t n_tokens;
    int n_head, n_head_kv, head_dim;
    int64_t lo, hi;
    bool use_leverage;
    const float *phi;
    int sketch;
    int64_t lev_chunk;
    double ridge;
    bool use_attention;
    int64_t attn_chunk;
    float scale;         /* 0 = 1/sqrt(head_dim) */
    bool vnorm;
    int pool;
    double lambda;
    float *scores;
} pd_token_score_args;

/* One 2-D copy within backend memory: rows rows of width bytes. */
typedef struct pd_copy2d {
    void *dst;
    const void *src;
    size_t dst_pitch, src_pitch, width, rows;
} pd_copy2d;

/* ---- the compute backend ----------------------------------------------
 * A device's memory and compute behind one interface: the ops table is
 * internal to kernels/ (kernels/backend_impl.h, versioned by
 * PD_BACKEND_OPS_VERSION); callers use these functions. Every op returns
 * PD_OK or a status with err filled, unless its type says otherwise. */
typedef struct pd_backend pd_backend;

/* The backend's name ("cpu", "cpu-discrete", "cuda:0"). */
const char *pd_backend_name(const pd_backend *be);
/* Backend memory is host memory: pointers may be shared both ways. */
bool pd_backend_host_memory(const pd_backend *be);
/* bytes of backend memory (aligned to 256 bytes), or NULL with err
 * filled; release(NULL) is a no-op. A device backend keeps released blocks
 * for reuse (docs/gpu.md, Memory), so release neither waits nor frees. */
void *pd_backend_alloc(pd_backend *be, size_t bytes, pd_error *err);
void pd_backend_release(pd_backend *be, void *p);
/* Host memory for buffers the backend downloads into on the hot path
 * (logits): page-locked on CUDA, so a download is one DMA with no staging;
 * plain malloc elsewhere. NULL with err filled; host_free(NULL) is a no-op.
 * Slow to allocate on CUDA: keep such buffers, do not churn them. */
void *pd_backend_host_alloc(pd_backend *be, size_t bytes, pd_error *err);
void pd_backend_host_free(pd_backend *be, void *p);
/* Free and total bytes of backend memory (a device backend counts memory
 * its allocator caches as free); PD_EUNSUPPORTED on host backends. */
int pd_backend_memory(pd_backend *be, uint64_t *free_bytes, uint64_t *total_bytes, pd_error *err);
/* host -> backend. A device backend copies src into pinned staging memory
 * and queues the copy from there, so src may be any host memory (an LMDB
 * map, say), may be reused as soon as the call returns, and the call does
 * not wait for the device. */
int pd_backend_upload(pd_backend *be, void *dst, const void *src, size_t bytes, pd_error *err);
/* backend -> host; waits for the queued work first. */
int pd_backend_download(pd_backend *be, void *dst, const void *src, size_t bytes, pd_error *err);
/* Within backend memory; regions may not overlap. */
int pd_backend_copy(pd_backend *be, void *dst, const void *src, size_t bytes, pd_error *err);
/* rows rows of width bytes each, from src (rows src_pitch apart) to dst
 * (dst_pitch apart), within backend memory. */
int pd_backend_copy2d(pd_backend *be, void *dst, size_t dst_pitch, const void *src, size_t src_pitch, size_t width, size_t rows, pd_error *err);
/* Many 2-D copies at once (descs is host memory): one launch on a
 * device backend, where a decode step appends K/V rows to hundreds of
 * (layer, kv head, sequence) streams. Copies must not overlap. */
int pd_backend_copy2d_batch(pd_backend *be, const pd_copy2d *descs, int64_t n, pd_error *err);
/* dst[i] = src[i] for i < n, from src_type to dst_type, within
 * backend memory: f32 -> f16 (round to nearest even; beyond +-65504
 * gives +-inf, as F16C and __float2half_rn do), f16 -> f32 (exact), or
 * a copy when the types are equal. Other types: PD_EUNSUPPORTED.
 * Regions may not overlap. */
int pd_backend_convert(pd_backend *be, void *dst, pd_type dst_type, const void *src, pd_type src_type, int64_t n, pd_error *err);
/* dst[i] = src[idx[i]] for rows of row_bytes; idx is host memory;
 * dst and src must not overlap. */
int pd_backend_gather(pd_backend *be, void *dst, const void *src, const int32_t *idx, int64_t n, size_t row_bytes, pd_error *err);
/* Wait for everything queued; report any failure since the last check. */
int pd_backend_sync(pd_backend *be, pd_error *err);
/* Make the backend's copy of a weight now (NULL on host backends). */
int pd_backend_prepare_weight(pd_backend *be, const pd_weight *w, pd_error *err);
/* Drop the backend's copy of a weight (NULL on host backends): called
 * when a model is freed, since another file mapped later at the same
 * address must not find stale weights. */
void pd_backend_forget_weight(pd_backend *be, const pd_weight *w);
/* Rearrange a weight's bytes in place into the layout this backend
 * computes fastest from, and set w->layout; `data` is w->data, writable
 * (the caller's own copy of the file: every weight sharing those bytes
 * must be the same pd_weight). Leaves w alone (PD_OK) where the backend
 * has no such layout for its type, as on a device backend, which copies
 * the GGUF layout instead. */
int pd_backend_pack_weight(pd_backend *be, pd_weight *w, void *data, pd_error *err);
/* y[i][r] = dot(W[r,:], x[i,:]) for i < n: y is [n][rows], x is [n][cols].
 * Small n uses quantized dot products directly, large n a GEMM.
 * Accuracy (CPU): f32/f16/bf16 weights use float x (relative error of
 * float accumulation, ~1e-6). Quantized weights are multiplied exactly
 * by x quantized to int8 (per 32 elements for the 32-element types, per
 * 256 for the 256-element ones, scale amax/127 kept in float), so each
 * output is within sum_i |W[r,i]| * amax(block of i) / 254 (plus float
 * rounding) of the exact product; where a GEMM on dequantized weights
 * serves large n the error is only float rounding. Accuracy (CUDA): up to
 * 8 tokens, f32 x and f32 accumulation with the weights as stored
 * (quantized types dequantized in registers);
 * larger n, weights and x rounded to bf16 (f16) for tensor-core GEMMs, f32
 * accumulation. */
int pd_backend_matmul(pd_backend *be, const pd_weight *w, const float *x, int64_t n, float *y, pd_error *err);
/* out[i][:] = dequantized row ids[i] of W (embedding lookup); ids is
 * host memory. */
int pd_backend_get_rows(pd_backend *be, const pd_weight *w, const int32_t *ids, int64_t n, float *out, pd_error *err);
/* out[i] = x[i] / rms(x[i]) * weight, rows of dim; out may equal x.
 * Per-head norms (Qwen3, Gemma 3) are rows of head_dim: n * n_heads rows. */
int pd_backend_rmsnorm(pd_backend *be, const float *x, const float *weight, int64_t n, int64_t dim, float eps, float *out, pd_error *err);
/* In-place rotary embedding of x [n][n_heads][head_dim] at positions pos[n]:
 * pairs i < n_rot/2 rotate by theta_i = pos * freq_base^(-2i/n_rot)
 * / freq_factors[i]; dimensions from n_rot on are left alone. An n_rot
 * above head_dim is treated as head_dim, an odd one rounded down. */
int pd_backend_rope(pd_backend *be, float *x, const int32_t *pos, int64_t n, int n_heads, int head_dim, const pd_rope_params *p, pd_error *err);
/* out[i] = silu(gate[i]) * up[i] for i < n; out may equal gate. */
int pd_backend_swiglu(pd_backend *be, const float *gate, const float *up, int64_t n, float *out, pd_error *err);
/* out[i] = gelu(gate[i]) * up[i] for i < n, with GELU's tanh
 * approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) as
 * Gemma and ggml use it; out may equal gate. */
int pd_backend_geglu(pd_backend *be, const float *gate, const float *up, int64_t n, float *out, pd_error *err);
/* In place, x[i] = cap * tanh(x[i] / cap) for i < n (cap > 0): final
 * logit soft-capping. */
int pd_backend_softcap(pd_backend *be, float *x, int64_t n, float cap, pd_error *err);
/* In place, x[i] *= s for i < n (Gemma's sqrt(n_embd) embedding scale). */
int pd_backend_scale(pd_backend *be, float *x, int64_t n, float s, pd_error *err);
/* y[r][i] += x[r][i] for r < rows, i < width, where x_stride is 0 (one
 * row broadcast to every row: a bias) or width (element-wise). */
int pd_backend_add(pd_backend *be, float *y, const float *x, int64_t rows, int64_t width, int64_t x_stride, pd_error *err);
/* ---- fused ops: each equals the unfused sequence it names (bit for bit
 * on the CPU and on CUDA, where the same kernels' arithmetic is reused)
 * and saves a device backend launches; docs/gpu.md lists a decode step's. */
/* x[r] += h[r], then out[r] = rmsnorm(x[r]) * weight, rows of dim: the
 * residual add that ends a block and the norm that starts the next, as
 * pd_backend_add (x_stride = dim) then pd_backend_rmsnorm. out may equal
 * x or h. */
int pd_backend_add_rmsnorm(pd_backend *be, float *x, const float *h, const float *weight, int64_t n, int64_t dim,
                           float eps, float *out, pd_error *err);
/* Products of up to PD_MATMUL_MULTI_MAX weights with the same x (the Q, K
 * and V projections): y[j] as pd_backend_matmul(w[j], x, n, y[j]). w and
 * y are host arrays of n_w entries; every weight has x's cols. A device
 * backend runs a decode batch (n <= 8) of same-typed weights in one GEMV
 * launch. */
#define PD_MATMUL_MULTI_MAX 3
int pd_backend_matmul_multi(pd_backend *be, const pd_weight *const *w, int n_w, const float *x, int64_t n,
                            float *const *y, pd_error *err);
typedef enum pd_glu {
    PD_GLU_SILU = 0, /* swiglu */
    PD_GLU_GELU = 1, /* geglu */
} pd_glu;
/* The gated feed-forward input: out = act(x W_gate^T) * (x W_up^T),
 * [n][rows], as pd_backend_matmul of each weight then pd_backend_swiglu
 * (PD_GLU_SILU) or pd_backend_geglu (PD_GLU_GELU). The weights have the
 * same shape. up is scratch of n * rows floats the backend may use (its
 * contents are undefined afterwards); a device backend computes a decode
 * batch (n <= 8) in one GEMV launch that reads both weights' rows for
 * each output and never touches up. */
int pd_backend_matmul_glu(pd_backend *be, const pd_weight *w_gate, const pd_weight *w_up, const float *x, int64_t n,
                          pd_glu act, float *out, float *up, pd_error *err);
/* Fresh Q [n][n_head][head_dim], K and V [n][n_head_kv][head_dim]: q +=
 * bq, k += bk, v += bv (each bias one row of the width, NULL = none),
 * then rope on q and k at positions pos (rope NULL = none), as
 * pd_backend_add then pd_backend_rope. One launch on a device backend. */
typedef struct pd_qkv_args {
    float *q, *k, *v;
    const float *bq, *bk, *bv;
    const int32_t *pos;
    int64_t n;
    int n_head, n_head_kv, head_dim;
    const pd_rope_params *rope;
} pd_qkv_args;
int pd_backend_qkv_bias_rope(pd_backend *be, const pd_qkv_args *a, pd_error *err);
int pd_backend_attention(pd_backend *be, const pd_attn_args *a, pd_error *err);
/* Optional (NULL: the caller scores on the host): pd_token_score_args. */
int pd_backend_token_scores(pd_backend *be, const pd_token_score_args *a, pd_error *err);
/* Whether the backend keeps copies of weights of its own (prepare_weight
 * and forget_weight do something); false on host-memory backends. */
bool pd_backend_caches_weights(const pd_backend *be);
/* Whether token_scores runs on the backend (optional; without it the
 * caller scores on the host). */
bool pd_backend_has_token_scores(const pd_backend *be);

/* Device graphs: a backend that has them (CUDA) records the work queued
 * between graph_begin and graph_end instead of running it, and at
 * graph_end(launch = true) runs it all as one graph: the graph of `bucket`
 * (a decode step's batch size, 1..PD_GRAPH_BUCKETS) is updated in place
 * when the recorded work has the same shape as last time, and rebuilt when
 * not. Nothing may wait for the device in between (download, sync).
 * graph_begin fails with PD_EUNSUPPORTED where there are no graphs (a host
 * backend, a bucket out of range, or after a recording failed: the backend
 * stops recording for good), and the caller just runs the work. graph_end
 * with launch = false drops the recording. When graph_end(true) fails with
 * PD_EUNSUPPORTED, none of the recorded work ran: the caller redoes it
 * without a graph; any other code is a failure of the device itself. */
#define PD_GRAPH_BUCKETS 32
int pd_backend_graph_begin(pd_backend *be, int bucket, pd_error *err);
int pd_backend_graph_end(pd_backend *be, bool launch, pd_error *err);

/* What a device backend has done since it was created, for benchmarks and
 * for tests that check the serving path: a decode step should launch few
 * kernels, allocate nothing and copy through pinned memory only. A host
 * backend reports zeros. */
typedef struct pd_backend_counters {
    uint64_t launches;        /* kernels and library calls (a cuBLAS GEMM is one) enqueued */
    uint64_t device_allocs;   /* allocations from the driver (cudaMalloc) */
    uint64_t device_frees;    /* blocks given back to the driver (cudaFree) */
    uint64_t uploads;         /* host -> device copies */
    uint64_t downloads;       /* device -> host copies */
    uint64_t unstaged_copies; /* of those, to or from pageable memory without pinned staging */
    uint64_t syncs;           /* times the host waited for the stream */
    uint64_t graph_launches;  /* device graphs launched (their recorded work counts in launches) */
    uint64_t graph_builds;    /* graphs instantiated: a new bucket, or a step whose shape changed */
} pd_backend_counters;
void pd_backend_counters_get(const pd_backend *be, pd_backend_counters *out);

/* A stopwatch over a stretch of backend work, for benchmarks (tools/
 * prefix-bench): start and stop mark points in the work queued so far. On a
 * device backend the marks are events on its stream, so device_s is the
 * time the device took from the start mark to the stop mark; on a host
 * backend, whose ops run before they return, device_s is the host wall time
 * between the calls. enqueue_s is the host wall time from start to the
 * first call that waits for the queue (download or sync) or, without one,
 * to stop: how long the host took to queue the work. */
typedef struct pd_backend_timer pd_backend_timer;
typedef struct pd_backend_timing {
    double wall_s;    /* host wall time from start to stop */
    double enqueue_s; /* host wall time from start to the first wait (or stop) */
    double wait_s;    /* host time blocked in download and sync in between */
    double device_s;  /* device time from the start mark to the stop mark */
} pd_backend_timing;
int pd_backend_timer_create(pd_backend *be, pd_backend_timer **out, pd_error *err);
/* NULL is a no-op. */
void pd_backend_timer_free(pd_backend_timer *t);
int pd_backend_timer_start(pd_backend_timer *t, pd_error *err);
int pd_backend_timer_stop(pd_backend_timer *t, pd_error *err);
/* The figures of the last start..stop; waits for the stop mark to run. */
int pd_backend_timer_read(pd_backend_timer *t, pd_backend_timing *out, pd_error *err);

/* The CPU backend: OpenBLAS for batched products, AVX2/AVX-512 quantized dot
 * products chosen at run time (portable C otherwise), n_threads workers
 * (<= 0: all CPUs). The backend owns its scratch buffers and is used by
 * one thread at a time.
 *
 * Environment, read at creation:
 *   PD_CPU_SIMD=scalar|avx2|avx512|auto  cap the SIMD level (never above
 *       what the CPU supports); tests use "scalar" to compare paths. An
 *       unknown value makes creation fail with PD_EINVAL.
 *   PD_CPU_GEMM_MIN_N=N  batch size from which dequantize + sgemm replaces
 *       the dot-product kernels, for every type (tuning only; the defaults
 *       are per type and SIMD level, 4 to 64; q8_0 on AVX-512 VNNI always
 *       uses its integer GEMM kernel).
 * Creation also sets OpenBLAS to one thread (process-wide): the backend
 * parallelises GEMM tiles on its own pool. */
int pd_backend_cpu_create(int n_threads, pd_backend **out, pd_error *err);
/* The same CPU backend presenting itself as a device with memory of its
 * own (host_memory = false, name "cpu-discrete"): callers then take every
 * path they take on a GPU (uploads, downloads, batched copies, prefix
 * upload, hook copies) with the CPU's arithmetic. Machines without a GPU
 * (CI) test the engine's device paths with it; results equal the CPU's. */
int pd_backend_cpu_discrete_create(int n_threads, pd_backend **out, pd_error *err);
/* NULL is a no-op. */
void pd_backend_free(pd_backend *be);
/* OpenBLAS's pthreads build starts one spinning thread per core when it is
 * loaded, which steals cores from the backend's own pool (the backend calls
 * OpenBLAS single-threaded). Programs call this first thing in main: unless
 * OPENBLAS_NUM_THREADS is set it sets it to 1 and re-executes the program
 * (/proc/self/exe) so the setting is seen at load time; where re-execution
 * is impossible it returns and the program runs on. It also has glibc keep
 * freed memory below 32 MiB (up to 1 GiB of it) for reuse instead of
 * unmapping it: sequences' KV rows are allocated and freed per request, and
 * refaulting them page by page made a cached prompt's admission 10x slower
 * in a VM. */
void pd_cpu_prepare_process(char **argv);
/* Which SIMD path a CPU backend created now would pick ("avx512vnni",
 * "avx2", "scalar"): the best the CPU supports, capped by $PD_CPU_SIMD. */
const char *pd_cpu_simd_name(void);

/* The CUDA backend on device `index`: weights uploaded once (f16/bf16 as
 * they are, f32 kept f32, quantized types dequantized to bf16), cuBLAS
 * GEMMs with f32 accumulation for batches, GEMV kernels for decode, fused
 * elementwise kernels, flash-style attention, and the Compactor scorer.
 * One stream; used by one thread at a time (any thread). Fails with
 * PD_EUNSUPPORTED when the build has no CUDA, PD_ENOTFOUND when there is
 * no such device. */
int pd_backend_cuda_create(int index, pd_backend **out, pd_error *err);

/* Where to compute: "cpu", "cuda" (device 0), "cuda:N", or "auto" (CUDA
 * device 0 when one is present and the build has CUDA, else the CPU). */
typedef enum pd_device_kind {
    PD_DEVICE_CPU = 0,
    PD_DEVICE_CUDA = 1,
    PD_DEVICE_AUTO = 2,
} pd_device_kind;
typedef struct pd_device {
    pd_device_kind kind;
    int index; /* CUDA device index (cuda, auto) */
} pd_device;
/* Parse the strings above (case-insensitive; N is 0..255). */
int pd_device_parse(const char *text, pd_device *out, pd_error *err);
/* Canonical text: "cpu", "auto", "cuda:N"; buf of at least 16 bytes. */
void pd_device_format(const pd_device *d, char *buf, size_t cap);
/* Create the backend a device names. `cuda` fails cleanly (naming the
 * alternatives) when CUDA is not compiled in or the device is absent;
 * `auto` then falls back to the CPU. n_threads is for the CPU backend. */
int pd_backend_create(const pd_device *d, int n_threads, pd_backend **out, pd_error *err);

/* CUDA backend probe. Always linkable: without CUDA support compiled in, it
 * reports zero devices and `pd_cuda_compiled()` is false. */
bool pd_cuda_compiled(void);
typedef struct pd_cuda_device_info {
    int index;
    char name[256];
    int cc_major, cc_minor;
    uint64_t total_mem;
    int mem_bus_width_bits;
    int mem_clock_khz; /* peak bandwidth = 2 * clock * width / 8 */
    int sm_count;
} pd_cuda_device_info;
/* Number of usable CUDA devices (0 when none or not compiled in). */
int pd_cuda_device_count(void);
int pd_cuda_device_info_get(int index, pd_cuda_device_info *out, pd_error *err);
/* Round-trip a small SGEMM through cuBLAS on device `index` and compare with
 * the CPU; proves the toolkit, driver and library agree. */
int pd_cuda_selftest(int index, double *max_abs_err, pd_error *err);
/* Measured device-to-device copy bandwidth of device `index` (bytes/s),
 * copying `bytes` a few times; the bound decode speed is compared with. */
int pd_cuda_copy_bandwidth(int index, size_t bytes, double *bytes_per_s, pd_error *err);
/* Device bytes the CUDA backend holds for a rows x cols weight of type t:
 * the file's bytes (quantized types stay in their blocks; docs/gpu.md), 0
 * for a type it cannot hold or a build without CUDA. */
uint64_t pd_cuda_weight_bytes(pd_type t, int64_t rows, int64_t cols);

#ifdef __cplusplus
}
#endif
#endif
