/* Context-calibrated compression: measure the NLL ratio of a held-out probe
 * at a few retentions, fit f(rho) = 1 + a (rho^-b - 1) with an asymmetric
 * squared loss, and keep the smallest retention whose predicted ratio stays
 * within the budget tau. */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "policies/policies.h"

/* Search box of the fit. a is clamped rather than allowed to reach 0 so the
 * curve stays monotone; a ratio that never rises above 1 fits to A_MIN,
 * whose inverse is the smallest retention allowed. */
#define A_MIN 1e-9
#define A_MAX 1e9
#define B_MIN 1e-3
#define B_MAX 10.0
#define B_GRID 161        /* log-spaced grid points over [B_MIN, B_MAX] */
#define GOLDEN_ITERS 100  /* shrinks the bracket by 0.618^100: far below double precision */

double pd_curve_eval(pd_curve c, double retention) {
    if (!(retention > 0)) return HUGE_VAL;
    return 1.0 + c.a * (pow(retention, -c.b) - 1.0);
}

double pd_curve_inverse(pd_curve c, double tau, double lo) {
    if (!(lo > 0) || lo > 1) lo = lo > 1 ? 1 : 0;
    if (!(tau > 1)) return 1.0;
    /* An unusable curve must never license compression. */
    if (!(c.a > 0) || !(c.b > 0) || !isfinite(c.a) || !isfinite(c.b)) return 1.0;
    double r = pow(1.0 + (tau - 1.0) / c.a, -1.0 / c.b);
    if (!(r <= 1)) r = 1; /* NaN as well */
    return r < lo ? lo : r;
}

/* Points of one fit: g[i] = rho_i^-b - 1 (>= 0), d[i] = ratio_i - 1. */
typedef struct fit_ctx {
    const double *rho, *y;
    int m;
    double uw;
    double *g, *bp; /* scratch, m each */
} fit_ctx;

static double asym_loss(const fit_ctx *f, double a) {
    double s = 0;
    for (int i = 0; i < f->m; i++) {
        const double r = (f->y[i] - 1.0) - a * f->g[i];
        s += (r > 0 ? f->uw : 1.0) * r * r;
    }
    return s;
}

/* d/da of the loss, up to the factor -2: sum w_i g_i r_i. Decreasing in a
 * (the loss is convex in a), so its root is the minimiser. */
static double asym_slope(const fit_ctx *f, double a) {
    double s = 0;
    for (int i = 0; i < f->m; i++) {
        const double r = (f->y[i] - 1.0) - a * f->g[i];
        s += (r > 0 ? f->uw : 1.0) * f->g[i] * r;
    }
    return s;
}

static int cmp_double(const void *pa, const void *pb) {
    const double x = *(const double *)pa, y = *(const double *)pb;
    return (x > y) - (x < y);
}

/* The exact minimiser over a for fixed g: the slope is piecewise linear with
 * breakpoints where a residual changes sign; find the piece holding the root
 * and solve the weighted least squares of that sign pattern. */
static double best_a(fit_ctx *f) {
    int nb = 0;
    for (int i = 0; i < f->m; i++)
        if (f->g[i] > 0) f->bp[nb++] = (f->y[i] - 1.0) / f->g[i];
    qsort(f->bp, (size_t)nb, sizeof *f->bp, cmp_double);
    int k = 0;
    while (k < nb && asym_slope(f, f->bp[k]) > 0) k++;
    /* The root lies in (bp[k-1], bp[k]]; pick a point inside to fix the signs. */
    double lo = k > 0 ? f->bp[k - 1] : -INFINITY, hi = k < nb ? f->bp[k] : INFINITY;
    double probe;
    if (k == 0) probe = nb ? hi - fmax(1.0, fabs(hi)) : 0.0;
    else if (k == nb) probe = lo + fmax(1.0, fabs(lo));
    else probe = 0.5 * (lo + hi);
    double num = 0, den = 0;
    for (int i = 0; i < f->m; i++) {
        const double w = ((f->y[i] - 1.0) - probe * f->g[i]) > 0 ? f->uw : 1.0;
        num += w * f->g[i] * (f->y[i] - 1.0);
        den += w * f->g[i] * f->g[i];
    }
    double a = den > 0 ? num / den : A_MIN;
    if (a < lo) a = lo; /* rounding only */
    if (a > hi) a = hi;
    /* The loss is convex in a, so clamping is the constrained optimum. */
    if (!(a >= A_MIN)) a = A_MIN;
    if (a > A_MAX) a = A_MAX;
    return a;
}

