/* Attention over segmented KV on the CPU.
 *
 * Work items are (query token, query head) pairs taken from an atomic
 * counter. For each item and each segment the keys are processed in blocks
 * of KEY_BLOCK with an online softmax (running max m, running sum l,
 * running weighted value sum o); the per-segment results are then merged
 * with log-sum-exp:
 *     M = max_s m_s,  L = sum_s l_s e^(m_s - M),  out = sum_s o_s e^(m_s - M) / L
 * which equals softmax attention over the concatenated segments. Keys that
 * are masked (keep[j] == 0, or pos > q_pos under causal) get a score of
 * -inf, hence weight exactly 0, and their values are never read. A block
 * with no visible key is skipped without computing its scores. */
#include <math.h>
#include <stdatomic.h>
#include <string.h>

#include "kernels/cpu/cpu_internal.h"

#define KEY_BLOCK 128

typedef struct attn_ctx {
    const pd_attn_args *a;
    const cpu_kernels *k;
    float *work;
    size_t per_thread;
    int64_t n_items;
    atomic_llong next;
} attn_ctx;

static void attn_item(const attn_ctx *c, int64_t item, float *work) {
    const pd_attn_args *a = c->a;
    const cpu_kernels *k = c->k;
    const int hd = a->head_dim;
    const int64_t t = item / a->n_head;
    const int h = (int)(item % a->n_head);
    const int g = h / (a->n_head / a->n_head_kv);
    const float *q = a->q + (t * a->n_head + h) * (int64_t)hd;
    const int32_t qpos = a->q_pos ? a->q_pos[t] : 0;
    float *out = a->out + (t * a->n_head + h) * (int64_t)hd;

    float *sc = work;            /* KEY_BLOCK scores */
    float *pr = sc + KEY_BLOCK;  /* KEY_BLOCK probabilities */
    float *os = pr + KEY_BLOCK;  /* n_segments x hd partial outputs */
    float ms[PD_MAX_KV_SEGMENTS], ls[PD_MAX_KV_SEGMENTS];

    for (int s = 0; s < a->n_segments; s++) {
        const pd_kv_view *kv = &a->kv[(int64_t)s * a->n_head_kv + g];
        float *o = os + (int64_t)s * hd;
        memset(o, 0, (size_t)hd * sizeof(float));
        float m = -INFINITY, l = 0.0f;
        for (int64_t j0 = 0; j0 < kv->len; j0 += KEY_BLOCK) {
            const int64_t nk = kv->len - j0 < KEY_BLOCK ? kv->len - j0 : KEY_BLOCK;
            /* visibility first: skip blocks nobody can see */
            int64_t first = -1, last = -1;
            for (int64_t j = 0; j < nk; j++) {
                const bool vis = (!kv->keep || kv->keep[j0 + j]) && (!a->causal || kv->pos[j0 + j] <= qpos);
                if (vis) {
                    if (first < 0) first = j;
                    last = j;
                }
            }
            if (first < 0) continue;
            const int64_t span = last - first + 1;
            k->attn_scores(q, kv->k + (j0 + first) * hd, hd, span, a->scale, sc);
            float bmax = -INFINITY;
            for (int64_t j = 0; j < span; j++) {
                const int64_t jj = j0 + first + j;
                const bool vis = (!kv->keep || kv->keep[jj]) && (!a->causal || kv->pos[jj] <= qpos);
                if (!vis)
                    sc[j] = -INFINITY;
                else if (sc[j] > bmax)
                    bmax = sc[j];
            }
            if (bmax > m) {
                if (m != -INFINITY) {
                    const float alpha = expf(m - bmax);
                    l *= alpha;
                    k->scale_f32(alpha, hd, o);
                }
                m = bmax;
            }
            l += k->softmax_exp(sc, m, span, pr);
            k->attn_pv(pr, kv->v + (j0 + first) * hd, hd, span, o);
        }
        ms[s] = m;
        ls[s] = l;
    }

    float mx = -INFINITY;
    for (int s = 0; s < a->n_segments; s++)
        if (ms[s] > mx) mx = ms[s];
    memset(out, 0, (size_t)hd * sizeof(float));
    if (mx == -INFINITY) return; /* no visible key: zeros */
    float lsum = 0.0f, wts[PD_MAX_KV_SEGMENTS];
    for (int s = 0; s < a->n_segments; s++) {
        wts[s] = ms[s] == -INFINITY ? 0.0f : expf(ms[s] - mx);
        lsum += ls[s] * wts[s];
    }
    for (int s = 0; s < a->n_segments; s++)
        if (wts[s] != 0.0f) k->axpy_f32(wts[s] / lsum, os + (int64_t)s * hd, hd, out);
}

