/* Compactor's building blocks (leverage, sketch, non-causal attention,
 * z-score, pooling, rank correlation), the Compactor / leverage /
 * noncausal scorers in both profiles, the simple scorers and
 * pd_policy_score's argument checks. Every number is compared with a naive
 * double-precision reference written here from the description in
 * policies.h and DESIGN.md, on seeded synthetic layers. */
#include <criterion/criterion.h>
#include <criterion/logging.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "helpers.h"
#include "policies/policies.h"

/* ---- test data ---------------------------------------------------------- */

/* A 64-bit LCG with an xorshift output: deliberately not the library's
 * splitmix64, so test data and sketch are independent. */
typedef struct trng {
    uint64_t s;
} trng;

static uint64_t trng_next(trng *r) {
    r->s = r->s * 6364136223846793005ULL + 1442695040888963407ULL;
    uint64_t x = r->s;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    return x ^ (x >> 33);
}

static double trng_unif(trng *r) { return (double)(trng_next(r) >> 11) * 0x1p-53; }

static double trng_normal(trng *r) {
    double u1 = 1.0 - trng_unif(r), u2 = trng_unif(r);
    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

static void *xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size);
    cr_assert_not_null(p, "out of memory in the test");
    return p;
}

/* A synthetic layer. Pre-RoPE keys get a per-(head, dim) offset and a
 * per-dim scale so centring and anisotropy matter; post-RoPE keys, queries
 * and values are independent Gaussians (the scorers never relate them). */
typedef struct syn {
    pd_layer_kv kv;
    float *kpre, *q, *k, *v;
    int32_t *pos;
} syn;

static syn syn_make(int64_t n, int n_head, int n_head_kv, int d, uint64_t seed) {
    syn s;
    memset(&s, 0, sizeof s);
    trng r = {seed * 0x9e3779b97f4a7c15ULL + 12345};
    size_t kvn = (size_t)n * n_head_kv * d, qn = (size_t)n * n_head * d;
    s.kpre = xcalloc(kvn, sizeof(float));
    s.k = xcalloc(kvn, sizeof(float));
    s.v = xcalloc(kvn, sizeof(float));
    s.q = xcalloc(qn, sizeof(float));
    s.pos = xcalloc((size_t)n, sizeof(int32_t));
    double *mu = xcalloc((size_t)n_head_kv * d, sizeof(double));
    for (int i = 0; i < n_head_kv * d; i++) mu[i] = 3.0 * trng_normal(&r);
    for (int64_t t = 0; t < n; t++)
        for (int h = 0; h < n_head_kv; h++)
            for (int j = 0; j < d; j++) {
                size_t o = ((size_t)t * n_head_kv + h) * d + j;
                s.kpre[o] = (float)(mu[h * d + j] + trng_normal(&r) * (0.3 + 1.5 * exp(-j / 4.0)));
                s.k[o] = (float)trng_normal(&r);
                s.v[o] = (float)(0.2 + trng_unif(&r));
            }
    for (size_t i = 0; i < qn; i++) s.q[i] = (float)(0.5 * trng_normal(&r));
    for (int64_t t = 0; t < n; t++) s.pos[t] = (int32_t)(1000 + 3 * t);
    free(mu);
    s.kv = (pd_layer_kv){.layer = 3, .n_tokens = n, .n_head = n_head, .n_head_kv = n_head_kv, .head_dim = d,
                         .pos = s.pos, .k_pre_rope = s.kpre, .q = s.q, .k = s.k, .v = s.v};
    return s;
}

static void syn_free(syn *s) {
    free(s->kpre);
    free(s->q);
    free(s->k);
    free(s->v);
    free(s->pos);
}

/* The two Compactor profiles as described in DESIGN.md, field by field. */
static void spec_official(pd_policy_spec *s) {
    memset(s, 0, sizeof *s);
    s->kind = s->scorer = PD_POLICY_COMPACTOR;
    s->retention = 0.25;
    s->seed = 1;
    s->budget = PD_BUDGET_GLOBAL;
    s->sink = 16;
    s->recent = 64;
    s->reuse = 1;
    s->profile = PD_PROFILE_OFFICIAL;
    s->lambda = 0.5;
    s->sketch = 48;
    s->lev_chunk = 512;
    s->ridge = 5e-3;
    s->attn_chunk = 128;
    s->scale = 1.0;
    s->vnorm = false;
    s->leverage = PD_LEVERAGE_APPROX;
    s->pool = 1;
}

static void spec_kvpress(pd_policy_spec *s) {
    spec_official(s);
    s->profile = PD_PROFILE_KVPRESS;
    s->budget = PD_BUDGET_UNIFORM;
    s->sink = 8;
    s->recent = 4;
    s->lambda = -1; /* auto: 1 - retention */
    s->lev_chunk = 0;
    s->ridge = 1e-2;
    s->attn_chunk = 256;
    s->vnorm = true;
    s->pool = 3;
}

/* ---- naive references --------------------------------------------------- */

/* Rows [0, m) minus their column means, in double. */
static void ref_center(const float *rows, int64_t m, int d, int64_t stride, double *c) {
    for (int j = 0; j < d; j++) {
        double mean = 0;
        for (int64_t i = 0; i < m; i++) mean += rows[i * stride + j];
        mean /= (double)m;
        for (int64_t i = 0; i < m; i++) c[i * d + j] = rows[i * stride + j] - mean;
    }
}

/* Exact leverage: modified Gram-Schmidt (twice) over the columns of the
 * centred chunk, dropping columns whose residual is below 1e-5 of the
 * largest column (float keys carry ~1e-7 rounding noise, which is not a
 * direction), then the squared row norms of the orthonormal basis (the
 * hat matrix diagonal). */
static void ref_leverage_exact(const float *rows, int64_t n, int d, int64_t stride, int64_t chunk, double *out) {
    int64_t len = chunk > 0 && chunk < n ? chunk : n;
    double *c = xcalloc((size_t)len * d, sizeof(double)), *basis = xcalloc((size_t)len * d, sizeof(double));
    double *v = xcalloc((size_t)len, sizeof(double));
    for (int64_t c0 = 0; c0 < n; c0 += len) {
        int64_t m = n - c0 < len ? n - c0 : len;
        ref_center(rows + c0 * stride, m, d, stride, c);
        double maxnorm = 0;
        for (int j = 0; j < d; j++) {
            double s = 0;
            for (int64_t i = 0; i < m; i++) s += c[i * d + j] * c[i * d + j];
            maxnorm = fmax(maxnorm, sqrt(s));
        }
        int r = 0;
        for (int j = 0; j < d; j++) {
            for (int64_t i = 0; i < m; i++) v[i] = c[i * d + j];
            for (int pass = 0; pass < 2; pass++)
                for (int b = 0; b < r; b++) {
                    double dot = 0;
                    for (int64_t i = 0; i < m; i++) dot += basis[i * d + b] * v[i];
                    for (int64_t i = 0; i < m; i++) v[i] -= dot * basis[i * d + b];
                }
            double nv = 0;
            for (int64_t i = 0; i < m; i++) nv += v[i] * v[i];
            nv = sqrt(nv);
            if (nv > 1e-5 * maxnorm && nv > 0) {
                for (int64_t i = 0; i < m; i++) basis[i * d + r] = v[i] / nv;
                r++;
            }
        }
        for (int64_t i = 0; i < m; i++) {
            double l = 0;
            for (int b = 0; b < r; b++) l += basis[i * d + b] * basis[i * d + b];
            out[c0 + i] = l;
        }
    }
    free(c);
    free(basis);
    free(v);
}

/* Solve A z = b (n x n, row-major, destroyed) by Gaussian elimination with
 * partial pivoting. */
