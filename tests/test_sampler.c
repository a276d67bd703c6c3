/* engine/sampler.c and engine/stop.c: greedy, temperature, top-k/top-p/min-p,
 * seeds, penalties, logit bias, logprobs, parameter validation, a 152k
 * vocabulary; stop strings across pieces, UTF-8 holding, generation limits. */
#include <criterion/criterion.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/engine.h"
#include "helpers.h"
#include "tools/tools.h"

/* ---- helpers ------------------------------------------------------------ */

/* The test's own generator (independent of the sampler's). */
static uint64_t trng_state;
static uint64_t trng(void) { return pd_splitmix64(&trng_state); }
static double trng_u(void) { return (double)(trng() >> 11) * 0x1.0p-53; }
static float trng_normal(void) {
    double u1 = trng_u(), u2 = trng_u();
    if (u1 < 1e-300) u1 = 1e-300;
    return (float)(sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2));
}
static void rand_logits(float *x, int32_t n, float scale) {
    for (int32_t i = 0; i < n; i++) x[i] = scale * trng_normal();
}

static pd_sampler *mk(const pd_sampler_params *p, int32_t n) {
    pd_sampler *s = NULL;
    pd_error err = {0};
    int rc = pd_sampler_create(p, n, &s, &err);
    cr_assert_eq(rc, PD_OK, "pd_sampler_create: %s", err.msg);
    return s;
}

static pd_token draw(pd_sampler *s, const float *x) {
    pd_sample_result r;
    pd_error err = {0};
    int rc = pd_sampler_sample(s, x, &r, &err);
    cr_assert_eq(rc, PD_OK, "pd_sampler_sample: %s", err.msg);
    cr_assert(r.token >= 0 && r.token < pd_sampler_n_vocab(s));
    return r.token;
}

static pd_sample_result draw_full(pd_sampler *s, const float *x) {
    pd_sample_result r;
    pd_error err = {0};
    int rc = pd_sampler_sample(s, x, &r, &err);
    cr_assert_eq(rc, PD_OK, "pd_sampler_sample: %s", err.msg);
    return r;
}

static void accept(pd_sampler *s, pd_token t, bool generated) {
    pd_error err = {0};
    cr_assert_eq(pd_sampler_accept(s, t, generated, &err), PD_OK, "%s", err.msg);
}

static pd_sampler_params params_seed(float temp, uint64_t seed) {
    pd_sampler_params p = pd_sampler_params_default();
    p.temperature = temp;
    p.seed = seed;
    return p;
}

/* Reference: softmax(x / T) in double. */
static void softmax_ref(const float *x, int32_t n, double t, double *p) {
    double m = -INFINITY;
    for (int32_t i = 0; i < n; i++)
        if (x[i] > m) m = x[i];
    double z = 0;
    for (int32_t i = 0; i < n; i++) z += (p[i] = isinf(x[i]) ? 0.0 : exp((x[i] - m) / t));
    for (int32_t i = 0; i < n; i++) p[i] /= z;
}

/* Reference ordering: by logit descending, ties by lowest id. */
static const float *sort_x;
static int cmp_desc(const void *a, const void *b) {
    int32_t i = *(const int32_t *)a, j = *(const int32_t *)b;
    if (sort_x[i] > sort_x[j]) return -1;
    if (sort_x[i] < sort_x[j]) return 1;
    return (i > j) - (i < j);
}
static int32_t *order_desc(const float *x, int32_t n) {
    int32_t *o = malloc((size_t)n * sizeof *o);
    for (int32_t i = 0; i < n; i++) o[i] = i;
    sort_x = x;
    qsort(o, (size_t)n, sizeof *o, cmp_desc);
    return o;
}

/* Reference truncation, applied in the documented order. allowed[i] set
 * for survivors; returns the count. min_margin gets how close the top-p
 * cumulative sum came to the threshold (so tests can avoid knife edges). */
static int32_t allowed_ref(const float *x, int32_t n, double t, int32_t top_k, double top_p,
                           double min_p, bool *allowed, double *probs) {
    int32_t *o = order_desc(x, n);
    int32_t k = (top_k > 0 && top_k < n) ? top_k : n;
    softmax_ref(x, n, t, probs);
    double zk = 0;
    for (int32_t j = 0; j < k; j++) zk += probs[o[j]];
    int32_t kp = k;
    if (top_p < 1.0) {
        double c = 0;
        for (int32_t j = 0; j < k; j++) {
            c += probs[o[j]] / zk;
            if (c >= top_p) {
                kp = j + 1;
                break;
            }
        }
    }
    double pmax = probs[o[0]];
    int32_t cnt = 0;
    for (int32_t i = 0; i < n; i++) allowed[i] = false;
    for (int32_t j = 0; j < kp; j++) {
        if (probs[o[j]] >= min_p * pmax) {
            allowed[o[j]] = true;
            cnt++;
        }
    }
    /* renormalised probabilities over the survivors */
    double z = 0;
    for (int32_t i = 0; i < n; i++) z += allowed[i] ? probs[i] : 0;
    for (int32_t i = 0; i < n; i++) probs[i] = allowed[i] ? probs[i] / z : 0;
    free(o);
    return cnt;
}

/* Chi-square of counts against probabilities (bins with expectation >= 5;
 * the rest pooled). Returns the statistic and the degrees of freedom. */
static double chi_square(const int *counts, const double *p, int32_t n, int total, int *df) {
    double chi = 0, pool_e = 0, pool_o = 0;
    int bins = 0;
    for (int32_t i = 0; i < n; i++) {
        double e = p[i] * total;
        if (e >= 5) {
            chi += (counts[i] - e) * (counts[i] - e) / e;
            bins++;
        } else {
            pool_e += e;
            pool_o += counts[i];
        }
    }
    if (pool_e >= 5) {
        chi += (pool_o - pool_e) * (pool_o - pool_e) / pool_e;
        bins++;
    } else {
        cr_expect(pool_o <= pool_e + 10, "rare tokens drawn %g times, expected %g", pool_o, pool_e);
    }
    *df = bins - 1;
    return chi;
}

/* Chi-square 0.999 quantile (Wilson-Hilferty). */
static double chi_crit(int df) {
    double z = 3.090; /* 0.999 normal quantile */
    double a = 2.0 / (9.0 * df);
    double v = 1 - a + z * sqrt(a);
    return df * v * v * v;
}

/* ---- greedy ---------------------------------------------------------------- */

Test(sampler, greedy_picks_argmax_lowest_id_on_ties) {
    pd_sampler_params p = params_seed(0.0f, 1);
    float x[8] = {0.5f, 3.0f, -1.0f, 3.0f, 2.9f, 3.0f, -INFINITY, 0.0f};
    pd_sampler *s = mk(&p, 8);
    for (int i = 0; i < 10; i++) cr_expect_eq(draw(s, x), 1);
    x[1] = 2.0f;
    cr_expect_eq(draw(s, x), 3);
    float neg[4] = {-5.0f, -2.0f, -2.0f, -3.0f};
    pd_sampler *s4 = mk(&p, 4);
    cr_expect_eq(draw(s4, neg), 1);
    pd_sampler_free(s4);
    pd_sampler_free(s);
}

Test(sampler, greedy_ignores_truncation_params) {
    pd_sampler_params p = params_seed(0.0f, 9);
    p.top_k = 3;
    p.top_p = 0.1f;
    p.min_p = 0.9f;
    trng_state = 11;
    float x[100];
    pd_sampler *s = mk(&p, 100);
    for (int it = 0; it < 50; it++) {
        rand_logits(x, 100, 2.0f);
        int32_t best = 0;
        for (int32_t i = 1; i < 100; i++)
            if (x[i] > x[best]) best = i;
        cr_expect_eq(draw(s, x), best);
    }
    pd_sampler_free(s);
}

