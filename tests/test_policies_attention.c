/* Attention scorers (SnapKV, H2O, TOVA, OBCache, LASER-KV): every scorer
 * against a naive double-precision re-implementation written here (full
 * softmax rows, straightforward loops) on seeded random q/k/v, over GQA
 * groups of 1 and 2, head_dim 8 and 64, ranges that do not start at 0 and
 * ranges shorter than the window; then behavioural checks on constructed
 * inputs. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "policies/scorers.h"

/* ---- random layers ------------------------------------------------------ */

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static double normal(uint64_t *s) {
    double u1 = ((double)(splitmix(s) >> 11) + 1) * 0x1p-53, u2 = (double)(splitmix(s) >> 11) * 0x1p-53;
    return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

typedef struct layer {
    pd_layer_kv kv;
    float *q, *k, *v;
    int32_t *pos;
} layer;

/* N(0, 1) keys and values, N(0, q_scale^2) queries. */
static layer *layer_new(int64_t n, int n_head, int n_kv, int d, uint64_t seed, double q_scale) {
    layer *l = calloc(1, sizeof *l);
    cr_assert_not_null(l);
    l->q = malloc((size_t)n * n_head * d * sizeof *l->q);
    l->k = malloc((size_t)n * n_kv * d * sizeof *l->k);
    l->v = malloc((size_t)n * n_kv * d * sizeof *l->v);
    l->pos = malloc((size_t)n * sizeof *l->pos);
    cr_assert(l->q && l->k && l->v && l->pos);
    for (int64_t i = 0; i < n * n_head * d; i++) l->q[i] = (float)(q_scale * normal(&seed));
    for (int64_t i = 0; i < n * n_kv * d; i++) l->k[i] = (float)normal(&seed);
    for (int64_t i = 0; i < n * n_kv * d; i++) l->v[i] = (float)normal(&seed);
    for (int64_t i = 0; i < n; i++) l->pos[i] = (int32_t)i;
    l->kv = (pd_layer_kv){.layer = 3, .n_tokens = n, .n_head = n_head, .n_head_kv = n_kv, .head_dim = d,
                          .pos = l->pos, .k_pre_rope = l->k, .q = l->q, .k = l->k, .v = l->v};
    return l;
}

static void layer_free(layer *l) {
    free(l->q);
    free(l->k);
    free(l->v);
    free(l->pos);
    free(l);
}

static float *qrow(layer *l, int64_t i, int a) {
    return l->q + ((size_t)i * l->kv.n_head + a) * l->kv.head_dim;
}
static float *krow(layer *l, int64_t i, int h) {
    return l->k + ((size_t)i * l->kv.n_head_kv + h) * l->kv.head_dim;
}
static float *vrow(layer *l, int64_t i, int h) {
    return l->v + ((size_t)i * l->kv.n_head_kv + h) * l->kv.head_dim;
}

/* Every field a scorer here reads, set by hand (spec.c is another part). */
static pd_policy_spec spec_for(pd_policy_kind kind) {
    pd_policy_spec s;
    memset(&s, 0, sizeof s);
    s.kind = s.scorer = kind;
    s.retention = 0.5;
    s.seed = 1;
    s.budget = PD_BUDGET_UNIFORM;
    s.window = 64;
    s.pool = 5;
    s.target = PD_OBCACHE_JOINT;
    s.divisor = 8;
    s.alpha = 0.5;
    s.rounds = 8;
    s.bits = 8;
    return s;
}

/* ---- naive references (double) ------------------------------------------ */

/* Query i, head a, over keys [lo, i]: weights w[j - lo], logits z[j - lo]. */
static void ref_attn(const pd_layer_kv *kv, int64_t lo, int64_t i, int a, double *w, double *z) {
    int d = kv->head_dim, h = a / (kv->n_head / kv->n_head_kv);
    const float *q = kv->q + ((size_t)i * kv->n_head + a) * d;
    double m = -INFINITY, sum = 0;
    for (int64_t j = lo; j <= i; j++) {
        const float *k = kv->k + ((size_t)j * kv->n_head_kv + h) * d;
        double dot = 0;
        for (int e = 0; e < d; e++) dot += (double)q[e] * k[e];
        z[j - lo] = dot / sqrt((double)d);
        if (z[j - lo] > m) m = z[j - lo];
    }
    for (int64_t j = lo; j <= i; j++) sum += exp(z[j - lo] - m);
    for (int64_t j = lo; j <= i; j++) w[j - lo] = exp(z[j - lo] - m) / sum;
}

static int64_t min64(int64_t a, int64_t b) {
    return a < b ? a : b;
}

/* The window (last w tokens): max over every head's other scores + 1 + raw. */
static void ref_protect(double *s, int n_kv, int64_t len, int64_t w) {
    double m = 0;
    for (int h = 0; h < n_kv; h++)
        for (int64_t j = 0; j < len - w; j++) m = fmax(m, s[h * len + j]);
    for (int h = 0; h < n_kv; h++)
        for (int64_t j = len - w; j < len; j++) s[h * len + j] += m + 1;
}

static void ref_snapkv(const pd_layer_kv *kv, int64_t lo, int64_t hi, int window, int pool, double *out) {
    int64_t len = hi - lo, w = min64(window, len), pre = len - w;
    int g = kv->n_head / kv->n_head_kv;
    double *wt = malloc(len * sizeof *wt), *z = malloc(len * sizeof *z), *s = malloc(len * sizeof *s);
    for (int h = 0; h < kv->n_head_kv; h++) {
        for (int64_t j = 0; j < len; j++) s[j] = 0;
        for (int a = h * g; a < (h + 1) * g; a++)
            for (int64_t i = hi - w; i < hi; i++) {
                ref_attn(kv, lo, i, a, wt, z);
                for (int64_t j = 0; j <= i - lo; j++) s[j] += wt[j] / ((double)w * g);
            }
        for (int64_t j = 0; j < len; j++) {
            if (j >= pre) {
                out[h * len + j] = s[j];
                continue;
            }
            double sum = 0; /* zero padding, counted in the average */
            for (int64_t m = j - pool / 2; m <= j + pool / 2; m++)
                if (m >= 0 && m < pre) sum += s[m];
            out[h * len + j] = sum / pool;
        }
    }
    ref_protect(out, kv->n_head_kv, len, w);
    free(wt);
    free(z);
    free(s);
}

static void ref_h2o(const pd_layer_kv *kv, int64_t lo, int64_t hi, double *out) {
    int64_t len = hi - lo;
    int g = kv->n_head / kv->n_head_kv;
    double *wt = malloc(len * sizeof *wt), *z = malloc(len * sizeof *z);
    for (int64_t x = 0; x < kv->n_head_kv * len; x++) out[x] = 0;
    for (int a = 0; a < kv->n_head; a++)
        for (int64_t i = lo; i < hi; i++) {
            ref_attn(kv, lo, i, a, wt, z);
            for (int64_t j = 0; j <= i - lo; j++) out[(a / g) * len + j] += wt[j];
        }
    for (int h = 0; h < kv->n_head_kv; h++)
        for (int64_t j = 0; j < len; j++) out[h * len + j] /= (double)(len - j) * g;
    free(wt);
    free(z);
}

/* kvpress TOVA: mean over all query heads, the same for every kv head. */
static void ref_tova(const pd_layer_kv *kv, int64_t lo, int64_t hi, double *out) {
    int64_t len = hi - lo;
    double *wt = malloc(len * sizeof *wt), *z = malloc(len * sizeof *z), *s = calloc(len, sizeof *s);
    for (int a = 0; a < kv->n_head; a++) {
        ref_attn(kv, lo, hi - 1, a, wt, z);
        for (int64_t j = 0; j < len; j++) s[j] += wt[j] / kv->n_head;
    }
    for (int h = 0; h < kv->n_head_kv; h++)
        for (int64_t j = 0; j < len; j++) out[h * len + j] = s[j];
    ref_protect(out, kv->n_head_kv, len, 1);
    free(wt);
    free(z);
    free(s);
}

/* OBCache by its definition: the output change when v_p, k_p or both are
 * zeroed, linearised, squared; computed with explicit vectors; then the
 * pre-window scores max-pooled over `pool` neighbours (those inside the
 * range), as OBCache's code does before its top-k. */
static void ref_obcache(const pd_layer_kv *kv, int64_t lo, int64_t hi, int window, int pool, pd_obcache_target target,
                        double *out) {
    int64_t len = hi - lo, w = min64(window, len);
    int g = kv->n_head / kv->n_head_kv, d = kv->head_dim;
    double *wt = malloc(len * sizeof *wt), *z = malloc(len * sizeof *z), *o = malloc(d * sizeof *o);
    for (int64_t x = 0; x < kv->n_head_kv * len; x++) out[x] = 0;
    for (int a = 0; a < kv->n_head; a++) {
        int h = a / g;
        for (int64_t i = hi - w; i < hi; i++) {
            ref_attn(kv, lo, i, a, wt, z);
            for (int e = 0; e < d; e++) o[e] = 0;
            for (int64_t j = lo; j <= i; j++)
                for (int e = 0; e < d; e++) o[e] += wt[j - lo] * kv->v[((size_t)j * kv->n_head_kv + h) * d + e];
            for (int64_t j = lo; j <= i; j++) {
                const float *v = kv->v + ((size_t)j * kv->n_head_kv + h) * d;
                double a_ = wt[j - lo], zz = z[j - lo], n2 = 0;
                for (int e = 0; e < d; e++) {
                    double dv = target == PD_OBCACHE_VALUE ? a_ * v[e]
                                : target == PD_OBCACHE_KEY ? a_ * zz * (v[e] - o[e])
                                                           : a_ * (v[e] + zz * (v[e] - o[e]));
                    n2 += dv * dv;
                }
                out[h * len + (j - lo)] += n2;
            }
        }
    }
    double *raw = malloc(len * sizeof *raw);
    for (int h = 0; h < kv->n_head_kv; h++) {
        memcpy(raw, out + h * len, len * sizeof *raw);
        for (int64_t j = 0; j < len - w; j++)
            for (int64_t x = j - pool / 2; x <= j + pool / 2; x++)
                if (x >= 0 && x < len - w && raw[x] > out[h * len + j]) out[h * len + j] = raw[x];
    }
    free(raw);
    ref_protect(out, kv->n_head_kv, len, w);
    free(wt);
    free(z);
    free(o);
}

/* The layer seed derivation documented in score_laserkv.c. */
static uint64_t mix64(uint64_t x) {
    return splitmix(&x);
}

static uint32_t ref_code(const float *x, const double *mu, const float *planes, int d, int nb, int r, int bits) {
    uint32_t code = 0;
    for (int b = 0; b < bits; b++) {
        double p = 0;
        for (int e = 0; e < d; e++) p += ((double)x[e] - (mu ? mu[e] : 0.0)) * planes[e * nb + r * bits + b];
        if (p > 0) code |= (uint32_t)1 << b;
    }
    return code;
}

/* out: [2][n_kv][len] */
static void ref_laserkv(const pd_layer_kv *kv, int64_t lo, int64_t hi, const pd_policy_spec *spec, double *out) {
    int64_t len = hi - lo, w = min64(spec->window, len);
    int g = kv->n_head / kv->n_head_kv, d = kv->head_dim, nb = spec->rounds * spec->bits, nkv = kv->n_head_kv;
    double *wt = malloc(len * sizeof *wt), *z = malloc(len * sizeof *z), *s = calloc(len, sizeof *s);
    for (int a = 0; a < kv->n_head; a++)
        for (int64_t i = hi - w; i < hi; i++) {
            ref_attn(kv, lo, i, a, wt, z);
            for (int64_t j = 0; j <= i - lo; j++) s[j] += wt[j];
        }
    for (int h = 0; h < nkv; h++)
        for (int64_t j = 0; j < len; j++) out[h * len + j] = s[j];

    float *planes = malloc((size_t)d * nb * sizeof *planes);
    pd_gaussian_sketch(mix64(spec->seed ^ mix64((uint64_t)(uint32_t)kv->layer)), d, nb, planes);
    double *mu = malloc(d * sizeof *mu);
    for (int64_t j = 0; j < len; j++) s[j] = 0;
    for (int a = 0; a < kv->n_head; a++) {
        int h = a / g;
        for (int e = 0; e < d; e++) mu[e] = 0;
        for (int64_t j = lo; j < hi; j++)
            for (int e = 0; e < d; e++) mu[e] += kv->k[((size_t)j * nkv + h) * d + e] / (double)len;
        for (int64_t j = lo; j < hi; j++)
            for (int r = 0; r < spec->rounds; r++) {
                uint32_t kc = ref_code(kv->k + ((size_t)j * nkv + h) * d, mu, planes, d, nb, r, spec->bits);
                for (int64_t i = hi - w; i < hi; i++)
                    s[j - lo] += ref_code(kv->q + ((size_t)i * kv->n_head + a) * d, NULL, planes, d, nb, r,
                                          spec->bits) == kc;
            }
    }
    for (int h = 0; h < nkv; h++)
        for (int64_t j = 0; j < len; j++) out[(nkv + h) * len + j] = s[j];
    free(planes);
    free(mu);
    free(wt);
    free(z);
    free(s);
}

/* |got - ref| <= 1e-4 |ref| (+ 1e-6 of the largest |ref|, for entries that
 * are differences of larger terms); every value finite. */
static void expect_close(const float *got, const double *ref, int64_t n, const char *what) {
    double big = 0;
    for (int64_t i = 0; i < n; i++) big = fmax(big, fabs(ref[i]));
    for (int64_t i = 0; i < n; i++) {
        cr_assert(isfinite(got[i]), "%s: entry %lld is not finite", what, (long long)i);
        double tol = 1e-4 * fabs(ref[i]) + 1e-6 * big;
        cr_assert(fabs(got[i] - ref[i]) <= tol, "%s: entry %lld is %.9g, reference %.9g", what, (long long)i,
                  (double)got[i], ref[i]);
    }
}

/* ---- the configurations ------------------------------------------------- */

typedef struct shape {
    int64_t n;
    int n_head, n_kv, d;
} shape;

static const shape shapes[] = {
    {96, 2, 2, 8},   /* GQA g = 1 */
    {160, 4, 2, 64}, /* g = 2, head_dim 64 */
    {300, 4, 2, 8},  /* g = 2, several H2O query blocks */
};

/* Ranges of an n-token layer: all, span-local not starting at 0, shorter
 * than the window, a single token. */
static void ranges_of(int64_t n, int64_t lo[4], int64_t hi[4]) {
    lo[0] = 0, hi[0] = n;
    lo[1] = 17, hi[1] = n - 5;
    lo[2] = 30, hi[2] = 55;
    lo[3] = n - 1, hi[3] = n;
}

typedef int (*scorer_fn)(const pd_policy_spec *, const pd_layer_kv *, int64_t, int64_t, float *, pd_error *);

static float *score_or_die(scorer_fn f, const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi,
                           int n_criteria) {
    float *out = malloc((size_t)n_criteria * kv->n_head_kv * (hi - lo) * sizeof *out);
    cr_assert_not_null(out);
    pd_error err = {0};
    int rc = f(spec, kv, lo, hi, out, &err);
    cr_assert_eq(rc, PD_OK, "scoring [%lld, %lld): %s", (long long)lo, (long long)hi, err.msg);
    return out;
}

/* Runs the body for every shape, range and window (16 and the default 64). */
#define FOR_EACH_CASE(...)                                                                                     \
    for (size_t si = 0; si < sizeof shapes / sizeof *shapes; si++) {                                           \
        const shape *sh = &shapes[si];                                                                          \
        layer *l = layer_new(sh->n, sh->n_head, sh->n_kv, sh->d, 100 + si, 1.5);                               \
        int64_t los[4], his[4];                                                                                 \
        ranges_of(sh->n, los, his);                                                                             \
        for (int ri = 0; ri < 4; ri++)                                                                          \
            for (int window = 16; window <= 64; window *= 4) {                                                  \
                int64_t lo = los[ri], hi = his[ri], len = hi - lo;                                             \
                char what[128];                                                                                 \
                snprintf(what, sizeof what, "n=%lld heads=%d/%d d=%d [%lld, %lld) window=%d", (long long)sh->n, \
                         sh->n_head, sh->n_kv, sh->d, (long long)lo, (long long)hi, window);                   \
                __VA_ARGS__                                                                                     \
            }                                                                                                   \
        layer_free(l);                                                                                          \
    }

Test(attention, snapkv_matches_reference) {
    FOR_EACH_CASE({
        for (int pool = 1; pool <= 5; pool += 4) {
            pd_policy_spec spec = spec_for(PD_POLICY_SNAPKV);
            spec.window = window;
            spec.pool = pool;
            double *ref = malloc(sh->n_kv * len * sizeof *ref);
            ref_snapkv(&l->kv, lo, hi, window, pool, ref);
            float *got = score_or_die(pd_score_snapkv, &spec, &l->kv, lo, hi, 1);
            expect_close(got, ref, sh->n_kv * len, what);
            free(ref);
            free(got);
        }
    })
}

Test(attention, h2o_matches_reference) {
    FOR_EACH_CASE({
        if (window != 64) continue; /* h2o has no window */
        pd_policy_spec spec = spec_for(PD_POLICY_H2O);
        double *ref = malloc(sh->n_kv * len * sizeof *ref);
        ref_h2o(&l->kv, lo, hi, ref);
        float *got = score_or_die(pd_score_h2o, &spec, &l->kv, lo, hi, 1);
        expect_close(got, ref, sh->n_kv * len, what);
        free(ref);
        free(got);
    })
}

Test(attention, tova_matches_reference) {
    FOR_EACH_CASE({
        if (window != 64) continue;
        pd_policy_spec spec = spec_for(PD_POLICY_TOVA);
        double *ref = malloc(sh->n_kv * len * sizeof *ref);
        ref_tova(&l->kv, lo, hi, ref);
        float *got = score_or_die(pd_score_tova, &spec, &l->kv, lo, hi, 1);
        expect_close(got, ref, sh->n_kv * len, what);
        free(ref);
        free(got);
    })
}

Test(attention, obcache_matches_reference) {
    static const pd_obcache_target targets[] = {PD_OBCACHE_VALUE, PD_OBCACHE_KEY, PD_OBCACHE_JOINT};
    FOR_EACH_CASE({
        for (int ti = 0; ti < 6; ti++) {
            pd_policy_spec spec = spec_for(PD_POLICY_OBCACHE);
            spec.window = window;
            spec.target = targets[ti % 3];
            spec.pool = ti < 3 ? 1 : 7; /* raw saliency, then OBCache's max pool of 7 */
            double *ref = malloc(sh->n_kv * len * sizeof *ref);
            ref_obcache(&l->kv, lo, hi, window, spec.pool, targets[ti % 3], ref);
            float *got = score_or_die(pd_score_obcache, &spec, &l->kv, lo, hi, 1);
            char what2[160];
            snprintf(what2, sizeof what2, "%s target=%d pool=%d", what, ti % 3, spec.pool);
            expect_close(got, ref, sh->n_kv * len, what2);
            free(ref);
            free(got);
        }
    })
}

/* window=0 is OBCache's rule: the larger of 16 tokens (its needle setting)
 * and 5% of the per-head budget (its LongBench setting), never more than
 * the range; the scorer then equals the one with that window spelled out. */
Test(attention, obcache_auto_window_is_the_papers_rule) {
    pd_policy_spec spec = spec_for(PD_POLICY_OBCACHE);
    spec.window = 0;
    static const struct {
        double retention;
        int64_t len, want;
    } cases[] = {
        {0.1, 400, 16},    /* budget 40: 5% is 2, 16 wins */
        {0.5, 400, 16},    /* budget 200: 10 */
        {0.1, 8000, 40},   /* budget 800: 40 */
        {0.2, 10000, 100}, /* budget 2000 */
        {0.5, 10, 10},     /* clipped to the range */
        {0.05, 1, 1},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        spec.retention = cases[i].retention;
        cr_assert_eq(pd_policy_window(&spec, cases[i].len), cases[i].want, "retention %g, %lld tokens",
                     cases[i].retention, (long long)cases[i].len);
    }
    spec.window = 64;
    cr_assert_eq(pd_policy_window(&spec, 400), 64, "an explicit window is used as given");
    cr_assert_eq(pd_policy_window(&spec, 30), 30);

    layer *l = layer_new(700, 4, 2, 8, 77, 1.5);
    for (int ri = 0; ri < 2; ri++) {
        spec.retention = ri ? 1.0 : 0.1;
        spec.window = 0;
        int64_t w = pd_policy_window(&spec, 700);
        cr_assert_eq(w, ri ? 35 : 16);
        float *got = score_or_die(pd_score_obcache, &spec, &l->kv, 0, 700, 1);
        spec.window = (int32_t)w;
        float *want = score_or_die(pd_score_obcache, &spec, &l->kv, 0, 700, 1);
        cr_assert_eq(memcmp(got, want, 2 * 700 * sizeof *got), 0, "retention %g: window=0 is window=%lld",
                     spec.retention, (long long)w);
        free(got);
        free(want);
    }
    layer_free(l);
}

Test(attention, laserkv_matches_reference) {
    FOR_EACH_CASE({
        pd_policy_spec spec = spec_for(PD_POLICY_LASERKV);
        spec.window = window;
        spec.rounds = window == 16 ? 3 : 8;
        spec.bits = window == 16 ? 5 : 8;
        double *ref = malloc(2 * sh->n_kv * len * sizeof *ref);
        ref_laserkv(&l->kv, lo, hi, &spec, ref);
        float *got = score_or_die(pd_score_laserkv, &spec, &l->kv, lo, hi, 2);
        expect_close(got, ref, sh->n_kv * len, what);
        /* collision counts are integers: exact */
        for (int64_t x = sh->n_kv * len; x < 2 * sh->n_kv * len; x++)
            cr_assert_eq(got[x], (float)ref[x], "%s: LSH count %lld is %g, reference %g", what, (long long)x,
                         (double)got[x], ref[x]);
        free(ref);
        free(got);
    })
}

/* Only queries and keys inside [lo, hi) may matter: scribbling over every
 * token outside the range leaves all scores bit-identical. */
Test(attention, span_local_ignores_tokens_outside_the_range) {
    static const struct {
        scorer_fn f;
        pd_policy_kind kind;
        int n_criteria;
    } scorers[] = {
        {pd_score_snapkv, PD_POLICY_SNAPKV, 1}, {pd_score_h2o, PD_POLICY_H2O, 1},
        {pd_score_tova, PD_POLICY_TOVA, 1},     {pd_score_obcache, PD_POLICY_OBCACHE, 1},
        {pd_score_laserkv, PD_POLICY_LASERKV, 2},
    };
    int64_t n = 140, lo = 40, hi = 110;
    layer *a = layer_new(n, 4, 2, 16, 7, 1.0), *b = layer_new(n, 4, 2, 16, 8, 1.0);
    for (int64_t i = lo; i < hi; i++) {
        memcpy(qrow(b, i, 0), qrow(a, i, 0), 4 * 16 * sizeof(float));
        memcpy(krow(b, i, 0), krow(a, i, 0), 2 * 16 * sizeof(float));
        memcpy(vrow(b, i, 0), vrow(a, i, 0), 2 * 16 * sizeof(float));
    }
    for (size_t s = 0; s < sizeof scorers / sizeof *scorers; s++) {
        pd_policy_spec spec = spec_for(scorers[s].kind);
        spec.window = 32;
        float *x = score_or_die(scorers[s].f, &spec, &a->kv, lo, hi, scorers[s].n_criteria);
        float *y = score_or_die(scorers[s].f, &spec, &b->kv, lo, hi, scorers[s].n_criteria);
        cr_assert(memcmp(x, y, (size_t)scorers[s].n_criteria * 2 * (hi - lo) * sizeof *x) == 0,
                  "scorer %zu looked outside its range", s);
        free(x);
        free(y);
    }
    layer_free(a);
    layer_free(b);
}

/* ---- behaviour ---------------------------------------------------------- */

/* Every query carries a shared direction u and key j* = 10 is a large
 * multiple of u: every query attends to it strongly. */
static layer *strong_key_layer(int64_t n, int n_head, int n_kv, int d, int64_t jstar) {
    layer *l = layer_new(n, n_head, n_kv, d, 42, 0.3);
    uint64_t seed = 5;
    double *u = malloc(d * sizeof *u), norm = 0;
    for (int e = 0; e < d; e++) {
        u[e] = normal(&seed);
        norm += u[e] * u[e];
    }
    for (int e = 0; e < d; e++) u[e] /= sqrt(norm);
    for (int64_t i = 0; i < n; i++)
        for (int a = 0; a < n_head; a++)
            for (int e = 0; e < d; e++) qrow(l, i, a)[e] += (float)(2.0 * u[e]);
    for (int h = 0; h < n_kv; h++)
        for (int e = 0; e < d; e++) krow(l, jstar, h)[e] = (float)(4.0 * sqrt((double)d) * u[e]);
    free(u);
    return l;
}

static int64_t argmax(const float *x, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++)
        if (x[i] > x[best]) best = i;
    return best;
}

