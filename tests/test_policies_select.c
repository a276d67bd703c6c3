/* policies/select.c: layer budgets (uniform, pyramid) against direct
 * computations, selection against a naive reference (O(m^2) ranking,
 * written here from the contract) on random scores with ties in every mode,
 * and fair per-span quotas. */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "policies/policies.h"

static uint64_t rng_next(uint64_t *s) {
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}
static int64_t rng_int(uint64_t *s, int64_t lo, int64_t hi) {
    return lo + (int64_t)(rng_next(s) % (uint64_t)(hi - lo + 1));
}
static double rng_unit(uint64_t *s) { return (double)(rng_next(s) >> 11) / 9007199254740992.0; }

static bool contains(const char *haystack, const char *needle) { return strstr(haystack, needle) != NULL; }

static pd_policy_spec spec_of(const char *text) {
    pd_policy_spec s;
    pd_error err = {0};
    cr_assert_eq(pd_policy_spec_parse(text, &s, &err), PD_OK, "%s: %s", text, err.msg);
    return s;
}

/* ------------------------------------------------------------------------
 * Budgets
 * ------------------------------------------------------------------------ */

/* floor(k / 1000 * n), at least 1, in exact integer arithmetic. */
static int64_t mean_budget(int k, int64_t n) {
    int64_t m = (int64_t)k * n / 1000;
    return m < 1 ? 1 : m;
}

Test(budgets, uniform_and_global) {
    static const int ks[] = {1, 10, 50, 100, 125, 250, 333, 500, 700, 999, 1000};
    static const int64_t ns[] = {1, 2, 3, 7, 10, 100, 400, 1000, 4097, 100000};
    const char *modes[] = {"uniform", "global"};
    for (int mi = 0; mi < 2; mi++)
        for (size_t ki = 0; ki < sizeof ks / sizeof ks[0]; ki++)
            for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
                char text[96];
                snprintf(text, sizeof text, "knorm:budget=%s,retention=%.3f", modes[mi], ks[ki] / 1000.0);
                pd_policy_spec s = spec_of(text);
                int64_t out[5];
                pd_policy_budgets(&s, 5, ns[ni], out);
                for (int l = 0; l < 5; l++)
                    cr_assert_eq(out[l], mean_budget(ks[ki], ns[ni]), "%s n=%" PRId64 " layer %d: %" PRId64, text,
                                 ns[ni], l, out[l]);
            }
    /* The classic trap: 0.1 * 400 is 40.000000000000004 or 39.99..., never 39. */
    pd_policy_spec s = spec_of("knorm:retention=0.1");
    int64_t one;
    pd_policy_budgets(&s, 1, 400, &one);
    cr_assert_eq(one, 40);
    s = spec_of("knorm:retention=0.3");
    pd_policy_budgets(&s, 1, 10, &one);
    cr_assert_eq(one, 3);
}

/* Direct pyramid for the unclipped case: targets, floors, largest
 * remainder with ties to the lower layer (selection by repeated scans). */
static void naive_pyramid(int64_t mean, double beta, int L, int64_t *out) {
    double bottom = (double)mean / beta, top = 2.0 * (double)mean - bottom;
    double frac[64];
    int64_t sum = 0;
    for (int l = 0; l < L; l++) {
        double t = top - (top - bottom) * (double)l / (double)(L - 1);
        out[l] = (int64_t)floor(t);
        frac[l] = t - floor(t);
        sum += out[l];
    }
    bool given[64] = {false};
    for (int64_t r = (int64_t)L * mean - sum; r > 0; r--) {
        int best = -1;
        for (int l = 0; l < L; l++)
            if (!given[l] && (best < 0 || frac[l] > frac[best])) best = l;
        cr_assert_geq(best, 0);
        given[best] = true;
        out[best]++;
    }
}

static void check_pyramid_shape(const int64_t *out, int L, int64_t n, int64_t mean, const char *what) {
    int64_t sum = 0;
    for (int l = 0; l < L; l++) {
        cr_assert(out[l] >= 1 && out[l] <= n, "%s: layer %d budget %" PRId64 " outside [1, %" PRId64 "]", what, l,
                  out[l], n);
        if (l > 0) cr_assert_leq(out[l], out[l - 1], "%s: layer %d above layer %d", what, l, l - 1);
        sum += out[l];
    }
    cr_assert_eq(sum, (int64_t)L * mean, "%s: total %" PRId64 " != %d x %" PRId64, what, sum, L, mean);
}

Test(budgets, pyramid_against_direct_computation) {
    uint64_t rng = 77;
    int compared = 0;
    for (int iter = 0; iter < 3000; iter++) {
        int L = (int)rng_int(&rng, 1, 40);
        int64_t n = rng_int(&rng, 1, iter % 2 ? 12 : 5000);
        int k = (int)rng_int(&rng, 1, 1000);
        double beta = rng_int(&rng, 0, 1) ? (double)rng_int(&rng, 1, 40) : 1 + rng_unit(&rng) * 30;
        char text[128];
        snprintf(text, sizeof text, "knorm:budget=pyramid,retention=%.3f,beta=%.17g", k / 1000.0, beta);
        pd_policy_spec s = spec_of(text);
        int64_t out[40], want[40];
        pd_policy_budgets(&s, L, n, out);
        int64_t mean = mean_budget(k, n);
        char what[200];
        snprintf(what, sizeof what, "%s L=%d n=%" PRId64, text, L, n);
        check_pyramid_shape(out, L, n, mean, what);
        if (L == 1) {
            cr_assert_eq(out[0], mean, "%s", what);
            continue;
        }
        double bottom = (double)mean / beta, top = 2.0 * (double)mean - bottom;
        if (bottom >= 1 && top <= (double)n) { /* no clipping: the plain PyramidKV line */
            naive_pyramid(mean, beta, L, want);
            for (int l = 0; l < L; l++)
                cr_assert_eq(out[l], want[l], "%s: layer %d got %" PRId64 " want %" PRId64, what, l, out[l], want[l]);
            compared++;
        } else {
            /* The line does not fit in [1, n]: every layer gets the mean. */
            for (int l = 0; l < L; l++) cr_assert_eq(out[l], mean, "%s: layer %d", what, l);
        }
    }
    cr_assert_gt(compared, 500, "too few unclipped cases compared (%d)", compared);
}

