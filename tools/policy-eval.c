/* policy-eval: how much each KV-cache policy costs in quality, on text the
 * model itself wrote.
 *
 *   policy-eval [MODEL] [--stories K] [--prefix N] [--cont N] [--seed S] [--threads N]
 *               [--sets N] [--data-dir DIR]
 *
 * K stories are sampled from BOS (temperature 1, seeds S, S+1, ...). Each
 * story's first N tokens are the prefix, the next ones the continuation.
 * For every policy and retention the table gives the NLL ratio
 * NLL(continuation | compressed prefix) / NLL(continuation | full prefix)
 * across stories. The calibration experiment runs pd_calibrate on each
 * prefix alone (its last 20% as probe), compresses the prefix at the chosen
 * retention and measures the ratio on the real continuation; the zero-shot
 * arm instead chooses from one curve fitted offline on K other stories
 * (seeds S + 1000 + i). Markdown on stdout, progress on stderr.
 *
 * The separation tables (docs/policies.md, issue 17) scale protection with
 * the retention and add per-span keep rates, the NLL of far-context copies
 * and an instruction-survival probe; --data-dir writes the curves and keep
 * rates that tools/eval-figures.sh plots. */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "policies/policies.h"
#include "util/util.h"

#define DEFAULT_MODEL "../shared/models/tinystories/stories260K.gguf"
#define MAX_STORIES 64
#define N_SPANS 4
/* The zero-shot calibration set uses seeds S + this + i: disjoint from the
 * evaluated stories (S .. S + 63). */
#define ZERO_SHOT_SEED_OFFSET 1000

typedef struct story {
    pd_token *ids; /* prefix then continuation */
    int64_t n_prefix, n_cont;
    double nll_full; /* continuation after the full prefix */
} story;

typedef struct eval_ctx {
    pd_model *m;
    story stories[MAX_STORIES];
    int n_stories;
} eval_ctx;

static void usage(FILE *f) {
    fputs("usage: policy-eval [MODEL] [--stories K] [--prefix N] [--cont N] [--seed S] [--threads N]\n"
          "  MODEL           GGUF model (default " DEFAULT_MODEL ")\n"
          "  --stories K     stories sampled from the model (default 8, at most 64)\n"
          "  --prefix N      prefix tokens per story, BOS included (default 400)\n"
          "  --cont N        continuation tokens scored after it (default 100)\n"
          "  --seed S        sampler seed of the first story (default 1; story i uses S + i)\n"
          "  --threads N     CPU threads (default 2)\n"
          "  --sets N        instruction-survival prefixes of 4 story openings (default 4, at most 32)\n"
          "  --data-dir DIR  write the figure data (curves, per-span keep rates) into DIR, which must exist\n",
          f);
}

static int parse_int(const char *opt, const char *arg, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(arg, &end, 10);
    if (errno || end == arg || *end || v < lo || v > hi) {
        fprintf(stderr, "policy-eval: %s wants an integer in [%ld, %ld], got '%s'\n", opt, lo, hi, arg);
        return 2;
    }
    *out = v;
    return 0;
}

/* Sample n tokens after BOS at temperature 1. */
static int sample_story(pd_model *m, uint64_t seed, int64_t n, pd_token *out, pd_error *err) {
    const int32_t V = pd_model_hparams(m)->n_vocab;
    float *logits = malloc(sizeof(float) * (size_t)V);
    if (!logits) return pd_errorf(err, PD_ENOMEM, "out of memory for logits");
    pd_sampler_params sp = pd_sampler_params_default();
    sp.temperature = 1.0f;
    sp.seed = seed;
    sp.penalty_last_n = 0;
    pd_sampler *smp = NULL;
    pd_seq *s = NULL;
    pd_token bos = pd_tokenizer_bos(pd_model_tokenizer(m));
    out[0] = bos == PD_TOKEN_NULL ? 1 : bos;
    int rc = pd_sampler_create(&sp, V, &smp, err);
    if (!rc) rc = pd_seq_create(m, 0, &s, err);
    if (!rc) rc = pd_prefill(m, s, out, 1, NULL, logits, err);
    for (int64_t i = 1; !rc && i < n; i++) {
        pd_sample_result r;
        if ((rc = pd_sampler_sample(smp, logits, &r, err))) break;
        out[i] = r.token;
        if (i + 1 < n) rc = pd_decode(m, &s, &out[i], 1, logits, err);
    }
    pd_seq_free(s);
    pd_sampler_free(smp);
    free(logits);
    return rc;
}

static int full_prefix(pd_model *m, const pd_token *ids, int64_t n, pd_kv_prefix **out, pd_error *err) {
    pd_seq *s = NULL;
    int rc = pd_seq_create(m, 0, &s, err);
    if (!rc) rc = pd_prefill(m, s, ids, n, NULL, NULL, err);
    if (!rc) rc = pd_seq_to_prefix(s, out, err);
    pd_seq_free(s);
    return rc;
}

/* The prefix cut into N_SPANS equal spans (the last takes the remainder). */
static void equal_spans(int64_t n, pd_span *spans) {
    for (int i = 0; i < N_SPANS; i++) {
        memset(&spans[i], 0, sizeof spans[i]);
        snprintf(spans[i].name, sizeof spans[i].name, "part%d", i + 1);
        spans[i].start = n * i / N_SPANS;
        spans[i].end = n * (i + 1) / N_SPANS;
    }
}

static int story_ratio(eval_ctx *e, const story *st, const pd_policy_spec *spec, double *ratio, pd_error *err) {
    pd_span spans[N_SPANS];
    equal_spans(st->n_prefix, spans);
    pd_layout lay = {.spans = spans, .n_spans = N_SPANS};
    pd_kv_prefix *p = NULL;
    double nll = 0;
    int rc = pd_compress_prefix(e->m, st->ids, st->n_prefix, spec, spec->fair ? &lay : NULL, &p, NULL, err);
    if (!rc) rc = pd_nll(e->m, p, NULL, 0, st->ids + st->n_prefix, st->n_cont, &nll, err);
    pd_kv_prefix_free(p);
    if (!rc) *ratio = nll / st->nll_full;
    return rc;
}

