/* The forward pass of the supported decoder architectures (llama, qwen2,
 * qwen3, gemma2, gemma3, phi3: pre-norm transformers that differ in norms,
 * activations, windows and soft-capping, switched per layer below).
 *
 * One call runs a batch of entries (sequence + new tokens): a long prefill is
 * one entry with many tokens, a decode step many entries with one token each.
 * Work is layer-major: every layer runs over all of the call's tokens before
 * the next, which is what lets the prefill hook see a whole layer's
 * queries/keys/values at once while memory stays O(tokens x width). Inside a
 * layer, rows are processed in chunks so the feed-forward scratch stays
 * bounded. Matrix products, norms, rope and attention go through the
 * backend vtable. */
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/model_internal.h"

/* Rows per projection/FFN chunk (the GEMMs' M). On the CPU 256 keeps the
 * chunk's activations in cache; a GPU needs large GEMMs to fill its tensor
 * cores and has the memory for the scratch. */
#define HOST_ROW_CHUNK 256
#define DEVICE_ROW_CHUNK 2048
#define LOGIT_CHUNK 32 /* rows per output-projection chunk (a [rows][n_vocab] buffer) */

typedef struct fwd_entry {
    pd_seq *seq;
    const pd_token *tokens;
    int64_t n;
    int64_t row0;    /* first row of this entry in the batch */
    int64_t n_out;   /* rows whose logits are wanted (1 or n) */
    int64_t out0;    /* logits row of the first wanted row */
} fwd_entry;

/* Activations in backend memory, plus what the host needs. */
typedef struct fwd_bufs {
    float *x;       /* [R][d] residual stream */
    float *q;       /* [R][q_dim] */
    float *k;       /* [R][kv_dim] */
    float *v;       /* [R][kv_dim] */
    float *k_pre;   /* [R][kv_dim], only with a hook */
    uint16_t *k16, *v16; /* [R][kv_dim], k and v rounded to f16 (f16 KV caches only) */
    int32_t *pos;   /* [R] */
    float *h;       /* [C][max(d, q_dim)] */
    float *attn;    /* [C][q_dim] */
    float *gate;    /* [C][ff] */
    float *up;      /* [C][ff] */
    float *logits;  /* [LOGIT_CHUNK][n_vocab] */
    /* host */
    int32_t *hpos;  /* [R] */
    uint8_t *keep;  /* [n_head_kv][R], only with a hook */
    float *hq, *hk, *hv, *hk_pre; /* host copies for the hook on a device backend */
    int32_t *idx;   /* [max(R, LOGIT_CHUNK)] row indices */
    pd_copy2d *copies; /* [3 * n_head_kv * n_entries] */
} fwd_bufs;

static size_t align_up(size_t n) { return (n + 255) & ~(size_t)255; }

static bool host_backend(const pd_model *m) { return pd_backend_host_memory(m->backend); }

/* A model-owned 1-D tensor as the backend reads it. */
static const float *on_backend(const pd_model *m, const float *host) {
    return host ? m->dev_norms + (host - m->norms) : NULL;
}

static int scratch_grow(pd_model *m, bool dev, size_t bytes, void **out, pd_error *err) {
    pd_backend *be = m->backend;
    void **block = dev ? &m->scratch.dev : &m->scratch.host;
    size_t *have = dev ? &m->scratch.dev_bytes : &m->scratch.host_bytes;
    if (bytes > *have) {
        if (dev) {
            pd_backend_release(be, *block);
            *block = pd_backend_alloc(be, bytes, err);
        } else {
            free(*block);
            *block = malloc(bytes);
        }
        *have = *block ? bytes : 0;
        if (!*block)
            return dev ? pd_error_prefix(err, "the forward pass needs %zu MiB of %s scratch", bytes >> 20, pd_backend_name(be))
                       : pd_errorf(err, PD_ENOMEM, "out of memory: the forward pass needs %zu MiB of scratch", bytes >> 20);
    }
    *out = *block;
    return PD_OK;
}

/* Carve `n` regions of sizes[i] bytes out of one scratch block. */
static int carve(pd_model *m, bool dev, const size_t *sizes, void ***slots, size_t n, pd_error *err) {
    size_t total = 0;
    for (size_t i = 0; i < n; i++) total += align_up(sizes[i]);
    void *block = NULL;
    int rc = scratch_grow(m, dev, total ? total : 1, &block, err);
    if (rc) return rc;
    char *p = block;
    for (size_t i = 0; i < n; i++) {
        *slots[i] = sizes[i] ? p : NULL;
        p += align_up(sizes[i]);
    }
    return PD_OK;
}

static int64_t row_chunk(const pd_model *m) { return host_backend(m) ? HOST_ROW_CHUNK : DEVICE_ROW_CHUNK; }

