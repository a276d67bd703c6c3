/* Offline calibration: the pooled fit against a naive grid search, the
 * policy identity of a curve, per-text measurements against the library's
 * own compress + NLL, curve files round trip, `prefixctl calibrate` and
 * `prefixctl compress --curve` end to end, and the admin API's `curve` on a
 * real daemon. */
#include <criterion/criterion.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>

#include "engine/engine.h"
#include "helpers.h"
#include "helpers_json.h"
#include "policies/policies.h"
#include "tools/tools.h"

#define TOKEN "cal-t0ken"

static char *tmpdir;
static pid_t daemon_pid;
static int port;

static void setup(void) {
    tmpdir = th_mkdtemp();
    cr_assert_not_null(tmpdir);
}

static void teardown(void) {
    th_daemon_stop(&daemon_pid, SIGKILL);
    th_rmtree(tmpdir);
    free(tmpdir);
    tmpdir = NULL;
}

TestSuite(calibrate, .init = setup, .fini = teardown, .timeout = 240);

/* ---- the pooled fit ------------------------------------------------------------- */

/* The fit's objective written out: asymmetric squared loss over every
 * (point, ratio) pair of every text. */
static double pooled_loss(pd_curve c, const double *points, int np, const double *ratios, int nt, double uw) {
    double s = 0;
    for (int t = 0; t < nt; t++)
        for (int i = 0; i < np; i++) {
            const double r = ratios[t * np + i] - pd_curve_eval(c, points[i]);
            s += (r > 0 ? uw : 1.0) * r * r;
        }
    return s;
}

/* xorshift64*: deterministic noise for the synthetic texts. */
static double noise(uint64_t *s) {
    *s ^= *s >> 12, *s ^= *s << 25, *s ^= *s >> 27;
    return (double)((*s * 2685821657736338717ULL) >> 11) / 9007199254740992.0 - 0.5;
}

Test(calibrate, fit_over_a_set_is_the_best_pooled_curve) {
    static const double points[] = {0.5, 0.25, 0.125, 0.0625};
    enum { NP = 4, NT = 9 };
    double ratios[NT * NP];
    uint64_t seed = 12345;
    /* Texts that differ in how much compression hurts them, with noise. */
    for (int t = 0; t < NT; t++) {
        const pd_curve truth = {.a = 0.01 * (1 + t % 3), .b = 0.8 + 0.2 * (t % 4)};
        for (int i = 0; i < NP; i++) ratios[t * NP + i] = pd_curve_eval(truth, points[i]) + 0.02 * noise(&seed);
    }
    pd_curve fit;
    pd_error err = {0};
    cr_assert_eq(pd_curve_fit_set(points, NP, ratios, NT, 4.0, &fit, &err), PD_OK, "%s", err.msg);
    /* Naive reference: a dense grid over (log a, log b). */
    pd_curve best = {0};
    double best_loss = INFINITY;
    for (int ia = 0; ia <= 400; ia++)
        for (int ib = 0; ib <= 400; ib++) {
            const pd_curve c = {.a = exp(log(1e-4) + (log(10.0) - log(1e-4)) * ia / 400.0),
                                .b = exp(log(1e-2) + (log(10.0) - log(1e-2)) * ib / 400.0)};
            const double l = pooled_loss(c, points, NP, ratios, NT, 4.0);
            if (l < best_loss) best_loss = l, best = c;
        }
    const double fit_loss = pooled_loss(fit, points, NP, ratios, NT, 4.0);
    cr_assert_leq(fit_loss, best_loss * (1 + 1e-9), "fit (a %g, b %g) loss %g, grid (a %g, b %g) loss %g", fit.a,
                  fit.b, fit_loss, best.a, best.b, best_loss);
    cr_assert_geq(fit_loss, best_loss * 0.95, "the grid is fine enough to come within 5%% of the optimum");
    /* Pooling gives every text the same weight: any order of the texts fits the same curve (up to
     * rounding in the sums, which the flat optimum turns into ~1e-8 in a and b). */
    double reversed[NT * NP];
    for (int t = 0; t < NT; t++) memcpy(reversed + t * NP, ratios + (NT - 1 - t) * NP, sizeof(double) * NP);
    pd_curve rev;
    cr_assert_eq(pd_curve_fit_set(points, NP, reversed, NT, 4.0, &rev, &err), PD_OK, "%s", err.msg);
    cr_assert_float_eq(rev.a, fit.a, 1e-6 * fit.a, "a %.17g vs %.17g, b %.17g vs %.17g", rev.a, fit.a, rev.b, fit.b);
    cr_assert_float_eq(rev.b, fit.b, 1e-6 * fit.b);
    cr_assert_float_eq(pooled_loss(rev, points, NP, ratios, NT, 4.0), fit_loss, 1e-12 * fit_loss);
    /* The under-weight pushes the curve above most points: more of them below it than above. */
    int below = 0;
    for (int t = 0; t < NT; t++)
        for (int i = 0; i < NP; i++) below += ratios[t * NP + i] <= pd_curve_eval(fit, points[i]);
    cr_assert_gt(below, NT * NP / 2, "%d of %d points under the curve", below, NT * NP);
    /* Errors: nothing to fit. */
    cr_assert_eq(pd_curve_fit_set(points, NP, ratios, 0, 4.0, &fit, &err), PD_EINVAL);
    cr_assert_eq(pd_curve_fit_set(points, 0, ratios, NT, 4.0, &fit, &err), PD_EINVAL);
}

