/* CPU/GPU parity: the CUDA backend against the CPU backend, which defines
 * the semantics of every op (kernels/kernels.h). Ops one by one on random
 * data, attention in its prefill / batched / decode shapes, whole models
 * (the real stories260K and a generated qwen2), compressed prefixes, and the
 * error path for a missing device.
 *
 * Every test skips where there is no CUDA device, so the suite passes (as
 * skips) on CPU-only machines and checks the GPU wherever one exists.
 *
 * Tolerances: each check says why its bound is what it is. The CUDA backend
 * rounds weights and activations to bf16 for tensor core GEMMs (batches
 * above 8 tokens); everything else is f32 arithmetic that differs from the
 * CPU only in summation order (tests/test_cuda_quant.c checks each
 * quantized type more closely). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "helpers.h"
#include "kernels/kernels.h"
#include "policies/policies.h"
#include "tools/tools.h"

/* Built twice: as test_cuda_parity against CUDA device 0 (skipping without
 * one), and as test_engine_discrete with PD_PARITY_DISCRETE_CPU, where the
 * "device" is the CPU backend in discrete-memory mode. That second build
 * runs everywhere (CI has no GPU): it checks the engine's device paths
 * (uploads, batched K/V appends, prefix upload, hook copies) and these
 * tests themselves, with the CPU's arithmetic on both sides. */
#ifdef PD_PARITY_DISCRETE_CPU
#define REQUIRE_CUDA() ((void)0)
static int device_backend_create(pd_backend **out, pd_error *err) { return pd_backend_cpu_discrete_create(2, out, err); }
#else
#define REQUIRE_CUDA()                                                                                         \
    do {                                                                                                       \
        if (pd_cuda_device_count() == 0)                                                                       \
            cr_skip_test("no CUDA device: CPU/GPU parity not checked (compiled in: %s)",                       \
                         pd_cuda_compiled() ? "yes" : "no");                                                   \
    } while (0)
static int device_backend_create(pd_backend **out, pd_error *err) { return pd_backend_cuda_create(0, out, err); }
#endif

/* Unit roundoff (2^-p for p significant bits) of f32 (p = 24) and bf16 (p = 8). */
#define F32_U 0x1p-24
#define BF16_U 0x1p-8

/* ------------------------------------------------------------------------
 * Random data (seeded, the same on every machine)
 * ------------------------------------------------------------------------ */

typedef struct rng {
    uint64_t s;
} rng;

static double rng_unit(rng *r) { return (double)(pd_splitmix64(&r->s) >> 11) * 0x1p-53; }
/* Uniform in [-a, a). */
static float rng_sym(rng *r, float a) { return (float)((2.0 * rng_unit(r) - 1.0) * a); }
/* Approximately N(0, 1): sum of 12 uniforms. */
static float rng_normal(rng *r) {
    double s = 0;
    for (int i = 0; i < 12; i++) s += rng_unit(r);
    return (float)(s - 6.0);
}
static int64_t rng_below(rng *r, int64_t n) { return (int64_t)(pd_splitmix64(&r->s) % (uint64_t)n); }

static void fill_sym(float *x, int64_t n, float a, uint64_t seed) {
    rng r = {seed};
    for (int64_t i = 0; i < n; i++) x[i] = rng_sym(&r, a);
}

static void fill_normal(float *x, int64_t n, float scale, uint64_t seed) {
    rng r = {seed};
    for (int64_t i = 0; i < n; i++) x[i] = rng_normal(&r) * scale;
}

static void *xmalloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    cr_assert_not_null(p, "out of memory (%zu bytes)", bytes);
    return p;
}

/* ------------------------------------------------------------------------
 * Backends and backend memory
 *
 * Every op runs through the same helpers on both backends (alloc, upload,
 * op, download), so the CPU path exercises its memory ops too and the two
 * results come back as host arrays.
 * ------------------------------------------------------------------------ */

typedef struct backends {
    pd_backend *cpu, *gpu;
} backends;

static backends open_backends(void) {
    backends b = {0};
    pd_error err = {0};
    cr_assert_eq(pd_backend_cpu_create(2, &b.cpu, &err), PD_OK, "cpu backend: %s", err.msg);
    cr_assert_eq(device_backend_create(&b.gpu, &err), PD_OK, "device backend: %s", err.msg);
    cr_assert(pd_backend_host_memory(b.cpu));
    cr_assert(!pd_backend_host_memory(b.gpu), "the CUDA backend must not claim host memory");
    return b;
}

static void close_backends(backends *b) {
    pd_backend_free(b->gpu);
    pd_backend_free(b->cpu);
    b->gpu = b->cpu = NULL;
}

static void *be_alloc(pd_backend *be, size_t bytes) {
    pd_error err = {0};
    void *p = pd_backend_alloc(be, bytes ? bytes : 1, &err);
    cr_assert_not_null(p, "%s: alloc(%zu): %s", pd_backend_name(be), bytes, err.msg);
    return p;
}

static void be_release(pd_backend *be, const void *p) { pd_backend_release(be, (void *)p); }

/* Backend copy of `bytes` of host memory. */
static void *be_put(pd_backend *be, const void *host, size_t bytes) {
    void *p = be_alloc(be, bytes);
    if (bytes) {
        pd_error err = {0};
        cr_assert_eq(pd_backend_upload(be, p, host, bytes, &err), PD_OK, "%s: upload(%zu): %s", pd_backend_name(be),
                     bytes, err.msg);
    }
    return p;
}

static void be_get(pd_backend *be, void *host, const void *src, size_t bytes) {
    pd_error err = {0};
    cr_assert_eq(pd_backend_download(be, host, src, bytes, &err), PD_OK, "%s: download(%zu): %s", pd_backend_name(be),
                 bytes, err.msg);
}

static void be_ok(pd_backend *be, int rc, const pd_error *err, const char *what) {
    cr_assert_eq(rc, PD_OK, "%s on %s: %s", what, pd_backend_name(be), err->msg);
}

/* ------------------------------------------------------------------------
 * matmul
 * ------------------------------------------------------------------------ */

/* A weight with its encoded rows and the same rows dequantized to f32. The
 * CUDA backend caches its copy of a weight by host data pointer, so the
 * encoded rows must outlive the backend (freeing them first could let a
 * later weight reuse the address and hit a stale copy). */
typedef struct host_weight {
    pd_weight w;
    void *data;
    float *deq; /* [rows][cols] */
} host_weight;

static host_weight make_weight(pd_type t, int64_t rows, int64_t cols, uint64_t seed) {
    host_weight hw = {0};
    pd_error err = {0};
    uint64_t rb;
    cr_assert_eq(pd_type_row_size(t, (uint64_t)cols, &rb, &err), PD_OK, "%s", err.msg);
    float *vals = xmalloc(sizeof(float) * (size_t)(rows * cols));
    rng r = {seed};
    /* Rows of different magnitude, so per-block scales vary. */
    for (int64_t i = 0; i < rows; i++) {
        const float row_scale = 0.1f + 2.0f * (float)rng_unit(&r);
        for (int64_t j = 0; j < cols; j++) vals[i * cols + j] = rng_sym(&r, row_scale);
    }
    hw.data = xmalloc((size_t)rb * (size_t)rows);
    hw.deq = xmalloc(sizeof(float) * (size_t)(rows * cols));
    for (int64_t i = 0; i < rows; i++) {
        uint8_t *row = (uint8_t *)hw.data + (size_t)i * rb;
        cr_assert_eq(pd_quantize_row(t, vals + i * cols, row, (uint64_t)cols, &err), PD_OK, "%s", err.msg);
        cr_assert_eq(pd_dequantize_row(t, row, hw.deq + i * cols, (uint64_t)cols, &err), PD_OK, "%s", err.msg);
    }
    free(vals);
    cr_assert_eq(pd_weight_init(&hw.w, t, hw.data, rows, cols, &err), PD_OK, "%s", err.msg);
    return hw;
}

static void free_weight(host_weight *hw) {
    free(hw->data);
    free(hw->deq);
}

static void run_matmul(pd_backend *be, const pd_weight *w, const float *x, int64_t n, float *y) {
    pd_error err = {0};
    const size_t xb = sizeof(float) * (size_t)(n * w->cols), yb = sizeof(float) * (size_t)(n * w->rows);
    float *dx = be_put(be, x, xb);
    float *dy = be_alloc(be, yb);
    be_ok(be, pd_backend_matmul(be, w, dx, n, dy, &err), &err, "matmul");
    be_get(be, y, dy, yb);
    be_release(be, dx);
    be_release(be, dy);
}

/* Block length over which the CPU quantizes x for a quantized weight type
 * (kernels.h: per 32 for q8_0/q4_0/q4_1/q5_0/q5_1/iq4_nl, per 256 for the
 * k-quants). */
static int64_t cpu_x_block(pd_type t) {
    switch (t) {
    case PD_TYPE_Q8_0:
    case PD_TYPE_Q4_0:
    case PD_TYPE_Q4_1:
    case PD_TYPE_Q5_0:
    case PD_TYPE_Q5_1:
    case PD_TYPE_IQ4_NL: return 32;
    case PD_TYPE_Q4_K:
    case PD_TYPE_Q6_K: return PD_QK_K;
    default: return 0; /* float types: x is used as it is */
    }
}

/* The weight is returned in *keep, for the caller to free once the
 * backends are gone (see host_weight). */
