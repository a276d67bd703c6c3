/* Budgets and selection: how many tokens each layer keeps, and which.
 * Scorers only rank; every policy shares this code for protection (sinks,
 * recent window, whitelist), per-head or global top-k, ChunkKV chunks, the
 * two-criteria split of LASER-KV and fair per-span quotas. */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "policies/policies.h"

/* ------------------------------------------------------------------------
 * Budgets
 * ------------------------------------------------------------------------ */

static double clampd(double x, double lo, double hi) { return x < lo ? lo : x > hi ? hi : x; }

/* Layer l's point on the PyramidKV line from top (layer 0) to bottom. */
static double pyramid_line(double top, double bottom, int n_layer, int l) {
    return top - (top - bottom) * (double)l / (double)(n_layer - 1);
}

void pd_policy_budgets(const pd_policy_spec *spec, int n_layer, int64_t n, int64_t *out) {
    if (n_layer <= 0) return;
    if (n <= 0) {
        for (int l = 0; l < n_layer; l++) out[l] = 0;
        return;
    }
    double m;
    if (spec->retention >= 1) {
        m = (double)n; /* no compression, whatever the base */
    } else if (spec->scorer == PD_POLICY_COMPACTOR && spec->base == PD_BASE_UNPROTECTED) {
        /* compactor-vllm: round(ratio * (L - sinks - recent)), the
         * protected tokens ranked first inside it. */
        double free_n = (double)n - (double)spec->sink - (double)spec->recent;
        m = free_n > 0 ? round(spec->retention * free_n) : 0;
    } else {
        /* The epsilon makes floor(0.1 * 400) 40, not 39. */
        m = floor(spec->retention * (double)n + 1e-9);
    }
    int64_t mean = m < 1 ? 1 : m > (double)n ? n : (int64_t)m;
    if (spec->budget != PD_BUDGET_PYRAMID || n_layer == 1) {
        for (int l = 0; l < n_layer; l++) out[l] = mean;
        return;
    }

    /* PyramidKV: a line from 2M - M/beta down to M/beta, mean M. As in the
     * paper's code (and kvpress), when that line does not fit between the
     * observation window (the smallest budget must hold it) and the prefix
     * length, every layer gets the mean: SnapKV's budgets, but never less
     * than the window, which PyramidKV's code keeps on top of its budget. */
    double beta = spec->beta >= 1 ? spec->beta : 1;
    double bottom = (double)mean / beta, top = 2.0 * (double)mean - bottom;
    const int64_t window = spec->scorer == PD_POLICY_SNAPKV ? pd_policy_window(spec, n) : 1;
    if (bottom < (double)window || top > (double)n) {
        const int64_t keep = mean > window ? mean : window < n ? window : n;
        for (int l = 0; l < n_layer; l++) out[l] = keep;
        return;
    }

    /* Integer parts, then largest remainder (ties to the lower layer): the
     * greedy "most under-served layer next" is largest remainder on its
     * first pass. */
    int64_t total = n_layer * mean, sum = 0;
    for (int l = 0; l < n_layer; l++) {
        double c = pyramid_line(top, bottom, n_layer, l);
        int64_t q = (int64_t)floor(c);
        out[l] = q < 1 ? 1 : q > n ? n : q;
        sum += out[l];
    }
    while (sum < total) {
        int best = -1;
        double best_gap = 0;
        for (int l = 0; l < n_layer; l++) {
            if (out[l] >= n) continue;
            double gap = pyramid_line(top, bottom, n_layer, l) - (double)out[l];
            if (best < 0 || gap > best_gap) best = l, best_gap = gap;
        }
        out[best]++; /* one exists: total <= n_layer * n */
        sum++;
    }
    while (sum > total) {
        int best = -1;
        double best_gap = 0;
        for (int l = n_layer - 1; l >= 0; l--) {
            if (out[l] <= 1) continue;
            double gap = pyramid_line(top, bottom, n_layer, l) - (double)out[l];
            if (best < 0 || gap < best_gap) best = l, best_gap = gap;
        }
        out[best]--; /* one exists: total >= n_layer */
        sum--;
    }
    /* Rounding keeps the order in exact arithmetic; make it certain. */
    for (int l = 1; l < n_layer; l++) {
        int64_t v = out[l];
        int j = l;
        for (; j > 0 && out[j - 1] < v; j--) out[j] = out[j - 1];
        out[j] = v;
    }
}