/* min over a of the loss at b = exp(logb). */
static double profile(fit_ctx *f, double logb, double *a_out) {
    const double b = exp(logb);
    for (int i = 0; i < f->m; i++) f->g[i] = pow(f->rho[i], -b) - 1.0;
    const double a = best_a(f);
    if (a_out) *a_out = a;
    return asym_loss(f, a);
}

int pd_curve_fit(const double *retention, const double *ratio, int m, double under_weight, pd_curve *out,
                 pd_error *err) {
    if (m < 2) return pd_errorf(err, PD_EINVAL, "curve fit: %d point(s); at least 2 are needed", m);
    if (!(under_weight > 0) || !isfinite(under_weight))
        return pd_errorf(err, PD_EINVAL, "curve fit: under_weight %g must be a positive number", under_weight);
    bool below_one = false;
    for (int i = 0; i < m; i++) {
        if (!(retention[i] > 0 && retention[i] <= 1))
            return pd_errorf(err, PD_EINVAL, "curve fit: retention[%d] = %g is outside (0, 1]", i, retention[i]);
        if (!(ratio[i] > 0) || !isfinite(ratio[i]))
            return pd_errorf(err, PD_EINVAL, "curve fit: ratio[%d] = %g must be a positive number", i, ratio[i]);
        if (retention[i] < 1) below_one = true;
    }
    /* f(1) = 1 whatever a and b are: points at 1 say nothing about the curve. */
    if (!below_one) return pd_errorf(err, PD_EINVAL, "curve fit: every retention is 1; measure at least one below 1");
    double *scratch = malloc(sizeof(double) * 2 * (size_t)m);
    if (!scratch) return pd_errorf(err, PD_ENOMEM, "curve fit: out of memory for %d points", m);
    fit_ctx f = {.rho = retention, .y = ratio, .m = m, .uw = under_weight, .g = scratch, .bp = scratch + m};

    /* The profile loss need not be unimodal over four decades of b: a grid
     * finds the basin, golden section refines inside it. */
    const double l0 = log(B_MIN), l1 = log(B_MAX), step = (l1 - l0) / (B_GRID - 1);
    int best = 0;
    double best_loss = INFINITY;
    for (int k = 0; k < B_GRID; k++) {
        const double loss = profile(&f, l0 + step * k, NULL);
        if (loss < best_loss) best_loss = loss, best = k;
    }
    double lo = l0 + step * (best > 0 ? best - 1 : 0), hi = l0 + step * (best < B_GRID - 1 ? best + 1 : B_GRID - 1);
    const double gr = 0.5 * (sqrt(5.0) - 1.0);
    double x1 = hi - gr * (hi - lo), x2 = lo + gr * (hi - lo);
    double f1 = profile(&f, x1, NULL), f2 = profile(&f, x2, NULL);
    for (int it = 0; it < GOLDEN_ITERS && hi - lo > 1e-15; it++) {
        if (f1 <= f2) {
            hi = x2, x2 = x1, f2 = f1;
            x1 = hi - gr * (hi - lo);
            f1 = profile(&f, x1, NULL);
        } else {
            lo = x1, x1 = x2, f1 = f2;
            x2 = lo + gr * (hi - lo);
            f2 = profile(&f, x2, NULL);
        }
    }
    double logb = f1 <= f2 ? x1 : x2, a;
    double loss = profile(&f, logb, &a);
    if (!(loss <= best_loss)) { /* never worse than the grid */
        logb = l0 + step * best;
        profile(&f, logb, &a);
    }
    free(scratch);
    out->a = a;
    out->b = exp(logb);
    return PD_OK;
}

void pd_calib_opts_default(pd_calib_opts *o) {
    memset(o, 0, sizeof *o);
    o->tau = 1.05;
    o->n_points = 4;
    o->points[0] = 0.5;
    o->points[1] = 0.25;
    o->points[2] = 0.125;
    o->points[3] = 0.0625;
    o->min_retention = 0.05;
    o->holdout = 0.2;
    o->probe = NULL;
    o->n_probe = 0;
    o->under_weight = 4.0;
}

/* The probe needs at least this many tokens (the first one is only fed), and
 * the calibration prefix at least this many, or the measurements are noise. */
