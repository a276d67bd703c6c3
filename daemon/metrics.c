/* Metrics registry: counters, gauges and histograms rendered in the
 * Prometheus text exposition format 0.0.4.
 *
 * Registration takes the registry's lock (so a series can be added while
 * serving, e.g. the first request of a new route and status); updates come
 * from any thread and never lock. A double is kept as its IEEE-754 bit pattern in an
 * atomic uint64_t and updated with a CAS loop: C11 has no atomic fetch-add
 * for floating types, and a 64-bit integer CAS is lock-free on every target
 * we build for (no libatomic needed). */
#include <dirent.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "daemon/daemon.h"

typedef enum metric_type { MT_COUNTER, MT_GAUGE, MT_HISTOGRAM } metric_type;

struct pd_counter {
    _Atomic uint64_t bits;
};
struct pd_gauge {
    _Atomic uint64_t bits;
};
struct pd_histogram {
    const double *bounds;      /* the family's, n of them */
    size_t n;
    _Atomic uint64_t *buckets; /* n + 1 per-bucket (not cumulative) counts; last is +Inf */
    _Atomic uint64_t sum_bits;
};

typedef struct series {
    char *labels; /* "" when none */
    union {
        pd_counter c;
        pd_gauge g;
        pd_histogram h;
    } u;
} series;

typedef struct family {
    char *name;
    char *help;
    metric_type type;
    double *bounds; /* histograms: n_bounds finite, strictly increasing */
    size_t n_bounds;
    series **series; /* pointers stay stable: handles point into them */
    size_t n_series, cap_series;
} family;

/* The process_* series, refreshed from /proc at each render. */
typedef struct process_series {
    pd_counter *cpu_seconds;
    pd_gauge *resident_bytes, *virtual_bytes, *open_fds, *max_fds, *start_time;
} process_series;

struct pd_metrics {
    pthread_mutex_t mu; /* registration and rendering (the family and series arrays) */
    family **fams;
    size_t n_fams, cap_fams;
    bool has_process;
    process_series proc;
};

/* ---- atomic doubles ----------------------------------------------------- */

static uint64_t dbl_bits(double v) {
    uint64_t u;
    memcpy(&u, &v, sizeof u);
    return u;
}

static double bits_dbl(uint64_t u) {
    double v;
    memcpy(&v, &u, sizeof v);
    return v;
}

static void atomic_dbl_add(_Atomic uint64_t *a, double v) {
    uint64_t old = atomic_load_explicit(a, memory_order_relaxed);
    /* On failure `old` is refreshed with the current value; retry. */
    while (!atomic_compare_exchange_weak_explicit(a, &old, dbl_bits(bits_dbl(old) + v), memory_order_relaxed,
                                                  memory_order_relaxed)) {
    }
}

static double atomic_dbl_load(const _Atomic uint64_t *a) {
    /* atomic_load takes a non-const pointer in older C libraries. */
    return bits_dbl(atomic_load_explicit((_Atomic uint64_t *)a, memory_order_relaxed));
}

void pd_counter_add(pd_counter *c, double v) {
    /* A counter only goes up: negative and NaN increments are dropped
     * (the contract says v >= 0) rather than corrupting the series. */
    if (!c || !(v >= 0)) return;
    atomic_dbl_add(&c->bits, v);
}

void pd_gauge_set(pd_gauge *g, double v) {
    if (g) atomic_store_explicit(&g->bits, dbl_bits(v), memory_order_relaxed);
}

void pd_gauge_add(pd_gauge *g, double v) {
    if (g) atomic_dbl_add(&g->bits, v);
}

double pd_counter_value(const pd_counter *c) { return c ? atomic_dbl_load(&c->bits) : 0; }

double pd_gauge_value(const pd_gauge *g) { return g ? atomic_dbl_load(&g->bits) : 0; }

void pd_histogram_observe(pd_histogram *h, double v) {
    if (!h) return;
    /* First bucket whose upper bound is >= v ("le" is inclusive); NaN
     * compares false everywhere and lands in +Inf, as in client_golang. */
    size_t lo = 0, hi = h->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (v <= h->bounds[mid]) hi = mid;
        else lo = mid + 1;
    }
    if (isnan(v)) lo = h->n;
    atomic_fetch_add_explicit(&h->buckets[lo], 1, memory_order_relaxed);
    atomic_dbl_add(&h->sum_bits, v);
}

/* ---- validation ---------------------------------------------------------- */

