/* Quantized weights kept in their GGUF blocks on the CUDA device
 * (kernels/cuda/quant.cu): for every type with native kernels, random rows
 * quantized by the CPU's quantizers, then
 *   - get_rows (the device dequantizer, f32 out) against pd_dequantize_row:
 *     bit-identical, which pins every block layout;
 *   - the decode GEMV (1, 3 and 8 tokens, and 3 tokens with x not 16-byte
 *     aligned) against the exact product of the dequantized weights: f32
 *     accumulation error only;
 *   - the prefill path (37 tokens: rows dequantized to bf16 on the device,
 *     cuBLAS GEMM) against the same product: two bf16 roundings;
 *   - both against the CPU backend's matmul, within the sum of the bounds;
 *   - the device bytes the backend reports for the weight: the file's.
 * Row counts of 157 (not a multiple of the GEMV's 2 or 4 rows per block), 5
 * and 1; rows of 1, 3 and 9 blocks (fewer and more 8-element pieces than a
 * block's 128 threads).
 *
 * Skips where there is no CUDA device (a CPU-only build, or cudaemu with
 * CUDAEMU_DEVICES=0). `--verbose` prints the largest errors per type. */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"

#define F32_U 0x1p-24

#define REQUIRE_CUDA()                                                                                         \
    do {                                                                                                       \
        if (pd_cuda_device_count() == 0)                                                                       \
            cr_skip_test("no CUDA device: quantized GEMV not checked (compiled in: %s)",                       \
                         pd_cuda_compiled() ? "yes" : "no");                                                   \
    } while (0)

static const pd_type native_types[] = {PD_TYPE_Q8_0, PD_TYPE_Q4_0, PD_TYPE_Q4_1, PD_TYPE_Q5_0,
                                       PD_TYPE_Q5_1, PD_TYPE_IQ4_NL, PD_TYPE_Q2_K, PD_TYPE_Q3_K,
                                       PD_TYPE_Q4_K, PD_TYPE_Q5_K, PD_TYPE_Q6_K, PD_TYPE_IQ4_XS};
#define N_NATIVE (sizeof native_types / sizeof native_types[0])

static void *xmalloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    cr_assert_not_null(p, "out of memory (%zu bytes)", bytes);
    return p;
}

static double unit(uint64_t *s) { return (double)(pd_splitmix64(s) >> 11) * 0x1p-53; }

/* A quantized weight, its encoded rows (which must outlive the backends:
 * the CUDA backend keys its copy by host pointer) and the rows decoded. */
typedef struct qweight {
    pd_weight w;
    void *data;
    float *deq; /* [rows][cols] */
} qweight;

static qweight make_qweight(pd_type t, int64_t rows, int64_t cols, uint64_t seed) {
    qweight q = {0};
    pd_error err = {0};
    uint64_t rb;
    cr_assert_eq(pd_type_row_size(t, (uint64_t)cols, &rb, &err), PD_OK, "%s", err.msg);
    float *vals = xmalloc(sizeof(float) * (size_t)(rows * cols));
    uint64_t s = seed;
    /* Rows of different magnitude and an offset, so scales and k-quant
     * mins vary from block to block. */
    for (int64_t i = 0; i < rows; i++) {
        const double scale = 0.05 + 2.0 * unit(&s), shift = (unit(&s) - 0.5) * scale;
        for (int64_t j = 0; j < cols; j++) vals[i * cols + j] = (float)((2.0 * unit(&s) - 1.0) * scale + shift);
    }
    q.data = xmalloc((size_t)rb * (size_t)rows);
    q.deq = xmalloc(sizeof(float) * (size_t)(rows * cols));
    for (int64_t i = 0; i < rows; i++) {
        uint8_t *row = (uint8_t *)q.data + (size_t)i * rb;
        cr_assert_eq(pd_quantize_row(t, vals + i * cols, row, (uint64_t)cols, &err), PD_OK, "%s", err.msg);
        cr_assert_eq(pd_dequantize_row(t, row, q.deq + i * cols, (uint64_t)cols, &err), PD_OK, "%s", err.msg);
    }
    free(vals);
    cr_assert_eq(pd_weight_init(&q.w, t, q.data, rows, cols, &err), PD_OK, "%s", err.msg);
    return q;
}