static void check_matmul(backends *b, pd_type t, int64_t rows, int64_t cols, float x_scale, uint64_t seed,
                         host_weight *keep) {
    static const int64_t batch[] = {1, 4, 33, 300};
    const char *tname = pd_type_get((uint32_t)t)->name;
    host_weight hw = make_weight(t, rows, cols, seed);
    *keep = hw;
    for (size_t bi = 0; bi < sizeof batch / sizeof batch[0]; bi++) {
        const int64_t n = batch[bi];
        float *x = xmalloc(sizeof(float) * (size_t)(n * cols));
        float *yc = xmalloc(sizeof(float) * (size_t)(n * rows));
        float *yg = xmalloc(sizeof(float) * (size_t)(n * rows));
        fill_normal(x, n * cols, x_scale, seed * 131 + (uint64_t)n);
        run_matmul(b->cpu, &hw.w, x, n, yc);
        run_matmul(b->gpu, &hw.w, x, n, yg);

        /* Tolerances, per output y[i][r] with S = sum_k |W[r,k] x[i,k]|:
         * - GPU: weights are exact (f32/f16/bf16) or bf16 roundings of the
         *   dequantized values, and x is rounded to bf16 for batches above
         *   8: at most two bf16 roundings per product, relative error
         *   <= 2 * 2^-9 = 2^-8 each, so |gpu - exact| <= 2^-8 S plus f32
         *   accumulation (cols * 2^-24 S, far smaller). We allow 2^-7 S.
         * - CPU: float types accumulate in f32 (cols * 2^-24 S); quantized
         *   types multiply by x quantized to int8 per block (scale
         *   amax/127), adding at most sum_k |W[r,k]| amax(block of k) / 254
         *   (kernels.h). The two bounds add for |gpu - cpu|. */
        const int64_t xblk = cpu_x_block(t);
        double worst_ref = 0, worst_cpu = 0;
        int64_t wi = 0, wr = 0;
        for (int64_t i = 0; i < n; i++) {
            const float *xi = x + i * cols;
            for (int64_t r = 0; r < rows; r++) {
                const float *wrow = hw.deq + r * cols;
                double exact = 0, abs_sum = 0, quant_err = 0;
                for (int64_t k = 0; k < cols; k++) {
                    exact += (double)wrow[k] * xi[k];
                    abs_sum += fabs((double)wrow[k] * xi[k]);
                }
                if (xblk) {
                    for (int64_t k0 = 0; k0 < cols; k0 += xblk) {
                        double amax = 0, wsum = 0;
                        for (int64_t k = k0; k < k0 + xblk && k < cols; k++) {
                            amax = fmax(amax, fabs((double)xi[k]));
                            wsum += fabs((double)wrow[k]);
                        }
                        quant_err += wsum * amax / 254.0;
                    }
                }
                const double gpu_tol = abs_sum * 0x1p-7 + 1e-30;
                const double cpu_tol = abs_sum * (double)cols * F32_U + quant_err;
                const double g = yg[i * rows + r], c = yc[i * rows + r];
                const double e_ref = fabs(g - exact) / gpu_tol;
                const double e_cpu = fabs(g - c) / (gpu_tol + cpu_tol);
                if (!(e_ref <= worst_ref)) {
                    worst_ref = isnan(e_ref) ? INFINITY : e_ref;
                    wi = i;
                    wr = r;
                }
                if (!(e_cpu <= worst_cpu)) worst_cpu = isnan(e_cpu) ? INFINITY : e_cpu;
            }
        }
        cr_assert_leq(worst_ref, 1.0,
                      "matmul %s %lldx%lld n=%lld: GPU y[%lld][%lld] = %g is %.3g tolerances from the exact product "
                      "of the dequantized weights",
                      tname, (long long)rows, (long long)cols, (long long)n, (long long)wi, (long long)wr,
                      (double)yg[wi * rows + wr], worst_ref);
        cr_assert_leq(worst_cpu, 1.0,
                      "matmul %s %lldx%lld n=%lld: GPU and CPU differ by %.3g times the sum of their error bounds",
                      tname, (long long)rows, (long long)cols, (long long)n, worst_cpu);
        free(x);
        free(yc);
        free(yg);
    }
}

Test(cuda_parity, matmul_every_type_and_batch_size) {
    REQUIRE_CUDA();
    backends b = open_backends();
    static const pd_type types[] = {PD_TYPE_F32,  PD_TYPE_F16,  PD_TYPE_BF16, PD_TYPE_Q8_0,
                                    PD_TYPE_Q4_K, PD_TYPE_Q5_1, PD_TYPE_IQ4_NL};
    /* 157 rows: not a multiple of any warp or tile size; 768 columns: three
     * k-quant super-blocks. */
    host_weight keep[16];
    int n_keep = 0;
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        check_matmul(&b, types[i], 157, 768, 1.0f, 11 + i, &keep[n_keep++]);
    /* Float weights with a row length that is not a multiple of 8 elements
     * (vector loads must handle the tail). */
    static const pd_type float_types[] = {PD_TYPE_F32, PD_TYPE_F16, PD_TYPE_BF16};
    for (size_t i = 0; i < sizeof float_types / sizeof float_types[0]; i++)
        check_matmul(&b, float_types[i], 33, 100, 1.0f, 41 + i, &keep[n_keep++]);
    /* Activations far above f16's largest value (65504; |x| up to ~2e6
     * here): the GPU's f16 GEMM path must not overflow them (it scales each
     * token's row by a power of two), and the 16-bit types stay within the
     * same relative bounds. */
    static const pd_type half_types[] = {PD_TYPE_F16, PD_TYPE_BF16};
    for (size_t i = 0; i < sizeof half_types / sizeof half_types[0]; i++)
        check_matmul(&b, half_types[i], 64, 256, 3e5f, 61 + i, &keep[n_keep++]);
    close_backends(&b);
    for (int i = 0; i < n_keep; i++) free_weight(&keep[i]);
}

/* ------------------------------------------------------------------------
 * get_rows
 * ------------------------------------------------------------------------ */

#ifndef PD_PARITY_DISCRETE_CPU
/* A weight the CPU backend packed (pd_backend_pack_weight, AVX-512) is not
 * in the file's layout: the device refuses it by name instead of
 * uploading bytes it would misread. */
Test(cuda_parity, a_weight_packed_for_the_cpu_is_refused) {
    REQUIRE_CUDA();
    backends b = open_backends();
    host_weight hw = make_weight(PD_TYPE_Q8_0, 32, 256, 77);
    pd_error err = {0};
    cr_assert_eq(pd_backend_pack_weight(b.cpu, &hw.w, hw.data, &err), PD_OK, "%s", err.msg);
    if (hw.w.layout == PD_LAYOUT_GGUF) {
        free_weight(&hw);
        close_backends(&b);
        cr_skip_test("this CPU does not pack q8_0 (no AVX-512 VNNI)");
    }
    cr_assert_eq(pd_backend_prepare_weight(b.gpu, &hw.w, &err), PD_EUNSUPPORTED);
    cr_assert(strstr(err.msg, "packed for the CPU") != NULL, "%s", err.msg);
    pd_backend_forget_weight(b.gpu, &hw.w);
    free_weight(&hw);
    close_backends(&b);
}
#endif

Test(cuda_parity, get_rows_every_type) {
    REQUIRE_CUDA();
    backends b = open_backends();
    static const pd_type types[] = {PD_TYPE_F32,  PD_TYPE_F16,  PD_TYPE_BF16, PD_TYPE_Q8_0,  PD_TYPE_Q4_0,  PD_TYPE_Q4_1,
                                    PD_TYPE_Q5_0, PD_TYPE_Q5_1, PD_TYPE_IQ4_NL, PD_TYPE_Q4_K, PD_TYPE_Q6_K};
    enum { N_TYPES = sizeof types / sizeof types[0] };
    static const int32_t ids[] = {0, 49, 7, 7, 23, 1, 48, 0, 31};
    const int64_t n = sizeof ids / sizeof ids[0], rows = 50, cols = 512;
    host_weight hw[N_TYPES];
    for (int t = 0; t < N_TYPES; t++) {
        const char *tname = pd_type_get((uint32_t)types[t])->name;
        hw[t] = make_weight(types[t], rows, cols, 300 + (uint64_t)t);
        const size_t ob = sizeof(float) * (size_t)(n * cols);
        float *oc = xmalloc(ob), *og = xmalloc(ob);
        pd_backend *bes[2] = {b.cpu, b.gpu};
        float *outs[2] = {oc, og};
        for (int k = 0; k < 2; k++) {
            pd_error err = {0};
            float *d = be_alloc(bes[k], ob);
            be_ok(bes[k], pd_backend_get_rows(bes[k], &hw[t].w, ids, n, d, &err), &err, "get_rows");
            be_get(bes[k], outs[k], d, ob);
            be_release(bes[k], d);
        }
        /* f32/f16/bf16 rows are kept as stored on the GPU and widen to f32
         * exactly: bit-identical. Quantized rows are dequantized on the
         * device like the reference dequantizer (bit-identical to it,
         * tests/test_cuda_quant.c); the bound allows one bf16 rounding (2^-9
         * relative) and a few f32 ulps where the CPU's SIMD dequantizer
         * rounds differently from the reference one. */
        const bool exact = types[t] == PD_TYPE_F32 || types[t] == PD_TYPE_F16 || types[t] == PD_TYPE_BF16;
        for (int64_t i = 0; i < n * cols; i++) {
            const double tol = exact ? 0.0 : fabs((double)oc[i]) * (BF16_U + 16 * F32_U);
            cr_assert_leq(fabs((double)og[i] - oc[i]), tol,
                          "get_rows %s: row %d (index %lld) element %lld: GPU %g, CPU %g", tname, ids[i / cols],
                          (long long)(i / cols), (long long)(i % cols), (double)og[i], (double)oc[i]);
        }
        free(oc);
        free(og);
    }
    close_backends(&b);
    for (int t = 0; t < N_TYPES; t++) free_weight(&hw[t]);
}

/* ------------------------------------------------------------------------
 * rmsnorm, rope, swiglu, add
 * ------------------------------------------------------------------------ */

static void run_rmsnorm(pd_backend *be, const float *x, const float *w, int64_t n, int64_t dim, float eps,
                        bool in_place, float *out) {
    pd_error err = {0};
    const size_t xb = sizeof(float) * (size_t)(n * dim);
    float *dx = be_put(be, x, xb);
    float *dw = be_put(be, w, sizeof(float) * (size_t)dim);
    float *dout = in_place ? dx : be_alloc(be, xb);
    be_ok(be, pd_backend_rmsnorm(be, dx, dw, n, dim, eps, dout, &err), &err, "rmsnorm");
    be_get(be, out, dout, xb);
    if (!in_place) be_release(be, dout);
    be_release(be, dx);
    be_release(be, dw);
}

