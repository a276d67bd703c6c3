/* engine: model files, tokenizers and (later) the forward pass.
 *
 * This header is the folder's public contract. Nothing outside engine/
 * includes engine's private headers. */
#ifndef PD_ENGINE_H
#define PD_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/kernels.h"
#include "util/util.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------
 * GGUF reader
 *
 * The file is mmap'd; strings and array payloads point into the mapping and
 * stay valid until pd_gguf_close(). Every count, length, offset and type read
 * from the file is checked against the file size before use, so a malformed
 * file yields PD_EFORMAT with a message naming the field and byte offset.
 * ------------------------------------------------------------------------ */

#define PD_GGUF_MAGIC 0x46554747u /* "GGUF" little-endian */
#define PD_GGUF_DEFAULT_ALIGNMENT 32
#define PD_GGUF_MAX_DIMS 4
#define PD_GGUF_MAX_ARRAY_DEPTH 8 /* nested arrays deeper than this are refused */

typedef enum pd_gguf_vtype {
    PD_GGUF_UINT8 = 0,
    PD_GGUF_INT8 = 1,
    PD_GGUF_UINT16 = 2,
    PD_GGUF_INT16 = 3,
    PD_GGUF_UINT32 = 4,
    PD_GGUF_INT32 = 5,
    PD_GGUF_FLOAT32 = 6,
    PD_GGUF_BOOL = 7,
    PD_GGUF_STRING = 8,
    PD_GGUF_ARRAY = 9,
    PD_GGUF_UINT64 = 10,
    PD_GGUF_INT64 = 11,
    PD_GGUF_FLOAT64 = 12,
    PD_GGUF_VTYPE_COUNT = 13
} pd_gguf_vtype;

const char *pd_gguf_vtype_name(pd_gguf_vtype t);

/* A length-delimited string inside the mapping (not NUL-terminated). */
typedef struct pd_str {
    const char *ptr;
    uint64_t len;
} pd_str;

typedef struct pd_gguf_value pd_gguf_value;
struct pd_gguf_value {
    pd_gguf_vtype type;
    union {
        uint64_t u;  /* UINT8/16/32/64, BOOL (0/1) */
        int64_t i;   /* INT8/16/32/64 */
        double f;    /* FLOAT32/64 */
        pd_str str;  /* STRING */
        struct {
            pd_gguf_vtype elem_type;
            uint64_t n;
            /* Fixed-size elements: raw little-endian payload, possibly
             * unaligned; read with the pd_gguf_arr_* accessors. */
            const uint8_t *data;
            /* STRING elements: n entries. */
            const pd_str *strs;
            /* ARRAY elements: n nested values. */
            const pd_gguf_value *items;
        } arr;
    };
};

typedef struct pd_gguf_kv {
    char *key; /* NUL-terminated copy */
    pd_gguf_value value;
} pd_gguf_kv;

typedef struct pd_gguf_tensor {
    char *name; /* NUL-terminated copy */
    uint32_t n_dims;
    uint64_t ne[PD_GGUF_MAX_DIMS]; /* ne[0] is the contiguous dimension; unused dims are 1 */
    pd_type type;
    uint64_t offset;  /* relative to the start of the data section */
    uint64_t n_elems;
    uint64_t n_bytes;
    const uint8_t *data; /* inside the mapping */
} pd_gguf_tensor;

typedef struct pd_gguf pd_gguf;

/* Open and validate a GGUF v2/v3 file, mapped from the page cache. */
int pd_gguf_open(const char *path, pd_gguf **out, pd_error *err);
/* The same, read into private huge-page memory (pd_load_file): what the
 * CPU computes from, since decode streams the weights at memory speed. */
int pd_gguf_load(const char *path, pd_gguf **out, pd_error *err);
/* Parse a GGUF image already in memory (not copied; must outlive the handle).
 * Used by the fuzzer and by tests. */
int pd_gguf_open_memory(const void *data, size_t size, pd_gguf **out, pd_error *err);
void pd_gguf_close(pd_gguf *g);