/* ------------------------------------------------------------------------
 * Fair quotas
 * ------------------------------------------------------------------------ */

/* Weight of span s: the mix of the base policy's count and the fair share. */
static double quota_weight(int64_t free, const int64_t *free_len, const int64_t *base, int s, double debias,
                           double len_sum) {
    double b = base && base[s] > 0 ? (double)base[s] : 0;
    double fair = len_sum > 0 ? (double)free * (double)free_len[s] / len_sum : 0;
    return (1 - debias) * b + debias * fair;
}

void pd_fair_quotas(int64_t free, const int64_t *free_len, const int64_t *base, int n_spans, double debias,
                    double *carry, int64_t *quota) {
    if (n_spans <= 0) return;
    double d = isfinite(debias) ? clampd(debias, 0, 1) : 1;
    int64_t len_sum = 0;
    for (int s = 0; s < n_spans; s++) {
        quota[s] = 0;
        if (free_len[s] > 0) len_sum += free_len[s];
    }
    int64_t total = free < len_sum ? free : len_sum;
    if (total <= 0) return;

    double w_sum = 0;
    for (int s = 0; s < n_spans; s++)
        if (free_len[s] > 0) w_sum += quota_weight(free, free_len, base, s, d, (double)len_sum);
    /* No weight at all (a base policy that kept nothing, debias 0): fall
     * back to the fair share. */
    if (!(w_sum > 0)) d = 1;

    /* Capped proportional shares: target_s = min(lambda * w_s, len_s) with
     * lambda chosen so the targets sum to `total`. A span capped at one
     * lambda stays capped at every larger one, so iterating from the plain
     * proportional lambda converges in at most n_spans rounds. */
    double lambda = 0;
    for (int round = 0; round <= n_spans; round++) {
        double capped_len = 0, open_w = 0;
        for (int s = 0; s < n_spans; s++) {
            if (free_len[s] <= 0) continue;
            double w = quota_weight(free, free_len, base, s, d, (double)len_sum);
            if (round > 0 && lambda * w >= (double)free_len[s]) capped_len += (double)free_len[s];
            else open_w += w;
        }
        /* Every weighted span full: keep lambda (they stay capped); the
         * rest goes to weightless spans below. */
        if (!(open_w > 0)) break;
        double next = ((double)total - capped_len) / open_w;
        if (round > 0 && next == lambda) break;
        lambda = next;
    }

    int64_t sum = 0;
    for (int s = 0; s < n_spans; s++) {
        if (free_len[s] <= 0) continue;
        double w = quota_weight(free, free_len, base, s, d, (double)len_sum);
        double t = fmin(lambda * w, (double)free_len[s]);
        int64_t q = (int64_t)floor(t);
        quota[s] = q < 0 ? 0 : q > free_len[s] ? free_len[s] : q;
        sum += quota[s];
    }
    /* Largest remainder, ties to the lower span; then whatever is left
     * (weightless spans when the weighted ones are full) to the lower span
     * with room. With a carry, the remainder units go to the spans with a
     * fractional share that earlier groups shorted most, so that summed
     * over the groups (heads, layers) every span gets its share within one
     * entry instead of losing the same fraction in every group. At most
     * n_spans steps of O(n_spans). */
    while (sum < total) {
        int best = -1;
        bool best_frac = false;
        double best_key = 0;
        for (int s = 0; s < n_spans; s++) {
            if (quota[s] >= free_len[s]) continue;
            double w = quota_weight(free, free_len, base, s, d, (double)len_sum);
            double gap = fmin(lambda * w, (double)free_len[s]) - (double)quota[s];
            bool frac = gap > 0;
            double key = gap + (carry && frac ? carry[s] : 0);
            if (best < 0 || (frac && !best_frac) || (frac == best_frac && key > best_key))
                best = s, best_frac = frac, best_key = key;
        }
        quota[best]++; /* one has room: total <= sum(free_len) */
        sum++;
    }
    while (sum > total) { /* only from rounding slack in lambda */
        int best = -1;
        double best_gap = 0;
        for (int s = n_spans - 1; s >= 0; s--) {
            if (quota[s] <= 0) continue;
            double w = quota_weight(free, free_len, base, s, d, (double)len_sum);
            double gap = fmin(lambda * w, (double)free_len[s]) - (double)quota[s];
            if (best < 0 || gap < best_gap) best = s, best_gap = gap;
        }
        quota[best]--;
        sum--;
    }
    if (carry)
        for (int s = 0; s < n_spans; s++)
            if (free_len[s] > 0)
                carry[s] += fmin(lambda * quota_weight(free, free_len, base, s, d, (double)len_sum), (double)free_len[s]) -
                            (double)quota[s];
}