static int alloc_bufs(pd_model *m, int64_t R, int n_es, bool want_logits, const pd_prefill_opts *opts, fwd_bufs *b,
                      pd_error *err) {
    const pd_hparams *hp = &m->hp;
    const bool hook = opts && opts->hook, host = host_backend(m);
    const bool hook_copies = hook && !host && !opts->hook_device_only;
    const size_t d = (size_t)hp->n_embd, qd = (size_t)hp->n_head * hp->head_dim,
                 kvd = (size_t)hp->n_head_kv * hp->head_dim, ff = (size_t)hp->n_ff, r = (size_t)R;
    const size_t c = (size_t)(R < row_chunk(m) ? R : row_chunk(m)), hw = d > qd ? d : qd;
    const size_t lc = (size_t)(R < LOGIT_CHUNK ? R : LOGIT_CHUNK);
    const size_t kv16 = m->kv_type == PD_TYPE_F16 ? r * kvd * 2 : 0;
    size_t dev_sizes[] = {
        r * d * 4, r * qd * 4, r * kvd * 4, r * kvd * 4, hook ? r * kvd * 4 : 0, kv16, kv16, r * 4,
        c * hw * 4, c * qd * 4, c * ff * 4, c * ff * 4, want_logits ? lc * (size_t)hp->n_vocab * 4 : 0,
    };
    void **dev_slots[] = {(void **)&b->x,    (void **)&b->q,   (void **)&b->k,    (void **)&b->v,
                          (void **)&b->k_pre, (void **)&b->k16, (void **)&b->v16, (void **)&b->pos,
                          (void **)&b->h,    (void **)&b->attn, (void **)&b->gate, (void **)&b->up,
                          (void **)&b->logits};
    int rc = carve(m, true, dev_sizes, dev_slots, sizeof dev_sizes / sizeof *dev_sizes, err);
    if (rc) return rc;
    size_t host_sizes[] = {
        r * 4, hook ? r * (size_t)hp->n_head_kv : 0, hook_copies ? r * qd * 4 : 0, hook_copies ? r * kvd * 4 : 0,
        hook_copies ? r * kvd * 4 : 0, hook_copies ? r * kvd * 4 : 0, (r > lc ? r : lc) * 4,
        3 * (size_t)hp->n_head_kv * (size_t)n_es * sizeof(pd_copy2d),
    };
    void **host_slots[] = {(void **)&b->hpos, (void **)&b->keep,   (void **)&b->hq,  (void **)&b->hk,
                           (void **)&b->hv,   (void **)&b->hk_pre, (void **)&b->idx, (void **)&b->copies};
    return carve(m, false, host_sizes, host_slots, sizeof host_sizes / sizeof *host_sizes, err);
}

static kv_stream *seq_stream(pd_seq *s, int layer, int head) {
    return &s->streams[(int64_t)layer * s->model->hp.n_head_kv + head];
}

/* Room for every entry's new rows in its streams of one layer. */
static int reserve_kv(pd_model *m, const fwd_entry *es, int n_es, int layer, pd_error *err) {
    const size_t row = (size_t)m->hp.head_dim * kv_elem_size(m->kv_type);
    for (int i = 0; i < n_es; i++)
        for (int h = 0; h < m->hp.n_head_kv; h++) {
            kv_stream *st = seq_stream(es[i].seq, layer, h);
            int rc = kv_stream_reserve(st, m->backend, st->len + es[i].n, row, err);
            if (rc) return rc;
        }
    return PD_OK;
}

/* Append every entry's new K/V rows of one layer to its sequence's streams:
 * one batch of 2-D copies ([row][kv head][dim] -> [kv head][row][dim]). An
 * f16 cache takes the rows rounded once, for the whole batch, first. */
static int append_kv(pd_model *m, const fwd_entry *es, int n_es, int64_t R, int layer, const fwd_bufs *b,
                     pd_error *err) {
    const pd_hparams *hp = &m->hp;
    pd_backend *be = m->backend;
    const int hd = hp->head_dim, nkv = hp->n_head_kv;
    const size_t esz = kv_elem_size(m->kv_type), row = (size_t)hd * esz, src_pitch = (size_t)nkv * row;
    const char *ksrc = (const char *)b->k, *vsrc = (const char *)b->v;
    int rc;
    if (m->kv_type == PD_TYPE_F16) {
        const int64_t n = R * nkv * hd;
        if ((rc = pd_backend_convert(be, b->k16, PD_TYPE_F16, b->k, PD_TYPE_F32, n, err)) ||
            (rc = pd_backend_convert(be, b->v16, PD_TYPE_F16, b->v, PD_TYPE_F32, n, err)))
            return rc;
        ksrc = (const char *)b->k16, vsrc = (const char *)b->v16;
    }
    if ((rc = reserve_kv(m, es, n_es, layer, err))) return rc;
    int64_t n_copies = 0;
    for (int i = 0; i < n_es; i++) {
        const fwd_entry *e = &es[i];
        for (int h = 0; h < nkv; h++) {
            kv_stream *st = seq_stream(e->seq, layer, h);
            const size_t first = (size_t)((e->row0 * nkv + h) * hd) * esz, end = (size_t)st->len * row;
            b->copies[n_copies++] =
                (pd_copy2d){(char *)st->k + end, ksrc + first, row, src_pitch, row, (size_t)e->n};
            b->copies[n_copies++] =
                (pd_copy2d){(char *)st->v + end, vsrc + first, row, src_pitch, row, (size_t)e->n};
            if (st->dpos)
                b->copies[n_copies++] = (pd_copy2d){st->dpos + st->len, b->pos + e->row0, sizeof(int32_t),
                                                    sizeof(int32_t), (size_t)e->n * sizeof(int32_t), 1};
        }
    }
    if ((rc = pd_backend_copy2d_batch(be, b->copies, n_copies, err))) return rc;
    /* Only now that the copies are queued do the lengths grow. */
    for (int i = 0; i < n_es; i++) {
        const fwd_entry *e = &es[i];
        for (int h = 0; h < nkv; h++) {
            kv_stream *st = seq_stream(e->seq, layer, h);
            memcpy(st->pos + st->len, b->hpos + e->row0, sizeof(int32_t) * (size_t)e->n);
            if (st->keep) memset(st->keep + st->len, 1, (size_t)e->n);
            st->len += e->n;
        }
    }
    return PD_OK;
}

