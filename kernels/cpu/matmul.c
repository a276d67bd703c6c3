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
 * The dot-product path cuts the rows into chunks. Each thread owns a
 * contiguous run of them and takes it front to back, so it reads one
 * sequential stream that the hardware prefetcher follows; a thread done
 * with its run takes chunks from the back of the others' runs, so a slow
 * thread (another process on its core) does not hold everyone up. The
 * sgemm path takes tiles from one atomic counter.
 *
 * pd_backend_matmul_multi and _glu (several weights, one x) are one job:
 * x is quantized once per activation layout and the chunks of all the
 * weights are split between the threads together, one pool dispatch
 * instead of one per weight. A row's result is the same either way. */
#include <cblas.h>
#include <stdatomic.h>
#include <string.h>

#include "kernels/cpu/cpu_internal.h"

#define ALIGN64(v) (((v) + 63) & ~(size_t)63)

/* ------------------------------------------------------------------------
 * row-chunk scheduling
 * ------------------------------------------------------------------------ */

/* The weights of one call: 1 for matmul, 2 for matmul_glu, up to
 * PD_MATMUL_MULTI_MAX for matmul_multi (kernels/backend.c checks n_w). */
#define MM_MAX_PARTS PD_MATMUL_MULTI_MAX

typedef struct mm_part {
    cpu_mm m;
    cpu_mm_fn fn, fn_x16;
    int64_t rows, chunk, first; /* first: index of its first chunk */
    /* Decode over four far-apart quarters (cpu_mm.far): chunks [first,
     * first + nfar) are far_chunk rows of the first quarter, each with the
     * same rows of the other three (mf: m with far set); the rows from
     * 4 x mf.far on take ordinary chunks after them. nfar = 0: none. */
    cpu_mm mf;
    int64_t nfar, far_chunk;
    int64_t x16_rows;           /* rows [0, x16_rows) for fn_x16: packed, or repacked when `repack` */
    bool repack;                /* GGUF layout, x16 kernel: repack CPU_X16_BATCH_GROUPS groups at a time */
    pd_type type;
} mm_part;

typedef struct mm_ctx {
    mm_part part[MM_MAX_PARTS];
    int nparts;
    int64_t nchunks;
    cpu_mm_run *run; /* per thread: the chunk indices it owns */
    uint8_t *tmp;    /* per thread, tmp_stride bytes: repacked groups */
    size_t tmp_stride;
    void (*repack)(pd_type t, const uint8_t *src, int64_t groups, size_t row_bytes, uint8_t *dst);
} mm_ctx;

/* A run is [lo, hi) in one 64-bit word: the owner takes lo, others hi - 1. */
static bool take_chunk(cpu_mm_run *r, bool front, int64_t *i) {
    unsigned long long v = atomic_load_explicit(&r->lohi, memory_order_relaxed);
    for (;;) {
        const uint32_t lo = (uint32_t)v, hi = (uint32_t)(v >> 32);
        if (lo >= hi) return false;
        const unsigned long long nv = front ? v + 1 : ((unsigned long long)(hi - 1) << 32) | lo;
        if (atomic_compare_exchange_weak_explicit(&r->lohi, &v, nv, memory_order_relaxed, memory_order_relaxed)) {
            *i = front ? lo : hi - 1;
            return true;
        }
    }
}

/* Rows [r0, r1) of a part whose x16 rows are repacked: a few groups at a
 * time into thread ith's buffer, then the x16 kernel over them there. */
static void run_repacked(const mm_ctx *c, const mm_part *p, int64_t r0, int64_t r1, int ith) {
    uint8_t *tmp = c->tmp + (size_t)ith * c->tmp_stride;
    const int64_t step = CPU_X16_BATCH_GROUPS * CPU_X16;
    for (int64_t r = r0; r < r1; r += step) {
        const int64_t rz = r + step < r1 ? r + step : r1;
        c->repack(p->type, p->m.w + (size_t)r * p->m.rb, (rz - r) / CPU_X16, p->m.rb, tmp);
        cpu_mm m = p->m;
        m.w = tmp;
        m.y = p->m.y + r;
        p->fn_x16(&m, 0, rz - r);
    }
}