/* ------------------------------------------------------------------------
 * Selection
 * ------------------------------------------------------------------------ */

typedef struct entry {
    float score;
    int32_t head;
    int64_t tok;
} entry;

typedef struct unit {
    double score; /* sum of its free entries' scores */
    int64_t start, end, cost;
    int32_t head;
} unit;

/* Best first; ties to the earlier token, then the lower head. */
static int cmp_entry(const void *pa, const void *pb) {
    const entry *a = pa, *b = pb;
    if (a->score != b->score) return a->score > b->score ? -1 : 1;
    if (a->tok != b->tok) return a->tok < b->tok ? -1 : 1;
    return (a->head > b->head) - (a->head < b->head);
}

static int cmp_unit(const void *pa, const void *pb) {
    const unit *a = pa, *b = pb;
    if (a->score != b->score) return a->score > b->score ? -1 : 1;
    if (a->start != b->start) return a->start < b->start ? -1 : 1;
    return (a->head > b->head) - (a->head < b->head);
}

typedef struct selector {
    int64_t n;
    int n_head;
    int32_t chunk;
    uint8_t *keep;
    entry *ent;  /* scratch, one selection group */
    unit *units; /* scratch, chunk > 0 */
} selector;

/* The still-free entries of heads [h0, h1) x tokens [lo, hi) into ent. */
static size_t gather(const selector *s, int h0, int h1, int64_t lo, int64_t hi, const float *sc) {
    size_t m = 0;
    for (int h = h0; h < h1; h++) {
        const uint8_t *kp = s->keep + (size_t)h * (size_t)s->n;
        const float *sp = sc + (size_t)h * (size_t)s->n;
        for (int64_t t = lo; t < hi; t++)
            if (!kp[t]) s->ent[m++] = (entry){sp[t], h, t};
    }
    return m;
}

static void keep_best(selector *s, size_t m, int64_t k) {
    if (k <= 0 || m == 0) return;
    qsort(s->ent, m, sizeof *s->ent, cmp_entry);
    size_t take = (uint64_t)k < m ? (size_t)k : m;
    for (size_t i = 0; i < take; i++)
        s->keep[(size_t)s->ent[i].head * (size_t)s->n + (size_t)s->ent[i].tok] = 1;
}

/* Keep the best k still-free entries of heads [h0, h1) x tokens [lo, hi),
 * ranked by sc. With chunks (boundaries at lo + j * chunk) the best whole
 * chunks are taken while they fit and the first one that does not fit is
 * taken partially, by its best entries, to use the budget exactly. */