Test(attention, a_key_every_query_attends_to_ranks_first) {
    int64_t n = 120, jstar = 10, w = 16;
    layer *l = strong_key_layer(n, 4, 2, 16, jstar);
    pd_policy_spec snap = spec_for(PD_POLICY_SNAPKV), h2o = spec_for(PD_POLICY_H2O), tova = spec_for(PD_POLICY_TOVA),
                   laser = spec_for(PD_POLICY_LASERKV);
    snap.window = laser.window = (int32_t)w;
    snap.pool = 1;
    float *s = score_or_die(pd_score_snapkv, &snap, &l->kv, 0, n, 1);
    float *o = score_or_die(pd_score_h2o, &h2o, &l->kv, 0, n, 1);
    float *t = score_or_die(pd_score_tova, &tova, &l->kv, 0, n, 1);
    float *x = score_or_die(pd_score_laserkv, &laser, &l->kv, 0, n, 2);
    for (int h = 0; h < 2; h++) {
        cr_assert_eq(argmax(s + h * n, n - w), jstar, "snapkv head %d", h); /* before the window */
        cr_assert_eq(argmax(o + h * n, n), jstar, "h2o head %d", h);
        cr_assert_eq(argmax(t + h * n, n - 1), jstar, "tova head %d", h);
        cr_assert_eq(argmax(x + h * n, n), jstar, "laserkv exact attention head %d", h);
    }
    /* and the window is kept before everything else */
    for (int h = 0; h < 2; h++)
        for (int64_t j = n - w; j < n; j++) cr_assert_gt(s[h * n + j], s[h * n + jstar]);
    cr_assert_gt(t[n - 1], t[jstar]);
    free(s);
    free(o);
    free(t);
    free(x);
    layer_free(l);
}