Test(cuda_parity, rmsnorm) {
    REQUIRE_CUDA();
    backends b = open_backends();
    static const int64_t dims[] = {64, 576, 4096, 1000};
    for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
        const int64_t dim = dims[di], n = 37;
        float *x = xmalloc(sizeof(float) * (size_t)(n * dim));
        float *w = xmalloc(sizeof(float) * (size_t)dim);
        float *oc = xmalloc(sizeof(float) * (size_t)(n * dim));
        float *og = xmalloc(sizeof(float) * (size_t)(n * dim));
        fill_sym(x, n * dim, 2.0f, 500 + (uint64_t)dim);
        for (int64_t j = 0; j < dim; j++) x[3 * dim + j] *= 1e-3f; /* a row where eps matters */
        fill_sym(w, dim, 1.5f, 600 + (uint64_t)dim);
        for (int in_place = 0; in_place < 2; in_place++) {
            run_rmsnorm(b.cpu, x, w, n, dim, 1e-5f, in_place, oc);
            run_rmsnorm(b.gpu, x, w, n, dim, 1e-5f, in_place, og);
            /* Each backend sums dim squares in f32 in its own order
             * (relative error <= (dim - 1) 2^-24 in the worst case), halves
             * it through the square root and rounds a few more times: per
             * backend (dim / 2 + 4) 2^-24 of |out|; the two add. */
            const double rel = (double)(dim + 8) * F32_U;
            for (int64_t i = 0; i < n * dim; i++)
                cr_assert_leq(fabs((double)og[i] - oc[i]), rel * fabs((double)oc[i]) + 1e-30,
                              "rmsnorm dim %lld%s: row %lld col %lld: GPU %.9g, CPU %.9g", (long long)dim,
                              in_place ? " (in place)" : "", (long long)(i / dim), (long long)(i % dim),
                              (double)og[i], (double)oc[i]);
        }
        free(x);
        free(w);
        free(oc);
        free(og);
    }
    close_backends(&b);
}

static void run_rope(pd_backend *be, const float *x, const int32_t *pos, int64_t n, int n_heads, int head_dim,
                     const pd_rope_params *p, float *out) {
    pd_error err = {0};
    const size_t xb = sizeof(float) * (size_t)(n * n_heads * head_dim);
    float *dx = be_put(be, x, xb);
    int32_t *dp = be_put(be, pos, sizeof(int32_t) * (size_t)n);
    be_ok(be, pd_backend_rope(be, dx, dp, n, n_heads, head_dim, p, &err), &err, "rope");
    be_get(be, out, dx, xb);
    be_release(be, dx);
    be_release(be, dp);
}

Test(cuda_parity, rope_both_modes_and_freq_factors) {
    REQUIRE_CUDA();
    backends b = open_backends();
    const int64_t n = 19;
    const int n_heads = 6;
    int32_t pos[19];
    rng r = {77};
    for (int64_t i = 0; i < n; i++) pos[i] = (int32_t)rng_below(&r, 40000);
    pos[0] = 0;
    pos[1] = 131071; /* the far end of a long context */
    float factors[PD_ROPE_MAX_FACTORS];
    for (int i = 0; i < PD_ROPE_MAX_FACTORS; i++) factors[i] = 1.0f + 7.0f * (float)rng_unit(&r);

    static const int head_dims[] = {64, 128};
    for (size_t hi = 0; hi < sizeof head_dims / sizeof head_dims[0]; hi++) {
        const int hd = head_dims[hi];
        const int64_t len = n * n_heads * hd;
        float *x = xmalloc(sizeof(float) * (size_t)len);
        float *oc = xmalloc(sizeof(float) * (size_t)len), *og = xmalloc(sizeof(float) * (size_t)len);
        fill_sym(x, len, 1.0f, 900 + (uint64_t)hd);
        for (int mode = 0; mode < 2; mode++)
            for (int partial = 0; partial < 2; partial++)
                for (int ff = 0; ff < 2; ff++) {
                    const pd_rope_params p = {.mode = mode ? PD_ROPE_NEOX : PD_ROPE_NORM,
                                              .n_rot = partial ? hd / 2 : hd,
                                              .freq_base = ff ? 500000.0f : 10000.0f,
                                              .freq_factors = ff ? factors : NULL};
                    run_rope(b.cpu, x, pos, n, n_heads, hd, &p, oc);
                    run_rope(b.gpu, x, pos, n, n_heads, hd, &p, og);
                    /* Both backends compute theta in double, reduce it to
                     * [-pi, pi] in double and take a float sin/cos (<= 2
                     * ulp), so each output (|x0| + |x1| <= 2) agrees to a
                     * few 1e-7. A theta computed in float would be off by
                     * pos * 2^-24 rad (~1e-2 at 131071): 1e-5 catches it. */
                    for (int64_t i = 0; i < len; i++)
                        cr_assert_leq(fabs((double)og[i] - oc[i]), 1e-5,
                                      "rope %s n_rot %d%s head_dim %d: token %lld (pos %d) head %lld dim %lld: "
                                      "GPU %.8g, CPU %.8g",
                                      mode ? "neox" : "norm", p.n_rot, ff ? " freq_factors" : "", hd,
                                      (long long)(i / (n_heads * hd)), pos[i / (n_heads * hd)],
                                      (long long)(i / hd % n_heads), (long long)(i % hd), (double)og[i],
                                      (double)oc[i]);
                }
        free(x);
        free(oc);
        free(og);
    }
    close_backends(&b);
}

static void run_swiglu(pd_backend *be, const float *g, const float *u, int64_t n, bool in_place, float *out) {
    pd_error err = {0};
    const size_t bytes = sizeof(float) * (size_t)n;
    float *dg = be_put(be, g, bytes), *du = be_put(be, u, bytes);
    float *dout = in_place ? dg : be_alloc(be, bytes);
    be_ok(be, pd_backend_swiglu(be, dg, du, n, dout, &err), &err, "swiglu");
    be_get(be, out, dout, bytes);
    if (!in_place) be_release(be, dout);
    be_release(be, dg);
    be_release(be, du);
}

Test(cuda_parity, swiglu) {
    REQUIRE_CUDA();
    backends b = open_backends();
    const int64_t n = 100003; /* odd: vector tails */
    float *g = xmalloc(sizeof(float) * n), *u = xmalloc(sizeof(float) * n);
    float *oc = xmalloc(sizeof(float) * n), *og = xmalloc(sizeof(float) * n);
    fill_sym(g, n, 12.0f, 1001);
    fill_sym(u, n, 3.0f, 1002);
    for (int in_place = 0; in_place < 2; in_place++) {
        run_swiglu(b.cpu, g, u, n, in_place, oc);
        run_swiglu(b.gpu, g, u, n, in_place, og);
        /* silu(g) * u = g / (1 + e^-g) * u: an exp (the CPU's SIMD
         * polynomial and CUDA's expf are both within ~2 ulp), an add, a
         * division and two products: a handful of ulps each side; 4e-6
         * relative (~32 ulp) leaves margin without hiding a wrong formula. */
        for (int64_t i = 0; i < n; i++)
            cr_assert_leq(fabs((double)og[i] - oc[i]), 4e-6 * fabs((double)oc[i]) + 1e-30,
                          "swiglu%s: g %g u %g: GPU %.9g, CPU %.9g", in_place ? " (in place)" : "", (double)g[i],
                          (double)u[i], (double)og[i], (double)oc[i]);
    }
    free(g);
    free(u);
    free(oc);
    free(og);
    close_backends(&b);
}

/* GeGLU, soft-capping and scaling. tanhf on each side is within a few ulps;
 * the same margin as swiglu's. */
Test(cuda_parity, geglu_softcap_scale) {
    REQUIRE_CUDA();
    backends b = open_backends();
    const int64_t n = 100003;
    const size_t bytes = sizeof(float) * (size_t)n;
    float *g = xmalloc(bytes), *u = xmalloc(bytes), *oc = xmalloc(bytes), *og = xmalloc(bytes);
    fill_sym(g, n, 12.0f, 1101);
    fill_sym(u, n, 3.0f, 1102);
    pd_backend *bes[2] = {b.cpu, b.gpu};
    for (int op = 0; op < 3; op++) {
        for (int i = 0; i < 2; i++) {
            pd_backend *be = bes[i];
            pd_error err = {0};
            float *dg = be_put(be, g, bytes), *du = be_put(be, u, bytes);
            if (op == 0) be_ok(be, pd_backend_geglu(be, dg, du, n, dg, &err), &err, "geglu");
            if (op == 1) be_ok(be, pd_backend_softcap(be, dg, n, 5.0f, &err), &err, "softcap");
            if (op == 2) be_ok(be, pd_backend_scale(be, dg, n, 0.3f, &err), &err, "scale");
            be_get(be, i ? og : oc, dg, bytes);
            be_release(be, dg);
            be_release(be, du);
        }
        static const char *const names[] = {"geglu", "softcap", "scale"};
        for (int64_t i = 0; i < n; i++)
            cr_assert_leq(fabs((double)og[i] - oc[i]), 4e-6 * fabs((double)oc[i]) + 1e-30,
                          "%s: g %g u %g: GPU %.9g, CPU %.9g", names[op], (double)g[i], (double)u[i], (double)og[i],
                          (double)oc[i]);
    }
    free(g), free(u), free(oc), free(og);
    close_backends(&b);
}

Test(cuda_parity, add_bias_and_elementwise) {
    REQUIRE_CUDA();
    backends b = open_backends();
    const int64_t rows = 7, width = 1001;
    float *y = xmalloc(sizeof(float) * (size_t)(rows * width));
    float *x = xmalloc(sizeof(float) * (size_t)(rows * width));
    float *oc = xmalloc(sizeof(float) * (size_t)(rows * width)), *og = xmalloc(sizeof(float) * (size_t)(rows * width));
    fill_sym(y, rows * width, 5.0f, 1100);
    fill_sym(x, rows * width, 5.0f, 1101);
    for (int bias = 0; bias < 2; bias++) {
        const int64_t stride = bias ? 0 : width;
        pd_backend *bes[2] = {b.cpu, b.gpu};
        float *outs[2] = {oc, og};
        for (int k = 0; k < 2; k++) {
            pd_error err = {0};
            float *dy = be_put(bes[k], y, sizeof(float) * (size_t)(rows * width));
            float *dx = be_put(bes[k], x, sizeof(float) * (size_t)((bias ? 1 : rows) * width));
            be_ok(bes[k], pd_backend_add(bes[k], dy, dx, rows, width, stride, &err), &err, "add");
            be_get(bes[k], outs[k], dy, sizeof(float) * (size_t)(rows * width));
            be_release(bes[k], dy);
            be_release(bes[k], dx);
        }
        /* One correctly rounded f32 addition per element on both sides:
         * bit-identical. */
        for (int64_t i = 0; i < rows * width; i++) {
            const float want = y[i] + x[bias ? i % width : i];
            cr_assert(oc[i] == want && og[i] == want, "add (%s) element %lld: CPU %.9g, GPU %.9g, expected %.9g",
                      bias ? "bias" : "element-wise", (long long)i, (double)oc[i], (double)og[i], (double)want);
        }
    }
    free(y);
    free(x);
    free(oc);
    free(og);
    close_backends(&b);
}

/* ------------------------------------------------------------------------
 * Memory ops: copy2d, gather, upload/download round trip
 * ------------------------------------------------------------------------ */