static void pick(selector *s, int h0, int h1, int64_t lo, int64_t hi, int64_t k, const float *sc) {
    if (k <= 0 || lo >= hi) return;
    if (s->chunk <= 0) {
        keep_best(s, gather(s, h0, h1, lo, hi, sc), k);
        return;
    }
    size_t nu = 0;
    for (int h = h0; h < h1; h++) {
        const uint8_t *kp = s->keep + (size_t)h * (size_t)s->n;
        const float *sp = sc + (size_t)h * (size_t)s->n;
        for (int64_t c0 = lo; c0 < hi;) {
            int64_t c1 = hi - c0 > s->chunk ? c0 + s->chunk : hi;
            unit u = {0, c0, c1, 0, h};
            for (int64_t t = c0; t < c1; t++) {
                if (kp[t]) continue;
                u.score += sp[t];
                u.cost++;
            }
            if (u.cost > 0) s->units[nu++] = u;
            c0 = c1;
        }
    }
    qsort(s->units, nu, sizeof *s->units, cmp_unit);
    int64_t left = k;
    for (size_t i = 0; i < nu && left > 0; i++) {
        const unit *u = &s->units[i];
        if (u->cost <= left) {
            uint8_t *kp = s->keep + (size_t)u->head * (size_t)s->n;
            for (int64_t t = u->start; t < u->end; t++) kp[t] = 1;
            left -= u->cost;
        } else {
            keep_best(s, gather(s, u->head, u->head + 1, u->start, u->end, sc), left);
            left = 0;
        }
    }
}

/* pick() with the two-criteria split: floor(share * k) by sc1, the rest
 * by sc2 among what sc1 left. */
static void pick2(selector *s, const pd_select_args *a, int h0, int h1, int64_t lo, int64_t hi, int64_t k,
                  const float *sc1, const float *sc2) {
    if (!sc2) {
        pick(s, h0, h1, lo, hi, k, sc1);
        return;
    }
    int64_t k1 = (int64_t)floor(a->share * (double)k);
    if (k1 > k) k1 = k;
    pick(s, h0, h1, lo, hi, k1, sc1);
    pick(s, h0, h1, lo, hi, k - k1, sc2);
}

static int check_finite(const float *x, size_t len, const char *what, int64_t n, pd_error *err) {
    if (!x) return PD_OK;
    for (size_t i = 0; i < len; i++)
        if (!isfinite(x[i]))
            return pd_errorf(err, PD_EINVAL, "selection: %s of kv head %" PRId64 ", token %" PRId64 " is not "
                             "finite (%g); scorers must return finite scores", what, (int64_t)(i / (size_t)n),
                             (int64_t)(i % (size_t)n), (double)x[i]);
    return PD_OK;
}

static int check_args(const pd_select_args *a, size_t total, pd_error *err) {
    if (a->n < 0 || a->n_head_kv < 1)
        return pd_errorf(err, PD_EINVAL, "selection: %" PRId64 " tokens and %d kv heads; need n >= 0 and at least "
                         "one kv head", a->n, a->n_head_kv);
    if (a->mode != PD_BUDGET_UNIFORM && a->mode != PD_BUDGET_PYRAMID && a->mode != PD_BUDGET_GLOBAL)
        return pd_errorf(err, PD_EINVAL, "selection: budget mode %d is not uniform, pyramid or global", (int)a->mode);
    if (a->budget < 0 || a->sink < 0 || a->recent < 0 || a->chunk < 0)
        return pd_errorf(err, PD_EINVAL, "selection: budget %" PRId64 ", sink %" PRId64 ", recent %" PRId64
                         ", chunk %" PRId32 " must all be >= 0", a->budget, a->sink, a->recent, a->chunk);
    if (a->n > 0 && !a->scores) return pd_errorf(err, PD_EINVAL, "selection: no scores given");
    if (a->scores2 && !(a->share >= 0 && a->share <= 1))
        return pd_errorf(err, PD_EINVAL, "selection: share %g of the first criterion must be in [0, 1]", a->share);
    int rc = pd_layout_validate(a->layout, a->n, err);
    if (rc) return pd_error_prefix(err, "selection");
    if (a->quotas && (!a->layout || a->layout->n_spans < 1))
        return pd_errorf(err, PD_EINVAL, "selection: per-span quotas (fair eviction) need a layout with spans");
    if (a->n == 0) return PD_OK;
    if ((rc = check_finite(a->scores, total, "score", a->n, err))) return rc;
    if ((rc = check_finite(a->scores2, total, "second-criterion score", a->n, err))) return rc;
    return check_finite(a->local_scores, a->scores2 ? 2 * total : total, "span-local score", a->n, err);
}