Test(sampler, temperature_to_zero_equals_greedy) {
    trng_state = 5;
    float x[500];
    pd_sampler_params p = params_seed(1e-4f, 3);
    pd_sampler *s = mk(&p, 500);
    for (int it = 0; it < 200; it++) {
        rand_logits(x, 500, 3.0f);
        int32_t best = 0;
        for (int32_t i = 1; i < 500; i++)
            if (x[i] > x[best]) best = i;
        /* make the gap at the top at least 0.05 so T = 1e-4 is a true limit */
        for (int32_t i = 0; i < 500; i++)
            if (i != best && x[i] > x[best] - 0.05f) x[i] = x[best] - 0.05f;
        cr_expect_eq(draw(s, x), best, "iteration %d", it);
    }
    pd_sampler_free(s);
    /* even a subnormal temperature (1/T overflows) is well defined */
    p.temperature = 1e-40f;
    s = mk(&p, 500);
    pd_sampler_params pg = params_seed(0.0f, 3);
    pd_sampler *g = mk(&pg, 500);
    cr_expect_eq(draw(s, x), draw(g, x));
    pd_sampler_free(g);
    pd_sampler_free(s);
}

Test(sampler, top_k_1_is_greedy) {
    trng_state = 77;
    float x[1000];
    pd_sampler_params p = params_seed(1.5f, 4);
    p.top_k = 1;
    pd_sampler *s = mk(&p, 1000);
    for (int it = 0; it < 100; it++) {
        rand_logits(x, 1000, 1.0f);
        int32_t best = 0;
        for (int32_t i = 1; i < 1000; i++)
            if (x[i] > x[best]) best = i;
        cr_expect_eq(draw(s, x), best);
    }
    /* ties: the lowest id among the maxima */
    for (int32_t i = 0; i < 1000; i++) x[i] = (float)(i % 7);
    cr_expect_eq(draw(s, x), 6);
    pd_sampler_free(s);
}

/* ---- seeds -------------------------------------------------------------------- */

Test(sampler, fixed_seed_is_reproducible_and_seeds_differ) {
    const int32_t n = 2000;
    float *x = malloc(n * sizeof *x);
    pd_token a[300], b[300], c[300], d[300];
    pd_sampler_params p = params_seed(1.0f, 12345);
    p.top_p = 0.95f;
    p.top_k = 200;
    pd_sampler *s1 = mk(&p, n), *s2 = mk(&p, n);
    p.seed = 12346;
    pd_sampler *s3 = mk(&p, n);
    trng_state = 99;
    for (int i = 0; i < 300; i++) {
        rand_logits(x, n, 1.0f);
        a[i] = draw(s1, x);
        b[i] = draw(s2, x);
        c[i] = draw(s3, x);
    }
    cr_expect(memcmp(a, b, sizeof a) == 0, "same seed, same logits: same tokens");
    int diff = 0;
    for (int i = 0; i < 300; i++) diff += a[i] != c[i];
    cr_expect_gt(diff, 200, "different seeds should mostly differ (%d of 300 differ)", diff);
    /* reset restarts the generator */
    pd_sampler_reset(s1);
    trng_state = 99;
    for (int i = 0; i < 300; i++) {
        rand_logits(x, n, 1.0f);
        d[i] = draw(s1, x);
    }
    cr_expect(memcmp(a, d, sizeof a) == 0, "reset reproduces the run");
    cr_expect_eq(pd_sampler_seed(s1), 12345);
    pd_sampler_free(s1);
    pd_sampler_free(s2);
    pd_sampler_free(s3);

    /* random seeds are reported, and reproduce when reused */
    p = params_seed(1.0f, PD_SAMPLER_SEED_RANDOM);
    pd_sampler *r1 = mk(&p, n);
    p.seed = pd_sampler_seed(r1);
    cr_expect_neq(p.seed, PD_SAMPLER_SEED_RANDOM);
    pd_sampler *r2 = mk(&p, n);
    trng_state = 3;
    for (int i = 0; i < 50; i++) {
        rand_logits(x, n, 1.0f);
        cr_expect_eq(draw(r1, x), draw(r2, x));
    }
    pd_sampler_free(r1);
    pd_sampler_free(r2);
    free(x);
}

/* ---- distributions ------------------------------------------------------------ */

static void check_distribution(const float *x, int32_t n, float temp, int32_t top_k, float top_p,
                               float min_p, uint64_t seed, int draws) {
    pd_sampler_params p = params_seed(temp, seed);
    p.top_k = top_k;
    p.top_p = top_p;
    p.min_p = min_p;
    pd_sampler *s = mk(&p, n);
    bool *allowed = malloc((size_t)n);
    double *probs = malloc((size_t)n * sizeof *probs);
    int *counts = calloc((size_t)n, sizeof *counts);
    allowed_ref(x, n, temp, top_k, top_p, min_p, allowed, probs);
    for (int i = 0; i < draws; i++) {
        pd_token t = draw(s, x);
        cr_assert(allowed[t], "token %d (logit %g) is outside the allowed set (T=%g k=%d p=%g "
                  "min_p=%g)", t, (double)x[t], (double)temp, top_k, (double)top_p, (double)min_p);
        counts[t]++;
    }
    int df = 0;
    double chi = chi_square(counts, probs, n, draws, &df);
    if (df > 0)
        cr_expect_lt(chi, chi_crit(df), "chi-square %.2f with %d dof (T=%g k=%d p=%g min_p=%g)",
                     chi, df, (double)temp, top_k, (double)top_p, (double)min_p);
    /* per-bin bound as well: within 5 sigma */
    for (int32_t i = 0; i < n; i++) {
        double e = probs[i] * draws, sd = sqrt(draws * probs[i] * (1 - probs[i]));
        cr_expect(fabs(counts[i] - e) <= 5 * sd + 1, "token %d: %d draws, expected %.1f", i,
                  counts[i], e);
    }
    pd_sampler_free(s);
    free(allowed);
    free(probs);
    free(counts);
}

Test(sampler, empirical_distribution_matches_softmax) {
    float x[10] = {1.0f, 0.5f, 0.0f, -0.5f, 2.0f, 1.5f, -1.0f, 0.2f, 0.8f, 1.2f};
    check_distribution(x, 10, 1.0f, 0, 1.0f, 0.0f, 42, 20000);
    check_distribution(x, 10, 0.7f, 0, 1.0f, 0.0f, 43, 20000);
    check_distribution(x, 10, 2.0f, 0, 1.0f, 0.0f, 45, 20000);
}

/* Over many seeds the chi-square statistic has the mean of its
 * distribution (the degrees of freedom): catches small biases that one
 * seed cannot. */
Test(sampler, chi_square_over_many_seeds) {
    float x[10] = {1.0f, 0.5f, 0.0f, -0.5f, 2.0f, 1.5f, -1.0f, 0.2f, 0.8f, 1.2f};
    double probs[10];
    softmax_ref(x, 10, 1.3, probs);
    const int seeds = 60, draws = 5000;
    double sum = 0;
    for (int k = 0; k < seeds; k++) {
        pd_sampler_params p = params_seed(1.3f, 1000 + (uint64_t)k);
        pd_sampler *s = mk(&p, 10);
        int counts[10] = {0};
        for (int i = 0; i < draws; i++) counts[draw(s, x)]++;
        int df;
        sum += chi_square(counts, probs, 10, draws, &df);
        cr_assert_eq(df, 9);
        pd_sampler_free(s);
    }
    /* mean of 60 chi-square(9): 9 +- 0.55 (one sd) */
    double mean = sum / seeds;
    cr_expect(mean > 9 - 2.5 && mean < 9 + 2.5, "mean chi-square %.2f over %d seeds, expected 9",
              mean, seeds);
}

Test(sampler, truncated_distributions_match_renormalised_softmax) {
    trng_state = 2024;
    float x[300];
    rand_logits(x, 300, 1.5f);
    check_distribution(x, 300, 1.0f, 20, 1.0f, 0.0f, 7, 20000);
    check_distribution(x, 300, 0.8f, 0, 0.6f, 0.0f, 8, 20000);
    check_distribution(x, 300, 1.3f, 0, 1.0f, 0.2f, 9, 20000);
    check_distribution(x, 300, 1.0f, 40, 0.8f, 0.1f, 10, 20000);
    /* larger: several weight blocks; radix top-k (k > 256) feeding top-p */
    float y[1000];
    rand_logits(y, 1000, 1.0f);
    check_distribution(y, 1000, 1.0f, 0, 1.0f, 0.0f, 11, 40000);
    check_distribution(y, 1000, 1.0f, 600, 0.8f, 0.0f, 12, 40000);
    /* top-p over the whole vocabulary, peaked (prefiltered candidates) */
    for (int i = 0; i < 1000; i++) y[i] = y[i] - 8.0f + (i % 50 == 0 ? 6.0f + (float)(i % 7) : 0.0f);
    check_distribution(y, 1000, 1.0f, 0, 0.9f, 0.0f, 13, 40000);
}