/* A late token that every query able to see it attends to almost entirely
 * outranks token 0, although its raw column sum is smaller: H2O divides by
 * the number of queries that see each key. */
Test(attention, h2o_does_not_penalise_late_tokens) {
    int64_t n = 100, late = 95;
    int d = 8;
    layer *l = layer_new(n, 1, 1, d, 9, 1.0);
    memset(l->k, 0, (size_t)n * d * sizeof *l->k);
    for (int64_t i = 0; i < n; i++)
        for (int e = 0; e < d; e++) qrow(l, i, 0)[e] = e == 0 ? 1.0f : 0.0f;
    krow(l, late, 0)[0] = (float)(12.0 * sqrt((double)d)); /* logit 12 against 0 elsewhere */
    double *wt = malloc(n * sizeof *wt), *z = malloc(n * sizeof *z);
    double raw0 = 0, raw_late = 0;
    for (int64_t i = 0; i < n; i++) {
        ref_attn(&l->kv, 0, i, 0, wt, z);
        raw0 += wt[0];
        if (i >= late) raw_late += wt[late];
    }
    cr_assert_gt(raw0, raw_late, "the construction: token 0's raw column sum is the larger");
    pd_policy_spec spec = spec_for(PD_POLICY_H2O);
    float *s = score_or_die(pd_score_h2o, &spec, &l->kv, 0, n, 1);
    cr_assert_eq(argmax(s, n), late);
    cr_assert_gt(s[late], 0.99f, "mean weight on the late token over the queries that see it");
    free(wt);
    free(z);
    free(s);
    layer_free(l);
}

