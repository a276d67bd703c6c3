/* policies: query-agnostic KV cache eviction for registered prefixes.
 *
 * A policy is a SCORER (per layer: one score per (kv_head, token), higher =
 * keep) plus the shared SELECTION machinery (budgets, protected tokens,
 * fair per-span quotas, chunks, index reuse across layers). Everything a
 * policy does is named by its canonical spec string, which is part of the
 * prefix cache key:
 *
 *     compactor:attn_chunk=128,budget=global,...,retention=0.25,...
 *
 * `retention` is always the fraction of tokens KEPT (1 = no compression).
 *
 * The stack: policies -> engine -> kernels. The compressor plugs into the
 * engine's per-layer prefill hook (pd_prefill_hook_fn), so memory stays
 * O(n * d) per layer; calibration uses pd_nll.
 *
 * This header is the folder's public contract. */
#ifndef PD_POLICIES_H
#define PD_POLICIES_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "engine/model.h" /* pd_model, pd_kv_prefix, pd_layer_kv */
#include "engine/tokenizer.h" /* pd_tokenizer: layouts from text */
#include "util/util.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------
 * Spec
 * ------------------------------------------------------------------------ */

/* Policy names as written in spec strings. */
typedef enum pd_policy_kind {
    PD_POLICY_COMPACTOR = 0, /* "compactor": leverage + non-causal attention (default) */
    PD_POLICY_LEVERAGE,      /* "leverage": Compactor's leverage half alone (exact or approx) */
    PD_POLICY_NONCAUSAL,     /* "noncausal": Compactor's attention half alone */
    PD_POLICY_RANDOM,        /* "random": seeded uniform scores */
    PD_POLICY_KNORM,         /* "knorm": keep keys with the smallest L2 norm */
    PD_POLICY_STREAMING,     /* "streaming": StreamingLLM, sinks + most recent */
    PD_POLICY_SNAPKV,        /* "snapkv": observation window of the last queries, pooled */
    PD_POLICY_H2O,           /* "h2o": accumulated (observed) attention / number of queries */
    PD_POLICY_TOVA,          /* "tova": attention of the last token */
    PD_POLICY_PYRAMIDKV,     /* "pyramidkv": a scorer (snapkv) with pyramid layer budgets */
    PD_POLICY_CHUNKKV,       /* "chunkkv": a scorer (snapkv) selecting whole chunks, index reuse */
    PD_POLICY_OBCACHE,       /* "obcache": output-perturbation saliency (value/key/joint) */
    PD_POLICY_LASERKV,       /* "laserkv": anchors + recent + exact attention + LSH recall */
    PD_POLICY_COUNT
} pd_policy_kind;

/* How a layer's budget is spent. */
typedef enum pd_budget_mode {
    PD_BUDGET_UNIFORM = 0, /* "uniform": every kv head keeps the same count */
    PD_BUDGET_PYRAMID,     /* "pyramid": per head, layer budgets fall linearly (PyramidKV) */
    PD_BUDGET_GLOBAL,      /* "global": top-k over (token, head) pairs of the layer */
} pd_budget_mode;

typedef enum pd_compactor_profile {
    PD_PROFILE_OFFICIAL = 0, /* the paper's official implementation */
    PD_PROFILE_KVPRESS,      /* NVIDIA kvpress CompactorPress */
} pd_compactor_profile;

typedef enum pd_leverage_mode {
    PD_LEVERAGE_APPROX = 0, /* right Gaussian sketch + ridge + Cholesky */
    PD_LEVERAGE_EXACT,      /* thin QR of the centred keys, no sketch, no ridge */
} pd_leverage_mode;

/* What the per-head budget is a fraction of (Compactor's `base`). */
typedef enum pd_budget_base {
    PD_BASE_PROMPT = 0,  /* "prompt": floor(retention * n), protected tokens inside */
    PD_BASE_UNPROTECTED, /* "unprotected": round(retention * (n - sink - recent)), protected tokens inside
                          * (compactor-vllm's retain count) */
} pd_budget_base;