/* Keep only the rows the hook left marked, in order. */
static int compact_kv(pd_model *m, const fwd_entry *e, int layer, const uint8_t *keep, fwd_bufs *b, pd_error *err) {
    const pd_hparams *hp = &m->hp;
    pd_backend *be = m->backend;
    const size_t row = (size_t)hp->head_dim * kv_elem_size(m->kv_type);
    for (int h = 0; h < hp->n_head_kv; h++) {
        kv_stream *st = seq_stream(e->seq, layer, h);
        const uint8_t *kh = keep + (int64_t)h * e->n;
        const int64_t base = st->len - e->n;
        int64_t n_kept = 0;
        for (int64_t i = 0; i < e->n; i++)
            if (kh[i]) b->idx[n_kept++] = (int32_t)i;
        if (n_kept == e->n) continue;
        char *k = (char *)st->k + (size_t)base * row, *v = (char *)st->v + (size_t)base * row;
        if (host_backend(m)) {
            for (int64_t j = 0; j < n_kept; j++) {
                const size_t src = (size_t)b->idx[j], dst = (size_t)j;
                memmove(k + dst * row, k + src * row, row);
                memmove(v + dst * row, v + src * row, row);
                if (st->keep) st->keep[base + j] = st->keep[base + b->idx[j]];
            }
        } else {
            /* Gather into the activation buffers (free by now), then back. */
            int rc;
            if ((rc = pd_backend_gather(be, b->q, k, b->idx, n_kept, row, err)) ||
                (rc = pd_backend_copy(be, k, b->q, (size_t)n_kept * row, err)) ||
                (rc = pd_backend_gather(be, b->q, v, b->idx, n_kept, row, err)) ||
                (rc = pd_backend_copy(be, v, b->q, (size_t)n_kept * row, err)))
                return rc;
        }
        for (int64_t j = 0; j < n_kept; j++) st->pos[base + j] = st->pos[base + b->idx[j]];
        if (st->dpos) {
            int rc = pd_backend_upload(be, st->dpos + base, st->pos + base, (size_t)n_kept * sizeof(int32_t), err);
            if (rc) return rc;
        }
        st->len = base + n_kept;
    }
    return PD_OK;
}

/* Views of one stream array (rows of `type`) as the backend reads it. */
static void stream_views(const kv_stream *streams, pd_type type, int nkv, int layer, pd_kv_view *out) {
    for (int h = 0; h < nkv; h++) {
        const kv_stream *st = &streams[(int64_t)layer * nkv + h];
        out[h] = (pd_kv_view){
            .k = st->k, .v = st->v, .pos = kv_stream_dpos(st), .keep = st->keep, .len = st->len, .type = type};
    }
}

/* Attention for entries [i0, i1) (consecutive rows [r0, r1) of the batch,
 * all continuing the same prefix or none): the prefix is the shared
 * segment, each entry's own cache its private one. */
static int attend(pd_model *m, const fwd_entry *es, int i0, int i1, int64_t r0, int64_t r1, int layer,
                  const fwd_bufs *b, pd_error *err) {
    const pd_hparams *hp = &m->hp;
    const int nkv = hp->n_head_kv, n_groups = i1 - i0;
    const pd_kv_prefix *prefix = es[i0].seq->prefix;
    pd_kv_view shared_small[64], own_small[4 * 64], *shared = shared_small, *own = own_small;
    int64_t starts_small[65], *starts = starts_small;
    int rc = PD_OK;
    if (nkv > 64) shared = malloc(sizeof *shared * (size_t)nkv);
    if ((int64_t)n_groups * nkv > 4 * 64) own = malloc(sizeof *own * (size_t)n_groups * (size_t)nkv);
    if (n_groups + 1 > 65) starts = malloc(sizeof *starts * (size_t)(n_groups + 1));
    if (!shared || !own || !starts) {
        rc = pd_errorf(err, PD_ENOMEM, "out of memory for attention views");
        goto done;
    }
    if (prefix) stream_views(es[i0].seq->prefix_streams, prefix->type, nkv, layer, shared);
    for (int g = 0; g < n_groups; g++) {
        const fwd_entry *e = &es[i0 + g];
        stream_views(e->seq->streams, m->kv_type, nkv, layer, own + (int64_t)g * nkv);
        /* A chunk of one long entry is one group; entries of one token each
         * are one group each. */
        int64_t a = e->row0 > r0 ? e->row0 : r0;
        starts[g] = a - r0;
    }
    starts[n_groups] = r1 - r0;
    const int64_t qd = (int64_t)hp->n_head * hp->head_dim;
    pd_attn_args args = {
        .q = b->q + r0 * qd,
        .q_pos = b->pos + r0,
        .n_tokens = r1 - r0,
        .n_head = hp->n_head,
        .n_head_kv = nkv,
        .head_dim = hp->head_dim,
        .n_segments = 1,
        .kv = own,
        .n_shared = prefix ? 1 : 0,
        .shared = prefix ? shared : NULL,
        .n_groups = n_groups,
        .group_start = starts,
        .scale = hp->attn_scale,
        .causal = true,
        .window = m->layers[layer].window,
        .softcap = hp->attn_softcap,
        .out = b->attn,
    };
    rc = pd_backend_attention(m->backend, &args, err);
done:
    if (shared != shared_small) free(shared);
    if (own != own_small) free(own);
    if (starts != starts_small) free(starts);
    return rc;
}

