/* matmul: y[n][rows] = x[n][cols] . W^T on the CPU.
 *
 * Two paths:
 *  - quantized dot products (all n for kernels that tile over tokens, like
 *    the AVX-512 VNNI q8_0 kernel; small n otherwise): x is quantized once
 *    per call (q8_0 blocks for the 32-element types, q8_K super-blocks for
 *    the 256-element ones; f32/f16/bf16 weights use float x), then threads
 *    take chunks of weight rows and compute them against every x row;
 *  - dequantize + sgemm (large n): each thread dequantizes a tile of weight
 *    rows into its own f32 buffer and calls a single-threaded OpenBLAS
 *    sgemm for y[:, tile].
 * Threads take row chunks from an atomic counter, so a slow thread (another
 * process on its core) does not hold everyone up. */
#include <cblas.h>
#include <stdatomic.h>
#include <string.h>

#include "kernels/cpu/cpu_internal.h"

#define ALIGN64(v) (((v) + 63) & ~(size_t)63)

/* ------------------------------------------------------------------------
 * row-chunk scheduling
 * ------------------------------------------------------------------------ */

typedef struct mm_ctx {
    cpu_mm m;
    cpu_mm_fn fn;
    int64_t rows, chunk, nchunks;
    atomic_llong next;
} mm_ctx;

static void mm_worker(void *p, int ith, int nth) {
    (void)ith;
    (void)nth;
    mm_ctx *c = p;
    for (;;) {
        const int64_t i = atomic_fetch_add_explicit(&c->next, 1, memory_order_relaxed);
        if (i >= c->nchunks) break;
        const int64_t r0 = i * c->chunk;
        const int64_t r1 = r0 + c->chunk < c->rows ? r0 + c->chunk : c->rows;
        c->fn(&c->m, r0, r1);
    }
}

/* Rows per chunk: a multiple of `mult`, about `per_thread` chunks per
 * thread, at least `min_rows`. */
static int64_t pick_chunk(int64_t rows, int nth, int per_thread, int64_t min_rows, int64_t mult) {
    int64_t c = (rows + (int64_t)nth * per_thread - 1) / ((int64_t)nth * per_thread);
    if (c < min_rows) c = min_rows;
    c = (c + mult - 1) / mult * mult;
    return c;
}

/* ------------------------------------------------------------------------
 * activation quantization
 * ------------------------------------------------------------------------ */

typedef struct quant_ctx {
    const float *x;
    const cpu_qact *q;
    cpu_quant_fn fn;
    int64_t bsum_stride;
} quant_ctx;

static void quant_rows(const quant_ctx *c, int64_t t0, int64_t t1) {
    const cpu_qact *q = c->q;
    for (int64_t t = t0; t < t1; t++)
        c->fn(c->x + t * q->cols, q->cols, q->qs + t * q->cols, q->d + t * q->nblocks,
              q->c ? q->c + t * q->nblocks : NULL, q->bsums ? q->bsums + t * c->bsum_stride : NULL);
}

static void quant_worker(void *p, int ith, int nth) {
    const quant_ctx *c = p;
    quant_rows(c, c->q->n * ith / nth, c->q->n * (ith + 1) / nth);
}

/* The activations a quantized weight type's kernels take: q8_K
 * super-blocks (with bsums) for the 256-element types, like ggml's
 * vec_dot_type; q8_0 blocks for the 32-element ones. */
static bool uses_q8_K(pd_type wt) {
    return pd_type_get((uint32_t)wt)->block_size == PD_QK_K;
}