Test(budgets, pyramid_beta_and_edges) {
    int64_t a[8], b[8], c[8];
    pd_policy_spec s = spec_of("knorm:budget=pyramid,retention=0.25,beta=1");
    pd_policy_budgets(&s, 8, 1000, a);
    for (int l = 0; l < 8; l++) cr_assert_eq(a[l], 250, "beta=1 is flat");
    s = spec_of("knorm:budget=pyramid,retention=0.25,beta=5");
    pd_policy_budgets(&s, 8, 1000, b);
    s = spec_of("knorm:budget=pyramid,retention=0.25,beta=50");
    pd_policy_budgets(&s, 8, 1000, c);
    cr_assert_eq(b[7], 50, "last layer = mean / beta");
    cr_assert_eq(b[0], 450, "first layer = 2 mean - mean / beta");
    cr_assert_eq(c[7], 5);
    cr_assert_eq(c[0], 495);
    /* A larger beta spreads the layers further apart. */
    for (int l = 0; l < 8; l++) {
        if (l < 4) cr_assert(a[l] <= b[l] && b[l] <= c[l], "layer %d: %" PRId64 " %" PRId64 " %" PRId64, l, a[l], b[l], c[l]);
        else cr_assert(a[l] >= b[l] && b[l] >= c[l], "layer %d: %" PRId64 " %" PRId64 " %" PRId64, l, a[l], b[l], c[l]);
    }
    /* retention 1 keeps everything, whatever the pyramid says. */
    s = spec_of("knorm:budget=pyramid,retention=1");
    pd_policy_budgets(&s, 8, 37, a);
    for (int l = 0; l < 8; l++) cr_assert_eq(a[l], 37);
    /* Tiny prefixes: every layer keeps at least one token. */
    for (int64_t n = 1; n <= 6; n++)
        for (int L = 1; L <= 6; L++)
            for (int k = 1; k <= 1000; k += 111) {
                char text[96];
                snprintf(text, sizeof text, "knorm:budget=pyramid,retention=%.3f,beta=20", k / 1000.0);
                s = spec_of(text);
                pd_policy_budgets(&s, L, n, a);
                check_pyramid_shape(a, L, n, mean_budget(k, n), text);
            }
    /* Near-full retention: the line's top (2 x 90 - 4.5) is above n, so
     * every layer gets the mean, as in PyramidKV's code. */
    s = spec_of("knorm:budget=pyramid,retention=0.9,beta=20");
    pd_policy_budgets(&s, 8, 100, a);
    for (int l = 0; l < 8; l++) cr_assert_eq(a[l], 90, "layer %d", l);
    /* pyramidkv (SnapKV scores, a 64-token window): the smallest budget must
     * hold the window. At mean 100 the last layer would get 5: SnapKV's
     * uniform budgets instead (the paper's code and kvpress fall back so). */
    s = spec_of("pyramidkv:retention=0.25");
    cr_assert(s.window == 64 && s.beta == 20, "the defaults this test is about");
    pd_policy_budgets(&s, 8, 400, a);
    for (int l = 0; l < 8; l++) cr_assert_eq(a[l], 100, "layer %d: the SnapKV fallback", l);
    /* Below the window (mean 40 of 400 at 0.1) every layer keeps the
     * 64-token window; a prefix shorter than the window keeps everything. */
    s = spec_of("pyramidkv:retention=0.1");
    pd_policy_budgets(&s, 8, 400, a);
    for (int l = 0; l < 8; l++) cr_assert_eq(a[l], 64, "layer %d: the window floor", l);
    pd_policy_budgets(&s, 8, 50, a);
    for (int l = 0; l < 8; l++) cr_assert_eq(a[l], 50, "layer %d: all of a 50-token prefix", l);
    s = spec_of("pyramidkv:retention=0.25");
    /* With room (mean 2000, last layer 100 >= 64) it is the pyramid. */
    pd_policy_budgets(&s, 8, 8000, a);
    check_pyramid_shape(a, 8, 8000, 2000, "pyramidkv n=8000");
    cr_assert_eq(a[7], 100);
    cr_assert_eq(a[0], 3900);
    /* Empty prefixes keep nothing. */
    pd_policy_budgets(&s, 3, 0, a);
    cr_assert(a[0] == 0 && a[1] == 0 && a[2] == 0);
}

/* ------------------------------------------------------------------------
 * Selection: the naive reference
 * ------------------------------------------------------------------------ */

typedef struct cand {
    double score;
    int64_t tok;
    int head;
    int64_t end, cost; /* units only */
} cand;

static bool better(const cand *a, const cand *b) {
    if (a->score != b->score) return a->score > b->score;
    if (a->tok != b->tok) return a->tok < b->tok;
    return a->head < b->head;
}

/* Selection sort: slow and obviously right. */
static void naive_sort(cand *c, int64_t m) {
    for (int64_t i = 0; i < m; i++) {
        int64_t best = i;
        for (int64_t j = i + 1; j < m; j++)
            if (better(&c[j], &c[best])) best = j;
        cand t = c[i];
        c[i] = c[best];
        c[best] = t;
    }
}

typedef struct ref {
    const pd_select_args *a;
    uint8_t *keep;
    cand *buf, *units;
} ref;

static void ref_pick1(ref *r, int h0, int h1, int64_t lo, int64_t hi, int64_t k, const float *sc) {
    const pd_select_args *a = r->a;
    int64_t n = a->n;
    if (k <= 0) return;
    if (a->chunk == 0) {
        int64_t m = 0;
        for (int h = h0; h < h1; h++)
            for (int64_t t = lo; t < hi; t++)
                if (!r->keep[h * n + t]) r->buf[m++] = (cand){sc[h * n + t], t, h, 0, 0};
        naive_sort(r->buf, m);
        for (int64_t i = 0; i < m && i < k; i++) r->keep[r->buf[i].head * n + r->buf[i].tok] = 1;
        return;
    }
    int64_t nu = 0;
    for (int h = h0; h < h1; h++)
        for (int64_t c0 = lo; c0 < hi; c0 += a->chunk) {
            int64_t c1 = c0 + a->chunk < hi ? c0 + a->chunk : hi;
            cand u = {0, c0, h, c1, 0};
            for (int64_t t = c0; t < c1; t++)
                if (!r->keep[h * n + t]) {
                    u.score += sc[h * n + t];
                    u.cost++;
                }
            if (u.cost) r->units[nu++] = u;
        }
    naive_sort(r->units, nu);
    for (int64_t i = 0; i < nu && k > 0; i++) {
        cand u = r->units[i];
        if (u.cost <= k) {
            for (int64_t t = u.tok; t < u.end; t++) r->keep[u.head * n + t] = 1;
            k -= u.cost;
        } else {
            int64_t m = 0;
            for (int64_t t = u.tok; t < u.end; t++)
                if (!r->keep[u.head * n + t]) r->buf[m++] = (cand){sc[u.head * n + t], t, u.head, 0, 0};
            naive_sort(r->buf, m);
            for (int64_t j = 0; j < k; j++) r->keep[r->buf[j].head * n + r->buf[j].tok] = 1;
            k = 0;
        }
    }
}