static bool is_alpha_(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
static bool is_digit(char c) { return c >= '0' && c <= '9'; }

static bool valid_metric_name(const char *s) {
    if (!s || !(is_alpha_(*s) || *s == ':')) return false;
    for (s++; *s; s++)
        if (!(is_alpha_(*s) || is_digit(*s) || *s == ':')) return false;
    return true;
}

/* Checks "k=\"v\",k2=\"v2\"" as it goes between braces: label names
 * [a-zA-Z_][a-zA-Z0-9_]* not starting with "__" (reserved by Prometheus),
 * no name twice, values quoted with only \\ \" \n escapes and no raw
 * newline. `reserved` (e.g. "le" for histograms) may not be used. */
static int check_labels(const char *labels, const char *reserved, pd_error *err) {
    enum { MAX_LABELS = 32 };
    const char *names[MAX_LABELS];
    size_t name_lens[MAX_LABELS];
    size_t n = 0;
    const char *p = labels;
    for (;;) {
        const char *name = p;
        if (!is_alpha_(*p))
            return pd_errorf(err, PD_EINVAL, "labels \"%s\": a label name must start with a letter or '_' (at offset %zu)",
                             labels, (size_t)(p - labels));
        while (is_alpha_(*p) || is_digit(*p)) p++;
        size_t len = (size_t)(p - name);
        if (len >= 2 && name[0] == '_' && name[1] == '_')
            return pd_errorf(err, PD_EINVAL, "labels \"%s\": label names starting with \"__\" are reserved", labels);
        if (reserved && len == strlen(reserved) && memcmp(name, reserved, len) == 0)
            return pd_errorf(err, PD_EINVAL, "labels \"%s\": label \"%s\" is set by the registry for this type",
                             labels, reserved);
        for (size_t i = 0; i < n; i++)
            if (name_lens[i] == len && memcmp(names[i], name, len) == 0)
                return pd_errorf(err, PD_EINVAL, "labels \"%s\": label \"%.*s\" is given twice", labels, (int)len,
                                 name);
        if (n == MAX_LABELS)
            return pd_errorf(err, PD_EINVAL, "labels \"%s\": more than %d labels", labels, MAX_LABELS);
        names[n] = name;
        name_lens[n++] = len;
        if (p[0] != '=' || p[1] != '"')
            return pd_errorf(err, PD_EINVAL, "labels \"%s\": expected =\"value\" after label \"%.*s\"", labels,
                             (int)len, name);
        p += 2;
        for (;; p++) {
            if (*p == '\0')
                return pd_errorf(err, PD_EINVAL, "labels \"%s\": unterminated value of label \"%.*s\"", labels,
                                 (int)len, name);
            if (*p == '\n')
                return pd_errorf(err, PD_EINVAL, "labels \"%s\": raw newline in a label value; write it as \\n",
                                 labels);
            if (*p == '"') break;
            if (*p == '\\') {
                p++;
                if (*p != '\\' && *p != '"' && *p != 'n')
                    return pd_errorf(err, PD_EINVAL,
                                     "labels \"%s\": bad escape in a label value (only \\\\, \\\" and \\n are allowed)",
                                     labels);
            }
        }
        p++; /* closing quote */
        if (*p == '\0') return PD_OK;
        if (*p != ',' || p[1] == '\0')
            return pd_errorf(err, PD_EINVAL, "labels \"%s\": expected ',' and another label after a value (offset %zu)",
                             labels, (size_t)(p - labels));
        p++;
    }
}

/* ---- registry ------------------------------------------------------------ */

int pd_metrics_create(pd_metrics **out, pd_error *err) {
    if (!out) return pd_errorf(err, PD_EINVAL, "pd_metrics_create: out is NULL");
    *out = calloc(1, sizeof **out);
    if (!*out) return pd_errorf(err, PD_ENOMEM, "out of memory creating the metrics registry");
    pthread_mutex_init(&(*out)->mu, NULL);
    return PD_OK;
}

static void series_free(series *s, metric_type t) {
    if (!s) return;
    if (t == MT_HISTOGRAM) free(s->u.h.buckets);
    free(s->labels);
    free(s);
}

static void family_free(family *f) {
    if (!f) return;
    for (size_t i = 0; i < f->n_series; i++) series_free(f->series[i], f->type);
    free(f->series);
    free(f->bounds);
    free(f->help);
    free(f->name);
    free(f);
}

void pd_metrics_free(pd_metrics *m) {
    if (!m) return;
    for (size_t i = 0; i < m->n_fams; i++) family_free(m->fams[i]);
    free(m->fams);
    pthread_mutex_destroy(&m->mu);
    free(m);
}

static const char *type_name(metric_type t) {
    switch (t) {
    case MT_COUNTER: return "counter";
    case MT_GAUGE: return "gauge";
    case MT_HISTOGRAM: return "histogram";
    }
    return "untyped";
}

/* Grow *arr (of pointers) to hold one more element. */
static int grow_ptrs(void *arr, size_t n, size_t *cap) {
    void ***a = arr;
    if (n < *cap) return PD_OK;
    size_t ncap = *cap ? *cap * 2 : 8;
    uint64_t bytes;
    if (ncap < *cap || !pd_mul_ok(ncap, sizeof(void *), &bytes) || bytes > SIZE_MAX) return PD_ENOMEM;
    void **na = realloc(*a, (size_t)bytes);
    if (!na) return PD_ENOMEM;
    *a = na;
    *cap = ncap;
    return PD_OK;
}

/* The suffixed names a histogram family puts on the wire. */
static bool is_histogram_child(const char *name, const char *hist) {
    static const char *const suffixes[] = {"_bucket", "_sum", "_count"};
    size_t hl = strlen(hist);
    if (strncmp(name, hist, hl) != 0) return false;
    for (size_t i = 0; i < sizeof suffixes / sizeof suffixes[0]; i++)
        if (strcmp(name + hl, suffixes[i]) == 0) return true;
    return false;
}

static bool same_bounds(const family *f, const double *bounds, size_t n) {
    if (f->n_bounds != n) return false;
    for (size_t i = 0; i < n; i++)
        if (f->bounds[i] != bounds[i]) return false;
    return true;
}

/* Find or create the family and the series; *created tells the caller to
 * initialise the series' value. */
static int lookup_series_locked(pd_metrics *m, const char *name, const char *help, const char *labels,
                                metric_type type, const double *bounds, size_t n_bounds, series **out,
                                pd_error *err) {
    if (!valid_metric_name(name))
        return pd_errorf(err, PD_EINVAL, "metric name \"%s\" is invalid: use [a-zA-Z_:][a-zA-Z0-9_:]*",
                         name ? name : "(null)");
    if (!help) help = "";
    if (!labels) labels = "";
    if (*labels) {
        int rc = check_labels(labels, type == MT_HISTOGRAM ? "le" : NULL, err);
        if (rc != PD_OK) {
            pd_error_prefix(err, "metric %s", name);
            return rc;
        }
    }
    if (type == MT_HISTOGRAM) {
        if (n_bounds > 0 && !bounds) return pd_errorf(err, PD_EINVAL, "histogram %s: bounds is NULL", name);
        for (size_t i = 0; i < n_bounds; i++) {
            if (!isfinite(bounds[i]))
                return pd_errorf(err, PD_EINVAL, "histogram %s: bound %zu is not finite (+Inf is implicit)", name, i);
            if (i > 0 && !(bounds[i] > bounds[i - 1]))
                return pd_errorf(err, PD_EINVAL, "histogram %s: bounds must be strictly increasing (bound %zu is %g after %g)",
                                 name, i, bounds[i], bounds[i - 1]);
        }
    }

    family *f = NULL;
    for (size_t i = 0; i < m->n_fams; i++) {
        family *g = m->fams[i];
        if (strcmp(g->name, name) == 0) {
            f = g;
            break;
        }
        /* "x_count" next to a histogram "x" would produce two families
         * with the same sample names. */
        if ((g->type == MT_HISTOGRAM && is_histogram_child(name, g->name)) ||
            (type == MT_HISTOGRAM && is_histogram_child(g->name, name)))
            return pd_errorf(err, PD_EINVAL, "metric %s clashes with the samples of histogram %s", name,
                             g->type == MT_HISTOGRAM ? g->name : name);
    }
    if (f) {
        if (f->type != type)
            return pd_errorf(err, PD_EINVAL, "metric %s is already registered as a %s, not a %s", name,
                             type_name(f->type), type_name(type));
        if (strcmp(f->help, help) != 0)
            return pd_errorf(err, PD_EINVAL, "metric %s is already registered with another help text", name);
        if (type == MT_HISTOGRAM && !same_bounds(f, bounds, n_bounds))
            return pd_errorf(err, PD_EINVAL, "histogram %s is already registered with other bucket bounds", name);
        for (size_t i = 0; i < f->n_series; i++)
            if (strcmp(f->series[i]->labels, labels) == 0) {
                *out = f->series[i];
                return PD_OK;
            }
    } else {
        if (grow_ptrs(&m->fams, m->n_fams, &m->cap_fams) != PD_OK) goto oom;
        f = calloc(1, sizeof *f);
        if (!f) goto oom;
        f->type = type;
        f->name = strdup(name);
        f->help = strdup(help);
        if (!f->name || !f->help) {
            family_free(f);
            goto oom;
        }
        if (type == MT_HISTOGRAM && n_bounds > 0) {
            f->bounds = calloc(n_bounds, sizeof *f->bounds);
            if (!f->bounds) {
                family_free(f);
                goto oom;
            }
            memcpy(f->bounds, bounds, n_bounds * sizeof *f->bounds);
        }
        f->n_bounds = type == MT_HISTOGRAM ? n_bounds : 0;
        m->fams[m->n_fams++] = f;
    }

    if (grow_ptrs(&f->series, f->n_series, &f->cap_series) != PD_OK) goto oom;
    series *s = calloc(1, sizeof *s);
    if (!s) goto oom;
    s->labels = strdup(labels);
    if (!s->labels) {
        free(s);
        goto oom;
    }
    switch (type) {
    case MT_COUNTER: atomic_init(&s->u.c.bits, dbl_bits(0.0)); break;
    case MT_GAUGE: atomic_init(&s->u.g.bits, dbl_bits(0.0)); break;
    case MT_HISTOGRAM:
        /* n_bounds + 1 cannot overflow: the bounds array already holds n_bounds doubles. */
        s->u.h.buckets = calloc(f->n_bounds + 1, sizeof *s->u.h.buckets);
        if (!s->u.h.buckets) {
            series_free(s, type);
            goto oom;
        }
        for (size_t i = 0; i <= f->n_bounds; i++) atomic_init(&s->u.h.buckets[i], 0);
        atomic_init(&s->u.h.sum_bits, dbl_bits(0.0));
        s->u.h.bounds = f->bounds;
        s->u.h.n = f->n_bounds;
        break;
    }
    f->series[f->n_series++] = s;
    *out = s;
    return PD_OK;
oom:
    return pd_errorf(err, PD_ENOMEM, "out of memory registering metric %s", name);
}

static int lookup_series(pd_metrics *m, const char *name, const char *help, const char *labels, metric_type type,
                         const double *bounds, size_t n_bounds, series **out, pd_error *err) {
    if (!m || !out) return pd_errorf(err, PD_EINVAL, "metrics: registry or out is NULL");
    pthread_mutex_lock(&m->mu);
    const int rc = lookup_series_locked(m, name, help, labels, type, bounds, n_bounds, out, err);
    pthread_mutex_unlock(&m->mu);
    return rc;
}

int pd_metrics_counter(pd_metrics *m, const char *name, const char *help, const char *labels, pd_counter **out,
                       pd_error *err) {
    series *s;
    int rc = lookup_series(m, name, help, labels, MT_COUNTER, NULL, 0, &s, err);
    if (rc == PD_OK) *out = &s->u.c;
    return rc;
}

int pd_metrics_gauge(pd_metrics *m, const char *name, const char *help, const char *labels, pd_gauge **out,
                     pd_error *err) {
    series *s;
    int rc = lookup_series(m, name, help, labels, MT_GAUGE, NULL, 0, &s, err);
    if (rc == PD_OK) *out = &s->u.g;
    return rc;
}

int pd_metrics_histogram(pd_metrics *m, const char *name, const char *help, const char *labels,
                         const double *bounds, size_t n, pd_histogram **out, pd_error *err) {
    series *s;
    int rc = lookup_series(m, name, help, labels, MT_HISTOGRAM, bounds, n, &s, err);
    if (rc == PD_OK) *out = &s->u.h;
    return rc;
}

/* ---- process metrics ------------------------------------------------------ */

/* The process_* series the Prometheus client libraries export, so the
 * usual dashboards work: CPU seconds (user + system), resident and virtual
 * memory, open and maximum file descriptors, start time. */
int pd_metrics_process(pd_metrics *m, pd_error *err) {
    process_series p = {0};
    int rc = pd_metrics_counter(m, "process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
                                NULL, &p.cpu_seconds, err);
    if (!rc)
        rc = pd_metrics_gauge(m, "process_resident_memory_bytes", "Resident memory size in bytes.", NULL,
                              &p.resident_bytes, err);
    if (!rc)
        rc = pd_metrics_gauge(m, "process_virtual_memory_bytes", "Virtual memory size in bytes.", NULL,
                              &p.virtual_bytes, err);
    if (!rc) rc = pd_metrics_gauge(m, "process_open_fds", "Number of open file descriptors.", NULL, &p.open_fds, err);
    if (!rc)
        rc = pd_metrics_gauge(m, "process_max_fds", "Maximum number of open file descriptors.", NULL, &p.max_fds, err);
    if (!rc)
        rc = pd_metrics_gauge(m, "process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
                              NULL, &p.start_time, err);
    if (rc) return rc;
    pthread_mutex_lock(&m->mu);
    m->proc = p;
    m->has_process = true;
    pthread_mutex_unlock(&m->mu);
    return PD_OK;
}

/* The boot time in Unix seconds, from the clocks (/proc/stat's btime is
 * hidden by the unit's ProcSubset=pid). */
static double boot_time(void) {
    struct timespec real, boot;
    clock_gettime(CLOCK_REALTIME, &real);
    clock_gettime(CLOCK_BOOTTIME, &boot);
    return (double)(real.tv_sec - boot.tv_sec) + (double)(real.tv_nsec - boot.tv_nsec) * 1e-9;
}

static void process_refresh(const process_series *p) {
    /* /proc/self/stat: fields after the command name (which may hold
     * spaces and parentheses, so parse from the last ')'): field 3 is the
     * state; utime 14, stime 15 (clock ticks), starttime 22 (ticks after
     * boot), vsize 23 (bytes), rss 24 (pages). */
    FILE *f = fopen("/proc/self/stat", "r");
    if (f) {
        char buf[1024];
        const size_t n = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[n] = '\0';
        const char *p_end = strrchr(buf, ')');
        unsigned long long utime, stime, start, vsize;
        long long rss;
        const double ticks = (double)sysconf(_SC_CLK_TCK), page = (double)sysconf(_SC_PAGESIZE);
        if (p_end && ticks > 0 &&
            sscanf(p_end + 1,
                   " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu %*d %*d %*d %*d %*d %*d %llu %llu %lld",
                   &utime, &stime, &start, &vsize, &rss) == 5) {
            /* A counter that is read, not added to: stored as is. */
            atomic_store_explicit(&p->cpu_seconds->bits, dbl_bits((double)(utime + stime) / ticks),
                                  memory_order_relaxed);
            pd_gauge_set(p->virtual_bytes, (double)vsize);
            pd_gauge_set(p->resident_bytes, (double)rss * page);
            pd_gauge_set(p->start_time, boot_time() + (double)start / ticks);
        }
    }
    DIR *d = opendir("/proc/self/fd");
    if (d) {
        int64_t open = 0;
        const int own = dirfd(d);
        for (struct dirent *e; (e = readdir(d));)
            if (e->d_name[0] != '.' && atoi(e->d_name) != own) open++;
        closedir(d);
        pd_gauge_set(p->open_fds, (double)open);
    }
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0)
        pd_gauge_set(p->max_fds, rl.rlim_cur == RLIM_INFINITY ? INFINITY : (double)rl.rlim_cur);
}

