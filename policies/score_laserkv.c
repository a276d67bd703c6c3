/* LASER-KV (Sood et al., arXiv 2602.02199, "Layer Accumulated Selection with
 * Exact-LSH Recall"): two criteria per layer. The budget split (B/n anchors,
 * B/n recent, the rest alpha : 1 - alpha between the criteria, the second
 * choosing among tokens the first did not) is done by the selection code.
 * Only the paper's abstract was readable here; the details below come from
 * the official code (github.com/zer0-data/LASER-KV).
 *
 * Criterion 1, exact attention: the weights of the observation queries (the
 * last w = min(window, len) queries of the range, causal softmax over keys
 * [lo, query]) summed over the queries and over ALL query heads of the
 * layer, so every kv head gets the same scores: LASER-KV selects tokens, not
 * (token, head) pairs (official code, bmrt/flash_scorer.py: softmax(QK^T /
 * sqrt(d)) summed over heads and queries; it also sums over layers, which a
 * per-layer hook cannot).
 *
 * Criterion 2, LSH collisions (SimHash, sign random projections):
 * `rounds` hash tables of `bits` Gaussian hyperplanes each in head_dim space,
 * drawn per layer with pd_gaussian_sketch(laserkv_layer_seed(seed, layer),
 * head_dim, rounds * bits) (column r * bits + b is bit b of table r). A
 * vector's code in table r has bit b set when its projection on that
 * hyperplane is > 0. Keys are centred by the mean key of the range (per kv
 * head) before hashing, as the official code does (bmrt/selectors/
 * lsh_core.py); that is attention-invariant (softmax ignores an offset shared
 * by all keys). Key j's score is the number of (table, observation query,
 * query head) with the query's code equal to the key's code (the query head
 * compared with its own kv head's key), summed over all query heads like
 * criterion 1, so it too is shared by the kv heads.
 * Differences from the official code, which hashes last-layer KEYS of the
 * appended question (mean over heads) against the context keys, both
 * centred, and combines tables either by counting the tables in which any
 * query shares the key's bucket (`frequency_rank`) or by MagicPIG's
 * collision probability (`magicpig_baseline`, its canonical setting): we hash
 * the observation tokens' queries, the vectors attention actually uses, left
 * uncentred (centring them by the key mean would change what they attend
 * to), per layer, and count every (table, query, head) collision, which does
 * not saturate when many queries cover most buckets. */
#include <cblas.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "policies/scorers.h"

/* Each layer draws its own hyperplanes from (spec seed, layer). */
static uint64_t laserkv_layer_seed(uint64_t seed, int layer) {
    return pd_mix64(seed ^ pd_mix64((uint64_t)(uint32_t)layer));
}

/* The hyperplanes and what hashing needs besides the vectors. */
typedef struct lsh {
    int d, rounds, bits, nb;  /* nb = rounds * bits */
    const float *planes;      /* [d][nb] */
    const double *col_norm;   /* [nb] */
} lsh;

/* Codes of n vectors (rows of x with `stride`, minus `mu` when given):
 * codes[i * rounds + r]. proj is [n][nb] scratch. Projections are float
 * (sgemm); those within float rounding of 0 are recomputed in double so a
 * sign never depends on the BLAS summation order. */
static void lsh_codes(const lsh *l, const float *x, int stride, int64_t n, const double *mu, float *xc, float *proj,
                      uint32_t *codes) {
    const float *src = x;
    int src_stride = stride;
    if (mu) {
        for (int64_t i = 0; i < n; i++)
            for (int k = 0; k < l->d; k++) xc[i * l->d + k] = (float)((double)x[i * stride + k] - mu[k]);
        src = xc;
        src_stride = l->d;
    }
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)n, l->nb, l->d, 1.0f, src, src_stride, l->planes,
                l->nb, 0.0f, proj, l->nb);
    for (int64_t i = 0; i < n; i++) {
        const float *xi = x + i * stride;
        double xn = 0;
        for (int k = 0; k < l->d; k++) {
            double e = (double)xi[k] - (mu ? mu[k] : 0.0);
            xn += e * e;
        }
        xn = sqrt(xn);
        for (int r = 0; r < l->rounds; r++) {
            uint32_t code = 0;
            for (int b = 0; b < l->bits; b++) {
                int col = r * l->bits + b;
                double p = proj[i * l->nb + col];
                if (fabs(p) <= 1e-4 * xn * l->col_norm[col]) {
                    p = 0;
                    for (int k = 0; k < l->d; k++)
                        p += ((double)xi[k] - (mu ? mu[k] : 0.0)) * (double)l->planes[k * l->nb + col];
                }
                if (p > 0) code |= (uint32_t)1 << b;
            }
            codes[i * l->rounds + r] = code;
        }
    }
}