static uint8_t pattern_byte(size_t i, unsigned salt) { return (uint8_t)(pd_mix64(i * 2654435761u + salt) >> 56); }

Test(cuda_parity, copy2d_copy2d_batch_and_gather) {
    REQUIRE_CUDA();
    backends b = open_backends();
    pd_backend *bes[2] = {b.cpu, b.gpu};

    /* copy2d: 50 rows of 203 bytes, source rows 300 apart, destination rows
     * 256 apart; the destination's gaps must keep their old bytes. */
    const size_t rows = 50, width = 203, spitch = 300, dpitch = 256;
    uint8_t *src = xmalloc(rows * spitch), *dst0 = xmalloc(rows * dpitch), *want = xmalloc(rows * dpitch);
    uint8_t *got = xmalloc(rows * dpitch);
    for (size_t i = 0; i < rows * spitch; i++) src[i] = pattern_byte(i, 1);
    for (size_t i = 0; i < rows * dpitch; i++) dst0[i] = pattern_byte(i, 2);
    memcpy(want, dst0, rows * dpitch);
    for (size_t r = 0; r < rows; r++) memcpy(want + r * dpitch, src + r * spitch, width);
    for (int k = 0; k < 2; k++) {
        pd_error err = {0};
        uint8_t *ds = be_put(bes[k], src, rows * spitch), *dd = be_put(bes[k], dst0, rows * dpitch);
        be_ok(bes[k], pd_backend_copy2d(bes[k], dd, dpitch, ds, spitch, width, rows, &err), &err, "copy2d");
        be_get(bes[k], got, dd, rows * dpitch);
        for (size_t i = 0; i < rows * dpitch; i++)
            cr_assert_eq(got[i], want[i], "copy2d on %s: byte %zu (row %zu, offset %zu) is %u, expected %u",
                         pd_backend_name(bes[k]), i, i / dpitch, i % dpitch, got[i], want[i]);
        be_release(bes[k], ds);
        be_release(bes[k], dd);
    }
    free(src);
    free(dst0);
    free(want);
    free(got);

    /* copy2d_batch: three copies of different shapes between one source and
     * one destination buffer (disjoint regions), as a decode step appends
     * rows to many streams at once. */
    {
        const size_t sbytes = 24000, dbytes = 30000;
        const struct {
            size_t dst_off, src_off, dst_pitch, src_pitch, width, rows;
        } sh[3] = {{0, 0, 256, 512, 256, 10}, {5000, 7000, 100, 64, 37, 33}, {12000, 9500, 4096, 4096, 4096, 3}};
        uint8_t *bsrc = xmalloc(sbytes), *bdst0 = xmalloc(dbytes), *bwant = xmalloc(dbytes), *bgot = xmalloc(dbytes);
        for (size_t i = 0; i < sbytes; i++) bsrc[i] = pattern_byte(i, 4);
        for (size_t i = 0; i < dbytes; i++) bdst0[i] = pattern_byte(i, 5);
        memcpy(bwant, bdst0, dbytes);
        for (int j = 0; j < 3; j++)
            for (size_t r = 0; r < sh[j].rows; r++)
                memcpy(bwant + sh[j].dst_off + r * sh[j].dst_pitch, bsrc + sh[j].src_off + r * sh[j].src_pitch,
                       sh[j].width);
        for (int k = 0; k < 2; k++) {
            pd_error err = {0};
            uint8_t *ds = be_put(bes[k], bsrc, sbytes), *dd = be_put(bes[k], bdst0, dbytes);
            pd_copy2d descs[3];
            for (int j = 0; j < 3; j++)
                descs[j] = (pd_copy2d){.dst = dd + sh[j].dst_off, .src = ds + sh[j].src_off,
                                       .dst_pitch = sh[j].dst_pitch, .src_pitch = sh[j].src_pitch,
                                       .width = sh[j].width, .rows = sh[j].rows};
            be_ok(bes[k], pd_backend_copy2d_batch(bes[k], descs, 3, &err), &err, "copy2d_batch");
            be_get(bes[k], bgot, dd, dbytes);
            for (size_t i = 0; i < dbytes; i++)
                cr_assert_eq(bgot[i], bwant[i], "copy2d_batch on %s: byte %zu is %u, expected %u", pd_backend_name(bes[k]),
                             i, bgot[i], bwant[i]);
            be_release(bes[k], ds);
            be_release(bes[k], dd);
        }
        free(bsrc);
        free(bdst0);
        free(bwant);
        free(bgot);
    }

    /* gather: rows of 256 bytes (a head_dim-64 f32 row) and of 6 bytes
     * (not a multiple of 4), indices out of order and repeated. */
    static const size_t row_sizes[] = {256, 6};
    const int64_t n_src = 1000, n_idx = 333;
    int32_t *idx = xmalloc(sizeof(int32_t) * (size_t)n_idx);
    rng r = {1200};
    for (int64_t i = 0; i < n_idx; i++) idx[i] = (int32_t)rng_below(&r, n_src);
    idx[0] = (int32_t)(n_src - 1);
    idx[1] = 0;
    idx[2] = idx[3];
    for (size_t s = 0; s < sizeof row_sizes / sizeof row_sizes[0]; s++) {
        const size_t rb = row_sizes[s];
        uint8_t *gs = xmalloc(rb * (size_t)n_src), *gout = xmalloc(rb * (size_t)n_idx);
        for (size_t i = 0; i < rb * (size_t)n_src; i++) gs[i] = pattern_byte(i, 3 + (unsigned)s);
        for (int k = 0; k < 2; k++) {
            pd_error err = {0};
            uint8_t *ds = be_put(bes[k], gs, rb * (size_t)n_src), *dd = be_alloc(bes[k], rb * (size_t)n_idx);
            be_ok(bes[k], pd_backend_gather(bes[k], dd, ds, idx, n_idx, rb, &err), &err, "gather");
            be_get(bes[k], gout, dd, rb * (size_t)n_idx);
            for (int64_t i = 0; i < n_idx; i++)
                cr_assert(memcmp(gout + (size_t)i * rb, gs + (size_t)idx[i] * rb, rb) == 0,
                          "gather on %s, rows of %zu bytes: output row %lld is not source row %d", pd_backend_name(bes[k]),
                          rb, (long long)i, idx[i]);
            be_release(bes[k], ds);
            be_release(bes[k], dd);
        }
        free(gs);
        free(gout);
    }
    free(idx);
    close_backends(&b);
}

Test(cuda_parity, upload_download_round_trip_20_mib_of_pageable_memory) {
    REQUIRE_CUDA();
    backends b = open_backends();
    pd_backend *gpu = b.gpu;
    /* 20 MiB plus an odd tail, from a source 3 bytes into an ordinary
     * malloc'd block: larger than the pinned staging buffers, so the upload
     * goes through them in pieces, and misaligned on the host side. */
    const size_t bytes = (20u << 20) + 13;
    uint8_t *block = xmalloc(bytes + 3), *back = xmalloc(bytes);
    uint8_t *src = block + 3;
    for (size_t i = 0; i < bytes; i++) src[i] = pattern_byte(i, 9);
    pd_error err = {0};
    uint8_t *d1 = be_alloc(gpu, bytes), *d2 = be_alloc(gpu, bytes);
    be_ok(gpu, pd_backend_upload(gpu, d1, src, bytes, &err), &err, "upload");
    /* kernels.h: the source may be reused as soon as upload returns. */
    memset(src, 0xA5, bytes);
    be_ok(gpu, pd_backend_copy(gpu, d2, d1, bytes, &err), &err, "copy");
    be_get(gpu, back, d2, bytes);
    be_ok(gpu, pd_backend_sync(gpu, &err), &err, "sync");
    size_t bad = bytes;
    for (size_t i = 0; i < bytes && bad == bytes; i++)
        if (back[i] != pattern_byte(i, 9)) bad = i;
    cr_assert_eq(bad, bytes, "round trip of %zu bytes: byte %zu is %u, expected %u (0xa5: the upload read the source "
                             "after returning)",
                 bytes, bad, bad < bytes ? back[bad] : 0, bad < bytes ? pattern_byte(bad, 9) : 0);
    /* A small download into a misaligned destination. */
    uint8_t small[64 + 1];
    be_get(gpu, small + 1, d1 + 1000, 64);
    for (size_t i = 0; i < 64; i++) cr_assert_eq(small[1 + i], pattern_byte(1000 + i, 9));
    be_release(gpu, d1);
    be_release(gpu, d2);
    free(block);
    free(back);
    close_backends(&b);
}

/* ------------------------------------------------------------------------
 * Attention
 * ------------------------------------------------------------------------ */

#define MAX_GROUPS 8

/* One attention problem, built the way the engine builds them: the shared
 * segments hold a compressed prefix (kept positions with gaps), each group's
 * own segments continue after it (positions with gaps too), and the group's
 * query tokens are the last rows of its last own segment. */
typedef struct attn_case {
    const char *name;
    int n_head, n_head_kv, head_dim;
    int n_groups;
    int64_t group_tokens[MAX_GROUPS];
    int n_shared;
    int64_t shared_len;                 /* per shared segment */
    int n_segments;
    int64_t seg_len[MAX_GROUPS][PD_MAX_KV_SEGMENTS];
    uint64_t seed;
    pd_type shared_type, own_type; /* K/V rows: f32 (0) or f16, uploaded as such to both backends */
    int32_t window;                /* sliding window (0: none) */
    float softcap;                 /* score soft-capping (0: none) */
} attn_case;

/* Host data of one segment for every kv head: positions shared by the
 * heads, rows per head. */
typedef struct host_seg {
    int64_t len;
    int32_t *pos;
    float *k[16], *v[16];
} host_seg;

static host_seg make_seg(rng *r, int64_t len, int n_head_kv, int hd, int32_t *next_pos, float vscale) {
    host_seg s = {.len = len};
    s.pos = xmalloc(sizeof(int32_t) * (size_t)len);
    for (int64_t i = 0; i < len; i++) {
        *next_pos += 1 + (int32_t)rng_below(r, 3); /* gaps of 0 to 2 evicted tokens */
        s.pos[i] = *next_pos;
    }
    for (int h = 0; h < n_head_kv; h++) {
        s.k[h] = xmalloc(sizeof(float) * (size_t)(len * hd));
        s.v[h] = xmalloc(sizeof(float) * (size_t)(len * hd));
        for (int64_t i = 0; i < len * hd; i++) {
            s.k[h][i] = rng_normal(r);
            s.v[h][i] = rng_normal(r) * vscale;
        }
    }
    return s;
}