uint32_t pd_gguf_version(const pd_gguf *g);
uint64_t pd_gguf_alignment(const pd_gguf *g);
uint64_t pd_gguf_data_offset(const pd_gguf *g); /* file offset of the data section */
uint64_t pd_gguf_file_size(const pd_gguf *g);

size_t pd_gguf_kv_count(const pd_gguf *g);
const pd_gguf_kv *pd_gguf_kv_at(const pd_gguf *g, size_t i);
/* NULL when absent. */
const pd_gguf_value *pd_gguf_find(const pd_gguf *g, const char *key);

size_t pd_gguf_tensor_count(const pd_gguf *g);
const pd_gguf_tensor *pd_gguf_tensor_at(const pd_gguf *g, size_t i);
const pd_gguf_tensor *pd_gguf_find_tensor(const pd_gguf *g, const char *name);

/* Typed getters. They return PD_ENOTFOUND if the key is absent and
 * PD_EFORMAT if it has an incompatible type or an out-of-range value
 * (integers convert between widths when the value fits). */
int pd_gguf_get_u64(const pd_gguf *g, const char *key, uint64_t *out, pd_error *err);
int pd_gguf_get_u32(const pd_gguf *g, const char *key, uint32_t *out, pd_error *err);
int pd_gguf_get_i64(const pd_gguf *g, const char *key, int64_t *out, pd_error *err);
int pd_gguf_get_f32(const pd_gguf *g, const char *key, float *out, pd_error *err);
int pd_gguf_get_bool(const pd_gguf *g, const char *key, bool *out, pd_error *err);
int pd_gguf_get_str(const pd_gguf *g, const char *key, pd_str *out, pd_error *err);
/* Array of the given element type (PD_GGUF_ARRAY key). */
int pd_gguf_get_arr(const pd_gguf *g, const char *key, pd_gguf_vtype elem_type,
                    const pd_gguf_value **out, pd_error *err);

/* Element accessors for fixed-size arrays (caller checks i < n and type). */
float pd_gguf_arr_f32(const pd_gguf_value *arr, uint64_t i);
int32_t pd_gguf_arr_i32(const pd_gguf_value *arr, uint64_t i);
/* Any integer element type, widened. */
int64_t pd_gguf_arr_int(const pd_gguf_value *arr, uint64_t i);

/* Model fingerprint: SHA-256 over the header, metadata and tensor table bytes
 * exactly as stored (not the weights): cheap and stable across runs. */
void pd_gguf_fingerprint(const pd_gguf *g, uint8_t out[PD_SHA256_LEN]);

/* Print metadata and tensor table in a human-readable form (prefixctl inspect).
 * Long arrays are abbreviated to their first `max_array_items` items. */
void pd_gguf_print(const pd_gguf *g, void *file /* FILE* */, size_t max_array_items);

/* ------------------------------------------------------------------------
 * GGUF writer (test models, tools)
 *
 * Collects metadata and tensors in memory, then writes a v3 file with the
 * requested alignment. Keys and tensor names are copied.
 * ------------------------------------------------------------------------ */

typedef struct pd_gguf_writer pd_gguf_writer;

int pd_gguf_writer_new(pd_gguf_writer **out, pd_error *err);
void pd_gguf_writer_free(pd_gguf_writer *w);
int pd_gguf_writer_set_u32(pd_gguf_writer *w, const char *key, uint32_t v, pd_error *err);
int pd_gguf_writer_set_i32(pd_gguf_writer *w, const char *key, int32_t v, pd_error *err);
int pd_gguf_writer_set_u64(pd_gguf_writer *w, const char *key, uint64_t v, pd_error *err);
int pd_gguf_writer_set_f32(pd_gguf_writer *w, const char *key, float v, pd_error *err);
int pd_gguf_writer_set_bool(pd_gguf_writer *w, const char *key, bool v, pd_error *err);
int pd_gguf_writer_set_str(pd_gguf_writer *w, const char *key, const char *v, pd_error *err);
/* Array of fixed-size elements (elem_type not STRING/ARRAY), n elements of
 * native little-endian data. */