/* Mark the protected tokens of one head (the same for every head) in prot:
 * whitelist, then sinks from the front, then recent from the back, while
 * `room` lasts. Returns the number protected, or -1 if the whitelist alone
 * does not fit (*n_white says how many it has). */
static int64_t protect(const pd_select_args *a, int64_t room, uint8_t *prot, int64_t *n_white) {
    int64_t n = a->n, count = 0;
    memset(prot, 0, (size_t)n);
    const pd_layout *lay = a->layout;
    for (int i = 0; lay && i < lay->n_spans; i++) {
        const pd_span *sp = &lay->spans[i];
        if (sp->whitelist) memset(prot + sp->start, 1, (size_t)(sp->end - sp->start));
    }
    for (int i = 0; lay && i < lay->n_whitelist; i++) {
        const pd_range *r = &lay->whitelist[i];
        memset(prot + r->start, 1, (size_t)(r->end - r->start));
    }
    for (int64_t t = 0; t < n; t++) count += prot[t];
    *n_white = count;
    if (count > room) return -1;
    for (int64_t t = 0; t < n && t < a->sink && count < room; t++)
        if (!prot[t]) prot[t] = 1, count++;
    for (int64_t t = n - 1, i = 0; t >= 0 && i < a->recent && count < room; t--, i++)
        if (!prot[t]) prot[t] = 1, count++;
    return count;
}

int64_t pd_policy_protected(const pd_select_args *a, uint8_t *prot) {
    int64_t n_white, room = a->mode == PD_BUDGET_GLOBAL ? a->budget / a->n_head_kv : a->budget;
    return protect(a, room, prot, &n_white);
}