typedef enum pd_obcache_target {
    PD_OBCACHE_VALUE = 0,
    PD_OBCACHE_KEY,
    PD_OBCACHE_JOINT,
} pd_obcache_target;

/* A parsed, validated spec with every default filled in. Fields that a
 * policy does not use keep their defaults and are not printed. Compare
 * two specs by their canonical strings, not with memcmp. */
typedef struct pd_policy_spec {
    pd_policy_kind kind;
    pd_policy_kind scorer;  /* who scores; == kind except pyramidkv/chunkkv (key `scorer`) */

    /* common */
    double retention;       /* (0, 1]: fraction of tokens kept per layer */
    uint64_t seed;          /* random scores, Compactor sketch, LASER-KV hashes */

    /* selection */
    pd_budget_mode budget;
    double beta;            /* pyramid: smallest layer budget = mean budget / beta */
    int32_t sink;           /* first tokens always kept */
    int32_t recent;         /* last tokens always kept */
    int32_t chunk;          /* > 0: select whole chunks of this many tokens (ChunkKV) */
    int32_t reuse;          /* > 1: layer l reuses the indices of layer l - l % reuse */
    bool shared;            /* chunk > 0: the same chunks in every kv head (kvpress ChunkKVPress) */

    /* fair eviction (any policy) */
    bool fair;              /* per-span quotas; needs a layout with spans */
    double debias;          /* lambda in [0, 1]: 0 = the base policy's own per-span counts, 1 = fair */
    bool local;             /* attention scorers vote only inside each span */

    /* Compactor / leverage / noncausal */
    pd_compactor_profile profile;
    double lambda;          /* weight of z(leverage); < 0 = auto (kvpress: 1 - retention) */
    int32_t sketch;         /* sketch width */
    int32_t lev_chunk;      /* leverage chunk length; 0 = whole sequence */
    double ridge;           /* initial ridge added to the sketched Gram matrix */
    int32_t attn_chunk;     /* non-causal attention chunk length */
    double scale;           /* softmax scale; 0 = 1/sqrt(head_dim) */
    bool vnorm;             /* multiply attention scores by ||v|| (kvpress) */
    pd_leverage_mode leverage;
    pd_budget_base base;    /* compactor: what retention is a fraction of */

    /* attention scorers */
    int32_t window;         /* snapkv/pyramidkv/chunkkv/obcache/laserkv: observation queries;
                             * 0 = auto (pd_policy_window) */
    int32_t pool;           /* pool width over tokens (1 = none): average, max for obcache */
    pd_obcache_target target;

    /* LASER-KV (defaults: the official code's hybrid setting) */
    int32_t divisor;        /* protection divisor n: B/n anchors and B/n recent */
    double alpha;           /* share of the rest chosen by exact attention (the rest: LSH) */
    int32_t rounds;         /* LSH hash rounds R */
    int32_t bits;           /* hyperplanes per round */
    bool accumulate;        /* exact attention summed over the layers scored so far */
} pd_policy_spec;

#define PD_POLICY_SPEC_MAX 512 /* canonical strings are shorter than this */

/* The defaults of a policy (profile official for compactor). */
void pd_policy_spec_default(pd_policy_kind kind, pd_policy_spec *out);
/* Parse "name" or "name:key=value,key=value,...". Keys may come in any
 * order; `profile` (compactor) and `scorer` (pyramidkv, chunkkv) are applied
 * first because they change other keys' defaults. Unknown names, unknown or
 * inapplicable keys, duplicate keys, bad numbers and out-of-range values are
 * PD_EINVAL with a message naming the key and the accepted values. */
int pd_policy_spec_parse(const char *text, pd_policy_spec *out, pd_error *err);
/* Check ranges and combinations (also done by parse). */
int pd_policy_spec_validate(const pd_policy_spec *spec, pd_error *err);
/* Canonical form: name, ':', every key the policy uses, sorted by key,
 * defaults included, numbers in the shortest form that round-trips.
 * parse(print(s)) prints the same string. Returns the length. */