static void free_qweight(qweight *q) {
    free(q->data);
    free(q->deq);
}

static void *be_put(pd_backend *be, const void *host, size_t bytes) {
    pd_error err = {0};
    void *p = pd_backend_alloc(be, bytes, &err);
    cr_assert_not_null(p, "%s: alloc: %s", pd_backend_name(be), err.msg);
    if (host) cr_assert_eq(pd_backend_upload(be, p, host, bytes, &err), PD_OK, "upload: %s", err.msg);
    return p;
}

static void be_get(pd_backend *be, void *host, const void *src, size_t bytes) {
    pd_error err = {0};
    cr_assert_eq(pd_backend_download(be, host, src, bytes, &err), PD_OK, "download: %s", err.msg);
}

/* y = W x on be, with x placed `x_offset` floats into its device buffer. */
static void run_matmul(pd_backend *be, const pd_weight *w, const float *x, int64_t n, int64_t x_offset, float *y) {
    pd_error err = {0};
    const size_t xb = sizeof(float) * (size_t)(n * w->cols), yb = sizeof(float) * (size_t)(n * w->rows);
    float *dx = be_put(be, NULL, xb + sizeof(float) * (size_t)x_offset);
    cr_assert_eq(pd_backend_upload(be, dx + x_offset, x, xb, &err), PD_OK, "upload: %s", err.msg);
    float *dy = be_put(be, NULL, yb);
    cr_assert_eq(pd_backend_matmul(be, w, dx + x_offset, n, dy, &err), PD_OK, "matmul on %s: %s",
                 pd_backend_name(be), err.msg);
    be_get(be, y, dy, yb);
    pd_backend_release(be, dx);
    pd_backend_release(be, dy);
}

/* Largest errors seen for one type, for the log. */
typedef struct worst {
    double gemv_abs, gemv_rel, gemm_abs, gemm_rel;
} worst;