int pd_gguf_writer_set_arr(pd_gguf_writer *w, const char *key, pd_gguf_vtype elem_type,
                           const void *data, uint64_t n, pd_error *err);
/* Array of strings given as pd_str (lengths explicit, so NUL bytes survive). */
int pd_gguf_writer_set_arr_str(pd_gguf_writer *w, const char *key, const pd_str *strs,
                               uint64_t n, pd_error *err);
/* Copy one key (any type, nested arrays included) from an open file. */
int pd_gguf_writer_copy_kv(pd_gguf_writer *w, const pd_gguf_kv *kv, pd_error *err);
/* Add a tensor; `data` holds n_bytes of already-encoded data of `type` and is
 * copied. ne has n_dims entries (ne[0] contiguous). */
int pd_gguf_writer_add_tensor(pd_gguf_writer *w, const char *name, pd_type type,
                              uint32_t n_dims, const uint64_t *ne, const void *data,
                              pd_error *err);
/* Add a tensor whose bytes are produced at write time, so multi-gigabyte
 * models are streamed to disk instead of held in memory. `fill` must write
 * exactly n_bytes (the encoded size of the tensor) into dst. */
typedef int (*pd_gguf_fill_fn)(void *ctx, const char *name, void *dst, uint64_t n_bytes,
                               pd_error *err);
int pd_gguf_writer_add_tensor_lazy(pd_gguf_writer *w, const char *name, pd_type type,
                                   uint32_t n_dims, const uint64_t *ne, pd_gguf_fill_fn fill,
                                   void *ctx, pd_error *err);
/* Write the file (atomically: temp file + rename). alignment 0 = default 32. */
int pd_gguf_writer_write(pd_gguf_writer *w, const char *path, uint32_t alignment, pd_error *err);

/* ------------------------------------------------------------------------
 * Tokenizer
 *
 * Built from a GGUF file's tokenizer.ggml.* metadata. Supports
 * tokenizer.ggml.model = "llama" (SentencePiece BPE with byte fallback),
 * "gpt2" (byte-level BPE with the pre-tokenizer named by tokenizer.ggml.pre)
 * and "bert" (WordPiece). Results match llama.cpp's tokenizer.
 * ------------------------------------------------------------------------ */

typedef int32_t pd_token;
#define PD_TOKEN_NULL (-1)

typedef enum pd_vocab_kind {
    PD_VOCAB_SPM = 1,  /* tokenizer.ggml.model = llama */
    PD_VOCAB_BPE = 2,  /* gpt2 */
    PD_VOCAB_WPM = 3,  /* bert */
} pd_vocab_kind;

/* tokenizer.ggml.token_type values */
typedef enum pd_token_type {
    PD_TOKEN_TYPE_UNDEFINED = 0,
    PD_TOKEN_TYPE_NORMAL = 1,
    PD_TOKEN_TYPE_UNKNOWN = 2,
    PD_TOKEN_TYPE_CONTROL = 3,
    PD_TOKEN_TYPE_USER_DEFINED = 4,
    PD_TOKEN_TYPE_UNUSED = 5,
    PD_TOKEN_TYPE_BYTE = 6,
} pd_token_type;

typedef struct pd_tokenizer pd_tokenizer;

/* Build from an open GGUF (the tokenizer copies what it needs, so the GGUF
 * may be closed afterwards). */
int pd_tokenizer_load(const pd_gguf *g, pd_tokenizer **out, pd_error *err);
void pd_tokenizer_free(pd_tokenizer *t);