size_t pd_policy_spec_print(const pd_policy_spec *spec, char *buf, size_t cap);
/* The tokens a policy always keeps at a per-head budget of B: sink first
 * tokens and recent last ones (its `sink` and `recent` keys, or LASER-KV's
 * B/divisor of each). */
void pd_policy_spec_protected(const pd_policy_spec *spec, int64_t budget, int64_t *sink, int64_t *recent);
/* The observation window a scorer uses on a range of len >= 1 tokens:
 * `window` clipped to len, or with window=0 OBCache's rule, max(16, 5% of
 * the per-head budget floor(retention * len)), clipped to len. */
int64_t pd_policy_window(const pd_policy_spec *spec, int64_t len);
/* The spec a span of a fair selection (local=1) is scored with, one of
 * n_spans: SnapKV's observation window split evenly across the spans
 * (window / n_spans, at least 1), as the fair-eviction paper does, so
 * that the spans together look at one window's worth of queries; every
 * other key as in spec. */
void pd_policy_spec_for_span(const pd_policy_spec *spec, int n_spans, pd_policy_spec *out);
/* Set the retention (used by calibration); keeps everything else. */
void pd_policy_spec_set_retention(pd_policy_spec *spec, double retention);
const char *pd_policy_kind_name(pd_policy_kind kind);
/* One line on what the policy keeps (for listings such as the admin API). */
const char *pd_policy_kind_summary(pd_policy_kind kind);
/* "compactor" -> PD_POLICY_COMPACTOR; false if unknown. */
bool pd_policy_kind_from_name(const char *name, pd_policy_kind *out);
/* One line per policy with its keys and defaults (for --help and docs). */
void pd_policy_describe(FILE *f);

/* ------------------------------------------------------------------------
 * Layout: named spans and whitelisted ranges of the prefix
 * ------------------------------------------------------------------------ */

typedef struct pd_range {
    int64_t start, end; /* [start, end) in tokens */
} pd_range;

typedef struct pd_span {
    char name[32];
    int64_t start, end; /* [start, end) */
    bool whitelist;     /* every token of the span is always kept */
} pd_span;

/* Spans, when given, are sorted, non-empty and cover [0, n) exactly (template
 * tokens belong to a neighbouring span). Whitelisted ranges may be anywhere;
 * they and whitelisted spans are always kept and count against the budget. */
typedef struct pd_layout {
    const pd_span *spans;
    int n_spans;
    const pd_range *whitelist;
    int n_whitelist;
} pd_layout;

int pd_layout_validate(const pd_layout *layout, int64_t n, pd_error *err);
/* Canonical text of a layout ("" for none), e.g.
 * "spans=defense:0-120,directive:120-200!,docs:200-400;keep=5-9", where '!'
 * marks a whitelisted span. It belongs in the cache key next to the spec. */
size_t pd_layout_print(const pd_layout *layout, char *buf, size_t cap);
/* The text a compressed prefix is keyed by (pd_prefix_info.spec): the
 * canonical spec, then '|' and the canonical layout when the layout is not
 * NULL and not empty. snprintf-style: returns the full length. */
size_t pd_policy_key_print(const pd_policy_spec *spec, const pd_layout *layout, char *buf, size_t cap);
/* Parse the canonical text or the --spans file format: one span per line,
 * "name start end [keep]", '#' comments; "keep start end" lines add
 * whitelisted ranges. Arrays are malloc'd into *out (free with
 * pd_layout_free). */
int pd_layout_parse(const char *text, pd_layout *out, pd_error *err);
void pd_layout_free(pd_layout *layout);

/* ------------------------------------------------------------------------
 * Layouts from the prefix's text: automatic spans and phrase whitelists
 *
 * Both read the text the tokens render to (pd_detokenize_offsets, control
 * tokens as their text), so every byte belongs to one token.
 * ------------------------------------------------------------------------ */

