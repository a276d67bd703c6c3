/* The CUDA backend's attention (kernels/cuda/attention.cu) against a naive
 * reference computed here in double precision, on each kernel its planner
 * chooses:
 *   - the tensor-core kernel (f16 K/V, head_dim a multiple of 16, at least 4
 *     query rows per kv head): causal prefill chunks on the prefill plan and
 *     on the split-K plan, batched prefill over a shared prefix, GQA decode
 *     over a shared prefix (the shared-prefix pass, split-K and the merge),
 *     one long sequence cut into many chunks, sliding windows, soft-capping,
 *     positions with gaps (every case: kept tokens of a compressed prefix),
 *     head_dim 64, 80, 128 and 256, and queries that see nothing;
 *   - the f32 CUDA-core kernel where that path does not apply (f32 rows, a
 *     head_dim that is not a multiple of 16, single-row MHA decode).
 * On cudaemu (the CI device; make test-cudaemu) CUDAEMU_LAUNCH_LOG also shows
 * which kernel each call launched, so a case that should take a path and
 * does not fails. Skips where there is no CUDA device.
 *
 * Tolerances. Every output is a convex combination of value rows, so errors
 * are stated relative to vmax, the largest |v| among the keys the row sees.
 * The tensor-core path rounds the scaled queries q' = scale * q to f16 and
 * each probability to f16 before the P V product (K and V are f16 already);
 * scores accumulate in f32. With u = 2^-11 (f16 unit roundoff) and, per key
 * j, A_j = sum_d |q'_d k_jd|:
 *   score error  |ds_j| <= u A_j (Q rounding) + hd 2^-24 A_j (f32 sums);
 *                soft-capping only shrinks it (its slope is at most 1);
 *   weight error each weight is off by a factor within e^(|ds_j|) (1 + u),
 *                plus at most 2^-25 (a probability below f16's normal range,
 *                relative to the row's largest, 1);
 *   output error |o - o_ref| <= 2 (max_j |ds_j| + u + n_vis 2^-25) vmax,
 * to first order (a convex combination whose weights move by a relative
 * delta moves by at most 2 delta vmax); asserted with a 10% margin plus
 * 1e-5 vmax for exp and the final division. That bound is loose (worst-case
 * signs everywhere): the errors seen are ~1e-4 vmax. A wrong mask or a
 * missing tile is a systematic error, so the mean |error| / vmax over all
 * outputs must also stay below u / 4 (the rounding errors of independent
 * weights largely cancel; observed: ~1e-5).
 * The f32 kernel differs from the reference only in summation order:
 * asserted at 1e-4 vmax (observed ~1e-6). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "helpers.h"
#include "kernels/kernels.h"

#define MAX_GROUPS 8
#define MAX_SEGS 3
#define F16_U 0x1p-11

static void *xmalloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    cr_assert_not_null(p, "out of memory (%zu bytes)", bytes);
    return p;
}

/* Seeded generator, the same on every machine. */
typedef struct rng {
    uint64_t s;
} rng;
static double rng_unit(rng *r) { return (double)(pd_splitmix64(&r->s) >> 11) * 0x1p-53; }
static float rng_normal(rng *r) { /* ~N(0, 1): sum of 12 uniforms */
    double s = 0;
    for (int i = 0; i < 12; i++) s += rng_unit(r);
    return (float)(s - 6.0);
}

typedef struct tc_case {
    const char *name;
    int n_head, n_head_kv, head_dim;
    int n_groups;
    int64_t group_tokens[MAX_GROUPS];
    int n_shared;                         /* shared segments of shared_len keys */
    int64_t shared_len;
    int n_segments;                       /* own segments per group */
    int64_t seg_len[MAX_GROUPS][MAX_SEGS];
    pd_type shared_type, own_type;        /* PD_TYPE_F16 or PD_TYPE_F32 */
    int32_t window;
    float softcap;
    bool queries_first;                   /* every query precedes every key: nothing visible */
    bool expect_mma;                      /* the tensor-core kernel should run */
    uint64_t seed;
} tc_case;

/* One segment's positions (shared by the kv heads) and rows per kv head,
 * as the device gets them (f16-rounded for an f16 type, widened back). */
