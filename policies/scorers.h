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
/* score_laserkv.c: two criteria (exact attention, LSH collisions) */
int pd_score_laserkv(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi, float *scores,
                     pd_error *err);

#endif