/* ---- rendering ----------------------------------------------------------- */

typedef struct outbuf {
    char *data;
    size_t len, cap;
    bool oom;
} outbuf;

static bool ob_fail(outbuf *b) {
    b->oom = true;
    return false;
}

static bool ob_reserve(outbuf *b, size_t extra) {
    if (b->oom) return false;
    uint64_t need;
    if (!pd_add_ok(b->len, extra, &need) || !pd_add_ok(need, 1, &need) || need > SIZE_MAX) return ob_fail(b);
    if (need <= b->cap) return true;
    size_t ncap = b->cap ? b->cap : 4096;
    while (ncap < need) {
        if (ncap > SIZE_MAX / 2) {
            ncap = (size_t)need;
            break;
        }
        ncap *= 2;
    }
    char *nd = realloc(b->data, ncap);
    if (!nd) return ob_fail(b);
    b->data = nd;
    b->cap = ncap;
    return true;
}

static void ob_puts(outbuf *b, const char *s, size_t n) {
    if (!ob_reserve(b, n)) return;
    memcpy(b->data + b->len, s, n);
    b->len += n;
    b->data[b->len] = '\0';
}

static void ob_str(outbuf *b, const char *s) { ob_puts(b, s, strlen(s)); }

/* HELP text: backslash and line feed are escaped (quotes are not). */
static void ob_help(outbuf *b, const char *s) {
    for (; *s; s++) {
        if (*s == '\\') ob_puts(b, "\\\\", 2);
        else if (*s == '\n') ob_puts(b, "\\n", 2);
        else ob_puts(b, s, 1);
    }
}

