/* The scoring entry point: checks the arguments once for every scorer,
 * dispatches on spec->scorer and enforces the "all finite" contract. */
#include <inttypes.h>
#include <math.h>

#include "policies/scorers.h"

/* Which arrays of pd_layer_kv a scorer reads. */
enum {
    NEED_POS = 1 << 0,
    NEED_KPRE = 1 << 1,
    NEED_Q = 1 << 2,
    NEED_K = 1 << 3,
    NEED_V = 1 << 4,
};

typedef struct scorer_entry {
    pd_scorer_fn fn;
    unsigned needs;
} scorer_entry;

/* NULL for kinds that are not scorers (pyramidkv and chunkkv only choose
 * budgets and chunks; their spec names a scorer). */
static scorer_entry scorer_for(const pd_policy_spec *spec) {
    unsigned vnorm = spec->vnorm ? NEED_V : 0;
    switch (spec->scorer) {
    case PD_POLICY_COMPACTOR: return (scorer_entry){pd_score_compactor, NEED_KPRE | NEED_Q | NEED_K | vnorm};
    case PD_POLICY_LEVERAGE: return (scorer_entry){pd_score_leverage, NEED_KPRE};
    case PD_POLICY_NONCAUSAL: return (scorer_entry){pd_score_noncausal, NEED_Q | NEED_K | vnorm};
    case PD_POLICY_RANDOM: return (scorer_entry){pd_score_random, NEED_POS};
    case PD_POLICY_KNORM: return (scorer_entry){pd_score_knorm, NEED_K};
    case PD_POLICY_STREAMING: return (scorer_entry){pd_score_streaming, 0};
    case PD_POLICY_SNAPKV: return (scorer_entry){pd_score_snapkv, NEED_Q | NEED_K};
    case PD_POLICY_H2O: return (scorer_entry){pd_score_h2o, NEED_Q | NEED_K};
    case PD_POLICY_TOVA: return (scorer_entry){pd_score_tova, NEED_Q | NEED_K};
    case PD_POLICY_OBCACHE: return (scorer_entry){pd_score_obcache, NEED_Q | NEED_K | NEED_V};
    case PD_POLICY_LASERKV: return (scorer_entry){pd_score_laserkv, NEED_Q | NEED_K};
    case PD_POLICY_PYRAMIDKV:
    case PD_POLICY_CHUNKKV:
    case PD_POLICY_COUNT:
        break;
    }
    return (scorer_entry){NULL, 0};
}

int pd_policy_n_criteria(const pd_policy_spec *spec) { return spec->scorer == PD_POLICY_LASERKV ? 2 : 1; }

int pd_policy_score(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi, float *scores,
                    pd_error *err) {
    if (!spec || !kv || !scores)
        return pd_errorf(err, PD_EINVAL, "pd_policy_score: spec, layer and scores must not be NULL");
    scorer_entry e = scorer_for(spec);
    if (!e.fn) {
        const char *name = (unsigned)spec->scorer < PD_POLICY_COUNT ? pd_policy_kind_name(spec->scorer) : NULL;
        return pd_errorf(err, PD_EINVAL,
                         "scorer '%s' (%d) cannot score tokens; use compactor, leverage, noncausal, random, knorm, "
                         "streaming, snapkv, h2o, tova, obcache or laserkv",
                         name ? name : "?", (int)spec->scorer);
    }
    const char *name = pd_policy_kind_name(spec->scorer);
    if (kv->n_head <= 0 || kv->n_head_kv <= 0 || kv->head_dim <= 0 || kv->n_head % kv->n_head_kv != 0)
        return pd_errorf(err, PD_EINVAL,
                         "%s: layer %d has n_head %d, n_head_kv %d, head_dim %d; all must be positive and n_head a "
                         "multiple of n_head_kv",
                         name, kv->layer, kv->n_head, kv->n_head_kv, kv->head_dim);
    if (kv->n_tokens < 0 || lo < 0 || lo >= hi || hi > kv->n_tokens)
        return pd_errorf(err, PD_EINVAL,
                         "%s: token range [%" PRId64 ", %" PRId64 ") of layer %d must satisfy 0 <= lo < hi <= %" PRId64
                         " (the layer's token count)",
                         name, lo, hi, kv->layer, kv->n_tokens);
    /* A scorer that runs on the model's backend reads the backend's arrays. */
    const bool dev = pd_scorer_runs_on_backend(spec, kv->backend);
    struct {
        unsigned bit;
        const void *ptr;
        const char *what;
    } arrays[] = {
        {NEED_POS, kv->pos, "positions (pos)"},
        {NEED_KPRE, dev ? kv->dev_k_pre_rope : kv->k_pre_rope, "pre-RoPE keys (k_pre_rope)"},
        {NEED_Q, dev ? kv->dev_q : kv->q, "queries (q)"},
        {NEED_K, dev ? kv->dev_k : kv->k, "keys (k)"},
        {NEED_V, dev ? kv->dev_v : kv->v, "values (v)"},
    };
    for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; i++)
        if ((e.needs & arrays[i].bit) && !arrays[i].ptr)
            return pd_errorf(err, PD_EINVAL, "%s: layer %d has no %s, which this scorer reads", name, kv->layer,
                             arrays[i].what);

    int rc = e.fn(spec, kv, lo, hi, scores, err);
    if (rc) return rc;

    /* Selection sorts these; one NaN would make the order meaningless, so
     * a bad input surfaces here instead of as a silently odd cache. */
    int64_t n = hi - lo, per = (int64_t)kv->n_head_kv * n;
    int n_crit = pd_policy_n_criteria(spec);
    for (int c = 0; c < n_crit; c++)
        for (int64_t i = 0; i < per; i++)
            if (!isfinite(scores[(int64_t)c * per + i]))
                return pd_errorf(err, PD_ERANGE,
                                 "%s: non-finite score at layer %d, kv head %" PRId64 ", token %" PRId64
                                 " (criterion %d); the layer's Q/K/V probably hold inf or NaN",
                                 name, kv->layer, i / n, lo + i % n, c);
    return PD_OK;
}