static void ref_solve(double *a, double *b, int n) {
    for (int col = 0; col < n; col++) {
        int p = col;
        for (int i = col + 1; i < n; i++)
            if (fabs(a[i * n + col]) > fabs(a[p * n + col])) p = i;
        if (p != col) {
            for (int j = 0; j < n; j++) {
                double t = a[col * n + j];
                a[col * n + j] = a[p * n + j];
                a[p * n + j] = t;
            }
            double t = b[col];
            b[col] = b[p];
            b[p] = t;
        }
        for (int i = col + 1; i < n; i++) {
            double f = a[i * n + col] / a[col * n + col];
            for (int j = col; j < n; j++) a[i * n + j] -= f * a[col * n + j];
            b[i] -= f * b[col];
        }
    }
    for (int i = n - 1; i >= 0; i--) {
        double s = b[i];
        for (int j = i + 1; j < n; j++) s -= a[i * n + j] * b[j];
        b[i] = s / a[i * n + i];
    }
}

/* Approximate leverage: x_i = centred row * phi, l_i = x_i . (X^T X + ridge I)^-1 x_i. */
static void ref_leverage_approx(const float *rows, int64_t n, int d, int64_t stride, const float *phi, int sk,
                                int64_t chunk, double ridge, double *out) {
    int64_t len = chunk > 0 && chunk < n ? chunk : n;
    double *c = xcalloc((size_t)len * d, sizeof(double)), *x = xcalloc((size_t)len * sk, sizeof(double));
    double *g = xcalloc((size_t)sk * sk, sizeof(double)), *a = xcalloc((size_t)sk * sk, sizeof(double));
    double *z = xcalloc((size_t)sk, sizeof(double));
    for (int64_t c0 = 0; c0 < n; c0 += len) {
        int64_t m = n - c0 < len ? n - c0 : len;
        ref_center(rows + c0 * stride, m, d, stride, c);
        for (int64_t i = 0; i < m; i++)
            for (int s = 0; s < sk; s++) {
                double acc = 0;
                for (int j = 0; j < d; j++) acc += c[i * d + j] * phi[j * sk + s];
                x[i * sk + s] = acc;
            }
        for (int s = 0; s < sk; s++)
            for (int t = 0; t < sk; t++) {
                double acc = s == t ? ridge : 0;
                for (int64_t i = 0; i < m; i++) acc += x[i * sk + s] * x[i * sk + t];
                g[s * sk + t] = acc;
            }
        for (int64_t i = 0; i < m; i++) {
            memcpy(a, g, (size_t)sk * sk * sizeof(double));
            for (int s = 0; s < sk; s++) z[s] = x[i * sk + s];
            ref_solve(a, z, sk);
            double l = 0;
            for (int s = 0; s < sk; s++) l += x[i * sk + s] * z[s];
            out[c0 + i] = fmax(l, 0);
        }
    }
    free(c);
    free(x);
    free(g);
    free(a);
    free(z);
}

/* Column sums of softmax(scale q.k) inside chunks, in double. */
static void ref_colsum(const float *q, int64_t q_stride, int n_q, const float *k, int64_t k_stride, int64_t n, int d,
                       int64_t chunk, double scale, double *out) {
    if (chunk <= 0 || chunk > n) chunk = n;
    if (scale == 0) scale = 1.0 / sqrt((double)d);
    double *w = xcalloc((size_t)chunk, sizeof(double));
    for (int64_t i = 0; i < n; i++) out[i] = 0;
    for (int64_t c0 = 0; c0 < n; c0 += chunk) {
        int64_t m = n - c0 < chunk ? n - c0 : chunk;
        for (int h = 0; h < n_q; h++)
            for (int64_t i = c0; i < c0 + m; i++) {
                double mx = -INFINITY, sum = 0;
                for (int64_t j = c0; j < c0 + m; j++) {
                    double dot = 0;
                    for (int e = 0; e < d; e++) dot += (double)q[i * q_stride + h * d + e] * k[j * k_stride + e];
                    w[j - c0] = scale * dot;
                    mx = fmax(mx, w[j - c0]);
                }
                for (int64_t j = 0; j < m; j++) sum += (w[j] = exp(w[j] - mx));
                for (int64_t j = 0; j < m; j++) out[c0 + j] += w[j] / sum;
            }
    }
    free(w);
}

static void ref_zscore(double *x, int64_t n) {
    double mean = 0, var = 0;
    for (int64_t i = 0; i < n; i++) mean += x[i];
    mean /= (double)n;
    for (int64_t i = 0; i < n; i++) var += (x[i] - mean) * (x[i] - mean);
    double sd = fmax(sqrt(var / (double)n), 1e-6);
    for (int64_t i = 0; i < n; i++) x[i] = (x[i] - mean) / sd;
}

/* torch avg_pool1d(kernel w, stride 1, padding w/2, count_include_pad). */
static void ref_pool(const double *in, int64_t n, int w, double *out) {
    for (int64_t i = 0; i < n; i++) {
        double s = 0;
        for (int64_t j = i - w / 2; j <= i + w / 2; j++)
            if (j >= 0 && j < n) s += in[j];
        out[i] = s / w;
    }
}

/* Spearman with average ranks, ranks by counting. */
static double ref_spearman(const float *a, const float *b, int64_t n) {
    double *ra = xcalloc((size_t)n, sizeof(double)), *rb = xcalloc((size_t)n, sizeof(double));
    for (int64_t i = 0; i < n; i++) {
        int64_t la = 0, ea = 0, lb = 0, eb = 0;
        for (int64_t j = 0; j < n; j++) {
            la += a[j] < a[i];
            ea += a[j] == a[i];
            lb += b[j] < b[i];
            eb += b[j] == b[i];
        }
        ra[i] = (double)la + (double)(ea + 1) / 2.0;
        rb[i] = (double)lb + (double)(eb + 1) / 2.0;
    }
    double ma = 0, mb = 0, sab = 0, saa = 0, sbb = 0;
    for (int64_t i = 0; i < n; i++) {
        ma += ra[i];
        mb += rb[i];
    }
    ma /= (double)n;
    mb /= (double)n;
    for (int64_t i = 0; i < n; i++) {
        sab += (ra[i] - ma) * (rb[i] - mb);
        saa += (ra[i] - ma) * (ra[i] - ma);
        sbb += (rb[i] - mb) * (rb[i] - mb);
    }
    free(ra);
    free(rb);
    return saa > 0 && sbb > 0 ? sab / sqrt(saa * sbb) : 0;
}

/* Compactor from its description: leverage of the pre-RoPE keys and
 * non-causal attention, each z-scored over the layer, blended; kvpress
 * scores only the unprotected middle (group mean of attention, times ||v||,
 * pooled) and gives the protected tokens max + 1. `parts` selects
 * 1 = attention only, 2 = leverage only, 3 = both. out: [H][hi - lo]. */
static void ref_compactor(const pd_policy_spec *s, const pd_layer_kv *kv, int64_t lo, int64_t hi, int parts,
                          double *out) {
    int64_t n = hi - lo, a = lo, b = hi;
    int H = kv->n_head_kv, d = kv->head_dim, g = kv->n_head / kv->n_head_kv;
    if (s->profile == PD_PROFILE_KVPRESS && parts == 3) {
        int64_t sk = s->sink < n ? s->sink : n;
        int64_t rc = s->recent < n - sk ? s->recent : n - sk;
        a = lo + sk;
        b = hi - rc;
    }
    int64_t m = b - a;
    double *lev = xcalloc((size_t)H * m, sizeof(double)), *att = xcalloc((size_t)H * m, sizeof(double));
    double *tmp = xcalloc((size_t)m, sizeof(double));
    float *phi = xcalloc((size_t)d * s->sketch, sizeof(float));
    pd_gaussian_sketch(s->seed, d, s->sketch, phi);
    int64_t kst = (int64_t)H * d, qst = (int64_t)kv->n_head * d;
    for (int h = 0; h < H && m > 0; h++) {
        if (s->leverage == PD_LEVERAGE_EXACT)
            ref_leverage_exact(kv->k_pre_rope + a * kst + h * d, m, d, kst, s->lev_chunk, lev + h * m);
        else
            ref_leverage_approx(kv->k_pre_rope + a * kst + h * d, m, d, kst, phi, s->sketch, s->lev_chunk, s->ridge,
                                lev + h * m);
        for (int j = 0; j < g; j++) {
            ref_colsum(kv->q + a * qst + (int64_t)(h * g + j) * d, qst, 1, kv->k + a * kst + h * d, kst, m, d,
                       s->attn_chunk, s->scale, tmp);
            for (int64_t i = 0; i < m; i++) att[h * m + i] += tmp[i] / g;
        }
        if (s->vnorm)
            for (int64_t i = 0; i < m; i++) {
                double nv = 0;
                for (int e = 0; e < d; e++) {
                    double x = kv->v[(a + i) * kst + h * d + e];
                    nv += x * x;
                }
                att[h * m + i] *= sqrt(nv);
            }
        if (s->pool > 1) {
            ref_pool(att + h * m, m, s->pool, tmp);
            memcpy(att + h * m, tmp, (size_t)m * sizeof(double));
        }
    }
    double top = 0;
    if (m > 0) {
        ref_zscore(lev, H * m);
        ref_zscore(att, H * m);
        double lambda = s->lambda < 0 ? 1 - s->retention : s->lambda;
        top = -INFINITY;
        for (int h = 0; h < H; h++)
            for (int64_t i = 0; i < m; i++) {
                double v = parts == 1 ? att[h * m + i]
                           : parts == 2 ? lev[h * m + i]
                                        : att[h * m + i] + lambda * lev[h * m + i];
                out[h * n + (a - lo) + i] = v;
                top = fmax(top, v);
            }
    }
    for (int h = 0; h < H; h++)
        for (int64_t i = lo; i < hi; i++)
            if (i < a || i >= b) out[h * n + (i - lo)] = top + 1;
    free(lev);
    free(att);
    free(tmp);
    free(phi);
}

