/* The fused backend ops (kernels/backend.h: add_rmsnorm, matmul_multi,
 * matmul_glu, qkv_bias_rope) against the unfused sequences they replace,
 * on every backend this build has: the CPU, the CPU as a discrete device,
 * and CUDA (a GPU or cudaemu; those tests skip without a device).
 *
 * Tolerance: none. Each fused op is specified to equal its unfused sequence
 * bit for bit, and is built to: the CPU runs the same kernels in the same
 * order; on CUDA the fused kernels do the unfused kernels' float operations
 * in the same order (the same per-thread accumulation and block reduction
 * in the GEMV, the same rounding intrinsics in the elementwise parts). So
 * any difference is a bug, and the comparison is memcmp.
 *
 * Then the launch counter of the CUDA backend: every launch site counts
 * (a scan of the .cu files in kernels/cuda), the count equals what cudaemu itself ran,
 * and a decode step of a llama-shaped model launches at most
 * FUSED_DECODE_LAUNCHES_PER_LAYER_* kernels per layer (docs/gpu.md lists
 * them). */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "helpers.h"
#include "kernels/kernels.h"
#include "tools/tools.h"

/* docs/gpu.md, "Launches per decode step": a llama layer at batch 1..8
 * with an f32 KV cache, and with an f16 one (K and V converted before they
 * are appended), over a context short enough for one attention launch. */
#define FUSED_DECODE_LAUNCHES_PER_LAYER_F32_KV 9
#define FUSED_DECODE_LAUNCHES_PER_LAYER_F16_KV 11

/* cudaemu's own counts (tests/cudaemu): weak, so a build for a real GPU
 * links without them and the comparison skips. */
extern uint64_t cudaemu_kernel_launches(void) __attribute__((weak));
extern uint64_t cudaemu_library_calls(void) __attribute__((weak));

static void *xmalloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    cr_assert_not_null(p, "out of memory (%zu bytes)", bytes);
    return p;
}

/* The whole file, NUL-terminated, malloc'd; NULL when it cannot be read. */
static char *read_text(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = NULL;
    size_t len = 0, cap = 0, got;
    char chunk[65536];
    while ((got = fread(chunk, 1, sizeof chunk, f)) > 0) {
        if (len + got + 1 > cap) {
            cap = (len + got + 1) * 2;
            char *nb = realloc(buf, cap);
            if (!nb) {
                free(buf), fclose(f);
                return NULL;
            }
            buf = nb;
        }
        memcpy(buf + len, chunk, got);
        len += got;
    }
    fclose(f);
    if (!buf && !(buf = malloc(1))) return NULL;
    buf[len] = '\0';
    return buf;
}

static double unit(uint64_t *s) { return (double)(pd_splitmix64(s) >> 11) * 0x1p-53; }

static void fill(float *x, int64_t n, float a, uint64_t seed) {
    uint64_t s = seed;
    for (int64_t i = 0; i < n; i++) x[i] = (float)((2.0 * unit(&s) - 1.0) * a);
}

/* ------------------------------------------------------------------------
 * backends
 * ------------------------------------------------------------------------ */

enum { MAX_BACKENDS = 3 };

/* Every backend of this build: cpu, cpu-discrete, and cuda:0 when a device
 * is present. */
