/* Private to policies/: one function per scorer, dispatched by
 * pd_policy_score (score.c). Every scorer has the pd_policy_score contract:
 * keys of tokens [lo, hi), queries and keys from inside [lo, hi) only,
 * output [n_criteria][n_head_kv][hi - lo], finite, higher = keep. */
#ifndef PD_POLICIES_SCORERS_H
#define PD_POLICIES_SCORERS_H

#include "policies/policies.h"

typedef int (*pd_scorer_fn)(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi,
                            float *scores, pd_error *err);

/* score_compactor.c */
int pd_score_compactor(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi, float *scores,
                       pd_error *err);
int pd_score_leverage(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi, float *scores,
                      pd_error *err);
int pd_score_noncausal(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi, float *scores,
                       pd_error *err);
/* Whether the spec's scorer runs entirely on backend `be` (compactor and
 * leverage with approx leverage, noncausal; `be` has token_scores), so
 * it reads only the dev_* arrays of pd_layer_kv and the prefill may skip
 * copying q/k/v to the host (pd_prefill_opts.hook_device_only). */
bool pd_scorer_runs_on_backend(const pd_policy_spec *spec, const pd_backend *be);
/* score_simple.c */
int pd_score_random(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi, float *scores,
                    pd_error *err);
int pd_score_knorm(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi, float *scores,
                   pd_error *err);
int pd_score_streaming(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi, float *scores,
                       pd_error *err);
/* score_attention.c */
int pd_score_snapkv(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi, float *scores,
                    pd_error *err);
int pd_score_h2o(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi, float *scores,
                 pd_error *err);
int pd_score_tova(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi, float *scores,
                  pd_error *err);
int pd_score_obcache(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi, float *scores,
                     pd_error *err);
/* Shared by the attention scorers (score_attention.c). Rows [q0, q0 + nq)
 * of query head `a`: out[t * ld + j] is the causal softmax weight (scale
 * 1/sqrt(head_dim)) of query q0 + t on key lo + j, 0 past the query; with
 * `logits`, the scaled logits too (0 where masked). ld >= q0 + nq - lo. */
void pd_attention_rows(const pd_layer_kv *kv, int64_t lo, int a, int64_t q0, int64_t nq, float *out, int64_t ld,
                       float *logits);
/* n elements of `size` bytes; NULL on overflow or OOM, with err (may be
 * NULL) filled. */
void *pd_scorer_alloc(int64_t n, size_t size, const char *name, pd_error *err);

/* score_laserkv.c: two criteria (exact attention, LSH collisions) */
int pd_score_laserkv(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi, float *scores,
                     pd_error *err);

#endif
