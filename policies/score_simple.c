/* Baseline scorers that look at one token at a time: seeded random scores,
 * key norms (keep the smallest) and StreamingLLM's recency order. */
#include <inttypes.h>
#include <math.h>

#include "policies/scorers.h"

int pd_score_random(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi, float *scores,
                    pd_error *err) {
    (void)err;
    int64_t n = hi - lo;
    /* Keyed by the absolute position, not the row, so scoring a span alone
     * gives the same numbers as scoring the whole prefix. */
    for (int h = 0; h < kv->n_head_kv; h++) {
        uint64_t base = pd_mix64(pd_mix64(pd_mix64(spec->seed) ^ (uint64_t)(uint32_t)kv->layer) ^ (uint64_t)(uint32_t)h);
        for (int64_t i = 0; i < n; i++) {
            uint64_t x = pd_mix64(base ^ (uint64_t)(uint32_t)kv->pos[lo + i]);
            /* Top 24 bits: exactly representable in a float, so < 1. */
            scores[(int64_t)h * n + i] = (float)(x >> 40) * 0x1p-24f;
        }
    }
    return PD_OK;
}

int pd_score_knorm(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi, float *scores,
                   pd_error *err) {
    (void)spec;
    (void)err;
    int64_t n = hi - lo, d = kv->head_dim, stride = (int64_t)kv->n_head_kv * d;
    /* Post-RoPE keys are fine: RoPE rotates pairs of dimensions, which keeps
     * the norm. Low-norm keys draw the most attention (Devoto et al. 2024). */
    for (int h = 0; h < kv->n_head_kv; h++)
        for (int64_t i = 0; i < n; i++) {
            const float *k = kv->k + (lo + i) * stride + (int64_t)h * d;
            double s = 0;
            for (int64_t j = 0; j < d; j++) s += (double)k[j] * k[j];
            scores[(int64_t)h * n + i] = (float)-sqrt(s);
        }
    return PD_OK;
}

int pd_score_streaming(const pd_policy_spec *spec, const pd_layer_kv *kv, int64_t lo, int64_t hi, float *scores,
                       pd_error *err) {
    (void)spec;
    int64_t n = hi - lo;
    /* Later tokens score higher; the sinks are protected by the selection
     * (spec->sink), not by the score. Floats hold indexes exactly only up
     * to 2^24; beyond that ties would favour the earlier token. */
    if (n > ((int64_t)1 << 24))
        return pd_errorf(err, PD_ERANGE, "streaming: %" PRId64 " tokens in one range; at most 16777216 are supported",
                         n);
    for (int h = 0; h < kv->n_head_kv; h++)
        for (int64_t i = 0; i < n; i++) scores[(int64_t)h * n + i] = (float)i;
    return PD_OK;
}