/* The hook's view of this layer; on a device backend the host arrays are
 * copies made here unless the hook asked for device arrays only. */
static int run_hook(pd_model *m, const fwd_entry *e, int layer, const pd_prefill_opts *opts, fwd_bufs *b,
                    pd_error *err) {
    const pd_hparams *hp = &m->hp;
    pd_backend *be = m->backend;
    const size_t n = (size_t)e->n, qd = (size_t)hp->n_head * hp->head_dim, kvd = (size_t)hp->n_head_kv * hp->head_dim;
    pd_layer_kv view = {
        .layer = layer,
        .n_tokens = e->n,
        .n_head = hp->n_head,
        .n_head_kv = hp->n_head_kv,
        .head_dim = hp->head_dim,
        .pos = b->hpos,
        .backend = be,
        .dev_k_pre_rope = b->k_pre,
        .dev_q = b->q,
        .dev_k = b->k,
        .dev_v = b->v,
    };
    int rc;
    if (host_backend(m)) {
        view.k_pre_rope = b->k_pre, view.q = b->q, view.k = b->k, view.v = b->v;
    } else if (!opts->hook_device_only) {
        if ((rc = pd_backend_download(be, b->hq, b->q, n * qd * 4, err)) ||
            (rc = pd_backend_download(be, b->hk, b->k, n * kvd * 4, err)) ||
            (rc = pd_backend_download(be, b->hv, b->v, n * kvd * 4, err)) ||
            (rc = pd_backend_download(be, b->hk_pre, b->k_pre, n * kvd * 4, err)))
            return rc;
        view.k_pre_rope = b->hk_pre, view.q = b->hq, view.k = b->hk, view.v = b->hv;
    }
    memset(b->keep, 1, (size_t)hp->n_head_kv * n);
    if ((rc = opts->hook(opts->hook_ctx, &view, b->keep, err))) return rc;
    return compact_kv(m, e, layer, b->keep, b, err);
}

/* Entries [i, j) that can share one attention call: runs of one-token
 * entries continuing the same prefix (a decode batch), at most chunk. */
static int decode_run_end(const fwd_entry *es, int n_es, int i, int64_t chunk) {
    int j = i + 1;
    if (es[i].n != 1) return j;
    while (j < n_es && j - i < chunk && es[j].n == 1 && es[j].seq->prefix == es[i].seq->prefix) j++;
    return j;
}

/* One layer over all R rows. Fused ops cut a device backend's launches
 * (docs/gpu.md): Q, K and V in one product, biases and rope in one op,
 * gate/up and the GLU in one, and each residual add together with the
 * norm that reads its result. When every row fits one chunk (a decode
 * step, a short prefill) the add that ends the layer also computes the
 * next layer's attn_norm into b->h: *h_ready says so on return, and on
 * entry that this layer's attn_norm is already in b->h. */