/* How strongly the text is divided before a token, weakest first. */
typedef enum pd_boundary_kind {
    PD_BOUNDARY_NONE = 0,
    PD_BOUNDARY_SENTENCE,  /* after '.', '!' or '?' (and closing quotes or brackets) and whitespace,
                              after a line break, or after a CJK full stop, '！' or '？' */
    PD_BOUNDARY_PARAGRAPH, /* after a blank line (whitespace holding two line breaks) */
    PD_BOUNDARY_TURN,      /* after a control token that ends a turn (pd_tokenizer_is_eog:
                              <|im_end|>, <|eot_id|>, <|end|>, <end_of_turn>, </s>, ...) */
} pd_boundary_kind;

/* kinds[i] (n entries) = the strongest boundary just before token i, 0 for
 * i = 0. A boundary in the text starts at the token holding its first
 * non-whitespace byte, so whitespace and punctuation stay with the text
 * before. Abbreviations ("e.g. this") count as sentence ends: the splitter
 * is lexical, and a split too many only costs a merge. */
int pd_text_boundaries(const pd_tokenizer *tok, const pd_token *ids, int64_t n, uint8_t *kinds, pd_error *err);

typedef struct pd_auto_spans_opts {
    int64_t min_tokens; /* a piece shorter than this joins a neighbour (default 16) */
    int max_spans;      /* at most this many spans (default 16) */
} pd_auto_spans_opts;

/* min_tokens 16: a one-sentence instruction (the fair-eviction paper's unit)
 * is usually longer, so instructions keep spans of their own, while list
 * markers, headings and fragments, whose quota at retention 0.1 would be a
 * token or two of rounding, join a neighbour. max_spans 16: the layout is
 * part of the cache key (PD_PREFIX_SPEC_MAX), and SnapKV's window split
 * across the spans (local=1) still gives each span 4 of its 64 queries. */
void pd_auto_spans_opts_default(pd_auto_spans_opts *o);

/* Spans for fair eviction (fair=1) from the prefix's own text, for callers
 * without a span file: cut at every boundary (pd_text_boundaries), then,
 * while a piece is shorter than min_tokens, merge the shortest one into the
 * neighbour across the weaker boundary (the shorter neighbour on a tie);
 * then, while there are more than max_spans pieces, drop the weakest
 * boundary (on a tie the one joining the fewest tokens). So a turn or
 * paragraph boundary is dropped only when no weaker one is left, and text
 * without paragraphs is split by sentences. Spans are named s0, s1, ... and
 * cover [0, n); no whitelist. The first earliest wins every tie, so the
 * result is deterministic. *out's arrays are malloc'd (pd_layout_free).
 * opts NULL = defaults. */
int pd_layout_auto(const pd_tokenizer *tok, const pd_token *ids, int64_t n, const pd_auto_spans_opts *opts,
                   pd_layout *out, pd_error *err);

/* Whitelist every occurrence of each phrase in the prefix text: the tokens
 * overlapping an occurrence's bytes become a kept range (overlapping
 * occurrences included). layout must own its arrays (zeroed, or from
 * pd_layout_parse or pd_layout_auto); its whitelist gains the ranges and
 * comes out sorted with overlapping or touching ranges merged. A phrase that
 * is empty or never occurs is PD_EINVAL / PD_ENOTFOUND naming it, and
 * *missing (optional) gets its index; the layout is then unchanged. */
int pd_layout_keep_phrases(const pd_tokenizer *tok, const pd_token *ids, int64_t n, const char *const *phrases,
                           int n_phrases, pd_layout *layout, int *missing, pd_error *err);

/* ------------------------------------------------------------------------
 * Scoring (one layer)
 * ------------------------------------------------------------------------ */

