/* Attention over segmented KV on the CPU.
 *
 * Work items are (block of query tokens, kv head) pairs taken from an
 * atomic counter; an item handles the n_head / n_head_kv query heads that
 * share the kv head, so which keys a token may see is worked out once for
 * all of them, and each block of keys is reused from L1 by all its queries.
 * For each query head and each segment the keys are processed in blocks of
 * KEY_BLOCK with an online softmax (running max m, running sum l, running
 * weighted value sum o); the per-segment results are then merged with
 * log-sum-exp:
 *     M = max_s m_s,  L = sum_s l_s e^(m_s - M),  out = sum_s o_s e^(m_s - M) / L
 * which equals softmax attention over the concatenated segments. Keys that
 * are masked (keep[j] == 0, pos > q_pos under causal, q_pos - pos >= window
 * in a sliding window) get a score of
 * -inf, hence weight exactly 0, and their values are never used (nor read,
 * except as part of a widened f16 block, see below). Only the
 * span from the first to the last visible key of a block is scored, so a
 * block nobody can see costs one scan of its positions.
 *
 * Decode (a few query tokens) over a long cache has too few (token block,
 * kv head) items to keep every thread busy, and one thread would read a
 * whole long shared prefix for its head. Then the concatenated key range of
 * each kv head is also cut into chunks of whole key blocks: an item is
 * (token block, kv head, key chunk) and leaves an unnormalised partial
 * (m, l, o) per query, and the partials are merged with the same
 * log-sum-exp rule afterwards.
 *
 * f16 views (f16 KV caches) are read at half the bytes and computed in
 * f32. When a block of keys serves several tokens (prefill) its K and V rows
 * are widened once into per-thread scratch and the f32 kernels run on that;
 * for one token (decode) the f16 variants of the score and P.V kernels
 * widen each element as they load it, which is cheaper than storing and
 * reloading a widened block even though each of the n_rep query heads
 * converts the rows again. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cpu/cpu_internal.h"

#define KEY_BLOCK 64
#define SPLIT_MAX_TOKENS 8  /* split the keys only for this few query tokens */
#define MIN_CHUNK_KEYS 256  /* keys per chunk at least */

typedef struct attn_ctx {
    const pd_attn_args *a;
    const cpu_kernels *k;
    float *work;
    size_t per_thread;
    int n_rep;
    int64_t tok_block; /* tokens per work item */
    int64_t n_tblocks;
    int64_t n_items;   /* n_tblocks * n_head_kv * n_chunks */
    int64_t n_chunks;  /* key chunks per kv head (1: no split) */
    bool widen;        /* f16 blocks are widened into scratch (KEY_BLOCK x hd for K, then V) */
    int64_t chunk_keys; /* keys per chunk (a multiple of KEY_BLOCK) */
    float *part;       /* n_chunks > 1: partials [chunk][kv head][token][rep] x (m, l, o[hd]) */
    atomic_llong next;
} attn_ctx;

/* Scores of keys [row, row + n) of a view against q, and o += P V over
 * its values [row, row + n), in the view's element type. */
static inline void view_scores(const cpu_kernels *k, const pd_kv_view *kv, const float *q, int64_t row, int64_t hd,
                               int64_t n, float scale, float *s) {
    if (kv->type == PD_TYPE_F16)
        k->attn_scores_f16(q, (const uint16_t *)kv->k + row * hd, hd, n, scale, s);
    else
        k->attn_scores(q, (const float *)kv->k + row * hd, hd, n, scale, s);
}

static inline void view_pv(const cpu_kernels *k, const pd_kv_view *kv, const float *p, int64_t row, int64_t hd,
                           int64_t n, float *o) {
    if (kv->type == PD_TYPE_F16)
        k->attn_pv_f16(p, (const uint16_t *)kv->v + row * hd, hd, n, o);
    else
        k->attn_pv(p, (const float *)kv->v + row * hd, hd, n, o);
}