typedef struct seg_data {
    int64_t len;
    pd_type type;
    int32_t *pos;
    float *k[16], *v[16];
} seg_data;

typedef struct problem {
    int64_t n_tokens;
    int64_t group_start[MAX_GROUPS + 1];
    float *q;
    int32_t *q_pos;
    seg_data shared[2];
    seg_data own[MAX_GROUPS][MAX_SEGS];
} problem;

static void make_seg(seg_data *s, rng *r, int64_t len, pd_type type, int n_kv, int hd, int32_t *next_pos) {
    s->len = len;
    s->type = type;
    s->pos = xmalloc(sizeof(int32_t) * (size_t)len);
    for (int64_t i = 0; i < len; i++) {
        *next_pos += 1 + (int32_t)(pd_splitmix64(&r->s) % 3); /* gaps of 0-2 evicted tokens */
        s->pos[i] = *next_pos;
    }
    const size_t n = (size_t)(len * hd);
    uint16_t *h16 = xmalloc(2 * n + 2);
    for (int h = 0; h < n_kv; h++) {
        s->k[h] = xmalloc(sizeof(float) * n + 4);
        s->v[h] = xmalloc(sizeof(float) * n + 4);
        for (size_t i = 0; i < n; i++) {
            s->k[h][i] = rng_normal(r);
            s->v[h][i] = rng_normal(r);
        }
        if (type == PD_TYPE_F16) {
            pd_fp32_to_fp16_row(s->k[h], h16, n);
            pd_fp16_to_fp32_row(h16, s->k[h], n);
            pd_fp32_to_fp16_row(s->v[h], h16, n);
            pd_fp16_to_fp32_row(h16, s->v[h], n);
        }
    }
    free(h16);
}

static void free_seg(seg_data *s, int n_kv) {
    free(s->pos);
    for (int h = 0; h < n_kv; h++) {
        free(s->k[h]);
        free(s->v[h]);
    }
}

/* Shared segments first (a compressed prefix), then each group's own
 * segments continuing after it; a group's tokens are the last rows of its
 * last segment (or, with queries_first, positions 0.. before every key). */
static void make_problem(const tc_case *c, problem *p) {
    memset(p, 0, sizeof *p);
    rng r = {c->seed};
    const int hd = c->head_dim;
    int32_t next = c->queries_first ? 1000 : -1;
    for (int s = 0; s < c->n_shared; s++)
        make_seg(&p->shared[s], &r, c->shared_len, c->shared_type, c->n_head_kv, hd, &next);
    const int32_t after_shared = next;
    for (int g = 0; g < c->n_groups; g++) {
        p->group_start[g] = p->n_tokens;
        p->n_tokens += c->group_tokens[g];
    }
    p->group_start[c->n_groups] = p->n_tokens;
    const int64_t nq = p->n_tokens * c->n_head * hd;
    p->q = xmalloc(sizeof(float) * (size_t)nq);
    p->q_pos = xmalloc(sizeof(int32_t) * (size_t)p->n_tokens);
    /* q ~ N(0, 1.5^2): scores of std ~1.5 after the 1/sqrt(hd) scale, some
     * softmaxes peaked, some flat. */
    for (int64_t i = 0; i < nq; i++) p->q[i] = 1.5f * rng_normal(&r);
    for (int g = 0; g < c->n_groups; g++) {
        next = after_shared;
        for (int s = 0; s < c->n_segments; s++)
            make_seg(&p->own[g][s], &r, c->seg_len[g][s], c->own_type, c->n_head_kv, hd, &next);
        const seg_data *last = &p->own[g][c->n_segments - 1];
        cr_assert_geq(last->len, c->group_tokens[g], "%s: group %d has more tokens than its last segment", c->name, g);
        for (int64_t t = 0; t < c->group_tokens[g]; t++)
            p->q_pos[p->group_start[g] + t] =
                c->queries_first ? (int32_t)t : last->pos[last->len - c->group_tokens[g] + t];
    }
}

static void free_problem(const tc_case *c, problem *p) {
    free(p->q);
    free(p->q_pos);
    for (int s = 0; s < c->n_shared; s++) free_seg(&p->shared[s], c->n_head_kv);
    for (int g = 0; g < c->n_groups; g++)
        for (int s = 0; s < c->n_segments; s++) free_seg(&p->own[g][s], c->n_head_kv);
}