/* Scores for the keys of tokens [lo, hi) of one layer, using only queries
 * and keys inside [lo, hi) (the whole prefix, or one span with span-local
 * voting). Output: `n_criteria` arrays of [n_head_kv][hi - lo] floats, all
 * finite, higher = keep. Every policy has one criterion except laserkv
 * (exact attention, then LSH collisions). Deterministic for a spec. */
int pd_policy_n_criteria(const pd_policy_spec *spec);
int pd_policy_score(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi,
                    float *scores, pd_error *err);

/* Building blocks, public so tests can check them against naive references.
 * Row-major layouts; `stride` is the distance between consecutive tokens'
 * rows in floats (kv->n_head_kv * head_dim for one head's keys). */

/* Leverage scores of n rows of dimension d (centred first), per chunk of
 * `chunk` rows (0 = all). Approx: X = centred rows * phi (d x sketch), then
 * x_i^T (X^T X + ridge I)^-1 x_i, Cholesky with 10x ridge retries; exact:
 * squared row norms of Q from a thin QR of the centred rows. Clamped >= 0. */
int pd_leverage_scores(const float *rows, int64_t n, int d, int64_t stride, const float *phi, int sketch,
                       int64_t chunk, double ridge, pd_leverage_mode mode, float *out, pd_error *err);
/* The seeded Gaussian sketch, d x sketch, N(0, 1/sketch). */
void pd_gaussian_sketch(uint64_t seed, int d, int sketch, float *phi);
/* Non-causal attention column sums inside chunks of `chunk` tokens: for each
 * chunk, every query of the `n_q` query heads of one group attends to every
 * key of the chunk (no causal mask) with softmax(scale * q.k); out[j] = sum
 * over queries and heads of the weight on key j. q rows: n x n_q heads. */
void pd_noncausal_colsum(const float *q, int64_t q_stride, int n_q, const float *k, int64_t k_stride,
                         int64_t n, int d, int64_t chunk, float scale, float *out);
/* z-score in place over n values (population std, clamped at 1e-6). */
void pd_zscore(float *x, int64_t n);
/* Average pool of width w (odd), zero padding counted in the average
 * (torch avg_pool1d, count_include_pad). */
void pd_avg_pool(const float *in, int64_t n, int w, float *out);
/* Max pool of width w (odd), padding ignored (torch max_pool1d with
 * padding w/2, which pads with -inf). */
void pd_max_pool(const float *in, int64_t n, int w, float *out);
/* Spearman rank correlation of two score vectors (ties get average ranks). */
double pd_rank_correlation(const float *a, const float *b, int64_t n);

/* ------------------------------------------------------------------------
 * Budgets and selection
 * ------------------------------------------------------------------------ */

/* Tokens kept per kv head at each layer, for a prefix of n tokens:
 * floor(retention * n), or with base=unprotected (compactor)
 * round(retention * (n - sink - recent)), at least 1; n when retention is 1;
 * pyramid spreads n_layer times that so
 * that layer 0 gets the most, the last layer mean/beta, linearly in
 * between, when that line fits between the scorer's observation window
 * (SnapKV's `window`, else 1) and n; otherwise every layer gets the mean,
 * as PyramidKV's code does, but at least the window (at most n): the
 * window is kept on top of the budget there. out: [n_layer]. In global mode the layer keeps
 * out[l] * n_head_kv (token, head) pairs in total. */
void pd_policy_budgets(const pd_policy_spec *spec, int n_layer, int64_t n, int64_t *out);

/* Selection for one layer. Protected tokens (first `sink`, last `recent`,
 * whitelisted) are kept first and count against the budget; if they alone
 * exceed it, the whitelist is kept, then sinks, then recent tokens while
 * room lasts (so the recent window is clipped first), and a whitelist that
 * does not fit is PD_ERANGE. In global mode each head has budget/n_head_kv
 * of room for them. The free budget then goes to
 * the best scores: per head (uniform/pyramid) or over all (token, head)
 * pairs (global); with chunk > 0 in whole chunks (chunk boundaries at
 * multiples of `chunk` from the range start, chunk score = sum of its free
 * tokens' scores, summed over the kv heads with shared_chunks, at most one
 * chunk per head taken partially to fill the budget exactly). With two criteria (laserkv) the free budget is split
 * share : (1 - share), the second criterion choosing among tokens the first
 * did not. Ties break toward the earlier token, then the lower head. */