typedef struct summary {
    double mean, std, min, max;
} summary;

static summary summarise(const double *x, int n) {
    summary s = {0, 0, INFINITY, -INFINITY};
    for (int i = 0; i < n; i++) {
        s.mean += x[i];
        s.min = fmin(s.min, x[i]);
        s.max = fmax(s.max, x[i]);
    }
    s.mean /= n;
    for (int i = 0; i < n; i++) s.std += (x[i] - s.mean) * (x[i] - s.mean);
    s.std = n > 1 ? sqrt(s.std / (n - 1)) : 0;
    return s;
}

static const double retentions[] = {0.5, 0.25, 0.1};
#define N_RET ((int)(sizeof retentions / sizeof retentions[0]))

static int policy_table(eval_ctx *e, pd_error *err) {
    /* The 13 policies with their defaults, then fair eviction over 4 equal spans. */
    const char *specs[PD_POLICY_COUNT + 2];
    int n_specs = 0;
    for (int k = 0; k < PD_POLICY_COUNT; k++) specs[n_specs++] = pd_policy_kind_name((pd_policy_kind)k);
    specs[n_specs++] = "snapkv:fair=1";
    specs[n_specs++] = "compactor:fair=1";
    printf("| policy | retention 0.5 | retention 0.25 | retention 0.1 |\n|---|---|---|---|\n");
    double ratios[MAX_STORIES];
    for (int i = 0; i < n_specs; i++) {
        pd_policy_spec spec;
        int rc = pd_policy_spec_parse(specs[i], &spec, err);
        if (rc) return rc;
        printf("| `%s` |", specs[i]);
        for (int r = 0; r < N_RET; r++) {
            pd_policy_spec_set_retention(&spec, retentions[r]);
            for (int s = 0; s < e->n_stories; s++)
                if ((rc = story_ratio(e, &e->stories[s], &spec, &ratios[s], err)))
                    return pd_error_prefix(err, "%s at retention %g, story %d", specs[i], retentions[r], s);
            summary sm = summarise(ratios, e->n_stories);
            printf(" %.3f ± %.3f [%.3f, %.3f] |", sm.mean, sm.std, sm.min, sm.max);
        }
        putchar('\n');
        fflush(stdout);
        fprintf(stderr, "policy-eval: %s done\n", specs[i]);
    }
    return PD_OK;
}

/* ------------------------------------------------------------------------
 * Separating policies (issue 17): protection scaled with the retention,
 * per-span keep rates, far-context copies, instruction survival, and the
 * data files the figures are drawn from (tools/eval-figures.sh).
 * ------------------------------------------------------------------------ */

/* Every retention measured with scaled protection: the tables use 0.5,
 * 0.25 and 0.1 (with and without fair=1), the curves all of them (base
 * policies only). Retention 1 keeps everything bit-identically (ratio 1). */
static const double curve_retentions[] = {0.05, 0.1, 0.15, 0.25, 0.35, 0.5, 0.75};
#define N_CURVE_RET ((int)(sizeof curve_retentions / sizeof curve_retentions[0]))
#define MAX_SETS 32
#define N_SEP_SPECS (2 * PD_POLICY_COUNT) /* every policy, then every policy with fair=1 */

typedef struct sep_opts {
    const char *data_dir; /* NULL: no data files */
    int n_sets;           /* instruction-survival prefixes */
    int span_len;         /* tokens per independent span (the first one's BOS included) */
    int cue_len;          /* opening tokens of a span repeated after the prefix */
    uint64_t seed;        /* first story seed; survival spans use seed + 1000 + ... */
} sep_opts;

/* One spec at one retention. */
typedef struct sep_cell {
    double ratio[MAX_STORIES];    /* all continuation tokens, per story */
    double far_nll, far_nll_full; /* summed over the far-copy tokens of every story */
    double span_kept[N_SPANS];    /* unprotected kept fraction per span, mean over stories */
    double span_spread;           /* max / min of span_kept per story, mean over stories */
    double surv[N_SPANS];         /* per-span NLL ratio of the survival probe, mean over sets */
    double surv_worst;            /* the worst span's ratio, mean over sets */
} sep_cell;

typedef struct sep_ctx {
    eval_ctx *e;
    sep_opts o;
    double *tok_full[MAX_STORIES]; /* NLL per continuation token after the full prefix ([0] is not scored) */
    uint8_t *far[MAX_STORIES];     /* 1 = a far-copy token (far_copy_mask) */
    int far_count;
    double far_full_sum, far_bos_sum, all_full_sum, all_bos_sum; /* references: full prefix vs BOS alone */
    int64_t all_count;
    pd_token *sets[MAX_SETS];      /* survival prefixes: N_SPANS spans of span_len tokens */
    double set_full[MAX_SETS][N_SPANS], set_cue_only[MAX_SETS][N_SPANS];
    double *tok_buf;               /* scratch: one story's per-token NLLs */
    pd_policy_spec specs[N_SEP_SPECS];
    char names[N_SEP_SPECS][32];
    sep_cell *cells;               /* [N_SEP_SPECS][N_CURVE_RET] */
} sep_ctx;

/* NLL of every token of `text` after the prefix, as pd_nll computes it
 * (same chunking, so the mean is the same): out[0] = 0 because a prefix
 * keeps K/V, not its last token's logits, so text[0] is fed, not scored. */
