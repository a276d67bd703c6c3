/* The compressor: the engine's prefill hook calls it once per layer with that
 * layer's K/V (and queries); it scores, selects and marks the evicted rows.
 * Scratch is sized once at creation from the prefix length, so the hook does
 * not allocate. */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "policies/policies.h"
#include "policies/scorers.h"

struct pd_compressor {
    pd_policy_spec spec;
    int n_layer, n_head_kv, n_criteria;
    int64_t n;
    pd_span *spans; /* the layout, copied */
    pd_range *whitelist;
    pd_layout layout;
    bool has_layout;
    int64_t *budgets;     /* [n_layer] per head */
    pd_compress_stats stats;
    int last_layer;       /* the layer the hook saw last, -1 before the first */
    uint8_t *prev_keep;   /* [n_head_kv][n]: the last layer's mask, for reuse */
    float *scores;        /* [n_criteria][n_head_kv][n] */
    double *layer_sum;    /* [n_head_kv][n]: laserkv accumulate, criterion 1 summed over the layers so far */
    /* fair eviction only */
    float *local_scores;  /* [n_criteria][n_head_kv][n], when spec.local */
    float *span_scores;   /* [n_criteria][n_head_kv][longest span] */
    uint8_t *prot;        /* [n]: protected tokens (the same in every head); with spans */
    int64_t *free_len, *base, *quotas; /* [n_head_kv][n_spans] */
    double *fair_carry;   /* [n_spans]: rounding shortfall carried across groups */
};

/* calloc that remembers a failure, so a run of allocations is checked once. */
static void *alloc_array(size_t n, size_t size, bool *ok) {
    uint64_t bytes;
    if (!*ok || !pd_mul_ok(n, size, &bytes) || bytes > SIZE_MAX) {
        *ok = false;
        return NULL;
    }
    void *p = calloc(n ? n : 1, size);
    if (!p) *ok = false;
    return p;
}

void pd_compressor_free(pd_compressor *c) {
    if (!c) return;
    free(c->spans);
    free(c->whitelist);
    free(c->budgets);
    pd_compress_stats_free(&c->stats);
    free(c->prev_keep);
    free(c->scores);
    free(c->layer_sum);
    free(c->local_scores);
    free(c->span_scores);
    free(c->prot);
    free(c->free_len);
    free(c->base);
    free(c->quotas);
    free(c->fair_carry);
    free(c);
}

static int copy_layout(pd_compressor *c, const pd_layout *l, pd_error *err) {
    if (l->n_spans > 0) {
        if (!(c->spans = malloc(sizeof *c->spans * (size_t)l->n_spans)))
            return pd_errorf(err, PD_ENOMEM, "out of memory for %d spans", l->n_spans);
        memcpy(c->spans, l->spans, sizeof *c->spans * (size_t)l->n_spans);
    }
    if (l->n_whitelist > 0) {
        if (!(c->whitelist = malloc(sizeof *c->whitelist * (size_t)l->n_whitelist)))
            return pd_errorf(err, PD_ENOMEM, "out of memory for %d whitelisted ranges", l->n_whitelist);
        memcpy(c->whitelist, l->whitelist, sizeof *c->whitelist * (size_t)l->n_whitelist);
    }
    c->layout.spans = c->spans;
    c->layout.n_spans = l->n_spans > 0 ? l->n_spans : 0;
    c->layout.whitelist = c->whitelist;
    c->layout.n_whitelist = l->n_whitelist > 0 ? l->n_whitelist : 0;
    c->has_layout = c->layout.n_spans > 0 || c->layout.n_whitelist > 0;
    return PD_OK;
}

