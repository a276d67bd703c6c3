/* engine/model.h: Models and inference: loading, KV caches and prefixes, the forward pass, NLL and perplexity.
 * Part of engine's public contract (engine/engine.h includes every part). */
#ifndef PD_ENGINE_MODEL_H
#define PD_ENGINE_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/chat.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------
 * Models and inference
 *
 * A pd_model is the weights of one GGUF file (mapped, not copied) plus its
 * hyper-parameters and tokenizer; it is immutable after loading and shared
 * by every sequence. A pd_seq is one sequence's own KV cache, addressed per
 * (layer, kv_head), each with its own length and list of original positions,
 * optionally continuing a shared read-only pd_kv_prefix. Keys are cached
 * after RoPE; a kept token keeps its original position, and a sequence that
 * continues a prefix of original length n starts at position n.
 *
 * KV rows are stored as IEEE f16 by default (half the memory per token of
 * f32; pd_model_params.kv_f32 keeps f32). K and V are computed in f32 and
 * rounded once when appended; attention widens them back as it reads and
 * computes scores, softmax and the value sums in f32; queries stay f32.
 * The prefill hook still sees this call's f32 arrays.
 *
 * One pd_model may serve many sequences, but the forward functions use the
 * model's backend and scratch, so calls on one model are serialised by the
 * caller (the daemon's scheduler batches sequences into one call instead).
 * ------------------------------------------------------------------------ */

typedef enum pd_arch {
    PD_ARCH_LLAMA = 1,  /* Llama 2/3, Mistral, SmolLM2, TinyStories */
    PD_ARCH_QWEN2 = 2,  /* QKV bias, NeoX rope */
    PD_ARCH_QWEN3 = 3,  /* per-head RMS norm of Q and K before rope, NeoX rope */
    PD_ARCH_GEMMA2 = 4, /* scaled embeddings, GeGLU, post norms, windowed even layers, soft-capping */
    PD_ARCH_GEMMA3 = 5, /* gemma2 with Q/K norms, 5 windowed : 1 global layers, no soft-capping */
    PD_ARCH_PHI3 = 6,   /* fused QKV and gate/up, NeoX rope, every layer windowed */
} pd_arch;

typedef struct pd_hparams {
    pd_arch arch;
    char arch_name[32];
    int32_t n_vocab;
    int32_t n_ctx_train;
    int32_t n_embd;
    int32_t n_layer;
    int32_t n_head;
    int32_t n_head_kv;
    int32_t head_dim;
    int32_t n_ff;
    float rms_eps;
    pd_rope_params rope;  /* freq_factors (model-owned) folds in llama3 and linear scaling */
    /* Sliding-window attention: a layer is windowed when n_swa > 0 and
     * swa_period is 1 (every layer) or (layer + 1) % swa_period != 0
     * (gemma2: 2, the even layers; gemma3: 6). Windowed layers rope with
     * rope_swa (gemma3: base 10000, unscaled; otherwise equal to rope). */
    int32_t n_swa;
    int32_t swa_period;
    pd_rope_params rope_swa;
    float embd_scale;      /* token embeddings are multiplied by it (gemma: sqrt(n_embd)) */
    float attn_scale;      /* query scale of the attention scores */
    float attn_softcap;    /* 0 = none, else scores s -> c tanh(s / c) (gemma2) */
    float final_softcap;   /* the same for the logits */
    bool tied_output;      /* output matrix is token_embd */
    pd_type wtype;         /* type of most 2-D weights (informational) */
} pd_hparams;

/* Whether layer `layer` attends through a sliding window of hp->n_swa. */
static inline bool pd_hparams_layer_windowed(const pd_hparams *hp, int layer) {
    return hp->n_swa > 0 && (hp->swa_period <= 1 || (layer + 1) % hp->swa_period != 0);
}

typedef struct pd_model pd_model;

typedef struct pd_model_params {
    int n_threads;         /* CPU threads; <= 0 = all CPUs */
    pd_backend *backend;   /* use this backend (not owned; it must outlive the model and every
                              prefix attached to the model's sequences); NULL = a CPU backend */
    bool kv_f32;           /* keep KV rows in f32; false (the default, and NULL params): f16 */
    bool mmap_weights;     /* CPU: map the file instead of reading it into memory (faster start,
                              pages shared with other processes, slower decode: pd_gguf_load) */
    bool no_graphs;        /* run decode steps op by op; false (the default): a backend with device
                              graphs (CUDA) records each step and launches it as one graph */
} pd_model_params;

int pd_model_load(const char *path, const pd_model_params *params, pd_model **out, pd_error *err);
void pd_model_free(pd_model *m);
const pd_hparams *pd_model_hparams(const pd_model *m);
const pd_tokenizer *pd_model_tokenizer(const pd_model *m);
const pd_gguf *pd_model_gguf(const pd_model *m);
/* The backend the model computes on (CPU, or a CUDA device). */
pd_backend *pd_model_backend(const pd_model *m);
/* Element type of its sequences' KV rows: PD_TYPE_F16 or PD_TYPE_F32. */
pd_type pd_model_kv_type(const pd_model *m);
/* SHA-256 model fingerprint (see pd_gguf_fingerprint). */
void pd_model_fingerprint(const pd_model *m, uint8_t out[PD_SHA256_LEN]);

/* A shared, read-only KV prefix: for every (layer, kv_head) the kept
 * positions and their post-RoPE K and V rows, plus the original length n.
 * Its rows have one element type (PD_TYPE_F16 or PD_TYPE_F32), chosen at
 * creation; a sequence attends to a prefix of either type whatever its
 * own KV type. */
typedef struct pd_kv_prefix pd_kv_prefix;

/* type: PD_TYPE_F16 or PD_TYPE_F32 (PD_EINVAL otherwise). */
int pd_kv_prefix_create(const pd_hparams *hp, int32_t n_orig, pd_type type, pd_kv_prefix **out, pd_error *err);
/* Set one stream from f32 rows (copied, rounded to f16 for an f16
 * prefix). Positions must be strictly increasing and < n_orig. */
int pd_kv_prefix_set(pd_kv_prefix *p, int layer, int kv_head, const int32_t *pos, const float *k,
                     const float *v, int64_t len, pd_error *err);
/* Set one stream without copying: k and v hold rows of the prefix's type
 * (aligned to its element size, pos to 4 bytes) and, with pos, must stay
 * valid and unchanged until the stream is replaced or the prefix freed —
 * for example rows inside a store's memory map. Same checks as _set. */
int pd_kv_prefix_set_borrowed(pd_kv_prefix *p, int layer, int kv_head, const int32_t *pos, const void *k,
                              const void *v, int64_t len, pd_error *err);
/* A deep copy with owned rows (of the same type), e.g. of a borrowing one. */
int pd_kv_prefix_clone(const pd_kv_prefix *p, pd_kv_prefix **out, pd_error *err);
void pd_kv_prefix_free(pd_kv_prefix *p);
int32_t pd_kv_prefix_n_orig(const pd_kv_prefix *p);
/* The element type of its rows. */
pd_type pd_kv_prefix_type(const pd_kv_prefix *p);
/* The shape the prefix was created for. */
void pd_kv_prefix_shape(const pd_kv_prefix *p, int32_t *n_layer, int32_t *n_head_kv, int32_t *head_dim);
/* Read access to one stream as stored: rows are head_dim elements of
 * pd_kv_prefix_type(p). Returns the row count. */
int64_t pd_kv_prefix_stream(const pd_kv_prefix *p, int layer, int kv_head, const int32_t **pos,
                            const void **k, const void **v);
/* The same stream's rows widened to f32 into k and v (NULL: skipped), each
 * room for len * head_dim floats. Returns the row count. */
int64_t pd_kv_prefix_stream_f32(const pd_kv_prefix *p, int layer, int kv_head, float *k, float *v);
/* Total kept (layer, head, token) rows, and the same if nothing were dropped. */
int64_t pd_kv_prefix_kept_rows(const pd_kv_prefix *p);
/* Bytes of its kept rows: K and V in its type plus the 4-byte positions. */
uint64_t pd_kv_prefix_bytes(const pd_kv_prefix *p);

typedef struct pd_seq pd_seq;

/* n_ctx: the highest position + 1 the sequence may reach; 0 = the model's
 * trained context. */
int pd_seq_create(pd_model *m, int32_t n_ctx, pd_seq **out, pd_error *err);
void pd_seq_free(pd_seq *s);
/* Continue a shared prefix; the sequence must be empty. The prefix must
 * outlive the sequence. The next position becomes prefix->n_orig. */
int pd_seq_attach_prefix(pd_seq *s, const pd_kv_prefix *p, pd_error *err);
/* The next position (prefix length + own tokens). */
int32_t pd_seq_pos(const pd_seq *s);
/* Own cached rows of one (layer, kv_head) stream. */
int64_t pd_seq_stream_len(const pd_seq *s, int layer, int kv_head);
/* Bytes of the sequence's own cached rows (every stream's K and V in the
 * model's KV type plus the 4-byte positions; a prefix and spare capacity
 * are not counted). */
uint64_t pd_seq_kv_bytes(const pd_seq *s);
/* Snapshot the sequence's own cache as a prefix (deep copy, in the model's
 * KV type). The sequence must not have a prefix attached; n_orig =
 * pd_seq_pos(s). */
int pd_seq_to_prefix(const pd_seq *s, pd_kv_prefix **out, pd_error *err);
/* Room for n_tokens own rows in every stream, allocated now (one
 * allocation each instead of growing by doubling as rows arrive; nothing
 * on the device when the sequence holds a KV pool slab that fits). */
int pd_seq_reserve(pd_seq *s, int32_t n_tokens, pd_error *err);

/* The device KV pool (docs/gpu.md, Memory). On a device backend, reserve
 * n_seqs slabs of backend memory, each one allocation holding every
 * (layer, kv head) stream of one sequence (K, V and positions) for n_ctx
 * positions (0 = the model's trained context): pd_seq_create takes a free
 * slab and pd_seq_free returns it, so a sequence never grows on the device
 * and serving allocates nothing. The pool takes at most PD_KV_POOL_FRACTION
 * of the backend's free memory; when n_ctx rows per slab do not fit, slabs
 * hold fewer rows (a multiple of 64, at least 64, else PD_ENOMEM) and a
 * stream that outgrows its slab, or a sequence that finds no free slab,
 * grows by allocation as on a pool-less model (counted in
 * pd_kv_pool_stats). With warm_tokens > 0 it then runs a throwaway prefill
 * of warm_tokens tokens and a decode of n_seqs sequences, so the scratch
 * buffers reach the size serving's calls need (prefill calls of at most
 * warm_tokens tokens, decodes of at most n_seqs); attention's partials,
 * which grow with the context, grow through the allocator's cache once. 
 * A no-op on host backends. No sequence may hold a slab when it is called
 * again (the old pool is dropped first). */
#define PD_KV_POOL_FRACTION 0.8
int pd_model_reserve_kv(pd_model *m, int n_seqs, int32_t n_ctx, int32_t warm_tokens, pd_error *err);
typedef struct pd_kv_pool_stats {
    int slabs, slabs_free;
    int32_t rows;         /* positions each slab holds per stream */
    uint64_t bytes;       /* backend memory of all slabs */
    uint64_t no_slab;     /* sequences created with every slab taken */
    uint64_t outgrown;    /* streams that grew out of their slab */
} pd_kv_pool_stats;
/* Zeros when no pool is reserved. */
void pd_model_kv_pool_stats(pd_model *m, pd_kv_pool_stats *out);

/* Exact KV reuse (the daemon's automatic prefix cache). A token block is
 * the K and V rows of n consecutive positions for every stream, laid out
 * [layer][kv_head][K rows n x head_dim, then V rows n x head_dim] in the
 * model's KV type: pd_model_kv_token_bytes(m) * n bytes. */
size_t pd_model_kv_token_bytes(const pd_model *m);
/* Copy the own rows of positions [pos0, pos0 + n) out as a token block.
 * PD_EINVAL unless every stream holds exactly those positions, unmasked
 * (no prefix attached, nothing evicted by a prefill hook). */
int pd_seq_export_kv(const pd_seq *s, int32_t pos0, int32_t n, void *block, pd_error *err);
/* Append the first n positions of a token block of block_tokens positions
 * (n <= block_tokens: a block's first rows are those positions' exact KV)
 * at positions pd_seq_pos(s) .. + n - 1, as if those tokens had been
 * prefilled. The sequence must have no prefix and every stream must hold
 * all its positions so far (PD_EINVAL otherwise). */
int pd_seq_import_kv(pd_seq *s, const void *block, int32_t block_tokens, int32_t n, pd_error *err);
/* Mask rows of the sequence's own stream out of attention (keep[i] = 0 hides
 * row i) without removing them; NULL clears the mask. For evaluating
 * eviction against masking. */
int pd_seq_set_mask(pd_seq *s, int layer, int kv_head, const uint8_t *keep, int64_t len, pd_error *err);

/* What the prefill hook sees for one layer: this call's tokens only. */
typedef struct pd_layer_kv {
    int layer;
    int64_t n_tokens;
    int n_head, n_head_kv, head_dim;
    const int32_t *pos;       /* [n_tokens] */
    const float *k_pre_rope;  /* [n_tokens][n_head_kv][head_dim] */
    const float *q;           /* [n_tokens][n_head][head_dim], after RoPE */
    const float *k;           /* [n_tokens][n_head_kv][head_dim], after RoPE */
    const float *v;           /* [n_tokens][n_head_kv][head_dim] */
    /* The same four arrays in the model's backend memory (equal to the host
     * pointers on a host-memory backend), for scorers that run on the
     * backend (pd_backend_token_scores). With pd_prefill_opts.hook_device_only
     * on a device backend, the host arrays above are NULL (pos stays). */
    pd_backend *backend;
    const float *dev_k_pre_rope, *dev_q, *dev_k, *dev_v;
} pd_layer_kv;

/* Called once per layer after that layer's attention has run over all of the
 * call's tokens. `keep` is [n_head_kv][n_tokens], all 1 on entry; setting an
 * entry to 0 evicts that token from that kv head's cache for this layer. The
 * layer's own output is computed from the full K/V either way, so eviction
 * only changes what later tokens attend to. */
typedef int (*pd_prefill_hook_fn)(void *ctx, const pd_layer_kv *layer, uint8_t *keep, pd_error *err);

typedef struct pd_prefill_opts {
    bool logits_all;          /* logits for every token, not only the last */
    pd_prefill_hook_fn hook;  /* optional */
    void *hook_ctx;
    /* The hook reads only the dev_* arrays: skip copying the layer's
     * q/k/v to the host on a device backend. */
    bool hook_device_only;
} pd_prefill_opts;

/* Run n tokens of one sequence. logits: n_vocab floats (the last token) or
 * n * n_vocab with logits_all; may be NULL. */
int pd_prefill(pd_model *m, pd_seq *s, const pd_token *tokens, int64_t n, const pd_prefill_opts *opts,
               float *logits, pd_error *err);
/* One step for n_seqs sequences at once (one token each); logits is
 * [n_seqs][n_vocab]. A sequence may appear only once. */
int pd_decode(pd_model *m, pd_seq *const *seqs, const pd_token *tokens, int n_seqs, float *logits,
              pd_error *err);
/* Mean negative log-likelihood (nats/token) of `text` following `context`
 * (and the prefix, if given). The first text token is predicted from the
 * last context token; with a prefix and an empty context it is fed but not
 * scored (a prefix keeps K/V, not its last token's logits). */
int pd_nll(pd_model *m, const pd_kv_prefix *prefix, const pd_token *context, int64_t n_context,
           const pd_token *text, int64_t n_text, double *mean_nll, pd_error *err);

/* Perplexity as llama.cpp's llama-perplexity (b4748) measures it, so the two
 * can be compared. `tokens` is the whole text tokenized at once with
 * add_special (BOS first when the vocabulary adds it) and no special-token
 * parsing. It is cut into n_tokens / n_ctx chunks of n_ctx tokens (at most
 * max_chunks; the tail is ignored); each chunk is evaluated alone from
 * position 0 with its first token replaced by BOS when the vocabulary adds
 * BOS, and only its second half is scored: the logits at positions
 * n_ctx/2 .. n_ctx-2 predict the next token, n_ctx - n_ctx/2 - 1 tokens per
 * chunk. The result is exp(mean NLL over all scored tokens). */
#define PD_PPL_MIN_CTX 3

typedef struct pd_ppl_opts {
    int32_t n_ctx;      /* chunk length: PD_PPL_MIN_CTX .. the model's training context */
    int32_t max_chunks; /* 0 = every whole chunk */
    /* Called after each chunk with the perplexity so far (may be NULL). */
    void (*progress)(void *ctx, int32_t chunks_done, double ppl_so_far);
    void *progress_ctx;
} pd_ppl_opts;

typedef struct pd_ppl_result {
    int64_t n_tokens;  /* of the whole text */
    int32_t n_chunks;  /* evaluated */
    int64_t n_scored;  /* tokens scored */
    double mean_nll;   /* nats per scored token */
    double ppl;        /* exp(mean_nll) */
    double ppl_err;    /* llama-perplexity's "+/-": ppl x the standard error of the mean NLL */
} pd_ppl_result;

/* PD_EINVAL: a text shorter than 2 x n_ctx tokens, n_ctx below
 * PD_PPL_MIN_CTX, a vocabulary that appends EOS; PD_ERANGE: n_ctx above the
 * training context. */
int pd_perplexity(pd_model *m, const pd_token *tokens, int64_t n_tokens, const pd_ppl_opts *opts, pd_ppl_result *out,
                  pd_error *err);

#ifdef __cplusplus
}
#endif
#endif
