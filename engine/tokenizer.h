/* engine/tokenizer.h: Tokenizers built from a GGUF file's tokenizer.ggml.* metadata.
 * Part of engine's public contract (engine/engine.h includes every part). */
#ifndef PD_ENGINE_TOKENIZER_H
#define PD_ENGINE_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/gguf.h"

#ifdef __cplusplus
extern "C" {
#endif

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

/* The bytes of ids rendered piece by piece (pd_token_to_piece with
 * `special`; nothing stripped, no clean-up of spaces) and where each piece
 * starts: (*offsets_out)[i] is token i's first byte, (*offsets_out)[n] the
 * total length. Unlike pd_detokenize's output every byte belongs to exactly
 * one token, so a byte range of the text maps back to the tokens that
 * overlap it (phrase whitelists, sentence boundaries). For SPM and
 * byte-level BPE the text is the tokenized text (SPM: after the space it
 * puts in front); WordPiece renders its normalised form. *out is
 * NUL-terminated; both arrays are malloc'd. Invalid ids give PD_EINVAL. */
int pd_detokenize_offsets(const pd_tokenizer *t, const pd_token *ids, size_t n, bool special, char **out,
                          size_t *len_out, size_t **offsets_out, pd_error *err);

#ifdef __cplusplus
}
#endif
#endif