/* Draws stay inside the allowed set computed independently, and cover it. */
static void check_allowed(const float *x, int32_t n, float temp, int32_t top_k, float top_p,
                          float min_p, int draws, bool expect_cover) {
    pd_sampler_params p = params_seed(temp, 1000 + (uint64_t)top_k);
    p.top_k = top_k;
    p.top_p = top_p;
    p.min_p = min_p;
    pd_sampler *s = mk(&p, n);
    bool *allowed = malloc((size_t)n), *seen = calloc((size_t)n, 1);
    double *probs = malloc((size_t)n * sizeof *probs);
    int32_t cnt = allowed_ref(x, n, temp, top_k, top_p, min_p, allowed, probs);
    for (int i = 0; i < draws; i++) {
        pd_token t = draw(s, x);
        cr_assert(allowed[t], "token %d outside the allowed set (k=%d p=%g min_p=%g, %d allowed)",
                  t, top_k, (double)top_p, (double)min_p, cnt);
        seen[t] = true;
    }
    if (expect_cover)
        for (int32_t i = 0; i < n; i++)
            cr_expect(!allowed[i] || seen[i], "allowed token %d never drawn (k=%d p=%g)", i, top_k,
                      (double)top_p);
    pd_sampler_free(s);
    free(allowed);
    free(seen);
    free(probs);
}

Test(sampler, truncation_only_returns_allowed_tokens) {
    trng_state = 31337;
    const int32_t n = 1000;
    float *x = malloc(n * sizeof *x);
    rand_logits(x, n, 2.0f);
    check_allowed(x, n, 1.0f, 50, 1.0f, 0.0f, 3000, false);
    check_allowed(x, n, 100.0f, 7, 1.0f, 0.0f, 3000, true);
    check_allowed(x, n, 1.0f, 0, 0.5f, 0.0f, 3000, false);
    check_allowed(x, n, 1.0f, 0, 0.9f, 0.0f, 3000, false);
    check_allowed(x, n, 1.0f, 0, 1.0f, 0.05f, 3000, false);
    check_allowed(x, n, 1.0f, 0, 1.0f, 0.5f, 3000, true);
    check_allowed(x, n, 0.5f, 100, 0.9f, 0.02f, 3000, false);
    check_allowed(x, n, 1.0f, 500, 0.9f, 0.0f, 3000, false);
    check_allowed(x, n, 1.0f, 500, 0.3f, 0.05f, 3000, false);
    /* peaked logits: top-p over the vocabulary selects from a prefiltered few */
    for (int32_t i = 0; i < n; i++) x[i] = (i % 97 == 0) ? 10.0f + (float)(i % 5) : x[i] - 5.0f;
    check_allowed(x, n, 1.0f, 0, 0.9f, 0.0f, 3000, false);
    check_allowed(x, n, 1.0f, 0, 0.999f, 0.0f, 3000, false);
    check_allowed(x, n, 2.0f, 0, 0.7f, 0.0f, 3000, false);

    /* many ties: integer logits; ties are broken towards the lowest ids */
    for (int32_t i = 0; i < n; i++) x[i] = (float)(trng() % 5);
    check_allowed(x, n, 1000.0f, 37, 1.0f, 0.0f, 20000, true);
    check_allowed(x, n, 1000.0f, 250, 1.0f, 0.0f, 40000, true); /* heap */
    check_allowed(x, n, 1000.0f, 400, 1.0f, 0.0f, 60000, true); /* radix */
    check_allowed(x, n, 1000.0f, 400, 0.5f, 0.0f, 60000, true); /* radix + top-p on a list */
    check_allowed(x, n, 1000.0f, 0, 0.1f, 0.0f, 20000, true);

    /* logits one ulp apart: selection has to look at every bit */
    float v = 1.0f;
    for (int32_t i = 0; i < n; i++) {
        x[(i * 389) % n] = v;
        v = nextafterf(v, 2.0f);
    }
    check_allowed(x, n, 1.0f, 13, 1.0f, 0.0f, 5000, true);
    check_allowed(x, n, 1.0f, 0, 0.021f, 0.0f, 5000, true);
    /* negative, zero and -0 logits, and banned ones */
    for (int32_t i = 0; i < n; i++) x[i] = -(float)(trng() % 50) / 10.0f;
    x[5] = -0.0f;
    x[6] = 0.0f;
    x[7] = -INFINITY;
    check_allowed(x, n, 1.0f, 2, 1.0f, 0.0f, 2000, true);
    free(x);
}

Test(sampler, top_p_keeps_at_least_one_and_whole_boundary) {
    float x[5] = {2.0f, 1.0f, 0.0f, -1.0f, -2.0f};
    /* p(0) = 0.6364 at T = 1: top_p below it keeps only token 0 */
    check_allowed(x, 5, 1.0f, 0, 0.5f, 0.0f, 500, true);
    check_allowed(x, 5, 1.0f, 0, 0.01f, 0.0f, 500, true);
    /* just above it: tokens 0 and 1 */
    check_allowed(x, 5, 1.0f, 0, 0.7f, 0.0f, 3000, true);
    check_allowed(x, 5, 1.0f, 0, 1.0f, 0.0f, 20000, true);
}

/* ---- penalties ---------------------------------------------------------------- */

static void expect_adjusted(const pd_sampler *s, const float *x, const float *want, int32_t n) {
    float *got = malloc((size_t)n * sizeof *got);
    pd_sampler_adjust(s, x, got);
    for (int32_t i = 0; i < n; i++)
        cr_expect(got[i] == want[i] || fabsf(got[i] - want[i]) <= 1e-6f * fabsf(want[i]),
                  "adjusted logit %d: got %.9g want %.9g", i, (double)got[i], (double)want[i]);
    free(got);
}

/* Logprobs over the whole (small) vocabulary equal log-softmax(want). */
static void expect_logprobs(pd_sampler *s, const float *x, const float *want, int32_t n) {
    pd_sample_result r = draw_full(s, x);
    cr_assert(r.has_logprob);
    cr_assert_eq(r.n_top, n);
    double m = -INFINITY, z = 0;
    for (int32_t i = 0; i < n; i++) m = fmax(m, want[i]);
    for (int32_t i = 0; i < n; i++) z += exp(want[i] - m);
    for (int32_t j = 0; j < r.n_top; j++) {
        pd_token t = r.top[j].token;
        double ref = want[t] - m - log(z);
        cr_expect(fabs(r.top[j].logprob - ref) < 1e-5, "logprob of %d: %g vs %g", t,
                  (double)r.top[j].logprob, ref);
    }
}

Test(sampler, presence_and_frequency_penalties_follow_openai) {
    float x[8] = {1.0f, 2.0f, 3.0f, 2.5f, 0.0f, -1.0f, 0.5f, 2.9f};
    pd_sampler_params p = params_seed(0.0f, 1);
    p.presence_penalty = 0.5f;
    p.frequency_penalty = 0.25f;
    p.n_logprobs = 8;
    pd_sampler *s = mk(&p, 8);
    cr_expect_eq(draw(s, x), 2);
    /* prompt tokens do not count */
    accept(s, 2, false);
    accept(s, 2, false);
    expect_adjusted(s, x, x, 8);
    cr_expect_eq(draw(s, x), 2);
    /* generated: 2 twice, 3 once, 5 once */
    accept(s, 2, true);
    accept(s, 3, true);
    accept(s, 2, true);
    accept(s, 5, true);
    float want[8];
    memcpy(want, x, sizeof want);
    want[2] -= 0.5f + 2 * 0.25f; /* 2.0 */
    want[3] -= 0.5f + 1 * 0.25f; /* 1.75 */
    want[5] -= 0.5f + 1 * 0.25f; /* -1.75 */
    expect_adjusted(s, x, want, 8);
    expect_logprobs(s, x, want, 8);
    cr_expect_eq(draw(s, x), 7, "penalised 2 and 3 fall below 7 (2.9)");
    /* negative penalties encourage repetition */
    pd_sampler_free(s);
    p.presence_penalty = -2.0f;
    p.frequency_penalty = 0.0f;
    s = mk(&p, 8);
    accept(s, 4, true);
    cr_expect_eq(draw(s, x), 2);
    accept(s, 4, true);
    memcpy(want, x, sizeof want);
    want[4] += 2.0f;
    expect_adjusted(s, x, want, 8);
    /* reset forgets */
    pd_sampler_reset(s);
    expect_adjusted(s, x, x, 8);
    pd_sampler_free(s);
}