static void ref_pick(ref *r, int h0, int h1, int64_t lo, int64_t hi, int64_t k, const float *sc, const float *sc2) {
    if (!sc2) {
        ref_pick1(r, h0, h1, lo, hi, k, sc);
        return;
    }
    int64_t k1 = (int64_t)floor(r->a->share * (double)k);
    ref_pick1(r, h0, h1, lo, hi, k1, sc);
    ref_pick1(r, h0, h1, lo, hi, k - k1, sc2);
}

/* Protected tokens per the contract; returns how many, or -1 when the
 * whitelist alone is over the (per-head) room. */
static int64_t ref_protect(const pd_select_args *a, uint8_t *prot) {
    int64_t n = a->n;
    int64_t room = a->mode == PD_BUDGET_GLOBAL ? a->budget / a->n_head_kv : a->budget;
    memset(prot, 0, (size_t)n);
    if (a->layout) {
        for (int i = 0; i < a->layout->n_spans; i++)
            if (a->layout->spans[i].whitelist)
                for (int64_t t = a->layout->spans[i].start; t < a->layout->spans[i].end; t++) prot[t] = 1;
        for (int i = 0; i < a->layout->n_whitelist; i++)
            for (int64_t t = a->layout->whitelist[i].start; t < a->layout->whitelist[i].end; t++) prot[t] = 1;
    }
    int64_t count = 0;
    for (int64_t t = 0; t < n; t++) count += prot[t];
    if (count > room) return -1;
    for (int64_t t = 0; t < a->sink && t < n; t++)
        if (!prot[t] && count < room) prot[t] = 1, count++;
    for (int64_t i = 0; i < a->recent && i < n; i++)
        if (!prot[n - 1 - i] && count < room) prot[n - 1 - i] = 1, count++;
    return count;
}

static int ref_select(const pd_select_args *a, uint8_t *keep) {
    int64_t n = a->n, H = a->n_head_kv;
    bool global = a->mode == PD_BUDGET_GLOBAL;
    if ((global && a->budget >= n * H) || (!global && a->budget >= n)) {
        memset(keep, 1, (size_t)(n * H));
        return PD_OK;
    }
    uint8_t *prot = malloc((size_t)n);
    int64_t P = ref_protect(a, prot);
    if (P < 0) {
        free(prot);
        return PD_ERANGE;
    }
    for (int64_t h = 0; h < H; h++) memcpy(keep + h * n, prot, (size_t)n);
    ref r = {a, keep, malloc(sizeof(cand) * (size_t)(n * H)), malloc(sizeof(cand) * (size_t)(n * H))};
    int64_t F = global ? a->budget - P * H : a->budget - P;
    int groups = global ? 1 : (int)H;
    for (int g = 0; g < groups; g++) {
        int h0 = global ? 0 : g, h1 = global ? (int)H : g + 1;
        int64_t left = F;
        if (a->quotas) {
            for (int s = 0; s < a->layout->n_spans; s++) {
                int64_t q = a->quotas[g * a->layout->n_spans + s];
                /* local_scores holds one block per criterion */
                ref_pick(&r, h0, h1, a->layout->spans[s].start, a->layout->spans[s].end, q,
                         a->local_scores ? a->local_scores : a->scores,
                         !a->scores2 ? NULL : a->local_scores ? a->local_scores + n * H : a->scores2);
                left -= q;
            }
        }
        ref_pick(&r, h0, h1, 0, n, left, a->scores, a->scores2);
    }
    free(r.buf);
    free(r.units);
    free(prot);
    return PD_OK;
}

/* ------------------------------------------------------------------------
 * Selection: random cases against the reference
 * ------------------------------------------------------------------------ */

static void fill_scores(uint64_t *rng, float *x, int64_t len) {
    int style = (int)rng_int(rng, 0, 2);
    for (int64_t i = 0; i < len; i++) {
        if (style == 0) x[i] = (float)rng_int(rng, 0, 3); /* many ties */
        else if (style == 1) x[i] = (float)(rng_unit(rng) * 2 - 1);
        else x[i] = (float)rng_int(rng, -2, 2) * 0.5f;
    }
}

/* Count of kept entries of head h in [lo, hi) that are not protected. */
static int64_t kept_free(const uint8_t *keep, const uint8_t *prot, int64_t n, int h, int64_t lo, int64_t hi) {
    int64_t c = 0;
    for (int64_t t = lo; t < hi; t++) c += keep[h * n + t] && !prot[t];
    return c;
}