Test(calibrate, curve_choose_is_the_tidied_inverse) {
    const pd_curve c = {.a = 0.003, .b = 1.3};
    for (double tau = 1.01; tau < 1.3; tau += 0.03) {
        const double r = pd_curve_choose(c, tau, 0.05);
        const double exact = fmax(0.05, pow(1 + (tau - 1) / c.a, -1 / c.b));
        cr_assert(r >= exact - 1e-12 && r < exact + 1e-4 + 1e-12, "tau %g: %g vs %g", tau, r, exact);
        cr_assert_float_eq(r * 1e4, round(r * 1e4), 1e-6, "a multiple of 1e-4: %.10g", r);
        cr_assert_leq(pd_curve_eval(c, r), tau + 1e-12, "the rounded choice stays within tau");
    }
}

Test(calibrate, curve_policy_is_the_spec_without_retention) {
    pd_policy_spec a, b, c;
    pd_error err = {0};
    cr_assert_eq(pd_policy_spec_parse("snapkv:retention=0.3,window=32", &a, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_policy_spec_parse("snapkv:window=32,retention=0.7", &b, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_policy_spec_parse("snapkv:window=16,retention=0.3", &c, &err), PD_OK, "%s", err.msg);
    char pa[PD_POLICY_SPEC_MAX], pb[PD_POLICY_SPEC_MAX], pc[PD_POLICY_SPEC_MAX], full[PD_POLICY_SPEC_MAX];
    const size_t n = pd_curve_policy_print(&a, pa, sizeof pa);
    cr_assert_eq(n, strlen(pa));
    pd_curve_policy_print(&b, pb, sizeof pb);
    pd_curve_policy_print(&c, pc, sizeof pc);
    cr_assert_str_eq(pa, pb, "retention aside, the same policy");
    cr_assert_str_neq(pa, pc, "another window is another policy");
    cr_assert_null(strstr(pa, "retention"), "%s", pa);
    /* It is the canonical spec with exactly the retention item removed. */
    pd_policy_spec_print(&a, full, sizeof full);
    char *r = strstr(full, ",retention=0.3");
    cr_assert_not_null(r, "%s", full);
    memmove(r, r + strlen(",retention=0.3"), strlen(r + strlen(",retention=0.3")) + 1);
    cr_assert_str_eq(pa, full);
    /* And it parses back to the same policy. */
    pd_policy_spec back;
    cr_assert_eq(pd_policy_spec_parse(pa, &back, &err), PD_OK, "%s", err.msg);
    pd_curve_policy_print(&back, pb, sizeof pb);
    cr_assert_str_eq(pa, pb);
}

/* ---- curve files ---------------------------------------------------------------- */

static void fill_curve_file(pd_curve_file *cf, int n_texts) {
    memset(cf, 0, sizeof *cf);
    snprintf(cf->policy, sizeof cf->policy, "knorm:budget=uniform,chunk=0,fair=0,recent=0,reuse=1,sink=0");
    snprintf(cf->model_file, sizeof cf->model_file, "m.gguf");
    for (int i = 0; i < 2 * PD_SHA256_LEN; i++) cf->fingerprint[i] = "0123456789abcdef"[(i * 7) % 16];
    cf->curve = (pd_curve){.a = 0.0123456789012345, .b = 1.0 / 3.0};
    cf->n_points = 3;
    cf->points[0] = 0.5, cf->points[1] = 0.3, cf->points[2] = 0.1;
    cf->holdout = 0.2;
    cf->under_weight = 4;
    cf->n_texts = n_texts;
    cf->texts = calloc((size_t)n_texts, sizeof *cf->texts);
    cr_assert_not_null(cf->texts);
    for (int t = 0; t < n_texts; t++) {
        snprintf(cf->texts[t].file, sizeof cf->texts[t].file, "story-%02d.txt", t);
        cf->texts[t].tokens = 100 + t;
        cf->texts[t].nll_full = 1.0 + t / 7.0;
        for (int i = 0; i < 3; i++) cf->texts[t].ratio[i] = 1.0 + (t + 1) * (i + 1) / 97.0;
    }
}

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    cr_assert(f, "%s", path);
    fputs(text, f);
    fclose(f);
}

Test(calibrate, curve_file_round_trip_and_damage) {
    pd_curve_file cf, back;
    fill_curve_file(&cf, 5);
    char path[1024];
    snprintf(path, sizeof path, "%s/curve.json", tmpdir);
    pd_error err = {0};
    cr_assert_eq(pd_curve_file_write(&cf, path, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_curve_file_read(path, &back, &err), PD_OK, "%s", err.msg);
    cr_assert_str_eq(back.policy, cf.policy);
    cr_assert_str_eq(back.model_file, cf.model_file);
    cr_assert_str_eq(back.fingerprint, cf.fingerprint);
    cr_assert_eq(back.curve.a, cf.curve.a, "numbers come back bit-exact");
    cr_assert_eq(back.curve.b, cf.curve.b);
    cr_assert_eq(back.n_points, cf.n_points);
    for (int i = 0; i < cf.n_points; i++) cr_assert_eq(back.points[i], cf.points[i]);
    cr_assert_eq(back.holdout, cf.holdout);
    cr_assert_eq(back.under_weight, cf.under_weight);
    cr_assert_eq(back.n_texts, cf.n_texts);
    for (int t = 0; t < cf.n_texts; t++) {
        cr_assert_str_eq(back.texts[t].file, cf.texts[t].file);
        cr_assert_eq(back.texts[t].tokens, cf.texts[t].tokens);
        cr_assert_eq(back.texts[t].nll_full, cf.texts[t].nll_full);
        for (int i = 0; i < cf.n_points; i++) cr_assert_eq(back.texts[t].ratio[i], cf.texts[t].ratio[i]);
    }
    pd_curve_file_free(&back);

    /* Damaged files are refused with the reason. */
    char *text = NULL;
    cr_assert_eq(pd_read_file(path, &text, NULL, &err), PD_OK, "%s", err.msg);
    static const struct {
        const char *from, *to, *why;
    } damage[] = {
        {"\"version\": 1", "\"version\": 2", "version"},
        {"\"a\": 0.0123", "\"a\": -0.0123", "\"a\" and \"b\""},
        {"\"fingerprint\": \"0", "\"fingerprint\": \"X", "fingerprint"},
        {"\"policy\": \"knorm:", "\"policy\": \"nosuch:", "policy"},
        {"\"n_texts\": 5", "\"n_texts\": 4", "texts"},
        {"\"object\": \"prefixd.curve\"", "\"object\": \"other\"", "object"},
    };
    char bad[1024];
    snprintf(bad, sizeof bad, "%s/bad.json", tmpdir);
    for (size_t k = 0; k < sizeof damage / sizeof damage[0]; k++) {
        const char *at = strstr(text, damage[k].from);
        cr_assert_not_null(at, "'%s' in:\n%s", damage[k].from, text);
        char *copy = malloc(strlen(text) + 64);
        const size_t head = (size_t)(at - text);
        memcpy(copy, text, head);
        strcpy(copy + head, damage[k].to);
        strcat(copy, at + strlen(damage[k].from));
        write_text(bad, copy);
        free(copy);
        memset(&err, 0, sizeof err);
        cr_assert_neq(pd_curve_file_read(bad, &back, &err), PD_OK, "damage %zu accepted", k);
        cr_assert(strstr(err.msg, damage[k].why) && strstr(err.msg, "bad.json"), "damage %zu: %s", k, err.msg);
    }
    /* A text with a ratio missing. */
    json_error_t je;
    json_t *root = json_load_file(path, 0, &je);
    cr_assert_not_null(root, "%s", je.text);
    json_t *ratios = json_object_get(json_array_get(json_object_get(root, "texts"), 2), "ratios");
    cr_assert_eq(json_array_remove(ratios, 0), 0);
    cr_assert_eq(json_dump_file(root, bad, 0), 0);
    json_decref(root);
    cr_assert_neq(pd_curve_file_read(bad, &back, &err), PD_OK, "a text with 2 ratios for 3 points is accepted");
    cr_assert(strstr(err.msg, "texts[2]"), "%s", err.msg);
    free(text);

    /* The check: the policy apart from retention, and the model's fingerprint. */
    pd_policy_spec spec;
    cr_assert_eq(pd_policy_spec_parse("knorm:retention=0.9", &spec, &err), PD_OK, "%s", err.msg);
    uint8_t fp[PD_SHA256_LEN];
    for (int i = 0; i < PD_SHA256_LEN; i++) {
        unsigned v;
        sscanf(cf.fingerprint + 2 * i, "%2x", &v);
        fp[i] = (uint8_t)v;
    }
    cr_assert_eq(pd_curve_file_check(&cf, &spec, fp, &err), PD_OK, "%s", err.msg);
    fp[3] ^= 1;
    cr_assert_eq(pd_curve_file_check(&cf, &spec, fp, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "model m.gguf"), "%s", err.msg);
    fp[3] ^= 1;
    cr_assert_eq(pd_policy_spec_parse("knorm:sink=4", &spec, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_curve_file_check(&cf, &spec, fp, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "fitted for policy knorm:") && strstr(err.msg, "sink=4"), "%s", err.msg);
    pd_curve_file_free(&cf);
}

/* ---- measurements on the real model ---------------------------------------------- */

static const char *const stories[] = {
    "Once upon a time, there was a little girl named Lily. She had a red ball and a big dog named Max. Every day, "
    "Lily and Max went to the park to play. They ran on the grass and they jumped in the sun. One day, Lily saw a "
    "little bird in a tree. The bird was sad because it could not fly. Lily said, \"Do not be sad, little bird. I "
    "will help you.\" She gave the bird some water and a bit of bread. The bird ate the bread and felt better.",
    "Once upon a time, there was a boy named Tom. Tom liked to build things with his blocks. He made a tall tower "
    "in his room. His sister Sue came in and wanted to play. Tom said, \"Be careful, the tower is very tall.\" Sue "
    "touched the tower and it fell down. Tom was sad, but Sue said sorry. They built a new tower together, and it "
    "was even bigger than before. Mom came and smiled at them. She gave them cookies and milk.",
    "Once upon a time, in a small house, there lived a cat named Tiny. Tiny liked to sleep in the sun by the "
    "window. One morning, Tiny heard a noise in the garden. She jumped down and ran outside. There was a little "
    "mouse near the flowers. The mouse was scared, but Tiny only wanted to play. They ran around the garden all "
    "day. When the sun went down, the mouse went home and Tiny went back to her warm spot by the window.",
};
#define N_TEXTS ((int)(sizeof stories / sizeof stories[0]))

static pd_model *load_stories(char *path, size_t cap) {
    TH_REQUIRE_SHARED();
    cr_assert(th_shared_file("tinystories/stories260K.gguf", path, cap));
    pd_model *m = NULL;
    pd_error err = {0};
    pd_model_params p = {.n_threads = 2};
    cr_assert_eq(pd_model_load(path, &p, &m, &err), PD_OK, "%s", err.msg);
    return m;
}

static void tokens_of(pd_model *m, const char *text, pd_token **ids, size_t *n) {
    pd_error err = {0};
    pd_tokenize_opts o = {.add_special = true};
    cr_assert_eq(pd_tokenize(pd_model_tokenizer(m), text, strlen(text), o, ids, n, &err), PD_OK, "%s", err.msg);
}

/* NLL of the continuation after a prefix compressed at retention r (1 = the full prefix). */
static double naive_nll(pd_model *m, const pd_token *ids, int64_t np, int64_t nc, const pd_policy_spec *spec, double r) {
    pd_error err = {0};
    pd_kv_prefix *p = NULL;
    if (r >= 1) {
        pd_seq *s = NULL;
        cr_assert_eq(pd_seq_create(m, 0, &s, &err), PD_OK, "%s", err.msg);
        cr_assert_eq(pd_prefill(m, s, ids, np, NULL, NULL, &err), PD_OK, "%s", err.msg);
        cr_assert_eq(pd_seq_to_prefix(s, &p, &err), PD_OK, "%s", err.msg);
        pd_seq_free(s);
    } else {
        pd_policy_spec sp = *spec;
        pd_policy_spec_set_retention(&sp, r);
        cr_assert_eq(pd_compress_prefix(m, ids, np, &sp, NULL, &p, NULL, &err), PD_OK, "%s", err.msg);
    }
    double nll = 0;
    cr_assert_eq(pd_nll(m, p, NULL, 0, ids + np, nc, &nll, &err), PD_OK, "%s", err.msg);
    pd_kv_prefix_free(p);
    return nll;
}

Test(calibrate, measure_text_is_the_continuation_ratio) {
    char path[1024];
    pd_model *m = load_stories(path, sizeof path);
    pd_policy_spec spec;
    pd_error err = {0};
    cr_assert_eq(pd_policy_spec_parse("snapkv", &spec, &err), PD_OK, "%s", err.msg);
    pd_calib_opts o;
    pd_calib_opts_default(&o);
    o.holdout = 0.25;
    pd_token *ids = NULL;
    size_t n = 0;
    tokens_of(m, stories[0], &ids, &n);
    double ratio[PD_CALIB_MAX_POINTS], nll_full = 0;
    cr_assert_eq(pd_calib_measure_text(m, ids, (int64_t)n, &spec, &o, ratio, &nll_full, &err), PD_OK, "%s", err.msg);
    const int64_t nc = (int64_t)llround(0.25 * (double)n), np = (int64_t)n - nc;
    const double want_full = naive_nll(m, ids, np, nc, &spec, 1);
    cr_assert_float_eq(nll_full, want_full, 1e-12 * want_full);
    for (int i = 0; i < o.n_points; i++) {
        const double want = naive_nll(m, ids, np, nc, &spec, o.points[i]) / want_full;
        cr_assert_float_eq(ratio[i], want, 1e-12, "point %g: %.9f vs %.9f", o.points[i], ratio[i], want);
    }
    /* Too short to split: the message says what is needed. */
    cr_assert_eq(pd_calib_measure_text(m, ids, 30, &spec, &o, ratio, NULL, &err), PD_EINVAL);
    cr_assert(strstr(err.msg, "at least"), "%s", err.msg);
    free(ids);
    pd_model_free(m);
}

/* ---- prefixctl calibrate / compress --curve --------------------------------------------- */

static const char *prefixctl(void) {
    const char *p = getenv("PD_PREFIXCTL");
    cr_assert(p, "PD_PREFIXCTL is not set");
    return p;
}

static double double_after(const char *out, const char *label) {
    const char *p = strstr(out, label);
    cr_assert(p, "'%s' not in:\n%s", label, out);
    return strtod(p + strlen(label), NULL);
}

/* The calibration set: the stories under names that sort differently from
 * their creation order, a hidden file and a folder that are not texts. */
static void write_set(char *dir, size_t cap) {
    snprintf(dir, cap, "%s/set", tmpdir);
    cr_assert_eq(mkdir(dir, 0755), 0);
    static const char *const names[] = {"c.txt", "a.txt", "b.txt"};
    char path[1200];
    for (int t = 0; t < N_TEXTS; t++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[t]);
        write_text(path, stories[t]);
    }
    snprintf(path, sizeof path, "%s/.hidden", dir);
    write_text(path, "not a calibration text");
    snprintf(path, sizeof path, "%s/sub", dir);
    cr_assert_eq(mkdir(path, 0755), 0);
}

/* ---- progress (pd_calib_opts.progress) --------------------------------------------- */

#define MAX_CALLS 32

typedef struct calls {
    int n, done[MAX_CALLS], total[MAX_CALLS];
    int stop_at; /* > 0: fail the call with this done */
} calls;

static int record(void *ctx, int done, int total, pd_error *err) {
    calls *c = ctx;
    cr_assert_lt(c->n, MAX_CALLS);
    c->done[c->n] = done, c->total[c->n] = total;
    c->n++;
    if (done == c->stop_at) return pd_errorf(err, PD_EIO, "stopped by the test at %d", done);
    return PD_OK;
}

/* What the callback contract promises, call by call: done counts 1, 2, ...,
 * total never falls and is reached only by the last call, so done / total
 * (what a job shows) is strictly between 0 and 1 until the end and never
 * goes back. */
static void check_sequence(const calls *c, int min_total) {
    cr_assert_gt(c->n, 0, "no progress was reported");
    double last_frac = 0;
    for (int i = 0; i < c->n; i++) {
        cr_assert_eq(c->done[i], i + 1, "call %d says done %d", i, c->done[i]);
        cr_assert_leq(c->done[i], c->total[i]);
        if (i) cr_assert_geq(c->total[i], c->total[i - 1], "the plan shrank at call %d", i);
        const double frac = (double)c->done[i] / c->total[i];
        cr_assert_geq(frac, last_frac, "progress went back at call %d", i);
        if (i < c->n - 1) cr_assert(frac > 0 && frac < 1, "call %d: %d of %d before the end", i, c->done[i], c->total[i]);
        last_frac = frac;
    }
    cr_assert_eq(c->done[c->n - 1], c->total[c->n - 1], "the last call ends the plan");
    cr_assert_geq(c->total[c->n - 1], min_total);
}

Test(calibrate, progress_reports_every_measurement) {
    char path[1024];
    pd_model *m = load_stories(path, sizeof path);
    pd_policy_spec spec;
    pd_error err = {0};
    cr_assert_eq(pd_policy_spec_parse("snapkv", &spec, &err), PD_OK, "%s", err.msg);
    char text[4096];
    snprintf(text, sizeof text, "%s %s %s", stories[0], stories[1], stories[2]);
    pd_token *ids = NULL;
    size_t n = 0;
    tokens_of(m, text, &ids, &n);
    /* A loose budget (one check) and a tighter one (on this text and model
     * its first check misses: one more measurement, so the plan grows). */
    const double taus[] = {1.5, 1.01};
    for (size_t k = 0; k < sizeof taus / sizeof taus[0]; k++) {
        pd_calib_opts o;
        pd_calib_opts_default(&o);
        o.tau = taus[k];
        calls c = {0};
        o.progress = record;
        o.progress_ctx = &c;
        pd_calib_result r;
        cr_assert_eq(pd_calibrate(m, ids, (int64_t)n, &spec, NULL, &o, &r, NULL, &err), PD_OK, "%s", err.msg);
        check_sequence(&c, 1 + o.n_points);
        /* One call per measurement: the full prefix, the points, and the
         * checks (every point added to the fit was a check, plus the
         * final one unless the choice was 1, which needs none). */
        const int checks = r.n_points - o.n_points + (r.chosen < 1 ? 1 : 0);
        cr_assert_eq(c.n, 1 + o.n_points + checks, "tau %g: %d calls, %d checks", taus[k], c.n, checks);
        /* The same calibration without a callback chooses the same. */
        pd_calib_opts plain = o;
        plain.progress = NULL;
        pd_calib_result r2;
        cr_assert_eq(pd_calibrate(m, ids, (int64_t)n, &spec, NULL, &plain, &r2, NULL, &err), PD_OK, "%s", err.msg);
        cr_assert_eq(r2.chosen, r.chosen);
    }
    /* A failing callback stops the calibration with its error. */
    pd_calib_opts o;
    pd_calib_opts_default(&o);
    calls c = {.stop_at = 2};
    o.progress = record;
    o.progress_ctx = &c;
    cr_assert_eq(pd_calibrate(m, ids, (int64_t)n, &spec, NULL, &o, NULL, NULL, &err), PD_EIO);
    cr_assert(strstr(err.msg, "stopped by the test at 2"), "%s", err.msg);
    cr_assert_eq(c.n, 2, "no measurement after the stop");
    /* Offline measurement of one text: 1 + n_points calls. */
    calls t = {0};
    o.progress_ctx = &t;
    o.holdout = 0.25;
    double ratio[PD_CALIB_MAX_POINTS];
    cr_assert_eq(pd_calib_measure_text(m, ids, (int64_t)n, &spec, &o, ratio, NULL, &err), PD_OK, "%s", err.msg);
    check_sequence(&t, 1 + o.n_points);
    cr_assert_eq(t.n, 1 + o.n_points);
    free(ids);
    pd_model_free(m);
}

Test(calibrate, prefixctl_calibrate_then_compress_with_the_curve) {
    char model[1024], set[1024], curve[1200], text[1200];
    pd_model *m = load_stories(model, sizeof model);
    write_set(set, sizeof set);
    snprintf(curve, sizeof curve, "%s/curve.json", tmpdir);
    char *out = NULL;
    cr_assert_eq(th_runf(&out, "%s calibrate --model %s --policy snapkv:retention=0.3 --set %s --out %s "
                         "--points 0.5,0.25,0.1 --threads 2 2>%s/cal.err; st=$?; [ $st = 0 ] || cat %s/cal.err; exit $st",
                         prefixctl(), model, set,
                         curve, tmpdir, tmpdir),
                 0, "%s", out);
    free(out);
    /* stderr is a file, not a terminal: one line per phase. */
    cr_assert_eq(th_runf(&out, "cat %s/cal.err", tmpdir), 0);
    cr_assert_str_eq(out, "loading model\nmeasuring text 1 of 3\nmeasuring text 2 of 3\nmeasuring text 3 of 3\n"
                          "fitting the curve\n");
    free(out);
    pd_curve_file cf;
    pd_error err = {0};
    cr_assert_eq(pd_curve_file_read(curve, &cf, &err), PD_OK, "%s", err.msg);
    /* What was measured, text by text (a.txt = stories[1], b.txt = stories[2], c.txt = stories[0]). */
    static const int order[] = {1, 2, 0};
    cr_assert_eq(cf.n_texts, N_TEXTS, "the hidden file and the folder are not texts");
    cr_assert_eq(cf.n_points, 3);
    cr_assert_eq(cf.points[2], 0.1);
    pd_policy_spec spec;
    cr_assert_eq(pd_policy_spec_parse("snapkv", &spec, &err), PD_OK, "%s", err.msg);
    pd_calib_opts o;
    pd_calib_opts_default(&o);
    o.n_points = 3;
    memcpy(o.points, cf.points, sizeof cf.points);
    double all[N_TEXTS * 3];
    for (int t = 0; t < N_TEXTS; t++) {
        static const char *const sorted[] = {"a.txt", "b.txt", "c.txt"};
        cr_assert_str_eq(cf.texts[t].file, sorted[t], "sorted by name");
        pd_token *ids = NULL;
        size_t n = 0;
        tokens_of(m, stories[order[t]], &ids, &n);
        cr_assert_eq(cf.texts[t].tokens, (int64_t)n);
        double ratio[PD_CALIB_MAX_POINTS];
        cr_assert_eq(pd_calib_measure_text(m, ids, (int64_t)n, &spec, &o, ratio, NULL, &err), PD_OK, "%s", err.msg);
        for (int i = 0; i < 3; i++) {
            cr_assert_float_eq(cf.texts[t].ratio[i], ratio[i], 1e-9, "%s at %g", cf.texts[t].file, cf.points[i]);
            all[t * 3 + i] = cf.texts[t].ratio[i];
        }
        free(ids);
    }
    /* The curve is the pooled fit of those ratios. */
    pd_curve want;
    cr_assert_eq(pd_curve_fit_set(cf.points, 3, all, N_TEXTS, 4.0, &want, &err), PD_OK, "%s", err.msg);
    cr_assert_float_eq(cf.curve.a, want.a, 1e-12 * want.a);
    cr_assert_float_eq(cf.curve.b, want.b, 1e-12 * want.b);
    /* Policy and model identity. */
    char pol[PD_POLICY_SPEC_MAX], hex[2 * PD_SHA256_LEN + 1];
    pd_curve_policy_print(&spec, pol, sizeof pol);
    cr_assert_str_eq(cf.policy, pol);
    uint8_t fp[PD_SHA256_LEN];
    pd_model_fingerprint(m, fp);
    pd_hex(fp, PD_SHA256_LEN, hex);
    cr_assert_str_eq(cf.fingerprint, hex);
    cr_assert_str_eq(cf.model_file, "stories260K.gguf");

    /* compress --curve: the zero-shot choice, no probe. */
    snprintf(text, sizeof text, "%s/prefix.txt", tmpdir);
    write_text(text, stories[0]);
    cr_assert_eq(th_runf(&out, "%s compress --model %s --policy snapkv --quality 1.05 --curve %s --text %s "
                         "--threads 2 2>&1", prefixctl(), model, curve, text),
                 0, "%s", out);
    const double chosen = pd_curve_choose(cf.curve, 1.05, 0.05);
    cr_assert_float_eq(double_after(out, "chosen retention "), chosen, 1e-9, "%s", out);
    cr_assert_float_eq(double_after(out, ",retention="), chosen, 1e-9, "%s", out);
    cr_assert_null(strstr(out, "calibration: tau"), "no probe calibration ran:\n%s", out);
    free(out);

    /* Another policy (retention aside): refused, saying which. */
    cr_assert_eq(th_runf(&out, "%s compress --model %s --policy snapkv:window=32 --quality 1.05 --curve %s --text %s "
                         "2>&1", prefixctl(), model, curve, text),
                 1, "%s", out);
    cr_assert(strstr(out, "fitted for policy snapkv:") && strstr(out, "window=32"), "%s", out);
    free(out);
    /* A retention in the spec is not another policy. */
    cr_assert_eq(th_runf(&out, "%s compress --model %s --policy snapkv:retention=0.9 --quality 1.05 --curve %s "
                         "--text %s 2>&1", prefixctl(), model, curve, text),
                 0, "%s", out);
    free(out);
    /* Another model. */
    char other[1200];
    snprintf(other, sizeof other, "%s/other.gguf", tmpdir);
    pd_testmodel_opts to;
    cr_assert_eq(pd_testmodel_preset("tiny", &to, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(pd_testmodel_write(&to, other, NULL, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(th_runf(&out, "%s compress --model %s --policy snapkv --quality 1.05 --curve %s --text %s 2>&1",
                         prefixctl(), other, curve, text),
                 1, "%s", out);
    cr_assert(strstr(out, "fitted on model stories260K.gguf"), "%s", out);
    free(out);
    /* Usage errors. */
    cr_assert_eq(th_runf(&out, "%s compress --model %s --policy snapkv --curve %s --text %s 2>&1", prefixctl(), model,
                         curve, text),
                 2, "%s", out);
    cr_assert(strstr(out, "give --quality"), "%s", out);
    free(out);
    cr_assert_eq(th_runf(&out, "%s calibrate --model %s --policy snapkv --set %s/nosuch --out %s 2>&1", prefixctl(),
                         model, tmpdir, curve),
                 1, "%s", out);
    cr_assert(strstr(out, "nosuch"), "%s", out);
    free(out);
    cr_assert_eq(th_runf(&out, "%s calibrate --model %s --policy snapkv --set %s --out %s --points 0.5,2 2>&1",
                         prefixctl(), model, set, curve),
                 2, "%s", out);
    cr_assert(strstr(out, "--points"), "%s", out);
    free(out);
    cr_assert_eq(th_runf(&out, "%s calibrate --model %s --policy snapkv:fair=1 --set %s --out %s 2>&1", prefixctl(),
                         model, set, curve),
                 2, "%s", out);
    cr_assert(strstr(out, "fair=0"), "%s", out);
    free(out);
    pd_curve_file_free(&cf);
    pd_model_free(m);
}

/* ---- the admin API ------------------------------------------------------------------ */

static int req(const char *method, const char *path, const char *json, char **out) {
    char body_path[1200];
    snprintf(body_path, sizeof body_path, "%s/body.json", tmpdir);
    return th_http(port, method, path, json, TOKEN, body_path, out);
}

Test(calibrate, admin_registration_with_a_curve_is_zero_shot) {
    if (system("curl --version >/dev/null 2>&1") != 0) cr_skip_test("curl is not installed");
    char model[1024];
    pd_model *m = load_stories(model, sizeof model);
    uint8_t fp[PD_SHA256_LEN];
    char hex[2 * PD_SHA256_LEN + 1], pol[PD_POLICY_SPEC_MAX];
    pd_model_fingerprint(m, fp);
    pd_hex(fp, PD_SHA256_LEN, hex);
    pd_policy_spec spec;
    pd_error err = {0};
    cr_assert_eq(pd_policy_spec_parse("knorm", &spec, &err), PD_OK, "%s", err.msg);
    pd_curve_policy_print(&spec, pol, sizeof pol);
    pd_model_free(m);

    char args[4096], log[1200];
    snprintf(args, sizeof args, "--set model.path=%s --set cache.path=%s/store --set cache.map_size_mb=64 "
             "--set model.n_threads=2 --set compression.min_prefix_tokens=8 --set server.model_names=test "
             "--set admin.token=" TOKEN, model, tmpdir);
    snprintf(log, sizeof log, "%s/prefixd.log", tmpdir);
    daemon_pid = th_daemon_start(args, log, &port);

    const pd_curve c = {.a = 0.004, .b = 1.2};
    char body[8192], *out = NULL;
    /* The curve file's object as it is (extra keys ignored). */
    snprintf(body, sizeof body, "{\"text\":\"%s\",\"policy\":\"knorm\",\"quality\":1.05,\"wait\":true,"
             "\"curve\":{\"object\":\"prefixd.curve\",\"a\":%.17g,\"b\":%.17g,\"policy\":\"%s\","
             "\"model\":{\"file\":\"stories260K.gguf\",\"fingerprint\":\"%s\"},\"points\":[0.5,0.25]}}",
             stories[2], c.a, c.b, pol, hex);
    cr_assert_eq(req("POST", "/admin/v1/prefixes", body, &out), 201, "%s", out);
    json_t *j = th_json_parse(out);
    free(out);
    const double chosen = pd_curve_choose(c, 1.05, 0.05);
    cr_assert_float_eq(json_real_value(json_object_get(j, "chosen_retention")), chosen, 1e-12);
    json_t *q = json_object_get(json_object_get(j, "prefix"), "quality");
    cr_assert_float_eq(json_real_value(json_object_get(q, "tau")), 1.05, 1e-12);
    cr_assert(json_is_null(json_object_get(q, "nll_full")), "no probe was measured");
    char want[64];
    snprintf(want, sizeof want, "retention=%g,", chosen);
    const char *stored = json_string_value(json_object_get(json_object_get(j, "prefix"), "policy"));
    cr_assert(stored && strstr(stored, want), "%s lacks %s", stored, want);
    json_decref(j);

    /* Refusals, each naming its field. */
    static const struct {
        const char *curve, *extra, *why;
    } bad[] = {
        {"{\"a\":0.004,\"b\":1.2,\"policy\":\"knorm:sink=4\"}", ",\"quality\":1.05", "fitted for policy"},
        {"{\"a\":0.004,\"b\":1.2,\"policy\":\"knorm\",\"model\":{\"fingerprint\":\"00\"}}", ",\"quality\":1.05",
         "another model"},
        {"{\"a\":0.004,\"b\":1.2,\"policy\":\"knorm\"}", "", "send 'quality' too"},
        {"{\"a\":0.004,\"b\":1.2,\"policy\":\"knorm\"}", ",\"retention\":0.5", "not both"},
        {"{\"a\":-1,\"b\":1.2,\"policy\":\"knorm\"}", ",\"quality\":1.05", "positive numbers"},
        {"{\"a\":0.004,\"b\":1.2}", ",\"quality\":1.05", "curve.policy"},
        {"\"curve.json\"", ",\"quality\":1.05", "'curve' must be an object"},
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        snprintf(body, sizeof body, "{\"text\":\"%s\",\"policy\":\"knorm\",\"wait\":true,\"curve\":%s%s}", stories[2],
                 bad[k].curve, bad[k].extra);
        cr_assert_eq(req("POST", "/admin/v1/prefixes", body, &out), 400, "case %zu: %s", k, out);
        cr_assert(strstr(out, bad[k].why), "case %zu: '%s' not in %s", k, bad[k].why, out);
        free(out);
    }
}
