/* The forward pass of llama-family models.
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

#define ROW_CHUNK 256 /* rows per projection/FFN chunk */

typedef struct fwd_entry {
    pd_seq *seq;
    const pd_token *tokens;
    int64_t n;
    int64_t row0;    /* first row of this entry in the batch */
    int64_t n_out;   /* rows whose logits are wanted (1 or n) */
    int64_t out0;    /* first logits row of this entry */
} fwd_entry;

typedef struct fwd_bufs {
    float *x;       /* [R][d] residual stream */
    float *q;       /* [R][q_dim] */
    float *k;       /* [R][kv_dim] */
    float *v;       /* [R][kv_dim] */
    float *k_pre;   /* [R][kv_dim], only with a hook */
    int32_t *pos;   /* [R] */
    uint8_t *keep;  /* [n_head_kv][R], only with a hook */
    float *h;       /* [C][max(d, q_dim)] */
    float *attn;    /* [C][q_dim] */
    float *gate;    /* [C][ff] */
    float *up;      /* [C][ff] */
} fwd_bufs;

static size_t align_up(size_t n) { return (n + 63) & ~(size_t)63; }

static int scratch_get(pd_model *m, size_t bytes, void **out, pd_error *err) {
    if (bytes > m->scratch.bytes) {
        free(m->scratch.block);
        m->scratch.block = malloc(bytes);
        m->scratch.bytes = m->scratch.block ? bytes : 0;
        if (!m->scratch.block)
            return pd_errorf(err, PD_ENOMEM, "out of memory: the forward pass needs %zu MiB of scratch", bytes >> 20);
    }
    *out = m->scratch.block;
    return PD_OK;
}

static int alloc_bufs(pd_model *m, int64_t R, bool with_hook, fwd_bufs *b, pd_error *err) {
    const pd_hparams *hp = &m->hp;
    const size_t d = (size_t)hp->n_embd, qd = (size_t)hp->n_head * hp->head_dim,
                 kvd = (size_t)hp->n_head_kv * hp->head_dim, ff = (size_t)hp->n_ff, r = (size_t)R;
    const size_t c = (size_t)(R < ROW_CHUNK ? R : ROW_CHUNK), hw = d > qd ? d : qd;
    size_t sizes[] = {
        r * d * 4, r * qd * 4, r * kvd * 4, r * kvd * 4, with_hook ? r * kvd * 4 : 0, r * 4,
        with_hook ? r * (size_t)hp->n_head_kv : 0, c * hw * 4, c * qd * 4, c * ff * 4, c * ff * 4,
    };
    size_t total = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) total += align_up(sizes[i]);
    void *block = NULL;
    int rc = scratch_get(m, total, &block, err);
    if (rc) return rc;
    char *p = block;
    void **slots[] = {(void **)&b->x,    (void **)&b->q,    (void **)&b->k,    (void **)&b->v,
                      (void **)&b->k_pre, (void **)&b->pos, (void **)&b->keep, (void **)&b->h,
                      (void **)&b->attn, (void **)&b->gate, (void **)&b->up};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        *slots[i] = sizes[i] ? p : NULL;
        p += align_up(sizes[i]);
    }
    return PD_OK;
}

static void add_bias(float *y, const float *bias, int64_t rows, int64_t width) {
    if (!bias) return;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < width; i++) y[r * width + i] += bias[i];
}

static kv_stream *seq_stream(pd_seq *s, int layer, int head) {
    return &s->streams[(int64_t)layer * s->model->hp.n_head_kv + head];
}

/* Append this entry's new K/V rows of one layer to the sequence's streams. */
static int append_kv(pd_model *m, const fwd_entry *e, int layer, const fwd_bufs *b, pd_error *err) {
    const pd_hparams *hp = &m->hp;
    const int hd = hp->head_dim, nkv = hp->n_head_kv;
    for (int h = 0; h < nkv; h++) {
        kv_stream *st = seq_stream(e->seq, layer, h);
        int rc = kv_stream_reserve(st, st->len + e->n, hd, err);
        if (rc) return rc;
        for (int64_t i = 0; i < e->n; i++) {
            const int64_t row = e->row0 + i;
            memcpy(st->k + (st->len + i) * hd, b->k + (row * nkv + h) * hd, sizeof(float) * (size_t)hd);
            memcpy(st->v + (st->len + i) * hd, b->v + (row * nkv + h) * hd, sizeof(float) * (size_t)hd);
            st->pos[st->len + i] = b->pos[row];
            if (st->keep) st->keep[st->len + i] = 1;
        }
        st->len += e->n;
    }
    return PD_OK;
}