Test(sampler, repetition_penalty_follows_llama_cpp) {
    float x[8] = {1.0f, 2.0f, -3.0f, 2.5f, 0.0f, -1.0f, 0.5f, 2.4f};
    pd_sampler_params p = params_seed(0.0f, 1);
    p.repetition_penalty = 1.5f;
    p.penalty_last_n = 3;
    p.n_logprobs = 8;
    pd_sampler *s = mk(&p, 8);
    /* history 3 0 1 2 2: the window (last 3) is {1, 2}; 3 and 0 left it */
    accept(s, 3, false);
    accept(s, 0, false);
    accept(s, 1, true);
    accept(s, 2, false);
    accept(s, 2, true);
    float want[8];
    memcpy(want, x, sizeof want);
    want[1] = 2.0f / 1.5f;  /* positive: divided (once, not per occurrence) */
    want[2] = -3.0f * 1.5f; /* negative: multiplied */
    expect_adjusted(s, x, want, 8);
    expect_logprobs(s, x, want, 8);
    cr_expect_eq(draw(s, x), 3);
    accept(s, 3, true); /* window {2, 2, 3} */
    memcpy(want, x, sizeof want);
    want[2] = -3.0f * 1.5f;
    want[3] = 2.5f / 1.5f;
    expect_adjusted(s, x, want, 8);
    cr_expect_eq(draw(s, x), 7, "3 penalised to 1.67 falls below 7 (2.4)");
    pd_sampler_free(s);

    /* penalty_last_n = -1: the whole history; 0: off */
    p.penalty_last_n = -1;
    s = mk(&p, 8);
    for (pd_token t = 0; t < 4; t++) accept(s, t, false);
    for (int i = 0; i < 100; i++) accept(s, 6, false);
    memcpy(want, x, sizeof want);
    want[0] /= 1.5f;
    want[1] /= 1.5f;
    want[2] *= 1.5f;
    want[3] /= 1.5f;
    want[6] /= 1.5f;
    expect_adjusted(s, x, want, 8);
    pd_sampler_free(s);
    p.penalty_last_n = 0;
    s = mk(&p, 8);
    accept(s, 3, true);
    expect_adjusted(s, x, x, 8);
    pd_sampler_free(s);

    /* a long window that slides over many tokens keeps exact counts */
    p.penalty_last_n = 64;
    const int32_t n = 5000;
    s = mk(&p, n);
    float *big = calloc(n, sizeof *big), *got = malloc(n * sizeof *got);
    pd_token *hist = malloc(20000 * sizeof *hist);
    trng_state = 8;
    for (int i = 0; i < 20000; i++) {
        hist[i] = (pd_token)(trng() % (i < 10000 ? 300 : (uint64_t)n));
        accept(s, hist[i], i % 2);
    }
    for (int32_t i = 0; i < n; i++) big[i] = 1.0f;
    pd_sampler_adjust(s, big, got);
    bool *in = calloc(n, 1);
    for (int i = 20000 - 64; i < 20000; i++) in[hist[i]] = true;
    for (int32_t i = 0; i < n; i++)
        cr_expect_eq(got[i], in[i] ? 1.0f / 1.5f : 1.0f, "token %d", i);
    free(in);
    free(hist);
    free(big);
    free(got);
    pd_sampler_free(s);
}

Test(sampler, penalty_order_bias_then_repetition_then_presence) {
    float x[4] = {1.0f, 2.0f, 3.0f, 0.0f};
    pd_logit_bias b[] = {{1, 1.0f}, {3, -2.0f}};
    pd_sampler_params p = params_seed(0.0f, 1);
    p.logit_bias = b;
    p.n_logit_bias = 2;
    p.repetition_penalty = 2.0f;
    p.presence_penalty = 1.0f;
    pd_sampler *s = mk(&p, 4);
    accept(s, 1, true);
    accept(s, 3, true);
    float want[4] = {1.0f, (2.0f + 1.0f) / 2.0f - 1.0f, 3.0f, (0.0f - 2.0f) * 2.0f - 1.0f};
    expect_adjusted(s, x, want, 4);
    pd_sampler_free(s);
}

/* ---- logit bias ----------------------------------------------------------------- */

Test(sampler, logit_bias_bans_and_forces) {
    float x[6] = {1.0f, 5.0f, 2.0f, 4.0f, 0.0f, 3.0f};
    pd_sampler_params p = params_seed(0.0f, 1);
    pd_logit_bias ban[] = {{1, -100.0f}, {3, -INFINITY}};
    p.logit_bias = ban;
    p.n_logit_bias = 2;
    pd_sampler *s = mk(&p, 6);
    cr_expect_eq(draw(s, x), 5, "1 and 3 banned: 5 (3.0) wins");
    pd_sampler_free(s);

    /* sampled: banned tokens never come out, even at a high temperature */
    p.temperature = 5.0f;
    p.seed = 77;
    p.n_logprobs = 6;
    s = mk(&p, 6);
    for (int i = 0; i < 5000; i++) {
        pd_sample_result r = draw_full(s, x);
        cr_assert(r.token != 1 && r.token != 3, "banned token %d drawn", r.token);
        if (i == 0) {
            cr_expect_eq(r.n_top, 4, "banned tokens have no finite logprob");
            for (int j = 0; j < r.n_top; j++)
                cr_expect(r.top[j].token != 1 && r.top[j].token != 3);
        }
    }
    pd_sampler_free(s);

    /* +100 forces a token */
    pd_logit_bias force[] = {{4, 100.0f}};
    p.logit_bias = force;
    p.n_logit_bias = 1;
    p.temperature = 1.0f;
    s = mk(&p, 6);
    for (int i = 0; i < 2000; i++) cr_assert_eq(draw(s, x), 4);
    pd_sampler_free(s);

    /* entries for one token add up; together they can reach a ban */
    pd_logit_bias dup[] = {{1, -60.0f}, {1, -50.0f}, {2, 1.0f}, {2, 2.5f}};
    p.logit_bias = dup;
    p.n_logit_bias = 4;
    p.temperature = 0.0f;
    s = mk(&p, 6);
    float want[6] = {1.0f, -INFINITY, 5.5f, 4.0f, 0.0f, 3.0f};
    expect_adjusted(s, x, want, 6);
    cr_expect_eq(draw(s, x), 2);
    cr_expect_eq(pd_sampler_params_of(s)->n_logit_bias, 2);
    pd_sampler_free(s);

    /* banning everything is an error, not a silent token */
    pd_logit_bias all[6];
    for (int i = 0; i < 6; i++) all[i] = (pd_logit_bias){i, -100.0f};
    p.logit_bias = all;
    p.n_logit_bias = 6;
    s = mk(&p, 6);
    pd_sample_result r;
    pd_error err = {0};
    cr_expect_eq(pd_sampler_sample(s, x, &r, &err), PD_ERANGE);
    cr_expect(strstr(err.msg, "banned") != NULL, "%s", err.msg);
    pd_sampler_free(s);
}

/* ---- logprobs --------------------------------------------------------------------- */

