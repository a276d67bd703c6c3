/* Attention scorers: SnapKV, H2O (observed attention), TOVA and OBCache.
 *
 * SnapKV, H2O and TOVA follow NVIDIA kvpress (snapkv_press.py,
 * observed_attention_press.py, tova_press.py); OBCache follows Gu et al.,
 * arXiv 2510.07651. Deviations are written at each scorer.
 *
 * Every scorer is span-local: only queries and keys of [lo, hi) are used and
 * query i attends causally to keys [lo, i] with softmax(q.k / sqrt(d)), the
 * model's own attention restricted to the range. These are one-shot,
 * query-agnostic compressions of a prefix, so the "observation" queries are
 * the range's own last tokens. Query rows are computed a block at a time
 * with sgemm: memory is O(rows * len), never O(len^2). */
#include <cblas.h>
#include <inttypes.h>
#include <limits.h>
#include <stdbool.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "policies/scorers.h"

/* H2O needs every query of the range; this many rows share one sgemm. */
#define H2O_BLOCK 64

typedef struct attn_ctx {
    const pd_layer_kv *kv;
    int64_t lo, len;
    int d, g;                /* head_dim, query heads per kv head */
    int q_stride, k_stride;  /* floats between consecutive tokens' rows */
} attn_ctx;

/* BLAS takes int dimensions, hence the INT_MAX limits. */
static int attn_ctx_init(const char *name, const pd_layer_kv *kv, bool need_v, int64_t lo, int64_t hi, attn_ctx *c,
                         pd_error *err) {
    if (!kv || !kv->q || !kv->k || (need_v && !kv->v))
        return pd_errorf(err, PD_EINVAL, "%s: the layer has no %s rows to score", name, need_v ? "q/k/v" : "q/k");
    if (kv->n_head <= 0 || kv->n_head_kv <= 0 || kv->head_dim <= 0 || kv->n_head % kv->n_head_kv != 0)
        return pd_errorf(err, PD_EINVAL, "%s: %d query heads do not form groups over %d kv heads (head_dim %d)", name,
                         kv->n_head, kv->n_head_kv, kv->head_dim);
    if (lo < 0 || hi <= lo || hi > kv->n_tokens)
        return pd_errorf(err, PD_EINVAL,
                         "%s: token range [%" PRId64 ", %" PRId64 ") is empty or not inside [0, %" PRId64 ")", name,
                         lo, hi, kv->n_tokens);
    if (hi - lo > INT_MAX || (int64_t)kv->n_head * kv->head_dim > INT_MAX)
        return pd_errorf(err, PD_EINVAL, "%s: ranges over %d tokens or rows over %d floats are not supported", name,
                         INT_MAX, INT_MAX);
    c->kv = kv;
    c->lo = lo;
    c->len = hi - lo;
    c->d = kv->head_dim;
    c->g = kv->n_head / kv->n_head_kv;
    c->q_stride = kv->n_head * kv->head_dim;
    c->k_stride = kv->n_head_kv * kv->head_dim;
    return PD_OK;
}

void pd_attention_rows(const pd_layer_kv *kv, int64_t lo, int a, int64_t q0, int64_t nq, float *out, int64_t ld,
                       float *logits) {
    const int d = kv->head_dim, q_stride = kv->n_head * d, k_stride = kv->n_head_kv * d;
    const int h = a / (kv->n_head / kv->n_head_kv);
    const int64_t ncols = q0 + nq - lo;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)nq, (int)ncols, d, (float)(1.0 / sqrt((double)d)),
                kv->q + (size_t)q0 * (size_t)q_stride + (size_t)a * (size_t)d, q_stride,
                kv->k + (size_t)lo * (size_t)k_stride + (size_t)h * (size_t)d, k_stride, 0.0f, out, (int)ld);
    for (int64_t t = 0; t < nq; t++) {
        float *row = out + t * ld;
        int64_t lim = q0 + t - lo + 1;
        if (logits) {
            memcpy(logits + t * ld, row, (size_t)lim * sizeof *row);
            memset(logits + t * ld + lim, 0, (size_t)(ld - lim) * sizeof *row);
        }
        float m = row[0];
        for (int64_t j = 1; j < lim; j++) m = fmaxf(m, row[j]);
        double sum = 0;
        for (int64_t j = 0; j < lim; j++) {
            row[j] = expf(row[j] - m);
            sum += row[j];
        }
        float inv = (float)(1.0 / sum); /* sum >= 1: the maximum contributes exp(0) */
        for (int64_t j = 0; j < lim; j++) row[j] *= inv;
        memset(row + lim, 0, (size_t)(ld - lim) * sizeof *row);
    }
}