static void attn_worker(void *p, int ith, int nth) {
    (void)nth;
    attn_ctx *c = p;
    float *work = c->work + (size_t)ith * c->per_thread;
    for (;;) {
        /* a few items per grab keeps the counter off the hot path */
        const int64_t i0 = atomic_fetch_add_explicit(&c->next, 4, memory_order_relaxed);
        if (i0 >= c->n_items) break;
        const int64_t i1 = i0 + 4 < c->n_items ? i0 + 4 : c->n_items;
        for (int64_t i = i0; i < i1; i++) attn_item(c, i, work);
    }
}

int cpu_attention(pd_backend *be, const pd_attn_args *a, pd_error *err) {
    cpu_backend *cb = be->impl;
    if (!a) return pd_errorf(err, PD_EINVAL, "attention: NULL arguments");
    if (a->n_tokens < 0 || a->head_dim <= 0 || a->n_head <= 0 || a->n_head_kv <= 0)
        return pd_errorf(err, PD_EINVAL,
                         "attention: bad shape (n_tokens %lld, n_head %d, n_head_kv %d, head_dim %d)",
                         (long long)a->n_tokens, a->n_head, a->n_head_kv, a->head_dim);
    if (a->n_head % a->n_head_kv != 0)
        return pd_errorf(err, PD_EINVAL, "attention: n_head %d is not a multiple of n_head_kv %d",
                         a->n_head, a->n_head_kv);
    if (a->n_segments < 0 || a->n_segments > PD_MAX_KV_SEGMENTS)
        return pd_errorf(err, PD_EINVAL, "attention: %d segments (allowed 0..%d)", a->n_segments,
                         PD_MAX_KV_SEGMENTS);
    if (a->n_tokens == 0) return PD_OK;
    if (!a->q || !a->out || (a->causal && !a->q_pos) || (a->n_segments > 0 && !a->kv))
        return pd_errorf(err, PD_EINVAL, "attention: NULL q, q_pos, kv or out");
    for (int s = 0; s < a->n_segments; s++)
        for (int g = 0; g < a->n_head_kv; g++) {
            const pd_kv_view *kv = &a->kv[s * a->n_head_kv + g];
            if (kv->len < 0)
                return pd_errorf(err, PD_EINVAL, "attention: segment %d kv head %d has length %lld", s, g,
                                 (long long)kv->len);
            if (kv->len > 0 && (!kv->k || !kv->v || (a->causal && !kv->pos)))
                return pd_errorf(err, PD_EINVAL, "attention: segment %d kv head %d has NULL k, v or pos", s,
                                 g);
        }

    const int nth = cb->n_threads;
    attn_ctx c = {.a = a, .k = &cb->k, .n_items = a->n_tokens * a->n_head};
    c.per_thread = (2 * KEY_BLOCK + (size_t)(a->n_segments > 0 ? a->n_segments : 1) * (size_t)a->head_dim + 15) &
                   ~(size_t)15;
    void *work = cb->work;
    size_t cap_bytes = cb->work_cap * sizeof(float);
    int rc = cpu_scratch_reserve(&work, &cap_bytes, c.per_thread * sizeof(float) * (size_t)nth, err);
    cb->work = work;
    cb->work_cap = cap_bytes / sizeof(float);
    if (rc) return rc;
    c.work = cb->work;
    atomic_init(&c.next, 0);
    if (c.n_items <= 4)
        attn_worker(&c, 0, 1);
    else
        pd_threadpool_run(cb->tp, attn_worker, &c);
    return PD_OK;
}