static double max_abs_diff(const float *a, const double *b, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs((double)a[i] - b[i]));
    return m;
}

static float *to_float(const double *x, int64_t n) {
    float *f = xcalloc((size_t)n, sizeof(float));
    for (int64_t i = 0; i < n; i++) f[i] = (float)x[i];
    return f;
}

/* ---- sketch -------------------------------------------------------------- */

Test(sketch, gaussian_statistics_and_determinism) {
    enum { D = 256, S = 256, N = D * S };
    float *a = xcalloc(N, sizeof(float)), *b = xcalloc(N, sizeof(float)), *c = xcalloc(N, sizeof(float));
    pd_gaussian_sketch(42, D, S, a);
    pd_gaussian_sketch(42, D, S, b);
    pd_gaussian_sketch(43, D, S, c);
    cr_assert(memcmp(a, b, N * sizeof(float)) == 0, "the same seed must give the same sketch");
    int same = 0;
    for (int i = 0; i < N; i++) same += a[i] == c[i];
    cr_assert_lt(same, 10, "seeds 42 and 43 share %d of %d entries", same, N);
    double mean = 0, var = 0, m4 = 0;
    for (int i = 0; i < N; i++) {
        cr_assert(isfinite(a[i]));
        mean += a[i];
    }
    mean /= N;
    for (int i = 0; i < N; i++) {
        double z = a[i] - mean;
        var += z * z;
        m4 += z * z * z * z;
    }
    var /= N;
    m4 /= N;
    double want = 1.0 / S, sd = sqrt(want);
    /* Bounds at about 5 standard errors: mean sd/sqrt(N), variance
     * want*sqrt(2/N) (1.1% here), kurtosis sqrt(24/N) (0.02). */
    cr_assert_lt(fabs(mean), 5 * sd / sqrt(N), "mean %g", mean);
    cr_assert_lt(fabs(var / want - 1), 0.03, "variance %g, want %g", var, want);
    cr_assert_lt(fabs(m4 / (var * var) - 3), 0.1, "kurtosis %g, want 3 (Gaussian)", m4 / (var * var));
    /* Independence of neighbours (Box-Muller pairs): lag-1 correlation ~ 0. */
    double lag = 0;
    for (int i = 0; i + 1 < N; i++) lag += (a[i] - mean) * (a[i + 1] - mean);
    lag /= (N - 1) * var;
    cr_assert_lt(fabs(lag), 5 / sqrt(N), "lag-1 correlation %g", lag);
    /* An odd number of entries is filled completely. */
    float odd[3 * 5];
    for (int i = 0; i < 15; i++) odd[i] = NAN;
    pd_gaussian_sketch(7, 3, 5, odd);
    for (int i = 0; i < 15; i++) cr_assert(isfinite(odd[i]), "entry %d of a 3 x 5 sketch", i);
    free(a);
    free(b);
    free(c);
}

/* ---- leverage ------------------------------------------------------------ */

/* Head 1 of a 2-kv-head layer, so strides are exercised; 300 rows in chunks
 * of 128 leave a short last chunk of 44. */
Test(leverage, exact_matches_gram_schmidt) {
    syn s = syn_make(300, 2, 2, 16, 1);
    int64_t stride = 2 * 16;
    const float *rows = s.kpre + 16;
    float out[300];
    double ref[300];
    pd_error err = {0};
    int64_t chunks[] = {128, 0, 300, 17};
    for (size_t t = 0; t < sizeof chunks / sizeof chunks[0]; t++) {
        cr_assert_eq(pd_leverage_scores(rows, 300, 16, stride, NULL, 0, chunks[t], 0, PD_LEVERAGE_EXACT, out, &err),
                     PD_OK, "%s", err.msg);
        ref_leverage_exact(rows, 300, 16, stride, chunks[t], ref);
        double diff = max_abs_diff(out, ref, 300);
        cr_assert_lt(diff, 1e-4, "chunk %ld: max |exact - reference| = %g", (long)chunks[t], diff);
        /* The hat matrix of a rank-r chunk has trace r: 16 (min(m - 1, d) for
         * m = 17 rows after centring). */
        int64_t len = chunks[t] ? chunks[t] : 300;
        double tr = 0;
        for (int64_t i = 0; i < len; i++) tr += out[i];
        cr_assert_float_eq(tr, fmin(len - 1, 16), 1e-3, "trace %g of the first chunk", tr);
    }
    syn_free(&s);
}

Test(leverage, exact_rank_deficient) {
    /* 10 rows in 16 dimensions: centred, they span 9 dimensions and every
     * row has leverage 1 - 1/10. Duplicated rows share their leverage. */
    syn s = syn_make(10, 1, 1, 16, 2);
    float out[10];
    pd_error err = {0};
    cr_assert_eq(pd_leverage_scores(s.kpre, 10, 16, 16, NULL, 0, 0, 0, PD_LEVERAGE_EXACT, out, &err), PD_OK, "%s",
                 err.msg);
    for (int i = 0; i < 10; i++) cr_assert_float_eq(out[i], 0.9, 1e-5, "row %d: %g", i, out[i]);
    /* 40 rows, only 4 distinct (10 copies each) in 16 dimensions. */
    syn t = syn_make(40, 1, 1, 16, 3);
    for (int i = 4; i < 40; i++) memcpy(t.kpre + i * 16, t.kpre + (i % 4) * 16, 16 * sizeof(float));
    float out2[40];
    double ref2[40];
    cr_assert_eq(pd_leverage_scores(t.kpre, 40, 16, 16, NULL, 0, 0, 0, PD_LEVERAGE_EXACT, out2, &err), PD_OK, "%s",
                 err.msg);
    ref_leverage_exact(t.kpre, 40, 16, 16, 0, ref2);
    cr_assert_lt(max_abs_diff(out2, ref2, 40), 1e-5);
    double tr = 0;
    for (int i = 0; i < 40; i++) tr += out2[i];
    cr_assert_float_eq(tr, 3.0, 1e-4, "4 distinct centred rows have rank 3, trace %g", tr);
    /* All rows equal: zero leverage, not NaN. */
    for (int i = 1; i < 40; i++) memcpy(t.kpre + i * 16, t.kpre, 16 * sizeof(float));
    cr_assert_eq(pd_leverage_scores(t.kpre, 40, 16, 16, NULL, 0, 0, 0, PD_LEVERAGE_EXACT, out2, &err), PD_OK);
    for (int i = 0; i < 40; i++) cr_assert_eq(out2[i], 0.0f);
    syn_free(&s);
    syn_free(&t);
}