#define MIN_PROBE 16
#define MIN_PREFIX 32

bool pd_calib_tau_valid(double tau) { return tau > 1.0 && tau <= PD_CALIB_TAU_MAX; }

/* At least min_points (and at most PD_CALIB_MAX_POINTS) retentions in (0, 1). */
static int check_points(const pd_calib_opts *o, int min_points, pd_error *err) {
    if (o->n_points < min_points || o->n_points > PD_CALIB_MAX_POINTS)
        return pd_errorf(err, PD_EINVAL, "calibration: n_points %d must be in [%d, %d]", o->n_points, min_points,
                         PD_CALIB_MAX_POINTS);
    for (int i = 0; i < o->n_points; i++)
        if (!(o->points[i] > 0 && o->points[i] < 1))
            return pd_errorf(err, PD_EINVAL, "calibration: points[%d] = %g must be a retention in (0, 1)", i,
                             o->points[i]);
    return PD_OK;
}

static int check_opts(const pd_calib_opts *o, pd_error *err) {
    if (!pd_calib_tau_valid(o->tau))
        return pd_errorf(err, PD_EINVAL, "calibration: tau %g must be above 1 and at most %g (the allowed NLL ratio)",
                         o->tau, PD_CALIB_TAU_MAX);
    int rc = check_points(o, 2, err);
    if (rc) return rc;
    if (!(o->min_retention > 0 && o->min_retention <= 1))
        return pd_errorf(err, PD_EINVAL, "calibration: min_retention %g must be in (0, 1]", o->min_retention);
    if (!(o->under_weight > 0) || !isfinite(o->under_weight))
        return pd_errorf(err, PD_EINVAL, "calibration: under_weight %g must be a positive number", o->under_weight);
    if (o->probe) {
        if (o->n_probe < 2)
            return pd_errorf(err, PD_EINVAL, "calibration: the probe has %" PRId64 " tokens; at least 2 are needed",
                             o->n_probe);
    } else if (!(o->holdout > 0 && o->holdout < 1)) {
        return pd_errorf(err, PD_EINVAL, "calibration: holdout %g must be a fraction in (0, 1)", o->holdout);
    }
    return PD_OK;
}

/* The layout cut to the first np tokens (spans that start there, shortened;
 * whitelisted ranges likewise). Arrays are malloc'd into *out. */
static int clip_layout(const pd_layout *in, int64_t np, pd_layout *out, pd_error *err) {
    memset(out, 0, sizeof *out);
    pd_span *spans = NULL;
    pd_range *wl = NULL;
    if (in->n_spans > 0 && !(spans = malloc(sizeof *spans * (size_t)in->n_spans))) goto oom;
    if (in->n_whitelist > 0 && !(wl = malloc(sizeof *wl * (size_t)in->n_whitelist))) goto oom;
    int ns = 0, nw = 0;
    for (int i = 0; i < in->n_spans; i++) {
        if (in->spans[i].start >= np) continue;
        spans[ns] = in->spans[i];
        if (spans[ns].end > np) spans[ns].end = np;
        ns++;
    }
    for (int i = 0; i < in->n_whitelist; i++) {
        if (in->whitelist[i].start >= np) continue;
        wl[nw] = in->whitelist[i];
        if (wl[nw].end > np) wl[nw].end = np;
        nw++;
    }
    out->spans = spans;
    out->n_spans = ns;
    out->whitelist = wl;
    out->n_whitelist = nw;
    return PD_OK;
oom:
    free(spans);
    free(wl);
    return pd_errorf(err, PD_ENOMEM, "calibration: out of memory for the layout");
}

typedef struct calib_run {
    pd_model *m;
    const pd_token *prefix;
    int64_t n_prefix;
    const pd_token *probe;
    int64_t n_probe;
    const pd_layout *layout;
    double nll_full;
    const pd_calib_opts *opts;  /* for the progress callback */
    int done, total;            /* measurements done and planned */
} calib_run;

/* One measurement done: tell the caller (pd_calib_opts.progress). */
static int step(calib_run *r, pd_error *err) {
    r->done++;
    if (r->done > r->total) r->total = r->done;
    if (!r->opts || !r->opts->progress) return PD_OK;
    return r->opts->progress(r->opts->progress_ctx, r->done, r->total, err);
}