Test(select, random_against_reference) {
    uint64_t rng = 2024;
    int n_ok = 0, n_range = 0, n_quota = 0, n_chunk = 0, n_two = 0, n_global = 0;
    for (int iter = 0; iter < 4000; iter++) {
        int64_t n = rng_int(&rng, 1, 48);
        int H = (int)rng_int(&rng, 1, 4);
        pd_select_args a = {0};
        a.n = n;
        a.n_head_kv = H;
        a.mode = (pd_budget_mode)rng_int(&rng, 0, 2);
        bool global = a.mode == PD_BUDGET_GLOBAL;
        a.budget = global ? rng_int(&rng, 0, n * H + 2) : rng_int(&rng, 0, n + 2);
        a.sink = rng_int(&rng, 0, 3) ? rng_int(&rng, 0, 6) : 0;
        a.recent = rng_int(&rng, 0, 3) ? rng_int(&rng, 0, 6) : 0;
        a.chunk = rng_int(&rng, 0, 2) ? 0 : (int32_t)rng_int(&rng, 1, 7);
        float *sc = malloc(sizeof(float) * (size_t)(n * H)), *sc2 = malloc(sizeof(float) * (size_t)(n * H)),
              *loc = malloc(sizeof(float) * (size_t)(2 * n * H));
        fill_scores(&rng, sc, n * H);
        fill_scores(&rng, sc2, n * H);
        fill_scores(&rng, loc, 2 * n * H);
        a.scores = sc;
        if (rng_int(&rng, 0, 3) == 0) {
            a.scores2 = sc2;
            a.share = rng_int(&rng, 0, 1) ? rng_unit(&rng) : (double)rng_int(&rng, 0, 4) / 4;
        }
        /* A layout: spans (some whitelisted) and ranges, sometimes. */
        pd_span spans[6];
        pd_range ranges[3];
        pd_layout lay = {spans, 0, ranges, 0};
        if (rng_int(&rng, 0, 1)) {
            int64_t pos = 0;
            int ns = (int)rng_int(&rng, 1, n < 6 ? n : 6);
            for (int i = 0; i < ns; i++) {
                memset(&spans[i], 0, sizeof spans[i]);
                snprintf(spans[i].name, sizeof spans[i].name, "s%d", i);
                spans[i].start = pos;
                pos = i == ns - 1 ? n : rng_int(&rng, pos + 1, n - (ns - 1 - i));
                spans[i].end = pos;
                spans[i].whitelist = rng_int(&rng, 0, 7) == 0;
            }
            lay.n_spans = ns;
        }
        if (rng_int(&rng, 0, 2) == 0) {
            lay.n_whitelist = (int)rng_int(&rng, 1, 3);
            for (int i = 0; i < lay.n_whitelist; i++) {
                ranges[i].start = rng_int(&rng, 0, n - 1);
                ranges[i].end = rng_int(&rng, ranges[i].start + 1, ranges[i].start + 1 + (n - 1 - ranges[i].start) / 4);
            }
        }
        if (lay.n_spans || lay.n_whitelist) a.layout = &lay;

        uint8_t *prot = malloc((size_t)n);
        int64_t P = ref_protect(&a, prot);
        bool all = global ? a.budget >= n * H : a.budget >= n;
        int64_t F = global ? a.budget - P * H : a.budget - P;
        int64_t *quotas = NULL;
        if (lay.n_spans && P >= 0 && !all && rng_int(&rng, 0, 1)) {
            /* Random quotas within each span's free entries, summing to the
             * free budget (or sometimes short of it). */
            int groups = global ? 1 : H;
            quotas = calloc((size_t)(groups * lay.n_spans), sizeof *quotas);
            for (int g = 0; g < groups; g++) {
                int64_t want = rng_int(&rng, 0, 3) ? F : rng_int(&rng, 0, F);
                int64_t room[6];
                for (int s = 0; s < lay.n_spans; s++) {
                    int64_t p = 0;
                    for (int64_t t = spans[s].start; t < spans[s].end; t++) p += prot[t];
                    room[s] = (spans[s].end - spans[s].start - p) * (global ? H : 1);
                }
                for (int64_t u = 0; u < want; u++) {
                    int s = (int)rng_int(&rng, 0, lay.n_spans - 1);
                    for (int tries = 0; quotas[g * lay.n_spans + s] >= room[s] && tries < lay.n_spans; tries++)
                        s = (s + 1) % lay.n_spans;
                    cr_assert_lt(quotas[g * lay.n_spans + s], room[s], "no room for quota unit");
                    quotas[g * lay.n_spans + s]++;
                }
            }
            a.quotas = quotas;
            if (rng_int(&rng, 0, 1)) a.local_scores = loc;
        }

        uint8_t *got = malloc((size_t)(n * H)), *want = malloc((size_t)(n * H));
        pd_error err = {0};
        int rc = pd_policy_select(&a, got, &err);
        int rc_ref = ref_select(&a, want);
        cr_assert_eq(rc, rc_ref, "iteration %d: rc %d, reference %d (%s)", iter, rc, rc_ref, err.msg);
        if (rc == PD_ERANGE) {
            n_range++;
            cr_assert(contains(err.msg, "whitelist") && contains(err.msg, "retention"), "%s", err.msg);
        } else {
            n_ok++;
            n_quota += a.quotas != NULL;
            n_chunk += a.chunk > 0;
            n_two += a.scores2 != NULL;
            n_global += global;
            for (int64_t i = 0; i < n * H; i++)
                cr_assert_eq(got[i], want[i], "iteration %d: head %" PRId64 " token %" PRId64 " kept %d, reference %d",
                             iter, i / n, i % n, got[i], want[i]);
            /* Exact budget, protection. */
            int64_t total = 0;
            for (int h = 0; h < H; h++) {
                int64_t kh = 0;
                for (int64_t t = 0; t < n; t++) {
                    cr_assert(got[h * n + t] == 0 || got[h * n + t] == 1);
                    kh += got[h * n + t];
                    if (!all) cr_assert(!prot[t] || got[h * n + t], "protected token %" PRId64 " evicted", t);
                }
                if (!global) cr_assert_eq(kh, a.budget < n ? a.budget : n, "iteration %d head %d", iter, h);
                total += kh;
            }
            if (global) cr_assert_eq(total, a.budget < n * H ? a.budget : n * H, "iteration %d", iter);
            /* Quotas that use the whole free budget are met span by span. */
            if (a.quotas && !all) {
                int groups = global ? 1 : H;
                for (int g = 0; g < groups; g++) {
                    int64_t qsum = 0;
                    for (int s = 0; s < lay.n_spans; s++) qsum += quotas[g * lay.n_spans + s];
                    if (qsum != F) continue;
                    for (int s = 0; s < lay.n_spans; s++) {
                        int64_t k = 0;
                        for (int h = global ? 0 : g; h < (global ? H : g + 1); h++)
                            k += kept_free(got, prot, n, h, spans[s].start, spans[s].end);
                        cr_assert_eq(k, quotas[g * lay.n_spans + s], "iteration %d span %d", iter, s);
                    }
                }
            }
            /* Whole chunks, at most one partial per group. */
            if (a.chunk > 0 && !a.quotas && !a.scores2 && !all) {
                int partial_total = 0;
                for (int h = 0; h < H; h++) {
                    int partial = 0;
                    for (int64_t c0 = 0; c0 < n; c0 += a.chunk) {
                        int64_t c1 = c0 + a.chunk < n ? c0 + a.chunk : n, fr = 0;
                        for (int64_t t = c0; t < c1; t++) fr += !prot[t];
                        int64_t k = kept_free(got, prot, n, h, c0, c1);
                        if (k != 0 && k != fr) partial++;
                    }
                    if (!global) cr_assert_leq(partial, 1, "iteration %d head %d: %d partial chunks", iter, h, partial);
                    partial_total += partial;
                }
                if (global) cr_assert_leq(partial_total, 1, "iteration %d: %d partial chunks", iter, partial_total);
            }
        }
        free(got);
        free(want);
        free(prot);
        free(quotas);
        free(sc);
        free(sc2);
        free(loc);
    }
    cr_assert(n_ok > 2000 && n_range > 50 && n_quota > 300 && n_chunk > 500 && n_two > 300 && n_global > 500,
              "coverage: ok %d, range %d, quota %d, chunk %d, two %d, global %d", n_ok, n_range, n_quota, n_chunk,
              n_two, n_global);
}