/* All keys zero: every query attends uniformly, so the window's queries give
 * every pre-window token the same weights and the value score is
 * proportional to ||v||^2; a value three times longer ranks first. The key
 * score vanishes (the logits are already 0: zeroing a key changes nothing). */
Test(attention, obcache_value_prefers_larger_values_at_equal_attention) {
    int64_t n = 80, w = 16, big = 20;
    layer *l = layer_new(n, 4, 2, 16, 11, 1.0);
    memset(l->k, 0, (size_t)n * 2 * 16 * sizeof *l->k);
    for (int h = 0; h < 2; h++)
        for (int e = 0; e < 16; e++) vrow(l, big, h)[e] *= 3.0f;
    pd_policy_spec spec = spec_for(PD_POLICY_OBCACHE);
    spec.window = (int32_t)w;
    spec.pool = 1; /* the raw saliency */
    spec.target = PD_OBCACHE_VALUE;
    float *s = score_or_die(pd_score_obcache, &spec, &l->kv, 0, n, 1);
    for (int h = 0; h < 2; h++) {
        cr_assert_eq(argmax(s + h * n, n - w), big, "head %d", h);
        double ratio0 = 0;
        for (int64_t j = 0; j < n - w; j++) {
            double vv = 0;
            for (int e = 0; e < 16; e++) vv += (double)vrow(l, j, h)[e] * vrow(l, j, h)[e];
            double ratio = s[h * n + j] / vv;
            if (j == 0) ratio0 = ratio;
            cr_assert(fabs(ratio - ratio0) <= 1e-5 * ratio0, "head %d token %lld: score / ||v||^2 %g vs %g", h,
                      (long long)j, ratio, ratio0);
        }
    }
    free(s);
    spec.target = PD_OBCACHE_KEY;
    s = score_or_die(pd_score_obcache, &spec, &l->kv, 0, n, 1);
    for (int64_t x = 0; x < 2 * n; x++) cr_assert_eq(s[x], x % n < n - w ? 0.0f : 1.0f, "entry %lld", (long long)x);
    free(s);
    layer_free(l);
}