static void attn_rows(const attn_ctx *c, int a, int64_t q0, int64_t nq, float *out, int64_t ld, float *logits) {
    pd_attention_rows(c->kv, c->lo, a, q0, nq, out, ld, logits);
}

static int check_window(const char *name, const pd_policy_spec *spec, pd_error *err) {
    if (spec->window < 0)
        return pd_errorf(err, PD_EINVAL, "%s: window must be 0 (auto) or at least 1 observation query (got %d)", name,
                         spec->window);
    if (spec->pool < 1 || spec->pool % 2 == 0)
        return pd_errorf(err, PD_EINVAL, "%s: pool must be an odd width >= 1 (got %d)", name, spec->pool);
    return PD_OK;
}

/* The last w = min(window, len) tokens are the observation window. kvpress
 * pads the window's scores with the maximum score of the layer (all heads)
 * so that it is kept first; we add 1 so that the window strictly outranks
 * every other token (selection breaks ties toward earlier tokens, which
 * would favour the old maximum), on top of each window token's own raw
 * score, which ranks the window within itself when the budget cannot hold
 * all of it. Raw scores are >= 0, so 0 is the maximum of an empty set. */
static void protect_window(float *scores, int n_head_kv, int64_t len, int64_t w) {
    float m = 0;
    for (int h = 0; h < n_head_kv; h++)
        for (int64_t j = 0; j < len - w; j++) m = fmaxf(m, scores[h * len + j]);
    for (int h = 0; h < n_head_kv; h++)
        for (int64_t j = len - w; j < len; j++) scores[h * len + j] += m + 1.0f;
}

/* ---- SnapKV -------------------------------------------------------------
 * kvpress SnapKVPress: the last w queries attend causally to the keys; their
 * weights on the keys before the window are averaged over the window's
 * queries and over the kv head's query group (SnapKV issue #22), then
 * average-pooled with width `pool` (torch avg_pool1d, zero padding counted:
 * pd_avg_pool) over the pre-window keys only, as kvpress does. Deviations:
 * w = min(window, len) (kvpress asserts len > window), and the window is
 * scored max + 1 + its own mean weight (see protect_window). */
int pd_score_snapkv(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi, float *scores,
                    pd_error *err) {
    attn_ctx c;
    int rc = attn_ctx_init("snapkv", kv, false, lo, hi, &c, err);
    if (rc) return rc;
    if ((rc = check_window("snapkv", spec, err))) return rc;
    int64_t len = c.len, w = pd_policy_window(spec, len), pre = len - w;
    float *rows = pd_scorer_alloc(w * len, sizeof(float), "snapkv", err);
    float *pooled = pd_scorer_alloc(len, sizeof(float), "snapkv", err);
    double *acc = pd_scorer_alloc(len, sizeof(double), "snapkv", err);
    if (!rows || !pooled || !acc) {
        rc = PD_ENOMEM;
        goto out;
    }
    for (int h = 0; h < kv->n_head_kv; h++) {
        memset(acc, 0, (size_t)len * sizeof *acc);
        for (int a = h * c.g; a < (h + 1) * c.g; a++) {
            attn_rows(&c, a, hi - w, w, rows, len, NULL);
            for (int64_t t = 0; t < w; t++)
                for (int64_t j = 0; j < len; j++) acc[j] += rows[t * len + j];
        }
        float *s = scores + h * len;
        for (int64_t j = 0; j < len; j++) s[j] = (float)(acc[j] / ((double)w * c.g));
        if (pre > 0 && spec->pool > 1) {
            pd_avg_pool(s, pre, spec->pool, pooled);
            memcpy(s, pooled, (size_t)pre * sizeof *s);
        }
    }
    protect_window(scores, kv->n_head_kv, len, w);
out:
    free(rows);
    free(pooled);
    free(acc);
    return rc;
}

/* ---- H2O ----------------------------------------------------------------
 * kvpress ObservedAttentionPress: every query of the range attends causally;
 * key j's column sum is divided by the number of queries that can see it
 * (len - j), so late tokens are not penalised for being seen by fewer
 * queries, then averaged over the kv head's query group. kvpress
 * materialises the whole attention matrix; we stream H2O_BLOCK query rows at
 * a time, reading only the keys those rows can see. */