pd_vocab_kind pd_tokenizer_kind(const pd_tokenizer *t);
/* The pre-tokenizer name in effect ("default", "llama3", "qwen2", ...). */
const char *pd_tokenizer_pre(const pd_tokenizer *t);
int32_t pd_tokenizer_n_vocab(const pd_tokenizer *t);
pd_token pd_tokenizer_bos(const pd_tokenizer *t); /* PD_TOKEN_NULL if none */
pd_token pd_tokenizer_eos(const pd_tokenizer *t);
/* End-of-turn token (tokenizer.ggml.eot_token_id, or found by its text:
 * "<|eot_id|>", "<|im_end|>", "<|end|>", ...); PD_TOKEN_NULL if none. */
pd_token pd_tokenizer_eot(const pd_tokenizer *t);
/* True for tokens that end generation: EOS, EOT, EOM and llama.cpp's
 * end-of-generation set ("<|eot_id|>", "<|im_end|>", "<|endoftext|>", ...). */
bool pd_tokenizer_is_eog(const pd_tokenizer *t, pd_token id);
bool pd_tokenizer_add_bos(const pd_tokenizer *t); /* tokenizer.ggml.add_bos_token (or kind default) */
bool pd_tokenizer_add_eos(const pd_tokenizer *t);
/* Raw token text as stored in the vocab (NULL if out of range). */
const char *pd_tokenizer_token_text(const pd_tokenizer *t, pd_token id);
pd_token_type pd_tokenizer_token_type(const pd_tokenizer *t, pd_token id);
/* Exact match of a token's stored text (e.g. "<|im_start|>"); PD_TOKEN_NULL if absent. */
pd_token pd_tokenizer_find(const pd_tokenizer *t, const char *text, size_t len);

typedef struct pd_tokenize_opts {
    bool add_special;   /* add BOS/EOS as the vocab asks (add_bos/add_eos) */
    bool parse_special; /* recognise control tokens written as text, e.g. "<|im_end|>" */
} pd_tokenize_opts;

/* Tokenize len bytes of text. On success *out is a malloc'd array of *n_out
 * ids (the caller frees it; may be NULL when *n_out is 0). */
int pd_tokenize(const pd_tokenizer *t, const char *text, size_t len, pd_tokenize_opts opts,
                pd_token **out, size_t *n_out, pd_error *err);

/* Bytes of one token as it appears in text (byte tokens become their byte,
 * "▁" becomes a space for SPM, byte-level BPE is decoded to raw bytes).
 * Control tokens render as their text only when `special` is set.
 * Writes up to cap bytes; returns the full length (like snprintf), or a
 * negative status for an invalid id. */
int pd_token_to_piece(const pd_tokenizer *t, pd_token id, bool special, char *buf, size_t cap);

/* Decode ids to exact bytes. Pieces are concatenated as raw bytes, so a
 * UTF-8 character split across tokens comes out whole. The leading space
 * SPM adds is removed when `remove_leading_space` is set (from the first
 * token after any leading control tokens such as BOS). Like llama.cpp's
 * llama_detokenize, vocabs with clean_up_tokenization_spaces (gpt-2, llama3,
 * bert, ...; not qwen2/deepseek/smollm) then drop the space in " ,", " .",
 * " !", " ?", " 's", " 'm", " 're", " 've" and " ' "; concatenated
 * pd_token_to_piece output does not. Invalid ids give PD_EINVAL. Result is
 * malloc'd and NUL-terminated; *len_out excludes the NUL. */
int pd_detokenize(const pd_tokenizer *t, const pd_token *ids, size_t n, bool special,
                  bool remove_leading_space, char **out, size_t *len_out, pd_error *err);

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
     * backend (ops->compactor_scores). With pd_prefill_opts.hook_device_only
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

/* ------------------------------------------------------------------------
 * Chat templates
 *
 * prefixd does not run Jinja: it recognises the common template families
 * from the model's `tokenizer.chat_template` text and renders them itself.
 * Rendered text carries special tokens as text ("<|im_start|>"), so tokenize
 * it with parse_special; it does NOT start with the BOS token — tokenize
 * with add_special so the vocabulary adds BOS as it asks.
 * ------------------------------------------------------------------------ */