/* Visibility of keys [j0, j0 + nk) for a query at qpos: vis[j] = 0/1, the
 * first and last visible offsets (-1 if none); returns true when every key
 * in [first, last] is visible. A key is visible if kept, not after the
 * query (causal) and less than `window` positions before it (window > 0). */
static bool block_visibility(const cpu_kernels *k, const pd_kv_view *kv, bool causal, int32_t window, int32_t qpos,
                             int64_t j0, int64_t nk, uint8_t *vis, int64_t *first, int64_t *last) {
    const uint8_t *keep = kv->keep ? kv->keep + j0 : NULL;
    const int32_t *pos = kv->pos ? kv->pos + j0 : NULL;
    if (!keep && !causal && window <= 0) {
        *first = 0;
        *last = nk - 1;
        return true;
    }
    if (!keep && window <= 0) { /* causal only: often every key of the block is old enough */
        if (k->max_i32(pos, nk) <= qpos) {
            *first = 0;
            *last = nk - 1;
            return true;
        }
    }
    int64_t n_vis = 0;
    for (int64_t j = 0; j < nk; j++) {
        const bool v = (!keep || keep[j]) && (!causal || pos[j] <= qpos) &&
                       (window <= 0 || (int64_t)qpos - pos[j] < window);
        vis[j] = (uint8_t)v;
        n_vis += v;
    }
    if (n_vis == 0) {
        *first = *last = -1;
        return false;
    }
    int64_t f = 0, l = nk - 1;
    while (!vis[f]) f++;
    while (!vis[l]) l--;
    *first = f;
    *last = l;
    return n_vis == l - f + 1;
}

/* Tokens [t0, t1) against kv head g, for each of its n_rep query heads,
 * over keys [kr0, kr1) of the concatenation of the segments.
 * Loop order segment -> key block -> token -> head, so a block of keys and
 * values (KEY_BLOCK rows) is read from memory once and then reused from L1
 * by every query of the item. State per (token, head, segment): m, l, o.
 * With part == NULL the normalised result goes to a->out; otherwise the
 * merged but unnormalised (m, l, o) of each (token, head) goes to
 * part[(tt * n_rep + r) * (2 + hd)]. */
