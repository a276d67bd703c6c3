/* kernels: the CPU backend (thread pool, matmul per type and SIMD level,
 * get_rows, rmsnorm, rope, swiglu, segmented attention).
 *
 * References are computed in double from the reference dequantizer.
 *
 * matmul bounds tested, per output y[t][r] with w = dequantized row r and
 * x = x[t]:
 *   f32/f16/bf16 weights:  |y - ref| <= 1e-5 * sum_i |w_i x_i|
 *   quantized weights:     |y - ref| <= 1.001 * sum_i |w_i| * amax(x over
 *                          i's block) / 254  +  2e-5 * sum_i |w_i| (|x_i| + amax/254)
 * The first term of the second line is the activation quantization error
 * (int8 with a per-block scale amax/127 is off by at most half a step per
 * element; blocks are 32 for the 32-element types (q8_0, q4_0, q4_1, q5_0,
 * q5_1, iq4_nl) and 256 for the 256-element ones); the second is float
 * rounding. SIMD and scalar paths agree within float rounding
 * (1e-5 of the sums above) on the dot-product kernels, where both multiply
 * the same int8 activations. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/engine.h"
#include "helpers.h"
#include "kernels/kernels.h"
#include "tools/tools.h"

/* ------------------------------------------------------------------------
 * helpers
 * ------------------------------------------------------------------------ */

static uint64_t rng_next(uint64_t *s) {
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545f4914f6cdd1dull;
}

static double rng_unit(uint64_t *s) {
    return ((double)(rng_next(s) >> 11) + 0.5) / 9007199254740992.0;
}

static float rng_normal(uint64_t *s) {
    const double u1 = rng_unit(s), u2 = rng_unit(s);
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

static float rng_uniform(uint64_t *s) {
    return (float)(rng_unit(s) * 2.0 - 1.0);
}

/* Activations with LLM-like outliers: mostly N(0,1), a few large values. */
static void fill_acts(uint64_t *s, float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        x[i] = rng_normal(s);
        if (rng_next(s) % 97 == 0) x[i] *= 20.0f;
    }
}

/* Create a CPU backend with PD_CPU_SIMD set to simd (NULL: auto). */
static pd_backend *make_backend(int threads, const char *simd) {
    if (simd)
        setenv("PD_CPU_SIMD", simd, 1);
    else
        unsetenv("PD_CPU_SIMD");
    pd_backend *be = NULL;
    pd_error err = {0};
    const int rc = pd_backend_cpu_create(threads, &be, &err);
    unsetenv("PD_CPU_SIMD");
    cr_assert_eq(rc, PD_OK, "pd_backend_cpu_create(%d, %s): %s", threads, simd ? simd : "auto", err.msg);
    cr_assert_not_null(be);
    return be;
}

static bool cpu_has(const char *level) {
    /* a level is available when capping at it reports it */
    setenv("PD_CPU_SIMD", level, 1);
    const bool ok = strcmp(pd_cpu_simd_name(), strcmp(level, "avx512") == 0 ? "avx512vnni" : level) == 0;
    unsetenv("PD_CPU_SIMD");
    return ok;
}

/* Random weights of type t, quantized with the reference quantizer. */
static uint8_t *make_weights(uint64_t *s, pd_type t, int64_t rows, int64_t cols, pd_weight *w) {
    pd_error err = {0};
    uint64_t rb;
    cr_assert_eq(pd_type_row_size(t, (uint64_t)cols, &rb, &err), PD_OK, "%s", err.msg);
    uint8_t *data = malloc((size_t)(rb * (uint64_t)rows) + 1);
    float *src = malloc(sizeof(float) * (size_t)cols);
    cr_assert(data && src);
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t i = 0; i < cols; i++) src[i] = rng_normal(s) * 0.05f;
        cr_assert_eq(pd_quantize_row(t, src, data + (size_t)r * rb, (uint64_t)cols, &err), PD_OK, "%s",
                     err.msg);
    }
    free(src);
    cr_assert_eq(pd_weight_init(w, t, data, rows, cols, &err), PD_OK, "%s", err.msg);
    return data;
}

static bool is_quant(pd_type t) {
    return t != PD_TYPE_F32 && t != PD_TYPE_F16 && t != PD_TYPE_BF16;
}

/* Reference product and the error bounds described at the top. */
static void ref_matmul(const pd_weight *w, const float *x, int64_t n, double *ref, double *bound,
                       double *round_scale) {
    pd_error err = {0};
    float *wd = malloc(sizeof(float) * (size_t)w->cols);
    cr_assert_not_null(wd);
    const int64_t bs = pd_type_get(w->type)->block_size == PD_QK_K ? PD_QK_K : 32;
    for (int64_t r = 0; r < w->rows; r++) {
        cr_assert_eq(pd_dequantize_row(w->type, (const uint8_t *)w->data + (size_t)r * w->row_bytes, wd,
                                       (uint64_t)w->cols, &err),
                     PD_OK, "%s", err.msg);
        for (int64_t t = 0; t < n; t++) {
            const float *xt = x + t * w->cols;
            double acc = 0, qb = 0, rs = 0;
            for (int64_t b = 0; b < w->cols; b += bs) {
                double amax = 0;
                for (int64_t i = b; i < b + bs && i < w->cols; i++) amax = fmax(amax, fabs((double)xt[i]));
                for (int64_t i = b; i < b + bs && i < w->cols; i++) {
                    acc += (double)wd[i] * (double)xt[i];
                    qb += fabs((double)wd[i]) * amax / 254.0;
                    rs += fabs((double)wd[i]) * (fabs((double)xt[i]) + amax / 254.0);
                }
            }
            ref[t * w->rows + r] = acc;
            if (is_quant(w->type)) {
                bound[t * w->rows + r] = 1.001 * qb + 2e-5 * rs;
            } else {
                double a = 0;
                for (int64_t i = 0; i < w->cols; i++) a += fabs((double)wd[i] * (double)xt[i]);
                bound[t * w->rows + r] = 1e-5 * a + 1e-30;
            }
            round_scale[t * w->rows + r] = rs;
        }
    }
    free(wd);
}

static const pd_type all_types[] = {PD_TYPE_F32,  PD_TYPE_F16,  PD_TYPE_BF16, PD_TYPE_Q8_0,   PD_TYPE_Q4_0,
                                    PD_TYPE_Q4_K, PD_TYPE_Q6_K, PD_TYPE_Q2_K, PD_TYPE_Q3_K,   PD_TYPE_Q5_K,
                                    PD_TYPE_IQ4_XS, PD_TYPE_Q4_1, PD_TYPE_Q5_0, PD_TYPE_Q5_1, PD_TYPE_IQ4_NL};
#define N_TYPES (sizeof all_types / sizeof all_types[0])

/* Check the weight w against the reference for the batch sizes ns[0..n_ns)
 * (ascending) and 1 and 2 threads on the given SIMD level, with
 * activations drawn from *s; the reference reads ref_w (w in the GGUF
 * layout), or w itself if NULL. */
static void check_weight_as(const pd_weight *w, const pd_weight *ref_w, const char *simd, uint64_t *s,
                            const int64_t *ns, size_t n_ns) {
    static const int threads[] = {1, 2};
    const int64_t rows = w->rows, cols = w->cols;
    const int64_t nmax = ns[n_ns - 1];
    float *x = malloc(sizeof(float) * (size_t)(nmax * cols));
    float *y = malloc(sizeof(float) * (size_t)(nmax * rows));
    double *ref = malloc(sizeof(double) * (size_t)(nmax * rows));
    double *bound = malloc(sizeof(double) * (size_t)(nmax * rows));
    double *rs = malloc(sizeof(double) * (size_t)(nmax * rows));
    cr_assert(x && y && ref && bound && rs);
    fill_acts(s, x, nmax * cols);
    ref_matmul(ref_w ? ref_w : w, x, nmax, ref, bound, rs);
    const char *tn = pd_type_get(w->type)->name;
    for (size_t ti = 0; ti < sizeof threads / sizeof threads[0]; ti++) {
        pd_backend *be = make_backend(threads[ti], simd);
        for (size_t ni = 0; ni < n_ns; ni++) {
            const int64_t n = ns[ni];
            pd_error err = {0};
            for (int64_t i = 0; i < n * rows; i++) y[i] = NAN;
            cr_assert_eq(pd_backend_matmul(be, w, x, n, y, &err), PD_OK, "%s", err.msg);
            for (int64_t i = 0; i < n * rows; i++) {
                const double e = fabs((double)y[i] - ref[i]);
                cr_assert(e <= bound[i],
                          "%s %s %lldx%lld n=%lld threads=%d: y[%lld][%lld] = %.9g, ref %.9g, |err| %.3g > "
                          "bound %.3g",
                          simd ? simd : "auto", tn, (long long)rows, (long long)cols, (long long)n,
                          threads[ti], (long long)(i / rows), (long long)(i % rows), (double)y[i], ref[i], e,
                          bound[i]);
            }
        }
        pd_backend_free(be);
    }
    free(x);
    free(y);
    free(ref);
    free(bound);
    free(rs);
}

static void check_weight(const pd_weight *w, const char *simd, uint64_t *s, const int64_t *ns, size_t n_ns) {
    check_weight_as(w, NULL, simd, s, ns, n_ns);
}

/* The same for random weights of type t quantized by pd_quantize_row. */
static void check_matmul_ns(pd_type t, int64_t rows, int64_t cols, const char *simd, uint64_t seed, const int64_t *ns,
                            size_t n_ns) {
    uint64_t s = seed;
    pd_weight w;
    uint8_t *data = make_weights(&s, t, rows, cols, &w);
    check_weight(&w, simd, &s, ns, n_ns);
    free(data);
}

static void check_matmul(pd_type t, int64_t rows, int64_t cols, const char *simd, uint64_t seed) {
    static const int64_t ns[] = {1, 2, 3, 7, 8, 9, 64, 200}; /* both sides of CPU_DECODE_MAX_N */
    check_matmul_ns(t, rows, cols, simd, seed, ns, sizeof ns / sizeof ns[0]);
}

/* ------------------------------------------------------------------------
 * thread pool
 * ------------------------------------------------------------------------ */

typedef struct tp_ctx {
    atomic_int hits[16];
    atomic_int bad_nth;
    int expect_nth;
    int64_t *slots; /* written by each thread, read after run */
    int64_t round;
} tp_ctx;

static void tp_fn(void *p, int ith, int nth) {
    tp_ctx *c = p;
    if (nth != c->expect_nth || ith < 0 || ith >= nth) atomic_fetch_add(&c->bad_nth, 1);
    atomic_fetch_add(&c->hits[ith], 1);
    for (int64_t i = ith; i < 1000; i += nth) c->slots[i] = c->round * 1000 + i;
}

Test(threadpool, every_index_once_per_run) {
    for (int nthreads = 1; nthreads <= 5; nthreads++) {
        pd_threadpool *tp;
        pd_error err = {0};
        cr_assert_eq(pd_threadpool_create(nthreads, &tp, &err), PD_OK, "%s", err.msg);
        cr_assert_eq(pd_threadpool_size(tp), nthreads);
        tp_ctx c = {.expect_nth = nthreads};
        c.slots = calloc(1000, sizeof(int64_t));
        for (int i = 0; i < 16; i++) atomic_init(&c.hits[i], 0);
        atomic_init(&c.bad_nth, 0);
        const int runs = 2000;
        for (int r = 0; r < runs; r++) {
            c.round = r;
            pd_threadpool_run(tp, tp_fn, &c);
            /* run is a barrier: every slot holds this round's value */
            for (int64_t i = 0; i < 1000; i++)
                cr_assert_eq(c.slots[i], (int64_t)r * 1000 + i, "threads %d run %d slot %lld", nthreads, r,
                             (long long)i);
            for (int i = 0; i < nthreads; i++)
                cr_assert_eq(atomic_load(&c.hits[i]), r + 1, "threads %d run %d: index %d ran %d times",
                             nthreads, r, i, atomic_load(&c.hits[i]));
        }
        cr_assert_eq(atomic_load(&c.bad_nth), 0);
        free(c.slots);
        pd_threadpool_free(tp);
    }
}