static int quantize_acts(cpu_backend *cb, pd_type wt, const float *x, int64_t n, int64_t cols,
                         cpu_qact *q, pd_error *err) {
    const bool kq = uses_q8_K(wt);
    const int64_t bs = kq ? PD_QK_K : 32;
    memset(q, 0, sizeof *q);
    q->n = n;
    q->cols = cols;
    q->nblocks = cols / bs;
    const size_t qs_bytes = ALIGN64((size_t)n * (size_t)cols);
    const size_t d_bytes = ALIGN64((size_t)n * (size_t)q->nblocks * sizeof(float));
    const size_t x_bytes = kq ? ALIGN64((size_t)n * (size_t)(cols / 16) * sizeof(int16_t))
                              : ALIGN64((size_t)n * (size_t)q->nblocks * sizeof(int32_t));
    int rc = cpu_scratch_reserve(&cb->act, &cb->act_cap, qs_bytes + d_bytes + x_bytes, err);
    if (rc) return rc;
    uint8_t *base = cb->act;
    q->qs = (int8_t *)base;
    q->d = (float *)(void *)(base + qs_bytes);
    if (kq)
        q->bsums = (int16_t *)(void *)(base + qs_bytes + d_bytes);
    else
        q->c = (int32_t *)(void *)(base + qs_bytes + d_bytes);
    cpu_quant_fn fn = kq ? cb->k.quant_q8_K : cb->k.quant_q8_0;
    if (cb->k.quant_act[wt]) fn = cb->k.quant_act[wt];
    quant_ctx c = {x, q, fn, cols / 16};
    if (n >= 4 && n * cols >= 65536)
        pd_threadpool_run(cb->tp, quant_worker, &c);
    else
        quant_rows(&c, 0, n);
    return PD_OK;
}

/* ------------------------------------------------------------------------
 * dequantize + sgemm
 * ------------------------------------------------------------------------ */

typedef struct gemm_ctx {
    const cpu_kernels *k;
    const pd_weight *w;
    const float *x;
    float *y;
    int64_t n;
    float *work;
    size_t per_thread; /* floats of work per thread */
    int64_t chunk, nchunks;
    bool direct; /* f32 weights used in place */
    atomic_llong next;
} gemm_ctx;

static void gemm_worker(void *p, int ith, int nth) {
    (void)nth;
    gemm_ctx *c = p;
    const pd_weight *w = c->w;
    float *buf = c->work + (size_t)ith * c->per_thread;
    const cpu_dequant_fn fast = c->k->dequant[w->type];
    for (;;) {
        const int64_t i = atomic_fetch_add_explicit(&c->next, 1, memory_order_relaxed);
        if (i >= c->nchunks) break;
        const int64_t r0 = i * c->chunk;
        const int64_t r1 = r0 + c->chunk < w->rows ? r0 + c->chunk : w->rows;
        const uint8_t *src = (const uint8_t *)w->data + (size_t)r0 * w->row_bytes;
        const float *b;
        int64_t ldb;
        if (c->direct) {
            b = (const float *)(const void *)src;
            ldb = (int64_t)(w->row_bytes / sizeof(float));
        } else {
            for (int64_t r = r0; r < r1; r++) {
                const uint8_t *row = src + (size_t)(r - r0) * w->row_bytes;
                float *dst = buf + (r - r0) * w->cols;
                if (fast)
                    fast(row, w->cols, dst);
                else
                    (void)pd_dequantize_row(w->type, row, dst, (uint64_t)w->cols, NULL); /* validated */
            }
            b = buf;
            ldb = w->cols;
        }
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)c->n, (int)(r1 - r0), (int)w->cols,
                    1.0f, c->x, (int)w->cols, b, (int)ldb, 0.0f, c->y + r0, (int)w->rows);
    }
}

static int matmul_gemm(cpu_backend *cb, const pd_weight *w, const float *x, int64_t n, float *y,
                       pd_error *err) {
    const int nth = cb->n_threads;
    const bool direct = w->type == PD_TYPE_F32 && ((uintptr_t)w->data % sizeof(float)) == 0 &&
                        w->row_bytes % sizeof(float) == 0;
    /* about 256 KiB of dequantized rows per tile */
    int64_t tile = 65536 / w->cols;
    if (tile > 512) tile = 512;
    int64_t chunk = pick_chunk(w->rows, nth, 2, 16, 16);
    /* a dequantized tile must fit the per-thread buffer; f32 weights are
     * used in place, and bigger tiles repack x less often */
    if (!direct && chunk > tile) chunk = tile < 16 ? 16 : tile / 16 * 16;
    gemm_ctx c = {.k = &cb->k, .w = w, .x = x, .y = y, .n = n, .chunk = chunk, .direct = direct};
    c.nchunks = (w->rows + chunk - 1) / chunk;
    if (!direct) {
        c.per_thread = ALIGN64((size_t)chunk * (size_t)w->cols * sizeof(float)) / sizeof(float);
        void *work = cb->work;
        size_t cap_bytes = cb->work_cap * sizeof(float);
        int rc = cpu_scratch_reserve(&work, &cap_bytes, c.per_thread * sizeof(float) * (size_t)nth, err);
        cb->work = work;
        cb->work_cap = cap_bytes / sizeof(float);
        if (rc) return rc;
        c.work = cb->work;
    }
    atomic_init(&c.next, 0);
    pd_threadpool_run(cb->tp, gemm_worker, &c);
    return PD_OK;
}

