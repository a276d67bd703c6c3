/* The backend interface's internals, for the backends (cpu/, cuda/) and
 * kernels/backend.c only: everyone else calls the pd_backend_* functions of
 * kernels/kernels.h, where each op is documented. An op marked optional
 * may be NULL. */
#ifndef PD_KERNELS_BACKEND_IMPL_H
#define PD_KERNELS_BACKEND_IMPL_H

#include "kernels/kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped when an op is added, removed or changes meaning. */
#define PD_BACKEND_OPS_VERSION 6

typedef struct pd_backend_ops {
    const char *name;
    /* Backend memory is host memory: pointers may be shared both ways. */
    bool host_memory;
    void (*free)(pd_backend *be);

    /* ---- memory ---- */
    /* bytes of backend memory (aligned to 256 bytes), or NULL with err
     * filled; release(NULL) is a no-op. */
    void *(*alloc)(pd_backend *be, size_t bytes, pd_error *err);
    void (*release)(pd_backend *be, void *p);
    /* host -> backend. A device backend stages large copies through pinned
     * buffers, so src may be any host memory (an LMDB map, say) and may be
     * reused as soon as the call returns. */
    int (*upload)(pd_backend *be, void *dst, const void *src, size_t bytes, pd_error *err);
    /* backend -> host; waits for the queued work first. */
    int (*download)(pd_backend *be, void *dst, const void *src, size_t bytes, pd_error *err);
    /* Within backend memory; regions may not overlap. */
    int (*copy)(pd_backend *be, void *dst, const void *src, size_t bytes, pd_error *err);
    /* rows rows of width bytes each, from src (rows src_pitch apart) to dst
     * (dst_pitch apart), within backend memory. */
    int (*copy2d)(pd_backend *be, void *dst, size_t dst_pitch, const void *src, size_t src_pitch, size_t width,
                  size_t rows, pd_error *err);
    /* Many 2-D copies at once (descs is host memory): one launch on a
     * device backend, where a decode step appends K/V rows to hundreds of
     * (layer, kv head, sequence) streams. Copies must not overlap. */
    int (*copy2d_batch)(pd_backend *be, const pd_copy2d *descs, int64_t n, pd_error *err);
    /* dst[i] = src[i] for i < n, from src_type to dst_type, within
     * backend memory: f32 -> f16 (round to nearest even; beyond +-65504
     * gives +-inf, as F16C and __float2half_rn do), f16 -> f32 (exact), or
     * a copy when the types are equal. Other types: PD_EUNSUPPORTED.
     * Regions may not overlap. */
    int (*convert)(pd_backend *be, void *dst, pd_type dst_type, const void *src, pd_type src_type, int64_t n,
                   pd_error *err);
    /* dst[i] = src[idx[i]] for rows of row_bytes; idx is host memory;
     * dst and src must not overlap. */
    int (*gather)(pd_backend *be, void *dst, const void *src, const int32_t *idx, int64_t n, size_t row_bytes,
                  pd_error *err);
    /* Wait for everything queued; report any failure since the last check. */
    int (*sync)(pd_backend *be, pd_error *err);
    /* Make the backend's copy of a weight now (NULL on host backends). */
    int (*prepare_weight)(pd_backend *be, const pd_weight *w, pd_error *err);
    /* Drop the backend's copy of a weight (NULL on host backends): called
     * when a model is freed, since another file mapped later at the same
     * address must not find stale weights. */
    void (*forget_weight)(pd_backend *be, const pd_weight *w);
    /* pd_backend_pack_weight (NULL: no layout of its own). */
    int (*pack_weight)(pd_backend *be, pd_weight *w, void *data, pd_error *err);

    /* ---- compute ---- */
    /* y[i][r] = dot(W[r,:], x[i,:]) for i < n: y is [n][rows], x is [n][cols].
     * Small n uses quantized dot products directly, large n a GEMM.
     * Accuracy (CPU): f32/f16/bf16 weights use float x (relative error of
     * float accumulation, ~1e-6). Quantized weights are multiplied exactly
     * by x quantized to int8 (per 32 elements for the 32-element types, per
     * 256 for the 256-element ones, scale amax/127 kept in float), so each
     * output is within sum_i |W[r,i]| * amax(block of i) / 254 (plus float
     * rounding) of the exact product; where a GEMM on dequantized weights
     * serves large n the error is only float rounding. Accuracy (CUDA):
     * weights in f16/bf16 (quantized ones dequantized to bf16 at upload), x
     * rounded to bf16 for tensor-core GEMMs, f32 accumulation. */
    int (*matmul)(pd_backend *be, const pd_weight *w, const float *x, int64_t n, float *y,
                  pd_error *err);
    /* out[i][:] = dequantized row ids[i] of W (embedding lookup); ids is
     * host memory. */
    int (*get_rows)(pd_backend *be, const pd_weight *w, const int32_t *ids, int64_t n, float *out,
                    pd_error *err);
    /* out[i] = x[i] / rms(x[i]) * weight, rows of dim; out may equal x.
     * Per-head norms (Qwen3, Gemma 3) are rows of head_dim: n * n_heads rows. */
    int (*rmsnorm)(pd_backend *be, const float *x, const float *weight, int64_t n, int64_t dim,
                   float eps, float *out, pd_error *err);
    /* In-place rotary embedding of x [n][n_heads][head_dim] at positions pos[n]:
     * pairs i < n_rot/2 rotate by theta_i = pos * freq_base^(-2i/n_rot)
     * / freq_factors[i]; dimensions from n_rot on are left alone. An n_rot
     * above head_dim is treated as head_dim, an odd one rounded down. */
    int (*rope)(pd_backend *be, float *x, const int32_t *pos, int64_t n, int n_heads, int head_dim,
                const pd_rope_params *p, pd_error *err);
    /* out[i] = silu(gate[i]) * up[i] for i < n; out may equal gate. */
    int (*swiglu)(pd_backend *be, const float *gate, const float *up, int64_t n, float *out, pd_error *err);
    /* out[i] = gelu(gate[i]) * up[i] for i < n, with GELU's tanh
     * approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) as
     * Gemma and ggml use it; out may equal gate. */
    int (*geglu)(pd_backend *be, const float *gate, const float *up, int64_t n, float *out, pd_error *err);
    /* In place, x[i] = cap * tanh(x[i] / cap) for i < n (cap > 0): final
     * logit soft-capping. */
    int (*softcap)(pd_backend *be, float *x, int64_t n, float cap, pd_error *err);
    /* In place, x[i] *= s for i < n (Gemma's sqrt(n_embd) embedding scale). */
    int (*scale)(pd_backend *be, float *x, int64_t n, float s, pd_error *err);
    /* y[r][i] += x[r][i] for r < rows, i < width, where x_stride is 0 (one
     * row broadcast to every row: a bias) or width (element-wise). */
    int (*add)(pd_backend *be, float *y, const float *x, int64_t rows, int64_t width, int64_t x_stride,
               pd_error *err);
    int (*attention)(pd_backend *be, const pd_attn_args *a, pd_error *err);
    /* Fused ops (kernels/backend.h documents each). */
    int (*add_rmsnorm)(pd_backend *be, float *x, const float *h, const float *weight, int64_t n, int64_t dim,
                       float eps, float *out, pd_error *err);
    int (*matmul_multi)(pd_backend *be, const pd_weight *const *w, int n_w, const float *x, int64_t n,
                        float *const *y, pd_error *err);
    int (*matmul_glu)(pd_backend *be, const pd_weight *w_gate, const pd_weight *w_up, const float *x, int64_t n,
                      pd_glu act, float *out, float *up, pd_error *err);
    int (*qkv_bias_rope)(pd_backend *be, const pd_qkv_args *a, pd_error *err);
    /* Optional (NULL: the caller scores on the host): pd_token_score_args. */
    int (*token_scores)(pd_backend *be, const pd_token_score_args *a, pd_error *err);
    /* Optional, both or neither (NULL: no graphs): pd_backend_graph_begin
     * and pd_backend_graph_end. */
    int (*graph_begin)(pd_backend *be, int bucket, pd_error *err);
    int (*graph_end)(pd_backend *be, bool launch, pd_error *err);
    /* Optional (NULL: zeros): pd_backend_counters. */
    void (*counters)(const pd_backend *be, pd_backend_counters *out);
    /* Optional (NULL: malloc / free): host memory that downloads fill
     * fastest (page-locked on CUDA). */
    void *(*host_alloc)(pd_backend *be, size_t bytes, pd_error *err);
    void (*host_free)(pd_backend *be, void *p);
    /* Optional (NULL: PD_EUNSUPPORTED): free and total backend memory. */
    int (*memory)(pd_backend *be, uint64_t *free_bytes, uint64_t *total_bytes, pd_error *err);
    /* Optional (NULL: host wall time, right for a backend whose ops run
     * before they return): device marks for pd_backend_timer. */
    const struct pd_backend_timer_ops *timer;
} pd_backend_ops;

/* Two marks (start, stop) in a device backend's queue. */
typedef struct pd_backend_timer_ops {
    /* A new pair of marks, or NULL with err filled. */
    void *(*create)(pd_backend *be, pd_error *err);
    void (*destroy)(pd_backend *be, void *marks);
    /* Record mark `which` (0 start, 1 stop) after the work queued so far. */
    int (*record)(pd_backend *be, void *marks, int which, pd_error *err);
    /* Wait for the stop mark; the device seconds from start to stop. */
    int (*elapsed)(pd_backend *be, void *marks, double *seconds, pd_error *err);
} pd_backend_timer_ops;

struct pd_backend {
    const pd_backend_ops *ops;
    void *impl;
    /* Host seconds blocked in download and sync, and when the first such
     * wait after a timer's start began (0: none yet); backend.c keeps them
     * for pd_backend_timer. Zero at creation (backends calloc). */
    double waited_s;
    double first_wait_at;
};

#ifdef __cplusplus
}
#endif
#endif