int pd_policy_select(const pd_select_args *a, uint8_t *keep, pd_error *err) {
    uint64_t total64 = 0;
    if (a->n >= 0 && a->n_head_kv >= 1 && (!pd_mul_ok((uint64_t)a->n, (uint64_t)a->n_head_kv, &total64) ||
                                           total64 > SIZE_MAX / sizeof(entry)))
        return pd_errorf(err, PD_ERANGE, "selection: %" PRId64 " tokens x %d kv heads is too large", a->n,
                         a->n_head_kv);
    int rc = check_args(a, (size_t)total64, err);
    if (rc) return rc;
    int64_t n = a->n;
    int H = a->n_head_kv;
    size_t total = (size_t)total64;
    bool global = a->mode == PD_BUDGET_GLOBAL;
    if (n == 0) return PD_OK;

    /* Budget covers everything: nothing to choose. */
    if ((global && (uint64_t)a->budget >= total64) || (!global && a->budget >= n)) {
        memset(keep, 1, total);
        return PD_OK;
    }

    /* Global mode protects the same tokens in every head, each head
     * getting an equal floor(budget / heads) of room for them. */
    int64_t room = global ? a->budget / H : a->budget;
    uint8_t *prot = malloc((size_t)n);
    if (!prot) return pd_errorf(err, PD_ENOMEM, "out of memory for selection over %" PRId64 " tokens", n);
    int64_t n_white, n_prot = protect(a, room, prot, &n_white);
    if (n_prot < 0) {
        free(prot);
        if (global)
            return pd_errorf(err, PD_ERANGE, "selection: the whitelist keeps %" PRId64 " tokens x %d kv heads = %"
                             PRId64 " pairs but the layer's budget is %" PRId64 " pairs; raise retention above %.4g "
                             "(whitelisted/tokens) or whitelist fewer tokens", n_white, H, n_white * H, a->budget,
                             (double)n_white / (double)n);
        return pd_errorf(err, PD_ERANGE, "selection: the whitelist keeps %" PRId64 " tokens but the budget is %"
                         PRId64 " tokens per kv head; raise retention above %.4g (whitelisted/tokens, more with "
                         "budget=pyramid) or whitelist fewer tokens", n_white, a->budget,
                         (double)n_white / (double)n);
    }
    /* Free budget per selection group (one head, or the whole layer). */
    int64_t free_budget = global ? a->budget - n_prot * H : a->budget - n_prot;
    int n_groups = global ? 1 : H, group_heads = global ? H : 1;

    const pd_layout *lay = a->layout;
    if (a->quotas) {
        for (int g = 0; g < n_groups; g++) {
            const int64_t *q = a->quotas + (size_t)g * (size_t)lay->n_spans;
            int64_t sum = 0;
            for (int s = 0; s < lay->n_spans; s++) {
                int64_t free_len = 0;
                for (int64_t t = lay->spans[s].start; t < lay->spans[s].end; t++) free_len += !prot[t];
                free_len *= group_heads;
                if (q[s] < 0 || q[s] > free_len) {
                    free(prot);
                    return pd_errorf(err, PD_EINVAL, "selection: quota %" PRId64 " of span %d '%s'%s is outside "
                                     "0..%" PRId64 " (its free entries)", q[s], s, lay->spans[s].name,
                                     global ? "" : " (per head)", free_len);
                }
                sum += q[s];
            }
            if (sum > free_budget) {
                free(prot);
                return pd_errorf(err, PD_EINVAL, "selection: span quotas%s sum to %" PRId64 " but only %" PRId64
                                 " entries are left after protection", global ? "" : " of a kv head", sum,
                                 free_budget);
            }
        }
    }

    /* Shared chunks (kvpress ChunkKVPress): every head ranks by the scores
     * summed over the kv heads; protection is the same in every head, so
     * every head then keeps the same chunks. */
    float *shared = NULL;
    const float *rank_scores = a->scores, *rank_local = a->local_scores;
    if (a->chunk > 0 && a->shared_chunks && H > 1) {
        const bool local = a->local_scores != NULL;
        shared = malloc(sizeof *shared * total * (local ? 2 : 1));
        if (!shared) {
            free(prot);
            return pd_errorf(err, PD_ENOMEM, "out of memory for shared chunk scores over %zu entries", total);
        }
        for (int v = 0; v < (local ? 2 : 1); v++) {
            const float *src = v ? a->local_scores : a->scores;
            float *dst = shared + (size_t)v * total;
            for (int64_t t = 0; t < n; t++) {
                double sum = 0;
                for (int h = 0; h < H; h++) sum += src[(size_t)h * (size_t)n + (size_t)t];
                for (int h = 0; h < H; h++) dst[(size_t)h * (size_t)n + (size_t)t] = (float)sum;
            }
        }
        rank_scores = shared;
        if (local) rank_local = shared + total;
    }

    size_t group = global ? total : (size_t)n;
    selector s = {n, H, a->chunk, keep, NULL, NULL};
    s.ent = malloc(group * sizeof *s.ent);
    if (a->chunk > 0) s.units = malloc(group * sizeof *s.units);
    if (!s.ent || (a->chunk > 0 && !s.units)) {
        free(s.ent);
        free(s.units);
        free(prot);
        free(shared);
        return pd_errorf(err, PD_ENOMEM, "out of memory for selection over %zu entries", group);
    }

    memset(keep, 0, total);
    for (int h = 0; h < H; h++) memcpy(keep + (size_t)h * (size_t)n, prot, (size_t)n);
    for (int g = 0; g < n_groups; g++) {
        int h0 = global ? 0 : g, h1 = global ? H : g + 1;
        int64_t left = free_budget;
        if (a->quotas) {
            const int64_t *q = a->quotas + (size_t)g * (size_t)lay->n_spans;
            const float *rank = rank_local ? rank_local : rank_scores;
            const float *rank2 = !a->scores2 ? NULL : a->local_scores ? a->local_scores + total : a->scores2;
            for (int sp = 0; sp < lay->n_spans; sp++) {
                pick2(&s, a, h0, h1, lay->spans[sp].start, lay->spans[sp].end, q[sp], rank, rank2);
                left -= q[sp];
            }
        }
        /* Without quotas all of it; with quotas that sum short, the rest. */
        pick2(&s, a, h0, h1, 0, n, left, rank_scores, a->scores2);
    }
    free(s.ent);
    free(s.units);
    free(prot);
    free(shared);
    return PD_OK;
}