/* ------------------------------------------------------------------------
 * The device side
 * ------------------------------------------------------------------------ */

typedef struct device_mem {
    void *ptr[256];
    int n;
} device_mem;

static void *put(pd_backend *be, device_mem *dm, const void *host, size_t bytes) {
    pd_error err = {0};
    void *p = pd_backend_alloc(be, bytes ? bytes : 1, &err);
    cr_assert_not_null(p, "alloc(%zu): %s", bytes, err.msg);
    cr_assert_lt(dm->n, 256);
    dm->ptr[dm->n++] = p;
    if (bytes) cr_assert_eq(pd_backend_upload(be, p, host, bytes, &err), PD_OK, "upload(%zu): %s", bytes, err.msg);
    return p;
}

static void put_seg(pd_backend *be, device_mem *dm, const seg_data *s, int n_kv, int hd, pd_kv_view *views) {
    const int32_t *dpos = put(be, dm, s->pos, sizeof(int32_t) * (size_t)s->len);
    const size_t n = (size_t)(s->len * hd);
    uint16_t *h16 = xmalloc(2 * n + 2);
    for (int h = 0; h < n_kv; h++) {
        const void *dk, *dv;
        if (s->type == PD_TYPE_F16) {
            pd_fp32_to_fp16_row(s->k[h], h16, n); /* exact: the rows are f16 values */
            dk = put(be, dm, h16, 2 * n);
            pd_fp32_to_fp16_row(s->v[h], h16, n);
            dv = put(be, dm, h16, 2 * n);
        } else {
            dk = put(be, dm, s->k[h], sizeof(float) * n);
            dv = put(be, dm, s->v[h], sizeof(float) * n);
        }
        views[h] = (pd_kv_view){.k = dk, .v = dv, .pos = dpos, .len = s->len, .type = s->type};
    }
    free(h16);
}

static float attn_scale(const tc_case *c) { return 1.0f / sqrtf((float)c->head_dim); }

static void run_device(pd_backend *be, const tc_case *c, const problem *p, float *out) {
    const int hd = c->head_dim, nkv = c->n_head_kv;
    device_mem dm = {.n = 0};
    pd_kv_view shared_views[2 * 16], own_views[MAX_GROUPS * MAX_SEGS * 16];
    for (int s = 0; s < c->n_shared; s++) put_seg(be, &dm, &p->shared[s], nkv, hd, shared_views + s * nkv);
    for (int g = 0; g < c->n_groups; g++)
        for (int s = 0; s < c->n_segments; s++)
            put_seg(be, &dm, &p->own[g][s], nkv, hd, own_views + (g * c->n_segments + s) * nkv);
    const size_t qb = sizeof(float) * (size_t)(p->n_tokens * c->n_head * hd);
    const float *dq = put(be, &dm, p->q, qb);
    const int32_t *dqp = put(be, &dm, p->q_pos, sizeof(int32_t) * (size_t)p->n_tokens);
    pd_error err = {0};
    float *dout = pd_backend_alloc(be, qb, &err);
    cr_assert_not_null(dout, "alloc: %s", err.msg);
    dm.ptr[dm.n++] = dout;
    const pd_attn_args a = {.q = dq,
                            .q_pos = dqp,
                            .n_tokens = p->n_tokens,
                            .n_head = c->n_head,
                            .n_head_kv = nkv,
                            .head_dim = hd,
                            .n_segments = c->n_segments,
                            .kv = own_views,
                            .n_shared = c->n_shared,
                            .shared = c->n_shared ? shared_views : NULL,
                            .n_groups = c->n_groups,
                            .group_start = p->group_start,
                            .scale = attn_scale(c),
                            .causal = true,
                            .window = c->window,
                            .softcap = c->softcap,
                            .out = dout};
    cr_assert_eq(pd_backend_attention(be, &a, &err), PD_OK, "%s: attention: %s", c->name, err.msg);
    cr_assert_eq(pd_backend_download(be, out, dout, qb, &err), PD_OK, "%s: download: %s", c->name, err.msg);
    for (int i = 0; i < dm.n; i++) pd_backend_release(be, dm.ptr[i]);
}