/* ------------------------------------------------------------------------
 * Selection: specific behaviours
 * ------------------------------------------------------------------------ */

static void select_ok(const pd_select_args *a, uint8_t *keep) {
    pd_error err = {0};
    cr_assert_eq(pd_policy_select(a, keep, &err), PD_OK, "%s", err.msg);
}

static void expect_kept(const uint8_t *keep, int64_t n, const char *want) {
    cr_assert_eq((int64_t)strlen(want), n);
    for (int64_t t = 0; t < n; t++)
        cr_assert_eq(keep[t], want[t] == '1', "token %" PRId64 ": kept %d, want %c (%s)", t, keep[t], want[t], want);
}

Test(select, clipping_order) {
    float sc[20];
    for (int t = 0; t < 20; t++) sc[t] = (t == 10 || t == 11) ? 5.0f : 0.0f;
    uint8_t keep[20];
    pd_select_args a = {.n = 20, .n_head_kv = 1, .mode = PD_BUDGET_UNIFORM, .scores = sc, .sink = 5, .recent = 5};
    a.budget = 6; /* sinks first, then the most recent */
    select_ok(&a, keep);
    expect_kept(keep, 20, "11111000000000000001");
    a.budget = 3;
    select_ok(&a, keep);
    expect_kept(keep, 20, "11100000000000000000");
    a.budget = 12; /* all protected, then the two best free tokens */
    select_ok(&a, keep);
    expect_kept(keep, 20, "11111000001100011111");
    /* A whitelist comes before sinks and counts against the budget. */
    pd_range r = {8, 10};
    pd_layout lay = {NULL, 0, &r, 1};
    a.layout = &lay;
    a.budget = 6;
    select_ok(&a, keep);
    expect_kept(keep, 20, "11110000110000000000");
    a.budget = 2;
    select_ok(&a, keep);
    expect_kept(keep, 20, "00000000110000000000");
    /* Whitelisted spans too. */
    pd_span spans[2] = {{"a", 0, 15, false}, {"b", 15, 20, true}};
    pd_layout lay2 = {spans, 2, NULL, 0};
    a.layout = &lay2;
    a.budget = 7;
    select_ok(&a, keep);
    expect_kept(keep, 20, "11000000000000011111");
}

Test(select, whitelist_too_large) {
    float sc[40] = {0};
    uint8_t keep[40];
    pd_range r = {3, 13};
    pd_layout lay = {NULL, 0, &r, 1};
    pd_select_args a = {.n = 20, .n_head_kv = 1, .mode = PD_BUDGET_UNIFORM, .budget = 5, .scores = sc, .layout = &lay};
    pd_error err = {0};
    cr_assert_eq(pd_policy_select(&a, keep, &err), PD_ERANGE);
    cr_assert(contains(err.msg, "10 tokens") && contains(err.msg, "budget is 5") && contains(err.msg, "retention"),
              "%s", err.msg);
    a.budget = 10;
    select_ok(&a, keep);
    expect_kept(keep, 20, "00011111111110000000");
    /* Global: 10 whitelisted tokens x 2 heads = 20 pairs against 19. */
    a.n_head_kv = 2;
    a.mode = PD_BUDGET_GLOBAL;
    a.budget = 19;
    cr_assert_eq(pd_policy_select(&a, keep, &err), PD_ERANGE);
    cr_assert(contains(err.msg, "20 pairs") && contains(err.msg, "19 pairs"), "%s", err.msg);
    a.budget = 20;
    select_ok(&a, keep);
    expect_kept(keep, 20, "00011111111110000000");
    expect_kept(keep + 20, 20, "00011111111110000000");
}

Test(select, global_spreads_unevenly) {
    enum { N = 30, H = 3 };
    float sc[H * N];
    for (int h = 0; h < H; h++)
        for (int t = 0; t < N; t++) sc[h * N + t] = h == 1 ? 10.0f + (float)t : (float)t * 0.01f;
    uint8_t keep[H * N];
    pd_select_args a = {.n = N, .n_head_kv = H, .mode = PD_BUDGET_GLOBAL, .budget = 36, .scores = sc};
    select_ok(&a, keep);
    int64_t per[H] = {0};
    for (int h = 0; h < H; h++)
        for (int t = 0; t < N; t++) per[h] += keep[h * N + t];
    cr_assert_eq(per[1], 30, "the strong head keeps everything");
    cr_assert_eq(per[0] + per[2], 6);
    /* Equal weak scores: ties go to the lower head. */
    cr_assert_eq(per[0], 3);
    cr_assert_eq(per[2], 3);
    /* Sinks protect the same tokens in every head, room floor(budget / heads). */
    a.sink = 4;
    a.budget = 9;
    select_ok(&a, keep);
    for (int h = 0; h < H; h++) cr_assert(keep[h * N + 0] && keep[h * N + 1] && keep[h * N + 2] && !keep[h * N + 3]);
    int64_t total = 0;
    for (int i = 0; i < H * N; i++) total += keep[i];
    cr_assert_eq(total, 9);
}

Test(select, two_criteria_split) {
    enum { N = 20 };
    float sc[N], sc2[N];
    for (int t = 0; t < N; t++) {
        sc[t] = (float)(N - t);  /* best: earliest */
        sc2[t] = (float)t;       /* best: latest */
    }
    uint8_t keep[N];
    pd_select_args a = {.n = N, .n_head_kv = 1, .mode = PD_BUDGET_UNIFORM, .budget = 10, .scores = sc,
                        .scores2 = sc2, .share = 0.35};
    select_ok(&a, keep); /* floor(0.35 * 10) = 3 by the first, 7 by the second */
    expect_kept(keep, N, "11100000000001111111");
    /* The second criterion picks among what the first left. */
    for (int t = 0; t < N; t++) sc2[t] = (float)(N - t);
    select_ok(&a, keep);
    expect_kept(keep, N, "11111111110000000000");
    a.share = 1;
    for (int t = 0; t < N; t++) sc2[t] = (float)t;
    select_ok(&a, keep);
    expect_kept(keep, N, "11111111110000000000");
    a.share = 0;
    select_ok(&a, keep);
    expect_kept(keep, N, "00000000001111111111");
}