static void attn_item(const attn_ctx *c, int64_t t0, int64_t t1, int g, int64_t kr0, int64_t kr1,
                      float *work, float *part) {
    const pd_attn_args *a = c->a;
    const cpu_kernels *k = c->k;
    const int hd = a->head_dim;
    const int n_rep = c->n_rep;
    const int nseg = a->n_segments;
    const int h0 = g * n_rep; /* first query head of this kv head */
    const int64_t nt = t1 - t0;
    const int64_t nstate = nt * n_rep * (nseg > 0 ? nseg : 1);

    float *sc = work;                /* KEY_BLOCK scores */
    float *pr = sc + KEY_BLOCK;      /* KEY_BLOCK probabilities */
    float *ml = pr + KEY_BLOCK;      /* nstate x (m, l) */
    float *os = ml + 2 * nstate;     /* nstate x hd */
    float *kw = os + nstate * hd;    /* c->widen: KEY_BLOCK x hd widened K rows, then V rows */
    float *vw = kw + KEY_BLOCK * hd;
    uint8_t vis[KEY_BLOCK];
#define ST(tt, r, s) ((((tt) * n_rep) + (r)) * (int64_t)(nseg > 0 ? nseg : 1) + (s))

    for (int64_t i = 0; i < nstate; i++) {
        ml[2 * i] = -INFINITY;
        ml[2 * i + 1] = 0.0f;
    }
    memset(os, 0, (size_t)nstate * (size_t)hd * sizeof(float));

    int64_t seg_off = 0; /* start of segment s in the concatenated key range */
    for (int s = 0; s < nseg; s++) {
        const pd_kv_view *kv = &a->kv[(int64_t)s * a->n_head_kv + g];
        const int64_t jb = kr0 > seg_off ? kr0 - seg_off : 0;
        const int64_t je = kr1 - seg_off < kv->len ? kr1 - seg_off : kv->len;
        seg_off += kv->len;
        for (int64_t j0 = jb; j0 < je; j0 += KEY_BLOCK) {
            const int64_t nk = je - j0 < KEY_BLOCK ? je - j0 : KEY_BLOCK;
            /* The rows the kernels read: kv's, or the block widened to f32,
             * whose row 0 is kv's row j0 (off). */
            pd_kv_view wide;
            const pd_kv_view *src = kv;
            int64_t off = 0;
            if (c->widen && kv->type == PD_TYPE_F16) {
                k->f16_to_f32((const uint16_t *)kv->k + j0 * hd, nk * hd, kw);
                k->f16_to_f32((const uint16_t *)kv->v + j0 * hd, nk * hd, vw);
                wide = (pd_kv_view){.k = kw, .v = vw, .type = PD_TYPE_F32};
                src = &wide;
                off = j0;
            }
            for (int64_t tt = 0; tt < nt; tt++) {
                const int64_t t = t0 + tt;
                const int32_t qpos = a->q_pos ? a->q_pos[t] : 0;
                int64_t first, last;
                const bool dense =
                    block_visibility(k, kv, a->causal, a->window, qpos, j0, nk, vis, &first, &last);
                if (first < 0) continue;
                const int64_t span = last - first + 1, row = j0 + first;
                for (int r = 0; r < n_rep; r++) {
                    const float *q = a->q + (t * a->n_head + h0 + r) * (int64_t)hd;
                    float *m = &ml[2 * ST(tt, r, s)], *l = m + 1;
                    float *o = os + ST(tt, r, s) * hd;
                    view_scores(k, src, q, row - off, hd, span, a->scale, sc);
                    if (a->softcap > 0.0f)
                        for (int64_t j = 0; j < span; j++) sc[j] = a->softcap * tanhf(sc[j] / a->softcap);
                    float bmax = -INFINITY;
                    if (dense) {
                        bmax = k->max_f32(sc, span);
                    } else {
                        for (int64_t j = 0; j < span; j++) {
                            if (!vis[first + j])
                                sc[j] = -INFINITY;
                            else if (sc[j] > bmax)
                                bmax = sc[j];
                        }
                    }
                    if (bmax > *m) {
                        if (*m != -INFINITY) {
                            const float alpha = expf(*m - bmax);
                            *l *= alpha;
                            k->scale_f32(alpha, hd, o);
                        }
                        *m = bmax;
                    }
                    if (*m == -INFINITY) continue; /* NaN scores only */
                    *l += k->softmax_exp(sc, *m, span, pr);
                    if (dense) {
                        view_pv(k, src, pr, row - off, hd, span, o);
                    } else { /* runs of visible keys: masked rows are never read */
                        for (int64_t j = 0; j < span;) {
                            if (!vis[first + j]) {
                                j++;
                                continue;
                            }
                            int64_t e = j + 1;
                            while (e < span && vis[first + e]) e++;
                            view_pv(k, src, pr + j, row - off + j, hd, e - j, o);
                            j = e;
                        }
                    }
                }
            }
        }
    }

    for (int64_t tt = 0; tt < nt; tt++)
        for (int r = 0; r < n_rep; r++) {
            float *pp = part ? part + (tt * n_rep + r) * (int64_t)(2 + hd) : NULL;
            float *out = pp ? pp + 2 : a->out + ((t0 + tt) * a->n_head + h0 + r) * (int64_t)hd;
            memset(out, 0, (size_t)hd * sizeof(float));
            float mx = -INFINITY;
            for (int s = 0; s < nseg; s++) mx = ml[2 * ST(tt, r, s)] > mx ? ml[2 * ST(tt, r, s)] : mx;
            if (pp) {
                pp[0] = mx;
                pp[1] = 0.0f;
            }
            if (mx == -INFINITY) continue; /* no visible key: zeros */
            float lsum = 0.0f, wts[PD_MAX_KV_SEGMENTS];
            for (int s = 0; s < nseg; s++) {
                const float ms = ml[2 * ST(tt, r, s)];
                wts[s] = ms == -INFINITY ? 0.0f : expf(ms - mx);
                lsum += ml[2 * ST(tt, r, s) + 1] * wts[s];
            }
            if (pp) pp[1] = lsum;
            for (int s = 0; s < nseg; s++)
                if (wts[s] != 0.0f) k->axpy_f32(pp ? wts[s] : wts[s] / lsum, os + ST(tt, r, s) * hd, hd, out);
        }
#undef ST
}