static void check_type(pd_backend *cpu, pd_backend *gpu, pd_type t, int64_t rows, int64_t cols, uint64_t seed,
                       worst *wst, qweight *keep) {
    const char *tname = pd_type_get((uint32_t)t)->name;
    const int64_t xblk = pd_type_get((uint32_t)t)->block_size; /* the CPU quantizes x per weight block */
    qweight q = make_qweight(t, rows, cols, seed);
    *keep = q;

    /* Native device bytes: the file's rows as they are. */
    cr_assert_eq(pd_cuda_weight_bytes(t, rows, cols), (uint64_t)rows * q.w.row_bytes,
                 "%s: the device holds %llu bytes for %lld rows of %zu", tname,
                 (unsigned long long)pd_cuda_weight_bytes(t, rows, cols), (long long)rows, q.w.row_bytes);

    /* get_rows: every row, some twice, in a shuffled order; bit-identical
     * to the reference dequantizer (same float operations, no FMA). */
    {
        const int64_t n = rows + 2;
        int32_t *ids = xmalloc(sizeof(int32_t) * (size_t)n);
        for (int64_t i = 0; i < n; i++) ids[i] = (int32_t)((i * 7 + 3) % rows);
        const size_t ob = sizeof(float) * (size_t)(n * cols);
        float *out = xmalloc(ob);
        pd_error err = {0};
        float *d = be_put(gpu, NULL, ob);
        cr_assert_eq(pd_backend_get_rows(gpu, &q.w, ids, n, d, &err), PD_OK, "get_rows: %s", err.msg);
        be_get(gpu, out, d, ob);
        pd_backend_release(gpu, d);
        for (int64_t i = 0; i < n; i++)
            for (int64_t c = 0; c < cols; c++) {
                const float want = q.deq[(int64_t)ids[i] * cols + c], got = out[i * cols + c];
                cr_assert(memcmp(&want, &got, sizeof want) == 0,
                          "get_rows %s %lldx%lld: row %d element %lld: device %.9g, reference %.9g", tname,
                          (long long)rows, (long long)cols, ids[i], (long long)c, (double)got, (double)want);
            }
        free(ids);
        free(out);
    }

    static const struct {
        int64_t n, x_offset;
    } runs[] = {{1, 0}, {3, 0}, {8, 0}, {3, 1}, {37, 0}};
    for (size_t ri = 0; ri < sizeof runs / sizeof runs[0]; ri++) {
        const int64_t n = runs[ri].n;
        const bool gemm = n > 8;
        float *x = xmalloc(sizeof(float) * (size_t)(n * cols));
        float *yg = xmalloc(sizeof(float) * (size_t)(n * rows));
        float *yc = xmalloc(sizeof(float) * (size_t)(n * rows));
        uint64_t s = seed * 977 + (uint64_t)n;
        for (int64_t i = 0; i < n * cols; i++) x[i] = (float)(2.0 * unit(&s) - 1.0);
        run_matmul(gpu, &q.w, x, n, runs[ri].x_offset, yg);
        run_matmul(cpu, &q.w, x, n, 0, yc);
        /* Per output, with S = sum_k |W[r,k] x[k]|:
         * - GEMV: each 8-element piece adds scale * dot(q, x) - min * sum(x)
         *   in f32 (w = scale * q - min exactly), so only f32 rounding
         *   differs from the exact sum: at most cols * 2^-24 times the sum
         *   of the terms' magnitudes, sum_k (|w_k| + 2 |min_k|) |x_k|. The
         *   CPU's quantizers pick mins no larger than about the block's
         *   largest |w|: M = 2 sum_k amax(block of k) |x_k| covers them.
         * - prefill: weights and x each rounded to bf16 (2^-8 relative
         *   each) before an f32-accumulated GEMM: 2^-7 S, as
         *   test_cuda_parity allows.
         * - CPU: x quantized to int8 per weight block (kernels/backend.h):
         *   sum_k |W[r,k]| amax(block of k) / 254, plus f32 rounding; the
         *   two bounds add for |gpu - cpu|. */
        double worst_ref = 0, worst_cpu = 0;
        int64_t wi = 0, wr = 0;
        for (int64_t i = 0; i < n; i++)
            for (int64_t r = 0; r < rows; r++) {
                const float *wrow = q.deq + r * cols, *xi = x + i * cols;
                double exact = 0, abs_sum = 0, quant_err = 0, min_sum = 0;
                for (int64_t k = 0; k < cols; k++) {
                    exact += (double)wrow[k] * xi[k];
                    abs_sum += fabs((double)wrow[k] * xi[k]);
                }
                for (int64_t k0 = 0; k0 < cols; k0 += xblk) {
                    double amax = 0, wsum = 0;
                    for (int64_t k = k0; k < k0 + xblk; k++) {
                        amax = fmax(amax, fabs((double)xi[k]));
                        wsum += fabs((double)wrow[k]);
                    }
                    quant_err += wsum * amax / 254.0;
                    double wmax = 0;
                    for (int64_t k = k0; k < k0 + xblk; k++) wmax = fmax(wmax, fabs((double)wrow[k]));
                    for (int64_t k = k0; k < k0 + xblk; k++) min_sum += 2 * wmax * fabs((double)xi[k]);
                }
                const double gpu_tol =
                    (gemm ? abs_sum * 0x1p-7 : (abs_sum + min_sum) * (double)cols * F32_U) + 1e-30;
                const double cpu_tol = abs_sum * (double)cols * F32_U + quant_err;
                const double g = yg[i * rows + r], c = yc[i * rows + r];
                const double e_abs = fabs(g - exact), e_rel = e_abs / (abs_sum + 1e-30);
                if (gemm) {
                    wst->gemm_abs = fmax(wst->gemm_abs, e_abs);
                    wst->gemm_rel = fmax(wst->gemm_rel, e_rel);
                } else {
                    wst->gemv_abs = fmax(wst->gemv_abs, e_abs);
                    wst->gemv_rel = fmax(wst->gemv_rel, e_rel);
                }
                const double e_ref = e_abs / gpu_tol, e_cpu = fabs(g - c) / (gpu_tol + cpu_tol);
                if (!(e_ref <= worst_ref)) {
                    worst_ref = isnan(e_ref) ? INFINITY : e_ref;
                    wi = i;
                    wr = r;
                }
                if (!(e_cpu <= worst_cpu)) worst_cpu = isnan(e_cpu) ? INFINITY : e_cpu;
            }
        cr_assert_leq(worst_ref, 1.0,
                      "matmul %s %lldx%lld n=%lld (x offset %lld): y[%lld][%lld] = %g is %.3g tolerances from the "
                      "exact product of the dequantized weights",
                      tname, (long long)rows, (long long)cols, (long long)n, (long long)runs[ri].x_offset,
                      (long long)wi, (long long)wr, (double)yg[wi * rows + wr], worst_ref);
        cr_assert_leq(worst_cpu, 1.0,
                      "matmul %s %lldx%lld n=%lld: the device and the CPU differ by %.3g times the sum of their "
                      "error bounds",
                      tname, (long long)rows, (long long)cols, (long long)n, worst_cpu);
        free(x);
        free(yg);
        free(yc);
    }
}