static void free_seg(host_seg *s, int n_head_kv) {
    free(s->pos);
    for (int h = 0; h < n_head_kv; h++) {
        free(s->k[h]);
        free(s->v[h]);
    }
}

/* A segment's views on one backend: uploads pos/k/v per kv head (rows
 * rounded to f16 for an f16 type) into views[h] and remembers the
 * allocations in owned[] for release. */
static void put_seg(pd_backend *be, const host_seg *s, int n_head_kv, int hd, pd_type type, pd_kv_view *views,
                    void **owned, int *n_owned) {
    const void *dpos = be_put(be, s->pos, sizeof(int32_t) * (size_t)s->len);
    owned[(*n_owned)++] = (void *)dpos;
    const size_t n = (size_t)(s->len * hd);
    uint16_t *h16 = type == PD_TYPE_F16 ? xmalloc(2 * n + 2) : NULL;
    for (int h = 0; h < n_head_kv; h++) {
        const void *dk, *dv;
        if (h16) {
            pd_fp32_to_fp16_row(s->k[h], h16, n);
            dk = be_put(be, h16, 2 * n);
            pd_fp32_to_fp16_row(s->v[h], h16, n);
            dv = be_put(be, h16, 2 * n);
        } else {
            dk = be_put(be, s->k[h], sizeof(float) * n);
            dv = be_put(be, s->v[h], sizeof(float) * n);
        }
        owned[(*n_owned)++] = (void *)dk;
        owned[(*n_owned)++] = (void *)dv;
        views[h] = (pd_kv_view){.k = dk, .v = dv, .pos = dpos, .keep = NULL, .len = s->len, .type = type};
    }
    free(h16);
}

typedef struct attn_data {
    int64_t n_tokens;
    float *q;
    int32_t *q_pos;
    int64_t group_start[MAX_GROUPS + 1];
    host_seg shared[2];
    host_seg own[MAX_GROUPS][PD_MAX_KV_SEGMENTS];
    float vmax; /* largest |v|: outputs are convex combinations of values */
} attn_data;

static void make_attn_data(const attn_case *c, attn_data *d) {
    memset(d, 0, sizeof *d);
    rng r = {c->seed};
    const int hd = c->head_dim;
    int32_t next = -1;
    for (int s = 0; s < c->n_shared; s++) d->shared[s] = make_seg(&r, c->shared_len, c->n_head_kv, hd, &next, 1.0f);
    const int32_t after_shared = next;
    d->n_tokens = 0;
    for (int g = 0; g < c->n_groups; g++) {
        d->group_start[g] = d->n_tokens;
        d->n_tokens += c->group_tokens[g];
    }
    d->group_start[c->n_groups] = d->n_tokens;
    d->q = xmalloc(sizeof(float) * (size_t)(d->n_tokens * c->n_head * hd));
    d->q_pos = xmalloc(sizeof(int32_t) * (size_t)d->n_tokens);
    /* q ~ N(0, 1.5^2): scores of std ~1.5 after the 1/sqrt(hd) scale, so
     * some softmaxes are peaked and some flat. */
    for (int64_t i = 0; i < d->n_tokens * c->n_head * hd; i++) d->q[i] = 1.5f * rng_normal(&r);
    for (int g = 0; g < c->n_groups; g++) {
        next = after_shared;
        for (int s = 0; s < c->n_segments; s++)
            d->own[g][s] = make_seg(&r, c->seg_len[g][s], c->n_head_kv, hd, &next, 1.0f);
        /* The group's tokens are the last rows of its last segment. */
        const host_seg *last = &d->own[g][c->n_segments - 1];
        cr_assert_geq(last->len, c->group_tokens[g], "%s: group %d has more tokens than its last segment", c->name, g);
        for (int64_t t = 0; t < c->group_tokens[g]; t++)
            d->q_pos[d->group_start[g] + t] = last->pos[last->len - c->group_tokens[g] + t];
    }
    d->vmax = 0;
    for (int s = 0; s < c->n_shared; s++)
        for (int h = 0; h < c->n_head_kv; h++)
            for (int64_t i = 0; i < d->shared[s].len * hd; i++) d->vmax = fmaxf(d->vmax, fabsf(d->shared[s].v[h][i]));
    for (int g = 0; g < c->n_groups; g++)
        for (int s = 0; s < c->n_segments; s++)
            for (int h = 0; h < c->n_head_kv; h++)
                for (int64_t i = 0; i < d->own[g][s].len * hd; i++)
                    d->vmax = fmaxf(d->vmax, fabsf(d->own[g][s].v[h][i]));
}

static void free_attn_data(const attn_case *c, attn_data *d) {
    free(d->q);
    free(d->q_pos);
    for (int s = 0; s < c->n_shared; s++) free_seg(&d->shared[s], c->n_head_kv);
    for (int g = 0; g < c->n_groups; g++)
        for (int s = 0; s < c->n_segments; s++) free_seg(&d->own[g][s], c->n_head_kv);
}

static void run_attention(pd_backend *be, const attn_case *c, const attn_data *d, float *out) {
    const int hd = c->head_dim, H = c->n_head_kv;
    void *owned[2 + (2 + MAX_GROUPS * PD_MAX_KV_SEGMENTS) * (1 + 2 * 16)];
    int n_owned = 0;
    pd_kv_view shared_views[2 * 16];
    pd_kv_view *own_views = xmalloc(sizeof(pd_kv_view) * (size_t)(c->n_groups * c->n_segments * H));
    for (int s = 0; s < c->n_shared; s++)
        put_seg(be, &d->shared[s], H, hd, c->shared_type, shared_views + s * H, owned, &n_owned);
    for (int g = 0; g < c->n_groups; g++)
        for (int s = 0; s < c->n_segments; s++)
            put_seg(be, &d->own[g][s], H, hd, c->own_type, own_views + ((int64_t)g * c->n_segments + s) * H, owned,
                    &n_owned);
    const size_t qb = sizeof(float) * (size_t)(d->n_tokens * c->n_head * hd);
    float *dq = be_put(be, d->q, qb);
    int32_t *dqp = be_put(be, d->q_pos, sizeof(int32_t) * (size_t)d->n_tokens);
    float *dout = be_alloc(be, qb);
    const pd_attn_args a = {.q = dq,
                            .q_pos = dqp,
                            .n_tokens = d->n_tokens,
                            .n_head = c->n_head,
                            .n_head_kv = H,
                            .head_dim = hd,
                            .n_segments = c->n_segments,
                            .kv = own_views,
                            .n_shared = c->n_shared,
                            .shared = c->n_shared ? shared_views : NULL,
                            .n_groups = c->n_groups,
                            .group_start = d->group_start,
                            .scale = 1.0f / sqrtf((float)hd),
                            .causal = true,
                            .window = c->window,
                            .softcap = c->softcap,
                            .out = dout};
    pd_error err = {0};
    be_ok(be, pd_backend_attention(be, &a, &err), &err, c->name);
    be_get(be, out, dout, qb);
    be_release(be, dq);
    be_release(be, dqp);
    be_release(be, dout);
    for (int i = 0; i < n_owned; i++) be_release(be, owned[i]);
    free(own_views);
}

static void check_attention(backends *b, const attn_case *c) {
    attn_data d;
    make_attn_data(c, &d);
    const int64_t n_out = d.n_tokens * c->n_head * c->head_dim;
    float *oc = xmalloc(sizeof(float) * (size_t)n_out), *og = xmalloc(sizeof(float) * (size_t)n_out);
    run_attention(b->cpu, c, &d, oc);
    run_attention(b->gpu, c, &d, og);
    /* Both backends use f32 with an online softmax and a log-sum-exp merge
     * of segments (f16 rows, the same on both, widened exactly as they
     * are read); only the order of the sums differs. Each output is a
     * convex combination of value rows, so its error scales with the
     * largest |v|: ~1e-6 of it in practice, asserted at 1e-4 (which still
     * catches one wrong or missing key: its weight is rarely below 1e-3
     * with these scores).
     * When every row read is f16 and head_dim a multiple of 16, the CUDA
     * backend takes its tensor-core path, which rounds the scaled queries
     * and the probabilities to f16 (relative error 2^-11 each): the
     * weights move by ~2^-11 times the score, ~3e-4 of max|v| at most in
     * practice here, asserted at 4 * 2^-11 max|v| (tests/test_cuda_attention.c
     * checks that path against bounds derived per output). */
    const bool f16_rows = (c->n_shared == 0 || c->shared_type == PD_TYPE_F16) && c->own_type == PD_TYPE_F16;
    const double rel_tol = f16_rows && c->head_dim % 16 == 0 ? 4 * 0x1p-11 : 1e-4;
    const double tol = rel_tol * d.vmax;
    double worst = 0;
    int64_t wi = 0;
    for (int64_t i = 0; i < n_out; i++) {
        const double e = fabs((double)og[i] - oc[i]);
        if (!(e <= worst)) {
            worst = isnan(e) ? INFINITY : e;
            wi = i;
        }
    }
    const int64_t per_tok = (int64_t)c->n_head * c->head_dim;
    cr_assert_leq(worst, tol,
                  "attention %s (n_head %d, n_head_kv %d, head_dim %d, %s/%s rows): token %lld (pos %d) head %lld "
                  "dim %lld: GPU %.8g, CPU %.8g (|diff| %.3g > %.3g = %.3g max|v|)",
                  c->name, c->n_head, c->n_head_kv, c->head_dim, c->shared_type == PD_TYPE_F16 ? "f16" : "f32",
                  c->own_type == PD_TYPE_F16 ? "f16" : "f32", (long long)(wi / per_tok), d.q_pos[wi / per_tok],
                  (long long)(wi % per_tok / c->head_dim), (long long)(wi % c->head_dim), (double)og[wi],
                  (double)oc[wi], worst, tol, rel_tol);
    free(oc);
    free(og);
    free_attn_data(c, &d);
}