typedef enum pd_chat_family {
    PD_CHAT_NONE = 0,  /* no template, or one we do not recognise */
    PD_CHAT_CHATML,    /* <|im_start|>role\n...<|im_end|>\n (Qwen2, SmolLM2, ...) */
    PD_CHAT_LLAMA3,    /* <|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|> */
    PD_CHAT_LLAMA2,    /* [INST] <<SYS>>\n...\n<</SYS>>\n\nuser [/INST]answer</s><s>[INST] ... */
    PD_CHAT_MISTRAL,   /* [INST] user [/INST]answer</s>[INST] ..., system folded into the first user turn */
    PD_CHAT_ZEPHYR,    /* <|system|>\n...</s>\n<|user|>\n...</s>\n<|assistant|>\n */
    PD_CHAT_PHI3,      /* <|system|>\n...<|end|>\n<|user|>\n...<|end|>\n<|assistant|>\n */
    PD_CHAT_GEMMA,     /* <start_of_turn>user\n...<end_of_turn>\n<start_of_turn>model\n, system folded into the first user turn */
    PD_CHAT_QWEN3,     /* ChatML with thinking off: the generation prompt ends in an empty <think></think> block */
    PD_CHAT_FAMILY_COUNT
} pd_chat_family;

typedef struct pd_chat_message {
    const char *role;    /* "system", "user" or "assistant" */
    const char *content; /* UTF-8, NUL-terminated */
} pd_chat_message;

/* The family of a template text (NULL or unrecognised: PD_CHAT_NONE). */
pd_chat_family pd_chat_detect(const char *template_text, size_t len);
/* The model's family from its GGUF `tokenizer.chat_template`; PD_CHAT_NONE
 * too when the vocabulary lacks a control token the family renders. */
pd_chat_family pd_model_chat_family(const pd_model *m);
const char *pd_chat_family_name(pd_chat_family f);       /* "chatml", ... "none"; "unknown" if out of range */
bool pd_chat_family_from_name(const char *name, pd_chat_family *out);

/* Render a conversation. With add_generation_prompt the text ends with the
 * assistant turn's opening, ready for generation. *system_len is the length
 * of the leading part of the text that depends only on the leading system
 * message(s) (0 without one): the part to look up as a stored prefix.
 * Errors (PD_EINVAL): no messages, an unknown role, a system message after
 * the first turn where the family cannot place it, PD_CHAT_NONE. *out is
 * malloc'd and NUL-terminated; len and system_len may be NULL. */
int pd_chat_render(pd_chat_family f, const pd_chat_message *msgs, size_t n, bool add_generation_prompt, char **out,
                   size_t *len, size_t *system_len, pd_error *err);