/* Keys in +/- pairs (mean 0, so centring changes nothing) and every
 * observation query equal to key j* of its kv head: j* collides in every
 * table for every (query, head), the maximum, and its negation never. */
Test(attention, laserkv_identical_query_and_key_collide_every_round) {
    int64_t n = 64, w = 8, jstar = 20;
    int n_head = 4, n_kv = 2, d = 16;
    layer *l = layer_new(n, n_head, n_kv, d, 13, 1.0);
    for (int64_t i = 1; i < n; i += 2)
        for (int h = 0; h < n_kv; h++)
            for (int e = 0; e < d; e++) krow(l, i, h)[e] = -krow(l, i - 1, h)[e];
    for (int64_t i = n - w; i < n; i++)
        for (int a = 0; a < n_head; a++) memcpy(qrow(l, i, a), krow(l, jstar, a / 2), d * sizeof(float));
    pd_policy_spec spec = spec_for(PD_POLICY_LASERKV);
    spec.window = (int32_t)w;
    spec.rounds = 6;
    spec.bits = 10;
    float *s = score_or_die(pd_score_laserkv, &spec, &l->kv, 0, n, 2);
    const float *c2 = s + n_kv * n;
    float top = (float)(spec.rounds * w * n_head);
    for (int h = 0; h < n_kv; h++) {
        cr_assert_eq(c2[h * n + jstar], top, "head %d: %g collisions, expected %g", h, (double)c2[h * n + jstar],
                     (double)top);
        cr_assert_eq(c2[h * n + jstar + 1], 0.0f, "the negated key never collides");
        for (int64_t j = 0; j < n; j++) cr_assert_leq(c2[h * n + j], top);
    }
    free(s);
    layer_free(l);
}