Test(sampler, logprobs_are_log_softmax_before_temperature) {
    trng_state = 4242;
    const int32_t n = 3000;
    float *x = malloc(n * sizeof *x);
    rand_logits(x, n, 2.0f);
    x[17] = x[18] = 9.0f; /* a tie at the top */
    double m = -INFINITY, z = 0;
    for (int32_t i = 0; i < n; i++) m = fmax(m, x[i]);
    for (int32_t i = 0; i < n; i++) z += exp(x[i] - m);
    int32_t *o = order_desc(x, n);
    float temps[3] = {0.0f, 0.5f, 2.0f};
    for (int ti = 0; ti < 3; ti++) {
        pd_sampler_params p = params_seed(temps[ti], 5);
        p.n_logprobs = 20;
        p.top_k = 50;
        pd_sampler *s = mk(&p, n);
        for (int it = 0; it < 20; it++) {
            pd_sample_result r = draw_full(s, x);
            cr_assert(r.has_logprob);
            double ref = x[r.token] - m - log(z);
            cr_expect(fabs(r.logprob - ref) < 1e-5, "chosen logprob %g vs %g", (double)r.logprob, ref);
            cr_assert_eq(r.n_top, 20);
            for (int j = 0; j < 20; j++) {
                cr_expect_eq(r.top[j].token, o[j], "top[%d]", j);
                cr_expect(fabs(r.top[j].logprob - (x[o[j]] - m - log(z))) < 1e-5);
                if (j > 0) cr_expect(r.top[j].logprob <= r.top[j - 1].logprob);
            }
            cr_expect_eq(r.top[0].token, 17, "ties: lowest id first");
            cr_expect_eq(r.top[1].token, 18);
        }
        pd_sampler_free(s);
    }
    free(o);

    /* exp(logprob) over the whole vocabulary sums to 1 */
    float small[20];
    rand_logits(small, 20, 3.0f);
    pd_sampler_params p = params_seed(0.8f, 6);
    p.n_logprobs = 20;
    pd_sampler *s = mk(&p, 20);
    pd_sample_result r = draw_full(s, small);
    double sum = 0;
    for (int j = 0; j < r.n_top; j++) sum += exp(r.top[j].logprob);
    cr_expect(fabs(sum - 1.0) < 1e-5, "sum of probabilities %.8f", sum);
    pd_sampler_free(s);

    /* logprobs only: no alternatives */
    p.n_logprobs = 0;
    p.logprobs = true;
    s = mk(&p, 20);
    r = draw_full(s, small);
    cr_expect(r.has_logprob);
    cr_expect_eq(r.n_top, 0);
    cr_expect(r.logprob <= 0.0f);
    pd_sampler_free(s);
    p.logprobs = false;
    s = mk(&p, 20);
    r = draw_full(s, small);
    cr_expect(!r.has_logprob);
    pd_sampler_free(s);
    free(x);
}

/* ---- validation ---------------------------------------------------------------------- */

static void expect_invalid(const pd_sampler_params *p, int32_t n, const char *name) {
    pd_sampler *s = (pd_sampler *)(uintptr_t)1;
    pd_error err = {0};
    int rc = pd_sampler_create(p, n, &s, &err);
    cr_expect_eq(rc, PD_EINVAL, "%s: expected PD_EINVAL, got %d", name, rc);
    cr_expect_null(s);
    cr_expect(strstr(err.msg, name) != NULL, "message should name %s: %s", name, err.msg);
}

Test(sampler, parameter_validation_names_the_parameter) {
    pd_sampler_params p;
    pd_logit_bias b[2] = {{3, 1.0f}, {10, 1.0f}};
#define BAD(field, value, name)                                                                  \
    do {                                                                                         \
        p = pd_sampler_params_default();                                                         \
        p.field = value;                                                                         \
        expect_invalid(&p, 10, name);                                                            \
    } while (0)
    BAD(temperature, -0.1f, "temperature");
    BAD(temperature, NAN, "temperature");
    BAD(temperature, INFINITY, "temperature");
    BAD(top_p, 0.0f, "top_p");
    BAD(top_p, 1.01f, "top_p");
    BAD(top_p, NAN, "top_p");
    BAD(top_k, -1, "top_k");
    BAD(min_p, -0.01f, "min_p");
    BAD(min_p, 1.5f, "min_p");
    BAD(presence_penalty, 2.5f, "presence_penalty");
    BAD(frequency_penalty, -3.0f, "frequency_penalty");
    BAD(repetition_penalty, 0.0f, "repetition_penalty");
    BAD(repetition_penalty, -1.0f, "repetition_penalty");
    BAD(penalty_last_n, -2, "penalty_last_n");
    BAD(penalty_last_n, PD_SAMPLER_MAX_LAST_N + 1, "penalty_last_n");
    BAD(n_logprobs, 21, "logprobs");
    BAD(n_logprobs, -1, "logprobs");
#undef BAD
    p = pd_sampler_params_default();
    p.logit_bias = b;
    p.n_logit_bias = 2;
    expect_invalid(&p, 10, "logit_bias");
    b[1].token = -1;
    expect_invalid(&p, 10, "logit_bias");
    b[1] = (pd_logit_bias){4, 150.0f};
    expect_invalid(&p, 10, "logit_bias");
    b[1] = (pd_logit_bias){4, NAN};
    expect_invalid(&p, 10, "logit_bias");
    p.logit_bias = NULL;
    expect_invalid(&p, 10, "logit_bias");
    p = pd_sampler_params_default();
    expect_invalid(&p, 0, "n_vocab");

    /* edges that are fine */
    p = pd_sampler_params_default();
    p.top_k = 1000; /* larger than the vocabulary: off */
    p.top_p = 1.0f;
    p.min_p = 1.0f;
    p.n_logprobs = 20;
    p.penalty_last_n = -1;
    p.repetition_penalty = 0.5f;
    pd_sampler *s = mk(&p, 10);
    float x[10] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
    cr_expect_eq(draw(s, x), 9, "min_p = 1 keeps only the maximum");
    pd_sample_result r = draw_full(s, x);
    cr_expect_eq(r.n_top, 10, "n_top is capped by the vocabulary");

    /* bad ids and bad logits at run time */
    pd_error err = {0};
    cr_expect_eq(pd_sampler_accept(s, 10, true, &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "10") != NULL, "%s", err.msg);
    cr_expect_eq(pd_sampler_accept(s, -1, false, &err), PD_EINVAL);
    x[4] = NAN;
    cr_expect_eq(pd_sampler_sample(s, x, &r, &err), PD_ERANGE);
    cr_expect(strstr(err.msg, "NaN") != NULL && strstr(err.msg, "token 4") != NULL, "%s", err.msg);
    x[4] = INFINITY;
    cr_expect_eq(pd_sampler_sample(s, x, &r, &err), PD_ERANGE);
    cr_expect(strstr(err.msg, "inf") != NULL, "%s", err.msg);
    pd_sampler_free(s);
}

/* ---- a real vocabulary size ------------------------------------------------------------- */

Test(sampler, qwen_sized_vocabulary) {
    const int32_t n = 151936;
    float *x = malloc(n * sizeof *x);
    trng_state = 151936;
    rand_logits(x, n, 3.0f);
    int32_t *o = order_desc(x, n);
    bool *top40 = calloc(n, 1);
    for (int j = 0; j < 40; j++) top40[o[j]] = true;

    struct {
        const char *name;
        float temp;
        int32_t top_k;
        float top_p, min_p;
        int32_t n_logprobs;
        float pres;
    } cfg[] = {
        {"greedy", 0.0f, 0, 1.0f, 0.0f, 0, 0.0f},
        {"greedy+logprobs", 0.0f, 0, 1.0f, 0.0f, 20, 0.0f},
        {"temperature", 0.8f, 0, 1.0f, 0.0f, 0, 0.0f},
        {"top_k=40", 0.8f, 40, 1.0f, 0.0f, 0, 0.0f},
        {"top_p=0.95", 1.0f, 0, 0.95f, 0.0f, 0, 0.0f},
        {"top_k+top_p+min_p", 0.7f, 40, 0.9f, 0.05f, 0, 0.0f},
        {"everything", 0.7f, 100, 0.9f, 0.05f, 5, 0.5f},
    };
    for (size_t c = 0; c < sizeof cfg / sizeof cfg[0]; c++) {
        pd_sampler_params p = params_seed(cfg[c].temp, 17);
        p.top_k = cfg[c].top_k;
        p.top_p = cfg[c].top_p;
        p.min_p = cfg[c].min_p;
        p.n_logprobs = cfg[c].n_logprobs;
        p.presence_penalty = cfg[c].pres;
        pd_sampler *s = mk(&p, n);
        const int reps = 30;
        for (int i = 0; i < reps; i++) {
            pd_token t = draw(s, x);
            if (cfg[c].temp == 0.0f) cr_expect_eq(t, o[0]);
            if (cfg[c].top_k == 40) cr_expect(top40[t], "%s: token %d not in the top 40", cfg[c].name, t);
        }
        pd_sampler_free(s);
    }
    /* top-p with the reference set */
    check_allowed(x, n, 1.0f, 0, 0.9f, 0.0f, 200, false);
    check_allowed(x, n, 0.5f, 0, 0.5f, 0.0f, 200, false);
    free(top40);
    free(o);
    free(x);
}