int pd_compressor_create(const pd_policy_spec *spec, const pd_layout *layout, const pd_hparams *hp,
                         int64_t n_tokens, pd_compressor **out, pd_error *err) {
    *out = NULL;
    int rc = pd_policy_spec_validate(spec, err);
    if (rc) return rc;
    if (n_tokens <= 0 || n_tokens > INT32_MAX)
        return pd_errorf(err, PD_EINVAL, "prefix length %" PRId64 " must be in [1, %d]", n_tokens, INT32_MAX);
    if (hp->n_layer <= 0 || hp->n_head_kv <= 0)
        return pd_errorf(err, PD_EINVAL, "model shape (%d layers, %d kv heads) has nothing to compress", hp->n_layer,
                         hp->n_head_kv);
    if (layout && (rc = pd_layout_validate(layout, n_tokens, err))) return rc;
    if (spec->fair && (!layout || layout->n_spans <= 0))
        return pd_errorf(err, PD_EINVAL,
                         "policy %s has fair=1, which needs a layout with spans (e.g. --spans FILE); give spans or "
                         "set fair=0",
                         pd_policy_kind_name(spec->kind));

    pd_compressor *c = calloc(1, sizeof *c);
    if (!c) return pd_errorf(err, PD_ENOMEM, "out of memory for the compressor");
    c->spec = *spec;
    c->n_layer = hp->n_layer;
    c->n_head_kv = hp->n_head_kv;
    c->n_criteria = pd_policy_n_criteria(spec);
    c->n = n_tokens;
    c->last_layer = -1;
    if (layout && (rc = copy_layout(c, layout, err))) goto fail;

    const size_t L = (size_t)c->n_layer, H = (size_t)c->n_head_kv, N = (size_t)n_tokens;
    const size_t C = (size_t)(c->n_criteria > 0 ? c->n_criteria : 1);
    bool ok = true;
    c->budgets = alloc_array(L, sizeof *c->budgets, &ok);
    c->stats.kept = alloc_array(L * H, sizeof *c->stats.kept, &ok);
    c->prev_keep = alloc_array(H * N, 1, &ok);
    c->scores = alloc_array(C * H * N, sizeof *c->scores, &ok);
    if (spec->kind == PD_POLICY_LASERKV && spec->accumulate)
        c->layer_sum = alloc_array(H * N, sizeof *c->layer_sum, &ok);
    const size_t S = (size_t)c->layout.n_spans;
    if (S > 0) {
        c->prot = alloc_array(N, 1, &ok);
        c->stats.span_tokens = alloc_array(S, sizeof *c->stats.span_tokens, &ok);
        c->stats.span_kept = alloc_array(L * S, sizeof *c->stats.span_kept, &ok);
        c->stats.span_protected = alloc_array(L * S, sizeof *c->stats.span_protected, &ok);
    }
    if (spec->fair) {
        int64_t longest = 0;
        for (int s = 0; s < c->layout.n_spans; s++)
            if (c->spans[s].end - c->spans[s].start > longest) longest = c->spans[s].end - c->spans[s].start;
        c->fair_carry = alloc_array(S, sizeof *c->fair_carry, &ok);
        c->free_len = alloc_array(H * S, sizeof *c->free_len, &ok);
        c->base = alloc_array(H * S, sizeof *c->base, &ok);
        c->quotas = alloc_array(H * S, sizeof *c->quotas, &ok);
        if (spec->local) {
            c->local_scores = alloc_array(C * H * N, sizeof *c->local_scores, &ok);
            c->span_scores = alloc_array(C * H * (size_t)longest, sizeof *c->span_scores, &ok);
        }
    }
    if (!ok) {
        rc = pd_errorf(err, PD_ENOMEM, "out of memory for the compressor's scratch (%" PRId64 " tokens, %d layers, %d kv heads)",
                       n_tokens, c->n_layer, c->n_head_kv);
        goto fail;
    }
    pd_policy_budgets(spec, c->n_layer, n_tokens, c->budgets);
    c->stats.n_layer = c->n_layer;
    c->stats.n_head_kv = c->n_head_kv;
    c->stats.n_spans = c->layout.n_spans;
    for (int s = 0; s < c->layout.n_spans; s++) c->stats.span_tokens[s] = c->spans[s].end - c->spans[s].start;
    c->stats.n_tokens = n_tokens;
    *out = c;
    return PD_OK;
fail:
    pd_compressor_free(c);
    return rc;
}

const pd_compress_stats *pd_compressor_stats(const pd_compressor *c) { return &c->stats; }

/* Span-local scores: each span scored on its own tokens only, written at the
 * span's place in the [n_criteria][n_head_kv][n] array. */