/* A sample value (or "le" bound) as Prometheus parses it: +Inf/-Inf/NaN,
 * integers up to 2^53 in plain digits (a token counter reads 12345678, not
 * 1.2345678e+07), anything else in the shortest form that reads back to
 * the same double. */
static void format_double(double v, char *buf, size_t cap) {
    if (isnan(v)) snprintf(buf, cap, "NaN");
    else if (isinf(v)) snprintf(buf, cap, v > 0 ? "+Inf" : "-Inf");
    else if (v == 0) snprintf(buf, cap, "0"); /* also -0 */
    else if (v == floor(v) && fabs(v) <= 9007199254740992.0) snprintf(buf, cap, "%.0f", v);
    else {
        for (int prec = 15; prec <= 17; prec++) {
            snprintf(buf, cap, "%.*g", prec, v);
            if (strtod(buf, NULL) == v) break;
        }
    }
}

static void ob_value(outbuf *b, double v) {
    char num[64];
    format_double(v, num, sizeof num);
    ob_str(b, num);
}

/* name suffix {labels[,extra]} value\n */
static void ob_sample(outbuf *b, const char *name, const char *suffix, const char *labels, const char *extra,
                      double v) {
    ob_str(b, name);
    ob_str(b, suffix);
    bool has_labels = *labels != '\0';
    if (has_labels || extra) {
        ob_puts(b, "{", 1);
        ob_str(b, labels);
        if (extra) {
            if (has_labels) ob_puts(b, ",", 1);
            ob_str(b, extra);
        }
        ob_puts(b, "}", 1);
    }
    ob_puts(b, " ", 1);
    ob_value(b, v);
    ob_puts(b, "\n", 1);
}