Test(select, chunks_whole_then_one_partial) {
    enum { N = 24 };
    float sc[N];
    /* Chunks of 4: [0,4) sum 8, [4,8) sum 40, [8,12) sum 4, [12,16) sum 20, ... */
    static const float v[N] = {2, 2, 2, 2, 10, 10, 10, 10, 1, 1, 1, 1, 5, 5, 5, 5, 0, 0, 0, 9, 0, 0, 0, 0};
    memcpy(sc, v, sizeof sc);
    uint8_t keep[N];
    pd_select_args a = {.n = N, .n_head_kv = 1, .mode = PD_BUDGET_UNIFORM, .budget = 10, .scores = sc, .chunk = 4};
    select_ok(&a, keep);
    /* [4,8) and [12,16) whole (8 tokens); next best [16,20) (sum 9) gets its best 2: token 19 then 16. */
    expect_kept(keep, N, "000011110000111110010000");
    /* Protected tokens are not part of any chunk's cost or score. */
    a.recent = 2;
    a.budget = 8;
    select_ok(&a, keep);
    expect_kept(keep, N, "000011110000110000000011");
}

/* Shared chunks (kvpress ChunkKVPress): chunk scores summed over the kv
 * heads, the same chunks in every head. Reference: rank chunks by the
 * head-summed score of their free tokens, take whole chunks while they fit,
 * then the best free tokens (by head-summed score) of the first that does
 * not, ties to the earlier chunk / token. */
static void ref_shared_chunks(const float *sc, int H, int64_t n, int chunk, int64_t budget, int64_t recent,
                              uint8_t *keep) {
    double tok[64];
    uint8_t k1[64] = {0};
    for (int64_t t = 0; t < n; t++) {
        tok[t] = 0;
        for (int h = 0; h < H; h++) tok[t] += sc[h * n + t];
    }
    int64_t left = budget;
    for (int64_t t = n - recent; t < n; t++) k1[t] = 1, left--;
    int nc = (int)((n + chunk - 1) / chunk);
    uint8_t used[64] = {0};
    while (left > 0) {
        int best = -1;
        double best_s = 0;
        for (int c = 0; c < nc; c++) {
            if (used[c]) continue;
            double s = 0;
            int cost = 0;
            for (int64_t t = (int64_t)c * chunk; t < (c + 1) * (int64_t)chunk && t < n; t++)
                if (!k1[t]) s += tok[t], cost++;
            if (!cost) continue;
            if (best < 0 || s > best_s) best = c, best_s = s;
        }
        if (best < 0) break;
        used[best] = 1;
        int64_t c0 = (int64_t)best * chunk, c1 = c0 + chunk < n ? c0 + chunk : n, cost = 0;
        for (int64_t t = c0; t < c1; t++) cost += !k1[t];
        if (cost <= left) {
            for (int64_t t = c0; t < c1; t++) k1[t] = 1;
            left -= cost;
        } else {
            while (left > 0) {
                int64_t bt = -1;
                for (int64_t t = c0; t < c1; t++)
                    if (!k1[t] && (bt < 0 || tok[t] > tok[bt])) bt = t;
                k1[bt] = 1;
                left--;
            }
        }
    }
    for (int h = 0; h < H; h++) memcpy(keep + h * n, k1, (size_t)n);
}

Test(select, shared_chunks_are_the_same_in_every_head) {
    enum { N = 50, H = 3 };
    uint64_t rng = 42;
    for (int iter = 0; iter < 200; iter++) {
        float sc[H * N];
        /* Scores on a coarse grid: ties between chunks happen. */
        for (int i = 0; i < H * N; i++) sc[i] = (float)rng_int(&rng, 0, 20) / 4.0f;
        int chunk = (int)rng_int(&rng, 1, 12);
        int64_t budget = rng_int(&rng, 1, N - 1), recent = rng_int(&rng, 0, budget < 5 ? budget : 5);
        uint8_t keep[H * N], want[H * N];
        pd_select_args a = {.n = N, .n_head_kv = H, .mode = PD_BUDGET_UNIFORM, .budget = budget, .scores = sc,
                            .chunk = chunk, .shared_chunks = true, .recent = recent};
        select_ok(&a, keep);
        ref_shared_chunks(sc, H, N, chunk, budget, recent, want);
        for (int h = 0; h < H; h++) {
            cr_assert_eq(memcmp(keep + h * N, keep, N), 0, "iter %d: head %d keeps other chunks than head 0", iter, h);
            int64_t kept = 0;
            for (int t = 0; t < N; t++) kept += keep[h * N + t];
            cr_assert_eq(kept, budget, "iter %d head %d", iter, h);
        }
        cr_assert_eq(memcmp(keep, want, sizeof keep), 0, "iter %d (chunk %d, budget %lld, recent %lld)", iter, chunk,
                     (long long)budget, (long long)recent);
    }
    /* Per-head chunks (shared=0) may differ: head 1 prefers the end. */
    float sc[2 * 8] = {9, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1};
    uint8_t keep[2 * 8];
    pd_select_args a = {.n = 8, .n_head_kv = 2, .mode = PD_BUDGET_UNIFORM, .budget = 2, .scores = sc, .chunk = 2};
    select_ok(&a, keep);
    expect_kept(keep, 8, "11000000");
    expect_kept(keep + 8, 8, "00000011");
    a.shared_chunks = true; /* summed: 18 against 2 */
    select_ok(&a, keep);
    expect_kept(keep, 8, "11000000");
    expect_kept(keep + 8, 8, "11000000");
}

/* Compactor's budget with base=unprotected (profile official):
 * compactor-vllm keeps round(ratio * (L - sinks - recent)) per kv head, the
 * protected tokens ranked first inside it; retention 1 keeps everything and
 * a prefix shorter than the protection keeps 1. */
