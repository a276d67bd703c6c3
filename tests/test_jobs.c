/* Precompression jobs on the real stories260K model and a real LMDB store:
 * what a job stores equals what pd_compress_prefix gives and what prefixctl
 * would key it under, repeats are recognised, calibration, layouts, errors,
 * progress, the bounded job table, metrics and shutdown with queued jobs. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache/cache.h"
#include "daemon/daemon.h"
#include "engine/engine.h"
#include "helpers.h"
#include "policies/policies.h"

#define WAIT_S 600.0 /* a bound for a hung worker, not a timing assertion */

static char *tmpdir;
static char model_path[1024];
static pd_store *store;

static void setup(void) {
    if (!th_shared_file("tinystories/stories260K.gguf", model_path, sizeof model_path)) return;
    tmpdir = th_mkdtemp();
    cr_assert_not_null(tmpdir);
    pd_store_opts so;
    pd_store_opts_default(&so);
    so.dir = tmpdir;
    so.map_size = 256ull << 20;
    pd_error err = {0};
    cr_assert_eq(pd_store_open(&so, &store, &err), PD_OK, "%s", err.msg);
}

static void teardown(void) {
    pd_store_close(store);
    store = NULL;
    if (tmpdir) {
        th_rmtree(tmpdir);
        free(tmpdir);
        tmpdir = NULL;
    }
}

TestSuite(jobs, .init = setup, .fini = teardown, .timeout = 280);

#define REQUIRE_MODEL()                                                                           \
    do {                                                                                          \
        TH_REQUIRE_SHARED();                                                                      \
        if (!store) cr_skip_test("tinystories/stories260K.gguf is absent; skipping");             \
    } while (0)

/* Seeded token ids in [3, 512), BOS first. */
static pd_token *tokens_of(int64_t n, uint64_t seed) {
    pd_token *t = malloc(sizeof *t * (size_t)n);
    cr_assert(t);
    uint64_t x = seed * 6364136223846793005ull + 1442695040888963407ull;
    for (int64_t i = 0; i < n; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        t[i] = 3 + (pd_token)((x >> 33) % 509u);
    }
    t[0] = 1;
    return t;
}

static pd_jobs *start_min(int max_jobs, bool paused, pd_metrics *metrics, int64_t min_compress_tokens) {
    pd_jobs_opts o;
    pd_jobs_opts_default(&o);
    o.model_path = model_path;
    o.n_threads = 1;
    o.store = store;
    o.max_jobs = max_jobs;
    o.start_paused = paused;
    o.metrics = metrics;
    o.min_compress_tokens = min_compress_tokens;
    pd_jobs *j = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_jobs_create(&o, &j, &err), PD_OK, "%s", err.msg);
    return j;
}

static pd_jobs *start(int max_jobs, bool paused, pd_metrics *metrics) {
    return start_min(max_jobs, paused, metrics, 0);
}

static uint64_t submit(pd_jobs *j, const pd_job_spec *s) {
    uint64_t id = 0;
    pd_error err = {0};
    cr_assert_eq(pd_jobs_submit(j, s, &id, &err), PD_OK, "%s", err.msg);
    cr_assert_gt(id, 0);
    return id;
}