#define TOKEN_NLL_CHUNK 64
static int token_nlls(pd_model *m, const pd_kv_prefix *prefix, const pd_token *text, int64_t n, double *out,
                      pd_error *err) {
    const int32_t V = pd_model_hparams(m)->n_vocab;
    float *logits = malloc(sizeof(float) * (size_t)V * TOKEN_NLL_CHUNK);
    if (!logits) return pd_errorf(err, PD_ENOMEM, "out of memory for logits");
    pd_seq *s = NULL;
    int rc = pd_seq_create(m, 0, &s, err);
    if (!rc) rc = pd_seq_attach_prefix(s, prefix, err);
    pd_prefill_opts all = {.logits_all = true};
    out[0] = 0;
    for (int64_t i = 0; !rc && i < n - 1; i += TOKEN_NLL_CHUNK) {
        const int64_t c = n - 1 - i < TOKEN_NLL_CHUNK ? n - 1 - i : TOKEN_NLL_CHUNK;
        rc = pd_prefill(m, s, text + i, c, &all, logits, err);
        for (int64_t j = 0; !rc && j < c; j++) {
            const float *l = logits + j * V;
            float mx = l[0];
            for (int32_t v = 1; v < V; v++) mx = fmaxf(mx, l[v]);
            double sum = 0;
            for (int32_t v = 0; v < V; v++) sum += exp((double)l[v] - mx);
            out[i + j + 1] = log(sum) + mx - l[text[i + j + 1]];
        }
    }
    pd_seq_free(s);
    free(logits);
    return rc;
}

/* A token that names something: a normal vocabulary piece with at least 3
 * bytes besides SentencePiece's leading space mark (U+2581), starting with a
 * letter. With a 512-token vocabulary most pieces are 1-2 characters
 * (punctuation, "▁a", "ed") that recur everywhere; the long ones are
 * whole words or the bulk of names ("▁Lily", "▁ball"). */
static bool naming_piece(const pd_tokenizer *t, pd_token id) {
    if (pd_tokenizer_token_type(t, id) != PD_TOKEN_TYPE_NORMAL) return false;
    const char *p = pd_tokenizer_token_text(t, id);
    if (!p) return false;
    if (!strncmp(p, "\xe2\x96\x81", 3)) p += 3;
    return strlen(p) >= 3 && ((*p >= 'A' && *p <= 'Z') || (*p >= 'a' && *p <= 'z'));
}

/* The far-copy tokens of a story: continuation tokens (scored ones, i >= 1)
 * with a naming piece that occurs in the first half of the prefix, not in
 * its second half and not earlier in the continuation, and that is rare:
 * in the prefixes of at most 3/4 of the stories (doc_freq), which drops
 * the words nearly every story has ("▁Once", "▁Lily", "▁play"). So the
 * model can only take them from far context: a policy that forgot the
 * first half must lose on them. Returns how many. */
static int far_copy_mask(const pd_tokenizer *t, const story *st, const int *doc_freq, int max_doc_freq,
                         uint8_t *far) {
    const int64_t half = st->n_prefix / 2;
    const pd_token *cont = st->ids + st->n_prefix;
    int count = 0;
    for (int64_t i = 0; i < st->n_cont; i++) {
        far[i] = 0;
        if (i == 0 || !naming_piece(t, cont[i]) || doc_freq[cont[i]] > max_doc_freq) continue;
        bool early = false, late = false, seen = false;
        for (int64_t j = 1; j < half && !early; j++) early = st->ids[j] == cont[i];
        for (int64_t j = half; j < st->n_prefix && !late; j++) late = st->ids[j] == cont[i];
        for (int64_t j = 0; j < i && !seen; j++) seen = cont[j] == cont[i];
        far[i] = early && !late && !seen;
        count += far[i];
    }
    return count;
}

/* The spec at `retention` with protection scaled as the evaluation's (d):
 * sinks, recent tokens and the kept observation window of the SnapKV-family
 * and OBCache scorers times min(1, retention / 0.5), so protection takes
 * the same share of the budget at every retention as the defaults do at
 * 0.5 (at 0.1 Compactor's 16 + 64 would otherwise fill the 40-token budget
 * of a 400-token prefix). LASER-KV derives its protection from the budget
 * already. */
static int scaled_spec(const pd_policy_spec *base, double retention, pd_policy_spec *out, pd_error *err) {
    *out = *base;
    pd_policy_spec_set_retention(out, retention);
    const double f = retention < 0.5 ? retention / 0.5 : 1.0;
    if (base->kind != PD_POLICY_LASERKV) {
        if (base->sink > 0) out->sink = (int32_t)fmax(1, lround(base->sink * f));
        out->recent = (int32_t)lround(base->recent * f);
    }
    if ((base->scorer == PD_POLICY_SNAPKV || base->scorer == PD_POLICY_OBCACHE) && base->window > 0)
        out->window = (int32_t)fmax(1, lround(base->window * f));
    return pd_policy_spec_validate(out, err);
}

static sep_cell *sep_at(sep_ctx *c, int spec, int r) { return &c->cells[spec * N_CURVE_RET + r]; }

static bool table_retention(double r) {
    for (int i = 0; i < N_RET; i++)
        if (fabs(retentions[i] - r) < 1e-12) return true;
    return false;
}

static int curve_index(double r) {
    for (int i = 0; i < N_CURVE_RET; i++)
        if (fabs(curve_retentions[i] - r) < 1e-12) return i;
    return -1;
}

/* The repeated opening of span k of survival prefix j (its first cue_len
 * tokens after the BOS that only span 0 has), followed in the prefix by the
 * text the probe scores: survival_rest tokens up to the span's end. */
static const pd_token *survival_cue(const sep_ctx *c, int j, int k) {
    return c->sets[j] + (int64_t)k * c->o.span_len + (k == 0);
}
static int64_t survival_rest(const sep_ctx *c, int k) { return c->o.span_len - c->o.cue_len - (k == 0); }

/* The references: per-token NLLs after the full prefix and after BOS alone,
 * the far-copy masks, and the survival prefixes with their full-prefix and
 * cue-only NLLs. */