/* ------------------------------------------------------------------------
 * Sampler
 *
 * One sampler per sequence. It turns a vector of n_vocab logits into one
 * token. The chain, in this order:
 *
 *   1. logit bias     x[t] += bias; a bias <= -100 (PD_LOGIT_BIAS_BAN, or
 *                     -INFINITY) bans the token (x[t] = -inf). Several
 *                     entries for one token add up.
 *   2. penalties      a. repetition (llama.cpp / CTRL): every distinct token
 *                        among the last penalty_last_n accepted tokens
 *                        (prompt and generated): x > 0 ? x / r : x * r.
 *                     b. presence / frequency (OpenAI), over the tokens
 *                        accepted as generated since creation or reset:
 *                        x -= presence * (count > 0) + frequency * count.
 *   -- the result is the "adjusted logits" (pd_sampler_adjust) --
 *   3. temperature 0: greedy: argmax of the adjusted logits, ties broken
 *      towards the lowest token id. Steps 4-8 are skipped and no random
 *      number is drawn. Otherwise:
 *   4. temperature    p ~ exp(x / T)
 *   5. top-k          keep the k highest (ties: lowest ids)
 *   6. top-p          keep the shortest prefix of the survivors, sorted by
 *                     probability (renormalised over the survivors), whose
 *                     cumulative probability reaches top_p (at least one)
 *   7. min-p          keep survivors with p >= min_p * p_max
 *   8. draw           one token from the survivors, with probability
 *                     proportional to exp(x / T), from the sampler's own
 *                     xoshiro256** generator (seeded by splitmix64).
 *
 * Log-probabilities (when asked for) come from ONE distribution, the same
 * one OpenAI reports: log-softmax of the adjusted logits (after bias and
 * penalties; BEFORE temperature, top-k, top-p and min-p). So the chosen
 * token's logprob does not depend on temperature or truncation, a banned
 * token has logprob -inf, and exp(logprob) over all tokens sums to 1.
 *
 * Determinism: for the same params (seed included), the same sequence of
 * accept calls and the same logits, sample returns the same tokens on every
 * run and machine with IEEE floats. Ordering ties are always broken by the
 * lowest token id, never by memory layout.
 *
 * Cost: no allocation per sample call; scratch is sized at creation. No
 * sort of the vocabulary: greedy is one pass over the logits; top-k <= 256
 * is one pass with a heap, larger k a radix selection (O(n_vocab)); top-p
 * over the whole vocabulary selects among the tokens that can matter
 * (weight >= (1-top_p) Z / (2 n_vocab)) by radix selection on probability
 * mass; exponentials are a 4-lane SIMD polynomial (own code, so results do
 * not depend on the C library). On one x86 core at n_vocab = 151936: greedy
 * ~0.08 ms, top-k 40 ~0.09 ms, plain temperature ~0.26 ms, top-p 0.95
 * 0.3-0.8 ms, logprobs add ~0.2 ms. Memory: 4 to 24 bytes per vocabulary
 * entry, depending on which features the params enable.
 * ------------------------------------------------------------------------ */

#define PD_SAMPLER_MAX_LOGPROBS 20      /* top alternatives per token, like OpenAI */
#define PD_SAMPLER_MAX_LAST_N (1 << 20) /* largest penalty_last_n */
#define PD_SAMPLER_SEED_RANDOM UINT64_MAX /* seed from the OS (getrandom) at creation */
#define PD_LOGIT_BIAS_BAN (-100.0f)     /* biases at or below this ban the token */

typedef struct pd_logit_bias {
    pd_token token;
    float bias; /* [-100, 100] or -INFINITY */
} pd_logit_bias;

typedef struct pd_sampler_params {
    float temperature;        /* >= 0 (finite); 0 = greedy. Default 1 */
    int32_t top_k;            /* >= 0; 0 = off (values >= n_vocab are off too). Default 0 */
    float top_p;              /* (0, 1]; 1 = off. Default 1 */
    float min_p;              /* [0, 1]; 0 = off. Default 0 */
    uint64_t seed;            /* PD_SAMPLER_SEED_RANDOM = pick one (see pd_sampler_seed). Default random */
    float presence_penalty;   /* [-2, 2]; 0 = off */
    float frequency_penalty;  /* [-2, 2]; 0 = off */
    float repetition_penalty; /* > 0 (finite); 1 = off. Default 1 */
    int32_t penalty_last_n;   /* window of the repetition penalty: > 0 that many tokens,
                                 -1 every token accepted since creation/reset, 0 off.
                                 At most PD_SAMPLER_MAX_LAST_N. Default 64 */
    const pd_logit_bias *logit_bias; /* copied by pd_sampler_create */
    size_t n_logit_bias;
    bool logprobs;            /* fill pd_sample_result.logprob */
    int32_t n_logprobs;       /* 0..PD_SAMPLER_MAX_LOGPROBS alternatives; > 0 implies logprobs */
} pd_sampler_params;

typedef struct pd_token_logprob {
    pd_token token;
    float logprob;
} pd_token_logprob;