static void attn_worker(void *p, int ith, int nth) {
    (void)nth;
    attn_ctx *c = p;
    float *work = c->work + (size_t)ith * c->per_thread;
    for (;;) {
        const int64_t i = atomic_fetch_add_explicit(&c->next, 1, memory_order_relaxed);
        if (i >= c->n_items) break;
        const int64_t ch = i % c->n_chunks;
        const int64_t tg = i / c->n_chunks;
        const int64_t tb = tg / c->a->n_head_kv;
        const int g = (int)(tg % c->a->n_head_kv);
        const int64_t t0 = tb * c->tok_block;
        const int64_t t1 = t0 + c->tok_block < c->a->n_tokens ? t0 + c->tok_block : c->a->n_tokens;
        if (c->n_chunks == 1) {
            attn_item(c, t0, t1, g, 0, INT64_MAX / 2, work, NULL);
        } else { /* one token block: t0 == 0 */
            const int64_t stride = (int64_t)c->n_rep * (2 + c->a->head_dim);
            float *part = c->part + (ch * c->a->n_head_kv + g) * c->a->n_tokens * stride;
            attn_item(c, t0, t1, g, ch * c->chunk_keys, (ch + 1) * c->chunk_keys, work, part);
        }
    }
}

/* out = the log-sum-exp merge of the chunk partials of every query. */
static void merge_chunks(const attn_ctx *c) {
    const pd_attn_args *a = c->a;
    const cpu_kernels *k = c->k;
    const int hd = a->head_dim;
    const int64_t stride = 2 + hd;
    for (int64_t t = 0; t < a->n_tokens; t++)
        for (int h = 0; h < a->n_head; h++) {
            const int g = h / c->n_rep, r = h % c->n_rep;
            float *out = a->out + (t * a->n_head + h) * (int64_t)hd;
            memset(out, 0, (size_t)hd * sizeof(float));
#define PART(ch) (c->part + (((ch) * a->n_head_kv + g) * a->n_tokens * c->n_rep + t * c->n_rep + r) * stride)
            float mx = -INFINITY;
            for (int64_t ch = 0; ch < c->n_chunks; ch++) mx = PART(ch)[0] > mx ? PART(ch)[0] : mx;
            if (mx == -INFINITY) continue; /* no visible key: zeros */
            float lsum = 0.0f;
            for (int64_t ch = 0; ch < c->n_chunks; ch++) {
                const float *pp = PART(ch);
                if (pp[0] != -INFINITY) lsum += pp[1] * expf(pp[0] - mx);
            }
            for (int64_t ch = 0; ch < c->n_chunks; ch++) {
                const float *pp = PART(ch);
                if (pp[0] != -INFINITY) k->axpy_f32(expf(pp[0] - mx) / lsum, pp + 2, hd, out);
            }
#undef PART
        }
}