int pd_score_h2o(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi, float *scores,
                 pd_error *err) {
    (void)spec;
    attn_ctx c;
    int rc = attn_ctx_init("h2o", kv, false, lo, hi, &c, err);
    if (rc) return rc;
    int64_t len = c.len, block = len < H2O_BLOCK ? len : H2O_BLOCK;
    float *rows = pd_scorer_alloc(block * len, sizeof(float), "h2o", err);
    double *acc = pd_scorer_alloc(len, sizeof(double), "h2o", err);
    if (!rows || !acc) {
        rc = PD_ENOMEM;
        goto out;
    }
    for (int h = 0; h < kv->n_head_kv; h++) {
        memset(acc, 0, (size_t)len * sizeof *acc);
        for (int a = h * c.g; a < (h + 1) * c.g; a++) {
            for (int64_t q0 = lo; q0 < hi; q0 += block) {
                int64_t nq = hi - q0 < block ? hi - q0 : block, ncols = q0 + nq - lo;
                attn_rows(&c, a, q0, nq, rows, ncols, NULL);
                for (int64_t t = 0; t < nq; t++)
                    for (int64_t j = 0; j < ncols; j++) acc[j] += rows[t * ncols + j];
            }
        }
        for (int64_t j = 0; j < len; j++) scores[h * len + j] = (float)(acc[j] / ((double)(len - j) * c.g));
    }
out:
    free(rows);
    free(acc);
    return rc;
}

/* ---- TOVA ---------------------------------------------------------------
 * kvpress TOVAPress: the weights of the range's last query on every key,
 * averaged over ALL query heads of the layer (not per group: kvpress takes
 * attn_weights.mean over the head axis and repeats it for each kv head), so
 * every kv head gets the same scores. The last token is the observation
 * window of one: max + 1 + its own weight (kvpress pads it with the max). */
int pd_score_tova(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi, float *scores,
                  pd_error *err) {
    (void)spec;
    attn_ctx c;
    int rc = attn_ctx_init("tova", kv, false, lo, hi, &c, err);
    if (rc) return rc;
    int64_t len = c.len;
    float *row = pd_scorer_alloc(len, sizeof(float), "tova", err);
    double *acc = pd_scorer_alloc(len, sizeof(double), "tova", err);
    if (!row || !acc) {
        rc = PD_ENOMEM;
        goto out;
    }
    memset(acc, 0, (size_t)len * sizeof *acc);
    for (int a = 0; a < kv->n_head; a++) {
        attn_rows(&c, a, hi - 1, 1, row, len, NULL);
        for (int64_t j = 0; j < len; j++) acc[j] += row[j];
    }
    for (int h = 0; h < kv->n_head_kv; h++)
        for (int64_t j = 0; j < len; j++) scores[h * len + j] = (float)(acc[j] / kv->n_head);
    protect_window(scores, kv->n_head_kv, len, 1);
out:
    free(row);
    free(acc);
    return rc;
}

/* ---- OBCache ------------------------------------------------------------
 * Optimal Brain Cache (Gu et al., arXiv 2510.07651): the saliency of token p
 * is the Optimal-Brain-Damage estimate of how much pruning it changes the
 * attention outputs of the observation queries t (the last w of the range),
 *     S_p = sum_t || J_t delta ||^2  (1/2 d^T H d, H = 2 J^T J at the
 * unpruned point, where the output error is zero),
 * with z_tp = q_t.k_p / sqrt(d) the pre-softmax logit, A_tp = softmax_p(z_t),
 * o_t = sum_p A_tp v_p. Pruning sets the value and/or key to zero
 * (dz_tp = -z_tp, do_t/dz_tp = A_tp (v_p - o_t)):
 *     value (Eq. 4):  S_p = sum_t A_tp^2 ||v_p||^2
 *     key   (Eq. 5):  S_p = sum_t A_tp^2 z_tp^2 ||v_p - o_t||^2
 *     joint (Eq. 6):  S_p = sum_t A_tp^2 ||v_p + z_tp (v_p - o_t)||^2
 *                         = value + key + 2 sum_t A_tp^2 z_tp (||v_p||^2 - v_p.o_t)
 * The paper's HTML was not readable here: these are derived from its stated
 * definition (OBD on the attention output, closed forms using values,
 * pre-softmax logits and outputs) and agree with a third-party reading of
 * Eq. 4-6 (value: sum A^2||v||^2; key: sum (A Z)^2 ||v - o||^2; joint:
 * value + key + 2 sum A^2 Z (||v||^2 - <v, o>)). GQA: the per-query-head
 * scores are summed over the kv head's group (App. B.5, Eq. 33-35, per the
 * same reading). The paper's prefill setting (App. C.2.1, same reading) plugs
 * the scores into SnapKV with the window protected; so does this scorer
 * (protect_window).
 * Window and pooling follow the OBCache code (its SnapKV variants, as
 * mirrored in MalachiAjayi/kv-cache-pruner, a renamed copy): the
 * observation window is the recent window, 5% of the budget on LongBench
 * and 16 tokens on the needle test (window=0: the larger of the two,
 * pd_policy_window), and the pre-window scores are max-pooled with a
 * kernel of 7 (`pool`, pd_max_pool) before the top-k. */
typedef struct obc_scratch {
    float *rows, *logits, *out, *vo;
    double *vv, *acc;
} obc_scratch;