typedef struct pd_sample_result {
    pd_token token;
    bool has_logprob;  /* params.logprobs or n_logprobs > 0 */
    float logprob;     /* of `token`, see above; 0 when !has_logprob */
    int32_t n_top;     /* min(n_logprobs, tokens with a finite logprob) */
    pd_token_logprob top[PD_SAMPLER_MAX_LOGPROBS]; /* most likely first; equal
                          logprobs by lowest id. The chosen token is in it only
                          if it is among the n_top most likely. */
} pd_sample_result;

typedef struct pd_sampler pd_sampler;

/* temperature 1, no truncation, no penalties, no bias, random seed,
 * penalty_last_n 64, no logprobs. */
pd_sampler_params pd_sampler_params_default(void);
/* Check every parameter against n_vocab. The message names the parameter
 * (OpenAI / llama.cpp spelling: "temperature", "top_p", "logit_bias", ...). */
int pd_sampler_params_validate(const pd_sampler_params *p, int32_t n_vocab, pd_error *err);

/* Validate, copy the params (logit_bias included) and size the scratch. */
int pd_sampler_create(const pd_sampler_params *p, int32_t n_vocab, pd_sampler **out,
                      pd_error *err);
void pd_sampler_free(pd_sampler *s);
/* Forget the history (penalty counts) and restart the generator from the
 * seed, so the sampler behaves as if just created. */
void pd_sampler_reset(pd_sampler *s);

/* Add a token to the history. Call it for every prompt token (generated =
 * false; they feed only the repetition penalty) and for every token the
 * sequence actually generated (generated = true; usually the one sample
 * returned), in order. Sample does not accept on its own. PD_EINVAL for an
 * id outside [0, n_vocab). */
int pd_sampler_accept(pd_sampler *s, pd_token token, bool generated, pd_error *err);
int pd_sampler_accept_many(pd_sampler *s, const pd_token *tokens, size_t n, bool generated,
                           pd_error *err);

/* Pick the next token from n_vocab logits (not modified). PD_ERANGE when a
 * logit is NaN or +inf, or when every token is banned (all -inf). */
int pd_sampler_sample(pd_sampler *s, const float *logits, pd_sample_result *out, pd_error *err);

/* The adjusted logits (bias and penalties applied: steps 1-2) into out
 * (n_vocab floats), for inspection and tests. */
void pd_sampler_adjust(const pd_sampler *s, const float *logits, float *out);

/* The seed in use (the drawn one for PD_SAMPLER_SEED_RANDOM), so a run can
 * be reproduced. */
uint64_t pd_sampler_seed(const pd_sampler *s);
int32_t pd_sampler_n_vocab(const pd_sampler *s);
/* The params as copied at creation (logit_bias points into the sampler). */
const pd_sampler_params *pd_sampler_params_of(const pd_sampler *s);

/* ------------------------------------------------------------------------
 * Stop sequences
 *
 * Stop strings are matched on the decoded bytes, across token boundaries.
 * Feed each token's piece (pd_token_to_piece bytes); each call says which
 * bytes are safe to show now. Bytes are held back while they could still be
 * the start of a stop string, and an incomplete UTF-8 character at the end
 * is held back until it completes, so a chunk never ends inside a
 * character. The stream stops at the first stop string occurrence to be
 * complete (earliest end in the text; on a tie the earliest start, then the
 * first listed), as soon as it is complete: the text ends right before it
 * and the stop string itself is never emitted. The result does not depend
 * on how the text is cut into pieces. pd_stop_finish flushes what is held
 * (also a trailing incomplete character: the stream is over).
 *
 * Concatenating every emitted chunk gives exactly the fed bytes, cut right
 * before that stop string (or all of them when none matched); the emitted
 * text never contains a whole stop string.
 * ------------------------------------------------------------------------ */

#define PD_STOP_MAX_STRINGS 64 /* OpenAI allows 4 */
#define PD_STOP_MAX_LEN 1024   /* bytes per stop string */

typedef struct pd_stop_matcher pd_stop_matcher;

typedef struct pd_stop_result {
    const char *text; /* bytes to emit now; valid until the next call on the matcher */
    size_t len;
    bool matched;     /* a stop string matched: the stream is over */
    int32_t stop_index; /* which one, -1 if none */
} pd_stop_result;