/* ------------------------------------------------------------------------
 * entry point
 * ------------------------------------------------------------------------ */

int cpu_matmul(pd_backend *be, const pd_weight *w, const float *x, int64_t n, float *y,
               pd_error *err) {
    cpu_backend *cb = be->impl;
    if (!w) return pd_errorf(err, PD_EINVAL, "matmul: NULL weight");
    const pd_type_traits *tr = pd_type_get((uint32_t)w->type);
    if (!tr || (uint32_t)w->type >= PD_TYPE_COUNT || !cb->k.mm[w->type])
        return pd_errorf(err, PD_EUNSUPPORTED,
                         "matmul: weights of type %s are not supported by the CPU backend "
                         "(supported: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, q2_k, q3_k, q4_k, q5_k, "
                         "q6_k, iq4_xs)",
                         tr ? tr->name : "(unknown)");
    if (n < 0 || w->rows < 0 || w->cols < 0)
        return pd_errorf(err, PD_EINVAL, "matmul: negative size (n %lld, weight %lld x %lld)",
                         (long long)n, (long long)w->rows, (long long)w->cols);
    if (w->cols % tr->block_size != 0)
        return pd_errorf(err, PD_EINVAL, "matmul: %lld columns is not a multiple of the %s block size %u",
                         (long long)w->cols, tr->name, tr->block_size);
    if (w->cols > INT32_MAX || w->rows > INT32_MAX || n > INT32_MAX)
        return pd_errorf(err, PD_ERANGE, "matmul: dimensions above 2^31 are not supported");
    const uint64_t need = (uint64_t)w->cols / tr->block_size * tr->type_size;
    if (w->row_bytes < need)
        return pd_errorf(err, PD_EINVAL, "matmul: row_bytes %zu is less than the %llu bytes of a %s row of %lld",
                         w->row_bytes, (unsigned long long)need, tr->name, (long long)w->cols);
    if (n == 0 || w->rows == 0) return PD_OK;
    if (!x || !y || (!w->data && w->cols > 0))
        return pd_errorf(err, PD_EINVAL, "matmul: NULL input, output or weight data");
    if (w->cols == 0) {
        memset(y, 0, (size_t)n * (size_t)w->rows * sizeof(float));
        return PD_OK;
    }

    if (n >= cb->gemm_min_n[w->type] && !cb->k.mm_any_n[w->type]) return matmul_gemm(cb, w, x, n, y, err);

    mm_ctx c = {.fn = cb->k.mm[w->type], .rows = w->rows};
    cpu_qact q;
    c.m.w = w->data;
    c.m.rb = w->row_bytes;
    c.m.cols = w->cols;
    c.m.n = n;
    c.m.x = x;
    c.m.y = y;
    c.m.ldy = w->rows;
    if (!cpu_type_is_float(w->type)) {
        int rc = quantize_acts(cb, w->type, x, n, w->cols, &q, err);
        if (rc) return rc;
        c.m.q = &q;
    }
    /* Chunks of whole 4-row tiles, a few per thread; with many tokens the
     * chunks can be smaller (more work per row). */
    c.chunk = pick_chunk(w->rows, cb->n_threads, 4, n >= 16 ? 16 : 32, 4);
    c.nchunks = (w->rows + c.chunk - 1) / c.chunk;
    atomic_init(&c.next, 0);
    if (c.nchunks == 1)
        mm_worker(&c, 0, 1);
    else
        pd_threadpool_run(cb->tp, mm_worker, &c);
    return PD_OK;
}