static void render_histogram(outbuf *b, const family *f, const series *s) {
    const pd_histogram *h = &s->u.h;
    uint64_t cum = 0;
    char le[96], num[64];
    for (size_t i = 0; i <= h->n; i++) {
        cum += atomic_load_explicit((_Atomic uint64_t *)&h->buckets[i], memory_order_relaxed);
        if (i < h->n) format_double(h->bounds[i], num, sizeof num);
        else snprintf(num, sizeof num, "+Inf");
        snprintf(le, sizeof le, "le=\"%s\"", num);
        ob_sample(b, f->name, "_bucket", s->labels, le, (double)cum);
    }
    /* _count is the +Inf bucket as read above, so a scrape racing with
     * observations is still self-consistent (count == last bucket). */
    ob_sample(b, f->name, "_sum", s->labels, NULL, atomic_dbl_load(&h->sum_bits));
    ob_sample(b, f->name, "_count", s->labels, NULL, (double)cum);
}

int pd_metrics_render(pd_metrics *m, char **out, size_t *len, pd_error *err) {
    if (!m || !out) return pd_errorf(err, PD_EINVAL, "pd_metrics_render: registry or out is NULL");
    pthread_mutex_lock(&m->mu);
    if (m->has_process) process_refresh(&m->proc);
    outbuf b = {0};
    ob_reserve(&b, 0); /* an empty registry still renders "" */
    for (size_t i = 0; i < m->n_fams; i++) {
        const family *f = m->fams[i];
        ob_str(&b, "# HELP ");
        ob_str(&b, f->name);
        ob_puts(&b, " ", 1);
        ob_help(&b, f->help);
        ob_str(&b, "\n# TYPE ");
        ob_str(&b, f->name);
        ob_puts(&b, " ", 1);
        ob_str(&b, type_name(f->type));
        ob_puts(&b, "\n", 1);
        for (size_t j = 0; j < f->n_series; j++) {
            const series *s = f->series[j];
            switch (f->type) {
            case MT_COUNTER: ob_sample(&b, f->name, "", s->labels, NULL, atomic_dbl_load(&s->u.c.bits)); break;
            case MT_GAUGE: ob_sample(&b, f->name, "", s->labels, NULL, atomic_dbl_load(&s->u.g.bits)); break;
            case MT_HISTOGRAM: render_histogram(&b, f, s); break;
            }
        }
    }
    pthread_mutex_unlock(&m->mu);
    if (b.oom) {
        free(b.data);
        return pd_errorf(err, PD_ENOMEM, "out of memory rendering metrics");
    }
    b.data[b.len] = '\0';
    *out = b.data;
    if (len) *len = b.len;
    return PD_OK;
}