Test(cuda_quant, native_types_against_the_cpu) {
    REQUIRE_CUDA();
    pd_backend *cpu, *gpu;
    pd_error err = {0};
    cr_assert_eq(pd_backend_cpu_create(2, &cpu, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_backend_cuda_create(0, &gpu, &err), PD_OK, "%s", err.msg);
    qweight keep[N_NATIVE * 3];
    int n_keep = 0;
    for (size_t ti = 0; ti < N_NATIVE; ti++) {
        const pd_type t = native_types[ti];
        const int64_t qk = pd_type_get((uint32_t)t)->block_size;
        /* (rows, blocks per row): odd row counts; a row of 1 block, of 3,
         * and of 9 (more 8-element pieces than the GEMV block's threads
         * for the 256-element types, fewer for the 32-element ones). */
        static const int64_t shapes[][2] = {{157, 3}, {5, 9}, {1, 1}};
        worst w = {0};
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++)
            check_type(cpu, gpu, t, shapes[si][0], shapes[si][1] * qk, 1000 * (ti + 1) + si, &w,
                       &keep[n_keep++]);
        cr_log_info("%-7s gemv (n 1, 3, 8): max |err| %.3g, max |err|/sum|w x| %.3g; prefill (n 37): max |err| "
                    "%.3g, max |err|/sum|w x| %.3g",
                    pd_type_get((uint32_t)t)->name, w.gemv_abs, w.gemv_rel, w.gemm_abs, w.gemm_rel);
    }
    pd_backend_free(gpu);
    pd_backend_free(cpu);
    for (int i = 0; i < n_keep; i++) free_qweight(&keep[i]);
}

Test(cuda_quant, device_bytes_per_type) {
    /* No device needed: the accounting is a property of the build. */
    if (!pd_cuda_compiled()) {
        cr_assert_eq(pd_cuda_weight_bytes(PD_TYPE_Q4_K, 4, 256), 0);
        return;
    }
    /* A type the CPU cannot dequantize cannot be held either. */
    cr_assert_eq(pd_cuda_weight_bytes(PD_TYPE_Q8_1, 4, 256), 0);
    cr_assert_eq(pd_cuda_weight_bytes(PD_TYPE_Q5_1, 4, 256), 4 * 8 * 24);
    cr_assert_eq(pd_cuda_weight_bytes(PD_TYPE_BF16, 4, 256), 4 * 256 * 2);
    cr_assert_eq(pd_cuda_weight_bytes(PD_TYPE_F32, 4, 256), 4 * 256 * 4);
    cr_assert_eq(pd_cuda_weight_bytes(PD_TYPE_Q4_K, 4, 512), 4 * 2 * 144);
    cr_assert_eq(pd_cuda_weight_bytes(PD_TYPE_Q6_K, 3, 256), 3 * 210);
    cr_assert_eq(pd_cuda_weight_bytes(PD_TYPE_Q8_0, 3, 64), 3 * 2 * 34);
}
