/* Private to engine/: the loaded model, sequences and prefixes. */
#ifndef PD_MODEL_INTERNAL_H
#define PD_MODEL_INTERNAL_H

#include <pthread.h>

#include "engine/engine.h"

/* A fused tensor (phi3's attn_qkv, its gate+up ffn_up) is loaded as views
 * of consecutive rows: wq/wk/wv and w_gate/w_up then point into it. */
typedef struct layer_weights {
    const float *attn_norm; /* [n_embd] */
    pd_weight wq, wk, wv, wo;
    const float *bq, *bk, *bv;        /* qwen2 biases, else NULL */
    const float *q_norm, *k_norm;     /* [head_dim] per-head norms (qwen3, gemma3), else NULL */
    const float *post_attn_norm;      /* gemma: norm of the attention output, else NULL */
    const float *ffn_norm;
    pd_weight w_gate, w_up, w_down;
    const float *post_ffn_norm;       /* gemma: norm of the feed-forward output, else NULL */
    int32_t window;                   /* sliding window of this layer, 0 = none */
    const pd_rope_params *rope;       /* &hp.rope or &hp.rope_swa */
} layer_weights;

/* Scratch for one forward call, grown on demand and reused: `dev` in
 * backend memory, `host` in host memory (the same kind on the CPU). */
typedef struct fwd_scratch {
    void *dev;
    size_t dev_bytes;
    void *host;
    size_t host_bytes;
} fwd_scratch;

/* The device KV pool (kv.c; pd_model_reserve_kv): n_slabs slabs of
 * slab_bytes, free ones on a stack. Guarded by lock: sequences may be
 * created and freed on any thread. */
typedef struct kv_pool {
    pthread_mutex_t lock;
    void **slabs;    /* [n_slabs] backend memory */
    void **free;     /* [n_free] of them, untaken */
    int n_slabs, n_free;
    int32_t rows;
    size_t slab_bytes;
    uint64_t no_slab, outgrown;
} kv_pool;

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
    size_t norms_len;
    float *dev_norms; /* the same in backend memory (== norms on a host backend) */
    float *rope_freqs;     /* hp.rope's divisors (and hp.rope_swa's where they are the same), or NULL */
    pd_type kv_type; /* PD_TYPE_F16 or PD_TYPE_F32: its sequences' K/V rows */
    bool no_graphs;  /* decode steps are not recorded as device graphs (pd_model_params) */
    fwd_scratch scratch;
    /* Pinned host rows the logits of a device backend come down into, all
     * of a chunk at once (forward.c; pd_backend_host_alloc). */
    float *logits_staging;
    size_t logits_staging_bytes;
    kv_pool pool;
};

/* One (layer, kv_head) stream of cached rows. A sequence's streams live in
 * its model's backend memory (k, v, dpos); positions are also kept on the
 * host (pos), where the engine reads them. The element type of k and v is
 * the owner's (the model's kv_type, or the prefix's type). */
typedef struct kv_stream {
    void *k, *v;     /* [cap][head_dim] elements */
    int32_t *pos;    /* [cap], host */
    int32_t *dpos;   /* [cap] in backend memory; NULL on a host backend (pos serves) */
    uint8_t *keep;   /* NULL, or [cap] attention mask (host backends only) */
    int64_t len, cap;
    bool borrowed;   /* k, v, pos point into memory the stream does not own (a store's map) */
    kv_pool *pool;   /* k, v, dpos lie in a slab of this pool (the sequence's), not owned */
    int64_t pos_cap; /* rows of pos, on a device stream (host ones: cap) */
} kv_stream;

/* Positions as the backend reads them. */
static inline const int32_t *kv_stream_dpos(const kv_stream *s) { return s->dpos ? s->dpos : s->pos; }

struct pd_kv_prefix {
    int32_t n_layer, n_head_kv, head_dim;
    int32_t n_orig;
    pd_type type;       /* of every stream's rows: PD_TYPE_F16 or PD_TYPE_F32 */
    kv_stream *streams; /* [n_layer][n_head_kv], host memory */
    /* A copy on a device backend, made when the prefix is first attached to
     * a sequence of a model on that backend, and shared by every sequence
     * after that. The backend must outlive the prefix. */
    pthread_mutex_t dev_lock;
    pd_backend *dev_backend;
    void *dev_block;        /* one allocation: k, v and positions of every stream */
    kv_stream *dev_streams; /* views into dev_block (pos is the host stream's) */
};

struct pd_seq {
    pd_model *model;
    const pd_kv_prefix *prefix;
    const kv_stream *prefix_streams; /* the prefix's streams in the model's backend memory */
    int32_t n_ctx;
    int32_t next_pos;
    kv_stream *streams; /* [n_layer][n_head_kv] */
    void *slab;         /* the KV pool slab its streams live in, or NULL */
};

/* Bytes of one element of a KV type. */
static inline size_t kv_elem_size(pd_type t) { return t == PD_TYPE_F16 ? 2 : 4; }

/* kv.c. `be` is the backend whose memory holds k, v and dpos; NULL or a
 * host backend means plain heap memory. row_bytes: head_dim elements. */
int kv_stream_reserve(kv_stream *s, pd_backend *be, int64_t cap, size_t row_bytes, pd_error *err);
void kv_stream_free(kv_stream *s, pd_backend *be);
/* The model's KV pool: an empty one at load, every slab released at free. */
int kv_pool_init(kv_pool *p, pd_error *err);
void kv_pool_destroy(kv_pool *p, pd_backend *be);
/* Size and allocate the slabs of pd_model_reserve_kv (model.c warms them);
 * no sequence may hold one. kv_pool_drop releases every slab. */
int kv_pool_reserve(pd_model *m, int n_seqs, int32_t n_ctx, pd_error *err);
void kv_pool_drop(kv_pool *p, pd_backend *be);

#endif