static int score_local(pd_compressor *c, const pd_layer_kv *kv, pd_error *err) {
    const int64_t n = c->n, H = c->n_head_kv;
    pd_policy_spec span_spec;
    pd_policy_spec_for_span(&c->spec, c->layout.n_spans, &span_spec);
    for (int s = 0; s < c->layout.n_spans; s++) {
        const int64_t lo = c->spans[s].start, len = c->spans[s].end - lo;
        int rc = pd_policy_score(&span_spec, kv, lo, lo + len, c->span_scores, err);
        if (rc) return pd_error_prefix(err, "span '%s' [%" PRId64 ", %" PRId64 ")", c->spans[s].name, lo, lo + len);
        for (int64_t q = 0; q < (int64_t)c->n_criteria * H; q++)
            memcpy(c->local_scores + q * n + lo, c->span_scores + q * len, sizeof(float) * (size_t)len);
    }
    return PD_OK;
}

/* Fair eviction. The base selection (no quotas) says how many free
 * entries the policy itself keeps in each span; the quotas blend those
 * counts with the span-proportional ones, and the final selection fills
 * each span's quota with its best entries. Free means unprotected, and
 * with debias > 0 only the sinks (and whitelists) are protected, as in the
 * fair-eviction paper (b_X / n_X equal for every span X but the sinks): a
 * recent window competes inside its span's quota instead of being kept on
 * top of it, where it would take most of the last span's share. With
 * debias=0 and local=0 the quotas are the base counts and the protection
 * the base policy's, so the result is the base policy's (for
 * single-criterion policies without chunks). */
static int select_fair(pd_compressor *c, const pd_layer_kv *kv, pd_select_args *a, uint8_t *keep, pd_error *err) {
    const int64_t n = c->n;
    const int H = c->n_head_kv, S = c->layout.n_spans;
    const bool global = a->mode == PD_BUDGET_GLOBAL;
    const int groups = global ? 1 : H;
    int rc;
    if ((rc = pd_policy_select(a, keep, err))) return rc;
    if (c->spec.debias > 0) a->recent = 0;
    pd_policy_protected(a, c->prot);

    memset(c->free_len, 0, sizeof *c->free_len * (size_t)groups * (size_t)S);
    memset(c->base, 0, sizeof *c->base * (size_t)groups * (size_t)S);
    for (int h = 0; h < H; h++) {
        const int g = global ? 0 : h;
        const uint8_t *kh = keep + (int64_t)h * n;
        for (int s = 0; s < S; s++)
            for (int64_t i = c->spans[s].start; i < c->spans[s].end; i++) {
                if (c->prot[i]) {
                    /* The base selection keeps every protected entry; if not,
                     * the two disagree on protection and quotas would be wrong. */
                    if (!kh[i])
                        return pd_errorf(err, PD_EINVAL, "fair eviction: token %" PRId64 " of kv head %d should be "
                                         "protected but the selection dropped it (internal inconsistency)", i, h);
                    continue;
                }
                c->free_len[g * S + s]++;
                c->base[g * S + s] += kh[i];
            }
    }
    for (int g = 0; g < groups; g++) {
        /* What the base selection spent beyond the (fair) protection: the
         * free budget, or every free entry when there are fewer. */
        int64_t kept_free = 0;
        for (int s = 0; s < S; s++) kept_free += c->base[g * S + s];
        pd_fair_quotas(kept_free, c->free_len + g * S, c->base + g * S, S, c->spec.debias, c->fair_carry,
                       c->quotas + g * S);
    }
    a->quotas = c->quotas;
    if (c->spec.local) {
        if ((rc = score_local(c, kv, err))) return rc;
        a->local_scores = c->local_scores;
    }
    return pd_policy_select(a, keep, err);
}

/* Per-span counts of layer l: what was kept, and which of it fairness
 * leaves out (sinks and whitelists as the selection protects them). */
static void count_spans(pd_compressor *c, int l, int64_t B, const uint8_t *keep) {
    const int64_t n = c->n;
    const int H = c->n_head_kv, S = c->layout.n_spans;
    pd_select_args a = {
        .n = n,
        .n_head_kv = H,
        .mode = c->spec.budget,
        .budget = c->spec.budget == PD_BUDGET_GLOBAL ? B * H : B,
        .layout = &c->layout,
    };
    int64_t recent;
    pd_policy_spec_protected(&c->spec, B, &a.sink, &recent);
    if (pd_policy_protected(&a, c->prot) < 0) memset(c->prot, 0, (size_t)n); /* selection refused it already */
    for (int s = 0; s < S; s++) {
        int64_t kept = 0, prot = 0;
        for (int h = 0; h < H; h++) {
            const uint8_t *kh = keep + (int64_t)h * n;
            for (int64_t i = c->spans[s].start; i < c->spans[s].end; i++) {
                kept += kh[i] != 0;
                prot += kh[i] && c->prot[i];
            }
        }
        c->stats.span_kept[(int64_t)l * S + s] = kept;
        c->stats.span_protected[(int64_t)l * S + s] = prot;
    }
}

