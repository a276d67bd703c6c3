/* The metrics registry: exact Prometheus text output, escaping, validation
 * of names, labels and bounds, re-registration, and exact sums under
 * concurrent updates. */
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/daemon.h"
#include "helpers.h"

static pd_metrics *reg;

static void setup(void) {
    pd_error err = {0};
    cr_assert_eq(pd_metrics_create(&reg, &err), PD_OK, "%s", err.msg);
}

static void teardown(void) {
    pd_metrics_free(reg);
    reg = NULL;
}

TestSuite(metrics, .init = setup, .fini = teardown);

static char *render(void) {
    char *text = NULL;
    size_t len = 0;
    pd_error err = {0};
    cr_assert_eq(pd_metrics_render(reg, &text, &len, &err), PD_OK, "%s", err.msg);
    cr_assert_not_null(text);
    cr_assert_eq(len, strlen(text));
    return text;
}

static void expect_render(const char *want) {
    char *got = render();
    cr_assert_str_eq(got, want, "rendered:\n%s\nwanted:\n%s", got, want);
    free(got);
}

static pd_counter *counter(const char *name, const char *help, const char *labels) {
    pd_counter *c = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_metrics_counter(reg, name, help, labels, &c, &err), PD_OK, "%s", err.msg);
    cr_assert_not_null(c);
    return c;
}

static pd_gauge *gauge(const char *name, const char *help, const char *labels) {
    pd_gauge *g = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_metrics_gauge(reg, name, help, labels, &g, &err), PD_OK, "%s", err.msg);
    cr_assert_not_null(g);
    return g;
}

static pd_histogram *histogram(const char *name, const char *help, const char *labels, const double *b, size_t n) {
    pd_histogram *h = NULL;
    pd_error err = {0};
    cr_assert_eq(pd_metrics_histogram(reg, name, help, labels, b, n, &h, &err), PD_OK, "%s", err.msg);
    cr_assert_not_null(h);
    return h;
}

Test(metrics, empty_registry_renders_empty_text) { expect_render(""); }

Test(metrics, renders_a_small_registry_exactly) {
    pd_counter *req_c = counter("pd_requests_total", "Requests served.", "endpoint=\"completions\"");
    pd_counter *tok = counter("pd_tokens_total", "Tokens generated.", NULL);
    pd_gauge *q = gauge("pd_queue_depth", "Requests waiting.", NULL);
    /* Second series of the first family, registered after other families:
     * it must still be printed under the first family's HELP/TYPE. */
    pd_counter *req_chat = counter("pd_requests_total", "Requests served.", "endpoint=\"chat\",code=\"200\"");
    static const double bounds[] = {0.25, 0.5, 1, 2.5};
    pd_histogram *h = histogram("pd_ttft_seconds", "Time to first token.", "model=\"m\"", bounds, 4);

    pd_counter_add(req_c, 3);
    pd_counter_add(req_chat, 1.5);
    pd_counter_add(tok, 12345678); /* plain digits, not 1.2345678e+07 */
    pd_gauge_set(q, 4);
    pd_gauge_add(q, -6.5);
    /* 0.25 sits exactly on a bound: "le" is inclusive. All values are
     * binary fractions so the sum is exact. */
    const double obs[] = {0.125, 0.25, 0.75, 3, 100};
    for (size_t i = 0; i < sizeof obs / sizeof obs[0]; i++) pd_histogram_observe(h, obs[i]);

    cr_assert_eq(pd_counter_value(req_c), 3);
    cr_assert_eq(pd_gauge_value(q), -2.5);
    expect_render("# HELP pd_requests_total Requests served.\n"
                  "# TYPE pd_requests_total counter\n"
                  "pd_requests_total{endpoint=\"completions\"} 3\n"
                  "pd_requests_total{endpoint=\"chat\",code=\"200\"} 1.5\n"
                  "# HELP pd_tokens_total Tokens generated.\n"
                  "# TYPE pd_tokens_total counter\n"
                  "pd_tokens_total 12345678\n"
                  "# HELP pd_queue_depth Requests waiting.\n"
                  "# TYPE pd_queue_depth gauge\n"
                  "pd_queue_depth -2.5\n"
                  "# HELP pd_ttft_seconds Time to first token.\n"
                  "# TYPE pd_ttft_seconds histogram\n"
                  "pd_ttft_seconds_bucket{model=\"m\",le=\"0.25\"} 2\n"
                  "pd_ttft_seconds_bucket{model=\"m\",le=\"0.5\"} 2\n"
                  "pd_ttft_seconds_bucket{model=\"m\",le=\"1\"} 3\n"
                  "pd_ttft_seconds_bucket{model=\"m\",le=\"2.5\"} 3\n"
                  "pd_ttft_seconds_bucket{model=\"m\",le=\"+Inf\"} 5\n"
                  "pd_ttft_seconds_sum{model=\"m\"} 104.125\n"
                  "pd_ttft_seconds_count{model=\"m\"} 5\n");
}