Test(attention, laserkv_hashes_are_deterministic_per_seed_and_layer) {
    int64_t n = 120;
    layer *l = layer_new(n, 4, 2, 8, 17, 1.0);
    pd_policy_spec spec = spec_for(PD_POLICY_LASERKV);
    size_t half = 2 * (size_t)n; /* criterion 2 starts here */
    float *a = score_or_die(pd_score_laserkv, &spec, &l->kv, 0, n, 2);
    float *b = score_or_die(pd_score_laserkv, &spec, &l->kv, 0, n, 2);
    cr_assert(memcmp(a, b, 2 * half * sizeof *a) == 0, "same spec, same scores");
    spec.seed = 2;
    float *c = score_or_die(pd_score_laserkv, &spec, &l->kv, 0, n, 2);
    cr_assert(memcmp(a, c, half * sizeof *a) == 0, "exact attention does not depend on the seed");
    cr_assert(memcmp(a + half, c + half, half * sizeof *a) != 0, "another seed, other hyperplanes");
    spec.seed = 1;
    l->kv.layer = 4;
    float *e = score_or_die(pd_score_laserkv, &spec, &l->kv, 0, n, 2);
    cr_assert(memcmp(a + half, e + half, half * sizeof *a) != 0, "another layer, other hyperplanes");
    free(a);
    free(b);
    free(c);
    free(e);
    layer_free(l);
}