/* NLL ratio of the probe after the prefix compressed at `retention`. */
static int measure(const calib_run *r, const pd_policy_spec *spec, double retention, double *ratio, pd_error *err) {
    pd_policy_spec s = *spec;
    pd_policy_spec_set_retention(&s, retention);
    pd_kv_prefix *p = NULL;
    double nll = 0;
    int rc = pd_compress_prefix(r->m, r->prefix, r->n_prefix, &s, r->layout, &p, NULL, err);
    if (!rc) rc = pd_nll(r->m, p, NULL, 0, r->probe, r->n_probe, &nll, err);
    pd_kv_prefix_free(p);
    if (rc) return pd_error_prefix(err, "calibration at retention %g", retention);
    *ratio = nll / r->nll_full;
    if (!(*ratio > 0) || !isfinite(*ratio))
        return pd_errorf(err, PD_ERANGE, "calibration at retention %g: the NLL ratio %g is not a positive number",
                         retention, *ratio);
    return PD_OK;
}

static int full_nll(calib_run *r, pd_error *err) {
    pd_seq *s = NULL;
    pd_kv_prefix *p = NULL;
    const int32_t ctx = pd_model_hparams(r->m)->n_ctx_train;
    if (r->n_prefix > ctx)
        return pd_errorf(err, PD_ERANGE, "calibration: the prefix has %" PRId64 " tokens, more than the context %d",
                         r->n_prefix, ctx);
    int rc = pd_seq_create(r->m, 0, &s, err);
    if (!rc) rc = pd_prefill(r->m, s, r->prefix, r->n_prefix, NULL, NULL, err);
    if (!rc) rc = pd_seq_to_prefix(s, &p, err);
    pd_seq_free(s);
    if (!rc) rc = pd_nll(r->m, p, NULL, 0, r->probe, r->n_probe, &r->nll_full, err);
    pd_kv_prefix_free(p);
    if (rc) return pd_error_prefix(err, "calibration, full prefix");
    if (!(r->nll_full > 0) || !isfinite(r->nll_full))
        return pd_errorf(err, PD_ERANGE, "calibration: the probe's NLL under the full prefix is %g; ratios need a "
                                         "positive NLL (use a longer or less predictable probe)",
                         r->nll_full);
    return PD_OK;
}

/* Choose the retention and check it on the probe. A choice whose measured
 * ratio exceeds tau becomes one more point of the fit (while the result has
 * room), and the next choice is at least the geometric midpoint between the
 * failed one and 1, so the retention only grows. If every check fails, the
 * smallest measured retention that is within tau together with every
 * measured retention above it is kept, or 1 (no compression). */
/* Rounded up to a multiple of 1e-4: the retention goes into the canonical
 * spec (the cache key), which should read 0.151, not 0.15097427627366566.
 * Rounding up never breaks the budget; the epsilon keeps exact multiples. */
static double tidy(double retention) {
    const double t = ceil(retention * 1e4 - 1e-6) / 1e4;
    return t > 1 ? 1 : t;
}

double pd_curve_choose(pd_curve c, double tau, double min_retention) {
    return tidy(pd_curve_inverse(c, tau, min_retention));
}

size_t pd_curve_policy_print(const pd_policy_spec *spec, char *buf, size_t cap) {
    char full[PD_POLICY_SPEC_MAX];
    pd_policy_spec_print(spec, full, sizeof full);
    /* Keys are "key=value" items after the ':' separated by ','; drop the
     * retention item and the separator in front of it. */
    char out[PD_POLICY_SPEC_MAX];
    size_t o = 0;
    const char *colon = strchr(full, ':');
    const size_t head = colon ? (size_t)(colon - full) : strlen(full);
    memcpy(out, full, head);
    o = head;
    bool first = true;
    for (const char *k = colon ? colon + 1 : NULL; k && *k;) {
        const char *end = strchr(k, ',');
        const size_t len = end ? (size_t)(end - k) : strlen(k);
        if (!(len > 10 && strncmp(k, "retention=", 10) == 0)) {
            out[o++] = first ? ':' : ',';
            memcpy(out + o, k, len);
            o += len;
            first = false;
        }
        k = end ? end + 1 : NULL;
    }
    out[o] = '\0';
    return (size_t)snprintf(buf, cap, "%s", out);
}