Test(leverage, approx_matches_reference) {
    syn s = syn_make(700, 2, 2, 16, 4);
    int64_t stride = 32;
    const float *rows = s.kpre + 16;
    float phi[16 * 12], out[700];
    double ref[700];
    pd_error err = {0};
    pd_gaussian_sketch(9, 16, 12, phi);
    int64_t chunks[] = {512, 0, 100};
    double ridges[] = {5e-3, 1e-2, 3.0};
    for (size_t t = 0; t < 3; t++) {
        cr_assert_eq(pd_leverage_scores(rows, 700, 16, stride, phi, 12, chunks[t], ridges[t], PD_LEVERAGE_APPROX, out,
                                        &err),
                     PD_OK, "%s", err.msg);
        ref_leverage_approx(rows, 700, 16, stride, phi, 12, chunks[t], ridges[t], ref);
        double worst = 0;
        for (int i = 0; i < 700; i++) worst = fmax(worst, fabs(out[i] - ref[i]) / fmax(ref[i], 1e-3));
        cr_assert_lt(worst, 1e-4, "chunk %ld ridge %g: worst relative error %g", (long)chunks[t], ridges[t], worst);
    }
    syn_free(&s);
}

/* With sketch >= d the sketch is injective on the keys' row space, so
 * with a negligible ridge the approximate scores are the exact ones. (The
 * default ridge 5e-3 is not negligible here: a square Gaussian sketch is
 * ill-conditioned, its smallest singular value is about 1/d.) */
Test(leverage, approx_with_full_sketch_matches_exact) {
    syn s = syn_make(512, 1, 1, 32, 5);
    float out[512], ex[512];
    pd_error err = {0};
    cr_assert_eq(pd_leverage_scores(s.kpre, 512, 32, 32, NULL, 0, 0, 0, PD_LEVERAGE_EXACT, ex, &err), PD_OK);
    int sketches[] = {32, 48, 64};
    for (int t = 0; t < 3; t++) {
        float *phi = xcalloc((size_t)32 * sketches[t], sizeof(float));
        pd_gaussian_sketch(11 + t, 32, sketches[t], phi);
        cr_assert_eq(pd_leverage_scores(s.kpre, 512, 32, 32, phi, sketches[t], 0, 1e-7, PD_LEVERAGE_APPROX, out, &err),
                     PD_OK, "%s", err.msg);
        double rho = pd_rank_correlation(out, ex, 512);
        cr_log_info("leverage: sketch %d >= d 32: Spearman vs exact %.6f", sketches[t], rho);
        cr_assert_gt(rho, 0.99, "sketch %d: Spearman %g", sketches[t], rho);
        double diff = 0;
        for (int i = 0; i < 512; i++) diff = fmax(diff, fabs(out[i] - ex[i]));
        cr_assert_lt(diff, 1e-3, "sketch %d: max |approx - exact| = %g", sketches[t], diff);
        free(phi);
    }
    syn_free(&s);
}

/* Keys with a decaying spectrum: pre-RoPE keys put most of their energy in
 * a few directions. decay <= 0: rank-40 keys (40 random directions of the
 * 64 dimensions, each as strong), which a 48-wide sketch sees whole. */
static void spectrum_keys(trng *r, float *rows, int64_t n, int d, double decay) {
    if (decay <= 0) {
        enum { RANK = 40 };
        double *basis = xcalloc((size_t)RANK * d, sizeof(double));
        for (int i = 0; i < RANK * d; i++) basis[i] = trng_normal(r);
        for (int64_t i = 0; i < n; i++) {
            double z[RANK];
            for (int k = 0; k < RANK; k++) z[k] = trng_normal(r);
            for (int j = 0; j < d; j++) {
                double x = 0.5;
                for (int k = 0; k < RANK; k++) x += z[k] * basis[k * d + j];
                rows[i * d + j] = (float)x;
            }
        }
        free(basis);
        return;
    }
    for (int64_t i = 0; i < n; i++)
        for (int j = 0; j < d; j++) rows[i * d + j] = (float)(trng_normal(r) * exp(-j / decay) + 0.5);
}

/* d = 64, sketch 48 < d, one chunk of 512 keys: how well does the sketched
 * order follow the exact one? Exact leverage is a Mahalanobis norm, so it
 * weighs every direction of the keys alike however weak; the sketch keeps
 * 48 random mixtures of the 64. For isotropic keys the two are sums of 64
 * and of 48 (correlated) squared coordinates, Pearson correlation about
 * sqrt(48/64) = 0.87; the measured Spearman is 0.819 (min) / 0.834
 * (mean). A steep spectrum makes it worse, since the weak directions that
 * exact leverage counts fully are the ones the sketch blurs together:
 * 0.825 / 0.842 at decay 16, 0.772 / 0.792 at decay 8. Keys of rank
 * 40 <= 48 keep their whole column space through the sketch, so the order
 * is the exact one (1.0000). Bounds: the measured minimum over the 8 seeds
 * minus about 0.03 (the data are seeded; the margin only absorbs BLAS
 * rounding differences). */
Test(leverage, sketch48_rank_correlation) {
    enum { N = 512, D = 64, S = 48, SEEDS = 8 };
    float *rows = xcalloc((size_t)N * D, sizeof(float)), *phi = xcalloc((size_t)D * S, sizeof(float));
    float ap[N], ex[N];
    pd_error err = {0};
    double decays[] = {1e9 /* isotropic */, 16.0, 8.0, 0 /* rank 40 */};
    const char *names[] = {"isotropic", "decay 16", "decay 8", "rank 40"};
    double bound[] = {0.79, 0.79, 0.74, 0.99};
    for (int t = 0; t < 4; t++) {
        double lo = 1, sum = 0;
        for (int seed = 0; seed < SEEDS; seed++) {
            trng r = {1000 + (uint64_t)seed};
            spectrum_keys(&r, rows, N, D, decays[t]);
            pd_gaussian_sketch((uint64_t)seed + 1, D, S, phi);
            cr_assert_eq(pd_leverage_scores(rows, N, D, D, phi, S, 0, 5e-3, PD_LEVERAGE_APPROX, ap, &err), PD_OK);
            cr_assert_eq(pd_leverage_scores(rows, N, D, D, NULL, 0, 0, 0, PD_LEVERAGE_EXACT, ex, &err), PD_OK);
            double rho = pd_rank_correlation(ap, ex, N);
            lo = fmin(lo, rho);
            sum += rho;
        }
        cr_log_info("leverage: d 64, sketch 48, %s keys: Spearman approx vs exact min %.4f mean %.4f over %d seeds",
                    names[t], lo, sum / SEEDS, SEEDS);
        cr_assert_gt(lo, bound[t], "%s: Spearman %g", names[t], lo);
    }
    free(rows);
    free(phi);
}

/* A few keys far off the bulk are the outliers leverage is meant to find:
 * they must rank first both exactly and through a 48-wide sketch. */
Test(leverage, outlier_keys_rank_first) {
    enum { N = 512, D = 64, S = 48 };
    float *rows = xcalloc((size_t)N * D, sizeof(float)), *phi = xcalloc((size_t)D * S, sizeof(float));
    float ap[N], ex[N];
    trng r = {77};
    spectrum_keys(&r, rows, N, D, 16.0);
    int outliers[] = {5, 200, 511};
    for (int o = 0; o < 3; o++)
        for (int j = 0; j < D; j++) rows[outliers[o] * D + j] += (float)(4.0 * trng_normal(&r));
    pd_gaussian_sketch(1, D, S, phi);
    pd_error err = {0};
    cr_assert_eq(pd_leverage_scores(rows, N, D, D, phi, S, 512, 5e-3, PD_LEVERAGE_APPROX, ap, &err), PD_OK);
    cr_assert_eq(pd_leverage_scores(rows, N, D, D, NULL, 0, 512, 0, PD_LEVERAGE_EXACT, ex, &err), PD_OK);
    const float *both[] = {ap, ex};
    for (int t = 0; t < 2; t++) {
        float worst_outlier = INFINITY, best_other = -INFINITY;
        for (int i = 0; i < N; i++) {
            bool is_out = i == 5 || i == 200 || i == 511;
            if (is_out) worst_outlier = fminf(worst_outlier, both[t][i]);
            else best_other = fmaxf(best_other, both[t][i]);
        }
        cr_assert_gt(worst_outlier, best_other, "%s: outliers' lowest leverage %g vs others' highest %g",
                     t ? "exact" : "approx", worst_outlier, best_other);
    }
    free(rows);
    free(phi);
}