/* ------------------------------------------------------------------------
 * The reference, and the check
 * ------------------------------------------------------------------------ */

static bool visible(const tc_case *c, int32_t qpos, int32_t kpos) {
    return kpos <= qpos && (c->window <= 0 || (int64_t)qpos - kpos < c->window);
}

/* Output row (t, head) in double, with the exact scaled query; *vmax gets
 * the largest |v| of the keys it sees, *amax the largest A_j (see the top),
 * *n_vis how many it sees. */
static void reference_row(const tc_case *c, const problem *p, int g, int64_t t, int head, double *o, double *vmax,
                          double *amax, int64_t *n_vis) {
    const int hd = c->head_dim, kvh = head / (c->n_head / c->n_head_kv);
    const float *q = p->q + (t * c->n_head + head) * hd;
    const float scale = attn_scale(c);
    double qs[256], qh[256];
    for (int d = 0; d < hd; d++) {
        qs[d] = (double)scale * q[d];
        qh[d] = fabs((double)pd_fp16_to_fp32(pd_fp32_to_fp16(q[d] * scale))); /* |q'_d| as the GPU rounds it */
    }
    const seg_data *list[2 + MAX_SEGS];
    int n_list = 0;
    for (int s = 0; s < c->n_shared; s++) list[n_list++] = &p->shared[s];
    for (int s = 0; s < c->n_segments; s++) list[n_list++] = &p->own[g][s];
    double m = -INFINITY, l = 0;
    *vmax = 0;
    *amax = 0;
    *n_vis = 0;
    for (int d = 0; d < hd; d++) o[d] = 0;
    for (int s = 0; s < n_list; s++) {
        const seg_data *sg = list[s];
        for (int64_t j = 0; j < sg->len; j++) {
            if (!visible(c, p->q_pos[t], sg->pos[j])) continue;
            const float *k = sg->k[kvh] + j * hd, *v = sg->v[kvh] + j * hd;
            double sc = 0, a = 0;
            for (int d = 0; d < hd; d++) {
                sc += qs[d] * k[d];
                a += qh[d] * fabs((double)k[d]);
            }
            if (c->softcap > 0) sc = c->softcap * tanh(sc / c->softcap);
            const double mn = fmax(m, sc), alpha = exp(m - mn), w = exp(sc - mn);
            l = l * alpha + w;
            for (int d = 0; d < hd; d++) {
                o[d] = o[d] * alpha + w * v[d];
                *vmax = fmax(*vmax, fabs((double)v[d]));
            }
            m = mn;
            *amax = fmax(*amax, a);
            (*n_vis)++;
        }
    }
    for (int d = 0; d < hd; d++) o[d] = *n_vis ? o[d] / l : 0.0;
}

