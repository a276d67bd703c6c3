/* Private to engine/: the loaded model, sequences and prefixes. */
#ifndef PD_MODEL_INTERNAL_H
#define PD_MODEL_INTERNAL_H

#include "engine/engine.h"

typedef struct layer_weights {
    const float *attn_norm; /* [n_embd] */
    pd_weight wq, wk, wv, wo;
    const float *bq, *bk, *bv; /* qwen2 biases, else NULL */
    const float *ffn_norm;
    pd_weight w_gate, w_up, w_down;
} layer_weights;

/* Scratch for one forward call, grown on demand and reused. */
typedef struct fwd_scratch {
    void *block;
    size_t bytes;
} fwd_scratch;

struct pd_model {
    pd_gguf *gguf;
    pd_tokenizer *tok;
    pd_hparams hp;
    pd_backend *backend;
    bool owns_backend;
    pd_weight tok_embd;
    pd_weight output;
    const float *output_norm;
    layer_weights *layers;
    float *norms; /* owned f32 copies of every 1-D tensor */
    float *rope_freqs;
    fwd_scratch scratch;
};

/* One (layer, kv_head) stream of cached rows. */
typedef struct kv_stream {
    float *k, *v;    /* [cap][head_dim] */
    int32_t *pos;    /* [cap] */
    uint8_t *keep;   /* NULL, or [cap] attention mask */
    int64_t len, cap;
    bool borrowed;   /* k, v, pos point into memory the stream does not own (a store's map) */
} kv_stream;

struct pd_kv_prefix {
    int32_t n_layer, n_head_kv, head_dim;
    int32_t n_orig;
    kv_stream *streams; /* [n_layer][n_head_kv] */
};

struct pd_seq {
    pd_model *model;
    const pd_kv_prefix *prefix;
    int32_t n_ctx;
    int32_t next_pos;
    kv_stream *streams; /* [n_layer][n_head_kv] */
};

/* kv.c */
int kv_stream_reserve(kv_stream *s, int64_t cap, int head_dim, pd_error *err);
void kv_stream_free(kv_stream *s);

#endif