/* Singular Gram matrices: duplicates and fewer rows than the sketch, with
 * ridge 0 so the first Cholesky must fail and the retries take over. */
Test(leverage, cholesky_retry_on_rank_deficient_chunk) {
    enum { D = 16, S = 48 };
    float phi[D * S], out[64];
    pd_gaussian_sketch(3, D, S, phi);
    syn s = syn_make(64, 1, 1, D, 6);
    for (int i = 8; i < 64; i++) memcpy(s.kpre + i * D, s.kpre + (i % 8) * D, D * sizeof(float));
    pd_error err = {0};
    int64_t ns[] = {5, 64};
    for (int t = 0; t < 2; t++) {
        cr_assert_eq(pd_leverage_scores(s.kpre, ns[t], D, D, phi, S, 0, 0.0, PD_LEVERAGE_APPROX, out, &err), PD_OK,
                     "%s", err.msg);
        for (int64_t i = 0; i < ns[t]; i++) cr_assert(isfinite(out[i]) && out[i] >= 0, "row %ld: %g", (long)i, out[i]);
        /* Copies of one row share one score. */
        for (int64_t i = 8; i < ns[t]; i++) cr_assert_eq(out[i], out[i % 8]);
        /* A small ridge only shrinks the projection a little: 5 centred
         * rows span 4 dimensions, each with leverage 4/5; 8 distinct rows
         * (8 copies each) span 7, each of the 64 with 7/64. A factorisation
         * that had "succeeded" on the singular matrix would give wild
         * values. */
        double want = t == 0 ? 0.8 : 7.0 / 64;
        for (int64_t i = 0; i < ns[t]; i++)
            cr_assert(out[i] <= want + 1e-6 && out[i] > want - 1e-2, "%ld rows, row %ld: %g, want just under %g",
                      (long)ns[t], (long)i, out[i], want);
    }
    /* One row: centred to exactly zero, G = 0 cannot be factored without a
     * ridge; after the retry the leverage is 0. */
    cr_assert_eq(pd_leverage_scores(s.kpre, 1, D, D, phi, S, 0, 0.0, PD_LEVERAGE_APPROX, out, &err), PD_OK);
    cr_assert_eq(out[0], 0.0f);
    /* NaN keys cannot be factored at any ridge. */
    s.kpre[3] = NAN;
    cr_assert_eq(pd_leverage_scores(s.kpre, 64, D, D, phi, S, 0, 5e-3, PD_LEVERAGE_APPROX, out, &err), PD_ERANGE);
    cr_assert(strstr(err.msg, "NaN"), "%s", err.msg);
    cr_assert_eq(pd_leverage_scores(s.kpre, 64, D, D, NULL, 0, 0, 0, PD_LEVERAGE_EXACT, out, &err) < 0, true);
    syn_free(&s);
}

Test(leverage, argument_errors) {
    float rows[32] = {0}, phi[16] = {0}, out[4];
    pd_error err = {0};
    cr_assert_eq(pd_leverage_scores(rows, 4, 0, 8, phi, 2, 0, 0, PD_LEVERAGE_APPROX, out, &err), PD_EINVAL);
    cr_assert_eq(pd_leverage_scores(rows, 4, 8, 4, phi, 2, 0, 0, PD_LEVERAGE_APPROX, out, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "stride"), "%s", err.msg);
    cr_assert_eq(pd_leverage_scores(rows, 4, 8, 8, NULL, 2, 0, 0, PD_LEVERAGE_APPROX, out, &err), PD_EINVAL);
    cr_assert_eq(pd_leverage_scores(rows, 4, 8, 8, phi, 2, 0, -1, PD_LEVERAGE_APPROX, out, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "ridge"), "%s", err.msg);
    cr_assert_eq(pd_leverage_scores(rows, 4, 8, 8, phi, 2, -3, 0, PD_LEVERAGE_APPROX, out, &err), PD_EINVAL);
    cr_assert_eq(pd_leverage_scores(rows, 0, 8, 8, phi, 2, 0, 0, PD_LEVERAGE_APPROX, out, &err), PD_OK);
}

/* ---- non-causal attention ------------------------------------------------ */

Test(noncausal, colsum_matches_reference) {
    /* 2 kv heads x 2 query heads each; take kv head 1's group. */
    syn s = syn_make(700, 4, 2, 16, 7);
    int64_t qst = 4 * 16, kst = 2 * 16;
    const float *q = s.q + 2 * 16, *k = s.k + 16;
    float *out = xcalloc(700, sizeof(float));
    double *ref = xcalloc(700, sizeof(double));
    struct {
        int64_t n, chunk;
        float scale;
    } cases[] = {
        {300, 128, 1.0f}, /* short last chunk of 44 */
        {700, 300, 1.0f}, /* chunks larger than the internal tiles */
        {100, 0, 0.5f},   /* 0 = one chunk */
        {100, 500, 1.0f}, /* chunk longer than the range */
        {37, 1, 1.0f},    /* every key alone: weight 1 from each query head */
        {257, 256, 0.0f}, /* scale 0 = 1/sqrt(d); a last chunk of one */
    };
    for (size_t t = 0; t < sizeof cases / sizeof cases[0]; t++) {
        pd_noncausal_colsum(q, qst, 2, k, kst, cases[t].n, 16, cases[t].chunk, cases[t].scale, out);
        ref_colsum(q, qst, 2, k, kst, cases[t].n, 16, cases[t].chunk, cases[t].scale, ref);
        double worst = 0;
        for (int64_t i = 0; i < cases[t].n; i++) worst = fmax(worst, fabs(out[i] - ref[i]) / fmax(ref[i], 1e-3));
        cr_assert_lt(worst, 1e-4, "case %zu: worst relative error %g", t, worst);
        /* Each query's weights sum to 1: a chunk of m keys receives 2m. */
        int64_t chunk = cases[t].chunk > 0 && cases[t].chunk < cases[t].n ? cases[t].chunk : cases[t].n;
        for (int64_t c0 = 0; c0 < cases[t].n; c0 += chunk) {
            int64_t m = cases[t].n - c0 < chunk ? cases[t].n - c0 : chunk;
            double sum = 0;
            for (int64_t i = c0; i < c0 + m; i++) sum += out[i];
            cr_assert_float_eq(sum, 2.0 * m, 1e-3 * m, "case %zu chunk at %ld: mass %g", t, (long)c0, sum);
        }
    }
    /* scale 0 is exactly the explicit 1/sqrt(d). */
    float *explicit_scale = xcalloc(700, sizeof(float));
    pd_noncausal_colsum(q, qst, 2, k, kst, 300, 16, 128, 0.0f, out);
    pd_noncausal_colsum(q, qst, 2, k, kst, 300, 16, 128, 0.25f, explicit_scale);
    cr_assert(memcmp(out, explicit_scale, 300 * sizeof(float)) == 0);
    free(explicit_scale);
    free(out);
    free(ref);
    syn_free(&s);
}

/* A key that matches every query draws the column: it must come out on
 * top by a wide margin even in a softmax with scale 1. */
Test(noncausal, attractor_key_wins) {
    syn s = syn_make(128, 1, 1, 16, 8);
    for (int j = 0; j < 16; j++) s.k[40 * 16 + j] = 0;
    for (int64_t i = 0; i < 128; i++) s.q[i * 16] = 3.0f;
    s.k[40 * 16] = 4.0f;
    float out[128];
    pd_noncausal_colsum(s.q, 16, 1, s.k, 16, 128, 16, 128, 1.0f, out);
    for (int i = 0; i < 128; i++)
        if (i != 40) cr_assert_gt(out[40], 10 * out[i], "key 40 (%g) vs key %d (%g)", out[40], i, out[i]);
    syn_free(&s);
}