/* Rows [r0, r1) of part p, by thread ith. */
static void run_rows(const mm_ctx *c, const mm_part *p, int64_t r0, int64_t r1, int ith) {
    if (r0 < p->x16_rows) {
        const int64_t rx = r1 < p->x16_rows ? r1 : p->x16_rows;
        if (p->repack)
            run_repacked(c, p, r0, rx, ith);
        else
            p->fn_x16(&p->m, r0, rx);
        r0 = p->x16_rows;
    }
    if (r0 < r1) p->fn(&p->m, r0, r1);
}

static void run_chunk(const mm_ctx *c, int64_t i, int ith) {
    int k = 0;
    while (k + 1 < c->nparts && i >= c->part[k + 1].first) k++;
    const mm_part *p = &c->part[k];
    i -= p->first;
    if (i < p->nfar) {
        const int64_t r0 = i * p->far_chunk, r1 = r0 + p->far_chunk < p->mf.far ? r0 + p->far_chunk : p->mf.far;
        (p->x16_rows ? p->fn_x16 : p->fn)(&p->mf, r0, r1);
        return;
    }
    const int64_t r0 = 4 * p->mf.far + (i - p->nfar) * p->chunk;
    run_rows(c, p, r0, r0 + p->chunk < p->rows ? r0 + p->chunk : p->rows, ith);
}

static void mm_worker(void *p, int ith, int nth) {
    mm_ctx *c = p;
    int64_t i;
    while (take_chunk(&c->run[ith], true, &i)) run_chunk(c, i, ith);
    for (int k = 1; k < nth; k++)
        while (take_chunk(&c->run[(ith + k) % nth], false, &i)) run_chunk(c, i, ith);
}

/* Decode reads the weights over four far-apart quarters (cpu_mm.far) when
 * a quarter is FAR_MIN_BYTES or more: each thread's run of chunks then
 * reads four streams, each continuing across its chunks. One stream per
 * thread left memory bandwidth unused (see q4_K_rows4, simd_avx512.c).
 * On q8_0 x16 (kernel-bench --cold --packed, 3 interleaved rounds, 1 | 2
 * threads, four quarters of each thread's chunk) 2048x2048 went from 28.7
 * to 33.7 GB/s | 55.0 to 63.4, 8192x2048 28.9 to 32.5 | 62.0 to 70.6,
 * 512x2048 (quarters of 35 KB) 27.6 to 30.8, while quarters of one group of
 * 16 rows (10 KB) were slower (576x576: 28.9 to 26.2); Llama-3.2-1B Q8_0
 * decode went from 23.7 to 28.5 tokens/s at 1 thread, 45.4 to 53.7 at 2
 * (prefix-bench, 3 interleaved rounds). */
#define FAR_MIN_BYTES ((size_t)32 << 10)