static int sep_prepare(sep_ctx *c, pd_error *err) {
    eval_ctx *e = c->e;
    const pd_tokenizer *t = pd_model_tokenizer(e->m);
    int rc = PD_OK;
    pd_kv_prefix *p = NULL, *bos = NULL;
    pd_token *sample = NULL;
    const int32_t V = pd_model_hparams(e->m)->n_vocab;
    int *doc_freq = calloc((size_t)V, sizeof(int));
    uint8_t *seen = calloc((size_t)V, 1);
    if (!doc_freq || !seen) {
        free(doc_freq);
        free(seen);
        return pd_errorf(err, PD_ENOMEM, "out of memory for token counts");
    }
    for (int s = 0; s < e->n_stories; s++) {
        memset(seen, 0, (size_t)V);
        for (int64_t i = 0; i < e->stories[s].n_prefix; i++) seen[e->stories[s].ids[i]] = 1;
        for (int32_t v = 0; v < V; v++) doc_freq[v] += seen[v];
    }
    const int max_doc_freq = 3 * e->n_stories / 4 > 1 ? 3 * e->n_stories / 4 : 1;
    if ((rc = full_prefix(e->m, e->stories[0].ids, 1, &bos, err))) goto fail;
    for (int s = 0; s < e->n_stories; s++) {
        const story *st = &e->stories[s];
        c->tok_full[s] = calloc((size_t)st->n_cont, sizeof(double));
        c->far[s] = calloc((size_t)st->n_cont, 1);
        if (!c->tok_full[s] || !c->far[s]) {
            rc = pd_errorf(err, PD_ENOMEM, "out of memory for story %d's token NLLs", s);
            goto fail;
        }
        c->far_count += far_copy_mask(t, st, doc_freq, max_doc_freq, c->far[s]);
        if ((rc = full_prefix(e->m, st->ids, st->n_prefix, &p, err))) goto fail;
        if ((rc = token_nlls(e->m, p, st->ids + st->n_prefix, st->n_cont, c->tok_full[s], err))) goto fail;
        pd_kv_prefix_free(p);
        p = NULL;
        if ((rc = token_nlls(e->m, bos, st->ids + st->n_prefix, st->n_cont, c->tok_buf, err))) goto fail;
        for (int64_t i = 1; i < st->n_cont; i++) {
            c->all_full_sum += c->tok_full[s][i];
            c->all_bos_sum += c->tok_buf[i];
            c->all_count++;
            if (c->far[s][i]) c->far_full_sum += c->tok_full[s][i], c->far_bos_sum += c->tok_buf[i];
        }
    }
    const int64_t n_set = (int64_t)N_SPANS * c->o.span_len;
    if (!(sample = malloc(sizeof(pd_token) * (size_t)(c->o.span_len + 1)))) {
        rc = pd_errorf(err, PD_ENOMEM, "out of memory for a survival span");
        goto fail;
    }
    for (int j = 0; j < c->o.n_sets; j++) {
        if (!(c->sets[j] = malloc(sizeof(pd_token) * (size_t)n_set))) {
            rc = pd_errorf(err, PD_ENOMEM, "out of memory for survival prefix %d", j);
            goto fail;
        }
        /* Only the first span keeps its BOS: the model was trained on
         * stories separated by BOS and does not look back across one, so a
         * BOS inside the prefix (or in the repeated opening) would hide the
         * spans before it whatever the policy kept. */
        for (int k = 0; k < N_SPANS; k++) {
            if ((rc = sample_story(e->m, c->o.seed + 1000 + (uint64_t)(N_SPANS * j + k), c->o.span_len + 1, sample,
                                   err)))
                goto fail;
            memcpy(c->sets[j] + (int64_t)k * c->o.span_len, sample + (k > 0), sizeof(pd_token) * (size_t)c->o.span_len);
        }
        if ((rc = full_prefix(e->m, c->sets[j], n_set, &p, err))) goto fail;
        for (int k = 0; k < N_SPANS && !rc; k++) {
            const pd_token *cue = survival_cue(c, j, k);
            const int64_t n_rest = survival_rest(c, k);
            rc = pd_nll(e->m, p, cue, c->o.cue_len, cue + c->o.cue_len, n_rest, &c->set_full[j][k], err);
            if (!rc) rc = pd_nll(e->m, NULL, cue, c->o.cue_len, cue + c->o.cue_len, n_rest, &c->set_cue_only[j][k], err);
        }
        pd_kv_prefix_free(p);
        p = NULL;
        if (rc) goto fail;
    }
fail:
    free(doc_freq);
    free(seen);
    free(sample);
    pd_kv_prefix_free(p);
    pd_kv_prefix_free(bos);
    return rc;
}

/* One spec at one retention over every story and survival prefix. The
 * layout of 4 equal spans is always passed: without fair=1 it changes
 * nothing (there is no whitelist) but gives the per-span counts. */
static int sep_measure(sep_ctx *c, const pd_policy_spec *spec, sep_cell *cell, pd_error *err) {
    eval_ctx *e = c->e;
    pd_span spans[N_SPANS];
    pd_kv_prefix *p = NULL;
    pd_compress_stats cs;
    memset(&cs, 0, sizeof cs);
    int rc = PD_OK;
    for (int s = 0; s < e->n_stories; s++) {
        const story *st = &e->stories[s];
        equal_spans(st->n_prefix, spans);
        pd_layout lay = {.spans = spans, .n_spans = N_SPANS};
        if ((rc = pd_compress_prefix(e->m, st->ids, st->n_prefix, spec, &lay, &p, &cs, err))) goto fail;
        if ((rc = token_nlls(e->m, p, st->ids + st->n_prefix, st->n_cont, c->tok_buf, err))) goto fail;
        double sum = 0, full = 0, lo = INFINITY, hi = 0;
        for (int64_t i = 1; i < st->n_cont; i++) {
            sum += c->tok_buf[i];
            full += c->tok_full[s][i];
            if (c->far[s][i]) cell->far_nll += c->tok_buf[i], cell->far_nll_full += c->tok_full[s][i];
        }
        cell->ratio[s] = sum / full;
        for (int k = 0; k < N_SPANS; k++) {
            double kept;
            pd_compress_span_fraction(&cs, k, NULL, &kept);
            cell->span_kept[k] += kept / e->n_stories;
            lo = fmin(lo, kept);
            hi = fmax(hi, kept);
        }
        cell->span_spread += (lo > 0 ? hi / lo : INFINITY) / e->n_stories;
        pd_compress_stats_free(&cs);
        memset(&cs, 0, sizeof cs);
        pd_kv_prefix_free(p);
        p = NULL;
    }
    const int64_t n_set = (int64_t)N_SPANS * c->o.span_len;
    for (int j = 0; j < c->o.n_sets; j++) {
        equal_spans(n_set, spans);
        pd_layout lay = {.spans = spans, .n_spans = N_SPANS};
        if ((rc = pd_compress_prefix(e->m, c->sets[j], n_set, spec, &lay, &p, NULL, err))) goto fail;
        double worst = 0;
        for (int k = 0; k < N_SPANS; k++) {
            const pd_token *cue = survival_cue(c, j, k);
            double nll;
            if ((rc = pd_nll(e->m, p, cue, c->o.cue_len, cue + c->o.cue_len, survival_rest(c, k), &nll, err)))
                goto fail;
            const double ratio = nll / c->set_full[j][k];
            cell->surv[k] += ratio / c->o.n_sets;
            worst = fmax(worst, ratio);
        }
        cell->surv_worst += worst / c->o.n_sets;
        pd_kv_prefix_free(p);
        p = NULL;
    }
fail:
    pd_compress_stats_free(&cs);
    pd_kv_prefix_free(p);
    return rc;
}