/* Keep only the rows the hook left marked, in order. */
static void compact_kv(pd_model *m, const fwd_entry *e, int layer, const uint8_t *keep) {
    const pd_hparams *hp = &m->hp;
    const int hd = hp->head_dim;
    for (int h = 0; h < hp->n_head_kv; h++) {
        kv_stream *st = seq_stream(e->seq, layer, h);
        const uint8_t *kh = keep + (int64_t)h * e->n;
        int64_t base = st->len - e->n, out = base;
        for (int64_t i = 0; i < e->n; i++) {
            if (!kh[i]) continue;
            const int64_t src = base + i;
            if (out != src) {
                memmove(st->k + out * hd, st->k + src * hd, sizeof(float) * (size_t)hd);
                memmove(st->v + out * hd, st->v + src * hd, sizeof(float) * (size_t)hd);
                st->pos[out] = st->pos[src];
                if (st->keep) st->keep[out] = st->keep[src];
            }
            out++;
        }
        st->len = out;
    }
}

static int attend_entry(pd_model *m, const fwd_entry *e, int layer, const fwd_bufs *b, int64_t r0, int64_t r1,
                        pd_error *err) {
    const pd_hparams *hp = &m->hp;
    pd_kv_view views[2 * 64];
    pd_kv_view *kv = views;
    const int nkv = hp->n_head_kv;
    int n_seg = e->seq->prefix ? 2 : 1;
    if ((size_t)(n_seg * nkv) > sizeof views / sizeof *views) {
        kv = malloc(sizeof *kv * (size_t)(n_seg * nkv));
        if (!kv) return pd_errorf(err, PD_ENOMEM, "out of memory for attention views");
    }
    int seg = 0;
    if (e->seq->prefix) {
        const pd_kv_prefix *p = e->seq->prefix;
        for (int h = 0; h < nkv; h++) {
            const kv_stream *st = &p->streams[(int64_t)layer * nkv + h];
            kv[h] = (pd_kv_view){.k = st->k, .v = st->v, .pos = st->pos, .keep = st->keep, .len = st->len};
        }
        seg = 1;
    }
    for (int h = 0; h < nkv; h++) {
        const kv_stream *st = seq_stream(e->seq, layer, h);
        kv[seg * nkv + h] = (pd_kv_view){.k = st->k, .v = st->v, .pos = st->pos, .keep = st->keep, .len = st->len};
    }
    pd_attn_args a = {
        .q = b->q + r0 * (int64_t)hp->n_head * hp->head_dim,
        .q_pos = b->pos + r0,
        .n_tokens = r1 - r0,
        .n_head = hp->n_head,
        .n_head_kv = nkv,
        .head_dim = hp->head_dim,
        .n_segments = n_seg,
        .kv = kv,
        .scale = 1.0f / sqrtf((float)hp->head_dim),
        .causal = true,
        .out = b->attn,
    };
    int rc = m->backend->ops->attention(m->backend, &a, err);
    if (kv != views) free(kv);
    return rc;
}

static int run_layer(pd_model *m, fwd_entry *es, int n_es, int64_t R, int layer, const pd_prefill_opts *opts,
                     fwd_bufs *b, pd_error *err) {
    const pd_hparams *hp = &m->hp;
    const layer_weights *L = &m->layers[layer];
    pd_backend *be = m->backend;
    const pd_backend_ops *ops = be->ops;
    const int64_t d = hp->n_embd, qd = (int64_t)hp->n_head * hp->head_dim, kvd = (int64_t)hp->n_head_kv * hp->head_dim,
                  ff = hp->n_ff;
    int rc;

    /* Q, K, V for every row. */
    for (int64_t r0 = 0; r0 < R; r0 += ROW_CHUNK) {
        const int64_t n = R - r0 < ROW_CHUNK ? R - r0 : ROW_CHUNK;
        ops->rmsnorm(be, b->x + r0 * d, L->attn_norm, n, d, hp->rms_eps, b->h);
        if ((rc = ops->matmul(be, &L->wq, b->h, n, b->q + r0 * qd, err)) ||
            (rc = ops->matmul(be, &L->wk, b->h, n, b->k + r0 * kvd, err)) ||
            (rc = ops->matmul(be, &L->wv, b->h, n, b->v + r0 * kvd, err)))
            return rc;
        add_bias(b->q + r0 * qd, L->bq, n, qd);
        add_bias(b->k + r0 * kvd, L->bk, n, kvd);
        add_bias(b->v + r0 * kvd, L->bv, n, kvd);
    }
    if (b->k_pre) memcpy(b->k_pre, b->k, sizeof(float) * (size_t)(R * kvd));
    ops->rope(be, b->q, b->pos, R, hp->n_head, hp->head_dim, &hp->rope);
    ops->rope(be, b->k, b->pos, R, hp->n_head_kv, hp->head_dim, &hp->rope);
    for (int i = 0; i < n_es; i++)
        if ((rc = append_kv(m, &es[i], layer, b, err))) return rc;

    /* Attention and output projection, chunk by chunk within each entry. */
    for (int i = 0; i < n_es; i++) {
        const fwd_entry *e = &es[i];
        for (int64_t r0 = e->row0; r0 < e->row0 + e->n; r0 += ROW_CHUNK) {
            const int64_t r1 = e->row0 + e->n - r0 < ROW_CHUNK ? e->row0 + e->n : r0 + ROW_CHUNK;
            if ((rc = attend_entry(m, e, layer, b, r0, r1, err))) return rc;
            if ((rc = ops->matmul(be, &L->wo, b->attn, r1 - r0, b->h, err))) return rc;
            float *x = b->x + r0 * d;
            for (int64_t j = 0; j < (r1 - r0) * d; j++) x[j] += b->h[j];
        }
    }

    /* The hook sees the layer after its attention ran over the full K/V. */
    if (opts && opts->hook) {
        const fwd_entry *e = &es[0];
        memset(b->keep, 1, (size_t)(hp->n_head_kv * e->n));
        pd_layer_kv view = {
            .layer = layer,
            .n_tokens = e->n,
            .n_head = hp->n_head,
            .n_head_kv = hp->n_head_kv,
            .head_dim = hp->head_dim,
            .pos = b->pos,
            .k_pre_rope = b->k_pre,
            .q = b->q,
            .k = b->k,
            .v = b->v,
        };
        if ((rc = opts->hook(opts->hook_ctx, &view, b->keep, err))) return rc;
        compact_kv(m, e, layer, b->keep);
    }

    /* Feed-forward. */
    for (int64_t r0 = 0; r0 < R; r0 += ROW_CHUNK) {
        const int64_t n = R - r0 < ROW_CHUNK ? R - r0 : ROW_CHUNK;
        ops->rmsnorm(be, b->x + r0 * d, L->ffn_norm, n, d, hp->rms_eps, b->h);
        if ((rc = ops->matmul(be, &L->w_gate, b->h, n, b->gate, err)) ||
            (rc = ops->matmul(be, &L->w_up, b->h, n, b->up, err)))
            return rc;
        ops->swiglu(be, b->gate, b->up, n * ff, b->gate);
        if ((rc = ops->matmul(be, &L->w_down, b->gate, n, b->h, err))) return rc;
        float *x = b->x + r0 * d;
        for (int64_t j = 0; j < n * d; j++) x[j] += b->h[j];
    }
    return PD_OK;
}