/* ---- stop strings --------------------------------------------------------------------- */

typedef struct stream {
    pd_stop_matcher *m;
    char out[4096];
    size_t len;
    bool matched;
    int32_t index;
} stream;

static void stream_open(stream *st, const char *const *stops, size_t n) {
    memset(st, 0, sizeof *st);
    pd_error err = {0};
    cr_assert_eq(pd_stop_create(stops, NULL, n, &st->m, &err), PD_OK, "%s", err.msg);
    st->index = -1;
}

/* Feed one piece; returns the emitted chunk as a NUL-terminated string. */
static const char *feed(stream *st, const char *piece, size_t n) {
    static char chunk[4096];
    pd_stop_result r;
    pd_error err = {0};
    cr_assert_eq(pd_stop_feed(st->m, piece, n, &r, &err), PD_OK, "%s", err.msg);
    cr_assert_lt(st->len + r.len, sizeof st->out);
    memcpy(st->out + st->len, r.text, r.len);
    st->len += r.len;
    memcpy(chunk, r.text, r.len);
    chunk[r.len] = 0;
    st->matched = r.matched;
    st->index = r.stop_index;
    return chunk;
}
static const char *feeds(stream *st, const char *piece) { return feed(st, piece, strlen(piece)); }

static const char *finish(stream *st) {
    static char chunk[4096];
    pd_stop_result r;
    pd_stop_finish(st->m, &r);
    memcpy(st->out + st->len, r.text, r.len);
    st->len += r.len;
    memcpy(chunk, r.text, r.len);
    chunk[r.len] = 0;
    return chunk;
}

static void stream_close(stream *st) {
    st->out[st->len] = 0;
    pd_stop_free(st->m);
    st->m = NULL;
}

Test(stop, split_across_pieces) {
    const char *stops[] = {"STOP"};
    stream st;
    stream_open(&st, stops, 1);
    cr_expect_str_eq(feeds(&st, "abc ST"), "abc ");
    cr_expect_eq(pd_stop_held(st.m), 2);
    cr_expect_str_eq(feeds(&st, "O"), "");
    cr_expect(!st.matched);
    cr_expect_str_eq(feeds(&st, "P more"), "");
    cr_expect(st.matched);
    cr_expect_eq(st.index, 0);
    /* after a match: nothing more, even at finish */
    cr_expect_str_eq(feeds(&st, "tail"), "");
    cr_expect(st.matched);
    cr_expect_str_eq(finish(&st), "");
    stream_close(&st);
    cr_expect_str_eq(st.out, "abc ");

    /* split over two pieces, text on both sides */
    stream_open(&st, stops, 1);
    cr_expect_str_eq(feeds(&st, "hello S"), "hello ");
    cr_expect_str_eq(feeds(&st, "TOP world"), "");
    cr_expect(st.matched);
    stream_close(&st);
    cr_expect_str_eq(st.out, "hello ");
}

Test(stop, overlapping_prefixes) {
    const char *stops[] = {"abc"};
    stream st;
    stream_open(&st, stops, 1);
    cr_expect_str_eq(feeds(&st, "ab"), "");
    cr_expect_str_eq(feeds(&st, "x"), "abx", "a broken prefix is released");
    cr_expect_str_eq(feeds(&st, "aab"), "a");
    cr_expect_str_eq(feeds(&st, "abc"), "ab", "stop starts inside the held bytes");
    cr_expect(st.matched);
    stream_close(&st);
    cr_expect_str_eq(st.out, "abxaab");

    /* self-overlapping stop string */
    const char *s2[] = {"aab"};
    stream_open(&st, s2, 1);
    cr_expect_str_eq(feeds(&st, "a"), "");
    cr_expect_str_eq(feeds(&st, "a"), "");
    cr_expect_str_eq(feeds(&st, "a"), "a");
    cr_expect_str_eq(feeds(&st, "b"), "");
    cr_expect(st.matched);
    stream_close(&st);
    cr_expect_str_eq(st.out, "a");
}

Test(stop, multiple_stops_earliest_wins) {
    const char *stops[] = {"\n\n", "END", "x", "ab"};
    stream st;
    stream_open(&st, stops, 4);
    cr_expect_str_eq(feeds(&st, "hello E"), "hello ");
    cr_expect_str_eq(feeds(&st, "ND\n\n"), "");
    cr_expect(st.matched);
    cr_expect_eq(st.index, 1, "END starts first");
    stream_close(&st);
    cr_expect_str_eq(st.out, "hello ");

    stream_open(&st, stops, 4);
    feeds(&st, "1 2\n");
    cr_expect_str_eq(feeds(&st, "\nx"), "");
    cr_expect_eq(st.index, 0);
    stream_close(&st);
    cr_expect_str_eq(st.out, "1 2");

    /* several in one piece: the one complete first wins, as it would
     * have if the text came byte by byte */
    const char *s2[] = {"world", "lo w", "o"};
    stream_open(&st, s2, 3);
    feeds(&st, "hello world");
    cr_expect_eq(st.index, 2);
    stream_close(&st);
    cr_expect_str_eq(st.out, "hell");
    const char *s3[] = {"abc", "ab"};
    stream_open(&st, s3, 2);
    feeds(&st, "zabc");
    cr_expect_eq(st.index, 1);
    stream_close(&st);
    cr_expect_str_eq(st.out, "z");
    /* complete at the same byte: the earliest start (the longer one) */
    const char *s4[] = {"b", "ab"};
    stream_open(&st, s4, 2);
    feeds(&st, "xab");
    cr_expect_eq(st.index, 1);
    stream_close(&st);
    cr_expect_str_eq(st.out, "x");
    /* a stop string that completes first wins over a longer one that
     * started earlier, whatever the pieces */
    const char *s5[] = {" b ", "b"};
    stream_open(&st, s5, 2);
    feeds(&st, " b ");
    cr_expect_eq(st.index, 1);
    stream_close(&st);
    cr_expect_str_eq(st.out, " ");
    /* same start and end: the first listed */
    const char *s6[] = {"q", "q"};
    stream_open(&st, s6, 2);
    feeds(&st, "aqq");
    cr_expect_eq(st.index, 0);
    stream_close(&st);
}

Test(stop, stop_at_the_very_start) {
    const char *stops[] = {"Hel"};
    stream st;
    stream_open(&st, stops, 1);
    cr_expect_str_eq(feeds(&st, "Hello"), "");
    cr_expect(st.matched);
    stream_close(&st);
    cr_expect_eq(st.len, 0);
    stream_open(&st, stops, 1);
    feeds(&st, "H");
    feeds(&st, "e");
    feeds(&st, "l");
    cr_expect(st.matched);
    stream_close(&st);
    cr_expect_eq(st.len, 0);
}

Test(stop, utf8_never_split) {
    const char emoji[] = "\xF0\x9F\x98\x80"; /* U+1F600 */
    stream st;
    stream_open(&st, NULL, 0);
    cr_expect_str_eq(feeds(&st, "a"), "a");
    for (int i = 0; i < 3; i++) {
        cr_expect_str_eq(feed(&st, emoji + i, 1), "", "byte %d must be held", i);
        cr_expect_eq(pd_stop_held(st.m), (size_t)i + 1);
    }
    cr_expect_str_eq(feed(&st, emoji + 3, 1), emoji);
    /* "é" (C3 A9) split with ASCII before it */
    cr_expect_str_eq(feeds(&st, "caf\xC3"), "caf");
    cr_expect_str_eq(feeds(&st, "\xA9!"), "\xC3\xA9!");
    /* three-byte character "€" (E2 82 AC) in two pieces */
    cr_expect_str_eq(feeds(&st, "\xE2\x82"), "");
    cr_expect_str_eq(feeds(&st, "\xAC"), "\xE2\x82\xAC");
    /* malformed bytes are not held forever */
    cr_expect_str_eq(feeds(&st, "\x80\x80"), "\x80\x80");
    cr_expect_str_eq(feeds(&st, "\xC3z"), "\xC3z");
    /* finish flushes an incomplete character */
    cr_expect_str_eq(feeds(&st, "\xF0\x9F"), "");
    cr_expect_str_eq(finish(&st), "\xF0\x9F");
    stream_close(&st);

    /* with a stop string that begins with a multi-byte character */
    const char *stops[] = {"\xF0\x9F\x98\x81" "x"}; /* U+1F601 then x */
    stream_open(&st, stops, 1);
    for (int i = 0; i < 4; i++) feed(&st, emoji + i, 1);
    cr_expect_eq(st.len, 4, "emoji emitted whole once complete");
    feed(&st, "\xF0\x9F\x98", 3);
    cr_expect_eq(st.len, 4);
    feed(&st, "\x81", 1);
    cr_expect_eq(st.len, 4, "held: could be the stop string");
    feed(&st, "y", 1);
    cr_expect_eq(st.len, 9);
    feed(&st, "\xF0\x9F\x98\x81x", 5);
    cr_expect(st.matched);
    stream_close(&st);
    cr_expect_eq(st.len, 9);
}