typedef struct tp_job {
    atomic_int count, mask;
} tp_job;

static void job_fn(void *p, int ith, int nth) {
    tp_job *j = p;
    (void)nth;
    atomic_fetch_add(&j->count, 1);
    atomic_fetch_or(&j->mask, 1 << ith);
}

Test(threadpool, no_index_runs_twice_or_late) {
    /* a fresh context per run: every index touches its own run exactly once
     * and nobody touches a run after pd_threadpool_run returned, also when
     * workers fall asleep between runs and the caller takes their share */
    pd_threadpool *tp;
    pd_error err = {0};
    cr_assert_eq(pd_threadpool_create(3, &tp, &err), PD_OK, "%s", err.msg);
    const int runs = 100000;
    tp_job *jobs = calloc((size_t)runs, sizeof *jobs);
    cr_assert_not_null(jobs);
    for (int r = 0; r < runs; r++) {
        pd_threadpool_run(tp, job_fn, &jobs[r]);
        cr_assert_eq(atomic_load(&jobs[r].count), 3, "run %d: %d calls", r, atomic_load(&jobs[r].count));
        cr_assert_eq(atomic_load(&jobs[r].mask), 7, "run %d: indices %#x", r, atomic_load(&jobs[r].mask));
        if (r % 10000 == 9999) {
            struct timespec ts = {0, 2 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
    }
    for (int r = 0; r < runs; r++) cr_assert_eq(atomic_load(&jobs[r].count), 3, "run %d touched late", r);
    pd_threadpool_free(tp);
    free(jobs);
}

static void sleepy_fn(void *p, int ith, int nth) {
    (void)nth;
    atomic_int *hits = p;
    atomic_fetch_add(&hits[ith], 1);
}

Test(threadpool, wakes_sleeping_workers) {
    /* gaps longer than the spin time put the workers to sleep */
    pd_threadpool *tp;
    pd_error err = {0};
    cr_assert_eq(pd_threadpool_create(3, &tp, &err), PD_OK, "%s", err.msg);
    atomic_int hits[3];
    for (int i = 0; i < 3; i++) atomic_init(&hits[i], 0);
    for (int r = 0; r < 5; r++) {
        struct timespec ts = {0, 5 * 1000 * 1000};
        nanosleep(&ts, NULL);
        pd_threadpool_run(tp, sleepy_fn, hits);
    }
    for (int i = 0; i < 3; i++) cr_assert_eq(atomic_load(&hits[i]), 5);
    pd_threadpool_free(tp);
}

Test(threadpool, default_size_and_limits) {
    pd_threadpool *tp;
    pd_error err = {0};
    cr_assert_eq(pd_threadpool_create(0, &tp, &err), PD_OK, "%s", err.msg);
    cr_assert_geq(pd_threadpool_size(tp), 1);
    pd_threadpool_free(tp);
    cr_assert_eq(pd_threadpool_create(100000, &tp, &err), PD_ERANGE);
    cr_assert_null(tp);
    pd_threadpool_free(NULL);
}

/* ------------------------------------------------------------------------
 * matmul vs reference
 * ------------------------------------------------------------------------ */

Test(matmul, f32_f16_bf16_match_reference, .timeout = 120) {
    const pd_type ts[] = {PD_TYPE_F32, PD_TYPE_F16, PD_TYPE_BF16};
    const int64_t shapes[][2] = {{1, 8}, {5, 33}, {13, 96}, {37, 576}, {131, 100}};
    for (size_t i = 0; i < 3; i++)
        for (size_t j = 0; j < sizeof shapes / sizeof shapes[0]; j++)
            check_matmul(ts[i], shapes[j][0], shapes[j][1], NULL, 1000 + 10 * i + j);
}

Test(matmul, q8_0_q4_0_match_reference, .timeout = 120) {
    const pd_type ts[] = {PD_TYPE_Q8_0, PD_TYPE_Q4_0};
    const int64_t shapes[][2] = {{1, 32}, {3, 64}, {5, 96}, {13, 576}, {37, 160}, {131, 1536}};
    for (size_t i = 0; i < 2; i++)
        for (size_t j = 0; j < sizeof shapes / sizeof shapes[0]; j++)
            check_matmul(ts[i], shapes[j][0], shapes[j][1], NULL, 2000 + 10 * i + j);
}

/* (131x2048: quarters of 32 rows, so decode reads them side by side) */
Test(matmul, q4_k_q6_k_match_reference, .timeout = 120) {
    const pd_type ts[] = {PD_TYPE_Q4_K, PD_TYPE_Q6_K};
    const int64_t shapes[][2] = {{1, 256}, {5, 512}, {13, 768}, {37, 256}, {131, 2048}};
    for (size_t i = 0; i < 2; i++)
        for (size_t j = 0; j < sizeof shapes / sizeof shapes[0]; j++)
            check_matmul(ts[i], shapes[j][0], shapes[j][1], NULL, 3000 + 10 * i + j);
}

/* q2_K, q3_K, q5_K and iq4_xs at every SIMD level this CPU has: decode
 * batches 1..8 and a prefill batch, odd row counts, once with the default
 * kernel choice (dequantize + sgemm for large n at the scalar level) and
 * once with the dot-product kernels at every n. */
Test(matmul, q2_k_q3_k_q5_k_iq4_xs_every_level, .timeout = 300) {
    static const int64_t ns[] = {1, 2, 3, 4, 5, 6, 7, 8, 37};
    const pd_type ts[] = {PD_TYPE_Q2_K, PD_TYPE_Q3_K, PD_TYPE_Q5_K, PD_TYPE_IQ4_XS};
    const int64_t shapes[][2] = {{1, 256}, {7, 768}, {37, 512}};
    const char *levels[] = {"scalar", "avx2", "avx512"};
    for (size_t l = 0; l < 3; l++) {
        if (l > 0 && !cpu_has(levels[l])) continue;
        for (int gemm = 0; gemm < 2; gemm++) {
            if (gemm)
                setenv("PD_CPU_GEMM_MIN_N", "1000", 1);
            else
                unsetenv("PD_CPU_GEMM_MIN_N");
            for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++)
                for (size_t j = 0; j < sizeof shapes / sizeof shapes[0]; j++)
                    check_matmul_ns(ts[i], shapes[j][0], shapes[j][1], levels[l], 6000 + 100 * l + 10 * i + j, ns,
                                    sizeof ns / sizeof ns[0]);
        }
        unsetenv("PD_CPU_GEMM_MIN_N");
    }
}

/* Blocks written by llama.cpp's own quantizer: a generated F32 model (rows
 * of 256 and 512, so every matrix can take a 256-element type) through
 * llama-quantize into the mixes that hold q2_K, q3_K, q5_K and iq4_xs.
 * Each such matrix decodes to the original weights within its type's
 * quantization error (bounds a little above the relative rms errors these
 * files show: q2_K 0.295, q3_K 0.150, q5_K 0.036, iq4_xs 0.076; a block
 * misread is off by about the signal itself), and multiplies at every SIMD
 * level like its dequantized rows. */
static char *peer_dir;
static void peer_setup(void) {
    peer_dir = th_mkdtemp();
    cr_assert_not_null(peer_dir);
}
static void peer_teardown(void) {
    th_rmtree(peer_dir);
    free(peer_dir);
    peer_dir = NULL;
}

static float *dequant_tensor(const pd_gguf_tensor *t) {
    float *f = malloc(sizeof(float) * t->n_elems);
    pd_error err = {0};
    cr_assert_not_null(f);
    cr_assert_eq(pd_dequantize_row(t->type, t->data, f, t->n_elems, &err), PD_OK, "%s: %s", t->name, err.msg);
    return f;
}

Test(matmul, llama_cpp_blocks_match_reference, .timeout = 300, .init = peer_setup, .fini = peer_teardown) {
    char f32_path[1024], q_path[1024];
    snprintf(f32_path, sizeof f32_path, "%s/f32.gguf", peer_dir);
    snprintf(q_path, sizeof q_path, "%s/q.gguf", peer_dir);
    pd_testmodel_opts o;
    pd_error err = {0};
    cr_assert_eq(pd_testmodel_preset("tiny", &o, &err), PD_OK, "%s", err.msg);
    o.n_embd = 256;
    o.n_ff = 512;
    o.n_layer = 1;
    o.n_head = 4;
    o.n_head_kv = 2;
    o.seed = 11;
    cr_assert_eq(pd_testmodel_write(&o, f32_path, NULL, &err), PD_OK, "%s", err.msg);
    static const char *ftypes[] = {"Q2_K", "Q3_K_S", "Q5_K_S", "IQ4_XS"};
    static const struct {
        pd_type t;
        double max_rel;
    } types[] = {{PD_TYPE_Q2_K, 0.33}, {PD_TYPE_Q3_K, 0.17}, {PD_TYPE_Q5_K, 0.04}, {PD_TYPE_IQ4_XS, 0.085}};
    static const int64_t ns[] = {1, 4, 8, 37};
    const char *levels[] = {"scalar", "avx2", "avx512"};
    int seen[sizeof types / sizeof types[0]] = {0};
    uint64_t s = 12;
    pd_gguf *gf = NULL;
    cr_assert_eq(pd_gguf_open(f32_path, &gf, &err), PD_OK, "%s", err.msg);
    for (size_t f = 0; f < sizeof ftypes / sizeof ftypes[0]; f++) {
        th_llama_quantize(f32_path, q_path, ftypes[f]);
        pd_gguf *gq = NULL;
        cr_assert_eq(pd_gguf_open(q_path, &gq, &err), PD_OK, "%s", err.msg);
        for (size_t i = 0; i < pd_gguf_tensor_count(gq); i++) {
            const pd_gguf_tensor *tq = pd_gguf_tensor_at(gq, i);
            size_t k = 0;
            while (k < sizeof types / sizeof types[0] && types[k].t != tq->type) k++;
            if (tq->n_dims != 2 || k == sizeof types / sizeof types[0]) continue;
            seen[k]++;
            const pd_gguf_tensor *tf = pd_gguf_find_tensor(gf, tq->name);
            cr_assert(tf && tf->n_elems == tq->n_elems && tf->type == PD_TYPE_F32, "%s", tq->name);
            float *wq = dequant_tensor(tq), *wf = dequant_tensor(tf);
            double se = 0, ss = 0;
            for (uint64_t e = 0; e < tq->n_elems; e++) {
                se += ((double)wq[e] - wf[e]) * ((double)wq[e] - wf[e]);
                ss += (double)wf[e] * wf[e];
            }
            const double rel = sqrt(se / ss);
            cr_log_info("%s %s %s: relative rms error %.4f", ftypes[f], tq->name, pd_type_get(tq->type)->name, rel);
            cr_expect_lt(rel, types[k].max_rel, "%s %s (%s): relative rms error %g vs the F32 weights", ftypes[f],
                         tq->name, pd_type_get(tq->type)->name, rel);
            free(wq);
            free(wf);
            pd_weight w;
            cr_assert_eq(pd_weight_init(&w, tq->type, tq->data, (int64_t)tq->ne[1], (int64_t)tq->ne[0], &err), PD_OK,
                         "%s", err.msg);
            for (size_t l = 0; l < 3; l++)
                if (l == 0 || cpu_has(levels[l])) check_weight(&w, levels[l], &s, ns, sizeof ns / sizeof ns[0]);
        }
        pd_gguf_close(gq);
    }
    pd_gguf_close(gf);
    for (size_t k = 0; k < sizeof types / sizeof types[0]; k++)
        cr_expect_gt(seen[k], 0, "no %s matrix in the llama-quantize files", pd_type_get(types[k].t)->name);
}

/* q4_1, q5_0, q5_1 and iq4_nl on every SIMD level this CPU has: every
 * decode n (1..8) and a prefill n, odd row and block counts (576 and 896
 * are widths of models whose K-quant mixes use these types). */
static const pd_type q32_types[] = {PD_TYPE_Q4_1, PD_TYPE_Q5_0, PD_TYPE_Q5_1, PD_TYPE_IQ4_NL};
static const char *const simd_levels[] = {"scalar", "avx2", "avx512"};
static const int64_t q32_ns[] = {1, 2, 3, 4, 5, 6, 7, 8, 37};
static const int64_t q32_shapes[][2] = {{1, 32}, {7, 96}, {13, 608}, {37, 896}, {5, 576}};

Test(matmul, q4_1_q5_0_q5_1_iq4_nl_match_reference, .timeout = 300) {
    for (size_t l = 0; l < 3; l++) {
        if (l > 0 && !cpu_has(simd_levels[l])) continue;
        for (size_t i = 0; i < 4; i++)
            for (size_t j = 0; j < sizeof q32_shapes / sizeof q32_shapes[0]; j++)
                check_matmul_ns(q32_types[i], q32_shapes[j][0], q32_shapes[j][1], simd_levels[l],
                                7000 + 100 * l + 10 * i + j, q32_ns, sizeof q32_ns / sizeof q32_ns[0]);
    }
}

/* The same kernels against the exact product with the activations the
 * backend multiplies: x quantized to int8 per block of 32 (d = amax / 127
 * in float, codes round-to-nearest-even of x * (1 / d)). What remains is
 * float rounding of the per-block sums: within 1e-5 of sum |x_q| (|w| +
 * 2|m|), m the block offset of q4_1/q5_1 (their kernels add q*d and m
 * separately). The dequantize + sgemm path is kept out of the way. */
Test(matmul, q32_kernels_are_exact_on_quantized_activations, .timeout = 300) {
    setenv("PD_CPU_GEMM_MIN_N", "1000", 1);
    for (size_t l = 0; l < 3; l++) {
        if (l > 0 && !cpu_has(simd_levels[l])) continue;
        for (size_t i = 0; i < 4; i++) {
            const pd_type t = q32_types[i];
            const bool offset = t == PD_TYPE_Q4_1 || t == PD_TYPE_Q5_1;
            for (size_t j = 0; j < sizeof q32_shapes / sizeof q32_shapes[0]; j++) {
                const int64_t rows = q32_shapes[j][0], cols = q32_shapes[j][1], nmax = 37;
                uint64_t s = 8000 + 100 * l + 10 * i + j;
                pd_weight w;
                uint8_t *data = make_weights(&s, t, rows, cols, &w);
                float *x = malloc(sizeof(float) * (size_t)(nmax * cols)), *wd = malloc(sizeof(float) * (size_t)cols);
                double *xq = malloc(sizeof(double) * (size_t)(nmax * cols));
                double *ref = malloc(sizeof(double) * (size_t)(nmax * rows)), *tol = malloc(sizeof(double) * (size_t)(nmax * rows));
                float *y = malloc(sizeof(float) * (size_t)(nmax * rows));
                cr_assert(x && wd && xq && ref && tol && y);
                fill_acts(&s, x, nmax * cols);
                for (int64_t b = 0; b < nmax * cols / 32; b++) {
                    float amax = 0.0f;
                    for (int k = 0; k < 32; k++) amax = fmaxf(amax, fabsf(x[32 * b + k]));
                    const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
                    for (int k = 0; k < 32; k++) xq[32 * b + k] = (double)rintf(x[32 * b + k] * id) * (double)d;
                }
                for (int64_t r = 0; r < rows; r++) {
                    const uint8_t *row = data + (size_t)r * w.row_bytes;
                    pd_error err = {0};
                    cr_assert_eq(pd_dequantize_row(t, row, wd, (uint64_t)cols, &err), PD_OK, "%s", err.msg);
                    for (int64_t tk = 0; tk < nmax; tk++) {
                        double acc = 0, mag = 0;
                        for (int64_t k = 0; k < cols; k++) {
                            const uint8_t *blk = row + (size_t)(k / 32) * pd_type_get(t)->type_size;
                            const double m = offset ? fabs((double)pd_fp16_to_fp32((uint16_t)(blk[2] | (blk[3] << 8)))) : 0;
                            acc += (double)wd[k] * xq[tk * cols + k];
                            mag += (fabs((double)wd[k]) + 2 * m) * fabs(xq[tk * cols + k]);
                        }
                        ref[tk * rows + r] = acc;
                        tol[tk * rows + r] = 1e-5 * mag + 1e-30;
                    }
                }
                for (int th = 1; th <= 2; th++) {
                    pd_backend *be = make_backend(th, simd_levels[l]);
                    for (size_t ni = 0; ni < sizeof q32_ns / sizeof q32_ns[0]; ni++) {
                        const int64_t n = q32_ns[ni];
                        pd_error err = {0};
                        cr_assert_eq(pd_backend_matmul(be, &w, x, n, y, &err), PD_OK, "%s", err.msg);
                        for (int64_t k = 0; k < n * rows; k++)
                            cr_assert(fabs((double)y[k] - ref[k]) <= tol[k],
                                      "%s %s %lldx%lld n=%lld threads=%d: y[%lld][%lld] = %.9g, exact %.9g (tol %.3g)",
                                      simd_levels[l], pd_type_get(t)->name, (long long)rows, (long long)cols,
                                      (long long)n, th, (long long)(k / rows), (long long)(k % rows), (double)y[k],
                                      ref[k], tol[k]);
                    }
                    pd_backend_free(be);
                }
                free(data);
                free(x);
                free(wd);
                free(xq);
                free(ref);
                free(tol);
                free(y);
            }
        }
    }
    unsetenv("PD_CPU_GEMM_MIN_N");
}

Test(matmul, every_simd_level_matches_reference, .timeout = 300) {
    /* the scalar path (large n through dequantize + sgemm), and AVX2 when
     * the CPU has more */
    const char *levels[] = {"scalar", "avx2"};
    for (size_t l = 0; l < 2; l++) {
        if (l == 1 && !cpu_has("avx2")) continue;
        for (size_t i = 0; i < N_TYPES; i++) {
            const pd_type t = all_types[i];
            const int64_t cols = pd_type_get(t)->block_size == 256 ? 512 : 96;
            check_matmul(t, 19, cols, levels[l], 4000 + 10 * l + i);
        }
    }
}

Test(matmul, simd_agrees_with_scalar) {
    const char *levels[] = {"avx2", "avx512"};
    for (size_t l = 0; l < 2; l++) {
        if (!cpu_has(levels[l])) continue;
        /* both on the dot-product kernels (no sgemm), same int8 activations */
        setenv("PD_CPU_GEMM_MIN_N", "1000", 1);
        pd_backend *sc = make_backend(1, "scalar");
        pd_backend *sv = make_backend(2, levels[l]);
        unsetenv("PD_CPU_GEMM_MIN_N");
        for (size_t i = 0; i < N_TYPES; i++) {
            const pd_type t = all_types[i];
            const int64_t cols = pd_type_get(t)->block_size == 256 ? 768 : 608;
            const int64_t rows = 23, nmax = 7;
            uint64_t s = 5000 + i;
            pd_weight w;
            uint8_t *data = make_weights(&s, t, rows, cols, &w);
            float x[7 * 768], y0[7 * 23], y1[7 * 23];
            double ref[7 * 23], bound[7 * 23], rs[7 * 23];
            fill_acts(&s, x, nmax * cols);
            ref_matmul(&w, x, nmax, ref, bound, rs);
            const int64_t ns[] = {1, 3, 7};
            for (size_t ni = 0; ni < 3; ni++) {
                pd_error err = {0};
                cr_assert_eq(pd_backend_matmul(sc, &w, x, ns[ni], y0, &err), PD_OK, "%s", err.msg);
                cr_assert_eq(pd_backend_matmul(sv, &w, x, ns[ni], y1, &err), PD_OK, "%s", err.msg);
                for (int64_t k = 0; k < ns[ni] * rows; k++) {
                    const double tol = 1e-5 * rs[k] + 1e-30;
                    cr_assert(fabs((double)y0[k] - (double)y1[k]) <= tol,
                              "%s vs scalar, %s n=%lld: y[%lld] %.9g vs %.9g (tol %.3g)", levels[l],
                              pd_type_get(t)->name, (long long)ns[ni], (long long)k, (double)y1[k],
                              (double)y0[k], tol);
                }
            }
            free(data);
        }
        pd_backend_free(sc);
        pd_backend_free(sv);
    }
}

/* The automatic prefix cache is exact only if a token's product does not
 * depend on how many tokens share its call: a cache hit computes the rest
 * of the prompt in a smaller batch than the first request did. Every
 * quantized type on AVX2 and AVX-512, bit for bit, across decode (<= 8
 * tokens) and prefill batch sizes (AVX-512 q8_0: row kernel against 4x4
 * tiles, 19 blocks so the odd-block tail runs, 37 rows so partial tiles do). */
Test(matmul, quantized_types_give_a_token_the_same_bits_at_every_batch_size, .timeout = 300) {
    enum { ROWS = 37, N = 64 };
    const char *levels[] = {"avx2", "avx512"};
    if (!cpu_has("avx2")) cr_skip_test("this CPU has no avx2");
    for (size_t l = 0; l < 2; l++) {
        if (!cpu_has(levels[l])) continue;
        pd_backend *be = make_backend(2, levels[l]);
        for (size_t i = 0; i < N_TYPES; i++) {
            const pd_type t = all_types[i];
            if (!is_quant(t)) continue;
            const int64_t cols = pd_type_get(t)->block_size == 256 ? 512 : 608;
            uint64_t s = 7000 + i;
            pd_weight w;
            uint8_t *data = make_weights(&s, t, ROWS, cols, &w);
            float *x = malloc(sizeof(float) * N * (size_t)cols);
            float *all = malloc(sizeof(float) * N * ROWS), *part = malloc(sizeof(float) * N * ROWS);
            cr_assert(x && all && part);
            fill_acts(&s, x, N * cols);
            pd_error err = {0};
            cr_assert_eq(pd_backend_matmul(be, &w, x, N, all, &err), PD_OK, "%s", err.msg);
            const int64_t splits[] = {1, 3, 8, 12, 17, 48};
            for (size_t k = 0; k < sizeof splits / sizeof splits[0]; k++) {
                for (int64_t t0 = 0; t0 < N; t0 += splits[k]) {
                    const int64_t n = t0 + splits[k] <= N ? splits[k] : N - t0;
                    cr_assert_eq(pd_backend_matmul(be, &w, x + t0 * cols, n, part + t0 * ROWS, &err), PD_OK,
                                 "%s", err.msg);
                }
                for (int64_t e = 0; e < N * ROWS; e++)
                    cr_assert(memcmp(&all[e], &part[e], sizeof(float)) == 0,
                              "%s %s: token %lld row %lld is %.9g in one call of %d but %.9g in calls of %lld",
                              levels[l], pd_type_get(t)->name, (long long)(e / ROWS), (long long)(e % ROWS),
                              (double)all[e], N, (double)part[e], (long long)splits[k]);
            }
            free(x);
            free(all);
            free(part);
            free(data);
        }
        pd_backend_free(be);
    }
}

/* ------------------------------------------------------------------------
 * packed weights (PD_LAYOUT_CPU_X16)
 * ------------------------------------------------------------------------ */

/* The types the AVX-512 backend packs at load; the K-quants with x16
 * kernels are repacked per call for batches of CPU_X16_REPACK_MIN_N (16)
 * tokens and more. */
static const pd_type x16_types[] = {PD_TYPE_Q8_0};
#define N_X16_TYPES (sizeof x16_types / sizeof x16_types[0])
static const pd_type x16_repacked_types[] = {PD_TYPE_Q4_K, PD_TYPE_Q6_K};

/* A packed copy of w (made by an AVX-512 backend) in *pw; returns its bytes. */
static uint8_t *packed_copy(const pd_weight *w, pd_weight *pw) {
    const size_t bytes = (size_t)w->rows * w->row_bytes;
    uint8_t *data = malloc(bytes + 1);
    cr_assert_not_null(data);
    memcpy(data, w->data, bytes);
    *pw = *w;
    pw->data = data;
    pd_backend *be = make_backend(1, "avx512");
    pd_error err = {0};
    cr_assert_eq(pd_backend_pack_weight(be, pw, data, &err), PD_OK, "%s", err.msg);
    pd_backend_free(be);
    return data;
}

/* Whole groups of 16 rows, a tail of rows in the GGUF layout after them,
 * decode and prefill batches, 1 and 2 threads (chunks cut inside the
 * packed rows and across their end). */
Test(matmul, packed_weights_match_reference, .timeout = 120) {
    if (!cpu_has("avx512")) cr_skip_test("this CPU has no avx512vnni");
    static const int64_t ns[] = {1, 2, 3, 4, 5, 8, 9, 64};
    const int64_t shapes[][2] = {{16, 256}, {37, 768}, {64, 512}, {131, 256}};
    for (size_t i = 0; i < N_X16_TYPES; i++)
        for (size_t j = 0; j < sizeof shapes / sizeof shapes[0]; j++) {
            uint64_t s = 8100 + 10 * i + j;
            pd_weight w, pw;
            uint8_t *data = make_weights(&s, x16_types[i], shapes[j][0], shapes[j][1], &w);
            uint8_t *packed = packed_copy(&w, &pw);
            cr_assert_eq(pw.layout, PD_LAYOUT_CPU_X16, "%s is packed", pd_type_get(w.type)->name);
            cr_assert(memcmp(packed, data, (size_t)w.rows * w.row_bytes) != 0, "packing moved bytes");
            check_weight_as(&pw, &w, "avx512", &s, ns, sizeof ns / sizeof ns[0]);
            free(packed);
            free(data);
        }
}

/* Decode over a packed q8_0 weight big enough to be read as four
 * far-apart quarters side by side (plan_far, matmul.c: quarters of 256
 * rows, in pieces of 2 groups of 16 rows at 1 thread and 1 at 2) plus a
 * tail of groups and of rows: against the reference, and each token the
 * same bits alone, in pairs and in a prefill batch. */
Test(matmul, packed_q8_0_decode_over_far_apart_groups, .timeout = 120) {
    if (!cpu_has("avx512")) cr_skip_test("this CPU has no avx512vnni");
    enum { ROWS = 1043, COLS = 2048, N = 9 };
    static const int64_t ns[] = {1, 2, 3};
    uint64_t s = 8300;
    pd_weight w, pw;
    uint8_t *data = make_weights(&s, PD_TYPE_Q8_0, ROWS, COLS, &w);
    uint8_t *packed = packed_copy(&w, &pw);
    check_weight_as(&pw, &w, "avx512", &s, ns, sizeof ns / sizeof ns[0]);
    float *x = malloc(sizeof(float) * N * COLS), *all = malloc(sizeof(float) * N * ROWS),
          *part = malloc(sizeof(float) * N * ROWS);
    cr_assert(x && all && part);
    fill_acts(&s, x, N * COLS);
    for (int th = 1; th <= 2; th++) {
        pd_backend *be = make_backend(th, "avx512");
        pd_error err = {0};
        cr_assert_eq(pd_backend_matmul(be, &pw, x, N, all, &err), PD_OK, "%s", err.msg);
        for (int64_t split = 1; split <= 2; split++) {
            for (int64_t t0 = 0; t0 < N; t0 += split) {
                const int64_t n = t0 + split <= N ? split : N - t0;
                cr_assert_eq(pd_backend_matmul(be, &pw, x + t0 * COLS, n, part + t0 * ROWS, &err), PD_OK, "%s",
                             err.msg);
            }
            for (int64_t e = 0; e < N * ROWS; e++)
                cr_assert(memcmp(&all[e], &part[e], sizeof(float)) == 0,
                          "%d threads: token %lld row %lld is %.9g in a batch of %d but %.9g in calls of %lld", th,
                          (long long)(e / ROWS), (long long)(e % ROWS), (double)all[e], N, (double)part[e],
                          (long long)split);
        }
        pd_backend_free(be);
    }
    free(x), free(all), free(part);
    free(packed), free(data);
}

/* As for the GGUF layout: a token's product has the same bits whatever
 * its batch, and rows of a packed weight fused with others agree with the
 * weight alone; get_rows gives the rows the file has. */
Test(matmul, packed_weights_are_batch_invariant_and_fuse, .timeout = 120) {
    if (!cpu_has("avx512")) cr_skip_test("this CPU has no avx512vnni");
    enum { ROWS = 53, COLS = 512, N = 40 };
    pd_backend *be = make_backend(2, "avx512");
    for (size_t i = 0; i < N_X16_TYPES; i++) {
        uint64_t s = 8200 + i;
        pd_weight w, pw, other;
        uint8_t *data = make_weights(&s, x16_types[i], ROWS, COLS, &w);
        uint8_t *odata = make_weights(&s, PD_TYPE_Q8_0, 24, COLS, &other);
        uint8_t *packed = packed_copy(&w, &pw);
        float *x = malloc(sizeof(float) * N * COLS), *all = malloc(sizeof(float) * N * ROWS),
              *part = malloc(sizeof(float) * N * ROWS), *oy = malloc(sizeof(float) * N * 24),
              *fy = malloc(sizeof(float) * N * ROWS);
        cr_assert(x && all && part && oy && fy);
        fill_acts(&s, x, N * COLS);
        pd_error err = {0};
        cr_assert_eq(pd_backend_matmul(be, &pw, x, N, all, &err), PD_OK, "%s", err.msg);
        const int64_t splits[] = {1, 3, 4, 5, 17};
        for (size_t k = 0; k < sizeof splits / sizeof splits[0]; k++) {
            for (int64_t t0 = 0; t0 < N; t0 += splits[k]) {
                const int64_t n = t0 + splits[k] <= N ? splits[k] : N - t0;
                cr_assert_eq(pd_backend_matmul(be, &pw, x + t0 * COLS, n, part + t0 * ROWS, &err), PD_OK, "%s",
                             err.msg);
            }
            cr_assert(memcmp(all, part, sizeof(float) * N * ROWS) == 0, "%s packed: calls of %lld differ",
                      pd_type_get(w.type)->name, (long long)splits[k]);
        }
        const pd_weight *ws[] = {&other, &pw};
        float *const ys[] = {oy, fy};
        cr_assert_eq(pd_backend_matmul_multi(be, ws, 2, x, N, ys, &err), PD_OK, "%s", err.msg);
        cr_assert(memcmp(all, fy, sizeof(float) * N * ROWS) == 0, "fused with a q8_0 weight");
        const int32_t ids[] = {0, 15, 16, 47, 48, 52, 3};
        float got[7 * COLS], want[COLS];
        cr_assert_eq(pd_backend_get_rows(be, &pw, ids, 7, got, &err), PD_OK, "%s", err.msg);
        for (int k = 0; k < 7; k++) {
            cr_assert_eq(pd_dequantize_row(w.type, data + (size_t)ids[k] * w.row_bytes, want, COLS, &err), PD_OK);
            cr_assert(memcmp(got + k * COLS, want, sizeof want) == 0, "get_rows row %d", ids[k]);
        }
        free(x), free(all), free(part), free(oy), free(fy);
        free(packed), free(data), free(odata);
    }
    pd_backend_free(be);
}

/* q4_K and q6_K stay in the file's layout (the row kernels read it faster
 * from memory) and a batch of 16 tokens or more takes the x16 kernels on
 * groups repacked per call: against the reference, and the same bits as
 * the row kernels give a token alone (the automatic prefix cache needs
 * that), with 1 and 2 threads, tails of rows after the last group, and an
 * odd block count (768 columns). */
Test(matmul, prefill_batches_repack_k_quants_for_the_x16_kernels, .timeout = 120) {
    if (!cpu_has("avx512")) cr_skip_test("this CPU has no avx512vnni");
    enum { N = 40 };
    const int64_t shapes[][2] = {{16, 256}, {53, 768}, {131, 2048}};
    static const int64_t ns[] = {15, 16, 17, 40};
    for (int th = 1; th <= 2; th++) {
        pd_backend *be = make_backend(th, "avx512");
        for (size_t i = 0; i < 2; i++)
            for (size_t j = 0; j < 3; j++) {
                const int64_t rows = shapes[j][0], cols = shapes[j][1];
                uint64_t s = 8400 + 10 * i + j;
                pd_weight w;
                uint8_t *data = make_weights(&s, x16_repacked_types[i], rows, cols, &w);
                pd_error err = {0};
                cr_assert_eq(pd_backend_pack_weight(be, &w, data, &err), PD_OK, "%s", err.msg);
                cr_assert_eq(w.layout, PD_LAYOUT_GGUF, "%s stays in the file's layout", pd_type_get(w.type)->name);
                if (th == 1) check_weight_as(&w, &w, "avx512", &s, ns, sizeof ns / sizeof ns[0]);
                float *x = malloc(sizeof(float) * N * (size_t)cols), *all = malloc(sizeof(float) * N * (size_t)rows),
                      *one = malloc(sizeof(float) * (size_t)rows);
                cr_assert(x && all && one);
                fill_acts(&s, x, N * cols);
                cr_assert_eq(pd_backend_matmul(be, &w, x, N, all, &err), PD_OK, "%s", err.msg);
                for (int64_t t = 0; t < N; t++) {
                    cr_assert_eq(pd_backend_matmul(be, &w, x + t * cols, 1, one, &err), PD_OK, "%s", err.msg);
                    for (int64_t r = 0; r < rows; r++)
                        cr_assert(memcmp(&all[t * rows + r], &one[r], sizeof(float)) == 0,
                                  "%s %lldx%lld, %d threads: token %lld row %lld is %.9g in a batch of %d, %.9g alone",
                                  pd_type_get(w.type)->name, (long long)rows, (long long)cols, th, (long long)t,
                                  (long long)r, (double)all[t * rows + r], N, (double)one[r]);
                }
                free(x), free(all), free(one);
                free(data);
            }
        pd_backend_free(be);
    }
}

/* What is not packed stays as it was; a packed weight is refused, with the
 * fix named, by a backend without the kernels for it. */
Test(matmul, packing_rules_and_errors) {
    uint64_t s = 8300;
    pd_error err = {0};
    pd_backend *be = make_backend(1, NULL);
    pd_weight w;
    uint8_t *data = make_weights(&s, PD_TYPE_Q5_0, 32, 256, &w);
    cr_assert_eq(pd_backend_pack_weight(be, &w, data, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(w.layout, PD_LAYOUT_GGUF, "q5_0 has no packed layout");
    free(data);
    data = make_weights(&s, PD_TYPE_Q4_K, 15, 256, &w); /* fewer rows than a group */
    cr_assert_eq(pd_backend_pack_weight(be, &w, data, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(w.layout, PD_LAYOUT_GGUF);
    uint8_t other[1];
    cr_assert_eq(pd_backend_pack_weight(be, &w, other, &err), PD_EINVAL);
    free(data);
    pd_backend_free(be);
    if (!cpu_has("avx512")) return;
    data = make_weights(&s, PD_TYPE_Q8_0, 32, 256, &w);
    pd_weight pw;
    uint8_t *packed = packed_copy(&w, &pw);
    pd_backend *scalar = make_backend(1, "scalar");
    float x[256] = {0}, y[32];
    cr_assert_eq(pd_backend_matmul(scalar, &pw, x, 1, y, &err), PD_EUNSUPPORTED);
    cr_assert(strstr(err.msg, "packed") && strstr(err.msg, "backend that packed it"), "%s", err.msg);
    /* packing twice is a no-op, not a second shuffle */
    pd_backend *be512 = make_backend(1, "avx512");
    cr_assert_eq(pd_backend_pack_weight(be512, &pw, packed, &err), PD_OK, "%s", err.msg);
    float y1[32], y2[32];
    fill_acts(&s, x, 256);
    cr_assert_eq(pd_backend_matmul(be512, &pw, x, 1, y1, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_backend_matmul(be512, &w, x, 1, y2, &err), PD_OK, "%s", err.msg);
    for (int r = 0; r < 32; r++) cr_assert(fabsf(y1[r] - y2[r]) <= 1e-4f * (fabsf(y2[r]) + 1.0f), "row %d", r);
    pd_backend_free(be512);
    pd_backend_free(scalar);
    free(packed);
    free(data);
}

Test(matmul, padded_rows_and_empty_shapes) {
    /* row_bytes larger than a row: the stride is honoured */
    uint64_t s = 77;
    pd_weight w;
    uint8_t *data = make_weights(&s, PD_TYPE_Q8_0, 9, 64, &w);
    const size_t rb = w.row_bytes, stride = rb + 6;
    uint8_t *padded = calloc(9, stride);
    for (int r = 0; r < 9; r++) memcpy(padded + r * stride, data + r * rb, rb);
    pd_weight wp = w;
    wp.data = padded;
    wp.row_bytes = stride;
    float x[2 * 64], y0[2 * 9], y1[2 * 9];
    fill_acts(&s, x, 2 * 64);
    pd_backend *be = make_backend(2, NULL);
    pd_error err = {0};
    cr_assert_eq(pd_backend_matmul(be, &w, x, 2, y0, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_backend_matmul(be, &wp, x, 2, y1, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(memcmp(y0, y1, sizeof y0), 0);
    /* n = 0 and rows = 0 are no-ops; cols = 0 gives zeros */
    cr_assert_eq(pd_backend_matmul(be, &w, x, 0, y0, &err), PD_OK);
    pd_weight we;
    cr_assert_eq(pd_weight_init(&we, PD_TYPE_F32, x, 3, 0, &err), PD_OK, "%s", err.msg);
    y0[0] = y0[1] = y0[2] = 1.0f;
    cr_assert_eq(pd_backend_matmul(be, &we, x, 1, y0, &err), PD_OK, "%s", err.msg);
    cr_assert(y0[0] == 0.0f && y0[1] == 0.0f && y0[2] == 0.0f);
    pd_backend_free(be);
    free(padded);
    free(data);
}

Test(matmul, errors) {
    pd_backend *be = make_backend(1, NULL);
    pd_error err = {0};
    pd_weight w;
    float x[64] = {0}, y[4];
    uint8_t buf[4 * 40] = {0};
    /* a type the backend cannot multiply */
    cr_assert_eq(pd_weight_init(&w, PD_TYPE_Q8_1, buf, 2, 32, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_backend_matmul(be, &w, x, 1, y, &err), PD_EUNSUPPORTED);
    cr_assert(strstr(err.msg, "q8_1") != NULL, "message names the type: %s", err.msg);
    /* shape checks */
    cr_assert_eq(pd_weight_init(&w, PD_TYPE_Q8_0, buf, 2, 33, &err), PD_EFORMAT);
    cr_assert_eq(pd_weight_init(&w, PD_TYPE_F32, buf, -1, 4, &err), PD_EINVAL);
    cr_assert_eq(pd_weight_init(&w, PD_TYPE_F32, NULL, 2, 4, &err), PD_EINVAL);
    cr_assert_eq(pd_weight_init(&w, (pd_type)99, buf, 2, 4, &err), PD_EINVAL);
    cr_assert_eq(pd_weight_init(&w, PD_TYPE_Q8_0, buf, 2, 32, &err), PD_OK, "%s", err.msg);
    w.row_bytes = 10;
    cr_assert_eq(pd_backend_matmul(be, &w, x, 1, y, &err), PD_EINVAL);
    w.row_bytes = 34;
    cr_assert_eq(pd_backend_matmul(be, &w, x, -1, y, &err), PD_EINVAL);
    pd_backend_free(be);

    setenv("PD_CPU_SIMD", "sse9", 1);
    pd_backend *bad = NULL;
    cr_assert_eq(pd_backend_cpu_create(1, &bad, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "PD_CPU_SIMD") != NULL, "%s", err.msg);
    cr_assert_null(bad);
    setenv("PD_CPU_SIMD", "scalar", 1);
    cr_assert_str_eq(pd_cpu_simd_name(), "scalar");
    unsetenv("PD_CPU_SIMD");
}

/* ------------------------------------------------------------------------
 * get_rows
 * ------------------------------------------------------------------------ */

Test(get_rows, dequantizes_selected_rows_exactly) {
    pd_backend *be = make_backend(2, NULL);
    for (size_t i = 0; i < N_TYPES; i++) {
        const pd_type t = all_types[i];
        const int64_t cols = pd_type_get(t)->block_size == 256 ? 512 : 96, rows = 17;
        uint64_t s = 6000 + i;
        pd_weight w;
        uint8_t *data = make_weights(&s, t, rows, cols, &w);
        const int32_t ids[] = {0, 16, 3, 3, 9};
        float out[5 * 512], want[512];
        pd_error err = {0};
        cr_assert_eq(pd_backend_get_rows(be, &w, ids, 5, out, &err), PD_OK, "%s", err.msg);
        for (int k = 0; k < 5; k++) {
            cr_assert_eq(pd_dequantize_row(t, data + (size_t)ids[k] * w.row_bytes, want, (uint64_t)cols, &err),
                         PD_OK);
            cr_assert_eq(memcmp(out + k * cols, want, sizeof(float) * (size_t)cols), 0, "%s row %d",
                         pd_type_get(t)->name, ids[k]);
        }
        const int32_t bad[] = {1, 17};
        cr_assert_eq(pd_backend_get_rows(be, &w, bad, 2, out, &err), PD_ERANGE);
        const int32_t neg[] = {-1};
        cr_assert_eq(pd_backend_get_rows(be, &w, neg, 1, out, &err), PD_ERANGE);
        free(data);
    }
    pd_backend_free(be);
}

/* ------------------------------------------------------------------------
 * rmsnorm, swiglu
 * ------------------------------------------------------------------------ */

Test(rmsnorm, matches_formula_and_works_in_place) {
    const char *levels[] = {"scalar", "avx2", NULL};
    for (int l = 0; l < 3; l++) {
        if (l == 1 && !cpu_has("avx2")) continue;
        pd_backend *be = make_backend(2, levels[l]);
        const int64_t dims[] = {1, 7, 64, 576, 1000};
        const int64_t ns[] = {1, 3, 100};
        for (size_t di = 0; di < 5; di++)
            for (size_t ni = 0; ni < 3; ni++) {
                const int64_t dim = dims[di], n = ns[ni];
                uint64_t s = 7000 + di * 10 + ni;
                float *x = malloc(sizeof(float) * (size_t)(n * dim));
                float *wt = malloc(sizeof(float) * (size_t)dim);
                float *out = malloc(sizeof(float) * (size_t)(n * dim));
                for (int64_t i = 0; i < n * dim; i++) x[i] = rng_normal(&s) * 3.0f;
                for (int64_t i = 0; i < dim; i++) wt[i] = 1.0f + rng_uniform(&s);
                cr_assert_eq(pd_backend_rmsnorm(be, x, wt, n, dim, 1e-5f, out, NULL), PD_OK);
                for (int64_t r = 0; r < n; r++) {
                    double ss = 0;
                    for (int64_t i = 0; i < dim; i++) ss += (double)x[r * dim + i] * x[r * dim + i];
                    const double sc = 1.0 / sqrt(ss / (double)dim + 1e-5);
                    for (int64_t i = 0; i < dim; i++) {
                        const double want = x[r * dim + i] * sc * wt[i];
                        cr_assert(fabs(out[r * dim + i] - want) <= 1e-5 * fmax(1.0, fabs(want)),
                                  "dim %lld n %lld [%lld][%lld]: %.9g vs %.9g", (long long)dim, (long long)n,
                                  (long long)r, (long long)i, (double)out[r * dim + i], want);
                    }
                }
                cr_assert_eq(pd_backend_rmsnorm(be, x, wt, n, dim, 1e-5f, x, NULL), PD_OK); /* in place */
                cr_assert_eq(memcmp(x, out, sizeof(float) * (size_t)(n * dim)), 0);
                free(x);
                free(wt);
                free(out);
            }
        pd_backend_free(be);
    }
}

Test(swiglu, matches_formula_and_works_in_place) {
    const char *levels[] = {"scalar", "avx2", NULL};
    for (int l = 0; l < 3; l++) {
        if (l == 1 && !cpu_has("avx2")) continue;
        pd_backend *be = make_backend(2, levels[l]);
        const int64_t ns[] = {1, 15, 17, 1536, 70001};
        for (size_t ni = 0; ni < 5; ni++) {
            const int64_t n = ns[ni];
            uint64_t s = 8000 + ni;
            float *g = malloc(sizeof(float) * (size_t)n), *u = malloc(sizeof(float) * (size_t)n);
            float *out = malloc(sizeof(float) * (size_t)n);
            for (int64_t i = 0; i < n; i++) {
                g[i] = rng_normal(&s) * 4.0f;
                u[i] = rng_normal(&s);
            }
            if (n > 4) {
                g[0] = 100.0f; /* silu(x) = x for large x */
                g[1] = -100.0f; /* and 0 for very negative x */
                g[2] = 0.0f;
            }
            cr_assert_eq(pd_backend_swiglu(be, g, u, n, out, NULL), PD_OK);
            for (int64_t i = 0; i < n; i++) {
                const double x = g[i];
                const double want = x / (1.0 + exp(-x)) * u[i];
                cr_assert(fabs(out[i] - want) <= 1e-6 * fmax(1.0, fabs(want)) + 2e-6 * fabs(want) * fabs(x),
                          "n %lld [%lld]: silu(%g)*%g = %.9g, want %.9g", (long long)n, (long long)i, x,
                          (double)u[i], (double)out[i], want);
            }
            cr_assert_eq(pd_backend_swiglu(be, g, u, n, g, NULL), PD_OK); /* in place */
            cr_assert_eq(memcmp(g, out, sizeof(float) * (size_t)n), 0);
            free(g);
            free(u);
            free(out);
        }
        pd_backend_free(be);
    }
}

/* GeGLU (tanh GELU), soft-capping and scaling, against their formulas in
 * double; each also in place. */
Test(elementwise, geglu_softcap_scale_match_formulas) {
    pd_backend *be = make_backend(2, NULL);
    const int64_t ns[] = {1, 17, 1536, 70001};
    for (size_t ni = 0; ni < 4; ni++) {
        const int64_t n = ns[ni];
        uint64_t s = 8100 + ni;
        float *g = malloc(sizeof(float) * (size_t)n), *u = malloc(sizeof(float) * (size_t)n);
        float *out = malloc(sizeof(float) * (size_t)n), *x = malloc(sizeof(float) * (size_t)n);
        for (int64_t i = 0; i < n; i++) {
            g[i] = rng_normal(&s) * 4.0f;
            u[i] = rng_normal(&s);
        }
        if (n > 4) g[0] = 30.0f, g[1] = -30.0f, g[2] = 0.0f; /* gelu(x) = x, 0, 0 */
        cr_assert_eq(pd_backend_geglu(be, g, u, n, out, NULL), PD_OK);
        for (int64_t i = 0; i < n; i++) {
            const double a = g[i];
            const double want = 0.5 * a * (1.0 + tanh(sqrt(2.0 / M_PI) * (a + 0.044715 * a * a * a))) * u[i];
            cr_assert(fabs(out[i] - want) <= 2e-6 * fmax(1.0, fabs(want)) + 2e-6 * fabs(want) * fabs(a),
                      "n %lld [%lld]: gelu(%g)*%g = %.9g, want %.9g", (long long)n, (long long)i, a, (double)u[i],
                      (double)out[i], want);
        }
        cr_assert_eq(pd_backend_geglu(be, g, u, n, g, NULL), PD_OK); /* in place */
        cr_assert_eq(memcmp(g, out, sizeof(float) * (size_t)n), 0);

        for (int64_t i = 0; i < n; i++) x[i] = u[i] * 40.0f;
        memcpy(out, x, sizeof(float) * (size_t)n);
        cr_assert_eq(pd_backend_softcap(be, out, n, 30.0f, NULL), PD_OK);
        for (int64_t i = 0; i < n; i++) {
            const double want = 30.0 * tanh(x[i] / 30.0);
            cr_assert(fabs(out[i] - want) <= 4e-6 * fmax(1.0, fabs(want)), "softcap(%g) = %.9g, want %.9g",
                      (double)x[i], (double)out[i], want);
        }
        memcpy(out, x, sizeof(float) * (size_t)n);
        cr_assert_eq(pd_backend_scale(be, out, n, 0.375f, NULL), PD_OK);
        for (int64_t i = 0; i < n; i++) cr_assert_eq(out[i], x[i] * 0.375f);
        free(g), free(u), free(out), free(x);
    }
    pd_error err = {0};
    float y = 1.0f;
    cr_expect_eq(pd_backend_softcap(be, &y, 1, 0.0f, &err), PD_EINVAL, "a cap of 0 is refused");
    pd_backend_free(be);
}

/* ------------------------------------------------------------------------
 * rope
 * ------------------------------------------------------------------------ */

static void rope_ref(float *x, const int32_t *pos, int64_t n, int nh, int hd, const pd_rope_params *p) {
    const int half = p->n_rot / 2;
    for (int64_t t = 0; t < n; t++)
        for (int h = 0; h < nh; h++) {
            float *v = x + (t * nh + h) * hd;
            for (int i = 0; i < half; i++) {
                double th = (double)pos[t] * pow((double)p->freq_base, -2.0 * i / p->n_rot);
                if (p->freq_factors) th /= (double)p->freq_factors[i];
                const int a = p->mode == PD_ROPE_NEOX ? i : 2 * i;
                const int b = p->mode == PD_ROPE_NEOX ? i + half : 2 * i + 1;
                const double x0 = v[a], x1 = v[b];
                v[a] = (float)(x0 * cos(th) - x1 * sin(th));
                v[b] = (float)(x0 * sin(th) + x1 * cos(th));
            }
        }
}

Test(rope, both_modes_match_formula) {
    pd_backend *be = make_backend(2, NULL);
    const pd_rope_mode modes[] = {PD_ROPE_NORM, PD_ROPE_NEOX};
    const int hds[] = {64, 128, 10};
    const int rots[] = {64, 32, 6};
    float ff[64];
    for (int i = 0; i < 64; i++) ff[i] = 1.0f + (float)i * 0.25f;
    for (int mi = 0; mi < 2; mi++)
        for (int hi = 0; hi < 3; hi++)
            for (int f = 0; f < 2; f++) {
                const int hd = hds[hi], nh = 3;
                const int64_t n = 300;
                pd_rope_params p = {modes[mi], rots[hi], 10000.0f, f ? ff : NULL};
                uint64_t s = 9000 + mi * 100 + hi * 10 + f;
                float *x = malloc(sizeof(float) * (size_t)(n * nh * hd));
                float *want = malloc(sizeof(float) * (size_t)(n * nh * hd));
                int32_t *pos = malloc(sizeof(int32_t) * (size_t)n);
                for (int64_t i = 0; i < n * nh * hd; i++) x[i] = rng_normal(&s);
                for (int64_t t = 0; t < n; t++) pos[t] = (int32_t)(t * 37 % 8191); /* gaps, any order */
                memcpy(want, x, sizeof(float) * (size_t)(n * nh * hd));
                rope_ref(want, pos, n, nh, hd, &p);
                cr_assert_eq(pd_backend_rope(be, x, pos, n, nh, hd, &p, NULL), PD_OK);
                for (int64_t i = 0; i < n * nh * hd; i++) {
                    const int d = (int)(i % hd);
                    if (d >= p.n_rot)
                        cr_assert_eq(x[i], want[i], "unrotated dim %d changed", d);
                    else
                        cr_assert(fabsf(x[i] - want[i]) <= 2e-6f * (1.0f + fabsf(want[i])),
                                  "mode %d hd %d n_rot %d ff %d: [%lld] %.9g vs %.9g", (int)modes[mi], hd, p.n_rot,
                                  f, (long long)i, (double)x[i], (double)want[i]);
                }
                free(x);
                free(want);
                free(pos);
            }
    pd_backend_free(be);
}

Test(rope, position_zero_is_identity) {
    pd_backend *be = make_backend(1, NULL);
    uint64_t s = 9500;
    float x[4 * 2 * 64], orig[4 * 2 * 64];
    for (int i = 0; i < 4 * 2 * 64; i++) orig[i] = x[i] = rng_normal(&s);
    const int32_t pos[4] = {0, 0, 0, 0};
    for (int m = 0; m < 2; m++) {
        pd_rope_params p = {m ? PD_ROPE_NEOX : PD_ROPE_NORM, 64, 500000.0f, NULL};
        cr_assert_eq(pd_backend_rope(be, x, pos, 4, 2, 64, &p, NULL), PD_OK);
        cr_assert_eq(memcmp(x, orig, sizeof x), 0);
    }
    pd_backend_free(be);
}

/* ------------------------------------------------------------------------
 * attention
 * ------------------------------------------------------------------------ */

typedef struct attn_case {
    int n_head, n_head_kv, head_dim, n_seg;
    int64_t n_tokens;
    int64_t seg_len[PD_MAX_KV_SEGMENTS];
    bool causal, masks;
    float scale;
    int32_t window; /* 0: none */
    float softcap;  /* 0: none */
} attn_case;

/* Element i of a view's K or V rows, whatever its type. */
static double kv_at(const pd_kv_view *kv, const void *rows, int64_t i) {
    return kv->type == PD_TYPE_F16 ? (double)pd_fp16_to_fp32(((const uint16_t *)rows)[i])
                                   : (double)((const float *)rows)[i];
}

/* Naive reference: softmax over the concatenation of all visible keys, in
 * double, over the values the views hold (f16 rows widened exactly). */
static void attn_ref(const pd_attn_args *a, double *out) {
    const int hd = a->head_dim;
    for (int64_t t = 0; t < a->n_tokens; t++)
        for (int h = 0; h < a->n_head; h++) {
            const int g = h / (a->n_head / a->n_head_kv);
            const float *q = a->q + (t * a->n_head + h) * hd;
            double *o = out + (t * a->n_head + h) * hd;
            double m = -INFINITY;
            for (int pass = 0; pass < 2; pass++) {
                double l = 0;
                if (pass == 1)
                    for (int d = 0; d < hd; d++) o[d] = 0;
                for (int s = 0; s < a->n_segments; s++) {
                    const pd_kv_view *kv = &a->kv[s * a->n_head_kv + g];
                    for (int64_t j = 0; j < kv->len; j++) {
                        if (kv->keep && !kv->keep[j]) continue;
                        if (a->causal && kv->pos[j] > a->q_pos[t]) continue;
                        if (a->window > 0 && (int64_t)a->q_pos[t] - kv->pos[j] >= a->window) continue;
                        double sc = 0;
                        for (int d = 0; d < hd; d++) sc += (double)q[d] * kv_at(kv, kv->k, j * hd + d);
                        sc *= a->scale;
                        if (a->softcap > 0) sc = a->softcap * tanh(sc / a->softcap);
                        if (pass == 0) {
                            if (sc > m) m = sc;
                        } else {
                            const double p = exp(sc - m);
                            l += p;
                            for (int d = 0; d < hd; d++) o[d] += p * kv_at(kv, kv->v, j * hd + d);
                        }
                    }
                }
                if (pass == 1)
                    for (int d = 0; d < hd; d++) o[d] = l > 0 ? o[d] / l : 0.0;
                if (pass == 0 && m == -INFINITY) {
                    for (int d = 0; d < hd; d++) o[d] = 0;
                    break;
                }
            }
        }
}

/* How far attention over f16-rounded K/V may be from attention over the
 * f32 rows, for one query (every K/V element in [-1, 1), as the tests draw
 * them). Rounding to f16 changes an element x by at most u |x|, u = 2^-11.
 * A score scale * q.k then moves by at most e = scale * u * sum_d |q_d|, so
 * every softmax weight changes by a factor within [e^-2e, e^2e] (its own
 * score and the normaliser), which moves a weighted mean of values in
 * [-1, 1] by at most 2 (e^2e - 1); the values' own rounding adds u. Plus
 * 1e-5 for float summation. */
static double attn_f16_bound(const float *q, int hd, float scale) {
    const double u = 0x1p-11;
    double l1 = 0;
    for (int d = 0; d < hd; d++) l1 += fabs((double)q[d]);
    const double e = fabs((double)scale) * u * l1;
    return 2.0 * expm1(2.0 * e) + u + 1e-5;
}

/* With kv_type f16 the kernel reads f16 copies of the rows: it must match
 * the reference over those copies as closely as f32 rows match theirs, and
 * the reference over the original f32 rows within what the rounding of K
 * and V allows (attn_f16_bound). */
static void run_attn_case(const attn_case *c, uint64_t seed, int threads, const char *simd, pd_type kv_type) {
    uint64_t s = seed;
    const int hd = c->head_dim;
    const int64_t nq = c->n_tokens * c->n_head * hd;
    float *q = malloc(sizeof(float) * (size_t)nq);
    float *out = malloc(sizeof(float) * (size_t)nq);
    double *want = malloc(sizeof(double) * (size_t)nq);
    double *want32 = malloc(sizeof(double) * (size_t)nq);
    int32_t *qpos = malloc(sizeof(int32_t) * (size_t)c->n_tokens);
    pd_kv_view kv[PD_MAX_KV_SEGMENTS * 8], kv32[PD_MAX_KV_SEGMENTS * 8];
    cr_assert(c->n_head_kv <= 8);
    for (int64_t i = 0; i < nq; i++) q[i] = rng_uniform(&s);
    /* positions: segment s holds keys at increasing positions with gaps;
     * the queries come after the first segment, in the middle of the rest */
    int32_t next_pos = 0;
    for (int sg = 0; sg < c->n_seg; sg++) {
        const int32_t start = next_pos;
        for (int g = 0; g < c->n_head_kv; g++) {
            pd_kv_view *v = &kv[sg * c->n_head_kv + g];
            const int64_t len = c->seg_len[sg] + g; /* kv heads differ in length */
            float *k = malloc(sizeof(float) * (size_t)(len * hd + 1));
            float *vv = malloc(sizeof(float) * (size_t)(len * hd + 1));
            int32_t *pos = malloc(sizeof(int32_t) * (size_t)(len + 1));
            uint8_t *keep = c->masks ? malloc((size_t)len + 1) : NULL;
            for (int64_t j = 0; j < len * hd; j++) {
                k[j] = rng_uniform(&s);
                vv[j] = rng_uniform(&s);
            }
            int32_t p = start;
            for (int64_t j = 0; j < len; j++) {
                p += 1 + (int32_t)(rng_next(&s) % 3); /* gaps */
                pos[j] = p;
                if (keep) keep[j] = (uint8_t)(rng_next(&s) % 4 != 0);
            }
            if (p > next_pos) next_pos = p;
            v->k = k;
            v->v = vv;
            v->pos = pos;
            v->keep = keep;
            v->len = len;
            v->type = PD_TYPE_F32;
            kv32[sg * c->n_head_kv + g] = *v;
            if (kv_type == PD_TYPE_F16) {
                uint16_t *k16 = malloc(2 * (size_t)(len * hd + 1)), *v16 = malloc(2 * (size_t)(len * hd + 1));
                pd_fp32_to_fp16_row(k, k16, (size_t)(len * hd));
                pd_fp32_to_fp16_row(vv, v16, (size_t)(len * hd));
                v->k = k16;
                v->v = v16;
                v->type = PD_TYPE_F16;
            }
        }
    }
    for (int64_t t = 0; t < c->n_tokens; t++) {
        /* spread from before every key (sees nothing under causal) to after all */
        qpos[t] = (int32_t)(t * (next_pos + 2) / (c->n_tokens > 1 ? c->n_tokens - 1 : 1)) - 1;
    }
    pd_attn_args a = {.q = q,
                      .q_pos = qpos,
                      .n_tokens = c->n_tokens,
                      .n_head = c->n_head,
                      .n_head_kv = c->n_head_kv,
                      .head_dim = hd,
                      .n_segments = c->n_seg,
                      .kv = kv,
                      .scale = c->scale,
                      .causal = c->causal,
                      .window = c->window,
                      .softcap = c->softcap,
                      .out = out};
    attn_ref(&a, want);
    pd_attn_args a32 = a;
    a32.kv = kv32;
    attn_ref(&a32, want32);
    pd_backend *be = make_backend(threads, simd);
    pd_error err = {0};
    for (int64_t i = 0; i < nq; i++) out[i] = NAN;
    cr_assert_eq(pd_backend_attention(be, &a, &err), PD_OK, "%s", err.msg);
    const char *tn = kv_type == PD_TYPE_F16 ? "f16" : "f32";
    for (int64_t i = 0; i < nq; i++)
        cr_assert(fabs((double)out[i] - want[i]) <= 1e-5,
                  "%s KV, %s threads %d heads %d/%d hd %d segs %d causal %d masks %d window %d softcap %g: "
                  "out[%lld] %.9g vs %.9g",
                  tn, simd ? simd : "auto", threads, c->n_head, c->n_head_kv, hd, c->n_seg, c->causal, c->masks,
                  (int)c->window, (double)c->softcap, (long long)i, (double)out[i], want[i]);
    if (kv_type == PD_TYPE_F16)
        for (int64_t t = 0; t < c->n_tokens; t++)
            for (int h = 0; h < c->n_head; h++) {
                const int64_t row = (t * c->n_head + h) * hd;
                const double bound = attn_f16_bound(q + row, hd, c->scale);
                for (int d = 0; d < hd; d++)
                    cr_assert(fabs((double)out[row + d] - want32[row + d]) <= bound,
                              "f16 KV vs f32 reference, %s threads %d hd %d scale %g: out[%lld] %.9g vs %.9g "
                              "(bound %.3g)",
                              simd ? simd : "auto", threads, hd, (double)c->scale, (long long)(row + d),
                              (double)out[row + d], want32[row + d], bound);
            }
    /* under causal the first query sits before every key: all zeros */
    if (c->causal)
        for (int64_t i = 0; i < c->n_head * hd; i++) cr_assert_eq(out[i], 0.0f, "query with no key");
    pd_backend_free(be);
    for (int i = 0; i < c->n_seg * c->n_head_kv; i++) {
        if (kv[i].k != kv32[i].k) free((void *)kv[i].k), free((void *)kv[i].v);
        free((void *)kv32[i].k);
        free((void *)kv32[i].v);
        free((void *)kv[i].pos);
        free((void *)kv[i].keep);
    }
    free(q);
    free(out);
    free(want);
    free(want32);
    free(qpos);
}

Test(attention, matches_naive_reference, .timeout = 120) {
    const attn_case cases[] = {
        /* heads, kv heads, hd, segs, tokens, lengths, causal, masks, scale */
        {4, 4, 64, 1, 5, {40}, false, false, 0.125f, 0, 0.0f},
        {9, 3, 64, 1, 7, {300}, true, false, 0.125f, 0, 0.0f},        /* GQA, several key blocks */
        {6, 2, 64, 2, 9, {200, 33}, true, true, 0.125f, 0, 0.0f},     /* two segments with masks */
        {8, 2, 20, 3, 6, {17, 150, 5}, true, true, 0.3f, 0, 0.0f},    /* odd head_dim, three segments */
        {4, 1, 128, 3, 4, {0, 64, 129}, false, true, 0.09f, 0, 0.0f}, /* an empty segment */
        {2, 2, 8, 2, 3, {3, 2}, true, false, 1.0f, 0, 0.0f},
        {4, 2, 64, 1, 3, {400}, false, false, 4.0f, 0, 0.0f}, /* large scores: the max moves across blocks */
        /* decode over a long cache: the keys are split across threads */
        {9, 3, 64, 2, 1, {2000, 1000}, false, true, 0.125f, 0, 0.0f},
        {9, 3, 64, 2, 2, {1900, 1100}, true, false, 0.125f, 0, 0.0f},
        {4, 1, 64, 2, 1, {2500, 600}, false, false, 2.0f, 0, 0.0f},
        /* sliding windows over positions with gaps, soft-capped scores */
        {6, 2, 64, 2, 9, {200, 33}, true, true, 0.125f, 40, 0.0f},
        {4, 2, 32, 1, 7, {300}, false, false, 0.5f, 25, 0.0f},     /* a window without causality */
        {4, 4, 64, 1, 5, {130}, true, false, 4.0f, 0, 3.0f},       /* scores far past the cap */
        {8, 2, 16, 3, 6, {17, 150, 5}, true, true, 1.0f, 9, 2.5f}, /* both */
        {9, 3, 64, 2, 1, {2000, 1000}, true, false, 0.125f, 700, 0.0f}, /* split keys, most outside */
        {4, 1, 64, 2, 2, {2500, 600}, true, true, 2.0f, 1500, 30.0f},
    };
    const char *levels[] = {"scalar", "avx2", NULL};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++)
        for (int l = 0; l < 3; l++) {
            if (l == 1 && !cpu_has("avx2")) continue;
            for (int th = 1; th <= 3; th++) {
                run_attn_case(&cases[ci], 10000 + ci, th, levels[l], PD_TYPE_F32);
                run_attn_case(&cases[ci], 10000 + ci, th, levels[l], PD_TYPE_F16);
            }
        }
}

Test(attention, masked_and_future_keys_are_never_read) {
    /* keys that are masked out hold NaN: the result must not see them */
    pd_backend *be = make_backend(2, NULL);
    const int hd = 16;
    float k[4 * 16], v[4 * 16], q[16], out[16];
    uint16_t k16[4 * 16], v16[4 * 16];
    for (int i = 0; i < 4 * hd; i++) k[i] = v[i] = (float)(i % 7) * 0.1f;
    for (int d = 0; d < hd; d++) {
        k[1 * hd + d] = v[1 * hd + d] = NAN; /* keep = 0 */
        k[3 * hd + d] = v[3 * hd + d] = NAN; /* future */
        q[d] = 0.5f;
    }
    pd_fp32_to_fp16_row(k, k16, 4 * (size_t)hd);
    pd_fp32_to_fp16_row(v, v16, 4 * (size_t)hd);
    const int32_t pos[4] = {0, 1, 2, 9};
    const uint8_t keep[4] = {1, 0, 1, 1};
    const int32_t qpos = 5;
    pd_kv_view kv = {k, v, pos, keep, 4, PD_TYPE_F32};
    pd_attn_args a = {.q = q, .q_pos = &qpos, .n_tokens = 1, .n_head = 1, .n_head_kv = 1, .head_dim = hd,
                      .n_segments = 1, .kv = &kv, .scale = 0.25f, .causal = true, .out = out};
    pd_error err = {0};
    cr_assert_eq(pd_backend_attention(be, &a, &err), PD_OK, "%s", err.msg);
    for (int d = 0; d < hd; d++) cr_assert(isfinite(out[d]), "out[%d] = %g", d, (double)out[d]);
    pd_kv_view kv16 = {k16, v16, pos, keep, 4, PD_TYPE_F16};
    a.kv = &kv16;
    cr_assert_eq(pd_backend_attention(be, &a, &err), PD_OK, "%s", err.msg);
    for (int d = 0; d < hd; d++) cr_assert(isfinite(out[d]), "f16: out[%d] = %g", d, (double)out[d]);
    /* only f32 and f16 rows */
    kv16.type = PD_TYPE_BF16;
    cr_assert_eq(pd_backend_attention(be, &a, &err), PD_EUNSUPPORTED);
    cr_assert(strstr(err.msg, "f32 or f16"), "%s", err.msg);
    a.kv = &kv;
    /* bad shapes */
    a.n_head = 3;
    a.n_head_kv = 2;
    cr_assert_eq(pd_backend_attention(be, &a, &err), PD_EINVAL);
    a.n_head = 1;
    a.n_head_kv = 1;
    a.n_segments = PD_MAX_KV_SEGMENTS + 1;
    cr_assert_eq(pd_backend_attention(be, &a, &err), PD_EINVAL);
    pd_backend_free(be);
}

/* Batched attention (groups over a shared segment) equals attending each
 * group on its own over [shared, own]: the decode path of a batch of
 * sequences that continue one compressed prefix. */
static void groups_over_shared(pd_type shared_type) {
    pd_backend *be = make_backend(3, NULL);
    uint64_t s = 77;
    enum { HD = 32, NH = 4, NKV = 2, NG = 3, SHARED = 700 };
    const int64_t own_len[NG] = {5, 0, 40}, tokens[NG] = {1, 2, 1};
    int64_t starts[NG + 1] = {0};
    for (int g = 0; g < NG; g++) starts[g + 1] = starts[g] + tokens[g];
    const int64_t T = starts[NG];
    float q[4 * NH * HD], out[4 * NH * HD], want[4 * NH * HD];
    int32_t qpos[4];
    for (int i = 0; i < T * NH * HD; i++) q[i] = rng_uniform(&s);
    float *sk = malloc(sizeof(float) * SHARED * HD * NKV), *sv = malloc(sizeof(float) * SHARED * HD * NKV);
    int32_t *spos = malloc(sizeof(int32_t) * SHARED);
    for (int i = 0; i < SHARED * HD * NKV; i++) sk[i] = rng_uniform(&s), sv[i] = rng_uniform(&s);
    for (int j = 0; j < SHARED; j++) spos[j] = 2 * j; /* a compressed prefix: gaps */
    pd_kv_view shared[NKV], own[NG * NKV];
    float *ok[NG], *ov[NG];
    int32_t *opos[NG];
    for (int g = 0; g < NG; g++) {
        ok[g] = malloc(sizeof(float) * (size_t)(own_len[g] * HD * NKV + 1));
        ov[g] = malloc(sizeof(float) * (size_t)(own_len[g] * HD * NKV + 1));
        opos[g] = malloc(sizeof(int32_t) * (size_t)(own_len[g] + 1));
        for (int64_t i = 0; i < own_len[g] * HD * NKV; i++) ok[g][i] = rng_uniform(&s), ov[g][i] = rng_uniform(&s);
        for (int64_t j = 0; j < own_len[g]; j++) opos[g][j] = 2 * SHARED + (int32_t)j;
        for (int64_t t = starts[g]; t < starts[g + 1]; t++)
            qpos[t] = 2 * SHARED + (int32_t)own_len[g] - 1 + (int32_t)(t - starts[g]); /* sees all but its own future */
        for (int h = 0; h < NKV; h++)
            own[g * NKV + h] = (pd_kv_view){ok[g] + own_len[g] * HD * h, ov[g] + own_len[g] * HD * h, opos[g], NULL,
                                            own_len[g], PD_TYPE_F32};
    }
    for (int h = 0; h < NKV; h++)
        shared[h] = (pd_kv_view){sk + SHARED * HD * h, sv + SHARED * HD * h, spos, NULL, SHARED, PD_TYPE_F32};
    uint16_t *sk16 = malloc(2 * SHARED * HD * NKV), *sv16 = malloc(2 * SHARED * HD * NKV);
    if (shared_type == PD_TYPE_F16) { /* an f16 prefix shared by sequences with f32 rows of their own */
        pd_fp32_to_fp16_row(sk, sk16, SHARED * HD * NKV);
        pd_fp32_to_fp16_row(sv, sv16, SHARED * HD * NKV);
        for (int h = 0; h < NKV; h++)
            shared[h] = (pd_kv_view){sk16 + SHARED * HD * h, sv16 + SHARED * HD * h, spos, NULL, SHARED, PD_TYPE_F16};
    }
    pd_error err = {0};
    for (int g = 0; g < NG; g++) {
        pd_kv_view segs[2 * NKV];
        memcpy(segs, shared, sizeof shared);
        memcpy(segs + NKV, own + g * NKV, sizeof(pd_kv_view) * NKV);
        pd_attn_args one = {.q = q + starts[g] * NH * HD, .q_pos = qpos + starts[g], .n_tokens = tokens[g],
                            .n_head = NH, .n_head_kv = NKV, .head_dim = HD, .n_segments = 2, .kv = segs,
                            .scale = 0.2f, .causal = true, .out = want + starts[g] * NH * HD};
        cr_assert_eq(pd_backend_attention(be, &one, &err), PD_OK, "%s", err.msg);
    }
    pd_attn_args all = {.q = q, .q_pos = qpos, .n_tokens = T, .n_head = NH, .n_head_kv = NKV, .head_dim = HD,
                        .n_segments = 1, .kv = own, .n_shared = 1, .shared = shared, .n_groups = NG,
                        .group_start = starts, .scale = 0.2f, .causal = true, .out = out};
    cr_assert_eq(pd_backend_attention(be, &all, &err), PD_OK, "%s", err.msg);
    /* the same arithmetic in the same order: equal bits */
    for (int64_t i = 0; i < T * NH * HD; i++) cr_assert_eq(out[i], want[i], "out[%lld]", (long long)i);
    /* groups must cover the tokens */
    starts[NG] = T + 1;
    cr_assert_eq(pd_backend_attention(be, &all, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "groups cover"), "%s", err.msg);
    starts[NG] = T;
    all.n_segments = PD_MAX_KV_SEGMENTS;
    cr_assert_eq(pd_backend_attention(be, &all, &err), PD_EINVAL);
    for (int g = 0; g < NG; g++) free(ok[g]), free(ov[g]), free(opos[g]);
    free(sk), free(sv), free(spos), free(sk16), free(sv16);
    pd_backend_free(be);
}

Test(attention, groups_over_a_shared_segment_match_one_call_per_group) { groups_over_shared(PD_TYPE_F32); }
Test(attention, groups_over_an_f16_shared_segment_match_one_call_per_group) { groups_over_shared(PD_TYPE_F16); }

/* f32 <-> f16 conversion: every SIMD level's kernels (through the backend's
 * convert op) and the row helpers give pd_fp32_to_fp16's bits, for
 * ordinary values, ties, subnormals, overflow, infinities and NaNs, at
 * lengths that leave vector tails. */
Test(attention, f16_conversions_match_the_reference_bit_for_bit) {
    enum { N = 4099 };
    float *x = malloc(sizeof(float) * N), *back = malloc(sizeof(float) * N), *ref_back = malloc(sizeof(float) * N);
    uint16_t *h = malloc(2 * N), *ref = malloc(2 * N);
    uint64_t s = 5;
    for (int i = 0; i < N; i++) {
        const int kind = i % 8;
        float v = rng_uniform(&s);
        if (kind == 1) v *= 70000.0f;                  /* some overflow to inf */
        if (kind == 2) v *= 1e-6f;                     /* f16 subnormals */
        if (kind == 3) v = ldexpf(1.0f + (float)(i % 1024) / 1024.0f + 0x1p-11f, (i % 30) - 15); /* ties */
        if (kind == 4) v *= 1e-9f;                     /* underflow to zero */
        if (i == 5) v = INFINITY;
        if (i == 13) v = -INFINITY;
        if (i == 21) v = NAN;
        x[i] = v;
        ref[i] = pd_fp32_to_fp16(v);
    }
    for (int i = 0; i < N; i++) ref_back[i] = pd_fp16_to_fp32(ref[i]);
    const char *levels[] = {"scalar", "avx2", NULL};
    for (int l = 0; l < 3; l++) {
        if (l == 1 && !cpu_has("avx2")) continue;
        for (int th = 1; th <= 2; th++) {
            pd_backend *be = make_backend(th, levels[l]);
            pd_error err = {0};
            for (int n = N; n >= N - 17; n -= 17) { /* tails of every length mod 16 */
                memset(h, 0xab, 2 * N);
                cr_assert_eq(pd_backend_convert(be, h, PD_TYPE_F16, x, PD_TYPE_F32, n, &err), PD_OK, "%s", err.msg);
                for (int i = 0; i < n; i++)
                    cr_assert_eq(h[i], ref[i], "%s: f16(%a) is %#x, the reference %#x", levels[l] ? levels[l] : "auto",
                                 (double)x[i], h[i], ref[i]);
                for (int i = n; i < N; i++) cr_assert_eq(h[i], 0xabab, "wrote past n");
                cr_assert_eq(pd_backend_convert(be, back, PD_TYPE_F32, ref, PD_TYPE_F16, n, &err), PD_OK, "%s", err.msg);
                cr_assert(memcmp(back, ref_back, sizeof(float) * (size_t)n) == 0, "f16 -> f32 differs");
            }
            cr_assert_eq(pd_backend_convert(be, h, PD_TYPE_BF16, x, PD_TYPE_F32, 4, &err), PD_EUNSUPPORTED);
            pd_backend_free(be);
        }
    }
    pd_fp32_to_fp16_row(x, h, N);
    cr_assert(memcmp(h, ref, 2 * N) == 0, "pd_fp32_to_fp16_row differs from pd_fp32_to_fp16");
    pd_fp16_to_fp32_row(ref, back, N);
    cr_assert(memcmp(back, ref_back, sizeof(float) * N) == 0, "pd_fp16_to_fp32_row differs from pd_fp16_to_fp32");
    free(x), free(back), free(ref_back), free(h), free(ref);
}

/* The memory half of the contract on a host backend. */
Test(backend_memory, copies_gather_and_add) {
    pd_backend *be = make_backend(1, NULL);
    pd_error err = {0};
    cr_assert(pd_backend_host_memory(be));
    float *a = pd_backend_alloc(be, 64 * sizeof(float), &err), *b = pd_backend_alloc(be, 64 * sizeof(float), &err);
    cr_assert(a && b, "%s", err.msg);
    cr_assert_eq((uintptr_t)a % 256, 0);
    float src[64];
    for (int i = 0; i < 64; i++) src[i] = (float)i;
    cr_assert_eq(pd_backend_upload(be, a, src, sizeof src, &err), PD_OK);
    /* [4 rows][2 heads][8] -> head 1's rows contiguous, via copy2d_batch */
    pd_copy2d d[2] = {{b, a + 8, 8 * sizeof(float), 16 * sizeof(float), 8 * sizeof(float), 4},
                      {b + 32, a, 8 * sizeof(float), 16 * sizeof(float), 8 * sizeof(float), 4}};
    cr_assert_eq(pd_backend_copy2d_batch(be, d, 2, &err), PD_OK);
    for (int r = 0; r < 4; r++)
        for (int i = 0; i < 8; i++) {
            cr_assert_eq(b[r * 8 + i], (float)(r * 16 + 8 + i));
            cr_assert_eq(b[32 + r * 8 + i], (float)(r * 16 + i));
        }
    const int32_t idx[3] = {3, 0, 3};
    cr_assert_eq(pd_backend_gather(be, b, a, idx, 3, 4 * sizeof(float), &err), PD_OK);
    for (int i = 0; i < 4; i++) {
        cr_assert_eq(b[i], (float)(12 + i));
        cr_assert_eq(b[4 + i], (float)i);
        cr_assert_eq(b[8 + i], (float)(12 + i));
    }
    const int32_t bad[1] = {-1};
    cr_assert_eq(pd_backend_gather(be, b, a, bad, 1, 4, &err), PD_EINVAL);
    /* bias (stride 0) and element-wise */
    float y[6] = {1, 2, 3, 4, 5, 6}, bias[3] = {10, 20, 30}, x[6] = {1, 1, 1, 2, 2, 2};
    cr_assert_eq(pd_backend_add(be, y, bias, 2, 3, 0, &err), PD_OK);
    cr_assert_eq(pd_backend_add(be, y, x, 2, 3, 3, &err), PD_OK);
    const float want[6] = {12, 23, 34, 16, 27, 38};
    for (int i = 0; i < 6; i++) cr_assert_eq(y[i], want[i]);
    cr_assert_eq(pd_backend_add(be, y, x, 2, 3, 2, &err), PD_EINVAL);
    float back[64];
    cr_assert_eq(pd_backend_download(be, back, a, sizeof back, &err), PD_OK);
    cr_assert_eq(memcmp(back, src, sizeof src), 0);
    cr_assert_eq(pd_backend_sync(be, &err), PD_OK);
    pd_backend_release(be, a);
    pd_backend_release(be, b);
    pd_backend_release(be, NULL);
    pd_backend_free(be);
}