int pd_compressor_hook(void *compressor, const pd_layer_kv *kv, uint8_t *keep, pd_error *err) {
    pd_compressor *c = compressor;
    const int64_t n = c->n;
    const int H = c->n_head_kv;
    if (kv->n_tokens != n)
        return pd_errorf(err, PD_EINVAL,
                         "the compressor was made for a %" PRId64 "-token prefix but the prefill passed %" PRId64
                         " tokens; prefill the whole prefix in one call",
                         n, kv->n_tokens);
    if (kv->layer < 0 || kv->layer >= c->n_layer || kv->n_head_kv != H)
        return pd_errorf(err, PD_EINVAL, "layer %d with %d kv heads does not match the compressor's model (%d layers, %d kv heads)",
                         kv->layer, kv->n_head_kv, c->n_layer, H);
    const int l = kv->layer;
    const double t0 = pd_now_seconds();
    const pd_policy_spec *sp = &c->spec;
    const int64_t B = c->budgets[l];
    int rc = PD_OK;

    if (sp->reuse > 1 && l % sp->reuse != 0) {
        /* ChunkKV index reuse: this layer keeps what the group's first layer kept. */
        if (c->last_layer != l - 1)
            return pd_errorf(err, PD_EINVAL, "reuse=%d: layer %d reuses the indices of layer %d, which the hook did "
                             "not see just before", sp->reuse, l, l - 1);
        memcpy(keep, c->prev_keep, (size_t)H * (size_t)n);
    } else if (B >= n) {
        /* Keeping everything: no scoring, and exactly the full prefix. */
        memset(keep, 1, (size_t)H * (size_t)n);
    } else {
        if ((rc = pd_policy_score(sp, kv, 0, n, c->scores, err))) return pd_error_prefix(err, "layer %d", l);
        if (c->layer_sum) {
            /* LASER-KV sums exact attention over layers; a per-layer hook
             * has seen only layers up to this one, so it ranks by their
             * running sum. */
            for (int64_t i = 0; i < (int64_t)H * n; i++) {
                c->layer_sum[i] += c->scores[i];
                c->scores[i] = (float)c->layer_sum[i];
            }
        }
        pd_select_args a = {
            .n = n,
            .n_head_kv = H,
            .mode = sp->budget,
            .budget = sp->budget == PD_BUDGET_GLOBAL ? B * H : B,
            .scores = c->scores,
            .scores2 = c->n_criteria > 1 ? c->scores + (int64_t)H * n : NULL,
            .share = sp->alpha,
            .chunk = sp->chunk,
            .shared_chunks = sp->shared,
            .layout = c->has_layout ? &c->layout : NULL,
        };
        pd_policy_spec_protected(sp, B, &a.sink, &a.recent);
        if (sp->fair) rc = select_fair(c, kv, &a, keep, err);
        else rc = pd_policy_select(&a, keep, err);
        if (rc) return pd_error_prefix(err, "layer %d", l);
    }

    if (c->layout.n_spans > 0) count_spans(c, l, B, keep);
    memcpy(c->prev_keep, keep, (size_t)H * (size_t)n);
    c->last_layer = l;
    int64_t total = 0;
    for (int h = 0; h < H; h++) {
        int64_t k = 0;
        const uint8_t *kh = keep + (int64_t)h * n;
        for (int64_t i = 0; i < n; i++) k += kh[i] != 0;
        c->stats.kept[(int64_t)l * H + h] = k;
    }
    for (int64_t i = 0; i < (int64_t)c->n_layer * H; i++) total += c->stats.kept[i];
    c->stats.kept_total = total;
    c->stats.score_seconds += pd_now_seconds() - t0;
    return PD_OK;
}

static int64_t *dup_counts(const int64_t *src, size_t cnt, bool *ok) {
    int64_t *p = cnt ? alloc_array(cnt, sizeof *p, ok) : NULL;
    if (p) memcpy(p, src, sizeof *p * cnt);
    return p;
}