static int sep_run_all(sep_ctx *c, pd_error *err) {
    for (int i = 0; i < N_SEP_SPECS; i++) {
        const bool fair = i >= PD_POLICY_COUNT;
        for (int r = 0; r < N_CURVE_RET; r++) {
            if (fair && !table_retention(curve_retentions[r])) continue; /* the curves show base policies */
            pd_policy_spec spec;
            int rc = scaled_spec(&c->specs[i], curve_retentions[r], &spec, err);
            if (!rc) rc = sep_measure(c, &spec, sep_at(c, i, r), err);
            if (rc) return pd_error_prefix(err, "%s at retention %g (protection scaled)", c->names[i], curve_retentions[r]);
        }
        fprintf(stderr, "policy-eval: %s (protection scaled) done\n", c->names[i]);
    }
    return PD_OK;
}

static void sep_print_tables(sep_ctx *c) {
    const sep_opts *o = &c->o;
    printf("\n**(d) Protection scaled with the retention.** Sinks, recent tokens and the kept observation window "
           "(snapkv, pyramidkv, chunkkv, obcache) times min(1, retention / 0.5); laserkv's protection is a share "
           "of the budget already. E.g. compactor keeps 16 + 64 at 0.5, 8 + 32 at 0.25, 3 + 13 at 0.1; snapkv's "
           "window is 64, 32, 13. Same stories and cells as above.\n\n");
    printf("| policy | retention 0.5 | retention 0.25 | retention 0.1 |\n|---|---|---|---|\n");
    for (int i = 0; i < N_SEP_SPECS; i++) {
        printf("| `%s` |", c->names[i]);
        for (int r = 0; r < N_RET; r++) {
            summary sm = summarise(sep_at(c, i, curve_index(retentions[r]))->ratio, c->e->n_stories);
            printf(" %.3f ± %.3f [%.3f, %.3f] |", sm.mean, sm.std, sm.min, sm.max);
        }
        putchar('\n');
    }
    printf("\n**(b) Far-context copies.** A continuation token counts when it is a naming piece (a normal piece "
           "of at least 3 bytes besides the leading space mark, starting with a letter) found in the prefixes of at "
           "most 3/4 of the stories, that occurs in the first half of its prefix, not in the second half and not "
           "earlier in the continuation: %d of %" PRId64
           " scored tokens over %d stories. Their mean NLL is %.3f after the full prefix and %.3f after BOS alone "
           "(all tokens: %.3f and %.3f), so the prefix is worth %.1f%% of their NLL. Cells: their summed NLL "
           "after the compressed prefix / after the full one (protection scaled).\n\n",
           c->far_count, c->all_count, c->e->n_stories, c->far_full_sum / fmax(1, c->far_count),
           c->far_bos_sum / fmax(1, c->far_count), c->all_full_sum / (double)c->all_count,
           c->all_bos_sum / (double)c->all_count, 100.0 * (1.0 - c->far_full_sum / fmax(1e-12, c->far_bos_sum)));
    printf("| policy | retention 0.5 | retention 0.25 | retention 0.1 |\n|---|---|---|---|\n");
    for (int i = 0; i < N_SEP_SPECS; i++) {
        printf("| `%s` |", c->names[i]);
        for (int r = 0; r < N_RET; r++) {
            const sep_cell *cell = sep_at(c, i, curve_index(retentions[r]));
            printf(" %.3f |", cell->far_nll / fmax(1e-12, cell->far_nll_full));
        }
        putchar('\n');
    }
    printf("\n**(a) Per-span keep rates.** Kept fraction of each of the 4 equal spans' unprotected entries (all "
           "layers and kv heads; sinks left out, the fair-eviction paper's b_X / n_X), mean over the stories, "
           "then max/min (mean over stories). Protection scaled.\n\n");
    printf("| policy | retention 0.5 | retention 0.25 | retention 0.1 |\n|---|---|---|---|\n");
    for (int i = 0; i < N_SEP_SPECS; i++) {
        printf("| `%s` |", c->names[i]);
        for (int r = 0; r < N_RET; r++) {
            const sep_cell *cell = sep_at(c, i, curve_index(retentions[r]));
            printf(" %.2f %.2f %.2f %.2f (%.2f) |", cell->span_kept[0], cell->span_kept[1], cell->span_kept[2],
                   cell->span_kept[3], cell->span_spread);
        }
        putchar('\n');
    }
    double full = 0, cue = 0;
    for (int j = 0; j < o->n_sets; j++)
        for (int k = 0; k < N_SPANS; k++) full += c->set_full[j][k], cue += c->set_cue_only[j][k];
    printf("\n**(c) Instruction survival.** %d prefixes, each %d independent story openings of %d tokens "
           "(sampled from BOS, seeds %" PRIu64 "..%" PRIu64 "; only the first keeps its BOS); after the compressed "
           "prefix the first %d tokens of span k are repeated and the rest of span k (%d-%d tokens) scored, which the "
           "model can copy from span k. Mean NLL of that "
           "text after the full prefix %.3f, after the repeated opening alone %.3f. Cells: the worst span's "
           "ratio (mean over prefixes), then the mean ratio of spans 1-4. `fair=1` spans are the 4 openings. "
           "Protection scaled.\n\n",
           o->n_sets, N_SPANS, o->span_len, o->seed + 1000, o->seed + 1000 + (uint64_t)(N_SPANS * o->n_sets) - 1,
           o->cue_len, o->span_len - o->cue_len - 1, o->span_len - o->cue_len, full / (o->n_sets * N_SPANS), cue / (o->n_sets * N_SPANS));
    printf("Per span (1-4), mean NLL after the full prefix / after the opening alone:");
    for (int k = 0; k < N_SPANS; k++) {
        double fk = 0, ck = 0;
        for (int j = 0; j < o->n_sets; j++) fk += c->set_full[j][k], ck += c->set_cue_only[j][k];
        printf(" %.3f / %.3f%s", fk / o->n_sets, ck / o->n_sets, k + 1 < N_SPANS ? "," : ".\n\n");
    }
    printf("| policy | retention 0.5 | retention 0.25 | retention 0.1 |\n|---|---|---|---|\n");
    for (int i = 0; i < N_SEP_SPECS; i++) {
        printf("| `%s` |", c->names[i]);
        for (int r = 0; r < N_RET; r++) {
            const sep_cell *cell = sep_at(c, i, curve_index(retentions[r]));
            printf(" %.3f (%.2f %.2f %.2f %.2f) |", cell->surv_worst, cell->surv[0], cell->surv[1], cell->surv[2],
                   cell->surv[3]);
        }
        putchar('\n');
    }
    fflush(stdout);
}