/* ---- z-score, pooling, rank correlation ---------------------------------- */

Test(util, zscore_matches_reference) {
    trng r = {5};
    float x[1001];
    double ref[1001];
    for (int i = 0; i < 1001; i++) ref[i] = x[i] = (float)(100 + 0.01 * trng_normal(&r));
    pd_zscore(x, 1001);
    ref_zscore(ref, 1001);
    cr_assert_lt(max_abs_diff(x, ref, 1001), 1e-3);
    /* A constant vector has std 0, clamped to 1e-6: zeros, not NaN. */
    float c[5] = {2, 2, 2, 2, 2};
    pd_zscore(c, 5);
    for (int i = 0; i < 5; i++) cr_assert_eq(c[i], 0.0f);
    float one = 7;
    pd_zscore(&one, 1);
    cr_assert_eq(one, 0.0f);
    pd_zscore(NULL, 0);
}

Test(util, avg_pool_matches_torch_count_include_pad) {
    trng r = {6};
    double in[50], ref[50];
    float inf_[50], out[50];
    for (int i = 0; i < 50; i++) inf_[i] = (float)(in[i] = trng_normal(&r));
    for (int i = 0; i < 50; i++) in[i] = inf_[i];
    int ws[] = {1, 3, 5, 7, 99};
    int64_t ns[] = {50, 1, 2, 3};
    for (int a = 0; a < 5; a++)
        for (int b = 0; b < 4; b++) {
            pd_avg_pool(inf_, ns[b], ws[a], out);
            ref_pool(in, ns[b], ws[a], ref);
            cr_assert_lt(max_abs_diff(out, ref, ns[b]), 1e-6, "w %d n %ld", ws[a], (long)ns[b]);
        }
    /* Edges average in the padding zeros: [1, 1, 1] pools to [2/3, 1, 2/3]. */
    float ones[3] = {1, 1, 1}, p[3];
    pd_avg_pool(ones, 3, 3, p);
    cr_assert_float_eq(p[0], 2.0 / 3, 1e-7);
    cr_assert_float_eq(p[1], 1.0, 1e-7);
    cr_assert_float_eq(p[2], 2.0 / 3, 1e-7);
}

/* OBCache's pooling: torch max_pool1d(kernel 7, padding 3, stride 1), whose
 * -inf padding never wins. Hand-made, then random against the definition. */
Test(util, max_pool_width_7) {
    static const float in[12] = {3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1};
    static const float want[12] = {3, 3, 3, 3, 0, 0, 0, 0, 1, 1, 1, 1};
    float out[12];
    pd_max_pool(in, 12, 7, out);
    for (int i = 0; i < 12; i++) cr_assert_eq(out[i], want[i], "entry %d: %g, want %g", i, out[i], want[i]);
    static const float neg[5] = {-5, -1, -7, -2, -9};
    static const float want_neg[5] = {-1, -1, -1, -1, -1}; /* padding is not 0 */
    pd_max_pool(neg, 5, 7, out);
    for (int i = 0; i < 5; i++) cr_assert_eq(out[i], want_neg[i], "negative entry %d: %g", i, out[i]);
    pd_max_pool(in, 12, 1, out);
    cr_assert_eq(memcmp(out, in, sizeof in), 0, "width 1 is the identity");
    trng rng = {7};
    for (int iter = 0; iter < 100; iter++) {
        float x[40], y[40];
        int n = 1 + (int)(trng_next(&rng) % 40), w = 1 + 2 * (int)(trng_next(&rng) % 6);
        for (int i = 0; i < n; i++) x[i] = (float)(trng_next(&rng) % 1000) / 10.0f - 50.0f;
        pd_max_pool(x, n, w, y);
        for (int i = 0; i < n; i++) {
            float m = -INFINITY;
            for (int j = i - w / 2; j <= i + w / 2; j++)
                if (j >= 0 && j < n && x[j] > m) m = x[j];
            cr_assert_eq(y[i], m, "n %d w %d entry %d", n, w, i);
        }
    }
}

Test(util, rank_correlation_with_ties) {
    trng r = {7};
    float a[300], b[300];
    for (int i = 0; i < 300; i++) {
        /* Few distinct values, so ties are everywhere. */
        a[i] = (float)floor(trng_unif(&r) * 7);
        b[i] = (float)(a[i] + floor(trng_unif(&r) * 4));
    }
    double got = pd_rank_correlation(a, b, 300), want = ref_spearman(a, b, 300);
    cr_assert_float_eq(got, want, 1e-9, "got %g want %g", got, want);
    for (int i = 0; i < 300; i++) b[i] = (float)trng_normal(&r);
    cr_assert_float_eq(pd_rank_correlation(a, b, 300), ref_spearman(a, b, 300), 1e-9);
    /* Monotone maps give +-1 whatever the values. */
    float c[300];
    for (int i = 0; i < 300; i++) c[i] = expf(b[i]);
    cr_assert_float_eq(pd_rank_correlation(b, c, 300), 1.0, 1e-12);
    for (int i = 0; i < 300; i++) c[i] = -b[i] * b[i] * b[i];
    cr_assert_float_eq(pd_rank_correlation(b, c, 300), -1.0, 1e-12);
    /* Constant input carries no order. */
    float k[4] = {1, 1, 1, 1}, l[4] = {1, 2, 3, 4};
    cr_assert_eq(pd_rank_correlation(k, l, 4), 0.0);
    cr_assert_eq(pd_rank_correlation(l, l, 1), 0.0);
}

/* ---- the Compactor family through pd_policy_score ------------------------- */

static float *score(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi) {
    float *out = xcalloc((size_t)kv->n_head_kv * (hi - lo), sizeof(float));
    pd_error err = {0};
    cr_assert_eq(pd_policy_score(spec, kv, lo, hi, out, &err), PD_OK, "[%ld, %ld): %s", (long)lo, (long)hi, err.msg);
    return out;
}

static void check_against_ref(const pd_policy_spec *spec, const syn *s, int64_t lo, int64_t hi, int parts,
                              const char *what) {
    int64_t len = (int64_t)s->kv.n_head_kv * (hi - lo);
    float *got = score(spec, &s->kv, lo, hi);
    double *ref = xcalloc((size_t)len, sizeof(double));
    ref_compactor(spec, &s->kv, lo, hi, parts, ref);
    double diff = max_abs_diff(got, ref, len);
    float *reff = to_float(ref, len);
    double rho = pd_rank_correlation(got, reff, len);
    cr_assert_lt(diff, 2e-3, "%s g=%d [%ld, %ld): max |score - reference| = %g", what,
                 s->kv.n_head / s->kv.n_head_kv, (long)lo, (long)hi, diff);
    /* Tiny ranges can be constant (one token z-scores to 0, fully
     * protected kvpress ranges are all max + 1): no order to compare. */
    double lo_ref = INFINITY, hi_ref = -INFINITY;
    for (int64_t i = 0; i < len; i++) {
        lo_ref = fmin(lo_ref, ref[i]);
        hi_ref = fmax(hi_ref, ref[i]);
    }
    if (len >= 20 && hi_ref > lo_ref) cr_assert_gt(rho, 0.9999, "%s: Spearman vs reference %g", what, rho);
    free(got);
    free(ref);
    free(reff);
}

Test(compactor, official_matches_reference) {
    pd_policy_spec spec;
    spec_official(&spec);
    int heads[][2] = {{2, 2}, {4, 2}}; /* g = 1 and g = 2 */
    for (int t = 0; t < 2; t++) {
        syn s = syn_make(700, heads[t][0], heads[t][1], 16, 10 + t);
        check_against_ref(&spec, &s, 0, 700, 3, "official");     /* leverage chunks 512 + 188 */
        check_against_ref(&spec, &s, 130, 461, 3, "official");   /* a span: chunks from lo */
        check_against_ref(&spec, &s, 600, 601, 3, "official");   /* one token */
        syn_free(&s);
    }
}