typedef struct pd_select_args {
    int64_t n;              /* tokens */
    int n_head_kv;
    pd_budget_mode mode;    /* uniform/pyramid = per head; global = pairs */
    int64_t budget;         /* per head (uniform/pyramid) or total pairs (global) */
    const float *scores;    /* [n_head_kv][n] */
    const float *scores2;   /* optional second criterion, same shape */
    double share;           /* fraction of the free budget for criterion 1 when scores2 */
    int64_t sink, recent;
    int32_t chunk;
    bool shared_chunks;     /* chunk > 0: rank chunks by scores summed over the kv heads, so that
                             * every head keeps the same chunks (per-head budgets) */
    const pd_layout *layout;   /* whitelist (may be NULL) */
    /* fair eviction: per-span quotas over the free budget. NULL = none.
     * quotas: [n_head_kv][n_spans] (per head) or [n_spans] (global), the
     * number of free (non-protected) entries to keep inside each span, and
     * local_scores (optional; [n_criteria][n_head_kv][n], the second block
     * only with scores2) rank tokens inside spans instead of scores. */
    const int64_t *quotas;
    const float *local_scores;
} pd_select_args;

int pd_policy_select(const pd_select_args *a, uint8_t *keep /* [n_head_kv][n] */, pd_error *err);
/* The protected tokens of one head (the same in every head) as
 * pd_policy_select chooses them: prot [n] gets 0/1. Returns how many, or -1
 * when the whitelist alone does not fit. */
int64_t pd_policy_protected(const pd_select_args *a, uint8_t *prot);

/* Fair quotas for one selection group (one head, or the whole layer in
 * global mode): free = budget left after protection, free_len[s] = free
 * tokens (or pairs) in span s, base[s] = what the base policy kept there.
 * quota[s] = largest-remainder apportionment of `free` over
 * (1 - debias) * base[s] + debias * free * free_len[s] / sum(free_len),
 * capped at free_len[s] with the excess moved to spans with room.
 * Sum(quota) == min(free, sum(free_len)), and |quota[s] - share[s]| < 1.
 * carry (optional, [n_spans], zeroed before the first group) carries each
 * span's rounding shortfall from group to group: the remainder units go to
 * the spans shorted most so far, so over many groups every span's total is
 * within one entry of its summed share. */
void pd_fair_quotas(int64_t free, const int64_t *free_len, const int64_t *base, int n_spans, double debias,
                    double *carry, int64_t *quota);

/* ------------------------------------------------------------------------
 * The compressor: drives scoring and selection from the prefill hook
 * ------------------------------------------------------------------------ */

typedef struct pd_compressor pd_compressor;

typedef struct pd_compress_stats {
    int n_layer, n_head_kv;
    int64_t n_tokens;
    int64_t *kept;          /* [n_layer][n_head_kv], owned by the compressor */
    int64_t kept_total;     /* sum of kept */
    double score_seconds;   /* scoring + selection, all layers */
    /* Per span of the layout (n_spans 0 without spans), in (token, kv head)
     * entries: kept in each layer, and of those the protected ones that
     * fairness leaves out (sinks and whitelisted tokens). */
    int n_spans;
    int64_t *span_tokens;    /* [n_spans]: tokens of each span */
    int64_t *span_kept;      /* [n_layer][n_spans] */
    int64_t *span_protected; /* [n_layer][n_spans] */
} pd_compress_stats;

/* Kept fraction of span s over every layer and kv head: of all its
 * entries (*all) and of its unprotected ones (*unprotected: sinks and
 * whitelisted tokens left out, the fair-eviction paper's b_X / n_X; 1 when
 * the span has none). Either pointer may be NULL. */