static int run_layer(pd_model *m, fwd_entry *es, int n_es, int64_t R, int layer, const pd_prefill_opts *opts,
                     fwd_bufs *b, bool *h_ready, pd_error *err) {
    const pd_hparams *hp = &m->hp;
    const layer_weights *L = &m->layers[layer];
    pd_backend *be = m->backend;
    const int64_t d = hp->n_embd, qd = (int64_t)hp->n_head * hp->head_dim, kvd = (int64_t)hp->n_head_kv * hp->head_dim;
    const bool hook = opts && opts->hook;
    /* Rows all in one chunk and no hook between attention and FFN: the
     * norms can ride on the residual adds. */
    const int64_t chunk = row_chunk(m);
    const bool fuse_norms = R <= chunk && !hook;
    const bool normed_in = *h_ready;
    int rc;
    *h_ready = false;

    /* Q, K, V for every row. */
    const pd_weight *wqkv[3] = {&L->wq, &L->wk, &L->wv};
    for (int64_t r0 = 0; r0 < R; r0 += chunk) {
        const int64_t n = R - r0 < chunk ? R - r0 : chunk;
        float *yqkv[3] = {b->q + r0 * qd, b->k + r0 * kvd, b->v + r0 * kvd};
        if ((!(normed_in && r0 == 0 && n == R) &&
             (rc = pd_backend_rmsnorm(be, b->x + r0 * d, on_backend(m, L->attn_norm), n, d, hp->rms_eps, b->h, err))) ||
            (rc = pd_backend_matmul_multi(be, wqkv, 3, b->h, n, yqkv, err)))
            return rc;
    }
    /* Biases, then (qwen3, gemma3) every head of Q and K RMS-normed, then
     * rope. Without the norms and the pre-rope copy of K, biases and rope
     * are one op. */
    const bool norms = L->q_norm || L->k_norm;
    const bool rope_now = !norms && !b->k_pre;
    const pd_qkv_args qkv = {
        .q = b->q, .k = b->k, .v = b->v,
        .bq = on_backend(m, L->bq), .bk = on_backend(m, L->bk), .bv = on_backend(m, L->bv),
        .pos = b->pos, .n = R, .n_head = hp->n_head, .n_head_kv = hp->n_head_kv, .head_dim = hp->head_dim,
        .rope = rope_now ? L->rope : NULL,
    };
    if ((rope_now || L->bq || L->bk || L->bv) && (rc = pd_backend_qkv_bias_rope(be, &qkv, err))) return rc;
    if ((L->q_norm && (rc = pd_backend_rmsnorm(be, b->q, on_backend(m, L->q_norm), R * hp->n_head, hp->head_dim,
                                         hp->rms_eps, b->q, err))) ||
        (L->k_norm && (rc = pd_backend_rmsnorm(be, b->k, on_backend(m, L->k_norm), R * hp->n_head_kv, hp->head_dim,
                                         hp->rms_eps, b->k, err))))
        return rc;
    if (b->k_pre && (rc = pd_backend_copy(be, b->k_pre, b->k, sizeof(float) * (size_t)(R * kvd), err))) return rc;
    if (!rope_now && ((rc = pd_backend_rope(be, b->q, b->pos, R, hp->n_head, hp->head_dim, L->rope, err)) ||
                      (rc = pd_backend_rope(be, b->k, b->pos, R, hp->n_head_kv, hp->head_dim, L->rope, err))))
        return rc;
    if ((rc = append_kv(m, es, n_es, R, layer, b, err))) return rc;

    /* Attention and output projection: a long entry chunk by chunk, a run
     * of decode entries together. A pass over all rows also norms them
     * for the FFN. */
    bool ffn_normed = false;
    for (int i = 0; i < n_es;) {
        const int j = decode_run_end(es, n_es, i, chunk);
        const int64_t end = es[j - 1].row0 + es[j - 1].n;
        for (int64_t r0 = es[i].row0; r0 < end; r0 += chunk) {
            const int64_t r1 = end - r0 < chunk ? end : r0 + chunk;
            const bool all_rows = fuse_norms && r0 == 0 && r1 == R;
            if ((rc = attend(m, es, i, j, r0, r1, layer, b, err)) ||
                (rc = pd_backend_matmul(be, &L->wo, b->attn, r1 - r0, b->h, err)) ||
                (L->post_attn_norm && (rc = pd_backend_rmsnorm(be, b->h, on_backend(m, L->post_attn_norm), r1 - r0, d,
                                                         hp->rms_eps, b->h, err))))
                return rc;
            rc = all_rows ? pd_backend_add_rmsnorm(be, b->x, b->h, on_backend(m, L->ffn_norm), R, d, hp->rms_eps, b->h, err)
                          : pd_backend_add(be, b->x + r0 * d, b->h, r1 - r0, d, d, err);
            if (rc) return rc;
            ffn_normed = all_rows;
        }
        i = j;
    }

    /* The hook sees the layer after its attention ran over the full K/V. */
    if (hook && (rc = run_hook(m, &es[0], layer, opts, b, err))) return rc;

    /* Feed-forward: SwiGLU, or GeGLU for gemma. */
    const bool gemma = hp->arch == PD_ARCH_GEMMA2 || hp->arch == PD_ARCH_GEMMA3;
    const float *next_norm = layer + 1 < hp->n_layer ? on_backend(m, m->layers[layer + 1].attn_norm) : NULL;
    for (int64_t r0 = 0; r0 < R; r0 += chunk) {
        const int64_t n = R - r0 < chunk ? R - r0 : chunk;
        if ((!ffn_normed &&
             (rc = pd_backend_rmsnorm(be, b->x + r0 * d, on_backend(m, L->ffn_norm), n, d, hp->rms_eps, b->h, err))) ||
            (rc = pd_backend_matmul_glu(be, &L->w_gate, &L->w_up, b->h, n, gemma ? PD_GLU_GELU : PD_GLU_SILU, b->gate,
                                        b->up, err)) ||
            (rc = pd_backend_matmul(be, &L->w_down, b->gate, n, b->h, err)) ||
            (L->post_ffn_norm &&
             (rc = pd_backend_rmsnorm(be, b->h, on_backend(m, L->post_ffn_norm), n, d, hp->rms_eps, b->h, err))))
            return rc;
        *h_ready = fuse_norms && next_norm;
        rc = *h_ready ? pd_backend_add_rmsnorm(be, b->x, b->h, next_norm, n, d, hp->rms_eps, b->h, err)
                      : pd_backend_add(be, b->x + r0 * d, b->h, n, d, d, err);
        if (rc) return rc;
    }
    return PD_OK;
}