typedef double (*sep_value_fn)(const sep_cell *cell, int n_stories);
static double value_ratio(const sep_cell *cell, int n) { return summarise(cell->ratio, n).mean; }
static double value_far(const sep_cell *cell, int n) {
    (void)n;
    return cell->far_nll / fmax(1e-12, cell->far_nll_full);
}
static double value_survival(const sep_cell *cell, int n) {
    (void)n;
    return cell->surv_worst;
}

static FILE *data_open(const char *dir, const char *name, pd_error *err) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    if (!f) pd_errorf(err, PD_EIO, "cannot write %s: %s (does --data-dir exist and is it writable?)", path, strerror(errno));
    return f;
}

static int data_close(FILE *f, const char *name, pd_error *err) {
    if (ferror(f) | fclose(f)) return pd_errorf(err, PD_EIO, "writing %s failed", name);
    return PD_OK;
}

/* A curve file: "retention <policy> ..." then one row per retention, base
 * policies only, retention 1 last (ratio 1: nothing evicted). */
static int write_curve(sep_ctx *c, const char *name, sep_value_fn value, pd_error *err) {
    FILE *f = data_open(c->o.data_dir, name, err);
    if (!f) return PD_EIO;
    fprintf(f, "retention");
    for (int i = 0; i < PD_POLICY_COUNT; i++) fprintf(f, " %s", c->names[i]);
    fputc('\n', f);
    for (int r = 0; r < N_CURVE_RET; r++) {
        fprintf(f, "%g", curve_retentions[r]);
        for (int i = 0; i < PD_POLICY_COUNT; i++) fprintf(f, " %.5f", value(sep_at(c, i, r), c->e->n_stories));
        fputc('\n', f);
    }
    fprintf(f, "1");
    for (int i = 0; i < PD_POLICY_COUNT; i++) fprintf(f, " 1");
    fputc('\n', f);
    return data_close(f, name, err);
}

/* span-keep-R.dat: "policy fair0_span1..4 fair1_span1..4" per base policy. */
static int write_span_keep(sep_ctx *c, double retention, pd_error *err) {
    char name[64];
    snprintf(name, sizeof name, "span-keep-%g.dat", retention);
    FILE *f = data_open(c->o.data_dir, name, err);
    if (!f) return PD_EIO;
    const int r = curve_index(retention);
    fprintf(f, "policy s1 s2 s3 s4 fair_s1 fair_s2 fair_s3 fair_s4\n");
    for (int i = 0; i < PD_POLICY_COUNT; i++) {
        const sep_cell *base = sep_at(c, i, r), *fair = sep_at(c, i + PD_POLICY_COUNT, r);
        fprintf(f, "%s", c->names[i]);
        for (int k = 0; k < N_SPANS; k++) fprintf(f, " %.4f", base->span_kept[k]);
        for (int k = 0; k < N_SPANS; k++) fprintf(f, " %.4f", fair->span_kept[k]);
        fputc('\n', f);
    }
    return data_close(f, name, err);
}

static int sep_write_data(sep_ctx *c, pd_error *err) {
    int rc = write_curve(c, "curve-ratio.dat", value_ratio, err);
    if (!rc) rc = write_curve(c, "curve-far.dat", value_far, err);
    if (!rc) rc = write_curve(c, "curve-survival.dat", value_survival, err);
    for (int r = 0; !rc && r < N_RET; r++) rc = write_span_keep(c, retentions[r], err);
    return rc;
}

/* Everything of the separation evaluation: references, every cell, the
 * tables on stdout and the data files. */