Test(metrics, histogram_without_labels_and_without_bounds) {
    static const double bounds[] = {1};
    pd_histogram *h = histogram("lat", "", NULL, bounds, 1);
    pd_histogram *only_inf = histogram("big", "Only +Inf.", NULL, NULL, 0);
    pd_histogram_observe(h, -1);  /* below every bound: first bucket */
    pd_histogram_observe(h, 1.5);
    pd_histogram_observe(only_inf, 7);
    expect_render("# HELP lat \n"
                  "# TYPE lat histogram\n"
                  "lat_bucket{le=\"1\"} 1\n"
                  "lat_bucket{le=\"+Inf\"} 2\n"
                  "lat_sum 0.5\n"
                  "lat_count 2\n"
                  "# HELP big Only +Inf.\n"
                  "# TYPE big histogram\n"
                  "big_bucket{le=\"+Inf\"} 1\n"
                  "big_sum 7\n"
                  "big_count 1\n");
}

Test(metrics, value_formatting) {
    struct {
        double v;
        const char *want;
    } cases[] = {
        {0.1, "0.1"},
        {-0.0, "0"},
        {1.0 / 3.0, "0.3333333333333333"},
        {9007199254740992.0, "9007199254740992"}, /* 2^53: still plain digits */
        {1e21, "1e+21"},
        {1.5e-7, "1.5e-07"},
        {-1234.5, "-1234.5"},
        {INFINITY, "+Inf"},
        {-INFINITY, "-Inf"},
        {NAN, "NaN"},
    };
    size_t n = sizeof cases / sizeof cases[0];
    char want[4096] = "";
    pd_strbuf sb = {.buf = want, .cap = sizeof want};
    pd_strbuf_printf(&sb, "# HELP g Values.\n# TYPE g gauge\n");
    for (size_t i = 0; i < n; i++) {
        char labels[32];
        snprintf(labels, sizeof labels, "i=\"%zu\"", i);
        pd_gauge_set(gauge("g", "Values.", labels), cases[i].v);
        pd_strbuf_printf(&sb, "g{i=\"%zu\"} %s\n", i, cases[i].want);
    }
    cr_assert_lt(sb.len, sizeof want);
    expect_render(want);
    /* Every finite value printed must read back to the same double. */
    cr_assert_eq(strtod("0.3333333333333333", NULL), 1.0 / 3.0);
}

Test(metrics, help_is_escaped_and_label_values_pass_through) {
    pd_counter *c = counter("esc_total", "Line one\nback\\slash \"quoted\"", "path=\"a\\\\b\\\"c\\nd\",x=\"\"");
    pd_counter_add(c, 1);
    expect_render("# HELP esc_total Line one\\nback\\\\slash \"quoted\"\n"
                  "# TYPE esc_total counter\n"
                  "esc_total{path=\"a\\\\b\\\"c\\nd\",x=\"\"} 1\n");
}

Test(metrics, counter_ignores_negative_and_nan_increments) {
    pd_counter *c = counter("mono_total", "Monotonic.", NULL);
    pd_counter_add(c, 2);
    pd_counter_add(c, -1);
    pd_counter_add(c, NAN);
    pd_counter_add(c, 0.5);
    cr_assert_eq(pd_counter_value(c), 2.5);
}

static void expect_einval(int rc, const pd_error *err, const char *what) {
    cr_assert_eq(rc, PD_EINVAL, "%s: rc %d", what, rc);
    cr_assert_neq(err->msg[0], '\0', "%s: empty message", what);
}