/* One group: every token attends to a->kv's n_segments segments. */
static int attention_one_group(cpu_backend *cb, const pd_attn_args *a, pd_error *err) {
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
    const bool need_pos = a->causal || a->window > 0;
    if (a->window < 0 || !(a->softcap >= 0.0f))
        return pd_errorf(err, PD_EINVAL, "attention: window %d and softcap %g must not be negative", (int)a->window,
                         (double)a->softcap);
    if (!a->q || !a->out || (need_pos && !a->q_pos) || (a->n_segments > 0 && !a->kv))
        return pd_errorf(err, PD_EINVAL, "attention: NULL q, q_pos, kv or out");
    for (int s = 0; s < a->n_segments; s++)
        for (int g = 0; g < a->n_head_kv; g++) {
            const pd_kv_view *kv = &a->kv[s * a->n_head_kv + g];
            if (kv->len < 0)
                return pd_errorf(err, PD_EINVAL, "attention: segment %d kv head %d has length %lld", s, g,
                                 (long long)kv->len);
            if (kv->len > 0 && (!kv->k || !kv->v || (need_pos && !kv->pos)))
                return pd_errorf(err, PD_EINVAL, "attention: segment %d kv head %d has NULL k, v or pos", s,
                                 g);
            if (kv->len > 0 && !pd_kv_type_ok(kv->type))
                return pd_errorf(err, PD_EUNSUPPORTED,
                                 "attention: segment %d kv head %d holds %s rows; KV rows must be f32 or f16", s, g,
                                 pd_type_get(kv->type) ? pd_type_get(kv->type)->name : "unknown");
        }

    const int nth = cb->n_threads;
    attn_ctx c = {.a = a, .k = &cb->k, .n_rep = a->n_head / a->n_head_kv};
    /* Tokens per item: up to 16 (reuse of each key block from L1), but
     * enough items to keep every thread busy. */
    int64_t tb = a->n_tokens * a->n_head_kv / (4 * (int64_t)nth);
    tb = tb < 1 ? 1 : tb > 16 ? 16 : tb;
    /* Few tokens over many keys: all tokens in one block, and the keys of
     * each kv head cut into chunks of at least MIN_CHUNK_KEYS, about four
     * items per thread. */
    int64_t max_keys = 0;
    for (int g = 0; g < a->n_head_kv; g++) {
        int64_t len = 0;
        for (int s = 0; s < a->n_segments; s++) len += a->kv[s * a->n_head_kv + g].len;
        max_keys = len > max_keys ? len : max_keys;
    }
    c.n_chunks = 1;
    if (nth > 1 && a->n_tokens <= SPLIT_MAX_TOKENS && a->n_head_kv < 4 * nth &&
        max_keys >= 2 * MIN_CHUNK_KEYS) {
        int64_t want = (4 * (int64_t)nth + a->n_head_kv - 1) / a->n_head_kv;
        const int64_t most = max_keys / MIN_CHUNK_KEYS;
        want = want < most ? want : most;
        if (want > 1) {
            tb = a->n_tokens;
            c.chunk_keys = (max_keys + want - 1) / want;
            c.chunk_keys = (c.chunk_keys + KEY_BLOCK - 1) / KEY_BLOCK * KEY_BLOCK;
            c.n_chunks = (max_keys + c.chunk_keys - 1) / c.chunk_keys;
        }
    }
    c.tok_block = tb;
    c.n_tblocks = (a->n_tokens + tb - 1) / tb;
    c.n_items = c.n_tblocks * a->n_head_kv * c.n_chunks;
    const size_t nstate = (size_t)tb * (size_t)c.n_rep * (size_t)(a->n_segments > 0 ? a->n_segments : 1);
    bool any_f16 = false;
    for (int64_t i = 0; i < (int64_t)a->n_segments * a->n_head_kv; i++) any_f16 |= a->kv[i].type == PD_TYPE_F16;
    /* Widening pays off when a block serves several tokens (prefill). For
     * one token (decode), storing and reloading a widened block costs more
     * than converting as the f16 kernels load, even n_rep times over. */
    c.widen = any_f16 && tb > 1;
    c.per_thread = (2 * KEY_BLOCK + 2 * nstate + nstate * (size_t)a->head_dim +
                    (c.widen ? 2 * (size_t)KEY_BLOCK * (size_t)a->head_dim : 0) + 15) &
                   ~(size_t)15;
    void *work = cb->work;
    size_t cap_bytes = cb->work_cap * sizeof(float);
    const size_t part_floats = c.n_chunks > 1 ? (size_t)c.n_chunks * (size_t)a->n_head_kv *
                                                    (size_t)a->n_tokens * (size_t)c.n_rep *
                                                    (size_t)(2 + a->head_dim)
                                              : 0;
    int rc = cpu_scratch_reserve(&work, &cap_bytes,
                                 (c.per_thread * (size_t)nth + part_floats) * sizeof(float), err);
    cb->work = work;
    cb->work_cap = cap_bytes / sizeof(float);
    if (rc) return rc;
    c.work = cb->work;
    if (part_floats) c.part = cb->work + c.per_thread * (size_t)nth;
    atomic_init(&c.next, 0);
    if (c.n_items == 1)
        attn_worker(&c, 0, 1);
    else
        pd_threadpool_run(cb->tp, attn_worker, &c);
    if (c.n_chunks > 1) merge_chunks(&c);
    return PD_OK;
}