void pd_compress_span_fraction(const pd_compress_stats *st, int s, double *all, double *unprotected);
/* Frees the arrays of stats that pd_compress_prefix filled (not the struct). */
void pd_compress_stats_free(pd_compress_stats *st);

/* n_tokens: the prefix length the prefill will pass in ONE pd_prefill call.
 * layout may be NULL; it is copied. */
int pd_compressor_create(const pd_policy_spec *spec, const pd_layout *layout, const pd_hparams *hp,
                         int64_t n_tokens, pd_compressor **out, pd_error *err);
void pd_compressor_free(pd_compressor *c);
/* A pd_prefill_hook_fn: pass the compressor as hook_ctx. */
int pd_compressor_hook(void *compressor, const pd_layer_kv *layer, uint8_t *keep, pd_error *err);
const pd_compress_stats *pd_compressor_stats(const pd_compressor *c);

/* Prefill `tokens` once with the policy and return the compressed prefix
 * (kept positions, post-RoPE K and V rows). stats (optional) is filled;
 * its arrays are malloc'd (pd_compress_stats_free). */
int pd_compress_prefix(pd_model *m, const pd_token *tokens, int64_t n, const pd_policy_spec *spec,
                       const pd_layout *layout, pd_kv_prefix **out, pd_compress_stats *stats, pd_error *err);
/* The same, calling on_layer(ctx, layer, n_layer, err) after each layer's
 * selection (progress reports, cancellation): a non-zero return stops the
 * prefill and is returned, with err filled by the callback. */
typedef int (*pd_compress_layer_fn)(void *ctx, int layer, int n_layer, pd_error *err);
int pd_compress_prefix_observed(pd_model *m, const pd_token *tokens, int64_t n, const pd_policy_spec *spec,
                                const pd_layout *layout, pd_compress_layer_fn on_layer, void *ctx,
                                pd_kv_prefix **out, pd_compress_stats *stats, pd_error *err);

/* ------------------------------------------------------------------------
 * Context-calibrated compression
 *
 * f(rho) = NLL(probe | compressed prefix) / NLL(probe | full prefix).
 * Model: f(rho) = 1 + a * (rho^-b - 1), a > 0, b > 0: f(1) = 1, monotone,
 * unbounded as rho -> 0, inverse rho = (1 + (tau - 1) / a)^(-1 / b).
 * Fitted by minimising an asymmetric squared loss that weighs
 * under-prediction (measured > predicted) `under_weight` times more.
 * ------------------------------------------------------------------------ */

typedef struct pd_curve {
    double a, b;
} pd_curve;

double pd_curve_eval(pd_curve c, double retention);
/* Smallest retention with predicted ratio <= tau, clamped to [lo, 1]. */
double pd_curve_inverse(pd_curve c, double tau, double lo);
/* Fit from m points (retention in (0, 1], ratio > 0). Deterministic. */
int pd_curve_fit(const double *retention, const double *ratio, int m, double under_weight, pd_curve *out,
                 pd_error *err);

#define PD_CALIB_MAX_POINTS 8
/* The allowed NLL ratio tau of a calibrated compression: above 1 (at 1 no
 * loss at all is allowed: keep everything) and at most this. */
#define PD_CALIB_TAU_MAX 10.0
bool pd_calib_tau_valid(double tau);

typedef struct pd_calib_opts {
    double tau;                 /* allowed NLL ratio (pd_calib_tau_valid) */
    int n_points;               /* retentions measured (default 4) */
    double points[PD_CALIB_MAX_POINTS]; /* default 0.5, 0.25, 0.125, 0.0625 */
    double min_retention;       /* never go below (default 0.05) */
    double holdout;             /* fraction of the prefix held out as probe when no probe (default 0.2) */
    const pd_token *probe;      /* caller-supplied probe text (optional) */
    int64_t n_probe;
    double under_weight;        /* default 4 */
    /* Optional, called after each measurement (the full-prefix NLL, then
     * each retention's compress + NLL) with the measurements done so far
     * and the number planned: done rises by 1 each call, done <= total,
     * total grows when a check misses tau and another measurement follows,
     * and the last call has done == total. Lets callers show progress
     * (done / total never falls); a non-zero return stops the calibration
     * and is returned, with err filled by the callback. NULL: none. */
    int (*progress)(void *ctx, int done, int total, pd_error *err);
    void *progress_ctx;
} pd_calib_opts;