static int separation_tables(eval_ctx *e, const sep_opts *o, pd_error *err) {
    sep_ctx c;
    memset(&c, 0, sizeof c);
    c.e = e;
    c.o = *o;
    int rc = PD_OK;
    const int64_t n_cont_max = e->stories[0].n_cont;
    c.tok_buf = malloc(sizeof(double) * (size_t)n_cont_max);
    c.cells = calloc((size_t)N_SEP_SPECS * N_CURVE_RET, sizeof *c.cells);
    if (!c.tok_buf || !c.cells) {
        rc = pd_errorf(err, PD_ENOMEM, "out of memory for the separation cells");
        goto fail;
    }
    for (int i = 0; i < N_SEP_SPECS; i++) {
        const pd_policy_kind kind = (pd_policy_kind)(i % PD_POLICY_COUNT);
        snprintf(c.names[i], sizeof c.names[i], "%s%s", pd_policy_kind_name(kind), i < PD_POLICY_COUNT ? "" : ":fair=1");
        if ((rc = pd_policy_spec_parse(c.names[i], &c.specs[i], err))) goto fail;
    }
    if ((rc = sep_prepare(&c, err))) goto fail;
    if ((rc = sep_run_all(&c, err))) goto fail;
    sep_print_tables(&c);
    if (o->data_dir) rc = sep_write_data(&c, err);
fail:
    for (int s = 0; s < MAX_STORIES; s++) free(c.tok_full[s]), free(c.far[s]);
    for (int j = 0; j < MAX_SETS; j++) free(c.sets[j]);
    free(c.tok_buf);
    free(c.cells);
    return rc;
}

/* The zero-shot arm's calibration set: stories sampled with seeds
 * cal_seed, cal_seed + 1, ... (disjoint from the evaluated ones), as long
 * as the evaluated stories (prefix + continuation). */
static int sample_calibration_set(eval_ctx *e, uint64_t cal_seed, pd_token **set, pd_error *err) {
    const int64_t n = e->stories[0].n_prefix + e->stories[0].n_cont;
    for (int s = 0; s < e->n_stories; s++) {
        if (!(set[s] = malloc(sizeof **set * (size_t)n)))
            return pd_errorf(err, PD_ENOMEM, "out of memory for calibration story %d", s);
        int rc = sample_story(e->m, cal_seed + (uint64_t)s, n, set[s], err);
        if (rc) return pd_error_prefix(err, "calibration story %d", s);
    }
    return PD_OK;
}

/* Offline calibration (the Compactor paper's setting): one curve fitted on
 * the calibration set, each story's continuation held out after its
 * prefix, exactly the evaluated stories' split. */
static int fit_zero_shot(eval_ctx *e, pd_token *const *set, const pd_policy_spec *spec, const pd_calib_opts *o,
                         pd_curve *curve, pd_error *err) {
    const int64_t n = e->stories[0].n_prefix + e->stories[0].n_cont;
    pd_calib_opts mo = *o;
    mo.holdout = (double)e->stories[0].n_cont / (double)n;
    double ratios[MAX_STORIES * PD_CALIB_MAX_POINTS];
    for (int s = 0; s < e->n_stories; s++) {
        int rc = pd_calib_measure_text(e->m, set[s], n, spec, &mo, ratios + s * mo.n_points, NULL, err);
        if (rc) return pd_error_prefix(err, "calibration story %d", s);
    }
    return pd_curve_fit_set(mo.points, mo.n_points, ratios, e->n_stories, mo.under_weight, curve, err);
}

typedef struct arm_stats {
    int hits;
    double chosen_sum, measured_sum, measured_max, probe_sum;
} arm_stats;

static void print_arm(const char *spec, double tau, const char *arm, const arm_stats *a, int k, bool probe) {
    printf("| `%s` | %.2f | %s | %d/%d | %.3f | %.4f | %.4f |", spec, tau, arm, a->hits, k, a->chosen_sum / k,
           a->measured_sum / k, a->measured_max);
    if (probe) printf(" %.4f |\n", a->probe_sum / k);
    else printf(" — |\n");
}

static int calibration_table(eval_ctx *e, uint64_t cal_seed, pd_error *err) {
    static const double taus[] = {1.02, 1.05, 1.10};
    static const char *const specs[] = {"compactor", "snapkv", "knorm"};
    pd_token *set[MAX_STORIES] = {0};
    int rc = sample_calibration_set(e, cal_seed, set, err);
    printf("| policy | tau | calibration | hit rate (measured <= tau) | mean chosen retention | mean measured ratio | "
           "max measured ratio | mean probe ratio at the choice |\n|---|---|---|---|---|---|---|---|\n");
    for (size_t p = 0; !rc && p < sizeof specs / sizeof specs[0]; p++) {
        pd_policy_spec spec;
        pd_curve curve;
        pd_calib_opts o;
        pd_calib_opts_default(&o);
        o.holdout = 0.2;
        if ((rc = pd_policy_spec_parse(specs[p], &spec, err))) break;
        if ((rc = fit_zero_shot(e, set, &spec, &o, &curve, err))) {
            pd_error_prefix(err, "zero-shot curve of %s", specs[p]);
            break;
        }
        fprintf(stderr, "policy-eval: zero-shot curve of %s: a %.6g, b %.6g\n", specs[p], curve.a, curve.b);
        for (size_t t = 0; !rc && t < sizeof taus / sizeof taus[0]; t++) {
            o.tau = taus[t];
            arm_stats probe = {0}, zero = {0};
            const double zero_chosen = pd_curve_choose(curve, taus[t], o.min_retention);
            pd_policy_spec zero_spec = spec;
            pd_policy_spec_set_retention(&zero_spec, zero_chosen);
            for (int s = 0; s < e->n_stories; s++) {
                const story *st = &e->stories[s];
                pd_calib_result cr;
                pd_policy_spec chosen;
                double ratio = 0, zero_ratio = 0;
                rc = pd_calibrate(e->m, st->ids, st->n_prefix, &spec, NULL, &o, &cr, &chosen, err);
                if (!rc) rc = story_ratio(e, st, &chosen, &ratio, err);
                if (!rc) rc = story_ratio(e, st, &zero_spec, &zero_ratio, err);
                if (rc) {
                    pd_error_prefix(err, "calibration of %s, tau %g, story %d", specs[p], taus[t], s);
                    break;
                }
                probe.hits += ratio <= taus[t];
                probe.chosen_sum += cr.chosen;
                probe.measured_sum += ratio;
                probe.measured_max = fmax(probe.measured_max, ratio);
                probe.probe_sum += cr.measured;
                zero.hits += zero_ratio <= taus[t];
                zero.chosen_sum += zero_chosen;
                zero.measured_sum += zero_ratio;
                zero.measured_max = fmax(zero.measured_max, zero_ratio);
            }
            if (rc) break;
            print_arm(specs[p], taus[t], "probe", &probe, e->n_stories, true);
            print_arm(specs[p], taus[t], "zero-shot", &zero, e->n_stories, false);
            fflush(stdout);
        }
        if (!rc) fprintf(stderr, "policy-eval: calibration of %s done\n", specs[p]);
    }
    for (int s = 0; s < e->n_stories; s++) free(set[s]);
    return rc;
}