/* Where a device backend's logits come down: LOGIT_CHUNK rows of pinned
 * host memory, kept by the model (allocating pinned memory is slow). */
static int logits_staging(pd_model *m, pd_error *err) {
    const size_t bytes = (size_t)LOGIT_CHUNK * (size_t)m->hp.n_vocab * sizeof(float);
    if (m->logits_staging_bytes >= bytes) return PD_OK;
    pd_backend_host_free(m->backend, m->logits_staging);
    m->logits_staging_bytes = 0;
    if (!(m->logits_staging = pd_backend_host_alloc(m->backend, bytes, err)))
        return pd_error_prefix(err, "staging for the logits");
    m->logits_staging_bytes = bytes;
    return PD_OK;
}

/* A step recorded as a device graph: RECORDING until output_logits ends
 * the recording (before the first download, which must wait for the
 * work), LAUNCHED once it was launched. */
typedef enum step_graph { GRAPH_NONE, GRAPH_RECORDING, GRAPH_LAUNCHED } step_graph;

/* Final norm and output projection of the wanted rows, LOGIT_CHUNK at a
 * time: gather them, project, and copy each row to its logits slot. On a
 * device backend a chunk comes down in one copy into pinned memory, then
 * is scattered to the slots. */
static int output_logits(pd_model *m, const fwd_entry *es, int n_es, fwd_bufs *b, float *logits, step_graph *graph,
                         pd_error *err) {
    const pd_hparams *hp = &m->hp;
    pd_backend *be = m->backend;
    const int64_t d = hp->n_embd, V = hp->n_vocab;
    int64_t n = 0, out_of[LOGIT_CHUNK];
    int rc = host_backend(m) ? PD_OK : logits_staging(m, err);
    for (int i = 0; i < n_es && !rc; i++) {
        const fwd_entry *e = &es[i];
        for (int64_t t = 0; t < e->n_out && !rc; t++) {
            b->idx[n] = (int32_t)(e->row0 + e->n - e->n_out + t);
            out_of[n++] = e->out0 + t;
            const bool last = i == n_es - 1 && t == e->n_out - 1;
            if (n < LOGIT_CHUNK && !last) continue;
            bool consecutive = true;
            for (int64_t r = 1; r < n; r++) consecutive &= out_of[r] == out_of[0] + r;
            /* On the host, consecutive slots are written in place. */
            float *dst = host_backend(m) && consecutive ? logits + out_of[0] * V : b->logits;
            if ((rc = pd_backend_gather(be, b->h, b->x, b->idx, n, (size_t)d * sizeof(float), err)) ||
                (rc = pd_backend_rmsnorm(be, b->h, on_backend(m, m->output_norm), n, d, hp->rms_eps, b->h, err)) ||
                (rc = pd_backend_matmul(be, &m->output, b->h, n, dst, err)) ||
                (hp->final_softcap > 0.0f && (rc = pd_backend_softcap(be, dst, n * V, hp->final_softcap, err))))
                break;
            const size_t row_bytes = (size_t)V * sizeof(float);
            if (*graph == GRAPH_RECORDING) {
                rc = pd_backend_graph_end(be, true, err);
                *graph = rc == PD_EUNSUPPORTED ? GRAPH_NONE : GRAPH_LAUNCHED; /* PD_EUNSUPPORTED: none of it ran */
                if (rc) break;
            }
            if (!host_backend(m)) {
                if (!(rc = pd_backend_download(be, m->logits_staging, b->logits, (size_t)n * row_bytes, err)))
                    for (int64_t r = 0; r < n; r++)
                        memcpy(logits + out_of[r] * V, m->logits_staging + r * V, row_bytes);
            } else {
                for (int64_t r = 0; r < n && !rc && dst == b->logits; r++)
                    rc = pd_backend_download(be, logits + out_of[r] * V, b->logits + r * V, row_bytes, err);
            }
            n = 0;
        }
    }
    return rc;
}

/* Drop every row at or past each entry's next_pos from layers [0, n_layers):
 * the sequences are as they were before the call. */
static void drop_step_rows(pd_model *m, const fwd_entry *es, int n_es, int n_layers) {
    for (int i = 0; i < n_es; i++)
        for (int l = 0; l < n_layers; l++)
            for (int h = 0; h < m->hp.n_head_kv; h++) {
                kv_stream *st = seq_stream(es[i].seq, l, h);
                while (st->len > 0 && st->pos[st->len - 1] >= es[i].seq->next_pos) st->len--;
            }
}

/* Whether a call is recorded as one device graph: a decode step (one token
 * and its logits per entry, one output chunk) on a device backend, unless
 * the model was loaded without graphs. */