void pd_calib_opts_default(pd_calib_opts *o);

typedef struct pd_calib_result {
    pd_curve curve;
    int n_points;
    double retention[PD_CALIB_MAX_POINTS];
    double ratio[PD_CALIB_MAX_POINTS];   /* measured at each point */
    double chosen;              /* chosen retention */
    double predicted;           /* curve at chosen */
    double measured;            /* measured ratio at chosen (on the probe) */
    double nll_full;            /* probe NLL under the full prefix */
} pd_calib_result;

/* Choose the retention for `spec` (its retention is ignored) on this
 * prefix: without a probe the last `holdout` of the tokens is the probe and
 * the rest the calibration prefix. The retention the curve picks is then
 * measured on the probe; when it misses tau, that point joins the fit and
 * the retention rises (at most PD_CALIB_MAX_POINTS measurements, 1 as the
 * last resort), so `measured` <= tau on the probe. The result is rounded up
 * to a multiple of 1e-4. Returns the spec with the chosen retention in
 * *chosen_spec. opts NULL = defaults. */
int pd_calibrate(pd_model *m, const pd_token *tokens, int64_t n, const pd_policy_spec *spec,
                 const pd_layout *layout, const pd_calib_opts *opts, pd_calib_result *out,
                 pd_policy_spec *chosen_spec, pd_error *err);

/* The retention a curve licenses for tau, as calibration stores it:
 * pd_curve_inverse clamped at min_retention and rounded up to a multiple of
 * 1e-4 (the canonical spec, the cache key, stays readable). Used to choose
 * zero-shot from a curve fitted offline. */
double pd_curve_choose(pd_curve c, double tau, double min_retention);

/* What a curve is valid for: the canonical spec without its retention key
 * (the retention is what the curve chooses). Two specs share curves iff
 * these texts are equal. snprintf-style: returns the full length. */
size_t pd_curve_policy_print(const pd_policy_spec *spec, char *buf, size_t cap);

/* ------------------------------------------------------------------------
 * Offline calibration (the Compactor paper's setting): one curve fitted on
 * a calibration set of texts, then applied zero-shot to other prefixes.
 * ------------------------------------------------------------------------ */

/* One text of the set: its last `holdout` fraction (opts->holdout, at
 * least 16 tokens, the rest at least 32) is the held-out continuation, the
 * rest the prefix. ratio[i] = NLL(continuation | prefix compressed at
 * opts->points[i]) / NLL(continuation | full prefix), i < opts->n_points;
 * *nll_full (optional) the denominator. opts->tau, min_retention and probe
 * are not used; opts->progress is called as in pd_calibrate, with
 * total = 1 + n_points. The spec's retention is ignored. */
int pd_calib_measure_text(pd_model *m, const pd_token *tokens, int64_t n, const pd_policy_spec *spec,
                          const pd_calib_opts *opts, double *ratio, double *nll_full, pd_error *err);

/* One curve over n_texts texts measured at the same n_points retentions:
 * ratios is [n_texts][n_points]. The points are pooled: every (points[i],
 * ratios[t][i]) is one point of the asymmetric fit, all weighted equally,
 * so every text counts the same and the curve sits near the upper envelope
 * of the texts' ratios (under-prediction weighs under_weight times more).
 * The order of the texts does not change the result (up to rounding). */
int pd_curve_fit_set(const double *points, int n_points, const double *ratios, int n_texts, double under_weight,
                     pd_curve *out, pd_error *err);

#ifdef __cplusplus
}
#endif
#endif