int main(int argc, char **argv) {
    static const struct option opts[] = {
        {"stories", required_argument, 0, 'k'}, {"prefix", required_argument, 0, 'p'},
        {"cont", required_argument, 0, 'c'},    {"seed", required_argument, 0, 's'},
        {"threads", required_argument, 0, 'T'}, {"help", no_argument, 0, 'h'},
        {"sets", required_argument, 0, 'S'},    {"data-dir", required_argument, 0, 'D'},
        {0, 0, 0, 0}};
    long k = 8, n_prefix = 400, n_cont = 100, seed = 1, threads = 2, n_sets = 4;
    sep_opts so = {.span_len = 100, .cue_len = 12};
    int c, rc = PD_OK;
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'k': if ((rc = parse_int("--stories", optarg, 1, MAX_STORIES, &k))) return rc; break;
        case 'p': if ((rc = parse_int("--prefix", optarg, 64, 1 << 20, &n_prefix))) return rc; break;
        case 'c': if ((rc = parse_int("--cont", optarg, 2, 1 << 20, &n_cont))) return rc; break;
        case 's': if ((rc = parse_int("--seed", optarg, 0, INT32_MAX, &seed))) return rc; break;
        case 'T': if ((rc = parse_int("--threads", optarg, 0, 1024, &threads))) return rc; break;
        case 'S': if ((rc = parse_int("--sets", optarg, 1, MAX_SETS, &n_sets))) return rc; break;
        case 'D': so.data_dir = optarg; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (argc - optind > 1) {
        usage(stderr);
        return 2;
    }
    const char *path = optind < argc ? argv[optind] : DEFAULT_MODEL;
    pd_error err = {0};
    eval_ctx e;
    memset(&e, 0, sizeof e);
    pd_model_params mp = {.n_threads = (int)threads};
    if ((rc = pd_model_load(path, &mp, &e.m, &err))) {
        fprintf(stderr, "policy-eval: %s\n", err.msg);
        return 1;
    }
    const int32_t ctx = pd_model_hparams(e.m)->n_ctx_train;
    if (n_prefix + n_cont > ctx) {
        fprintf(stderr, "policy-eval: prefix %ld + continuation %ld tokens exceed the context of %d\n", n_prefix,
                n_cont, ctx);
        pd_model_free(e.m);
        return 2;
    }
    if ((N_SPANS + 1) * so.span_len > ctx) {
        fprintf(stderr, "policy-eval: the survival probe needs %d tokens (%d spans of %d and one repeated), more "
                "than the model's context of %d\n", (N_SPANS + 1) * so.span_len, N_SPANS, so.span_len, ctx);
        pd_model_free(e.m);
        return 2;
    }
    const double t0 = pd_now_seconds();
    double nll_sum = 0;
    for (int s = 0; !rc && s < k; s++) {
        story *st = &e.stories[s];
        st->n_prefix = n_prefix;
        st->n_cont = n_cont;
        pd_kv_prefix *full = NULL;
        if (!(st->ids = malloc(sizeof *st->ids * (size_t)(n_prefix + n_cont)))) {
            rc = pd_errorf(&err, PD_ENOMEM, "out of memory for story %d", s);
            break;
        }
        e.n_stories++;
        rc = sample_story(e.m, (uint64_t)(seed + s), n_prefix + n_cont, st->ids, &err);
        if (!rc) rc = full_prefix(e.m, st->ids, n_prefix, &full, &err);
        if (!rc) rc = pd_nll(e.m, full, NULL, 0, st->ids + n_prefix, n_cont, &st->nll_full, &err);
        pd_kv_prefix_free(full);
        nll_sum += st->nll_full;
    }
    if (!rc) {
        printf("Model `%s`, %d stories sampled at temperature 1 (seeds %ld..%ld), prefix %ld tokens (BOS "
               "included), continuation %ld tokens; mean continuation NLL after the full prefix %.4f nats/token.\n\n",
               path, e.n_stories, seed, seed + k - 1, n_prefix, n_cont, nll_sum / e.n_stories);
        printf("NLL ratio NLL(continuation | compressed prefix) / NLL(continuation | full prefix): mean ± std "
               "[min, max] over the stories. `fair=1` variants use 4 equal spans (debias=1, local=1).\n\n");
        rc = policy_table(&e, &err);
    }
    so.n_sets = (int)n_sets;
    so.seed = (uint64_t)seed;
    if (!rc) rc = separation_tables(&e, &so, &err);
    if (!rc) {
        printf("\nCalibration: `probe` runs pd_calibrate on the prefix alone (its last 20%% as probe, points 0.5, "
               "0.25, 0.125, 0.0625, min retention 0.05, under-prediction weight 4); `zero-shot` chooses from one "
               "curve per policy fitted offline (pd_curve_fit_set, same points and weight) on %ld other stories "
               "(seeds %ld..%ld), each split into the same prefix and continuation. Either way the prefix is then "
               "compressed at the chosen retention and the ratio measured on the real continuation.\n\n",
               k, seed + ZERO_SHOT_SEED_OFFSET, seed + ZERO_SHOT_SEED_OFFSET + k - 1);
        rc = calibration_table(&e, (uint64_t)(seed + ZERO_SHOT_SEED_OFFSET), &err);
    }
    if (!rc) fprintf(stderr, "policy-eval: %.1f s\n", pd_now_seconds() - t0);
    for (int s = 0; s < e.n_stories; s++) free(e.stories[s].ids);
    pd_model_free(e.m);
    if (rc) {
        fprintf(stderr, "policy-eval: %s\n", err.msg);
        return 1;
    }
    return 0;
}