static int forward(pd_model *m, fwd_entry *es, int n_es, const pd_prefill_opts *opts, float *logits, pd_error *err) {
    const pd_hparams *hp = &m->hp;
    int64_t R = 0, n_out = 0;
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
        e->out0 = n_out;
        R += e->n;
        n_out += e->n_out;
    }
    fwd_bufs b;
    int rc = alloc_bufs(m, R, opts && opts->hook, &b, err);
    if (rc) return rc;

    const pd_backend_ops *ops = m->backend->ops;
    for (int i = 0; i < n_es; i++) {
        const fwd_entry *e = &es[i];
        if ((rc = ops->get_rows(m->backend, &m->tok_embd, e->tokens, e->n, b.x + e->row0 * hp->n_embd, err))) return rc;
        for (int64_t t = 0; t < e->n; t++) b.pos[e->row0 + t] = e->seq->next_pos + (int32_t)t;
    }

    for (int l = 0; l < hp->n_layer; l++) {
        if ((rc = run_layer(m, es, n_es, R, l, opts, &b, err))) {
            /* Leave every sequence as it was: drop this call's rows from all layers. */
            for (int i = 0; i < n_es; i++)
                for (int ll = 0; ll <= l; ll++)
                    for (int h = 0; h < hp->n_head_kv; h++) {
                        kv_stream *st = seq_stream(es[i].seq, ll, h);
                        while (st->len > 0 && st->pos[st->len - 1] >= es[i].seq->next_pos) st->len--;
                    }
            return pd_error_prefix(err, "layer %d", l);
        }
    }
    for (int i = 0; i < n_es; i++) es[i].seq->next_pos += (int32_t)es[i].n;
    if (!logits) return PD_OK;

    /* Final norm and output projection, only for the rows whose logits are wanted. */
    const int64_t d = hp->n_embd;
    for (int i = 0; i < n_es; i++) {
        const fwd_entry *e = &es[i];
        const int64_t first = e->row0 + e->n - e->n_out;
        for (int64_t r0 = 0; r0 < e->n_out; r0 += ROW_CHUNK) {
            const int64_t n = e->n_out - r0 < ROW_CHUNK ? e->n_out - r0 : ROW_CHUNK;
            ops->rmsnorm(m->backend, b.x + (first + r0) * d, m->output_norm, n, d, hp->rms_eps, b.h);
            if ((rc = ops->matmul(m->backend, &m->output, b.h, n, logits + (e->out0 + r0) * (int64_t)hp->n_vocab, err)))
                return rc;
        }
    }
    return PD_OK;
}

int pd_prefill(pd_model *m, pd_seq *s, const pd_token *tokens, int64_t n, const pd_prefill_opts *opts, float *logits,
               pd_error *err) {
    if (s->model != m) return pd_errorf(err, PD_EINVAL, "the sequence belongs to another model");
    if (n == 0) return pd_errorf(err, PD_EINVAL, "nothing to prefill: no tokens");
    fwd_entry e = {.seq = s, .tokens = tokens, .n = n, .n_out = opts && opts->logits_all ? n : 1};
    return forward(m, &e, 1, opts, logits, err);
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
        es[i] = (fwd_entry){.seq = seqs[i], .tokens = &tokens[i], .n = 1, .n_out = 1};
    }
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