Test(metrics, invalid_names_are_rejected) {
    const char *bad[] = {"", "1abc", "a-b", "a b", "ä", "a.b"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        pd_counter *c = NULL;
        pd_error err = {0};
        expect_einval(pd_metrics_counter(reg, bad[i], "h", NULL, &c, &err), &err, bad[i]);
        cr_assert_null(c);
    }
    pd_counter *c = NULL;
    pd_error err = {0};
    expect_einval(pd_metrics_counter(reg, NULL, "h", NULL, &c, &err), &err, "NULL name");
    /* Valid edge cases: colons and leading underscore. */
    counter(":a:b_1", "ok", NULL);
    counter("_x", "ok", NULL);
}

Test(metrics, invalid_labels_are_rejected) {
    const char *bad[] = {
        "a=b",                 /* unquoted value */
        "a=\"x",               /* unterminated */
        "a=\"x\",",            /* trailing comma */
        ",a=\"x\"",            /* leading comma */
        "1a=\"x\"",            /* name starts with a digit */
        "__a=\"x\"",           /* reserved prefix */
        "a=\"x\",a=\"y\"",     /* duplicate */
        "a=\"x\\ty\"",         /* \t is not a valid escape */
        "a=\"x\\\"",           /* escape eats the closing quote */
        "a=\"line\nbreak\"",   /* raw newline */
        "a=\"x\"b=\"y\"",      /* missing comma */
        "a =\"x\"",            /* space */
        "a-b=\"x\"",           /* bad character in name */
        "{a=\"x\"}",           /* braces are not part of the string */
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        pd_gauge *g = NULL;
        pd_error err = {0};
        expect_einval(pd_metrics_gauge(reg, "g", "h", bad[i], &g, &err), &err, bad[i]);
        cr_assert_null(g);
    }
    /* "le" is the registry's on histograms, but fine elsewhere. */
    static const double b[] = {1};
    pd_histogram *h = NULL;
    pd_error err = {0};
    expect_einval(pd_metrics_histogram(reg, "h", "h", "le=\"1\"", b, 1, &h, &err), &err, "le on histogram");
    gauge("g_le", "h", "le=\"1\"");
    /* Nothing half-registered: only the one good gauge appears. */
    expect_render("# HELP g_le h\n# TYPE g_le gauge\ng_le{le=\"1\"} 0\n");
}