Test(compactor, kvpress_matches_reference) {
    pd_policy_spec spec;
    spec_kvpress(&spec);
    int heads[][2] = {{2, 2}, {4, 2}};
    for (int t = 0; t < 2; t++) {
        syn s = syn_make(600, heads[t][0], heads[t][1], 16, 20 + t);
        check_against_ref(&spec, &s, 0, 600, 3, "kvpress");   /* attention chunks 256, 256, 76 */
        check_against_ref(&spec, &s, 50, 321, 3, "kvpress");  /* a span */
        check_against_ref(&spec, &s, 10, 20, 3, "kvpress");   /* 10 tokens: 8 sinks, 2 recent, nothing in between */
        check_against_ref(&spec, &s, 10, 23, 3, "kvpress");   /* one scored token */
        spec.lambda = 0.3;                                     /* explicit blend */
        spec.scale = 0;                                        /* 1/sqrt(d) */
        check_against_ref(&spec, &s, 0, 600, 3, "kvpress lambda 0.3");
        spec_kvpress(&spec);
        syn_free(&s);
    }
}

/* kvpress keeps its protected tokens with max + 1 and scores the middle
 * alone; official scores every token. */
Test(compactor, kvpress_protected_tokens) {
    pd_policy_spec spec;
    spec_kvpress(&spec);
    syn s = syn_make(200, 4, 2, 16, 30);
    float *got = score(&spec, &s.kv, 0, 200);
    float top = -INFINITY;
    for (int h = 0; h < 2; h++)
        for (int i = 8; i < 196; i++) top = fmaxf(top, got[h * 200 + i]);
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 200; i++)
            if (i < 8 || i >= 196) cr_assert_eq(got[h * 200 + i], top + 1, "head %d token %d", h, i);
    free(got);
    /* Everything protected: finite and equal. */
    got = score(&spec, &s.kv, 0, 5);
    for (int i = 0; i < 10; i++) cr_assert_eq(got[i], got[0]);
    cr_assert(isfinite(got[0]));
    free(got);
    syn_free(&s);
}

/* Span-local: only [lo, hi) may matter. Rewriting everything outside the
 * range must not change a single score. */
Test(compactor, span_local_ignores_outside_tokens) {
    pd_policy_spec specs[3];
    spec_official(&specs[0]);
    spec_kvpress(&specs[1]);
    spec_official(&specs[2]);
    specs[2].kind = specs[2].scorer = PD_POLICY_RANDOM;
    for (int t = 0; t < 3; t++) {
        syn s = syn_make(400, 4, 2, 16, 40);
        float *before = score(&specs[t], &s.kv, 100, 300);
        syn other = syn_make(400, 4, 2, 16, 41);
        size_t row_kv = 2 * 16, row_q = 4 * 16;
        for (int64_t i = 0; i < 400; i++) {
            if (i >= 100 && i < 300) continue;
            memcpy(s.kpre + i * row_kv, other.kpre + i * row_kv, row_kv * sizeof(float));
            memcpy(s.k + i * row_kv, other.k + i * row_kv, row_kv * sizeof(float));
            memcpy(s.v + i * row_kv, other.v + i * row_kv, row_kv * sizeof(float));
            memcpy(s.q + i * row_q, other.q + i * row_q, row_q * sizeof(float));
            s.pos[i] = -1;
        }
        float *after = score(&specs[t], &s.kv, 100, 300);
        cr_assert(memcmp(before, after, 2 * 200 * sizeof(float)) == 0, "spec %d: scores of [100, 300) changed", t);
        free(before);
        free(after);
        syn_free(&s);
        syn_free(&other);
    }
}

/* head_dim 64 > sketch 48, so the seed matters (with d <= 48 the sketch
 * would be injective and every seed would give the same order). */
Test(compactor, deterministic_per_seed) {
    pd_policy_spec spec;
    spec_official(&spec);
    syn s = syn_make(300, 4, 2, 64, 50);
    float *a = score(&spec, &s.kv, 0, 300), *b = score(&spec, &s.kv, 0, 300);
    cr_assert(memcmp(a, b, 600 * sizeof(float)) == 0, "same seed, different scores");
    spec.seed = 2;
    float *c = score(&spec, &s.kv, 0, 300);
    int same = 0;
    for (int i = 0; i < 600; i++) same += a[i] == c[i];
    cr_assert_lt(same, 60, "seeds 1 and 2 agree on %d of 600 scores", same);
    /* The sketch changes the details, not the picture. */
    double rho = pd_rank_correlation(a, c, 600);
    cr_log_info("compactor: d 64, Spearman between the scores of seeds 1 and 2: %.4f", rho);
    cr_assert_lt(rho, 0.9999);
    cr_assert_gt(rho, 0.8);
    free(a);
    free(b);
    free(c);
    syn_free(&s);
}

Test(compactor, halves_as_policies) {
    syn s = syn_make(600, 4, 2, 16, 60);
    pd_policy_spec spec;
    spec_official(&spec);
    spec.kind = spec.scorer = PD_POLICY_LEVERAGE;
    check_against_ref(&spec, &s, 0, 600, 2, "leverage approx");
    check_against_ref(&spec, &s, 77, 345, 2, "leverage approx span");
    spec.leverage = PD_LEVERAGE_EXACT;
    check_against_ref(&spec, &s, 0, 600, 2, "leverage exact");
    spec.lev_chunk = 0;
    check_against_ref(&spec, &s, 5, 600, 2, "leverage exact whole");
    spec_official(&spec);
    spec.kind = spec.scorer = PD_POLICY_NONCAUSAL;
    check_against_ref(&spec, &s, 0, 600, 1, "noncausal");
    spec.vnorm = true;
    spec.pool = 5;
    spec.attn_chunk = 64;
    check_against_ref(&spec, &s, 33, 500, 1, "noncausal vnorm pool 5");
    syn_free(&s);
}

/* The blend really uses both halves: lambda 0 is the attention half,
 * a huge lambda orders like the leverage half. */
Test(compactor, lambda_blends_the_halves) {
    syn s = syn_make(300, 2, 2, 16, 70);
    pd_policy_spec c, l, a;
    spec_official(&c);
    spec_official(&l);
    spec_official(&a);
    l.kind = l.scorer = PD_POLICY_LEVERAGE;
    a.kind = a.scorer = PD_POLICY_NONCAUSAL;
    float *lev = score(&l, &s.kv, 0, 300), *att = score(&a, &s.kv, 0, 300);
    c.lambda = 0;
    float *x = score(&c, &s.kv, 0, 300);
    cr_assert(memcmp(x, att, 600 * sizeof(float)) == 0);
    free(x);
    c.lambda = 1e6;
    x = score(&c, &s.kv, 0, 300);
    cr_assert_gt(pd_rank_correlation(x, lev, 600), 0.9999);
    free(x);
    free(lev);
    free(att);
    syn_free(&s);
}

/* The spec parser's defaults are the profiles described in DESIGN.md: the
 * scores equal those of the hand-filled specs above. */
Test(compactor, parsed_defaults_match_profiles) {
    syn s = syn_make(300, 4, 2, 16, 80);
    const char *texts[] = {"compactor:retention=0.25", "compactor:profile=kvpress,retention=0.25"};
    for (int t = 0; t < 2; t++) {
        pd_policy_spec parsed, hand;
        pd_error err = {0};
        cr_assert_eq(pd_policy_spec_parse(texts[t], &parsed, &err), PD_OK, "%s: %s", texts[t], err.msg);
        if (t == 0) spec_official(&hand);
        else spec_kvpress(&hand);
        cr_assert_eq(parsed.sink, hand.sink, "%s sink", texts[t]);
        cr_assert_eq(parsed.recent, hand.recent, "%s recent", texts[t]);
        cr_assert_eq(parsed.budget, hand.budget, "%s budget", texts[t]);
        float *a = score(&parsed, &s.kv, 0, 300), *b = score(&hand, &s.kv, 0, 300);
        cr_assert(memcmp(a, b, 600 * sizeof(float)) == 0, "%s: parsed defaults score differently", texts[t]);
        free(a);
        free(b);
    }
    syn_free(&s);
}

/* ---- simple scorers ----------------------------------------------------- */