Test(cuda_parity, attention_prefill_two_segments_with_gaps) {
    REQUIRE_CUDA();
    backends b = open_backends();
    static const int head_dims[] = {64, 128};
    for (size_t i = 0; i < 2; i++) {
        /* One sequence: a 300-row compressed prefix as its first segment,
         * then its 77 new tokens (all causal among themselves). */
        const attn_case c = {.name = "prefill",
                             .n_head = 8,
                             .n_head_kv = 2,
                             .head_dim = head_dims[i],
                             .n_groups = 1,
                             .group_tokens = {77},
                             .n_segments = 2,
                             .seg_len = {{300, 77}},
                             .seed = 2000 + i};
        check_attention(&b, &c);
        attn_case c16 = c; /* an f16 KV cache */
        c16.name = "prefill, f16 rows";
        c16.own_type = PD_TYPE_F16;
        check_attention(&b, &c16);
        /* Several sequences prefilled together over a shared prefix, one of
         * them with an empty first segment. */
        const attn_case cb = {.name = "batched prefill",
                              .n_head = 8,
                              .n_head_kv = 2,
                              .head_dim = head_dims[i],
                              .n_groups = 3,
                              .group_tokens = {5, 1, 20},
                              .n_shared = 1,
                              .shared_len = 500,
                              .n_segments = 2,
                              .seg_len = {{10, 5}, {0, 1}, {40, 20}},
                              .seed = 2100 + i};
        check_attention(&b, &cb);
    }
    close_backends(&b);
}

Test(cuda_parity, attention_decode_eight_groups_shared_prefix) {
    REQUIRE_CUDA();
    backends b = open_backends();
    static const int head_dims[] = {64, 128};
    for (size_t i = 0; i < 2; i++) {
        /* Eight sequences of one token each over one shared 3000-key prefix,
         * with own caches of very different lengths (the decode batch). */
        const attn_case c = {.name = "decode",
                             .n_head = 8,
                             .n_head_kv = 2,
                             .head_dim = head_dims[i],
                             .n_groups = 8,
                             .group_tokens = {1, 1, 1, 1, 1, 1, 1, 1},
                             .n_shared = 1,
                             .shared_len = 3000,
                             .n_segments = 1,
                             .seg_len = {{1}, {2}, {17}, {64}, {65}, {300}, {1000}, {2500}},
                             .seed = 3000 + i};
        check_attention(&b, &c);
        attn_case c16 = c; /* f16 KV caches over an f16 prefix */
        c16.name = "decode, f16 rows";
        c16.shared_type = c16.own_type = PD_TYPE_F16;
        check_attention(&b, &c16);
        attn_case mixed = c; /* f16 own rows over an f32 prefix */
        mixed.name = "decode, f32 prefix, f16 rows";
        mixed.own_type = PD_TYPE_F16;
        check_attention(&b, &mixed);
    }
    close_backends(&b);
}

/* Sliding windows (over positions with gaps, so kept prefix rows fall in
 * and out of them) and soft-capped scores, on the prefill and decode paths;
 * q is drawn larger here so the cap bites. */
Test(cuda_parity, attention_windows_and_soft_caps) {
    REQUIRE_CUDA();
    backends b = open_backends();
    const attn_case prefill = {.name = "prefill, window 40",
                               .n_head = 8,
                               .n_head_kv = 2,
                               .head_dim = 64,
                               .n_groups = 1,
                               .group_tokens = {77},
                               .n_segments = 2,
                               .seg_len = {{300, 77}},
                               .seed = 5000,
                               .window = 40};
    check_attention(&b, &prefill);
    attn_case capped = prefill;
    capped.name = "prefill, window 40, soft-cap 0.5, f16 rows";
    capped.softcap = 0.5f;
    capped.own_type = PD_TYPE_F16;
    check_attention(&b, &capped);
    const attn_case decode = {.name = "decode, window 700, soft-cap 1",
                              .n_head = 8,
                              .n_head_kv = 2,
                              .head_dim = 128,
                              .n_groups = 8,
                              .group_tokens = {1, 1, 1, 1, 1, 1, 1, 1},
                              .n_shared = 1,
                              .shared_len = 3000,
                              .n_segments = 1,
                              .seg_len = {{1}, {2}, {17}, {64}, {65}, {300}, {1000}, {2500}},
                              .seed = 5100,
                              .window = 700,
                              .softcap = 1.0f};
    check_attention(&b, &decode);
    attn_case narrow = decode;
    narrow.name = "decode, window 3";
    narrow.window = 3;
    narrow.softcap = 0.0f;
    check_attention(&b, &narrow);
    close_backends(&b);
}

Test(cuda_parity, attention_query_without_visible_keys_gives_zeros) {
    REQUIRE_CUDA();
    backends b = open_backends();
    /* Two queries at positions 0 and 1 over keys at positions 5..14: under
     * the causal mask nothing is visible, and kernels.h says zeros. */
    enum { HD = 64, NH = 8, NKV = 2, LEN = 10 };
    float *q = xmalloc(sizeof(float) * 2 * NH * HD), *k = xmalloc(sizeof(float) * LEN * HD);
    fill_normal(q, 2 * NH * HD, 1.0f, 4000);
    fill_normal(k, LEN * HD, 1.0f, 4001);
    int32_t qpos[2] = {0, 1}, kpos[LEN];
    for (int i = 0; i < LEN; i++) kpos[i] = 5 + i;
    pd_backend *bes[2] = {b.cpu, b.gpu};
    for (int be_i = 0; be_i < 2; be_i++) {
        pd_backend *be = bes[be_i];
        float *dq = be_put(be, q, sizeof(float) * 2 * NH * HD);
        int32_t *dqp = be_put(be, qpos, sizeof qpos), *dkp = be_put(be, kpos, sizeof kpos);
        float *dk = be_put(be, k, sizeof(float) * LEN * HD);
        float *dout = be_alloc(be, sizeof(float) * 2 * NH * HD);
        /* Fill the output with garbage first so "left untouched" fails. */
        float *junk = xmalloc(sizeof(float) * 2 * NH * HD);
        for (int i = 0; i < 2 * NH * HD; i++) junk[i] = 12345.0f;
        pd_error err = {0};
        be_ok(be, pd_backend_upload(be, dout, junk, sizeof(float) * 2 * NH * HD, &err), &err, "upload");
        pd_kv_view views[NKV];
        for (int h = 0; h < NKV; h++) views[h] = (pd_kv_view){.k = dk, .v = dk, .pos = dkp, .len = LEN};
        const pd_attn_args a = {.q = dq, .q_pos = dqp, .n_tokens = 2, .n_head = NH, .n_head_kv = NKV, .head_dim = HD,
                                .n_segments = 1, .kv = views, .n_groups = 0, .scale = 0.125f, .causal = true,
                                .out = dout};
        be_ok(be, pd_backend_attention(be, &a, &err), &err, "attention with nothing visible");
        be_get(be, junk, dout, sizeof(float) * 2 * NH * HD);
        for (int i = 0; i < 2 * NH * HD; i++)
            cr_assert(junk[i] == 0.0f, "%s: output %d is %g, expected 0", pd_backend_name(be), i, (double)junk[i]);
        free(junk);
        be_release(be, dq);
        be_release(be, dqp);
        be_release(be, dkp);
        be_release(be, dk);
        be_release(be, dout);
    }
    free(q);
    free(k);
    close_backends(&b);
}

/* ------------------------------------------------------------------------
 * Whole models
 * ------------------------------------------------------------------------ */

static const pd_token stories_reference[64] = {
    403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410, 408,
    419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 432, 352, 266, 268, 388, 426,
    338, 391, 266, 267, 337, 335, 312, 432, 398, 312, 286, 267, 414, 270, 333, 415, 426, 13,  438, 310};

static pd_model *load_on(const char *path, pd_backend *be) {
    pd_model *m = NULL;
    pd_error err = {0};
    pd_model_params p = {.n_threads = 2, .backend = be};
    cr_assert_eq(pd_model_load(path, &p, &m, &err), PD_OK, "%s on %s: %s", path, pd_backend_name(be), err.msg);
    return m;
}