static int cmp_u32(const void *a, const void *b) {
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

/* How many of the n sorted values equal v. */
static int64_t count_equal(const uint32_t *sorted, int64_t n, uint32_t v) {
    int64_t lo = 0, hi = n;
    while (lo < hi) { /* first >= v */
        int64_t mid = lo + (hi - lo) / 2;
        if (sorted[mid] < v)
            lo = mid + 1;
        else
            hi = mid;
    }
    int64_t first = lo;
    hi = n;
    while (lo < hi) { /* first > v */
        int64_t mid = lo + (hi - lo) / 2;
        if (sorted[mid] <= v)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo - first;
}

typedef struct lsh_scratch {
    float *planes, *xc, *proj;
    double *col_norm, *mu;
    uint32_t *kcodes, *qcodes, *sorted;
} lsh_scratch;

/* Criterion 2 into acc[len] (summed over every query head). */
static void lsh_collisions(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t len, int64_t w,
                           lsh_scratch *s, double *acc) {
    int d = kv->head_dim, g = kv->n_head / kv->n_head_kv, nq = (int)w * g;
    lsh l = {.d = d, .rounds = spec->rounds, .bits = spec->bits, .nb = spec->rounds * spec->bits};
    pd_gaussian_sketch(laserkv_layer_seed(spec->seed, kv->layer), d, l.nb, s->planes);
    for (int c = 0; c < l.nb; c++) {
        double n2 = 0;
        for (int k = 0; k < d; k++) n2 += (double)s->planes[k * l.nb + c] * s->planes[k * l.nb + c];
        s->col_norm[c] = sqrt(n2);
    }
    l.planes = s->planes;
    l.col_norm = s->col_norm;
    int q_stride = kv->n_head * d, k_stride = kv->n_head_kv * d;
    memset(acc, 0, (size_t)len * sizeof *acc);
    for (int h = 0; h < kv->n_head_kv; h++) {
        const float *k = kv->k + (size_t)lo * (size_t)k_stride + (size_t)h * (size_t)d;
        for (int i = 0; i < d; i++) s->mu[i] = 0;
        for (int64_t j = 0; j < len; j++)
            for (int i = 0; i < d; i++) s->mu[i] += k[j * k_stride + i];
        for (int i = 0; i < d; i++) s->mu[i] /= (double)len;
        lsh_codes(&l, k, k_stride, len, s->mu, s->xc, s->proj, s->kcodes);
        /* qcodes[(a - h g) * w + t][r] for the group's heads a */
        for (int a = h * g; a < (h + 1) * g; a++) {
            const float *q = kv->q + (size_t)(lo + len - w) * (size_t)q_stride + (size_t)a * (size_t)d;
            lsh_codes(&l, q, q_stride, w, NULL, NULL, s->proj, s->qcodes + (size_t)(a - h * g) * (size_t)w * l.rounds);
        }
        for (int r = 0; r < l.rounds; r++) {
            for (int i = 0; i < nq; i++) s->sorted[i] = s->qcodes[(size_t)i * l.rounds + r];
            qsort(s->sorted, (size_t)nq, sizeof *s->sorted, cmp_u32);
            for (int64_t j = 0; j < len; j++) acc[j] += (double)count_equal(s->sorted, nq, s->kcodes[j * l.rounds + r]);
        }
    }
}

int pd_score_laserkv(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi, float *scores,
                     pd_error *err) {
    if (!kv || !kv->q || !kv->k)
        return pd_errorf(err, PD_EINVAL, "laserkv: the layer has no q/k rows to score");
    if (kv->n_head <= 0 || kv->n_head_kv <= 0 || kv->head_dim <= 0 || kv->n_head % kv->n_head_kv != 0)
        return pd_errorf(err, PD_EINVAL, "laserkv: %d query heads do not form groups over %d kv heads (head_dim %d)",
                         kv->n_head, kv->n_head_kv, kv->head_dim);
    if (lo < 0 || hi <= lo || hi > kv->n_tokens)
        return pd_errorf(err, PD_EINVAL,
                         "laserkv: token range [%" PRId64 ", %" PRId64 ") is empty or not inside [0, %" PRId64 ")", lo,
                         hi, kv->n_tokens);
    if (spec->window < 0)
        return pd_errorf(err, PD_EINVAL, "laserkv: window must be 0 (auto) or at least 1 observation query (got %d)",
                         spec->window);
    if (spec->rounds < 1 || spec->rounds > 64)
        return pd_errorf(err, PD_EINVAL, "laserkv: rounds must be in 1..64 (got %d)", spec->rounds);
    if (spec->bits < 1 || spec->bits > 32)
        return pd_errorf(err, PD_EINVAL, "laserkv: bits must be in 1..32 (got %d)", spec->bits);
    int64_t len = hi - lo, w = pd_policy_window(spec, len);
    int g = kv->n_head / kv->n_head_kv;
    if (len > INT_MAX || (int64_t)kv->n_head * kv->head_dim > INT_MAX || w * g > INT_MAX)
        return pd_errorf(err, PD_EINVAL, "laserkv: ranges over %d tokens or rows over %d floats are not supported",
                         INT_MAX, INT_MAX);
    int d = kv->head_dim, nb = spec->rounds * spec->bits;
    int64_t n_kv = kv->n_head_kv, rows_n = len > w ? len : w;
    float *rows = pd_scorer_alloc(w * len, sizeof(float), "laserkv", err);
    double *acc = pd_scorer_alloc(len, sizeof(double), "laserkv", err);
    lsh_scratch s = {
        .planes = pd_scorer_alloc((int64_t)d * nb, sizeof(float), "laserkv", err),
        .xc = pd_scorer_alloc(len * d, sizeof(float), "laserkv", err),
        .proj = pd_scorer_alloc(rows_n * nb, sizeof(float), "laserkv", err),
        .col_norm = pd_scorer_alloc(nb, sizeof(double), "laserkv", err),
        .mu = pd_scorer_alloc(d, sizeof(double), "laserkv", err),
        .kcodes = pd_scorer_alloc(len * spec->rounds, sizeof(uint32_t), "laserkv", err),
        .qcodes = pd_scorer_alloc(w * g * spec->rounds, sizeof(uint32_t), "laserkv", err),
        .sorted = pd_scorer_alloc(w * g, sizeof(uint32_t), "laserkv", err),
    };
    int rc = PD_OK;
    if (!rows || !acc || !s.planes || !s.xc || !s.proj || !s.col_norm || !s.mu || !s.kcodes || !s.qcodes ||
        !s.sorted) {
        rc = PD_ENOMEM;
        goto out;
    }

    memset(acc, 0, (size_t)len * sizeof *acc);
    for (int a = 0; a < kv->n_head; a++) {
        pd_attention_rows(kv, lo, a, hi - w, w, rows, len, NULL);
        for (int64_t t = 0; t < w; t++)
            for (int64_t j = 0; j < len; j++) acc[j] += rows[t * len + j];
    }
    for (int64_t h = 0; h < n_kv; h++)
        for (int64_t j = 0; j < len; j++) scores[h * len + j] = (float)acc[j];

    lsh_collisions(spec, kv, lo, len, w, &s, acc);
    float *s2 = scores + n_kv * len;
    for (int64_t h = 0; h < n_kv; h++)
        for (int64_t j = 0; j < len; j++) s2[h * len + j] = (float)acc[j];
out:
    free(rows);
    free(acc);
    free(s.planes);
    free(s.xc);
    free(s.proj);
    free(s.col_norm);
    free(s.mu);
    free(s.kcodes);
    free(s.qcodes);
    free(s.sorted);
    return rc;
}