/* n stop strings; lens may be NULL (then they are NUL-terminated). Strings
 * are copied. n may be 0 (only UTF-8 holding). Empty strings, more than
 * PD_STOP_MAX_STRINGS strings, or longer than PD_STOP_MAX_LEN: PD_EINVAL
 * naming "stop". */
int pd_stop_create(const char *const *stops, const size_t *lens, size_t n,
                   pd_stop_matcher **out, pd_error *err);
void pd_stop_free(pd_stop_matcher *m);
void pd_stop_reset(pd_stop_matcher *m);
/* Feed bytes. After a match, further feeds emit nothing and report the
 * match again. */
int pd_stop_feed(pd_stop_matcher *m, const char *bytes, size_t len, pd_stop_result *out,
                 pd_error *err);
/* End of stream: emit everything held (nothing after a match). */
void pd_stop_finish(pd_stop_matcher *m, pd_stop_result *out);
/* Bytes currently held back. */
size_t pd_stop_held(const pd_stop_matcher *m);

/* ------------------------------------------------------------------------
 * Generation: stop strings + end-of-generation tokens + max_tokens
 *
 * Turns the stream of sampled tokens into the text to send and the finish
 * reason. For each sampled token, in order:
 *   - an end-of-generation token (pd_tokenizer_is_eog), unless ignore_eos:
 *     finish "stop"; its text is not emitted; held bytes are flushed;
 *   - otherwise its piece (control tokens rendered only when `special`) goes
 *     through the stop matcher; a match finishes with "stop";
 *   - then, if max_tokens tokens have been pushed, finish "length" and
 *     flush.
 * Every pushed token counts towards max_tokens and pd_generation_n_tokens
 * (the EOG token included).
 * ------------------------------------------------------------------------ */

typedef enum pd_finish_reason {
    PD_FINISH_NONE = 0,   /* still generating */
    PD_FINISH_STOP = 1,   /* EOG token or stop string: "stop" */
    PD_FINISH_LENGTH = 2, /* max_tokens reached: "length" */
} pd_finish_reason;

/* "stop", "length"; NULL for PD_FINISH_NONE (JSON null). */
const char *pd_finish_reason_name(pd_finish_reason r);

typedef struct pd_generation_params {
    int32_t max_tokens;      /* > 0; tokens this request may generate */
    const char *const *stop; /* stop strings (NUL-terminated), may be NULL */
    size_t n_stop;
    bool ignore_eos;         /* keep going past EOG tokens (benchmarks) */
    bool special;            /* render control tokens' text (default false) */
} pd_generation_params;

typedef struct pd_generation pd_generation;

typedef struct pd_generation_step {
    const char *text;        /* bytes to send for this token; valid until the next call */
    size_t len;
    pd_finish_reason finish; /* PD_FINISH_NONE while more tokens may follow */
    int32_t stop_index;      /* the stop string that matched, else -1 */
    bool eog;                /* this token was an end-of-generation token */
} pd_generation_step;

/* The tokenizer must outlive the generation. */
int pd_generation_create(const pd_tokenizer *tok, const pd_generation_params *p,
                         pd_generation **out, pd_error *err);
void pd_generation_free(pd_generation *g);
/* Push one sampled token. PD_EINVAL after the generation has finished or
 * for an invalid id. */
int pd_generation_push(pd_generation *g, pd_token token, pd_generation_step *out, pd_error *err);
/* Finish early (client gone, context full): flush held bytes; the finish
 * reason becomes `reason` (normally PD_FINISH_LENGTH) unless already set. */
void pd_generation_finish(pd_generation *g, pd_finish_reason reason, pd_generation_step *out);
int32_t pd_generation_n_tokens(const pd_generation *g);
pd_finish_reason pd_generation_finish_reason(const pd_generation *g);

#ifdef __cplusplus
}
#endif
#endif