static int choose(calib_run *r, const pd_policy_spec *spec, const pd_calib_opts *o, pd_calib_result *res,
                  pd_error *err) {
    double chosen = tidy(pd_curve_inverse(res->curve, o->tau, o->min_retention));
    for (;;) {
        /* Retention 1 is the full prefix itself: its ratio is 1 by definition. */
        if (chosen >= 1) {
            res->chosen = 1;
            res->measured = 1;
            res->predicted = pd_curve_eval(res->curve, 1);
            return PD_OK;
        }
        double measured;
        int rc = measure(r, spec, chosen, &measured, err);
        if (rc) return rc;
        /* A miss with room left means one more check: plan it before
         * reporting, so done == total only on the last measurement. */
        if (!(measured <= o->tau) && res->n_points < PD_CALIB_MAX_POINTS) r->total++;
        if ((rc = step(r, err))) return rc;
        if (measured <= o->tau || res->n_points == PD_CALIB_MAX_POINTS) {
            res->chosen = chosen;
            res->measured = measured;
            res->predicted = pd_curve_eval(res->curve, chosen);
            if (measured <= o->tau) return PD_OK;
            break;
        }
        res->retention[res->n_points] = chosen;
        res->ratio[res->n_points] = measured;
        res->n_points++;
        if ((rc = pd_curve_fit(res->retention, res->ratio, res->n_points, o->under_weight, &res->curve, err)))
            return rc;
        const double next = pd_curve_inverse(res->curve, o->tau, o->min_retention), mid = sqrt(chosen);
        chosen = tidy(next > mid ? next : mid);
    }
    /* Out of checks: the measurements themselves decide. Entry n is the
     * last (failed) choice, which has no room in the arrays. */
    const int n = res->n_points;
    double best = 1, best_ratio = 1;
    for (int i = 0; i <= n; i++) {
        const double x = i < n ? res->retention[i] : res->chosen;
        double worst = 0;
        for (int j = 0; j <= n; j++)
            if ((j < n ? res->retention[j] : res->chosen) >= x) worst = fmax(worst, j < n ? res->ratio[j] : res->measured);
        if (worst <= o->tau && x < best) best = x, best_ratio = i < n ? res->ratio[i] : res->measured;
    }
    res->chosen = best;
    res->measured = best_ratio;
    res->predicted = pd_curve_eval(res->curve, best);
    return PD_OK;
}

int pd_calibrate(pd_model *m, const pd_token *tokens, int64_t n, const pd_policy_spec *spec,
                 const pd_layout *layout, const pd_calib_opts *opts, pd_calib_result *out,
                 pd_policy_spec *chosen_spec, pd_error *err) {
    pd_calib_opts defaults;
    if (!opts) {
        pd_calib_opts_default(&defaults);
        opts = &defaults;
    }
    int rc = pd_policy_spec_validate(spec, err);
    if (rc) return rc;
    if ((rc = check_opts(opts, err))) return rc;
    if (!tokens || n <= 0) return pd_errorf(err, PD_EINVAL, "calibration: the prefix is empty");
    if (layout && (rc = pd_layout_validate(layout, n, err))) return rc;

    /* Planned: the full prefix, each point, and one check of the choice. */
    calib_run r = {.m = m, .prefix = tokens, .n_prefix = n, .opts = opts, .total = opts->n_points + 2};
    pd_layout clipped = {0};
    bool own_layout = false;
    if (opts->probe) {
        r.probe = opts->probe;
        r.n_probe = opts->n_probe;
        r.layout = layout;
    } else {
        const int64_t n_probe = (int64_t)llround(opts->holdout * (double)n);
        if (n_probe < MIN_PROBE || n - n_probe < MIN_PREFIX)
            return pd_errorf(err, PD_EINVAL,
                             "calibration: %" PRId64 " tokens with holdout %g leave a probe of %" PRId64
                             " and a prefix of %" PRId64 " tokens; at least %d and %d are needed (give a longer "
                             "prefix, change the holdout or pass a probe)",
                             n, opts->holdout, n_probe, n - n_probe, MIN_PROBE, MIN_PREFIX);
        r.n_prefix = n - n_probe;
        r.probe = tokens + r.n_prefix;
        r.n_probe = n_probe;
        if (layout) {
            if ((rc = clip_layout(layout, r.n_prefix, &clipped, err))) return rc;
            own_layout = true;
            r.layout = &clipped;
        }
    }

    pd_calib_result res;
    memset(&res, 0, sizeof res);
    rc = full_nll(&r, err);
    if (!rc) rc = step(&r, err);
    res.nll_full = r.nll_full;
    res.n_points = opts->n_points;
    for (int i = 0; !rc && i < opts->n_points; i++) {
        res.retention[i] = opts->points[i];
        rc = measure(&r, spec, opts->points[i], &res.ratio[i], err);
        if (!rc) rc = step(&r, err);
    }
    if (!rc) rc = pd_curve_fit(res.retention, res.ratio, res.n_points, opts->under_weight, &res.curve, err);
    if (!rc) rc = choose(&r, spec, opts, &res, err);
    /* A choice of 1 needs no check: the planned one is dropped, so the
     * last call still says done == total. */
    if (!rc && r.done < r.total && opts->progress) {
        r.total = r.done;
        rc = opts->progress(opts->progress_ctx, r.done, r.total, err);
    }
    if (own_layout) {
        free((void *)clipped.spans);
        free((void *)clipped.whitelist);
    }
    if (rc) return rc;
    if (out) *out = res;
    if (chosen_spec) {
        *chosen_spec = *spec;
        pd_policy_spec_set_retention(chosen_spec, res.chosen);
    }
    return PD_OK;
}