static void plan_far(const cpu_kernels *k, mm_part *p, int64_t n) {
    p->mf = p->m;
    p->mf.far = 0;
    p->nfar = 0;
    const bool x16 = p->x16_rows && !p->repack;
    if (x16 ? !k->x16_decode_far[p->type] || n > CPU_X16_FAR_MAX_N : !k->decode_far[p->type] || n > CPU_DECODE_MAX_N)
        return;
    const int64_t mult = x16 ? CPU_X16 : 1;
    const int64_t quarter = (x16 ? p->x16_rows : p->rows) / 4 / mult * mult;
    if ((size_t)quarter * p->m.rb < FAR_MIN_BYTES) return;
    /* four far-apart pieces no bigger together than an ordinary chunk, so
     * that the threads still finish within a chunk of each other */
    const int64_t far_chunk = p->chunk / 4 / mult * mult;
    if (far_chunk == 0) return;
    p->mf.far = quarter;
    p->far_chunk = far_chunk;
    p->nfar = (quarter + far_chunk - 1) / far_chunk;
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

static cpu_quant_fn act_quant_fn(const cpu_backend *cb, pd_type wt) {
    if (cb->k.quant_act[wt]) return cb->k.quant_act[wt];
    return uses_q8_K(wt) ? cb->k.quant_q8_K : cb->k.quant_q8_0;
}

/* The scratch layout of n quantized rows: qs, then d at *d_off, then c or
 * bsums at *x_off; returns the bytes it takes. */
static size_t qact_layout(bool kq, int64_t n, int64_t cols, size_t *d_off, size_t *x_off) {
    const int64_t nblocks = cols / (kq ? PD_QK_K : 32);
    *d_off = ALIGN64((size_t)n * (size_t)cols);
    *x_off = *d_off + ALIGN64((size_t)n * (size_t)nblocks * sizeof(float));
    return *x_off + (kq ? ALIGN64((size_t)n * (size_t)(cols / 16) * sizeof(int16_t))
                        : ALIGN64((size_t)n * (size_t)nblocks * sizeof(int32_t)));
}

/* x quantized for weights of type wt into base (qact_layout's bytes). */
static void quantize_acts(cpu_backend *cb, pd_type wt, const float *x, int64_t n, int64_t cols, uint8_t *base,
                          cpu_qact *q) {
    const bool kq = uses_q8_K(wt);
    size_t d_off, x_off;
    (void)qact_layout(kq, n, cols, &d_off, &x_off);
    memset(q, 0, sizeof *q);
    q->n = n;
    q->cols = cols;
    q->nblocks = cols / (kq ? PD_QK_K : 32);
    q->qs = (int8_t *)base;
    q->d = (float *)(void *)(base + d_off);
    if (kq)
        q->bsums = (int16_t *)(void *)(base + x_off);
    else
        q->c = (int32_t *)(void *)(base + x_off);
    quant_ctx c = {x, q, act_quant_fn(cb, wt), cols / 16};
    if (n >= 4 && n * cols >= 65536)
        pd_threadpool_run(cb->tp, quant_worker, &c);
    else
        quant_rows(&c, 0, n);
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

/* What pd_backend_matmul refuses; PD_OK for a weight it computes. */
static int check_weight(const cpu_backend *cb, const pd_weight *w, const char *op, pd_error *err) {
    if (!w) return pd_errorf(err, PD_EINVAL, "%s: NULL weight", op);
    const pd_type_traits *tr = pd_type_get((uint32_t)w->type);
    if (!tr || (uint32_t)w->type >= PD_TYPE_COUNT || !cb->k.mm[w->type])
        return pd_errorf(err, PD_EUNSUPPORTED,
                         "%s: weights of type %s are not supported by the CPU backend "
                         "(supported: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, iq4_nl, q2_k, q3_k, q4_k, q5_k, "
                         "q6_k, iq4_xs)",
                         op, tr ? tr->name : "(unknown)");
    if (w->rows < 0 || w->cols < 0)
        return pd_errorf(err, PD_EINVAL, "%s: negative size (weight %lld x %lld)", op, (long long)w->rows,
                         (long long)w->cols);
    if (w->cols % tr->block_size != 0)
        return pd_errorf(err, PD_EINVAL, "%s: %lld columns is not a multiple of the %s block size %u", op,
                         (long long)w->cols, tr->name, tr->block_size);
    if (w->cols > INT32_MAX || w->rows > INT32_MAX)
        return pd_errorf(err, PD_ERANGE, "%s: dimensions above 2^31 are not supported", op);
    const uint64_t need = (uint64_t)w->cols / tr->block_size * tr->type_size;
    if (w->row_bytes < need)
        return pd_errorf(err, PD_EINVAL, "%s: row_bytes %zu is less than the %llu bytes of a %s row of %lld", op,
                         w->row_bytes, (unsigned long long)need, tr->name, (long long)w->cols);
    if (!w->data && w->cols > 0 && w->rows > 0) return pd_errorf(err, PD_EINVAL, "%s: NULL weight data", op);
    if (w->layout == PD_LAYOUT_CPU_X16 && !cb->k.mm_x16[w->type])
        return pd_errorf(err, PD_EUNSUPPORTED,
                         "%s: the %s weight is packed for the CPU's AVX-512 kernels, which this backend does not use "
                         "(PD_CPU_SIMD below avx512?); compute with the backend that packed it",
                         op, tr->name);
    if (w->layout != PD_LAYOUT_GGUF && w->layout != PD_LAYOUT_CPU_X16)
        return pd_errorf(err, PD_EINVAL, "%s: unknown weight layout %d", op, (int)w->layout);
    return PD_OK;
}

/* Whether n rows of x against w take the dot-product kernels (else
 * dequantize + sgemm, or nothing to compute). */
static bool on_dot_kernels(const cpu_backend *cb, const pd_weight *w, int64_t n) {
    return w->rows > 0 && w->cols > 0 &&
           (n < cb->gemm_min_n[w->type] || cb->k.mm_any_n[w->type] || w->layout == PD_LAYOUT_CPU_X16);
}

/* y[j] = x . w[j]^T for weights that all take the dot-product kernels, in
 * one pool dispatch. */
static int matmul_dot(cpu_backend *cb, const pd_weight *const *w, int nw, const float *x, int64_t n,
                      float *const *y, pd_error *err) {
    mm_ctx c = {.nparts = nw};
    /* one quantized x per activation layout */
    cpu_quant_fn qfn[MM_MAX_PARTS];
    int qof[MM_MAX_PARTS]; /* part j uses the x quantized for part qof[j] */
    size_t off[MM_MAX_PARTS + 1] = {0};
    for (int j = 0; j < nw; j++) {
        qof[j] = j;
        off[j + 1] = off[j];
        if (cpu_type_is_float(w[j]->type)) continue;
        qfn[j] = act_quant_fn(cb, w[j]->type);
        for (int k = 0; k < j; k++)
            if (!cpu_type_is_float(w[k]->type) && qof[k] == k && qfn[k] == qfn[j] &&
                uses_q8_K(w[k]->type) == uses_q8_K(w[j]->type))
                qof[j] = k;
        size_t d_off, x_off;
        if (qof[j] == j) off[j + 1] += qact_layout(uses_q8_K(w[j]->type), n, w[j]->cols, &d_off, &x_off);
    }
    if (off[nw]) {
        int rc = cpu_scratch_reserve(&cb->act, &cb->act_cap, off[nw], err);
        if (rc) return rc;
    }
    cpu_qact q[MM_MAX_PARTS];
    /* Chunks of whole 4-row tiles, about 8 per thread, so that a thread
     * done early can take over a slow one's last ones. */
    const int nth = cb->n_threads;
    for (int j = 0; j < nw; j++) {
        mm_part *p = &c.part[j];
        p->fn = cb->k.mm[w[j]->type];
        p->fn_x16 = cb->k.mm_x16[w[j]->type];
        p->type = w[j]->type;
        p->rows = w[j]->rows;
        /* (a type packed at load that stayed in the file's layout, e.g.
         * mapped, keeps its row kernels: theirs are not the x16 steps) */
        p->repack = w[j]->layout == PD_LAYOUT_GGUF && n >= CPU_X16_REPACK_MIN_N && cb->k.x16_repack &&
                    cpu_x16_fits(&cb->k, w[j]) && !cb->k.x16_at_load[w[j]->type];
        p->x16_rows = w[j]->layout == PD_LAYOUT_CPU_X16 || p->repack ? w[j]->rows / CPU_X16 * CPU_X16 : 0;
        if (p->repack) {
            const size_t bytes = ALIGN64((size_t)CPU_X16_BATCH_GROUPS * CPU_X16 * w[j]->row_bytes);
            if (bytes > c.tmp_stride) c.tmp_stride = bytes;
        }
        p->m = (cpu_mm){.w = w[j]->data, .rb = w[j]->row_bytes, .cols = w[j]->cols, .n = n, .x = x, .y = y[j],
                        .ldy = w[j]->rows};
        if (!cpu_type_is_float(w[j]->type)) {
            if (qof[j] == j) quantize_acts(cb, w[j]->type, x, n, w[j]->cols, (uint8_t *)cb->act + off[j], &q[j]);
            p->m.q = &q[qof[j]];
        }
        p->chunk = pick_chunk(p->rows, nth, 8, 16, p->x16_rows ? CPU_X16 : 4);
        p->first = c.nchunks;
        plan_far(&cb->k, p, n);
        c.nchunks += p->nfar + (p->rows - 4 * p->mf.far + p->chunk - 1) / p->chunk;
    }
    if (c.tmp_stride) {
        int rc = cpu_scratch_reserve(&cb->x16_tmp, &cb->x16_tmp_cap, (size_t)nth * c.tmp_stride, err);
        if (rc) return rc;
        c.tmp = cb->x16_tmp;
        c.repack = cb->k.x16_repack;
    }
    if (c.nchunks == 1 || nth == 1) {
        for (int64_t i = 0; i < c.nchunks; i++) run_chunk(&c, i, 0);
        return PD_OK;
    }
    c.run = cb->runs;
    for (int t = 0; t < nth; t++) {
        const unsigned long long lo = (unsigned long long)(c.nchunks * t / nth);
        const unsigned long long hi = (unsigned long long)(c.nchunks * (t + 1) / nth);
        atomic_store_explicit(&c.run[t].lohi, hi << 32 | lo, memory_order_relaxed);
    }
    pd_threadpool_run(cb->tp, mm_worker, &c);
    return PD_OK;
}

/* One weight: validated by the caller. */
static int matmul_one(cpu_backend *cb, const pd_weight *w, const float *x, int64_t n, float *y, pd_error *err) {
    if (n == 0 || w->rows == 0) return PD_OK;
    if (w->cols == 0) {
        memset(y, 0, (size_t)n * (size_t)w->rows * sizeof(float));
        return PD_OK;
    }
    if (!on_dot_kernels(cb, w, n)) return matmul_gemm(cb, w, x, n, y, err);
    return matmul_dot(cb, &w, 1, x, n, &y, err);
}

static int check_call(const float *x, int64_t n, int nw, float *const *y, const char *op, pd_error *err) {
    if (n < 0) return pd_errorf(err, PD_EINVAL, "%s: negative token count %lld", op, (long long)n);
    if (n > INT32_MAX) return pd_errorf(err, PD_ERANGE, "%s: dimensions above 2^31 are not supported", op);
    if (n == 0) return PD_OK;
    if (!x) return pd_errorf(err, PD_EINVAL, "%s: NULL input", op);
    for (int j = 0; j < nw; j++)
        if (!y[j]) return pd_errorf(err, PD_EINVAL, "%s: NULL output", op);
    return PD_OK;
}

int cpu_matmul(pd_backend *be, const pd_weight *w, const float *x, int64_t n, float *y, pd_error *err) {
    cpu_backend *cb = be->impl;
    int rc;
    if ((rc = check_weight(cb, w, "matmul", err)) || (rc = check_call(x, n, 1, &y, "matmul", err))) return rc;
    return matmul_one(cb, w, x, n, y, err);
}

int cpu_matmul_multi(pd_backend *be, const pd_weight *const *w, int n_w, const float *x, int64_t n,
                     float *const *y, pd_error *err) {
    cpu_backend *cb = be->impl;
    int rc = check_call(x, n, n_w, y, "matmul_multi", err);
    bool fused = n > 0;
    for (int j = 0; j < n_w && !rc; j++) {
        rc = check_weight(cb, w[j], "matmul_multi", err);
        if (!rc && w[j]->cols != w[0]->cols)
            rc = pd_errorf(err, PD_EINVAL, "matmul_multi: weight %d has %lld columns, weight 0 %lld", j,
                           (long long)w[j]->cols, (long long)w[0]->cols);
        if (!rc && !on_dot_kernels(cb, w[j], n)) fused = false;
    }
    if (rc) return rc;
    if (fused) return matmul_dot(cb, w, n_w, x, n, y, err);
    for (int j = 0; j < n_w && !rc; j++) rc = matmul_one(cb, w[j], x, n, y[j], err);
    return rc;
}