/* Very large logits (queries scaled by 300) still give finite scores. */
Test(attention, scores_stay_finite_with_extreme_logits) {
    static const struct {
        scorer_fn f;
        pd_policy_kind kind;
        int n_criteria;
    } scorers[] = {
        {pd_score_snapkv, PD_POLICY_SNAPKV, 1}, {pd_score_h2o, PD_POLICY_H2O, 1},
        {pd_score_tova, PD_POLICY_TOVA, 1},     {pd_score_obcache, PD_POLICY_OBCACHE, 1},
        {pd_score_laserkv, PD_POLICY_LASERKV, 2},
    };
    int64_t n = 90;
    layer *l = layer_new(n, 4, 2, 8, 23, 300.0);
    for (size_t s = 0; s < sizeof scorers / sizeof *scorers; s++) {
        for (int t = 0; t < 3; t++) {
            pd_policy_spec spec = spec_for(scorers[s].kind);
            spec.target = (pd_obcache_target)t;
            float *x = score_or_die(scorers[s].f, &spec, &l->kv, 5, n, scorers[s].n_criteria);
            for (int64_t i = 0; i < scorers[s].n_criteria * 2 * (n - 5); i++)
                cr_assert(isfinite(x[i]), "scorer %zu entry %lld", s, (long long)i);
            free(x);
        }
    }
    layer_free(l);
}