static pd_job_status wait_done(pd_jobs *j, uint64_t id) {
    pd_job_status st;
    pd_error err = {0};
    cr_assert_eq(pd_jobs_wait(j, id, WAIT_S, &st, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(st.id, id);
    cr_assert(st.state == PD_JOB_DONE || st.state == PD_JOB_FAILED, "job %llu still %s", (unsigned long long)id,
              pd_job_state_name(st.state));
    return st;
}

static pd_job_status wait_ok(pd_jobs *j, uint64_t id) {
    pd_job_status st = wait_done(j, id);
    cr_assert_eq(st.state, PD_JOB_DONE, "job failed: %s", st.error);
    return st;
}

static void canonical(const char *text, double retention, char *buf, size_t cap) {
    pd_policy_spec s;
    pd_error err = {0};
    cr_assert_eq(pd_policy_spec_parse(text, &s, &err), PD_OK, "%s", err.msg);
    if (retention > 0) pd_policy_spec_set_retention(&s, retention);
    cr_assert_lt(pd_policy_spec_print(&s, buf, cap), cap);
}

static pd_model *load_model(void) {
    pd_model *m = NULL;
    pd_error err = {0};
    pd_model_params p = {.n_threads = 1};
    cr_assert_eq(pd_model_load(model_path, &p, &m, &err), PD_OK, "%s", err.msg);
    return m;
}

/* A retention job stores what pd_compress_prefix computes, under the id
 * prefixctl would give it (canonical spec, no layout), readable back. */
Test(jobs, retention_job_stores_the_compressed_prefix) {
    REQUIRE_MODEL();
    const int64_t n = 300;
    pd_token *t = tokens_of(n, 1);
    pd_jobs *j = start(8, false, NULL);
    pd_job_spec js = {.tokens = t, .n = n, .policy = "snapkv", .retention = 0.5, .ns = "tenant-a"};
    const uint64_t id = submit(j, &js);
    pd_job_status st = wait_ok(j, id);
    cr_assert_eq(st.progress, 1.0);
    cr_assert_str_eq(st.phase, "done");
    cr_assert_not(st.existed);
    cr_assert_eq(st.chosen_retention, 0.5);
    cr_assert_gt(st.created_at, 0);
    cr_assert_geq(st.started_at, st.created_at);
    cr_assert_geq(st.finished_at, st.started_at);

    char spec[PD_POLICY_SPEC_MAX];
    canonical("snapkv", 0.5, spec, sizeof spec);
    cr_assert_str_eq(st.info.spec, spec);
    cr_assert_str_eq(st.info.ns, "tenant-a");
    cr_assert_eq(st.info.n_tokens, n);
    cr_assert_eq(st.info.quality.retention, 0.5);
    cr_assert(isnan(st.info.quality.tau) && isnan(st.info.quality.nll_full) && isnan(st.info.quality.nll_ratio));

    /* The reference: the plain API on our own model instance. */
    pd_model *m = load_model();
    pd_policy_spec ps;
    pd_error err = {0};
    cr_assert_eq(pd_policy_spec_parse(spec, &ps, &err), PD_OK, "%s", err.msg);
    pd_kv_prefix *p = NULL;
    pd_compress_stats cs = {0};
    cr_assert_eq(pd_compress_prefix(m, t, n, &ps, NULL, &p, &cs, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(st.info.kept_rows, cs.kept_total);
    cr_assert_lt(cs.kept_total, n * cs.n_layer * cs.n_head_kv);

    uint8_t fp[PD_SHA256_LEN];
    pd_model_fingerprint(m, fp);
    cr_assert_eq(memcmp(fp, st.info.fingerprint, sizeof fp), 0);
    pd_prefix_id want;
    cr_assert_eq(pd_prefix_id_compute(fp, t, n, spec, "tenant-a", &want), PD_OK);
    cr_assert_eq(memcmp(&want, &st.info.id, sizeof want), 0, "the id is prefixctl's key convention");

    pd_prefix_ref *ref = NULL;
    cr_assert_eq(pd_store_get(store, &st.info.id, &ref, &err), PD_OK, "%s", err.msg);
    cr_assert_str_eq(pd_prefix_ref_info(ref)->spec, spec);
    cr_assert_eq(pd_prefix_ref_info(ref)->kept_rows, cs.kept_total);
    cr_assert_eq(memcmp(pd_prefix_ref_tokens(ref), t, sizeof *t * (size_t)n), 0);
    pd_prefix_ref_release(ref);

    pd_kv_prefix_free(p);
    pd_compress_stats_free(&cs);
    pd_model_free(m);
    pd_jobs_free(j);
    free(t);
}

/* compression.min_prefix_tokens: a prefix shorter than it is stored
 * exactly (retention 1 in its key, every token kept, no calibration);
 * one at the bound is compressed as asked. */
Test(jobs, prefixes_below_min_compress_tokens_are_stored_exactly) {
    REQUIRE_MODEL();
    pd_token *t = tokens_of(120, 3);
    pd_jobs *j = start_min(8, false, NULL, 100);
    char spec[PD_POLICY_SPEC_MAX];
    pd_job_status st = wait_ok(j, submit(j, &(pd_job_spec){.tokens = t, .n = 99, .policy = "snapkv", .retention = 0.25}));
    cr_assert_eq(st.chosen_retention, 1.0);
    canonical("snapkv", 1.0, spec, sizeof spec);
    cr_assert_str_eq(st.info.spec, spec);
    cr_assert_eq(st.info.n_tokens, 99);
    st = wait_ok(j, submit(j, &(pd_job_spec){.tokens = t, .n = 99, .policy = "snapkv", .quality = 1.05}));
    cr_assert_eq(st.chosen_retention, 1.0, "no calibration below the bound");
    cr_assert(isnan(st.info.quality.nll_full));
    st = wait_ok(j, submit(j, &(pd_job_spec){.tokens = t, .n = 100, .policy = "snapkv", .retention = 0.25}));
    cr_assert_eq(st.chosen_retention, 0.25);
    canonical("snapkv", 0.25, spec, sizeof spec);
    cr_assert_str_eq(st.info.spec, spec);
    pd_jobs_free(j);
    free(t);
}

Test(jobs, the_same_job_twice_reports_existed) {
    REQUIRE_MODEL();
    const int64_t n = 120;
    pd_token *t = tokens_of(n, 2);
    pd_jobs *j = start(8, false, NULL);
    pd_job_spec js = {.tokens = t, .n = n, .policy = "knorm", .retention = 0.25, .pin = true};
    pd_job_status a = wait_ok(j, submit(j, &js));
    pd_job_status b = wait_ok(j, submit(j, &js));
    cr_assert_not(a.existed);
    cr_assert(b.existed);
    cr_assert_neq(a.id, b.id);
    cr_assert_eq(memcmp(&a.info.id, &b.info.id, sizeof a.info.id), 0);
    cr_assert_eq(a.info.kept_rows, b.info.kept_rows);
    cr_assert(b.info.pinned);
    pd_store_stats ss;
    pd_error err = {0};
    cr_assert_eq(pd_store_stats_get(store, &ss, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(ss.prefixes, 1);
    cr_assert_eq(ss.pinned, 1);
    pd_jobs_free(j);
    free(t);
}

/* Calibration picks a retention in [min_retention, 1], puts it in the key
 * and records the quality numbers. Progress is polled the whole way: it
 * never goes back, the phases come in order, and it ends at 1. */
Test(jobs, quality_job_calibrates_with_monotone_progress) {
    REQUIRE_MODEL();
    const int64_t n = 300;
    pd_token *t = tokens_of(n, 3);
    pd_jobs *j = start(8, false, NULL);
    pd_job_spec js = {.tokens = t, .n = n, .policy = "snapkv", .quality = 1.1};
    const uint64_t id = submit(j, &js);
    static const char *const order[] = {"queued", "loading model", "calibrating", "compressing", "storing", "done"};
    int phase_at = 0;
    double last = 0;
    pd_job_status st;
    pd_error err = {0};
    for (int polls = 0;; polls++) {
        cr_assert_lt(polls, 10000000, "the job never finished");
        cr_assert_eq(pd_jobs_wait(j, id, 0.002, &st, &err), PD_OK, "%s", err.msg);
        cr_assert_geq(st.progress, last, "progress went back from %g to %g", last, st.progress);
        cr_assert(st.progress >= 0 && st.progress <= 1);
        last = st.progress;
        int k = phase_at;
        while (k < 6 && strcmp(order[k], st.phase) != 0) k++;
        cr_assert_lt(k, 6, "phase '%s' out of order (after '%s')", st.phase, order[phase_at]);
        phase_at = k;
        /* Calibration fills [0, 0.6] (one step per measurement, see
         * test_calibrate's progress test); compression starts at 0.6. */
        if (strcmp(st.phase, "calibrating") == 0) cr_assert_leq(st.progress, 0.6, "calibrating at %g", st.progress);
        if (strcmp(st.phase, "compressing") == 0) cr_assert_geq(st.progress, 0.6, "compressing at %g", st.progress);
        if (st.state == PD_JOB_DONE || st.state == PD_JOB_FAILED) break;
    }
    cr_assert_eq(st.state, PD_JOB_DONE, "%s", st.error);
    cr_assert_eq(st.progress, 1.0);
    cr_assert_str_eq(st.phase, "done");

    pd_calib_opts co;
    pd_calib_opts_default(&co);
    cr_assert(st.chosen_retention >= co.min_retention && st.chosen_retention <= 1, "chosen %g",
              st.chosen_retention);
    cr_assert_eq(st.info.quality.retention, st.chosen_retention);
    cr_assert_eq(st.info.quality.tau, 1.1);
    cr_assert(isfinite(st.info.quality.nll_full) && st.info.quality.nll_full > 0);
    cr_assert(isfinite(st.info.quality.nll_ratio) && st.info.quality.nll_ratio > 0);
    cr_assert_leq(st.info.quality.nll_ratio, 1.1);
    char spec[PD_POLICY_SPEC_MAX];
    canonical("snapkv", st.chosen_retention, spec, sizeof spec);
    cr_assert_str_eq(st.info.spec, spec);
    pd_prefix_info info;
    cr_assert_eq(pd_store_info(store, &st.info.id, &info, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(info.quality.tau, 1.1);
    pd_jobs_free(j);
    free(t);
}

/* A layout goes into the key as "spec|layout", like prefixctl --spans;
 * the same tokens without it get another id. The layout is copied: the
 * caller's arrays may change after submit. */
Test(jobs, layout_job_keys_spec_and_layout) {
    REQUIRE_MODEL();
    const int64_t n = 200;
    pd_token *t = tokens_of(n, 4);
    pd_span spans[2] = {{.name = "system", .start = 0, .end = 80}, {.name = "docs", .start = 80, .end = 200}};
    pd_range keep[1] = {{.start = 5, .end = 9}};
    pd_layout lay = {.spans = spans, .n_spans = 2, .whitelist = keep, .n_whitelist = 1};
    char ltext[256];
    cr_assert_lt(pd_layout_print(&lay, ltext, sizeof ltext), sizeof ltext);

    pd_jobs *j = start(8, true, NULL); /* paused: change the caller's layout before the job runs */
    pd_job_spec fair = {.tokens = t, .n = n, .layout = &lay, .policy = "snapkv:fair=1", .retention = 0.3};
    const uint64_t id_fair = submit(j, &fair);
    pd_job_spec with = {.tokens = t, .n = n, .layout = &lay, .policy = "snapkv", .retention = 0.3};
    const uint64_t id_with = submit(j, &with);
    pd_job_spec without = {.tokens = t, .n = n, .policy = "snapkv", .retention = 0.3};
    const uint64_t id_without = submit(j, &without);
    spans[0].end = 1, spans[1].start = 1;
    strcpy(spans[0].name, "x");
    pd_jobs_set_paused(j, false);

    pd_job_status a = wait_ok(j, id_fair), b = wait_ok(j, id_with), c = wait_ok(j, id_without);
    char spec[PD_POLICY_SPEC_MAX], key[PD_PREFIX_SPEC_MAX];
    canonical("snapkv:fair=1", 0.3, spec, sizeof spec);
    snprintf(key, sizeof key, "%s|%s", spec, ltext);
    cr_assert_str_eq(a.info.spec, key);
    canonical("snapkv", 0.3, spec, sizeof spec);
    snprintf(key, sizeof key, "%s|%s", spec, ltext);
    cr_assert_str_eq(b.info.spec, key);
    cr_assert_str_eq(c.info.spec, spec);
    cr_assert_neq(memcmp(&a.info.id, &b.info.id, sizeof a.info.id), 0);
    cr_assert_neq(memcmp(&b.info.id, &c.info.id, sizeof b.info.id), 0, "with and without layout differ");

    /* The stored fair prefix is what the plain API gives with the original layout. */
    spans[0].end = 80, spans[1].start = 80;
    strcpy(spans[0].name, "system");
    pd_model *m = load_model();
    pd_policy_spec ps;
    pd_error err = {0};
    canonical("snapkv:fair=1", 0.3, spec, sizeof spec);
    cr_assert_eq(pd_policy_spec_parse(spec, &ps, &err), PD_OK, "%s", err.msg);
    pd_kv_prefix *p = NULL;
    pd_compress_stats cs = {0};
    cr_assert_eq(pd_compress_prefix(m, t, n, &ps, &lay, &p, &cs, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(a.info.kept_rows, cs.kept_total);
    pd_kv_prefix_free(p);
    pd_compress_stats_free(&cs);
    pd_model_free(m);
    pd_jobs_free(j);
    free(t);
}

static void submit_fails(pd_jobs *j, const pd_job_spec *s, int code, const char *what) {
    uint64_t id = 12345;
    pd_error err = {0};
    cr_assert_eq(pd_jobs_submit(j, s, &id, &err), code, "%s: got '%s'", what, err.msg);
    cr_assert_eq(id, 12345, "%s: no id on failure", what);
    cr_assert_neq(err.msg[0], '\0', "%s: a message", what);
}

Test(jobs, bad_input_is_refused_or_fails_with_a_message) {
    REQUIRE_MODEL();
    const int64_t n = 2100; /* more than stories260K's 2048 context */
    pd_token *t = tokens_of(n, 5);
    pd_jobs *j = start(8, false, NULL);
    submit_fails(j, &(pd_job_spec){.tokens = t, .n = 50, .policy = "nosuch"}, PD_EINVAL, "unknown policy");
    submit_fails(j, &(pd_job_spec){.tokens = t, .n = 50, .policy = "snapkv:bogus=1"}, PD_EINVAL, "unknown key");
    submit_fails(j, &(pd_job_spec){.tokens = t, .n = 0, .policy = "snapkv"}, PD_EINVAL, "empty");
    submit_fails(j, &(pd_job_spec){.tokens = NULL, .n = 5, .policy = "snapkv"}, PD_EINVAL, "no tokens");
    submit_fails(j, &(pd_job_spec){.tokens = t, .n = 50, .retention = 1.5}, PD_EINVAL, "retention > 1");
    submit_fails(j, &(pd_job_spec){.tokens = t, .n = 50, .retention = NAN}, PD_EINVAL, "retention NaN");
    submit_fails(j, &(pd_job_spec){.tokens = t, .n = 50, .quality = 0.9}, PD_EINVAL, "quality <= 1");
    submit_fails(j, &(pd_job_spec){.tokens = t, .n = 50, .quality = 1.1, .retention = 0.5}, PD_EINVAL, "both");
    submit_fails(j, &(pd_job_spec){.tokens = t, .n = 50, .policy = "snapkv:fair=1"}, PD_EINVAL, "fair, no spans");
    submit_fails(j, &(pd_job_spec){.tokens = t, .n = 50, .dtype = (pd_kv_dtype)9}, PD_EINVAL, "dtype");
    pd_span sp[1] = {{.name = "a", .start = 0, .end = 40}};
    pd_layout short_lay = {.spans = sp, .n_spans = 1};
    submit_fails(j, &(pd_job_spec){.tokens = t, .n = 50, .layout = &short_lay}, PD_EINVAL, "spans miss tokens");
    char long_ns[PD_PREFIX_NS_MAX + 1];
    memset(long_ns, 'n', sizeof long_ns - 1);
    long_ns[sizeof long_ns - 1] = '\0';
    submit_fails(j, &(pd_job_spec){.tokens = t, .n = 50, .ns = long_ns}, PD_EINVAL, "namespace too long");

    /* Too long before the model is loaded: accepted, then failed by the worker. */
    pd_job_status st = wait_done(j, submit(j, &(pd_job_spec){.tokens = t, .n = n, .policy = "snapkv"}));
    cr_assert_eq(st.state, PD_JOB_FAILED);
    cr_assert_eq(st.error_code, PD_ERANGE);
    cr_assert_str_eq(st.phase, "failed");
    cr_assert(strstr(st.error, "2048") && strstr(st.error, "2100"), "%s", st.error);
    /* Once it is loaded the submit itself says so. */
    submit_fails(j, &(pd_job_spec){.tokens = t, .n = n, .policy = "snapkv"}, PD_ERANGE, "too long, model loaded");

    /* A token outside the vocabulary fails the job, and the worker goes on. */
    t[10] = 100000;
    st = wait_done(j, submit(j, &(pd_job_spec){.tokens = t, .n = 50, .policy = "snapkv", .retention = 0.5}));
    cr_assert_eq(st.state, PD_JOB_FAILED);
    cr_assert_neq(st.error_code, PD_OK);
    cr_assert(strstr(st.error, "100000"), "%s", st.error);
    t[10] = 7;
    st = wait_ok(j, submit(j, &(pd_job_spec){.tokens = t, .n = 50, .policy = "snapkv", .retention = 0.5}));
    cr_assert_eq(st.info.n_tokens, 50);
    pd_jobs_free(j);
    free(t);
}

Test(jobs, unknown_ids_are_not_found) {
    REQUIRE_MODEL();
    pd_jobs *j = start(4, false, NULL);
    pd_job_status st;
    pd_error err = {0};
    cr_assert_eq(pd_jobs_status(j, 0, &st, &err), PD_ENOTFOUND);
    cr_assert_eq(pd_jobs_status(j, 1, &st, &err), PD_ENOTFOUND);
    cr_assert_eq(pd_jobs_wait(j, 77, 1.0, &st, &err), PD_ENOTFOUND);
    cr_assert(strstr(err.msg, "77"), "%s", err.msg);
    cr_assert_eq(pd_jobs_wait(j, 1, NAN, &st, &err), PD_EINVAL);
    pd_jobs_free(j);
}

/* The table keeps max_jobs records: full of unfinished jobs it refuses
 * (PD_ERANGE); with finished ones it forgets the oldest finished first. */
Test(jobs, max_jobs_forgets_the_oldest_finished) {
    REQUIRE_MODEL();
    pd_token *t = tokens_of(64, 6);
    pd_jobs *j = start(2, true, NULL);
    pd_job_spec js = {.tokens = t, .n = 64, .policy = "knorm", .retention = 0.5};
    const uint64_t a = submit(j, &js);
    js.retention = 0.25;
    const uint64_t b = submit(j, &js);
    js.retention = 0.75;
    submit_fails(j, &js, PD_EBUSY, "all unfinished");
    pd_job_status st;
    pd_error err = {0};
    cr_assert_eq(pd_jobs_wait(j, a, 0, &st, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(st.state, PD_JOB_QUEUED, "paused");
    cr_assert_str_eq(st.phase, "queued");
    cr_assert_eq(st.progress, 0);

    pd_jobs_set_paused(j, false);
    wait_ok(j, a);
    wait_ok(j, b);
    const uint64_t c = submit(j, &js);
    cr_assert_eq(c, b + 1);
    cr_assert_eq(pd_jobs_status(j, a, &st, &err), PD_ENOTFOUND, "the oldest finished is forgotten");
    cr_assert_eq(pd_jobs_status(j, b, &st, &err), PD_OK, "%s", err.msg);
    cr_assert_eq(st.state, PD_JOB_DONE);
    cr_assert_eq(wait_ok(j, c).chosen_retention, 0.75);
    pd_jobs_free(j);
    free(t);
}

static double render_value(pd_metrics *m, const char *series) {
    char *text = NULL;
    size_t len = 0;
    pd_error err = {0};
    cr_assert_eq(pd_metrics_render(m, &text, &len, &err), PD_OK, "%s", err.msg);
    /* A sample line, not the # HELP line that also names the family. */
    char line[256];
    snprintf(line, sizeof line, "\n%s", series);
    const char *p = strstr(text, line);
    cr_assert(p, "no '%s' in:\n%s", series, text);
    double v = strtod(p + strlen(line), NULL);
    free(text);
    return v;
}

Test(jobs, metrics_count_outcomes_and_the_queue) {
    REQUIRE_MODEL();
    pd_metrics *m = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_metrics_create(&m, &err), PD_OK, "%s", err.msg);
    pd_token *t = tokens_of(64, 7);
    pd_jobs *j = start(8, true, m);
    const uint64_t a = submit(j, &(pd_job_spec){.tokens = t, .n = 64, .policy = "knorm", .retention = 0.5});
    t[3] = -4;
    const uint64_t b = submit(j, &(pd_job_spec){.tokens = t, .n = 64, .policy = "knorm", .retention = 0.5});
    cr_assert_eq(render_value(m, "prefixd_prefix_jobs_queued "), 2);
    pd_jobs_set_paused(j, false);
    wait_ok(j, a);
    cr_assert_eq(wait_done(j, b).state, PD_JOB_FAILED);
    cr_assert_eq(render_value(m, "prefixd_prefix_jobs_total{state=\"done\"} "), 1);
    cr_assert_eq(render_value(m, "prefixd_prefix_jobs_total{state=\"failed\"} "), 1);
    cr_assert_eq(render_value(m, "prefixd_prefix_jobs_queued "), 0);
    pd_jobs_free(j);
    pd_metrics_free(m);
    free(t);
}

/* Freeing with queued jobs (paused: none can start) drops them and frees
 * everything (ASan checks the leaks); freeing with one running finishes or
 * abandons it. Either way nothing is half-written: whatever is stored reads
 * back whole. */
Test(jobs, free_with_queued_and_running_jobs) {
    REQUIRE_MODEL();
    pd_token *t = tokens_of(400, 8);
    pd_metrics *m = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_metrics_create(&m, &err), PD_OK, "%s", err.msg);
    pd_jobs *j = start(8, true, m);
    for (int i = 0; i < 5; i++)
        submit(j, &(pd_job_spec){.tokens = t, .n = 400 - i, .policy = "snapkv", .retention = 0.5});
    pd_jobs_free(j);
    cr_assert_eq(render_value(m, "prefixd_prefix_jobs_queued "), 0, "dropped jobs leave the gauge");

    j = start(8, false, NULL);
    for (int i = 0; i < 3; i++)
        submit(j, &(pd_job_spec){.tokens = t, .n = 400 - i, .policy = "snapkv", .retention = 0.5});
    pd_jobs_free(j);
    pd_store_verify_report rep;
    cr_assert_eq(pd_store_verify(store, false, NULL, NULL, &rep, &err), PD_OK, "%s", err.msg);
    cr_assert_leq(rep.checked, 3);
    cr_assert_eq(rep.corrupt, 0);
    pd_metrics_free(m);
    free(t);
}