Test(simple, random_uniform_keyed_by_position) {
    syn s = syn_make(4096, 4, 4, 8, 90);
    pd_policy_spec spec;
    spec_official(&spec);
    spec.kind = spec.scorer = PD_POLICY_RANDOM;
    spec.seed = 5;
    float *all = score(&spec, &s.kv, 0, 4096);
    double mean = 0;
    int bins[10] = {0};
    for (int i = 0; i < 4 * 4096; i++) {
        cr_assert(all[i] >= 0 && all[i] < 1, "score %g", all[i]);
        mean += all[i];
        bins[(int)(all[i] * 10)]++;
    }
    mean /= 4 * 4096;
    /* Uniform: mean 1/2 (sd 0.0023 here), every tenth near 1638 (sd 38). */
    cr_assert_lt(fabs(mean - 0.5), 0.012, "mean %g", mean);
    for (int b = 0; b < 10; b++) cr_assert_lt(abs(bins[b] - 1638), 200, "bin %d holds %d", b, bins[b]);
    /* A span scores exactly like the same tokens in the whole range... */
    float *span = score(&spec, &s.kv, 1000, 1100);
    for (int h = 0; h < 4; h++)
        for (int i = 0; i < 100; i++) cr_assert_eq(span[h * 100 + i], all[h * 4096 + 1000 + i]);
    /* ...and so does a layer view that starts elsewhere, because the key is
     * the absolute position, not the row. */
    pd_layer_kv view = s.kv;
    view.n_tokens = 100;
    view.pos = s.pos + 1000;
    float *moved = score(&spec, &view, 0, 100);
    cr_assert(memcmp(moved, span, 400 * sizeof(float)) == 0);
    /* Heads, layers and seeds get independent streams. */
    int same = 0;
    for (int i = 0; i < 4096; i++) same += all[i] == all[4096 + i];
    cr_assert_lt(same, 20);
    view.layer = 4;
    float *other_layer = score(&spec, &view, 0, 100);
    spec.seed = 6;
    float *other_seed = score(&spec, &s.kv, 1000, 1100);
    int sl = 0, ss = 0;
    for (int i = 0; i < 400; i++) {
        sl += other_layer[i] == span[i];
        ss += other_seed[i] == span[i];
    }
    cr_assert_lt(sl, 5);
    cr_assert_lt(ss, 5);
    free(all);
    free(span);
    free(moved);
    free(other_layer);
    free(other_seed);
    syn_free(&s);
}

Test(simple, knorm_and_streaming) {
    syn s = syn_make(200, 4, 2, 16, 91);
    pd_policy_spec spec;
    spec_official(&spec);
    spec.kind = spec.scorer = PD_POLICY_KNORM;
    float *kn = score(&spec, &s.kv, 20, 180);
    for (int h = 0; h < 2; h++)
        for (int i = 20; i < 180; i++) {
            double nn = 0;
            for (int j = 0; j < 16; j++) nn += (double)s.k[(i * 2 + h) * 16 + j] * s.k[(i * 2 + h) * 16 + j];
            cr_assert_float_eq(kn[h * 160 + i - 20], -sqrt(nn), 1e-5, "head %d token %d", h, i);
        }
    free(kn);
    spec.kind = spec.scorer = PD_POLICY_STREAMING;
    float *st = score(&spec, &s.kv, 20, 180);
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < 160; i++) cr_assert_eq(st[h * 160 + i], (float)i);
    free(st);
    syn_free(&s);
}

/* ---- pd_policy_score checks ---------------------------------------------- */

Test(score, argument_errors) {
    syn s = syn_make(50, 4, 2, 8, 92);
    pd_policy_spec spec;
    spec_official(&spec);
    float out[200];
    pd_error err = {0};
    cr_assert_eq(pd_policy_score(NULL, &s.kv, 0, 50, out, &err), PD_EINVAL);
    cr_assert_eq(pd_policy_score(&spec, NULL, 0, 50, out, &err), PD_EINVAL);
    cr_assert_eq(pd_policy_score(&spec, &s.kv, 0, 50, NULL, &err), PD_EINVAL);
    int64_t bad[][2] = {{-1, 10}, {10, 10}, {20, 10}, {0, 51}};
    for (int t = 0; t < 4; t++) {
        cr_assert_eq(pd_policy_score(&spec, &s.kv, bad[t][0], bad[t][1], out, &err), PD_EINVAL);
        cr_assert(strstr(err.msg, "0 <= lo < hi <= 50"), "%s", err.msg);
    }
    pd_layer_kv kv = s.kv;
    kv.n_head = 3;
    cr_assert_eq(pd_policy_score(&spec, &kv, 0, 50, out, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "multiple"), "%s", err.msg);
    kv = s.kv;
    kv.head_dim = 0;
    cr_assert_eq(pd_policy_score(&spec, &kv, 0, 50, out, &err), PD_EINVAL);
    kv = s.kv;
    kv.k_pre_rope = NULL;
    cr_assert_eq(pd_policy_score(&spec, &kv, 0, 50, out, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "k_pre_rope"), "%s", err.msg);
    /* Values are only needed with vnorm. */
    kv = s.kv;
    kv.v = NULL;
    cr_assert_eq(pd_policy_score(&spec, &kv, 0, 50, out, &err), PD_OK, "%s", err.msg);
    spec.vnorm = true;
    cr_assert_eq(pd_policy_score(&spec, &kv, 0, 50, out, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "(v)"), "%s", err.msg);
    spec_official(&spec);
    kv = s.kv;
    kv.pos = NULL;
    spec.kind = spec.scorer = PD_POLICY_RANDOM;
    cr_assert_eq(pd_policy_score(&spec, &kv, 0, 50, out, &err), PD_EINVAL);
    /* Not a scorer. */
    spec.kind = PD_POLICY_PYRAMIDKV;
    spec.scorer = PD_POLICY_PYRAMIDKV;
    cr_assert_eq(pd_policy_score(&spec, &s.kv, 0, 50, out, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "pyramidkv"), "%s", err.msg);
    spec.scorer = PD_POLICY_COUNT;
    cr_assert_eq(pd_policy_score(&spec, &s.kv, 0, 50, out, &err), PD_EINVAL);
    /* Out-of-range spec fields filled by hand. */
    spec_official(&spec);
    spec.sketch = 0;
    cr_assert_eq(pd_policy_score(&spec, &s.kv, 0, 50, out, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "sketch"), "%s", err.msg);
    spec_official(&spec);
    spec.attn_chunk = 0;
    cr_assert_eq(pd_policy_score(&spec, &s.kv, 0, 50, out, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "attn_chunk"), "%s", err.msg);
    spec_official(&spec);
    spec.pool = 2;
    cr_assert_eq(pd_policy_score(&spec, &s.kv, 0, 50, out, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "pool"), "%s", err.msg);
    spec_official(&spec);
    spec.ridge = NAN;
    cr_assert_eq(pd_policy_score(&spec, &s.kv, 0, 50, out, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "ridge"), "%s", err.msg);
    /* Non-finite inputs surface as PD_ERANGE, never as NaN scores. */
    spec_official(&spec);
    s.q[5] = INFINITY;
    spec.kind = spec.scorer = PD_POLICY_NONCAUSAL;
    cr_assert_eq(pd_policy_score(&spec, &s.kv, 0, 50, out, &err), PD_ERANGE);
    cr_assert(strstr(err.msg, "non-finite"), "%s", err.msg);
    spec.kind = spec.scorer = PD_POLICY_KNORM;
    s.k[9] = NAN;
    cr_assert_eq(pd_policy_score(&spec, &s.kv, 0, 50, out, &err), PD_ERANGE);
    syn_free(&s);
}

Test(score, n_criteria) {
    pd_policy_spec spec;
    spec_official(&spec);
    cr_assert_eq(pd_policy_n_criteria(&spec), 1);
    spec.kind = spec.scorer = PD_POLICY_LASERKV;
    cr_assert_eq(pd_policy_n_criteria(&spec), 2);
    spec.kind = PD_POLICY_CHUNKKV;
    spec.scorer = PD_POLICY_SNAPKV;
    cr_assert_eq(pd_policy_n_criteria(&spec), 1);
}