Test(metrics, invalid_bounds_are_rejected) {
    struct {
        double b[3];
        size_t n;
        const char *what;
    } cases[] = {
        {{1, 1, 2}, 3, "equal bounds"},
        {{2, 1, 3}, 3, "decreasing"},
        {{1, NAN, 3}, 3, "NaN"},
        {{1, 2, INFINITY}, 3, "explicit +Inf"},
        {{-INFINITY, 0, 1}, 3, "-Inf"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        pd_histogram *h = NULL;
        pd_error err = {0};
        expect_einval(pd_metrics_histogram(reg, "h", "h", NULL, cases[i].b, cases[i].n, &h, &err), &err,
                      cases[i].what);
        cr_assert_null(h);
    }
    pd_histogram *h = NULL;
    pd_error err = {0};
    expect_einval(pd_metrics_histogram(reg, "h", "h", NULL, NULL, 2, &h, &err), &err, "NULL bounds");
    expect_render("");
}

Test(metrics, re_registration) {
    pd_counter *a = counter("re_total", "Help.", "k=\"1\"");
    pd_counter *a2 = counter("re_total", "Help.", "k=\"1\"");
    cr_assert_eq(a, a2, "same name and labels give the same series");
    pd_counter *b = counter("re_total", "Help.", "k=\"2\"");
    cr_assert_neq(a, b);
    pd_counter *none = counter("re_total", "Help.", NULL);
    cr_assert_eq(counter("re_total", "Help.", ""), none, "NULL and \"\" labels are the same series");
    pd_counter_add(a, 1);
    pd_counter_add(a2, 1);

    pd_error err = {0};
    pd_gauge *g = NULL;
    expect_einval(pd_metrics_gauge(reg, "re_total", "Help.", "k=\"1\"", &g, &err), &err, "other type");
    pd_counter *c = NULL;
    expect_einval(pd_metrics_counter(reg, "re_total", "Other help.", "k=\"3\"", &c, &err), &err, "other help");

    static const double b1[] = {1, 2}, b2[] = {1, 3};
    pd_histogram *h = histogram("hist", "H.", NULL, b1, 2);
    cr_assert_eq(histogram("hist", "H.", NULL, b1, 2), h);
    pd_histogram *h2 = NULL;
    expect_einval(pd_metrics_histogram(reg, "hist", "H.", NULL, b2, 2, &h2, &err), &err, "other bounds");
    expect_einval(pd_metrics_histogram(reg, "hist", "H.", NULL, b1, 1, &h2, &err), &err, "fewer bounds");
    /* Names that would collide with a histogram's samples. */
    expect_einval(pd_metrics_counter(reg, "hist_count", "x", NULL, &c, &err), &err, "hist_count");
    expect_einval(pd_metrics_gauge(reg, "hist_bucket", "x", NULL, &g, &err), &err, "hist_bucket");
    counter("busy_sum", "x", NULL);
    expect_einval(pd_metrics_histogram(reg, "busy", "x", NULL, b1, 2, &h2, &err), &err, "busy vs busy_sum");

    expect_render("# HELP re_total Help.\n"
                  "# TYPE re_total counter\n"
                  "re_total{k=\"1\"} 2\n"
                  "re_total{k=\"2\"} 0\n"
                  "re_total 0\n"
                  "# HELP hist H.\n"
                  "# TYPE hist histogram\n"
                  "hist_bucket{le=\"1\"} 0\n"
                  "hist_bucket{le=\"2\"} 0\n"
                  "hist_bucket{le=\"+Inf\"} 0\n"
                  "hist_sum 0\n"
                  "hist_count 0\n"
                  "# HELP busy_sum x\n"
                  "# TYPE busy_sum counter\n"
                  "busy_sum 0\n");
}

/* ---- concurrency ---------------------------------------------------------- */

enum { N_THREADS = 8, N_ITERS = 100000 };

typedef struct worker_arg {
    pd_counter *c;
    pd_gauge *g;
    pd_histogram *h;
    int id;
} worker_arg;

static void *worker(void *p) {
    worker_arg *a = p;
    for (int i = 0; i < N_ITERS; i++) {
        pd_counter_add(a->c, 1);
        /* Even threads add, odd threads subtract: the gauge ends at 0. */
        pd_gauge_add(a->g, (a->id % 2) ? -2 : 2);
        pd_histogram_observe(a->h, (double)(i % 4)); /* 0,1,2,3 */
    }
    return NULL;
}

Test(metrics, concurrent_updates_sum_exactly) {
    pd_counter *c = counter("conc_total", "Concurrent.", NULL);
    pd_gauge *g = gauge("conc_gauge", "Concurrent.", NULL);
    static const double bounds[] = {0.5, 1.5, 2.5};
    pd_histogram *h = histogram("conc_hist", "Concurrent.", NULL, bounds, 3);
    pthread_t th[N_THREADS];
    worker_arg args[N_THREADS];
    for (int t = 0; t < N_THREADS; t++) {
        args[t] = (worker_arg){.c = c, .g = g, .h = h, .id = t};
        cr_assert_eq(pthread_create(&th[t], NULL, worker, &args[t]), 0);
    }
    for (int t = 0; t < N_THREADS; t++) cr_assert_eq(pthread_join(th[t], NULL), 0);

    const long total = (long)N_THREADS * N_ITERS, quarter = total / 4;
    cr_assert_eq(pd_counter_value(c), (double)total, "counter %.17g", pd_counter_value(c));
    cr_assert_eq(pd_gauge_value(g), 0.0, "gauge %.17g", pd_gauge_value(g));
    /* Integer sums below 2^53 are exact in any order of additions. */
    char want[1024];
    snprintf(want, sizeof want,
             "# HELP conc_total Concurrent.\n# TYPE conc_total counter\nconc_total %ld\n"
             "# HELP conc_gauge Concurrent.\n# TYPE conc_gauge gauge\nconc_gauge 0\n"
             "# HELP conc_hist Concurrent.\n# TYPE conc_hist histogram\n"
             "conc_hist_bucket{le=\"0.5\"} %ld\nconc_hist_bucket{le=\"1.5\"} %ld\n"
             "conc_hist_bucket{le=\"2.5\"} %ld\nconc_hist_bucket{le=\"+Inf\"} %ld\n"
             "conc_hist_sum %ld\nconc_hist_count %ld\n",
             total, quarter, 2 * quarter, 3 * quarter, total, quarter * (0 + 1 + 2 + 3), total);
    expect_render(want);
}

/* Series registered while serving (a route and status seen for the first
 * time) race with each other and with scrapes: each label set ends up as
 * exactly one series holding every increment. */
typedef struct reg_arg {
    int thread;
} reg_arg;

enum { REG_THREADS = 4, REG_ROUNDS = 2000, REG_ROUTES = 5 };

static void *register_and_count(void *p) {
    const reg_arg *a = p;
    for (int i = 0; i < REG_ROUNDS; i++) {
        char labels[64];
        snprintf(labels, sizeof labels, "route=\"r%d\",status=\"200\"", (i + a->thread) % REG_ROUTES);
        pd_counter *c = NULL;
        pd_error err = {0};
        if (pd_metrics_counter(reg, "lazy_total", "Lazily registered.", labels, &c, &err) != PD_OK)
            return "registration failed";
        pd_counter_add(c, 1);
        if (a->thread == 0 && i % 100 == 0) {
            char *text = NULL;
            if (pd_metrics_render(reg, &text, NULL, &err) != PD_OK) return "render failed";
            free(text);
        }
    }
    return NULL;
}

Test(metrics, registration_while_serving_is_thread_safe) {
    pthread_t t[REG_THREADS];
    reg_arg args[REG_THREADS];
    for (int i = 0; i < REG_THREADS; i++) {
        args[i].thread = i;
        cr_assert_eq(pthread_create(&t[i], NULL, register_and_count, &args[i]), 0);
    }
    for (int i = 0; i < REG_THREADS; i++) {
        void *res = NULL;
        pthread_join(t[i], &res);
        cr_assert_null(res, "%s", (const char *)res);
    }
    char *text = render();
    double total = 0;
    int series = 0;
    for (int r = 0; r < REG_ROUTES; r++) {
        char name[96];
        snprintf(name, sizeof name, "lazy_total{route=\"r%d\",status=\"200\"}", r);
        const double v = th_metric(text, name);
        cr_assert_eq(v, REG_THREADS * REG_ROUNDS / REG_ROUTES, "%s", text);
        total += v;
        series++;
    }
    cr_assert_eq(total, REG_THREADS * REG_ROUNDS);
    /* one # TYPE line, one line per series */
    int lines = 0;
    for (const char *p = text; (p = strstr(p, "lazy_total{")); p++) lines++;
    cr_assert_eq(lines, series, "%s", text);
    free(text);
}

/* The process_* series read this process's /proc: its open descriptors,
 * memory and CPU time. */
Test(metrics, process_series_describe_this_process) {
    pd_error err = {0};
    cr_assert_eq(pd_metrics_process(reg, &err), PD_OK, "%s", err.msg);
    char *text = render();
    const double open_before = th_metric(text, "process_open_fds");
    free(text);
    FILE *extra[8];
    for (int i = 0; i < 8; i++) cr_assert_not_null(extra[i] = fopen("/dev/null", "r"));
    text = render();
    cr_assert_eq(th_metric(text, "process_open_fds"), open_before + 8, "%s", text);
    cr_assert_gt(th_metric(text, "process_resident_memory_bytes"), 1 << 20, "%s", text);
    cr_assert_geq(th_metric(text, "process_virtual_memory_bytes"), th_metric(text, "process_resident_memory_bytes"));
    cr_assert_geq(th_metric(text, "process_max_fds"), open_before + 8);
    const double start = th_metric(text, "process_start_time_seconds");
    cr_assert(start > 1.5e9 && start <= (double)time(NULL) + 1, "%f", start);
    free(text);
    for (int i = 0; i < 8; i++) fclose(extra[i]);
}