static bool graph_step(const pd_model *m, const fwd_entry *es, int n_es, const pd_prefill_opts *opts,
                       const float *logits) {
    if (m->no_graphs || host_backend(m) || opts || !logits || n_es > LOGIT_CHUNK || n_es > PD_GRAPH_BUCKETS)
        return false;
    for (int i = 0; i < n_es; i++)
        if (es[i].n != 1 || es[i].n_out != 1) return false;
    return true;
}

/* One pass, recorded as a device graph when try_graph and the backend
 * records one. A failure of a recorded pass leaves the sequences as they
 * were and sets *redo when none of the step ran and the device is fine:
 * the caller runs it again without a graph. */
static int forward_pass(pd_model *m, fwd_entry *es, int n_es, const pd_prefill_opts *opts, float *logits,
                        bool try_graph, bool *redo, pd_error *err) {
    const pd_hparams *hp = &m->hp;
    int64_t R = 0;
    for (int i = 0; i < n_es; i++) {
        fwd_entry *e = &es[i];
        if (e->n <= 0) return pd_errorf(err, PD_EINVAL, "entry %d has no tokens", i);
        if ((int64_t)e->seq->next_pos + e->n > e->seq->n_ctx)
            return pd_errorf(err, PD_ERANGE, "%" PRId64 " more tokens would pass the context size %d (at position %d)",
                             e->n, e->seq->n_ctx, e->seq->next_pos);
        for (int j = 0; j < i; j++)
            if (es[j].seq == e->seq) return pd_errorf(err, PD_EINVAL, "a sequence appears twice in one batch");
        for (int64_t t = 0; t < e->n; t++)
            if (e->tokens[t] < 0 || e->tokens[t] >= hp->n_vocab)
                return pd_errorf(err, PD_EINVAL, "token id %d at position %" PRId64 " is outside the vocabulary (0..%d)",
                                 e->tokens[t], t, hp->n_vocab - 1);
        e->row0 = R;
        R += e->n;
    }
    fwd_bufs b;
    pd_backend *be = m->backend;
    int rc = alloc_bufs(m, R, n_es, logits != NULL, opts, &b, err);
    if (rc) return rc;
    /* A stream that grows (allocate, copy) inside a recording that is then
     * dropped would be left half made: every stream grows first. */
    for (int l = 0; try_graph && l < hp->n_layer; l++)
        if ((rc = reserve_kv(m, es, n_es, l, err))) return rc;
    const bool recorded = try_graph && pd_backend_graph_begin(be, n_es, NULL) == PD_OK;
    step_graph graph = recorded ? GRAPH_RECORDING : GRAPH_NONE;

    for (int i = 0; i < n_es; i++) {
        const fwd_entry *e = &es[i];
        if ((rc = pd_backend_get_rows(be, &m->tok_embd, e->tokens, e->n, b.x + e->row0 * hp->n_embd, err))) goto fail;
        for (int64_t t = 0; t < e->n; t++) b.hpos[e->row0 + t] = e->seq->next_pos + (int32_t)t;
    }
    if (hp->embd_scale != 1.0f && (rc = pd_backend_scale(be, b.x, R * hp->n_embd, hp->embd_scale, err))) goto fail;
    if ((rc = pd_backend_upload(be, b.pos, b.hpos, sizeof(int32_t) * (size_t)R, err))) goto fail;

    bool h_ready = false; /* b->h holds the next layer's attn_norm (run_layer) */
    for (int l = 0; l < hp->n_layer; l++) {
        if ((rc = run_layer(m, es, n_es, R, l, opts, &b, &h_ready, err))) {
            /* Leave every sequence as it was: drop this call's rows from all layers. */
            drop_step_rows(m, es, n_es, l + 1);
            pd_error_prefix(err, "layer %d", l);
            goto fail;
        }
    }
    /* A device backend reports late failures here rather than in the next call. */
    if (!logits && (rc = pd_backend_sync(be, err))) return rc;
    for (int i = 0; i < n_es; i++) es[i].seq->next_pos += (int32_t)es[i].n;
    if (!logits) return PD_OK;
    if (!(rc = output_logits(m, es, n_es, &b, logits, &graph, err)) || !recorded || graph == GRAPH_LAUNCHED)
        return rc;
    /* The recorded step never ran (an op failed while recording, or the
     * recording could not be launched): take it back. */
    for (int i = 0; i < n_es; i++) es[i].seq->next_pos -= (int32_t)es[i].n;
    drop_step_rows(m, es, n_es, hp->n_layer);
fail:
    if (graph == GRAPH_RECORDING) (void)pd_backend_graph_end(be, false, NULL);
    *redo = recorded && rc != PD_EDEVICE;
    return rc;
}

static int forward(pd_model *m, fwd_entry *es, int n_es, const pd_prefill_opts *opts, float *logits, pd_error *err) {
    bool redo = false;
    const int rc = forward_pass(m, es, n_es, opts, logits, graph_step(m, es, n_es, opts, logits), &redo, err);
    return rc && redo ? forward_pass(m, es, n_es, opts, logits, false, &redo, err) : rc;
}