Test(budgets, compactor_counts_the_unprotected_tokens) {
    static const double rets[] = {0.05, 0.1, 0.25, 0.3, 0.5, 0.77, 0.999, 1};
    static const int64_t ns[] = {1, 10, 79, 80, 81, 100, 400, 1001, 4096};
    for (size_t ri = 0; ri < sizeof rets / sizeof rets[0]; ri++)
        for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
            char text[96];
            snprintf(text, sizeof text, "compactor:retention=%.17g", rets[ri]);
            pd_policy_spec s = spec_of(text);
            cr_assert_eq(s.base, PD_BASE_UNPROTECTED);
            cr_assert(s.sink == 16 && s.recent == 64);
            int64_t out[3], n = ns[ni];
            pd_policy_budgets(&s, 3, n, out);
            double exact = rets[ri] * (double)(n - 80);
            int64_t want = rets[ri] >= 1 ? n : n > 80 ? (int64_t)floor(exact + 0.5) : 0;
            if (want < 1) want = 1;
            for (int l = 0; l < 3; l++)
                cr_assert_eq(out[l], want, "%s n=%lld layer %d: %lld, want %lld", text, (long long)n, l,
                             (long long)out[l], (long long)want);
            /* base=prompt is floor(retention * n), as every other policy. */
            snprintf(text, sizeof text, "compactor:base=prompt,retention=%.17g", rets[ri]);
            s = spec_of(text);
            pd_policy_budgets(&s, 3, n, out);
            want = (int64_t)floor(rets[ri] * (double)n + 1e-9);
            cr_assert_eq(out[0], want < 1 ? 1 : want, "%s n=%lld", text, (long long)n);
        }
    /* The kvpress profile counts the whole prompt. */
    pd_policy_spec s = spec_of("compactor:profile=kvpress,retention=0.25");
    cr_assert_eq(s.base, PD_BASE_PROMPT);
    int64_t one;
    pd_policy_budgets(&s, 1, 400, &one);
    cr_assert_eq(one, 100);
}

Test(select, quotas_per_span) {
    enum { N = 30, H = 2 };
    float sc[H * N], loc[H * N];
    for (int i = 0; i < H * N; i++) {
        sc[i] = (float)(i % N); /* globally the end of the prefix wins */
        loc[i] = (float)(N - i % N);
    }
    pd_span spans[3] = {{"a", 0, 10, false}, {"b", 10, 20, false}, {"c", 20, 30, false}};
    pd_layout lay = {spans, 3, NULL, 0};
    int64_t quotas[H * 3] = {3, 3, 3, 1, 2, 6};
    uint8_t keep[H * N];
    pd_select_args a = {.n = N, .n_head_kv = H, .mode = PD_BUDGET_UNIFORM, .budget = 9, .scores = sc,
                        .layout = &lay, .quotas = quotas};
    select_ok(&a, keep);
    expect_kept(keep, N, "000000011100000001110000000111");
    expect_kept(keep + N, N, "000000000100000000110000111111");
    a.local_scores = loc; /* spans rank by the local scores */
    select_ok(&a, keep);
    expect_kept(keep, N, "111000000011100000001110000000");
    /* Global: one quota vector for the layer. */
    int64_t gq[3] = {2, 0, 4};
    a.mode = PD_BUDGET_GLOBAL;
    a.budget = 6;
    a.quotas = gq;
    a.local_scores = NULL;
    select_ok(&a, keep);
    expect_kept(keep, N, "000000000100000000000000000011");
    expect_kept(keep + N, N, "000000000100000000000000000011");
    /* Quotas beyond a span or the free budget are refused. */
    pd_error err = {0};
    gq[1] = 11 * H;
    cr_assert_eq(pd_policy_select(&a, keep, &err), PD_EINVAL);
    cr_assert(contains(err.msg, "span 1 'b'"), "%s", err.msg);
    gq[1] = 1;
    cr_assert_eq(pd_policy_select(&a, keep, &err), PD_EINVAL);
    cr_assert(contains(err.msg, "sum to 7"), "%s", err.msg);
    pd_layout no_spans = {NULL, 0, NULL, 0};
    a.layout = &no_spans;
    cr_assert_eq(pd_policy_select(&a, keep, &err), PD_EINVAL);
    cr_assert(contains(err.msg, "spans"), "%s", err.msg);
}

Test(select, argument_errors) {
    float sc[10] = {0};
    uint8_t keep[10];
    pd_error err = {0};
    pd_select_args a = {.n = 10, .n_head_kv = 1, .mode = PD_BUDGET_UNIFORM, .budget = 4, .scores = sc};
    sc[3] = NAN;
    cr_assert_eq(pd_policy_select(&a, keep, &err), PD_EINVAL);
    cr_assert(contains(err.msg, "token 3") && contains(err.msg, "finite"), "%s", err.msg);
    sc[3] = 0;
    a.budget = -1;
    cr_assert_eq(pd_policy_select(&a, keep, &err), PD_EINVAL);
    a.budget = 4;
    a.n_head_kv = 0;
    cr_assert_eq(pd_policy_select(&a, keep, &err), PD_EINVAL);
    a.n_head_kv = 1;
    pd_span s = {"x", 0, 9, false};
    pd_layout bad = {&s, 1, NULL, 0};
    a.layout = &bad;
    cr_assert_eq(pd_policy_select(&a, keep, &err), PD_EINVAL);
    cr_assert(contains(err.msg, "'x'"), "%s", err.msg);
    a.layout = NULL;
    a.budget = 10; /* everything fits: all kept */
    select_ok(&a, keep);
    for (int t = 0; t < 10; t++) cr_assert_eq(keep[t], 1);
    a.budget = 0;
    select_ok(&a, keep);
    for (int t = 0; t < 10; t++) cr_assert_eq(keep[t], 0);
}

/* ------------------------------------------------------------------------
 * Fair quotas
 * ------------------------------------------------------------------------ */

/* Real-valued capped proportional targets, the slow way: cap, re-spread,
 * repeat until nothing new is capped. */
static void naive_targets(int64_t free, const int64_t *len, const int64_t *base, int S, double debias, double *t) {
    int64_t lsum = 0;
    for (int s = 0; s < S; s++) lsum += len[s];
    double total = (double)(free < lsum ? free : lsum), w[16];
    bool capped[16] = {false};
    for (int s = 0; s < S; s++) w[s] = (1 - debias) * (double)base[s] + debias * (double)free * (double)len[s] / (double)lsum;
    for (;;) {
        double rest = total, wsum = 0;
        for (int s = 0; s < S; s++) {
            if (capped[s]) rest -= (double)len[s];
            else wsum += w[s];
        }
        bool changed = false;
        for (int s = 0; s < S; s++) {
            if (capped[s]) {
                t[s] = (double)len[s];
                continue;
            }
            t[s] = wsum > 0 ? rest * w[s] / wsum : 0;
            if (t[s] > (double)len[s]) capped[s] = changed = true;
        }
        if (!changed) return;
    }
}