static int copy_stats(const pd_compress_stats *src, pd_compress_stats *dst, pd_error *err) {
    const size_t L = (size_t)src->n_layer, S = (size_t)src->n_spans;
    bool ok = true;
    *dst = *src;
    dst->kept = dup_counts(src->kept, L * (size_t)src->n_head_kv, &ok);
    dst->span_tokens = dup_counts(src->span_tokens, S, &ok);
    dst->span_kept = dup_counts(src->span_kept, L * S, &ok);
    dst->span_protected = dup_counts(src->span_protected, L * S, &ok);
    if (ok) return PD_OK;
    pd_compress_stats_free(dst);
    return pd_errorf(err, PD_ENOMEM, "out of memory for the compression statistics");
}

void pd_compress_stats_free(pd_compress_stats *st) {
    if (!st) return;
    free(st->kept);
    free(st->span_tokens);
    free(st->span_kept);
    free(st->span_protected);
    st->kept = st->span_tokens = st->span_kept = st->span_protected = NULL;
}

void pd_compress_span_fraction(const pd_compress_stats *st, int s, double *all, double *unprotected) {
    int64_t kept = 0, prot = 0;
    for (int l = 0; l < st->n_layer; l++) {
        kept += st->span_kept[(int64_t)l * st->n_spans + s];
        prot += st->span_protected[(int64_t)l * st->n_spans + s];
    }
    const int64_t entries = st->span_tokens[s] * st->n_layer * st->n_head_kv;
    if (all) *all = entries > 0 ? (double)kept / (double)entries : 1;
    if (unprotected) *unprotected = entries > prot ? (double)(kept - prot) / (double)(entries - prot) : 1;
}

/* The prefill hook of pd_compress_prefix_observed: select, then report. */
typedef struct observed {
    pd_compressor *c;
    pd_compress_layer_fn on_layer;
    void *ctx;
} observed;

static int observed_hook(void *ctx, const pd_layer_kv *kv, uint8_t *keep, pd_error *err) {
    observed *o = ctx;
    int rc = pd_compressor_hook(o->c, kv, keep, err);
    return rc ? rc : o->on_layer(o->ctx, kv->layer, o->c->n_layer, err);
}

int pd_compress_prefix(pd_model *m, const pd_token *tokens, int64_t n, const pd_policy_spec *spec,
                       const pd_layout *layout, pd_kv_prefix **out, pd_compress_stats *stats, pd_error *err) {
    return pd_compress_prefix_observed(m, tokens, n, spec, layout, NULL, NULL, out, stats, err);
}

int pd_compress_prefix_observed(pd_model *m, const pd_token *tokens, int64_t n, const pd_policy_spec *spec,
                                const pd_layout *layout, pd_compress_layer_fn on_layer, void *ctx,
                                pd_kv_prefix **out, pd_compress_stats *stats, pd_error *err) {
    *out = NULL;
    const pd_hparams *hp = pd_model_hparams(m);
    if (n <= 0) return pd_errorf(err, PD_EINVAL, "the prefix is empty: nothing to compress");
    if (n > hp->n_ctx_train)
        return pd_errorf(err, PD_ERANGE, "the prefix has %" PRId64 " tokens, more than the model's context of %d", n,
                         hp->n_ctx_train);
    pd_compressor *c = NULL;
    pd_seq *s = NULL;
    int rc = pd_compressor_create(spec, layout, hp, n, &c, err);
    if (!rc) rc = pd_seq_create(m, 0, &s, err);
    observed ob = {.c = c, .on_layer = on_layer, .ctx = ctx};
    pd_prefill_opts o = on_layer ? (pd_prefill_opts){.hook = observed_hook, .hook_ctx = &ob}
                                 : (pd_prefill_opts){.hook = pd_compressor_hook, .hook_ctx = c};
    /* Scoring on the GPU: the layer's Q/K/V never travel to the host. */
    o.hook_device_only = pd_scorer_runs_on_backend(spec, pd_model_backend(m));
    if (!rc) rc = pd_prefill(m, s, tokens, n, &o, NULL, err);
    if (!rc) rc = pd_seq_to_prefix(s, out, err);
    pd_seq_free(s);
    if (!rc && stats && (rc = copy_stats(&c->stats, stats, err))) {
        pd_kv_prefix_free(*out);
        *out = NULL;
    }
    pd_compressor_free(c);
    return rc;
}
