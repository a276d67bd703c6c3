/* The CPU backend: SIMD level selection, the vtable, scratch memory and the
 * light element-wise operations (get_rows, rmsnorm, rope, swiglu). matmul.c
 * and attention.c hold the heavy ones. */
#include <cblas.h>
#include <math.h>
#include <malloc.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "kernels/cpu/cpu_internal.h"
#include "kernels/backend_impl.h"

#if PD_X86
#include <cpuid.h>
#endif

/* ------------------------------------------------------------------------
 * SIMD level
 * ------------------------------------------------------------------------ */

static cpu_simd_level best_level(void) {
#if PD_X86
    __builtin_cpu_init();
    if (!(cpu_has_f16c() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")))
        return CPU_SIMD_SCALAR;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512vnni"))
        return CPU_SIMD_AVX512;
    return CPU_SIMD_AVX2;
#else
    return CPU_SIMD_SCALAR;
#endif
}

/* Parse $PD_CPU_SIMD; returns false for a value we do not know. */
static bool env_level(cpu_simd_level best, cpu_simd_level *out, const char **bad) {
    const char *v = getenv("PD_CPU_SIMD");
    *out = best;
    *bad = NULL;
    if (!v || !*v || strcasecmp(v, "auto") == 0) return true;
    cpu_simd_level want;
    if (strcasecmp(v, "scalar") == 0)
        want = CPU_SIMD_SCALAR;
    else if (strcasecmp(v, "avx2") == 0)
        want = CPU_SIMD_AVX2;
    else if (strcasecmp(v, "avx512") == 0 || strcasecmp(v, "avx512vnni") == 0)
        want = CPU_SIMD_AVX512;
    else {
        *bad = v;
        return false;
    }
    *out = want < best ? want : best; /* never above what the CPU has */
    return true;
}

cpu_simd_level cpu_simd_detect(void) {
    cpu_simd_level l;
    const char *bad;
    env_level(best_level(), &l, &bad);
    return l;
}

const char *cpu_simd_level_name(cpu_simd_level l) {
    switch (l) {
    case CPU_SIMD_AVX512: return "avx512vnni";
    case CPU_SIMD_AVX2: return "avx2";
    default: return "scalar";
    }
}

const char *pd_cpu_simd_name(void) {
    return cpu_simd_level_name(cpu_simd_detect());
}

/* ------------------------------------------------------------------------
 * weights and scratch
 * ------------------------------------------------------------------------ */

int pd_weight_init(pd_weight *w, pd_type type, const void *data, int64_t rows, int64_t cols,
                   pd_error *err) {
    memset(w, 0, sizeof *w);
    const pd_type_traits *tr = pd_type_get((uint32_t)type);
    if (!tr) return pd_errorf(err, PD_EINVAL, "weight: unknown tensor type id %u", (unsigned)type);
    if (rows < 0 || cols < 0)
        return pd_errorf(err, PD_EINVAL, "weight: negative shape %lld x %lld", (long long)rows,
                         (long long)cols);
    uint64_t rb, total;
    int rc = pd_type_row_size(type, (uint64_t)cols, &rb, err);
    if (rc) {
        pd_error_prefix(err, "weight of %lld x %lld", (long long)rows, (long long)cols);
        return rc;
    }
    if (!pd_mul_ok(rb, (uint64_t)rows, &total) || total > (uint64_t)PTRDIFF_MAX)
        return pd_errorf(err, PD_ERANGE, "weight: %lld rows of %llu bytes overflow", (long long)rows,
                         (unsigned long long)rb);
    if (!data && total > 0) return pd_errorf(err, PD_EINVAL, "weight: NULL data for a non-empty tensor");
    w->type = type;
    w->data = data;
    w->rows = rows;
    w->cols = cols;
    w->row_bytes = (size_t)rb;
    w->layout = PD_LAYOUT_GGUF;
    return PD_OK;
}

/* ------------------------------------------------------------------------
 * pack_weight: PD_LAYOUT_CPU_X16 for the types this CPU has kernels for
 * ------------------------------------------------------------------------ */

static int cpu_pack_weight(pd_backend *be, pd_weight *w, void *data, pd_error *err) {
    const cpu_backend *cb = be->impl;
    if (!cpu_x16_fits(&cb->k, w) || !cb->k.x16_at_load[w->type]) return PD_OK;
    uint8_t *tmp = malloc(CPU_X16 * w->row_bytes);
    if (!tmp) return pd_errorf(err, PD_ENOMEM, "pack_weight: out of memory");
    cpu_x16_pack(w->type, data, w->rows, w->row_bytes, tmp);
    free(tmp);
    w->layout = PD_LAYOUT_CPU_X16;
    return PD_OK;
}

/* ------------------------------------------------------------------------
 * get_rows
 * ------------------------------------------------------------------------ */

static int cpu_get_rows(pd_backend *be, const pd_weight *w, const int32_t *ids, int64_t n, float *out,
                        pd_error *err) {
    const cpu_backend *cb = be->impl;
    const pd_type_traits *tr = pd_type_get((uint32_t)w->type);
    if (!tr || !tr->can_dequantize)
        return pd_errorf(err, PD_EUNSUPPORTED, "get_rows: cannot dequantize tensor type %s",
                         tr ? tr->name : "(unknown)");
    if (n < 0) return pd_errorf(err, PD_EINVAL, "get_rows: negative count %lld", (long long)n);
    if (n > 0 && (!ids || !out)) return pd_errorf(err, PD_EINVAL, "get_rows: NULL ids or output");
    const cpu_dequant_fn fast = cb->k.dequant[w->type];
    uint8_t *unpacked = NULL; /* a packed row as the file has it */
    if (n > 0 && w->layout == PD_LAYOUT_CPU_X16 && !(unpacked = malloc(w->row_bytes)))
        return pd_errorf(err, PD_ENOMEM, "get_rows: out of memory");
    int rc = PD_OK;
    for (int64_t i = 0; i < n && !rc; i++) {
        if (ids[i] < 0 || ids[i] >= w->rows) {
            rc = pd_errorf(err, PD_ERANGE, "get_rows: id %d at index %lld is outside [0, %lld)", (int)ids[i],
                           (long long)i, (long long)w->rows);
            break;
        }
        const uint8_t *row = (const uint8_t *)w->data + (size_t)ids[i] * w->row_bytes;
        if (unpacked) {
            cpu_x16_row(w->type, w->data, w->rows, w->row_bytes, ids[i], unpacked);
            row = unpacked;
        }
        float *dst = out + i * w->cols;
        if (fast)
            fast(row, w->cols, dst);
        else if ((rc = pd_dequantize_row(w->type, row, dst, (uint64_t)w->cols, err)))
            pd_error_prefix(err, "get_rows");
    }
    free(unpacked);
    return rc;
}

/* ------------------------------------------------------------------------
 * rmsnorm, swiglu: row- or range-parallel
 * ------------------------------------------------------------------------ */

/* Below this many elements an element-wise op runs on the calling thread. */
#define PAR_MIN_ELEMS 32768

typedef struct rms_ctx {
    const cpu_kernels *k;
    const float *x, *weight;
    float *out;
    int64_t n, dim;
    float eps;
} rms_ctx;

static void rms_rows(const rms_ctx *c, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        const float *x = c->x + r * c->dim;
        float *o = c->out + r * c->dim;
        const float ss = c->k->dot_f32(x, x, c->dim);
        const float scale = 1.0f / sqrtf(ss / (float)c->dim + c->eps);
        c->k->scale_mul(x, scale, c->weight, c->dim, o);
    }
}

static void rms_worker(void *p, int ith, int nth) {
    const rms_ctx *c = p;
    rms_rows(c, c->n * ith / nth, c->n * (ith + 1) / nth);
}

static int cpu_rmsnorm(pd_backend *be, const float *x, const float *weight, int64_t n, int64_t dim,
                       float eps, float *out, pd_error *err) {
    (void)err;
    const cpu_backend *cb = be->impl;
    if (n <= 0 || dim <= 0) return PD_OK;
    rms_ctx c = {&cb->k, x, weight, out, n, dim, eps};
    if (n * dim < PAR_MIN_ELEMS || n < 2)
        rms_rows(&c, 0, n);
    else
        pd_threadpool_run(cb->tp, rms_worker, &c);
    return PD_OK;
}

typedef struct swiglu_ctx {
    const cpu_kernels *k;
    const float *g, *u;
    float *out;
    int64_t n;
} swiglu_ctx;

static void swiglu_worker(void *p, int ith, int nth) {
    const swiglu_ctx *c = p;
    /* split on multiples of 64 so every slice but the last is whole vectors */
    const int64_t nv = (c->n + 63) / 64;
    int64_t a = nv * ith / nth * 64, b = nv * (ith + 1) / nth * 64;
    if (b > c->n) b = c->n;
    if (a < b) c->k->swiglu(c->g + a, c->u + a, b - a, c->out + a);
}

static int cpu_swiglu(pd_backend *be, const float *gate, const float *up, int64_t n, float *out, pd_error *err) {
    (void)err;
    const cpu_backend *cb = be->impl;
    if (n <= 0) return PD_OK;
    if (n < PAR_MIN_ELEMS) {
        cb->k.swiglu(gate, up, n, out);
        return PD_OK;
    }
    swiglu_ctx c = {&cb->k, gate, up, out, n};
    pd_threadpool_run(cb->tp, swiglu_worker, &c);
    return PD_OK;
}

/* GeGLU, soft-capping and scaling: plain loops over ranges (tanhf bounds
 * their cost, not vectors; they are a sliver of a layer's time). */
typedef enum elem_op { ELEM_GEGLU, ELEM_SOFTCAP, ELEM_SCALE } elem_op;

typedef struct elem_ctx {
    elem_op op;
    const float *a, *b; /* geglu: gate, up; otherwise a == out */
    float *out;
    int64_t n;
    float s;
} elem_ctx;

static void elem_range(const elem_ctx *c, int64_t i0, int64_t i1) {
    switch (c->op) {
    case ELEM_GEGLU: {
        const float k0 = 0.7978845608028654f, k1 = 0.044715f; /* sqrt(2/pi) */
        for (int64_t i = i0; i < i1; i++) {
            const float x = c->a[i];
            c->out[i] = 0.5f * x * (1.0f + tanhf(k0 * x * (1.0f + k1 * x * x))) * c->b[i];
        }
        break;
    }
    case ELEM_SOFTCAP:
        for (int64_t i = i0; i < i1; i++) c->out[i] = c->s * tanhf(c->out[i] / c->s);
        break;
    case ELEM_SCALE:
        for (int64_t i = i0; i < i1; i++) c->out[i] *= c->s;
        break;
    }
}

static void elem_worker(void *p, int ith, int nth) {
    const elem_ctx *c = p;
    elem_range(c, c->n * ith / nth, c->n * (ith + 1) / nth);
}

static void elem_run(const cpu_backend *cb, const elem_ctx *c) {
    if (c->n <= 0) return;
    if (c->n < PAR_MIN_ELEMS)
        elem_range(c, 0, c->n);
    else
        pd_threadpool_run(cb->tp, elem_worker, (void *)c);
}

static int cpu_geglu(pd_backend *be, const float *gate, const float *up, int64_t n, float *out, pd_error *err) {
    (void)err;
    elem_ctx c = {ELEM_GEGLU, gate, up, out, n, 0.0f};
    elem_run(be->impl, &c);
    return PD_OK;
}

static int cpu_softcap(pd_backend *be, float *x, int64_t n, float cap, pd_error *err) {
    if (!(cap > 0.0f)) return pd_errorf(err, PD_EINVAL, "softcap: the cap must be positive, not %g", (double)cap);
    elem_ctx c = {ELEM_SOFTCAP, x, NULL, x, n, cap};
    elem_run(be->impl, &c);
    return PD_OK;
}

static int cpu_scale(pd_backend *be, float *x, int64_t n, float s, pd_error *err) {
    (void)err;
    elem_ctx c = {ELEM_SCALE, x, NULL, x, n, s};
    elem_run(be->impl, &c);
    return PD_OK;
}

/* Residual adds and biases: memory-bound, a plain loop is as fast as it gets. */
static int cpu_add(pd_backend *be, float *y, const float *x, int64_t rows, int64_t width, int64_t x_stride,
                   pd_error *err) {
    (void)be;
    if (x_stride != 0 && x_stride != width)
        return pd_errorf(err, PD_EINVAL, "add: x stride %lld is neither 0 nor the width %lld", (long long)x_stride,
                         (long long)width);
    for (int64_t r = 0; r < rows; r++) {
        float *yr = y + r * width;
        const float *xr = x + r * x_stride;
        for (int64_t i = 0; i < width; i++) yr[i] += xr[i];
    }
    return PD_OK;
}

/* ------------------------------------------------------------------------
 * rope
 * ------------------------------------------------------------------------ */

#define ROPE_CHUNK 64 /* frequency pairs handled per pass */

typedef struct rope_ctx {
    float *x;
    const int32_t *pos;
    int64_t n;
    int n_heads, head_dim, n_rot;
    pd_rope_mode mode;
    double base;
    const float *ff;
} rope_ctx;

static void rope_tokens(const rope_ctx *c, int64_t t0, int64_t t1) {
    const int half = c->n_rot / 2;
    double inv_freq[ROPE_CHUNK];
    float cs[ROPE_CHUNK], sn[ROPE_CHUNK];
    for (int i0 = 0; i0 < half; i0 += ROPE_CHUNK) {
        const int ni = half - i0 < ROPE_CHUNK ? half - i0 : ROPE_CHUNK;
        for (int i = 0; i < ni; i++) {
            /* theta_i = pos * base^(-2i/n_rot) / freq_factors[i] */
            inv_freq[i] = pow(c->base, -2.0 * (double)(i0 + i) / (double)c->n_rot);
            if (c->ff) inv_freq[i] /= (double)c->ff[i0 + i];
        }
        for (int64_t t = t0; t < t1; t++) {
            const double p = (double)c->pos[t];
            for (int i = 0; i < ni; i++) {
                /* theta in double, reduced to [-pi, pi] in double, then a
                 * float sincos: accurate to float rounding at any position */
                double th = p * inv_freq[i];
                th -= 6.283185307179586 * nearbyint(th * 0.15915494309189535);
                sincosf((float)th, &sn[i], &cs[i]);
            }
            for (int h = 0; h < c->n_heads; h++) {
                float *v = c->x + (t * c->n_heads + h) * (int64_t)c->head_dim;
                if (c->mode == PD_ROPE_NEOX) {
                    float *v0 = v + i0, *v1 = v + i0 + half;
                    for (int i = 0; i < ni; i++) {
                        const float x0 = v0[i], x1 = v1[i];
                        v0[i] = x0 * cs[i] - x1 * sn[i];
                        v1[i] = x0 * sn[i] + x1 * cs[i];
                    }
                } else {
                    float *vp = v + 2 * i0;
                    for (int i = 0; i < ni; i++) {
                        const float x0 = vp[2 * i], x1 = vp[2 * i + 1];
                        vp[2 * i] = x0 * cs[i] - x1 * sn[i];
                        vp[2 * i + 1] = x0 * sn[i] + x1 * cs[i];
                    }
                }
            }
        }
    }
}

static void rope_worker(void *p, int ith, int nth) {
    const rope_ctx *c = p;
    rope_tokens(c, c->n * ith / nth, c->n * (ith + 1) / nth);
}

static int cpu_rope(pd_backend *be, float *x, const int32_t *pos, int64_t n, int n_heads,
                    int head_dim, const pd_rope_params *p, pd_error *err) {
    (void)err;
    const cpu_backend *cb = be->impl;
    if (n <= 0 || n_heads <= 0 || head_dim <= 0 || !p) return PD_OK;
    int n_rot = p->n_rot < head_dim ? p->n_rot : head_dim;
    n_rot &= ~1;
    if (n_rot <= 0) return PD_OK;
    rope_ctx c = {x, pos, n, n_heads, head_dim, n_rot, p->mode, (double)p->freq_base, p->freq_factors};
    if (n * n_heads * (int64_t)n_rot < PAR_MIN_ELEMS / 4 || n < 2)
        rope_tokens(&c, 0, n);
    else
        pd_threadpool_run(cb->tp, rope_worker, &c);
    return PD_OK;
}

/* ------------------------------------------------------------------------
 * fused ops: the unfused ops' arithmetic, in one pass where that saves
 * work (add_rmsnorm: one pool dispatch), else the unfused calls in order
 * (the products dominate; fusing them would only reorder memory traffic
 * the CPU's caches already absorb)
 * ------------------------------------------------------------------------ */

typedef struct add_rms_ctx {
    rms_ctx rms;
    float *x;
    const float *h;
} add_rms_ctx;

/* Rows [r0, r1): cpu_add's sum, then rms_rows over the updated rows. */
static void add_rms_rows(const add_rms_ctx *c, int64_t r0, int64_t r1) {
    const int64_t dim = c->rms.dim;
    for (int64_t r = r0; r < r1; r++) {
        float *xr = c->x + r * dim;
        const float *hr = c->h + r * dim;
        for (int64_t i = 0; i < dim; i++) xr[i] += hr[i];
        rms_rows(&c->rms, r, r + 1);
    }
}

static void add_rms_worker(void *p, int ith, int nth) {
    const add_rms_ctx *c = p;
    add_rms_rows(c, c->rms.n * ith / nth, c->rms.n * (ith + 1) / nth);
}

static int cpu_add_rmsnorm(pd_backend *be, float *x, const float *h, const float *weight, int64_t n, int64_t dim,
                           float eps, float *out, pd_error *err) {
    (void)err;
    const cpu_backend *cb = be->impl;
    if (n <= 0 || dim <= 0) return PD_OK;
    add_rms_ctx c = {{&cb->k, x, weight, out, n, dim, eps}, x, h};
    if (n * dim < PAR_MIN_ELEMS || n < 2)
        add_rms_rows(&c, 0, n);
    else
        pd_threadpool_run(cb->tp, add_rms_worker, &c);
    return PD_OK;
}

static int cpu_matmul_glu(pd_backend *be, const pd_weight *w_gate, const pd_weight *w_up, const float *x, int64_t n,
                          pd_glu act, float *out, float *up, pd_error *err) {
    if (act != PD_GLU_SILU && act != PD_GLU_GELU)
        return pd_errorf(err, PD_EINVAL, "matmul_glu: unknown activation %d", (int)act);
    if (!up) return pd_errorf(err, PD_EINVAL, "matmul_glu: NULL up scratch");
    int rc;
    const pd_weight *const w[2] = {w_gate, w_up};
    float *const y[2] = {out, up};
    if ((rc = cpu_matmul_multi(be, w, 2, x, n, y, err))) return rc;
    const int64_t count = n * w_gate->rows;
    return act == PD_GLU_SILU ? cpu_swiglu(be, out, up, count, out, err) : cpu_geglu(be, out, up, count, out, err);
}

static int cpu_qkv_bias_rope(pd_backend *be, const pd_qkv_args *a, pd_error *err) {
    const int64_t qd = (int64_t)a->n_head * a->head_dim, kvd = (int64_t)a->n_head_kv * a->head_dim;
    int rc;
    if ((a->bq && (rc = cpu_add(be, a->q, a->bq, a->n, qd, 0, err))) ||
        (a->bk && (rc = cpu_add(be, a->k, a->bk, a->n, kvd, 0, err))) ||
        (a->bv && (rc = cpu_add(be, a->v, a->bv, a->n, kvd, 0, err))))
        return rc;
    if (!a->rope) return PD_OK;
    if ((rc = cpu_rope(be, a->q, a->pos, a->n, a->n_head, a->head_dim, a->rope, err))) return rc;
    return cpu_rope(be, a->k, a->pos, a->n, a->n_head_kv, a->head_dim, a->rope, err);
}

/* ------------------------------------------------------------------------
 * memory: backend memory is host memory
 * ------------------------------------------------------------------------ */

static void *cpu_alloc(pd_backend *be, size_t bytes, pd_error *err) {
    (void)be;
    void *p = NULL;
    if (posix_memalign(&p, 256, bytes ? bytes : 1) != 0) {
        pd_errorf(err, PD_ENOMEM, "out of memory allocating %zu MiB", bytes >> 20);
        return NULL;
    }
    return p;
}

static void cpu_release(pd_backend *be, void *p) {
    (void)be;
    free(p);
}

static int cpu_copy(pd_backend *be, void *dst, const void *src, size_t bytes, pd_error *err) {
    (void)be;
    (void)err;
    if (bytes && dst != src) memmove(dst, src, bytes);
    return PD_OK;
}

static int cpu_copy2d(pd_backend *be, void *dst, size_t dst_pitch, const void *src, size_t src_pitch, size_t width,
                      size_t rows, pd_error *err) {
    (void)be;
    (void)err;
    for (size_t r = 0; r < rows; r++) memmove((char *)dst + r * dst_pitch, (const char *)src + r * src_pitch, width);
    return PD_OK;
}

static int cpu_copy2d_batch(pd_backend *be, const pd_copy2d *d, int64_t n, pd_error *err) {
    for (int64_t i = 0; i < n; i++) cpu_copy2d(be, d[i].dst, d[i].dst_pitch, d[i].src, d[i].src_pitch, d[i].width, d[i].rows, err);
    return PD_OK;
}

static int cpu_gather(pd_backend *be, void *dst, const void *src, const int32_t *idx, int64_t n, size_t row_bytes,
                      pd_error *err) {
    (void)be;
    for (int64_t i = 0; i < n; i++) {
        if (idx[i] < 0) return pd_errorf(err, PD_EINVAL, "gather: index %d at %lld is negative", idx[i], (long long)i);
        memcpy((char *)dst + (size_t)i * row_bytes, (const char *)src + (size_t)idx[i] * row_bytes, row_bytes);
    }
    return PD_OK;
}

typedef struct convert_ctx {
    const cpu_kernels *k;
    void *dst;
    const void *src;
    bool to_f16;
    int64_t n;
} convert_ctx;

static void convert_range(const convert_ctx *c, int64_t a, int64_t b) {
    if (c->to_f16)
        c->k->f32_to_f16((const float *)c->src + a, b - a, (uint16_t *)c->dst + a);
    else
        c->k->f16_to_f32((const uint16_t *)c->src + a, b - a, (float *)c->dst + a);
}

static void convert_worker(void *p, int ith, int nth) {
    const convert_ctx *c = p;
    const int64_t nv = (c->n + 63) / 64; /* slices of whole vectors */
    int64_t a = nv * ith / nth * 64, b = nv * (ith + 1) / nth * 64;
    if (b > c->n) b = c->n;
    if (a < b) convert_range(c, a, b);
}

static int cpu_convert(pd_backend *be, void *dst, pd_type dst_type, const void *src, pd_type src_type, int64_t n,
                       pd_error *err) {
    const cpu_backend *cb = be->impl;
    if (n < 0) return pd_errorf(err, PD_EINVAL, "convert: negative count %lld", (long long)n);
    if (!pd_kv_type_ok(dst_type) || !pd_kv_type_ok(src_type))
        return pd_errorf(err, PD_EUNSUPPORTED, "convert: only f32 and f16 are supported, not %s -> %s",
                         pd_type_get(src_type) ? pd_type_get(src_type)->name : "unknown",
                         pd_type_get(dst_type) ? pd_type_get(dst_type)->name : "unknown");
    if (n == 0) return PD_OK;
    if (dst_type == src_type) return cpu_copy(be, dst, src, (size_t)n * (dst_type == PD_TYPE_F16 ? 2 : 4), err);
    convert_ctx c = {&cb->k, dst, src, dst_type == PD_TYPE_F16, n};
    if (n < PAR_MIN_ELEMS)
        convert_range(&c, 0, n);
    else
        pd_threadpool_run(cb->tp, convert_worker, &c);
    return PD_OK;
}

static int cpu_sync(pd_backend *be, pd_error *err) {
    (void)be;
    (void)err;
    return PD_OK;
}

/* ------------------------------------------------------------------------
 * create / free
 * ------------------------------------------------------------------------ */

static void cpu_free(pd_backend *be) {
    if (!be) return;
    cpu_backend *cb = be->impl;
    pd_threadpool_free(cb->tp);
    free(cb->runs);
    free(cb->act);
    free(cb->work);
    free(cb->x16_tmp);
    free(cb);
}

/* Every op but the name and the memory model, shared by both tables. */
#define CPU_OPS \
    .free = cpu_free, \
    .alloc = cpu_alloc, \
    .release = cpu_release, \
    .upload = cpu_copy, \
    .download = cpu_copy, \
    .copy = cpu_copy, \
    .copy2d = cpu_copy2d, \
    .copy2d_batch = cpu_copy2d_batch, \
    .convert = cpu_convert, \
    .gather = cpu_gather, \
    .sync = cpu_sync, \
    .prepare_weight = NULL, \
    .forget_weight = NULL, \
    .pack_weight = cpu_pack_weight, \
    .matmul = cpu_matmul, \
    .get_rows = cpu_get_rows, \
    .rmsnorm = cpu_rmsnorm, \
    .rope = cpu_rope, \
    .swiglu = cpu_swiglu, \
    .geglu = cpu_geglu, \
    .softcap = cpu_softcap, \
    .scale = cpu_scale, \
    .add = cpu_add, \
    .attention = cpu_attention, \
    .add_rmsnorm = cpu_add_rmsnorm, \
    .matmul_multi = cpu_matmul_multi, \
    .matmul_glu = cpu_matmul_glu, \
    .qkv_bias_rope = cpu_qkv_bias_rope, \
    .token_scores = NULL,

static const pd_backend_ops cpu_ops = {
    .name = "cpu",
    .host_memory = true,
    CPU_OPS
};

static const pd_backend_ops cpu_discrete_ops = {
    .name = "cpu-discrete",
    .host_memory = false,
    CPU_OPS
};

int pd_backend_cpu_create(int n_threads, pd_backend **out, pd_error *err) {
    *out = NULL;
    cpu_simd_level level;
    const char *bad;
    if (!env_level(best_level(), &level, &bad))
        return pd_errorf(err, PD_EINVAL,
                         "PD_CPU_SIMD='%s' is not a SIMD level (use scalar, avx2, avx512 or auto)", bad);
    cpu_backend *cb = calloc(1, sizeof *cb);
    if (!cb) return pd_errorf(err, PD_ENOMEM, "cpu backend: out of memory");
    int rc = pd_threadpool_create(n_threads, &cb->tp, err);
    if (rc) {
        free(cb);
        pd_error_prefix(err, "cpu backend");
        return rc;
    }
    cb->n_threads = pd_threadpool_size(cb->tp);
    cb->runs = aligned_alloc(64, (size_t)cb->n_threads * sizeof *cb->runs);
    if (!cb->runs) {
        pd_threadpool_free(cb->tp);
        free(cb);
        return pd_errorf(err, PD_ENOMEM, "cpu backend: out of memory");
    }
    switch (level) {
#if PD_X86
    case CPU_SIMD_AVX512: cpu_kernels_avx512(&cb->k); break;
    case CPU_SIMD_AVX2: cpu_kernels_avx2(&cb->k); break;
#endif
    default: cpu_kernels_scalar(&cb->k); break;
    }
    /* Batch size from which dequantize + sgemm beats the dot-product
     * kernels of the float types, measured with kernel-bench on AVX-512
     * (Zen): sgemm pays for packing the weights on every call, and the
     * f16/bf16 kernels convert on the fly. On AVX2 and AVX-512 every
     * quantized type is flagged mm_any_n (its integer kernel at every
     * batch size, which keeps a token's result independent of its batch)
     * and ignores this threshold; portable C takes sgemm for all types. */
    for (int t = 0; t < PD_TYPE_COUNT; t++) cb->gemm_min_n[t] = 4;
    if (level != CPU_SIMD_SCALAR) {
        cb->gemm_min_n[PD_TYPE_F32] = 32;
        cb->gemm_min_n[PD_TYPE_F16] = 64;
        cb->gemm_min_n[PD_TYPE_BF16] = 64;
    }
    const char *g = getenv("PD_CPU_GEMM_MIN_N"); /* tuning knob for kernel-bench */
    if (g && *g) {
        char *end;
        const long v = strtol(g, &end, 10);
        if (*end == '\0' && v >= 1)
            for (int t = 0; t < PD_TYPE_COUNT; t++) cb->gemm_min_n[t] = v;
    }
    /* Our pool parallelises across GEMM tiles; OpenBLAS's own threads would
     * fight with it (process-wide setting). */
    openblas_set_num_threads(1);
    cb->base.ops = &cpu_ops;
    cb->base.impl = cb;
    *out = &cb->base;
    return PD_OK;
}

int pd_backend_cpu_discrete_create(int n_threads, pd_backend **out, pd_error *err) {
    int rc = pd_backend_cpu_create(n_threads, out, err);
    if (!rc) (*out)->ops = &cpu_discrete_ops;
    return rc;
}

/* Freed KV memory stays in the heap for the next request: glibc gives
 * blocks above a moving threshold back to the kernel, and refaulting them a
 * 4 KiB page at a time costs microseconds per page in a VM (a repeated
 * 2000-token prompt on the SmolLM2 shape waited 200 ms in admission for
 * 45 MB of copied KV rows, 20 ms with this). Allocations of 32 MiB and up
 * (weights, big slabs) still get their own mappings. */
#define HEAP_MMAP_THRESHOLD (32 << 20)
#define HEAP_TRIM_THRESHOLD (1 << 30)

void pd_cpu_prepare_process(char **argv) {
    (void)mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD);
    (void)mallopt(M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD);
    if (getenv("OPENBLAS_NUM_THREADS")) return;
    setenv("OPENBLAS_NUM_THREADS", "1", 1);
    execv("/proc/self/exe", argv);
    /* no /proc: carry on with OpenBLAS's threads */
}