/* Which kernels the last calls launched, on cudaemu (NULL elsewhere). */
static char *launch_log_path(void) {
    pd_cuda_device_info info;
    pd_error err = {0};
    if (pd_cuda_device_info_get(0, &info, &err) != PD_OK || strncmp(info.name, "cudaemu", 7) != 0) return NULL;
    static char path[256];
    snprintf(path, sizeof path, "%s/launches-%d.txt", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", (int)getpid());
    setenv("CUDAEMU_LAUNCH_LOG", path, 1);
    return path;
}

static bool log_mentions(const char *path, const char *what) {
    FILE *f = fopen(path, "r");
    if (!f) return false;
    char line[256];
    bool found = false;
    while (fgets(line, sizeof line, f))
        if (strstr(line, what)) found = true;
    fclose(f);
    return found;
}

static void check_case(pd_backend *be, const char *log, const tc_case *c) {
    problem p;
    make_problem(c, &p);
    const int hd = c->head_dim;
    const int64_t n_out = p.n_tokens * c->n_head * hd;
    float *out = xmalloc(sizeof(float) * (size_t)n_out);
    if (log) fclose(fopen(log, "w"));
    run_device(be, c, &p, out);
    if (log) {
        cr_assert(log_mentions(log, c->expect_mma ? "attn_mma_kernel" : "attn_tile_kernel"),
                  "%s: expected the %s kernel to run", c->name, c->expect_mma ? "tensor-core" : "f32");
        cr_assert(!log_mentions(log, c->expect_mma ? "attn_tile_kernel" : "attn_mma_kernel"),
                  "%s: the %s kernel ran as well", c->name, c->expect_mma ? "f32" : "tensor-core");
    }
    double worst = 0, sum_rel = 0;
    for (int g = 0; g < c->n_groups; g++)
        for (int64_t t = p.group_start[g]; t < p.group_start[g + 1]; t++)
            for (int head = 0; head < c->n_head; head++) {
                double ref[256], vmax, amax;
                int64_t n_vis;
                reference_row(c, &p, g, t, head, ref, &vmax, &amax, &n_vis);
                const float *got = out + (t * c->n_head + head) * hd;
                if (n_vis == 0) {
                    for (int d = 0; d < hd; d++)
                        cr_assert(got[d] == 0.0f, "%s: token %lld head %d sees no key but dim %d is %g", c->name,
                                  (long long)t, head, d, (double)got[d]);
                    continue;
                }
                const double bound =
                    c->expect_mma ? (1.1 * 2 * (F16_U * amax + hd * 0x1p-24 * amax + F16_U + n_vis * 0x1p-25) + 1e-5) *
                                        vmax
                                  : 1e-4 * vmax;
                for (int d = 0; d < hd; d++) {
                    const double e = fabs((double)got[d] - ref[d]);
                    cr_assert(e <= bound,
                              "%s: token %lld (pos %d) head %d dim %d: GPU %.8g, reference %.8g: |diff| %.3g > %.3g "
                              "(%.3g vmax; A %.3g, %lld keys seen)",
                              c->name, (long long)t, p.q_pos[t], head, d, (double)got[d], ref[d], e, bound,
                              bound / vmax, amax, (long long)n_vis);
                    worst = fmax(worst, e / vmax);
                    sum_rel += e / vmax;
                }
            }
    const double mean = sum_rel / (double)n_out;
    cr_log_info("%s: largest |error| %.3g vmax, mean %.3g vmax", c->name, worst, mean);
    if (c->expect_mma)
        cr_assert_leq(mean, F16_U / 4, "%s: mean |error| %.3g vmax > u/4: a systematic error", c->name, mean);
    free(out);
    free_problem(c, &p);
}

typedef struct fixture {
    pd_backend *be;
    const char *log;
} fixture;

static fixture open_device(void) {
    if (pd_cuda_device_count() == 0)
        cr_skip_test("no CUDA device: attention not checked (compiled in: %s)", pd_cuda_compiled() ? "yes" : "no");
    fixture f = {.log = launch_log_path()};
    pd_error err = {0};
    cr_assert_eq(pd_backend_cuda_create(0, &f.be, &err), PD_OK, "cuda backend: %s", err.msg);
    return f;
}

static void close_device(fixture *f) {
    pd_backend_free(f->be);
    if (f->log) remove(f->log);
}

/* ------------------------------------------------------------------------
 * Tensor-core path
 * ------------------------------------------------------------------------ */

Test(cuda_attention, causal_prefill_chunks) {
    fixture f = open_device();
    static const int head_dims[] = {64, 128};
    for (int i = 0; i < 2; i++) {
        /* A 300-row compressed prefix, then a 200-token chunk: 800 query rows
         * per kv head, enough tiles for the prefill plan (no split). */
        tc_case c = {.name = "prefill chunk of 200",
                     .n_head = 8,
                     .n_head_kv = 2,
                     .head_dim = head_dims[i],
                     .n_groups = 1,
                     .group_tokens = {200},
                     .n_segments = 2,
                     .seg_len = {{300, 200}},
                     .shared_type = PD_TYPE_F16,
                     .own_type = PD_TYPE_F16,
                     .expect_mma = true,
                     .seed = 100 + (uint64_t)i};
        check_case(f.be, f.log, &c);
        /* A 40-token chunk: too few tiles to fill the device, so split-K
         * chunks with a merge. */
        c.name = "prefill chunk of 40";
        c.group_tokens[0] = 40;
        c.seg_len[0][1] = 40;
        check_case(f.be, f.log, &c);
    }
    close_device(&f);
}

Test(cuda_attention, batched_prefill_over_a_shared_prefix) {
    fixture f = open_device();
    /* Three sequences over one shared prefix, one with an empty own
     * segment: with a group of 20 tokens the prefill plan (the prefix read
     * per group); with at most 16 tokens per group the split plan (the
     * prefix read once for all groups). */
    tc_case c = {.name = "batched prefill, prefill plan",
                 .n_head = 8,
                 .n_head_kv = 2,
                 .head_dim = 64,
                 .n_groups = 3,
                 .group_tokens = {5, 1, 20},
                 .n_shared = 1,
                 .shared_len = 500,
                 .n_segments = 2,
                 .seg_len = {{10, 5}, {0, 1}, {40, 20}},
                 .shared_type = PD_TYPE_F16,
                 .own_type = PD_TYPE_F16,
                 .expect_mma = true,
                 .seed = 200};
    check_case(f.be, f.log, &c);
    c.name = "batched prefill, shared-prefix pass";
    c.group_tokens[2] = 12;
    c.seg_len[2][1] = 12;
    c.head_dim = 128;
    check_case(f.be, f.log, &c);
    close_device(&f);
}

Test(cuda_attention, gqa_decode_over_a_shared_prefix) {
    fixture f = open_device();
    /* Eight sequences of one token over a 2000-key prefix in two shared
     * segments, own caches of very different lengths: split-K over the
     * prefix (read once for all groups) and over the own keys, merged.
     * n_rep 4 and 8: the query rows of one kv head. */
    tc_case c = {.name = "decode, n_rep 4",
                 .n_head = 8,
                 .n_head_kv = 2,
                 .head_dim = 64,
                 .n_groups = 8,
                 .group_tokens = {1, 1, 1, 1, 1, 1, 1, 1},
                 .n_shared = 2,
                 .shared_len = 1000,
                 .n_segments = 1,
                 .seg_len = {{1}, {2}, {17}, {64}, {65}, {300}, {900}, {1500}},
                 .shared_type = PD_TYPE_F16,
                 .own_type = PD_TYPE_F16,
                 .expect_mma = true,
                 .seed = 300};
    check_case(f.be, f.log, &c);
    c.name = "decode, n_rep 8";
    c.n_head = 16;
    c.head_dim = 128;
    c.seed = 301;
    check_case(f.be, f.log, &c);
    close_device(&f);
}

Test(cuda_attention, long_sequence_split_into_chunks) {
    fixture f = open_device();
    /* Four tokens (speculative decode) of one sequence over 6000 keys in
     * three segments: many split-K chunks, some crossing segments. */
    const tc_case c = {.name = "6000 keys, 4 tokens",
                       .n_head = 4,
                       .n_head_kv = 1,
                       .head_dim = 128,
                       .n_groups = 1,
                       .group_tokens = {4},
                       .n_segments = 3,
                       .seg_len = {{2500, 3001, 499}},
                       .shared_type = PD_TYPE_F16,
                       .own_type = PD_TYPE_F16,
                       .expect_mma = true,
                       .seed = 400};
    check_case(f.be, f.log, &c);
    close_device(&f);
}

Test(cuda_attention, windows_and_soft_caps) {
    fixture f = open_device();
    tc_case prefill = {.name = "prefill, window 40",
                       .n_head = 8,
                       .n_head_kv = 2,
                       .head_dim = 64,
                       .n_groups = 1,
                       .group_tokens = {77},
                       .n_segments = 2,
                       .seg_len = {{300, 77}},
                       .shared_type = PD_TYPE_F16,
                       .own_type = PD_TYPE_F16,
                       .window = 40,
                       .expect_mma = true,
                       .seed = 500};
    check_case(f.be, f.log, &prefill);
    prefill.name = "prefill, soft-cap 0.5";
    prefill.window = 0;
    prefill.softcap = 0.5f;
    check_case(f.be, f.log, &prefill);
    tc_case decode = {.name = "decode, window 700, soft-cap 1",
                      .n_head = 8,
                      .n_head_kv = 2,
                      .head_dim = 128,
                      .n_groups = 8,
                      .group_tokens = {1, 1, 1, 1, 1, 1, 1, 1},
                      .n_shared = 1,
                      .shared_len = 1500,
                      .n_segments = 1,
                      .seg_len = {{1}, {2}, {17}, {64}, {65}, {300}, {1000}, {1200}},
                      .shared_type = PD_TYPE_F16,
                      .own_type = PD_TYPE_F16,
                      .window = 700,
                      .softcap = 1.0f,
                      .expect_mma = true,
                      .seed = 501};
    check_case(f.be, f.log, &decode);
    decode.name = "decode, window 3";
    decode.window = 3;
    decode.softcap = 0;
    check_case(f.be, f.log, &decode);
    close_device(&f);
}

Test(cuda_attention, head_dims_80_and_256) {
    fixture f = open_device();
    static const int head_dims[] = {80, 256};
    for (int i = 0; i < 2; i++) {
        const tc_case c = {.name = head_dims[i] == 80 ? "head_dim 80" : "head_dim 256",
                           .n_head = 4,
                           .n_head_kv = 1,
                           .head_dim = head_dims[i],
                           .n_groups = 2,
                           .group_tokens = {30, 3},
                           .n_segments = 2,
                           .seg_len = {{100, 30}, {250, 3}},
                           .shared_type = PD_TYPE_F16,
                           .own_type = PD_TYPE_F16,
                           .expect_mma = true,
                           .seed = 600 + (uint64_t)i};
        check_case(f.be, f.log, &c);
    }
    close_device(&f);
}

Test(cuda_attention, queries_that_see_nothing_get_zeros) {
    fixture f = open_device();
    /* Every query precedes every key: the causal mask hides them all. */
    const tc_case c = {.name = "nothing visible",
                       .n_head = 8,
                       .n_head_kv = 2,
                       .head_dim = 64,
                       .n_groups = 2,
                       .group_tokens = {3, 2},
                       .n_shared = 1,
                       .shared_len = 100,
                       .n_segments = 1,
                       .seg_len = {{40}, {20}},
                       .shared_type = PD_TYPE_F16,
                       .own_type = PD_TYPE_F16,
                       .queries_first = true,
                       .expect_mma = true,
                       .seed = 700};
    check_case(f.be, f.log, &c);
    close_device(&f);
}

/* ------------------------------------------------------------------------
 * Where the tensor-core path does not apply: the f32 kernel
 * ------------------------------------------------------------------------ */

Test(cuda_attention, f32_kernel_where_tensor_cores_do_not_apply) {
    fixture f = open_device();
    tc_case c = {.name = "f32 rows",
                 .n_head = 8,
                 .n_head_kv = 2,
                 .head_dim = 64,
                 .n_groups = 1,
                 .group_tokens = {40},
                 .n_segments = 2,
                 .seg_len = {{200, 40}},
                 .shared_type = PD_TYPE_F32,
                 .own_type = PD_TYPE_F32,
                 .expect_mma = false,
                 .seed = 800};
    check_case(f.be, f.log, &c);
    c.name = "f16 rows, head_dim 36";
    c.head_dim = 36;
    c.shared_type = c.own_type = PD_TYPE_F16;
    check_case(f.be, f.log, &c);
    /* f16 own rows over an f32 prefix: one f32 view is enough. */
    const tc_case mixed = {.name = "f16 rows over an f32 prefix",
                           .n_head = 8,
                           .n_head_kv = 2,
                           .head_dim = 64,
                           .n_groups = 2,
                           .group_tokens = {1, 1},
                           .n_shared = 1,
                           .shared_len = 300,
                           .n_segments = 1,
                           .seg_len = {{10}, {50}},
                           .shared_type = PD_TYPE_F32,
                           .own_type = PD_TYPE_F16,
                           .expect_mma = false,
                           .seed = 801};
    check_case(f.be, f.log, &mixed);
    /* MHA decode: one query row per kv head. */
    const tc_case mha = {.name = "MHA decode",
                         .n_head = 4,
                         .n_head_kv = 4,
                         .head_dim = 64,
                         .n_groups = 4,
                         .group_tokens = {1, 1, 1, 1},
                         .n_segments = 1,
                         .seg_len = {{5}, {60}, {200}, {33}},
                         .shared_type = PD_TYPE_F16,
                         .own_type = PD_TYPE_F16,
                         .expect_mma = false,
                         .seed = 802};
    check_case(f.be, f.log, &mha);
    close_device(&f);
}