/* Groups and shared segments: each group is attended to on its own, over
 * the shared segments followed by its own, so the CPU reads a shared
 * prefix once per group (a device backend reads it once per call). */
int cpu_attention(pd_backend *be, const pd_attn_args *a, pd_error *err) {
    cpu_backend *cb = be->impl;
    if (!a) return pd_errorf(err, PD_EINVAL, "attention: NULL arguments");
    if (a->n_shared < 0 || a->n_segments < 0 || a->n_shared + a->n_segments > PD_MAX_KV_SEGMENTS)
        return pd_errorf(err, PD_EINVAL, "attention: %d shared + %d own segments (allowed %d in all)", a->n_shared,
                         a->n_segments, PD_MAX_KV_SEGMENTS);
    if ((a->n_shared > 0 && !a->shared) || (a->n_groups > 0 && !a->group_start) || a->n_groups < 0)
        return pd_errorf(err, PD_EINVAL, "attention: NULL shared views or group starts");
    if (a->n_groups <= 1 && a->n_shared == 0) return attention_one_group(cb, a, err);
    const int n_groups = a->n_groups > 0 ? a->n_groups : 1, nkv = a->n_head_kv;
    if (a->n_groups > 0 && (a->group_start[0] != 0 || a->group_start[n_groups] != a->n_tokens))
        return pd_errorf(err, PD_EINVAL, "attention: groups cover tokens [%lld, %lld), not [0, %lld)",
                         (long long)a->group_start[0], (long long)a->group_start[n_groups], (long long)a->n_tokens);
    if (nkv <= 0 || a->n_head <= 0 || a->head_dim <= 0)
        return attention_one_group(cb, a, err); /* reports the bad shape */
    pd_kv_view small[PD_MAX_KV_SEGMENTS * 16], *views = small;
    const size_t n_views = (size_t)PD_MAX_KV_SEGMENTS * (size_t)nkv;
    if (n_views > sizeof small / sizeof *small && !(views = malloc(n_views * sizeof *views)))
        return pd_errorf(err, PD_ENOMEM, "attention: out of memory for %zu views", n_views);
    const int64_t qrow = (int64_t)a->n_head * a->head_dim;
    int rc = PD_OK;
    for (int g = 0; g < n_groups && rc == PD_OK; g++) {
        const int64_t t0 = a->n_groups > 0 ? a->group_start[g] : 0;
        const int64_t t1 = a->n_groups > 0 ? a->group_start[g + 1] : a->n_tokens;
        if (t1 < t0) {
            rc = pd_errorf(err, PD_EINVAL, "attention: group %d ends before it starts", g);
            break;
        }
        if (t1 == t0) continue;
        if (a->n_shared > 0) memcpy(views, a->shared, sizeof *views * (size_t)(a->n_shared * nkv));
        if (a->n_segments > 0)
            memcpy(views + a->n_shared * nkv, a->kv + (size_t)g * (size_t)(a->n_segments * nkv),
                   sizeof *views * (size_t)(a->n_segments * nkv));
        pd_attn_args one = *a;
        one.q = a->q + t0 * qrow;
        one.q_pos = a->q_pos ? a->q_pos + t0 : NULL;
        one.out = a->out + t0 * qrow;
        one.n_tokens = t1 - t0;
        one.n_segments = a->n_shared + a->n_segments;
        one.kv = views;
        one.n_shared = 0;
        one.shared = NULL;
        one.n_groups = 0;
        one.group_start = NULL;
        rc = attention_one_group(cb, &one, err);
    }
    if (views != small) free(views);
    return rc;
}