Test(attention, bad_arguments_are_rejected_with_a_message) {
    layer *l = layer_new(40, 4, 2, 8, 29, 1.0);
    float out[2 * 2 * 40];
    pd_error err = {0};
    pd_policy_spec spec = spec_for(PD_POLICY_SNAPKV);
    cr_assert_eq(pd_score_snapkv(&spec, &l->kv, 10, 10, out, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "[10, 10)"), "%s", err.msg);
    cr_assert_eq(pd_score_h2o(&spec, &l->kv, 0, 41, out, &err), PD_EINVAL);
    cr_assert_eq(pd_score_tova(&spec, &l->kv, -1, 5, out, &err), PD_EINVAL);
    spec.pool = 4;
    cr_assert_eq(pd_score_snapkv(&spec, &l->kv, 0, 40, out, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "pool"), "%s", err.msg);
    spec = spec_for(PD_POLICY_OBCACHE);
    spec.window = -1;
    cr_assert_eq(pd_score_obcache(&spec, &l->kv, 0, 40, out, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "window"), "%s", err.msg);
    spec = spec_for(PD_POLICY_OBCACHE);
    spec.pool = 6;
    cr_assert_eq(pd_score_obcache(&spec, &l->kv, 0, 40, out, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "pool"), "%s", err.msg);
    spec = spec_for(PD_POLICY_OBCACHE);
    spec.target = (pd_obcache_target)7;
    cr_assert_eq(pd_score_obcache(&spec, &l->kv, 0, 40, out, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "target"), "%s", err.msg);
    spec = spec_for(PD_POLICY_LASERKV);
    spec.rounds = 0;
    cr_assert_eq(pd_score_laserkv(&spec, &l->kv, 0, 40, out, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "rounds"), "%s", err.msg);
    spec = spec_for(PD_POLICY_LASERKV);
    spec.bits = 33;
    cr_assert_eq(pd_score_laserkv(&spec, &l->kv, 0, 40, out, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "bits"), "%s", err.msg);
    /* only obcache reads values */
    l->kv.v = NULL;
    spec = spec_for(PD_POLICY_SNAPKV);
    cr_assert_eq(pd_score_snapkv(&spec, &l->kv, 0, 40, out, &err), PD_OK, "%s", err.msg);
    spec = spec_for(PD_POLICY_LASERKV);
    cr_assert_eq(pd_score_laserkv(&spec, &l->kv, 0, 40, out, &err), PD_OK, "%s", err.msg);
    spec = spec_for(PD_POLICY_OBCACHE);
    cr_assert_eq(pd_score_obcache(&spec, &l->kv, 0, 40, out, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "q/k/v"), "%s", err.msg);
    l->kv.v = l->v;
    l->kv.n_head = 3; /* not a multiple of the kv heads */
    spec = spec_for(PD_POLICY_TOVA);
    cr_assert_eq(pd_score_tova(&spec, &l->kv, 0, 40, out, &err), PD_EINVAL);
    layer_free(l);
}

/* LASER-KV ranks by exact attention summed over layers (accumulate=1): a
 * per-layer hook has seen layers 0..l, so layer l's selection must be the
 * one made from the running sum of their first-criterion scores (the LSH
 * criterion stays the layer's own). accumulate=0 ranks by the layer alone. */
Test(attention, laserkv_accumulates_exact_attention_over_layers) {
    enum { N = 120, L = 3, H = 2 };
    layer *ls[L];
    for (int l = 0; l < L; l++) {
        ls[l] = layer_new(N, 4, H, 8, 500 + (uint64_t)l, 1.5);
        ls[l]->kv.layer = l;
    }
    pd_hparams hp = {.n_layer = L, .n_head_kv = H};
    for (int acc = 0; acc <= 1; acc++) {
        pd_policy_spec spec;
        pd_error err = {0};
        cr_assert_eq(pd_policy_spec_parse(acc ? "laserkv:retention=0.3" : "laserkv:retention=0.3,accumulate=0",
                                          &spec, &err), PD_OK, "%s", err.msg);
        cr_assert_eq(spec.accumulate, acc == 1);
        pd_compressor *c = NULL;
        cr_assert_eq(pd_compressor_create(&spec, NULL, &hp, N, &c, &err), PD_OK, "%s", err.msg);
        double sum[H * N] = {0};
        float sc[2 * H * N];
        uint8_t keep[H * N], want[H * N];
        int64_t B[L];
        pd_policy_budgets(&spec, L, N, B);
        for (int l = 0; l < L; l++) {
            cr_assert_eq(pd_compressor_hook(c, &ls[l]->kv, keep, &err), PD_OK, "%s", err.msg);
            cr_assert_eq(pd_policy_score(&spec, &ls[l]->kv, 0, N, sc, &err), PD_OK, "%s", err.msg);
            for (int i = 0; i < H * N; i++) {
                sum[i] += sc[i];
                if (acc) sc[i] = (float)sum[i];
            }
            pd_select_args a = {.n = N, .n_head_kv = H, .mode = PD_BUDGET_UNIFORM, .budget = B[l], .scores = sc,
                                .scores2 = sc + H * N, .share = spec.alpha};
            pd_policy_spec_protected(&spec, B[l], &a.sink, &a.recent);
            cr_assert_eq(pd_policy_select(&a, want, &err), PD_OK, "%s", err.msg);
            cr_assert_eq(memcmp(keep, want, sizeof keep), 0, "accumulate=%d layer %d", acc, l);
        }
        pd_compressor_free(c);
    }
    for (int l = 0; l < L; l++) layer_free(ls[l]);
}