Test(stop, flush_at_end) {
    const char *stops[] = {"abc", "<|end|>"};
    stream st;
    stream_open(&st, stops, 2);
    cr_expect_str_eq(feeds(&st, "xab"), "x");
    cr_expect_str_eq(finish(&st), "ab");
    stream_close(&st);
    cr_expect_str_eq(st.out, "xab");
    stream_open(&st, stops, 2);
    cr_expect_str_eq(feeds(&st, "done <|en"), "done ");
    cr_expect_str_eq(finish(&st), "<|en");
    cr_expect(!st.matched);
    /* reset starts over */
    pd_stop_reset(st.m);
    st.len = 0;
    cr_expect_str_eq(feeds(&st, "<|end|>"), "");
    cr_expect(st.matched);
    stream_close(&st);
}

Test(stop, rejects_bad_stop_lists) {
    pd_stop_matcher *m = NULL;
    pd_error err = {0};
    const char *empty[] = {"ok", ""};
    cr_expect_eq(pd_stop_create(empty, NULL, 2, &m, &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "stop[1]") && strstr(err.msg, "empty"), "%s", err.msg);
    cr_expect_null(m);
    const char *many[PD_STOP_MAX_STRINGS + 1];
    for (int i = 0; i <= PD_STOP_MAX_STRINGS; i++) many[i] = "x";
    cr_expect_eq(pd_stop_create(many, NULL, PD_STOP_MAX_STRINGS + 1, &m, &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "stop") != NULL, "%s", err.msg);
    /* explicit lengths allow NUL bytes */
    const char *nul[] = {"a\0b"};
    size_t lens[] = {3};
    cr_assert_eq(pd_stop_create(nul, lens, 1, &m, &err), PD_OK, "%s", err.msg);
    pd_stop_result r;
    cr_assert_eq(pd_stop_feed(m, "xya\0bz", 6, &r, &err), PD_OK);
    cr_expect(r.matched);
    cr_expect_eq(r.len, 2);
    pd_stop_free(m);
}

/* Random streams against a naive reference: the concatenated output is the
 * text cut before the first stop string; no chunk ends inside a character;
 * held bytes stay bounded. */
Test(stop, random_streams_match_reference) {
    static const char *alphabet[] = {"a", "b", "c", " ", "\xC3\xA9", "\xE2\x82\xAC",
                                     "\xF0\x9F\x98\x80"};
    trng_state = 4;
    for (int it = 0; it < 3000; it++) {
        char text[600];
        size_t tl = 0;
        int nchars = 5 + (int)(trng() % 60);
        for (int i = 0; i < nchars; i++) {
            const char *c = alphabet[trng() % 7];
            memcpy(text + tl, c, strlen(c));
            tl += strlen(c);
        }
        char stopbuf[4][32];
        const char *stops[4];
        int ns = (int)(trng() % 5);
        size_t maxl = 0;
        for (int k = 0; k < ns; k++) {
            size_t l = 0;
            int nc = 1 + (int)(trng() % 3);
            for (int i = 0; i < nc; i++) {
                const char *c = alphabet[trng() % 7];
                memcpy(stopbuf[k] + l, c, strlen(c));
                l += strlen(c);
            }
            stopbuf[k][l] = 0;
            stops[k] = stopbuf[k];
            if (l > maxl) maxl = l;
        }
        /* reference: the occurrence that ends first, then starts first,
         * then is listed first */
        size_t cut = tl, cut_end = SIZE_MAX;
        int ref_idx = -1;
        for (int k = 0; k < ns; k++) {
            const char *h = memmem(text, tl, stops[k], strlen(stops[k]));
            if (!h) continue;
            size_t start = (size_t)(h - text), end = start + strlen(stops[k]);
            if (end < cut_end || (end == cut_end && start < cut)) {
                cut = start;
                cut_end = end;
                ref_idx = k;
            }
        }
        stream st;
        stream_open(&st, stops, (size_t)ns);
        size_t pos = 0;
        while (pos < tl && !st.matched) {
            size_t pl = 1 + trng() % 6;
            if (pl > tl - pos) pl = tl - pos;
            size_t before = st.len;
            feed(&st, text + pos, pl);
            pos += pl;
            /* chunk ends at a character boundary: the next byte of the text
             * (if any) is not a continuation byte */
            if (st.len > before && st.len < tl)
                cr_assert(((unsigned char)text[st.len] & 0xC0) != 0x80,
                          "iteration %d: chunk ends inside a character", it);
            cr_assert_leq(pd_stop_held(st.m), maxl + 3, "iteration %d: too much held", it);
            cr_assert(!st.matched || pos >= cut_end, "iteration %d: matched too early", it);
            cr_assert(st.matched || pos < cut_end, "iteration %d: match missed", it);
        }
        if (!st.matched) finish(&st);
        cr_assert_eq(st.matched, ref_idx >= 0, "iteration %d", it);
        if (st.matched) cr_assert_eq(st.index, ref_idx, "iteration %d", it);
        cr_assert_eq(st.len, cut, "iteration %d: emitted %zu bytes, want %zu", it, st.len, cut);
        cr_assert(memcmp(st.out, text, cut) == 0, "iteration %d: emitted text differs", it);
        stream_close(&st);
    }
}

/* ---- generation limits with a real tokenizer ----------------------------------------- */

static char *gen_dir;
static pd_tokenizer *gen_tok;

static void gen_setup(void) {
    gen_dir = th_mkdtemp();
    cr_assert_not_null(gen_dir);
    pd_testmodel_opts o;
    pd_error err = {0};
    cr_assert_eq(pd_testmodel_preset("tiny", &o, &err), PD_OK, "%s", err.msg);
    char path[1024];
    snprintf(path, sizeof path, "%s/tiny.gguf", gen_dir);
    cr_assert_eq(pd_testmodel_write(&o, path, NULL, &err), PD_OK, "%s", err.msg);
    pd_gguf *g = NULL;
    cr_assert_eq(pd_gguf_open(path, &g, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_tokenizer_load(g, &gen_tok, &err), PD_OK, "%s", err.msg);
    pd_gguf_close(g);
}

static void gen_teardown(void) {
    pd_tokenizer_free(gen_tok);
    gen_tok = NULL;
    th_rmtree(gen_dir);
    free(gen_dir);
    gen_dir = NULL;
}

static pd_token *tok_ids(const char *text, size_t *n) {
    pd_token *ids = NULL;
    pd_error err = {0};
    pd_tokenize_opts o = {.add_special = false, .parse_special = false};
    cr_assert_eq(pd_tokenize(gen_tok, text, strlen(text), o, &ids, n, &err), PD_OK, "%s", err.msg);
    return ids;
}

/* Push ids; collect text; return the finish reason. */
static pd_finish_reason run_gen(const pd_generation_params *p, const pd_token *ids, size_t n,
                                char *text, size_t cap, int32_t *stop_index, size_t *pushed) {
    pd_generation *g = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_generation_create(gen_tok, p, &g, &err), PD_OK, "%s", err.msg);
    size_t len = 0;
    pd_generation_step st = {0};
    size_t i = 0;
    for (; i < n; i++) {
        cr_assert_eq(pd_generation_push(g, ids[i], &st, &err), PD_OK, "%s", err.msg);
        cr_assert_lt(len + st.len, cap);
        memcpy(text + len, st.text, st.len);
        len += st.len;
        if (st.finish != PD_FINISH_NONE) break;
    }
    if (st.finish == PD_FINISH_NONE) {
        pd_generation_finish(g, PD_FINISH_LENGTH, &st);
        memcpy(text + len, st.text, st.len);
        len += st.len;
    } else {
        /* pushing after the end is refused */
        pd_generation_step st2;
        cr_expect_eq(pd_generation_push(g, ids[0], &st2, &err), PD_EINVAL);
        cr_expect(strstr(err.msg, "finished") != NULL, "%s", err.msg);
    }
    text[len] = 0;
    if (stop_index) *stop_index = st.stop_index;
    if (pushed) *pushed = (size_t)pd_generation_n_tokens(g);
    cr_expect_eq(pd_generation_tokens_left(g), p->max_tokens - pd_generation_n_tokens(g));
    pd_finish_reason fr = pd_generation_finish_reason(g);
    cr_expect_eq(fr, st.finish);
    pd_generation_free(g);
    return fr;
}

