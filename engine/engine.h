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

/* Open and validate a GGUF v2/v3 file. */
int pd_gguf_open(const char *path, pd_gguf **out, pd_error *err);
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
uint32_t pd_gguf_arr_u32(const pd_gguf_value *arr, uint64_t i);
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

#ifdef __cplusplus
}
#endif
#endif