Test(fair, debias_one_is_proportional) {
    uint64_t rng = 5;
    for (int iter = 0; iter < 2000; iter++) {
        int S = (int)rng_int(&rng, 1, 12);
        int64_t len[12], base[12], q[12], lsum = 0;
        for (int s = 0; s < S; s++) {
            len[s] = rng_int(&rng, 0, 3) ? rng_int(&rng, 1, 500) : rng_int(&rng, 0, 3);
            base[s] = rng_int(&rng, 0, len[s]);
            lsum += len[s];
        }
        int64_t free = rng_int(&rng, 0, lsum + 5);
        pd_fair_quotas(free, len, base, S, 1.0, NULL, q);
        int64_t sum = 0, want = free < lsum ? free : lsum;
        for (int s = 0; s < S; s++) {
            cr_assert(q[s] >= 0 && q[s] <= len[s]);
            sum += q[s];
            /* Kept fraction equal across spans, within one token. */
            if (lsum > 0) {
                double share = (double)want * (double)len[s] / (double)lsum;
                cr_assert_lt(fabs((double)q[s] - share), 1.0, "iter %d span %d: %" PRId64 " vs %.3f", iter, s, q[s],
                             share);
            }
        }
        cr_assert_eq(sum, want, "iter %d", iter);
    }
    int64_t len2[2] = {10, 10}, q2[2];
    pd_fair_quotas(5, len2, NULL, 2, 1.0, NULL, q2);
    cr_assert(q2[0] == 3 && q2[1] == 2, "a tie goes to the lower span: %" PRId64 " %" PRId64, q2[0], q2[1]);
    int64_t len3[3] = {4, 4, 4}, q3[3];
    pd_fair_quotas(1, len3, NULL, 3, 1.0, NULL, q3);
    cr_assert(q3[0] == 1 && q3[1] == 0 && q3[2] == 0);
}

Test(fair, debias_zero_reproduces_base) {
    uint64_t rng = 6;
    for (int iter = 0; iter < 2000; iter++) {
        int S = (int)rng_int(&rng, 1, 12);
        int64_t len[12], base[12], q[12], free = 0;
        for (int s = 0; s < S; s++) {
            len[s] = rng_int(&rng, 0, 300);
            base[s] = rng_int(&rng, 0, len[s]);
            free += base[s];
        }
        pd_fair_quotas(free, len, base, S, 0.0, NULL, q);
        for (int s = 0; s < S; s++)
            cr_assert_eq(q[s], base[s], "iter %d span %d: %" PRId64 " vs base %" PRId64, iter, s, q[s], base[s]);
    }
}

Test(fair, mixed_and_capped) {
    uint64_t rng = 7;
    for (int iter = 0; iter < 3000; iter++) {
        int S = (int)rng_int(&rng, 1, 10);
        int64_t len[10], base[10], q[10], lsum = 0, bsum = 0;
        for (int s = 0; s < S; s++) {
            len[s] = rng_int(&rng, 1, 200);
            lsum += len[s];
        }
        int64_t free = rng_int(&rng, 0, lsum);
        /* Base counts that sum to free and fit their spans. */
        for (int s = 0; s < S; s++) base[s] = 0;
        for (int64_t u = 0; u < free; u++) {
            int s = (int)rng_int(&rng, 0, S - 1);
            while (base[s] >= len[s]) s = (s + 1) % S;
            base[s]++;
            bsum++;
        }
        double debias = (double)rng_int(&rng, 0, 8) / 8;
        pd_fair_quotas(free, len, base, S, debias, NULL, q);
        double t[10];
        naive_targets(free, len, base, S, debias, t);
        int64_t sum = 0;
        for (int s = 0; s < S; s++) {
            cr_assert(q[s] >= 0 && q[s] <= len[s]);
            cr_assert_lt(fabs((double)q[s] - t[s]), 1.0 + 1e-9, "iter %d span %d: %" PRId64 " vs %.4f", iter, s, q[s],
                         t[s]);
            sum += q[s];
        }
        cr_assert_eq(sum, free, "iter %d", iter);
    }
    /* Caps move the excess to spans with room. */
    int64_t len[2] = {2, 100}, base[2] = {10, 0}, q[2];
    pd_fair_quotas(10, len, base, 2, 0.0, NULL, q);
    cr_assert(q[0] == 2 && q[1] == 8, "%" PRId64 " %" PRId64, q[0], q[1]);
    /* More budget than free tokens: every span full. */
    int64_t len3[3] = {3, 0, 5}, q3[3];
    pd_fair_quotas(100, len3, NULL, 3, 0.5, NULL, q3);
    cr_assert(q3[0] == 3 && q3[1] == 0 && q3[2] == 5);
    pd_fair_quotas(0, len3, NULL, 3, 0.5, NULL, q3);
    cr_assert(q3[0] == 0 && q3[1] == 0 && q3[2] == 0);
}

/* With a carry, rounding does not short the same span in every group: over
 * many groups each span's total stays within one entry of its summed share,
 * where plain largest remainder (ties to the lower span) drifts linearly. */
Test(fair, carry_spreads_rounding_over_groups) {
    const int S = 4, groups = 200;
    const int64_t len[4] = {84, 100, 100, 100}, free = 24;
    double carry[4] = {0};
    int64_t total[4] = {0}, plain[4] = {0}, q[4];
    for (int g = 0; g < groups; g++) {
        pd_fair_quotas(free, len, NULL, S, 1.0, carry, q);
        int64_t sum = 0;
        for (int s = 0; s < S; s++) {
            const double share = (double)free * (double)len[s] / 384.0;
            cr_assert(fabs((double)q[s] - share) < 1.0, "group %d span %d: quota %" PRId64 ", share %.3f", g, s, q[s], share);
            total[s] += q[s], sum += q[s];
        }
        cr_assert_eq(sum, free);
        pd_fair_quotas(free, len, NULL, S, 1.0, NULL, q);
        for (int s = 0; s < S; s++) plain[s] += q[s];
    }
    double plain_err = 0;
    for (int s = 0; s < S; s++) {
        const double want = (double)groups * (double)free * (double)len[s] / 384.0;
        cr_assert(fabs((double)total[s] - want) <= 1.0, "span %d: %" PRId64 " over %d groups, share %.2f", s, total[s],
                  groups, want);
        plain_err = fmax(plain_err, fabs((double)plain[s] - want));
    }
    cr_assert_gt(plain_err, 10.0, "without the carry the same span loses every time (the case this is about)");
}