TestSuite(generation, .init = gen_setup, .fini = gen_teardown);

Test(generation, stop_string_eog_and_length) {
    const char *text = "Once upon a time there was a little dog. The end.";
    size_t n = 0;
    pd_token *ids = tok_ids(text, &n);
    cr_assert_gt(n, 5);
    char out[1024];
    int32_t si;
    size_t pushed;

    /* no limits hit: the whole text, reason from the explicit finish */
    pd_generation_params p = {.max_tokens = 1000};
    cr_expect_eq(run_gen(&p, ids, n, out, sizeof out, &si, &pushed), PD_FINISH_LENGTH);
    /* SPM pieces carry the leading space of the first word */
    cr_expect(strstr(out, "Once upon a time there was a little dog. The end.") != NULL, "[%s]", out);

    /* stop string across tokens */
    const char *stops[] = {"little", "zzz"};
    p.stop = stops;
    p.n_stop = 2;
    cr_expect_eq(run_gen(&p, ids, n, out, sizeof out, &si, &pushed), PD_FINISH_STOP);
    cr_expect_eq(si, 0);
    cr_expect(strstr(out, "there was a ") != NULL && strstr(out, "little") == NULL, "[%s]", out);
    cr_expect_lt(pushed, n);

    /* max_tokens: "length", held bytes flushed */
    const char *st2[] = {"dog. The end. And more"};
    p.stop = st2;
    p.n_stop = 1;
    p.max_tokens = (int32_t)n;
    cr_expect_eq(run_gen(&p, ids, n, out, sizeof out, &si, &pushed), PD_FINISH_LENGTH);
    cr_expect(strstr(out, "little dog. The end.") != NULL, "held text flushed: [%s]", out);
    cr_expect_eq(pushed, n);
    p.max_tokens = 3;
    p.stop = NULL;
    p.n_stop = 0;
    cr_expect_eq(run_gen(&p, ids, n, out, sizeof out, &si, &pushed), PD_FINISH_LENGTH);
    cr_expect_eq(pushed, 3);

    /* EOS ends with "stop", is counted, and its text is not emitted */
    pd_token eos = pd_tokenizer_eos(gen_tok);
    cr_assert_neq(eos, PD_TOKEN_NULL);
    cr_assert(pd_tokenizer_is_eog(gen_tok, eos));
    pd_token *ids2 = malloc((n + 3) * sizeof *ids2);
    memcpy(ids2, ids, 4 * sizeof *ids2);
    ids2[4] = eos;
    memcpy(ids2 + 5, ids + 4, (n - 4) * sizeof *ids2);
    p.max_tokens = 100;
    cr_expect_eq(run_gen(&p, ids2, n + 1, out, sizeof out, &si, &pushed), PD_FINISH_STOP);
    cr_expect_eq(si, -1);
    cr_expect_eq(pushed, 5);
    size_t n4 = 0;
    char *four = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_detokenize(gen_tok, ids, 4, false, false, &four, &n4, &err), PD_OK);
    cr_expect_str_eq(out, four);
    free(four);
    /* ignore_eos: EOS is just another token (rendered empty without `special`) */
    p.ignore_eos = true;
    cr_expect_eq(run_gen(&p, ids2, n + 1, out, sizeof out, &si, &pushed), PD_FINISH_LENGTH);
    cr_expect_eq(pushed, n + 1);
    free(ids2);
    free(ids);

    /* validation */
    pd_generation *g = NULL;
    pd_generation_params bad = {.max_tokens = 0};
    cr_expect_eq(pd_generation_create(gen_tok, &bad, &g, &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "max_tokens") != NULL, "%s", err.msg);
    const char *empty[] = {""};
    bad = (pd_generation_params){.max_tokens = 5, .stop = empty, .n_stop = 1};
    cr_expect_eq(pd_generation_create(gen_tok, &bad, &g, &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "stop") != NULL, "%s", err.msg);
    cr_expect_str_eq(pd_finish_reason_name(PD_FINISH_STOP), "stop");
    cr_expect_str_eq(pd_finish_reason_name(PD_FINISH_LENGTH), "length");
    cr_expect_null(pd_finish_reason_name(PD_FINISH_NONE));
}

Test(generation, byte_fallback_emoji_is_never_split) {
    const char *text = "hi \xF0\x9F\x98\x80 ok";
    size_t n = 0;
    pd_token *ids = tok_ids(text, &n);
    pd_generation_params p = {.max_tokens = 100};
    pd_generation *g = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_generation_create(gen_tok, &p, &g, &err), PD_OK, "%s", err.msg);
    char out[256];
    size_t len = 0;
    int chunks_with_emoji = 0;
    for (size_t i = 0; i < n; i++) {
        pd_generation_step st;
        cr_assert_eq(pd_generation_push(g, ids[i], &st, &err), PD_OK, "%s", err.msg);
        /* every chunk is valid UTF-8 on its own */
        for (size_t j = 0; j < st.len; j++) {
            unsigned char c = (unsigned char)st.text[j];
            if (c >= 0xF0) {
                cr_assert_leq(j + 4, st.len, "emoji split across chunks");
                chunks_with_emoji++;
            }
        }
        if (st.len > 0) cr_assert(((unsigned char)st.text[0] & 0xC0) != 0x80, "chunk starts mid-character");
        memcpy(out + len, st.text, st.len);
        len += st.len;
    }
    out[len] = 0;
    cr_expect_eq(chunks_with_emoji, 1);
    cr_expect(strstr(out, "hi \xF0\x9F\x98\x80 ok") != NULL, "[%s]", out);
    pd_generation_free(g);
    free(ids);
}

/* The sampler and the generation together, as a decode loop would use them. */
Test(generation, sampler_and_limits_in_a_loop) {
    int32_t nv = pd_tokenizer_n_vocab(gen_tok);
    float *x = malloc((size_t)nv * sizeof *x);
    pd_sampler_params sp = params_seed(0.9f, 2);
    sp.top_k = 40;
    sp.frequency_penalty = 0.3f;
    sp.repetition_penalty = 1.1f;
    pd_sampler *s = mk(&sp, nv);
    size_t n_prompt = 0;
    pd_token *prompt = tok_ids("Once upon a time", &n_prompt);
    pd_error err = {0};
    cr_assert_eq(pd_sampler_accept_many(s, prompt, n_prompt, false, &err), PD_OK, "%s", err.msg);
    cr_expect_eq(pd_sampler_accept_many(s, (pd_token[]){1, nv}, 2, false, &err), PD_EINVAL);
    cr_expect(strstr(err.msg, "token 1 of 2") != NULL, "%s", err.msg);
    pd_generation_params gp = {.max_tokens = 64};
    pd_generation *g = NULL;
    cr_assert_eq(pd_generation_create(gen_tok, &gp, &g, &err), PD_OK, "%s", err.msg);
    trng_state = 1;
    pd_generation_step st = {0};
    int steps = 0;
    while (st.finish == PD_FINISH_NONE) {
        rand_logits(x, nv, 2.0f);
        pd_token t = draw(s, x);
        accept(s, t, true);
        cr_assert_eq(pd_generation_push(g, t, &st, &err), PD_OK, "%s", err.msg);
        steps++;
    }
    cr_expect_leq(steps, 64);
    cr_expect(st.finish == PD_FINISH_LENGTH ? steps == 64 : st.eog);
    pd_generation_free(g);
    pd_sampler_free(s);
    free(prompt);
    free(x);
}