static pd_token argmax(const float *x, int32_t n) {
    pd_token best = 0;
    for (int32_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

/* Largest |gpu - cpu| of a row of logits divided by the CPU row's range. */
static double logit_diff(const float *gpu, const float *cpu, int32_t n) {
    double lo = INFINITY, hi = -INFINITY, d = 0;
    for (int32_t i = 0; i < n; i++) {
        lo = fmin(lo, cpu[i]);
        hi = fmax(hi, cpu[i]);
        const double e = fabs((double)gpu[i] - cpu[i]);
        d = isnan(e) || e > d ? (isnan(e) ? INFINITY : e) : d;
    }
    return d / (hi > lo ? hi - lo : 1.0);
}

/* Prefill 64 tokens on both backends with every row's logits, then 8 decode
 * steps feeding both the same tokens. Rows and steps are compared as
 * described in the tolerance comment. */
static void check_model_logits(const char *path, const pd_token *tokens, const char *what) {
    enum { N = 64, STEPS = 8 };
    backends b = open_backends();
    pd_model *mc = load_on(path, b.cpu), *mg = load_on(path, b.gpu);
    const int32_t V = pd_model_hparams(mc)->n_vocab;
    float *lc = xmalloc(sizeof(float) * (size_t)V * N), *lg = xmalloc(sizeof(float) * (size_t)V * N);
    pd_seq *sc = NULL, *sg = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_seq_create(mc, 0, &sc, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_seq_create(mg, 0, &sg, &err), PD_OK, "%s", err.msg);
    const pd_prefill_opts all = {.logits_all = true};
    cr_assert_eq(pd_prefill(mc, sc, tokens, N, &all, lc, &err), PD_OK, "%s cpu prefill: %s", what, err.msg);
    cr_assert_eq(pd_prefill(mg, sg, tokens, N, &all, lg, &err), PD_OK, "%s gpu prefill: %s", what, err.msg);
    /* Tolerance: the GPU rounds GEMM inputs to bf16 (2^-9 relative), which
     * through the layers moves logits by well under 1% of their range;
     * 2e-2 of the range allows that and catches any real divergence (a
     * wrong op moves logits by a sizeable fraction of the range). Argmax
     * may flip only on near-ties: >= 95% of rows must agree. (A random
     * generated model has flat logits, so a flip or two is expected there;
     * the message lists each flip's CPU gap to show it was a near-tie.) */
    double worst = 0;
    int worst_row = 0, same = 0;
    char flips[512] = "";
    size_t flips_len = 0;
    for (int i = 0; i < N; i++) {
        const float *rg = lg + (size_t)i * V, *rc = lc + (size_t)i * V;
        const double d = logit_diff(rg, rc, V);
        if (!(d <= worst)) {
            worst = isnan(d) ? INFINITY : d;
            worst_row = i;
        }
        const pd_token ag = argmax(rg, V), ac = argmax(rc, V);
        same += ag == ac;
        if (ag != ac && flips_len < sizeof flips - 64) {
            double lo = INFINITY, hi = -INFINITY;
            for (int32_t j = 0; j < V; j++) {
                lo = fmin(lo, rc[j]);
                hi = fmax(hi, rc[j]);
            }
            flips_len += (size_t)snprintf(flips + flips_len, sizeof flips - flips_len, " row %d (gap %.2g)", i,
                                          ((double)rc[ac] - rc[ag]) / (hi > lo ? hi - lo : 1.0));
        }
    }
    cr_log_info("%s prefill of %d tokens: worst row |GPU - CPU| / range %.4g, argmax agrees on %d of %d rows%s%s", what,
                N, worst, same, N, flips_len ? "; flips (CPU logit gap / range):" : "", flips);
    cr_assert_lt(worst, 2e-2, "%s prefill: row %d differs by %.4g of the logit range (limit 2e-2)", what, worst_row,
                 worst);
    cr_assert_geq(same * 100, 95 * N, "%s prefill: the argmax agrees on %d of %d rows (need 95%%); flips:%s", what,
                  same, N, flips);
    /* Decode (one token: the GEMV path, f32 activations) from the same
     * state, feeding both the CPU's greedy choice. */
    pd_token t = argmax(lc + (size_t)(N - 1) * V, V);
    for (int s = 0; s < STEPS; s++) {
        cr_assert_eq(pd_decode(mc, &sc, &t, 1, lc, &err), PD_OK, "%s cpu decode: %s", what, err.msg);
        cr_assert_eq(pd_decode(mg, &sg, &t, 1, lg, &err), PD_OK, "%s gpu decode: %s", what, err.msg);
        const double d = logit_diff(lg, lc, V);
        cr_assert_lt(d, 2e-2, "%s decode step %d: logits differ by %.4g of the range (limit 2e-2)", what, s, d);
        t = argmax(lc, V);
    }
    pd_seq_free(sc);
    pd_seq_free(sg);
    free(lc);
    free(lg);
    pd_model_free(mc);
    pd_model_free(mg);
    close_backends(&b);
}

Test(cuda_parity, stories260k_prefill_and_decode_logits) {
    REQUIRE_CUDA();
    TH_REQUIRE_SHARED();
    char path[1024];
    cr_assert(th_shared_file("tinystories/stories260K.gguf", path, sizeof path));
    /* BOS and the reference story: natural text, so attention is not flat. */
    pd_token tokens[64];
    tokens[0] = 1;
    memcpy(tokens + 1, stories_reference, sizeof(pd_token) * 63);
    check_model_logits(path, tokens, "stories260K");
}

Test(cuda_parity, stories260k_greedy_matches_cpu_and_reference) {
    REQUIRE_CUDA();
    TH_REQUIRE_SHARED();
    char path[1024];
    cr_assert(th_shared_file("tinystories/stories260K.gguf", path, sizeof path));
    backends b = open_backends();
    pd_model *mc = load_on(path, b.cpu), *mg = load_on(path, b.gpu);
    const int32_t V = pd_model_hparams(mc)->n_vocab;
    float *lc = xmalloc(sizeof(float) * (size_t)V), *lg = xmalloc(sizeof(float) * (size_t)V);
    pd_seq *sc = NULL, *sg = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_seq_create(mc, 0, &sc, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_seq_create(mg, 0, &sg, &err), PD_OK, "%s", err.msg);
    pd_token tc = 1, tg = 1; /* BOS */
    cr_assert_eq(pd_prefill(mc, sc, &tc, 1, NULL, lc, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_prefill(mg, sg, &tg, 1, NULL, lg, &err), PD_OK, "%s", err.msg);
    /* The first token from the prefill, then 32 greedy decode steps, each
     * fed its own backend's choice. Single tokens take the f32 GEMV path on
     * the GPU (stories260K is F32), so the choices must be identical, and
     * equal to the float64 reference (MANIFEST.md: exact for dozens of
     * tokens). */
    for (int i = 0; i <= 32; i++) {
        tc = argmax(lc, V);
        tg = argmax(lg, V);
        cr_assert_eq(tg, tc, "greedy token %d: GPU %d, CPU %d", i, tg, tc);
        cr_assert_eq(tg, stories_reference[i], "greedy token %d: GPU %d, reference %d", i, tg,
                     stories_reference[i]);
        if (i == 32) break;
        cr_assert_eq(pd_decode(mc, &sc, &tc, 1, lc, &err), PD_OK, "%s", err.msg);
        cr_assert_eq(pd_decode(mg, &sg, &tg, 1, lg, &err), PD_OK, "gpu decode step %d: %s", i, err.msg);
    }
    cr_assert_eq(pd_seq_pos(sg), 33);
    pd_seq_free(sc);
    pd_seq_free(sg);
    free(lc);
    free(lg);
    pd_model_free(mc);
    pd_model_free(mg);
    close_backends(&b);
}

Test(cuda_parity, generated_qwen2_prefill_and_decode_logits) {
    REQUIRE_CUDA();
    char *dir = th_mkdtemp();
    cr_assert_not_null(dir);
    char path[1024];
    snprintf(path, sizeof path, "%s/qwen2.gguf", dir);
    /* qwen2: QKV biases (the add op as a broadcast) and NeoX rope; BF16
     * weights, so both backends multiply by the same weight values. */
    pd_testmodel_opts o;
    pd_error err = {0};
    cr_assert_eq(pd_testmodel_preset("tiny", &o, &err), PD_OK, "%s", err.msg);
    o.arch = "qwen2";
    o.wtype = PD_TYPE_BF16;
    o.n_embd = 256;
    o.n_ff = 512;
    o.n_head = 8;
    o.n_head_kv = 2;
    o.n_layer = 2;
    o.n_ctx = 512;
    o.seed = 17;
    cr_assert_eq(pd_testmodel_write(&o, path, NULL, &err), PD_OK, "%s", err.msg);
    pd_token tokens[64];
    rng r = {18};
    const uint32_t nv = pd_testmodel_builtin_vocab_size();
    for (int i = 0; i < 64; i++) tokens[i] = 3 + (pd_token)rng_below(&r, (int64_t)nv - 3);
    tokens[0] = 1;
    check_model_logits(path, tokens, "qwen2 (generated)");
    th_rmtree(dir);
    free(dir);
}

/* qwen3, gemma2, gemma3, phi3: per-head norms, GeGLU, post norms, windows
 * shorter than the prompt, soft-caps, fused tensors. Peaked F32 weights:
 * their sharp attention turns the bf16 rounding of BF16 GEMM inputs into
 * a few percent of the logit range after six layers (gemma3 measured 2.8%
 * under cudaemu), while with f32 GEMMs the backends agree to ~1e-3. */
Test(cuda_parity, generated_newer_architectures_prefill_and_decode_logits) {
    REQUIRE_CUDA();
    char *dir = th_mkdtemp();
    cr_assert_not_null(dir);
    static const char *const archs[] = {"qwen3", "gemma2", "gemma3", "phi3"};
    for (size_t i = 0; i < sizeof archs / sizeof *archs; i++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/%s.gguf", dir, archs[i]);
        pd_testmodel_opts o;
        pd_error err = {0};
        cr_assert_eq(pd_testmodel_preset("tiny", &o, &err), PD_OK, "%s", err.msg);
        o.arch = archs[i];
        o.wtype = PD_TYPE_F32;
        o.peaked = true;
        o.n_embd = 128;
        o.n_ff = 256;
        o.n_head = 4;
        o.n_head_kv = 2;
        o.head_dim = strcmp(archs[i], "phi3") ? 64 : 0;
        o.n_layer = strcmp(archs[i], "gemma3") ? 2 : 6;
        o.sliding_window = 12;
        o.tied = strcmp(archs[i], "phi3") != 0;
        o.attn_softcap = strcmp(archs[i], "gemma2") ? 0.0f : 10.0f;
        o.final_softcap = strcmp(archs[i], "gemma2") ? 0.0f : 20.0f;
        o.n_ctx = 512;
        o.seed = 19 + i;
        cr_assert_eq(pd_testmodel_write(&o, path, NULL, &err), PD_OK, "%s", err.msg);
        pd_token tokens[64];
        rng r = {20 + i};
        const uint32_t nv = pd_testmodel_builtin_vocab_size();
        for (int t = 0; t < 64; t++) tokens[t] = 3 + (pd_token)rng_below(&r, (int64_t)nv - 3);
        tokens[0] = 1;
        check_model_logits(path, tokens, archs[i]);
    }
    th_rmtree(dir);
    free(dir);
}

/* ------------------------------------------------------------------------
 * Compressed prefixes
 * ------------------------------------------------------------------------ */

/* n tokens of text the model writes itself (seeded sampling at temperature
 * 1 from BOS), so the prefix has the structure real text has. */
static pd_token *sample_text(pd_model *m, int n, uint64_t seed) {
    const int32_t V = pd_model_hparams(m)->n_vocab;
    pd_token *t = xmalloc(sizeof(pd_token) * (size_t)n);
    float *logits = xmalloc(sizeof(float) * (size_t)V);
    pd_sampler_params sp = pd_sampler_params_default();
    sp.seed = seed;
    pd_sampler *smp = NULL;
    pd_seq *s = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_sampler_create(&sp, V, &smp, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_seq_create(m, 0, &s, &err), PD_OK, "%s", err.msg);
    t[0] = 1;
    cr_assert_eq(pd_prefill(m, s, t, 1, NULL, logits, &err), PD_OK, "%s", err.msg);
    for (int i = 1; i < n; i++) {
        pd_sample_result res;
        cr_assert_eq(pd_sampler_sample(smp, logits, &res, &err), PD_OK, "%s", err.msg);
        t[i] = res.token;
        if (i + 1 < n) cr_assert_eq(pd_decode(m, &s, &t[i], 1, logits, &err), PD_OK, "%s", err.msg);
    }
    pd_seq_free(s);
    pd_sampler_free(smp);
    free(logits);
    return t;
}

/* Attach `p` to a new sequence on `m`, prefill `suffix`, then one decode
 * step of `next`: the logits of both (V floats each) into out[0], out[1]. */
static void continue_prefix(pd_model *m, const pd_kv_prefix *p, const pd_token *suffix, int64_t n_suffix,
                            pd_token next, float *out, const char *what) {
    const int32_t V = pd_model_hparams(m)->n_vocab;
    pd_seq *s = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_seq_create(m, 0, &s, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_seq_attach_prefix(s, p, &err), PD_OK, "%s: attach: %s", what, err.msg);
    cr_assert_eq(pd_prefill(m, s, suffix, n_suffix, NULL, out, &err), PD_OK, "%s: prefill: %s", what, err.msg);
    cr_assert_eq(pd_decode(m, &s, &next, 1, out + V, &err), PD_OK, "%s: decode: %s", what, err.msg);
    pd_seq_free(s);
}

Test(cuda_parity, compactor_prefix_kept_sets_and_continuations) {
    REQUIRE_CUDA();
    TH_REQUIRE_SHARED();
    char path[1024];
    cr_assert(th_shared_file("tinystories/stories260K.gguf", path, sizeof path));
    backends b = open_backends();
    pd_model *mc = load_on(path, b.cpu), *mg = load_on(path, b.gpu);
    const pd_hparams *hp = pd_model_hparams(mc);
    const int32_t V = hp->n_vocab;
    enum { N = 400, N_SUFFIX = 16 }; /* a suffix above 8 tokens takes the GEMM path */
    pd_token *text = sample_text(mc, N + N_SUFFIX + 1, 3);

    pd_policy_spec spec;
    pd_policy_spec_default(PD_POLICY_COMPACTOR, &spec);
    char spec_text[PD_POLICY_SPEC_MAX];
    pd_policy_spec_print(&spec, spec_text, sizeof spec_text);
    pd_kv_prefix *pc = NULL, *pg = NULL;
    pd_compress_stats stc, stg;
    pd_error err = {0};
    cr_assert_eq(pd_compress_prefix(mc, text, N, &spec, NULL, &pc, &stc, &err), PD_OK, "cpu %s: %s", spec_text,
                 err.msg);
    cr_assert_eq(pd_compress_prefix(mg, text, N, &spec, NULL, &pg, &stg, &err), PD_OK, "gpu %s: %s", spec_text,
                 err.msg);
    cr_assert_eq(stg.kept_total, stc.kept_total, "%s: the budget is the same on both backends", spec_text);

    /* Kept sets per (layer, kv head). The scores are z-scored, so the
     * GPU's bf16 GEMM inputs move them by ~1e-3 standard deviations; only
     * tokens that near-tie at the selection threshold can change sides
     * (and in global budget mode a head's count may shift by as many).
     * Overlap = |CPU & GPU| / max(|CPU|, |GPU|) >= 95% per stream. Kept
     * rows that both chose carry the same K/V within the prefill tolerance
     * (2e-2 of the stream's largest |k|, |v|). */
    double min_overlap = 1, total_common = 0, total_kept = 0;
    int min_l = 0, min_h = 0;
    for (int l = 0; l < hp->n_layer; l++)
        for (int h = 0; h < hp->n_head_kv; h++) {
            const int32_t *posc, *posg;
            const int64_t nc = pd_kv_prefix_stream(pc, l, h, &posc, NULL, NULL);
            const int64_t ng = pd_kv_prefix_stream(pg, l, h, &posg, NULL, NULL);
            float *kc = xmalloc(sizeof(float) * (size_t)(nc * hp->head_dim + 1)), *vc = xmalloc(sizeof(float) * (size_t)(nc * hp->head_dim + 1));
            float *kg = xmalloc(sizeof(float) * (size_t)(ng * hp->head_dim + 1)), *vg = xmalloc(sizeof(float) * (size_t)(ng * hp->head_dim + 1));
            pd_kv_prefix_stream_f32(pc, l, h, kc, vc); /* in the models' KV type; widened to compare */
            pd_kv_prefix_stream_f32(pg, l, h, kg, vg);
            int64_t common = 0;
            double kmax = 0, vmax = 0, kdiff = 0, vdiff = 0;
            for (int64_t i = 0; i < nc * hp->head_dim; i++) {
                kmax = fmax(kmax, fabs((double)kc[i]));
                vmax = fmax(vmax, fabs((double)vc[i]));
            }
            for (int64_t i = 0, j = 0; i < nc && j < ng;) {
                if (posc[i] < posg[j])
                    i++;
                else if (posc[i] > posg[j])
                    j++;
                else {
                    for (int d = 0; d < hp->head_dim; d++) {
                        kdiff = fmax(kdiff, fabs((double)kc[i * hp->head_dim + d] - kg[j * hp->head_dim + d]));
                        vdiff = fmax(vdiff, fabs((double)vc[i * hp->head_dim + d] - vg[j * hp->head_dim + d]));
                    }
                    common++;
                    i++;
                    j++;
                }
            }
            const int64_t larger = nc > ng ? nc : ng;
            const double overlap = larger ? (double)common / (double)larger : 1.0;
            if (overlap < min_overlap) {
                min_overlap = overlap;
                min_l = l;
                min_h = h;
            }
            total_common += (double)common;
            total_kept += (double)larger;
            cr_assert_geq(overlap, 0.95,
                          "%s, %d tokens: layer %d kv head %d keeps %lld tokens on the CPU and %lld on the GPU, %lld "
                          "in common: overlap %.1f%% < 95%%",
                          spec_text, N, l, h, (long long)nc, (long long)ng, (long long)common, 100 * overlap);
            cr_assert_leq(kdiff, 2e-2 * kmax, "layer %d head %d: kept keys differ by %.3g (max |k| %.3g)", l, h, kdiff,
                          kmax);
            cr_assert_leq(vdiff, 2e-2 * vmax, "layer %d head %d: kept values differ by %.3g (max |v| %.3g)", l, h,
                          vdiff, vmax);
            free(kc), free(vc), free(kg), free(vg);
        }
    cr_log_info("compactor kept-set overlap CPU/GPU: %.2f%% overall, lowest %.2f%% (layer %d head %d)",
                100 * total_common / (total_kept > 0 ? total_kept : 1), 100 * min_overlap, min_l, min_h);

    /* Continuations: (a) the CPU's prefix on the GPU against the same
     * prefix on the CPU isolates compute parity with an attached prefix:
     * the prefill tolerance (2e-2 of the range) and the same next token;
     * (b) each backend on its own prefix additionally differs by the few
     * near-tie tokens the two selections disagree on: 1e-1 of the range. */
    const pd_token *suffix = text + N, next = text[N + N_SUFFIX];
    float *lcc = xmalloc(sizeof(float) * 2 * (size_t)V), *lgc = xmalloc(sizeof(float) * 2 * (size_t)V);
    float *lgg = xmalloc(sizeof(float) * 2 * (size_t)V);
    continue_prefix(mc, pc, suffix, N_SUFFIX, next, lcc, "cpu model, cpu prefix");
    continue_prefix(mg, pc, suffix, N_SUFFIX, next, lgc, "gpu model, cpu prefix");
    continue_prefix(mg, pg, suffix, N_SUFFIX, next, lgg, "gpu model, gpu prefix");
    for (int k = 0; k < 2; k++) {
        const char *step = k ? "decode" : "suffix prefill";
        const double same = logit_diff(lgc + (size_t)k * V, lcc + (size_t)k * V, V);
        cr_assert_lt(same, 2e-2, "%s with the CPU's prefix: GPU and CPU logits differ by %.4g of the range", step,
                     same);
        cr_assert_eq(argmax(lgc + (size_t)k * V, V), argmax(lcc + (size_t)k * V, V),
                     "%s with the CPU's prefix: GPU and CPU pick different next tokens", step);
        const double own = logit_diff(lgg + (size_t)k * V, lcc + (size_t)k * V, V);
        cr_assert_lt(own, 1e-1, "%s, each backend with its own prefix: logits differ by %.4g of the range", step,
                     own);
        cr_log_info("%s after the compressed prefix: |GPU - CPU| / range %.4g (same prefix), %.4g (own prefixes)",
                    step, same, own);
    }

    /* A decode batch of three sequences sharing the CPU's prefix, each with
     * its own suffix, in one pd_decode call on each backend. */
    enum { NB = 3 };
    pd_seq *sc[NB], *sg[NB];
    pd_token nexts[NB];
    float *bc = xmalloc(sizeof(float) * (size_t)(NB * V)), *bg = xmalloc(sizeof(float) * (size_t)(NB * V));
    for (int i = 0; i < NB; i++) {
        cr_assert_eq(pd_seq_create(mc, 0, &sc[i], &err), PD_OK, "%s", err.msg);
        cr_assert_eq(pd_seq_create(mg, 0, &sg[i], &err), PD_OK, "%s", err.msg);
        cr_assert_eq(pd_seq_attach_prefix(sc[i], pc, &err), PD_OK, "%s", err.msg);
        cr_assert_eq(pd_seq_attach_prefix(sg[i], pc, &err), PD_OK, "%s", err.msg);
        cr_assert_eq(pd_prefill(mc, sc[i], suffix + i, 1 + 2 * i, NULL, NULL, &err), PD_OK, "%s", err.msg);
        cr_assert_eq(pd_prefill(mg, sg[i], suffix + i, 1 + 2 * i, NULL, NULL, &err), PD_OK, "%s", err.msg);
        nexts[i] = text[i + 1];
    }
    cr_assert_eq(pd_decode(mc, sc, nexts, NB, bc, &err), PD_OK, "cpu batch decode: %s", err.msg);
    cr_assert_eq(pd_decode(mg, sg, nexts, NB, bg, &err), PD_OK, "gpu batch decode: %s", err.msg);
    for (int i = 0; i < NB; i++) {
        const double d = logit_diff(bg + (size_t)i * V, bc + (size_t)i * V, V);
        cr_assert_lt(d, 2e-2, "batch decode, sequence %d: logits differ by %.4g of the range", i, d);
        pd_seq_free(sc[i]);
        pd_seq_free(sg[i]);
    }

    free(bc);
    free(bg);
    free(lcc);
    free(lgc);
    free(lgg);
    pd_compress_stats_free(&stc);
    pd_compress_stats_free(&stg);
    pd_kv_prefix_free(pc);
    pd_kv_prefix_free(pg);
    free(text);
    pd_model_free(mc);
    pd_model_free(mg);
    close_backends(&b);
}

/* ------------------------------------------------------------------------
 * Errors
 * ------------------------------------------------------------------------ */

Test(cuda_parity, absent_device_index_is_not_found) {
#ifdef PD_PARITY_DISCRETE_CPU
    cr_skip_test("CUDA-only check");
#endif
    REQUIRE_CUDA();
    pd_backend *be = (pd_backend *)0x1;
    pd_error err = {0};
    const int rc = pd_backend_cuda_create(999, &be, &err);
    cr_assert_eq(rc, PD_ENOTFOUND, "pd_backend_cuda_create(999) returned %d (%s), expected PD_ENOTFOUND", rc, err.msg);
    cr_assert_null(be, "a failed create must leave *out NULL");
    cr_assert(strlen(err.msg) > 0, "the error needs a message");
}