/* Adds group head a's scores for kv head h to s->acc. */
static void obcache_head(const attn_ctx *c, pd_obcache_target target, int a, int64_t hi, int64_t w, obc_scratch *s) {
    int64_t len = c->len;
    int d = c->d, h = a / c->g;
    const float *v = c->kv->v + (size_t)c->lo * (size_t)c->k_stride + (size_t)h * (size_t)d;
    attn_rows(c, a, hi - w, w, s->rows, len, s->logits);
    if (target != PD_OBCACHE_VALUE) {
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)w, d, (int)len, 1.0f, s->rows, (int)len, v,
                    c->k_stride, 0.0f, s->out, d);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)w, (int)len, d, 1.0f, s->out, d, v, c->k_stride,
                    0.0f, s->vo, (int)len);
    }
    for (int64_t t = 0; t < w; t++) {
        const float *at = s->rows + t * len, *zt = s->logits + t * len, *vot = s->vo + t * len;
        int64_t lim = hi - w + t - c->lo + 1;
        double oo = 0;
        if (target != PD_OBCACHE_VALUE)
            for (int i = 0; i < d; i++) oo += (double)s->out[t * d + i] * s->out[t * d + i];
        for (int64_t j = 0; j < lim; j++) {
            double a2 = (double)at[j] * at[j], z = zt[j], vv = s->vv[j];
            if (target == PD_OBCACHE_VALUE) {
                s->acc[j] += a2 * vv;
                continue;
            }
            double vo = vot[j], dist = fmax(0.0, vv + oo - 2.0 * vo); /* ||v - o||^2 */
            if (target == PD_OBCACHE_KEY)
                s->acc[j] += a2 * z * z * dist;
            else /* ||v + z (v - o)||^2, clamped: rounding can dip below 0 */
                s->acc[j] += a2 * fmax(0.0, vv + 2.0 * z * (vv - vo) + z * z * dist);
        }
    }
}

int pd_score_obcache(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi, float *scores,
                     pd_error *err) {
    attn_ctx c;
    int rc = attn_ctx_init("obcache", kv, true, lo, hi, &c, err);
    if (rc) return rc;
    if ((rc = check_window("obcache", spec, err))) return rc;
    if (spec->target != PD_OBCACHE_VALUE && spec->target != PD_OBCACHE_KEY && spec->target != PD_OBCACHE_JOINT)
        return pd_errorf(err, PD_EINVAL, "obcache: target must be value, key or joint (got %d)", (int)spec->target);
    int64_t len = c.len, w = pd_policy_window(spec, len), pre = len - w;
    float *pooled = pd_scorer_alloc(len, sizeof(float), "obcache", err);
    obc_scratch s = {
        .rows = pd_scorer_alloc(w * len, sizeof(float), "obcache", err),
        .logits = pd_scorer_alloc(w * len, sizeof(float), "obcache", err),
        .out = pd_scorer_alloc(w * c.d, sizeof(float), "obcache", err),
        .vo = pd_scorer_alloc(w * len, sizeof(float), "obcache", err),
        .vv = pd_scorer_alloc(len, sizeof(double), "obcache", err),
        .acc = pd_scorer_alloc(len, sizeof(double), "obcache", err),
    };
    if (!pooled || !s.rows || !s.logits || !s.out || !s.vo || !s.vv || !s.acc) {
        rc = PD_ENOMEM;
        goto out;
    }
    for (int h = 0; h < kv->n_head_kv; h++) {
        for (int64_t j = 0; j < len; j++) {
            const float *vj = kv->v + (size_t)(lo + j) * (size_t)c.k_stride + (size_t)h * (size_t)c.d;
            double vv = 0;
            for (int i = 0; i < c.d; i++) vv += (double)vj[i] * vj[i];
            s.vv[j] = vv;
        }
        memset(s.acc, 0, (size_t)len * sizeof *s.acc);
        for (int a = h * c.g; a < (h + 1) * c.g; a++) obcache_head(&c, spec->target, a, hi, w, &s);
        /* Clamped so that huge logits cannot overflow float (scores stay finite). */
        float *sh = scores + h * len;
        for (int64_t j = 0; j < len; j++) sh[j] = (float)fmin(s.acc[j], 1e30);
        if (pre > 0 && spec->pool > 1) {
            pd_max_pool(sh, pre, spec->pool, pooled);
            memcpy(sh, pooled, (size_t)pre * sizeof *sh);
        }
    }
    protect_window(scores, kv->n_head_kv, len, w);
out:
    free(pooled);
    free(s.rows);
    free(s.logits);
    free(s.out);
    free(s.vo);
    free(s.vv);
    free(s.acc);
    return rc;
}