static int open_all(pd_backend **be) {
    pd_error err = {0};
    int n = 0;
    cr_assert_eq(pd_backend_cpu_create(2, &be[n++], &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_backend_cpu_discrete_create(2, &be[n++], &err), PD_OK, "%s", err.msg);
    if (pd_cuda_device_count() > 0) cr_assert_eq(pd_backend_cuda_create(0, &be[n++], &err), PD_OK, "%s", err.msg);
    else cr_log_info("no CUDA device: the fused ops are checked on the CPU backends only");
    return n;
}

static void close_all(pd_backend **be, int n) {
    for (int i = 0; i < n; i++) pd_backend_free(be[i]);
}

static void *be_put(pd_backend *be, const void *host, size_t bytes) {
    pd_error err = {0};
    void *p = pd_backend_alloc(be, bytes ? bytes : 1, &err);
    cr_assert_not_null(p, "%s: alloc: %s", pd_backend_name(be), err.msg);
    if (host && bytes) cr_assert_eq(pd_backend_upload(be, p, host, bytes, &err), PD_OK, "upload: %s", err.msg);
    return p;
}

static void be_get(pd_backend *be, void *host, const void *src, size_t bytes) {
    pd_error err = {0};
    cr_assert_eq(pd_backend_download(be, host, src, bytes, &err), PD_OK, "%s: download: %s", pd_backend_name(be),
                 err.msg);
}

static void be_ok(pd_backend *be, int rc, const pd_error *err, const char *what) {
    cr_assert_eq(rc, PD_OK, "%s on %s: %s", what, pd_backend_name(be), err->msg);
}

/* The first float that differs, for messages; -1 when equal bit for bit. */
static int64_t first_diff(const float *a, const float *b, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (memcmp(&a[i], &b[i], sizeof(float)) != 0) return i;
    return -1;
}

#define ASSERT_SAME(a, b, n, ...)                                                                                      \
    do {                                                                                                               \
        const int64_t at_ = first_diff((a), (b), (n));                                                                 \
        cr_assert_eq(at_, -1, __VA_ARGS__);                                                                            \
    } while (0)

/* ------------------------------------------------------------------------
 * add_rmsnorm
 * ------------------------------------------------------------------------ */

static void check_add_rmsnorm(pd_backend *be, int64_t n, int64_t dim, bool with_weight, bool out_is_h) {
    pd_error err = {0};
    const size_t bytes = sizeof(float) * (size_t)(n * dim);
    float *x = xmalloc(bytes), *h = xmalloc(bytes), *w = xmalloc(sizeof(float) * (size_t)dim);
    fill(x, n * dim, 3.0f, 1 + (uint64_t)dim);
    fill(h, n * dim, 1.5f, 2 + (uint64_t)n);
    fill(w, dim, 2.0f, 3);
    float *rx = xmalloc(bytes), *rout = xmalloc(bytes), *fx = xmalloc(bytes), *fout = xmalloc(bytes);
    /* Unfused: add, then rmsnorm into a separate buffer. */
    float *dx = be_put(be, x, bytes), *dh = be_put(be, h, bytes), *dw = with_weight ? be_put(be, w, sizeof(float) * (size_t)dim) : NULL;
    float *dout = be_put(be, NULL, bytes);
    be_ok(be, pd_backend_add(be, dx, dh, n, dim, dim, &err), &err, "add");
    be_ok(be, pd_backend_rmsnorm(be, dx, dw, n, dim, 1e-5f, dout, &err), &err, "rmsnorm");
    be_get(be, rx, dx, bytes);
    be_get(be, rout, dout, bytes);
    /* Fused, from the same inputs. */
    cr_assert_eq(pd_backend_upload(be, dx, x, bytes, &err), PD_OK, "%s", err.msg);
    float *target = out_is_h ? dh : dout;
    be_ok(be, pd_backend_add_rmsnorm(be, dx, dh, dw, n, dim, 1e-5f, target, &err), &err, "add_rmsnorm");
    be_get(be, fx, dx, bytes);
    be_get(be, fout, target, bytes);
    ASSERT_SAME(fx, rx, n * dim, "%s: add_rmsnorm's x differs from add's (n %lld, dim %lld)", pd_backend_name(be),
                (long long)n, (long long)dim);
    ASSERT_SAME(fout, rout, n * dim, "%s: add_rmsnorm's out differs from rmsnorm's (n %lld, dim %lld, out %s)",
                pd_backend_name(be), (long long)n, (long long)dim, out_is_h ? "= h" : "separate");
    pd_backend_release(be, dx);
    pd_backend_release(be, dh);
    pd_backend_release(be, dw);
    pd_backend_release(be, dout);
    free(x), free(h), free(w), free(rx), free(rout), free(fx), free(fout);
}

Test(fused, add_rmsnorm_equals_add_then_rmsnorm) {
    pd_backend *be[MAX_BACKENDS];
    const int nb = open_all(be);
    for (int i = 0; i < nb; i++) {
        check_add_rmsnorm(be[i], 1, 64, true, true);
        check_add_rmsnorm(be[i], 7, 300, true, false);
        check_add_rmsnorm(be[i], 3, 4096, false, true);  /* wide rows: the CUDA kernel's 1024 threads */
        check_add_rmsnorm(be[i], 200, 512, true, true);  /* the CPU's thread pool */
    }
    close_all(be, nb);
}

/* ------------------------------------------------------------------------
 * weights of every type
 * ------------------------------------------------------------------------ */

static const pd_type all_types[] = {PD_TYPE_F32,  PD_TYPE_F16,  PD_TYPE_BF16, PD_TYPE_Q8_0,  PD_TYPE_Q4_0,
                                    PD_TYPE_Q4_1, PD_TYPE_Q5_0, PD_TYPE_Q5_1, PD_TYPE_IQ4_NL, PD_TYPE_Q2_K,
                                    PD_TYPE_Q3_K, PD_TYPE_Q4_K, PD_TYPE_Q5_K, PD_TYPE_Q6_K, PD_TYPE_IQ4_XS};
#define N_TYPES (sizeof all_types / sizeof all_types[0])

/* Encoded rows must outlive the backends: the CUDA backend keys its copy of
 * a weight by host pointer. */
typedef struct tweight {
    pd_weight w;
    void *data;
} tweight;

static tweight make_weight(pd_type t, int64_t rows, int64_t cols, uint64_t seed) {
    tweight tw = {0};
    pd_error err = {0};
    uint64_t rb;
    cr_assert_eq(pd_type_row_size(t, (uint64_t)cols, &rb, &err), PD_OK, "%s", err.msg);
    float *vals = xmalloc(sizeof(float) * (size_t)cols);
    tw.data = xmalloc((size_t)rb * (size_t)rows);
    uint64_t s = seed;
    for (int64_t i = 0; i < rows; i++) {
        const double scale = 0.05 + unit(&s);
        for (int64_t j = 0; j < cols; j++) vals[j] = (float)((2.0 * unit(&s) - 1.0) * scale);
        cr_assert_eq(pd_quantize_row(t, vals, (uint8_t *)tw.data + (size_t)i * rb, (uint64_t)cols, &err), PD_OK,
                     "%s", err.msg);
    }
    free(vals);
    cr_assert_eq(pd_weight_init(&tw.w, t, tw.data, rows, cols, &err), PD_OK, "%s", err.msg);
    return tw;
}

/* ------------------------------------------------------------------------
 * matmul_glu
 * ------------------------------------------------------------------------ */

/* On be: matmul_glu against matmul, matmul, swiglu/geglu; n tokens with x
 * placed x_offset floats into its buffer (1: not 16-byte aligned). */
static void check_glu(pd_backend *be, const tweight *gate, const tweight *up, int64_t n, int64_t x_offset, pd_glu act) {
    pd_error err = {0};
    const int64_t rows = gate->w.rows, cols = gate->w.cols;
    const size_t xb = sizeof(float) * (size_t)(n * cols), yb = sizeof(float) * (size_t)(n * rows);
    float *x = xmalloc(xb), *ref = xmalloc(yb), *got = xmalloc(yb);
    fill(x, n * cols, 1.0f, 40 + (uint64_t)n);
    float *dxb = be_put(be, NULL, xb + sizeof(float) * (size_t)x_offset), *dx = dxb + x_offset;
    cr_assert_eq(pd_backend_upload(be, dx, x, xb, &err), PD_OK, "%s", err.msg);
    float *dg = be_put(be, NULL, yb), *du = be_put(be, NULL, yb);
    be_ok(be, pd_backend_matmul(be, &gate->w, dx, n, dg, &err), &err, "matmul (gate)");
    be_ok(be, pd_backend_matmul(be, &up->w, dx, n, du, &err), &err, "matmul (up)");
    be_ok(be, act == PD_GLU_SILU ? pd_backend_swiglu(be, dg, du, n * rows, dg, &err)
                                 : pd_backend_geglu(be, dg, du, n * rows, dg, &err),
          &err, "glu");
    be_get(be, ref, dg, yb);
    be_ok(be, pd_backend_matmul_glu(be, &gate->w, &up->w, dx, n, act, dg, du, &err), &err, "matmul_glu");
    be_get(be, got, dg, yb);
    const pd_type_traits *tr = pd_type_get((uint32_t)gate->w.type);
    ASSERT_SAME(got, ref, n * rows, "%s: matmul_glu (%s, %s, %lld tokens, x offset %lld) differs from the unfused ops",
                pd_backend_name(be), tr ? tr->name : "?", act == PD_GLU_SILU ? "silu" : "gelu", (long long)n,
                (long long)x_offset);
    pd_backend_release(be, dxb);
    pd_backend_release(be, dg);
    pd_backend_release(be, du);
    free(x), free(ref), free(got);
}

Test(fused, matmul_glu_equals_matmuls_then_glu_every_type) {
    pd_backend *be[MAX_BACKENDS];
    const int nb = open_all(be);
    /* 2 rows of 256-element blocks would leave the GEMV's last block half
     * empty: 37 rows (odd for the 1- and 2-row halves), 512 columns (two
     * k-quant blocks, 16 of the 32-element ones). */
    const int64_t rows = 37, cols = 512;
    for (size_t t = 0; t < N_TYPES; t++) {
        tweight g = make_weight(all_types[t], rows, cols, 100 + t), u = make_weight(all_types[t], rows, cols, 200 + t);
        for (int i = 0; i < nb; i++) {
            static const int64_t ns[] = {1, 2, 3, 8, 11}; /* 11: the GEMM path + elementwise */
            for (size_t k = 0; k < sizeof ns / sizeof *ns; k++) check_glu(be[i], &g, &u, ns[k], 0, PD_GLU_SILU);
            check_glu(be[i], &g, &u, 4, 0, PD_GLU_GELU);
            check_glu(be[i], &g, &u, 3, 1, PD_GLU_SILU); /* x not 16-byte aligned */
        }
        for (int i = 0; i < nb; i++) pd_backend_forget_weight(be[i], &g.w), pd_backend_forget_weight(be[i], &u.w);
        free(g.data), free(u.data);
    }
    close_all(be, nb);
}

/* ------------------------------------------------------------------------
 * matmul_multi
 * ------------------------------------------------------------------------ */

static void check_multi(pd_backend *be, const tweight *ws, int n_w, int64_t n) {
    pd_error err = {0};
    const int64_t cols = ws[0].w.cols;
    const size_t xb = sizeof(float) * (size_t)(n * cols);
    float *x = xmalloc(xb);
    fill(x, n * cols, 1.0f, 60 + (uint64_t)n);
    float *dx = be_put(be, x, xb);
    const pd_weight *wp[PD_MATMUL_MULTI_MAX];
    float *dy[PD_MATMUL_MULTI_MAX], *ref[PD_MATMUL_MULTI_MAX], *got[PD_MATMUL_MULTI_MAX];
    for (int j = 0; j < n_w; j++) {
        const size_t yb = sizeof(float) * (size_t)(n * ws[j].w.rows);
        wp[j] = &ws[j].w;
        dy[j] = be_put(be, NULL, yb);
        ref[j] = xmalloc(yb), got[j] = xmalloc(yb);
        be_ok(be, pd_backend_matmul(be, wp[j], dx, n, dy[j], &err), &err, "matmul");
        be_get(be, ref[j], dy[j], yb);
    }
    be_ok(be, pd_backend_matmul_multi(be, wp, n_w, dx, n, dy, &err), &err, "matmul_multi");
    const pd_type_traits *tr = pd_type_get((uint32_t)ws[0].w.type);
    for (int j = 0; j < n_w; j++) {
        be_get(be, got[j], dy[j], sizeof(float) * (size_t)(n * ws[j].w.rows));
        ASSERT_SAME(got[j], ref[j], n * ws[j].w.rows, "%s: matmul_multi output %d of %d (%s, %lld tokens) differs",
                    pd_backend_name(be), j, n_w, tr ? tr->name : "?", (long long)n);
        pd_backend_release(be, dy[j]);
        free(ref[j]), free(got[j]);
    }
    pd_backend_release(be, dx);
    free(x);
}

Test(fused, matmul_multi_equals_separate_matmuls_every_type) {
    pd_backend *be[MAX_BACKENDS];
    const int nb = open_all(be);
    /* Q, K, V of a GQA layer: 64 + 16 + 16 rows, odd counts too (the last
     * block of each weight half full). */
    const int64_t rows[3] = {64, 17, 15}, cols = 256;
    for (size_t t = 0; t < N_TYPES; t++) {
        tweight ws[3];
        for (int j = 0; j < 3; j++) ws[j] = make_weight(all_types[t], rows[j], cols, 300 + 10 * t + (uint64_t)j);
        for (int i = 0; i < nb; i++) {
            check_multi(be[i], ws, 3, 1);
            check_multi(be[i], ws, 3, 5);
            check_multi(be[i], ws, 3, 8);
            check_multi(be[i], ws, 2, 2);
            check_multi(be[i], ws, 3, 12); /* the GEMM path */
        }
        for (int j = 0; j < 3; j++) {
            for (int i = 0; i < nb; i++) pd_backend_forget_weight(be[i], &ws[j].w);
            free(ws[j].data);
        }
    }
    /* Mixed types: one launch cannot serve them, the result is the same.
     * On the CPU the second set needs three activation layouts in one job
     * (q8_K reordered for q4_K on AVX-512, q8_K, q8_0), the third shares
     * one between q4_K and q5_K. */
    const pd_type sets[3][3] = {{PD_TYPE_BF16, PD_TYPE_Q8_0, PD_TYPE_F32},
                                {PD_TYPE_Q4_K, PD_TYPE_Q6_K, PD_TYPE_Q8_0},
                                {PD_TYPE_Q4_K, PD_TYPE_Q5_K, PD_TYPE_Q6_K}};
    for (int k = 0; k < 3; k++) {
        tweight mixed[3] = {make_weight(sets[k][0], 32, cols, 1), make_weight(sets[k][1], 8, cols, 2),
                            make_weight(sets[k][2], 8, cols, 3)};
        for (int i = 0; i < nb; i++) {
            check_multi(be[i], mixed, 3, 1);
            check_multi(be[i], mixed, 3, 4);
            for (int j = 0; j < 3; j++) pd_backend_forget_weight(be[i], &mixed[j].w);
        }
        for (int j = 0; j < 3; j++) free(mixed[j].data);
    }
    /* weights of different widths cannot share x: refused, not misread */
    tweight narrow = make_weight(PD_TYPE_Q8_0, 8, cols, 4), wide = make_weight(PD_TYPE_Q8_0, 8, 2 * cols, 5);
    const pd_weight *pair[2] = {&narrow.w, &wide.w};
    float x[2 * 256] = {0}, y0[8], y1[8];
    float *ys[2] = {y0, y1};
    pd_error err = {0};
    cr_assert_eq(pd_backend_matmul_multi(be[0], pair, 2, x, 1, ys, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "columns") != NULL, "message: %s", err.msg);
    free(narrow.data), free(wide.data);
    close_all(be, nb);
}

/* ------------------------------------------------------------------------
 * qkv_bias_rope
 * ------------------------------------------------------------------------ */

typedef struct qkv_case {
    int64_t n;
    int n_head, n_head_kv, head_dim;
    bool bq, bk, bv, rope;
    pd_rope_mode mode;
    int n_rot;
    bool factors;
} qkv_case;

static void check_qkv(pd_backend *be, const qkv_case *c) {
    pd_error err = {0};
    const int64_t qd = (int64_t)c->n_head * c->head_dim, kvd = (int64_t)c->n_head_kv * c->head_dim;
    const size_t qb = sizeof(float) * (size_t)(c->n * qd), kb = sizeof(float) * (size_t)(c->n * kvd);
    float *q = xmalloc(qb), *k = xmalloc(kb), *v = xmalloc(kb), *bias = xmalloc(sizeof(float) * (size_t)(qd + 2 * kvd));
    fill(q, c->n * qd, 2.0f, 7), fill(k, c->n * kvd, 2.0f, 8), fill(v, c->n * kvd, 2.0f, 9);
    fill(bias, qd + 2 * kvd, 0.5f, 10);
    int32_t *pos = xmalloc(sizeof(int32_t) * (size_t)c->n);
    for (int64_t t = 0; t < c->n; t++) pos[t] = (int32_t)(3 + 977 * t); /* far positions: large angles */
    float factors[PD_ROPE_MAX_FACTORS];
    for (int i = 0; i < PD_ROPE_MAX_FACTORS; i++) factors[i] = 1.0f + (float)(i % 5);
    const pd_rope_params rp = {.mode = c->mode, .n_rot = c->n_rot, .freq_base = 10000.0f,
                               .freq_factors = c->factors ? factors : NULL};
    float *dq = be_put(be, q, qb), *dk = be_put(be, k, kb), *dv = be_put(be, v, kb);
    float *dbias = be_put(be, bias, sizeof(float) * (size_t)(qd + 2 * kvd));
    int32_t *dpos = be_put(be, pos, sizeof(int32_t) * (size_t)c->n);
    const float *bq = c->bq ? dbias : NULL, *bk = c->bk ? dbias + qd : NULL, *bv = c->bv ? dbias + qd + kvd : NULL;
    /* Unfused: adds, then rope of q and k. */
    if (bq) be_ok(be, pd_backend_add(be, dq, bq, c->n, qd, 0, &err), &err, "add bq");
    if (bk) be_ok(be, pd_backend_add(be, dk, bk, c->n, kvd, 0, &err), &err, "add bk");
    if (bv) be_ok(be, pd_backend_add(be, dv, bv, c->n, kvd, 0, &err), &err, "add bv");
    if (c->rope) {
        be_ok(be, pd_backend_rope(be, dq, dpos, c->n, c->n_head, c->head_dim, &rp, &err), &err, "rope q");
        be_ok(be, pd_backend_rope(be, dk, dpos, c->n, c->n_head_kv, c->head_dim, &rp, &err), &err, "rope k");
    }
    float *rq = xmalloc(qb), *rk = xmalloc(kb), *rv = xmalloc(kb);
    be_get(be, rq, dq, qb), be_get(be, rk, dk, kb), be_get(be, rv, dv, kb);
    /* Fused, from the same inputs. */
    cr_assert_eq(pd_backend_upload(be, dq, q, qb, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_backend_upload(be, dk, k, kb, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_backend_upload(be, dv, v, kb, &err), PD_OK, "%s", err.msg);
    const pd_qkv_args a = {.q = dq, .k = dk, .v = dv, .bq = bq, .bk = bk, .bv = bv, .pos = dpos, .n = c->n,
                           .n_head = c->n_head, .n_head_kv = c->n_head_kv, .head_dim = c->head_dim,
                           .rope = c->rope ? &rp : NULL};
    be_ok(be, pd_backend_qkv_bias_rope(be, &a, &err), &err, "qkv_bias_rope");
    float *gq = xmalloc(qb), *gk = xmalloc(kb), *gv = xmalloc(kb);
    be_get(be, gq, dq, qb), be_get(be, gk, dk, kb), be_get(be, gv, dv, kb);
    const char *name = pd_backend_name(be);
    ASSERT_SAME(gq, rq, c->n * qd, "%s: qkv_bias_rope's q differs (head_dim %d, n_rot %d, mode %d, biases %d%d%d)", name,
                c->head_dim, c->n_rot, (int)c->mode, c->bq, c->bk, c->bv);
    ASSERT_SAME(gk, rk, c->n * kvd, "%s: qkv_bias_rope's k differs (head_dim %d, n_rot %d, mode %d)", name, c->head_dim,
                c->n_rot, (int)c->mode);
    ASSERT_SAME(gv, rv, c->n * kvd, "%s: qkv_bias_rope's v differs (bias %d)", name, c->bv);
    pd_backend_release(be, dq), pd_backend_release(be, dk), pd_backend_release(be, dv);
    pd_backend_release(be, dbias), pd_backend_release(be, dpos);
    free(q), free(k), free(v), free(bias), free(pos), free(rq), free(rk), free(rv), free(gq), free(gk), free(gv);
}

Test(fused, qkv_bias_rope_equals_adds_then_rope) {
    pd_backend *be[MAX_BACKENDS];
    const int nb = open_all(be);
    const qkv_case cases[] = {
        /* llama: no biases, adjacent pairs, every dimension rotated */
        {1, 8, 2, 64, false, false, false, true, PD_ROPE_NORM, 64, false},
        /* qwen2: q/k/v biases, NeoX halves, a decode batch */
        {8, 4, 2, 32, true, true, true, true, PD_ROPE_NEOX, 32, false},
        /* partial rotation (phi3-like) with llama3 frequency factors */
        {3, 6, 3, 96, true, false, true, true, PD_ROPE_NEOX, 48, true},
        {5, 2, 1, 128, false, true, false, true, PD_ROPE_NORM, 64, true},
        /* biases only (rope NULL), and only a v bias */
        {4, 4, 4, 16, true, true, true, false, PD_ROPE_NORM, 16, false},
        {2, 4, 2, 16, false, false, true, false, PD_ROPE_NORM, 16, false},
        /* a prefill-sized batch, head_dim 256 (gemma) */
        {300, 2, 1, 256, true, true, false, true, PD_ROPE_NEOX, 256, false},
    };
    for (int i = 0; i < nb; i++)
        for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) check_qkv(be[i], &cases[c]);
    close_all(be, nb);
}

/* ------------------------------------------------------------------------
 * launch counting (CUDA)
 * ------------------------------------------------------------------------ */

#define REQUIRE_CUDA()                                                                                                 \
    do {                                                                                                               \
        if (pd_cuda_device_count() == 0)                                                                               \
            cr_skip_test("no CUDA device (compiled in: %s)", pd_cuda_compiled() ? "yes" : "no");                       \
    } while (0)

/* Every kernel launch in the .cu files of kernels/cuda names its stream through
 * cuda_launch_stream(cb), and every cuBLAS/cuSOLVER call that enqueues work
 * its handle through cuda_launch_blas/cuda_launch_solver, which count it:
 * a launch written any other way would go uncounted. */
Test(fused, every_cuda_launch_site_counts) {
    const char *root = getenv("PD_SOURCE_ROOT");
    if (!root) cr_skip_test("PD_SOURCE_ROOT is not set (run through meson test)");
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/kernels/cuda", root);
    DIR *d = opendir(dir);
    cr_assert_not_null(d, "cannot open %s", dir);
    static const char *work_calls[] = {"cublasGemmEx(", "cublasSgemm(", "cublasDgemmStridedBatched(",
                                       "cublasDtrsmBatched(", "cusolverDnDpotrfBatched("};
    int files = 0, launches = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        const size_t len = strlen(de->d_name);
        if (len < 4 || strcmp(de->d_name + len - 3, ".cu") != 0 || strcmp(de->d_name, "device.cu") == 0) continue;
        char path[2048];
        snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
        char *text = read_text(path);
        cr_assert_not_null(text, "cannot read %s", path);
        files++;
        for (char *p = strstr(text, "<<<"); p; p = strstr(p + 3, "<<<")) {
            char *end = strstr(p, ">>>");
            cr_assert_not_null(end, "%s: <<< without >>>", de->d_name);
            const size_t n = (size_t)(end - p);
            char *cfg = xmalloc(n + 1);
            memcpy(cfg, p, n), cfg[n] = '\0';
            int line = 1;
            for (const char *q = text; q < p; q++) line += *q == '\n';
            cr_assert_not_null(strstr(cfg, "cuda_launch_stream("),
                               "%s:%d: a kernel launch whose stream is not cuda_launch_stream(cb): it goes uncounted",
                               de->d_name, line);
            free(cfg);
            launches++;
        }
        for (size_t w = 0; w < sizeof work_calls / sizeof *work_calls; w++)
            for (char *p = strstr(text, work_calls[w]); p; p = strstr(p + 1, work_calls[w])) {
                const char *args = strchr(p, '(');
                cr_assert(strncmp(args + 1, "cuda_launch_blas(", 17) == 0 || strncmp(args + 1, "cuda_launch_solver(", 19) == 0,
                          "%s: a %.*s call whose handle is not counted (cuda_launch_blas/cuda_launch_solver)",
                          de->d_name, (int)(args - p), p);
            }
        free(text);
    }
    closedir(d);
    cr_assert_geq(files, 6, "found %d .cu files in %s", files, dir);
    cr_assert_geq(launches, 30, "found only %d launches", launches);
}

static uint64_t be_launches(const pd_backend *be) {
    pd_backend_counters c;
    pd_backend_counters_get(be, &c);
    return c.launches;
}

static uint64_t emu_launches(void) { return cudaemu_kernel_launches() + cudaemu_library_calls(); }

static char *write_model(const char *dir, const char *name, const char *arch, pd_type wtype, int n_layer) {
    char *path = xmalloc(1024);
    snprintf(path, 1024, "%s/%s", dir, name);
    pd_testmodel_opts o;
    pd_error err = {0};
    cr_assert_eq(pd_testmodel_preset("tiny", &o, &err), PD_OK, "%s", err.msg);
    o.arch = arch;
    o.wtype = wtype;
    o.n_embd = 128;
    o.n_ff = 256;
    o.n_head = 4;
    o.n_head_kv = 2;
    o.n_layer = n_layer;
    o.n_ctx = 256;
    o.seed = 5;
    cr_assert_eq(pd_testmodel_write(&o, path, NULL, &err), PD_OK, "%s", err.msg);
    return path;
}

static pd_model *load_on(const char *path, pd_backend *be, bool kv_f32) {
    pd_model *m = NULL;
    pd_error err = {0};
    pd_model_params p = {.n_threads = 2, .backend = be, .kv_f32 = kv_f32};
    cr_assert_eq(pd_model_load(path, &p, &m, &err), PD_OK, "%s: %s", path, err.msg);
    return m;
}

/* Launches of one decode step of `batch` sequences after a short prefill
 * each, as the backend counts them; *emu what cudaemu ran meanwhile. */
static uint64_t decode_launches(const char *path, pd_backend *be, int batch, bool kv_f32, uint64_t *emu) {
    pd_error err = {0};
    pd_model *m = load_on(path, be, kv_f32);
    const int32_t V = pd_model_hparams(m)->n_vocab;
    float *logits = xmalloc(sizeof(float) * (size_t)V * (size_t)batch);
    pd_seq *seqs[8];
    const pd_token prompt[5] = {1, 5, 9, 13, 17};
    pd_token next[8];
    for (int s = 0; s < batch; s++) {
        cr_assert_eq(pd_seq_create(m, 0, &seqs[s], &err), PD_OK, "%s", err.msg);
        cr_assert_eq(pd_prefill(m, seqs[s], prompt, 5, NULL, logits, &err), PD_OK, "%s", err.msg);
        next[s] = (pd_token)(20 + s);
    }
    cr_assert_eq(pd_backend_sync(be, &err), PD_OK, "%s", err.msg);
    const uint64_t b0 = be_launches(be), e0 = emu_launches();
    cr_assert_eq(pd_decode(m, seqs, next, batch, logits, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_backend_sync(be, &err), PD_OK, "%s", err.msg);
    const uint64_t used = be_launches(be) - b0;
    *emu = emu_launches() - e0;
    for (int s = 0; s < batch; s++) pd_seq_free(seqs[s]);
    pd_model_free(m);
    free(logits);
    return used;
}

/* The backend's count equals what cudaemu itself ran, op by op and over
 * whole decode and prefill steps (GEMV, GEMM with cuBLAS, every fused op). */
Test(fused, launch_count_equals_what_cudaemu_ran) {
    REQUIRE_CUDA();
    if (!cudaemu_kernel_launches || !cudaemu_library_calls) cr_skip_test("not running on cudaemu");
    pd_error err = {0};
    pd_backend *be = NULL;
    cr_assert_eq(pd_backend_cuda_create(0, &be, &err), PD_OK, "%s", err.msg);
    char *dir = th_mkdtemp();
    cr_assert_not_null(dir);
    char *path = write_model(dir, "llama.gguf", "llama", PD_TYPE_BF16, 2);
    uint64_t emu;
    for (int batch = 1; batch <= 8; batch += 7)
        for (int kv_f32 = 0; kv_f32 < 2; kv_f32++) {
            const uint64_t used = decode_launches(path, be, batch, kv_f32, &emu);
            cr_assert_eq(used, emu, "decode of %d (%s KV): the backend counted %llu launches, cudaemu ran %llu", batch,
                         kv_f32 ? "f32" : "f16", (unsigned long long)used, (unsigned long long)emu);
        }
    /* Single ops, the GEMM paths included. */
    tweight wb = make_weight(PD_TYPE_BF16, 40, 256, 1), wq = make_weight(PD_TYPE_Q4_K, 40, 256, 2),
            wf = make_weight(PD_TYPE_F32, 40, 256, 3), wh = make_weight(PD_TYPE_F16, 40, 256, 4);
    float *x = be_put(be, NULL, sizeof(float) * 20 * 256), *y = be_put(be, NULL, sizeof(float) * 20 * 40);
    float *up = be_put(be, NULL, sizeof(float) * 20 * 40);
    const tweight *ws[] = {&wb, &wq, &wf, &wh};
    for (size_t i = 0; i < 4; i++)
        for (int64_t n = 1; n <= 20; n += 19) {
            cr_assert_eq(pd_backend_sync(be, &err), PD_OK, "%s", err.msg);
            const uint64_t b0 = be_launches(be), e0 = emu_launches();
            cr_assert_eq(pd_backend_matmul(be, &ws[i]->w, x, n, y, &err), PD_OK, "%s", err.msg);
            cr_assert_eq(pd_backend_matmul_glu(be, &ws[i]->w, &ws[i]->w, x, n, PD_GLU_SILU, y, up, &err), PD_OK, "%s",
                         err.msg);
            cr_assert_eq(pd_backend_sync(be, &err), PD_OK, "%s", err.msg);
            cr_assert_eq(be_launches(be) - b0, emu_launches() - e0, "weight %zu, %lld tokens: counted %llu, ran %llu",
                         i, (long long)n, (unsigned long long)(be_launches(be) - b0),
                         (unsigned long long)(emu_launches() - e0));
        }
    pd_backend_release(be, x), pd_backend_release(be, y), pd_backend_release(be, up);
    pd_backend_free(be);
    free(wb.data), free(wq.data), free(wf.data), free(wh.data);
    th_rmtree(dir);
    free(path);
    free(dir);
}

/* A decode step of a llama-shaped model launches at most
 * FUSED_DECODE_LAUNCHES_PER_LAYER_* kernels per layer: the difference
 * between a 4-layer and a 2-layer model of the same shape, halved. */
Test(fused, decode_launches_per_layer) {
    REQUIRE_CUDA();
    pd_error err = {0};
    pd_backend *be = NULL;
    cr_assert_eq(pd_backend_cuda_create(0, &be, &err), PD_OK, "%s", err.msg);
    char *dir = th_mkdtemp();
    cr_assert_not_null(dir);
    char *p2 = write_model(dir, "l2.gguf", "llama", PD_TYPE_Q8_0, 2), *p4 = write_model(dir, "l4.gguf", "llama", PD_TYPE_Q8_0, 4);
    for (int kv_f32 = 0; kv_f32 < 2; kv_f32++)
        for (int batch = 1; batch <= 8; batch += 7) {
            const uint64_t bound = kv_f32 ? FUSED_DECODE_LAUNCHES_PER_LAYER_F32_KV : FUSED_DECODE_LAUNCHES_PER_LAYER_F16_KV;
            uint64_t emu;
            const uint64_t l2 = decode_launches(p2, be, batch, kv_f32, &emu), l4 = decode_launches(p4, be, batch, kv_f32, &emu);
            cr_assert_gt(l4, l2);
            const uint64_t per_layer = (l4 - l2) / 2;
            cr_log_info("decode of %d, %s KV: %llu launches with 2 layers, %llu with 4: %llu per layer", batch,
                        kv_f32 ? "f32" : "f16", (unsigned long long)l2, (unsigned long long)l4,
                        (unsigned long long)per_layer);
            cr_assert_eq((l4 - l2) % 2, 0, "layers launch unevenly: %llu vs %llu", (unsigned long long)l2,
                         (unsigned long long)l4);
            cr_assert_leq(per_layer, bound, "decode of %d, %s KV: %llu launches per layer, the design's bound is %llu (docs/gpu.md)",
                          batch, kv_f32 ? "f32" : "f16", (unsigned long long)per_layer, (unsigned long long)bound);
        }
    pd_backend_free(be);
    th_rmtree(dir);
    free(p2), free(p4), free(dir);
}