/* ---- offline calibration over a set of texts ---------------------------- */

int pd_calib_measure_text(pd_model *m, const pd_token *tokens, int64_t n, const pd_policy_spec *spec,
                          const pd_calib_opts *opts, double *ratio, double *nll_full, pd_error *err) {
    pd_calib_opts defaults;
    if (!opts) {
        pd_calib_opts_default(&defaults);
        opts = &defaults;
    }
    int rc = pd_policy_spec_validate(spec, err);
    if (rc) return rc;
    if ((rc = check_points(opts, 1, err))) return rc;
    if (!(opts->holdout > 0 && opts->holdout < 1))
        return pd_errorf(err, PD_EINVAL, "calibration: holdout %g must be a fraction in (0, 1)", opts->holdout);
    if (!tokens || n <= 0) return pd_errorf(err, PD_EINVAL, "calibration: the text is empty");
    const int64_t n_cont = (int64_t)llround(opts->holdout * (double)n);
    if (n_cont < MIN_PROBE || n - n_cont < MIN_PREFIX)
        return pd_errorf(err, PD_EINVAL,
                         "calibration: %" PRId64 " tokens with holdout %g leave a continuation of %" PRId64
                         " and a prefix of %" PRId64 " tokens; at least %d and %d are needed (use a longer text "
                         "or change the holdout)",
                         n, opts->holdout, n_cont, n - n_cont, MIN_PROBE, MIN_PREFIX);
    calib_run r = {.m = m, .prefix = tokens, .n_prefix = n - n_cont, .probe = tokens + (n - n_cont),
                   .n_probe = n_cont, .opts = opts, .total = 1 + opts->n_points};
    if ((rc = full_nll(&r, err)) || (rc = step(&r, err))) return rc;
    for (int i = 0; i < opts->n_points; i++)
        if ((rc = measure(&r, spec, opts->points[i], &ratio[i], err)) || (rc = step(&r, err))) return rc;
    if (nll_full) *nll_full = r.nll_full;
    return PD_OK;
}

int pd_curve_fit_set(const double *points, int n_points, const double *ratios, int n_texts, double under_weight,
                     pd_curve *out, pd_error *err) {
    if (n_points < 1 || n_texts < 1)
        return pd_errorf(err, PD_EINVAL, "curve fit: %d text(s) with %d point(s) each; give at least one of each",
                         n_texts, n_points);
    if ((size_t)n_texts * (size_t)n_points > (size_t)INT32_MAX)
        return pd_errorf(err, PD_ERANGE, "curve fit: %d texts x %d points is too many", n_texts, n_points);
    const int m = n_texts * n_points;
    double *rho = malloc(sizeof(double) * (size_t)m);
    if (!rho) return pd_errorf(err, PD_ENOMEM, "curve fit: out of memory for %d points", m);
    for (int t = 0; t < n_texts; t++)
        for (int i = 0; i < n_points; i++) rho[t * n_points + i] = points[i];
    /* The loss is a sum over points, so pooling in any text order gives the
     * same minimiser; the fit itself is deterministic. */
    int rc = pd_curve_fit(rho, ratios, m, under_weight, out, err);
    free(rho);
    return rc;
}