int pd_prefill(pd_model *m, pd_seq *s, const pd_token *tokens, int64_t n, const pd_prefill_opts *opts, float *logits,
               pd_error *err) {
    if (s->model != m) return pd_errorf(err, PD_EINVAL, "the sequence belongs to another model");
    if (n == 0) return pd_errorf(err, PD_EINVAL, "nothing to prefill: no tokens");
    fwd_entry e = {.seq = s, .tokens = tokens, .n = n, .n_out = opts && opts->logits_all ? n : 1, .out0 = 0};
    return forward(m, &e, 1, opts, logits, err);
}

static int by_prefix(const void *pa, const void *pb) {
    const fwd_entry *a = pa, *b = pb;
    uintptr_t x = (uintptr_t)a->seq->prefix, y = (uintptr_t)b->seq->prefix;
    if (x != y) return x < y ? -1 : 1;
    return (a->out0 > b->out0) - (a->out0 < b->out0); /* stable: keep the caller's order */
}

int pd_decode(pd_model *m, pd_seq *const *seqs, const pd_token *tokens, int n_seqs, float *logits, pd_error *err) {
    if (n_seqs <= 0) return pd_errorf(err, PD_EINVAL, "nothing to decode: no sequences");
    fwd_entry small[16], *es = small;
    if (n_seqs > 16 && !(es = malloc(sizeof *es * (size_t)n_seqs)))
        return pd_errorf(err, PD_ENOMEM, "out of memory for a decode batch of %d", n_seqs);
    for (int i = 0; i < n_seqs; i++) {
        if (seqs[i]->model != m) {
            if (es != small) free(es);
            return pd_errorf(err, PD_EINVAL, "sequence %d belongs to another model", i);
        }
        es[i] = (fwd_entry){.seq = seqs[i], .tokens = &tokens[i], .n = 1, .n_out = 1, .out0 = i};
    }
    /* Sequences that continue the same prefix side by side: their attention
     * is one call that reads the prefix once. Logits keep the caller's order. */
    qsort(es, (size_t)n_seqs, sizeof *es, by_prefix);
    int rc = forward(m, es, n_seqs, NULL, logits, err);
    if (es != small) free(es);
    return rc;
}

/* -log softmax(logits)[target], in double for a stable sum over many tokens. */
static double token_nll(const float *logits, int32_t n_vocab, pd_token target) {
    float mx = logits[0];
    for (int32_t i = 1; i < n_vocab; i++)
        if (logits[i] > mx) mx = logits[i];
    double sum = 0.0;
    for (int32_t i = 0; i < n_vocab; i++) sum += exp((double)logits[i] - mx);
    return log(sum) + mx - logits[target];
}

#define NLL_CHUNK 64

int pd_nll(pd_model *m, const pd_kv_prefix *prefix, const pd_token *context, int64_t n_context, const pd_token *text,
           int64_t n_text, double *mean_nll, pd_error *err) {
    if (n_text <= 0) return pd_errorf(err, PD_EINVAL, "nothing to score: the text is empty");
    if (n_context <= 0 && (!prefix || prefix->n_orig == 0))
        return pd_errorf(err, PD_EINVAL, "the text needs a context or a prefix to be scored against");
    const int32_t V = m->hp.n_vocab;
    for (int64_t i = 0; i < n_text; i++)
        if (text[i] < 0 || text[i] >= V) return pd_errorf(err, PD_EINVAL, "text token %d is outside the vocabulary", text[i]);
    pd_seq *s = NULL;
    float *logits = malloc(sizeof(float) * (size_t)V * NLL_CHUNK);
    if (!logits) return pd_errorf(err, PD_ENOMEM, "out of memory for logits");
    int32_t need = (int32_t)((prefix ? prefix->n_orig : 0) + n_context + n_text);
    int rc = pd_seq_create(m, need > m->hp.n_ctx_train ? need : 0, &s, err);
    if (!rc && prefix) rc = pd_seq_attach_prefix(s, prefix, err);

    double total = 0.0;
    int64_t scored = 0;
    pd_prefill_opts all = {.logits_all = true};
    if (!rc && n_context > 0) {
        /* The last context token's logits predict text[0]. */
        if (n_context > 1) rc = pd_prefill(m, s, context, n_context - 1, NULL, NULL, err);
        if (!rc) rc = pd_prefill(m, s, context + n_context - 1, 1, NULL, logits, err);
        if (!rc) total += token_nll(logits, V, text[0]), scored = 1;
    }
    /* Then text[i] predicts text[i + 1]. With a prefix and no context, text[0]
     * is only fed: a prefix keeps K/V, not the logits of its last token. */
    for (int64_t i = 0; !rc && i < n_text - 1; i += NLL_CHUNK) {
        const int64_t n = n_text - 1 - i < NLL_CHUNK ? n_text - 1 - i : NLL_CHUNK;
        rc = pd_prefill(m, s, text + i, n, &all, logits, err);
        for (int64_t j = 0; !rc && j < n; j++) total += token_nll(logits + j * V, V, text[i + j + 1]);
        scored += n;
    }
    pd_seq_free(s);
    free(logits);
    if (rc) return rc;
    if (scored == 0) return pd_errorf(err, PD_EINVAL, "no text token could be scored");
    *mean_nll = total / (double)scored;
    return PD_OK;
}
